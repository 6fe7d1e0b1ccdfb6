"""TRL's ``SFTTrainer`` with the sequence split over ranks (needs ``trl``: ``pip install "seqpar[hf]"``).

Packing (``packing=True``, best-fit decreasing) and ``padding_free=True`` keep every document apart: TRL's
collator gives position ids that restart at each document, and seqpar's attention reads documents from them.

Note [SFT metrics over shards]
    ``SFTTrainer`` logs, per micro-batch, the mean entropy of the predicted distribution and the top-1
    accuracy over the tokens that have a label, and the running count of input tokens (``num_tokens``).
    Under seqpar each rank holds the logits of its shard only. Every rank sums over its shard the entropy,
    the correct predictions and the labelled positions, and one all-reduce over the job adds them up: the
    ratios are those of the micro-batch's whole rows over every replica, as one process computes them on
    a batch of ``dp x`` the rows. Input tokens are counted as TRL counts them on the collator's output (the
    attention mask's sum, or the packed row's width), once per replica: the sum over the job divided by
    the ``sp_size`` ranks that share each row.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from trl import SFTTrainer

from seqpar.data import IGNORE_INDEX
from seqpar.hf.batches import StepShards
from seqpar.hf.config import check_sft_arguments
from seqpar.hf.trainer import SequenceParallelMixin
from seqpar.sequence_parallel.comm.collectives import collective_device

INPUT_TOKENS = "num_input_tokens"  # key of a SequenceShard: the raw batch's tokens as TRL counts them
_CHUNK = 4096  # labelled positions whose float32 logits are held at once


def _input_tokens(batch: object) -> int:
    """Tokens of one collator output as ``SFTTrainer`` counts them: the attention mask's sum, or the row width."""
    rows = batch if isinstance(batch, Mapping) else {}  # a dict, or a processor's BatchFeature
    mask = rows.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        return int(mask.sum())
    ids = rows.get("input_ids")
    return int(ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.shape[0] else 0


def token_statistics(logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    """Sums over the labelled positions of a shard: ``[count, entropy, correct top-1]`` in float64.

    Args:
        logits: ``[B, S/P, V]`` this rank's logits.
        shift_labels: ``[B, S/P]`` the labels each position predicts (``-100``: none).

    Returns:
        A float64 tensor of 3 sums (no gradient).
    """
    with torch.no_grad():
        mask = shift_labels != IGNORE_INDEX
        picked, labels = logits[mask], shift_labels[mask]  # [N, V], [N]
        sums = torch.zeros(3, dtype=torch.float64, device=logits.device)
        sums[0] = labels.numel()
        for start in range(0, labels.numel(), _CHUNK):
            x = picked[start : start + _CHUNK].float()
            log_z = torch.logsumexp(x, dim=-1)
            entropy = log_z - (torch.softmax(x, dim=-1) * x).sum(-1)
            sums[1] += entropy.double().sum()
            sums[2] += (x.argmax(-1) == labels[start : start + _CHUNK]).sum()
    return sums


class SequenceParallelSFTTrainer(SequenceParallelMixin, SFTTrainer):
    """``trl.SFTTrainer`` with sequence parallelism; the same constructor plus ``sequence_parallel=``.

    ``per_device_train_batch_size`` counts sequences (or packed rows) per data-parallel replica: the
    ``sp_size`` ranks of a group share them. The loss is the exact token-mean negative log-likelihood of
    the whole optimizer step (completion-only and assistant-only masks are honoured through the labels).
    TRL's training metrics ``entropy``, ``mean_token_accuracy`` and ``num_tokens`` are computed over the
    shards and equal one process's (Note [SFT metrics over shards]).

    Raises:
        SeqparInputError: on every rank, for ``SFTConfig`` options seqpar cannot honour (see
            ``seqpar.hf.config.check_sft_arguments``) and those of the plain Trainer.
    """

    def __init__(self, *args, **kwargs) -> None:
        check_sft_arguments(kwargs.get("args", args[1] if len(args) > 1 else None))
        super().__init__(*args, **kwargs)
        self._aux_share: torch.Tensor | None = None  # the last micro-batch's router loss share, unweighted

    def shard_batches(self, batches: list) -> StepShards:
        """As the mixin's, with each shard also carrying its raw batch's token count (TRL's ``num_tokens``)."""
        step = super().shard_batches(batches)
        for shard, batch in zip(step.shards, batches):
            shard[INPUT_TOKENS] = _input_tokens(batch)
        return step

    def router_loss(self, outputs, shard, num_items_in_batch=None, coefficient=None) -> torch.Tensor | float:
        """The mixin's share weighted with TRL's ``router_aux_loss_coef`` and divided by the accumulation steps,
        as TRL's SFTTrainer weighs its router loss (Note [router loss under the Trainer]); the unweighted share
        is kept for TRL's ``aux_loss`` metric."""
        share = super().router_loss(outputs, shard, num_items_in_batch, self.router_aux_loss_coef)
        self._aux_share = share.detach() / self.router_aux_loss_coef if torch.is_tensor(share) else None
        steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
        return share / steps

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """The mixin's exact loss, and TRL's per-micro-batch metrics over every rank (collective)."""
        shard, num_items_in_batch = self.as_shard(inputs, num_items_in_batch)
        loss, outputs = super().compute_loss(model, shard, return_outputs=True, num_items_in_batch=num_items_in_batch)
        mode = "train" if self.model.training else "eval"
        sums = torch.zeros(5, dtype=torch.float64, device=outputs.logits.device)
        sums[:3] = token_statistics(outputs.logits, shard["shift_labels"])
        sums[3] = shard.get(INPUT_TOKENS, 0)
        aux = self._aux_share
        sums[4] = aux if aux is not None else 0.0
        group = self._world_group()
        if group is not None:
            sums = sums.to(collective_device(group))
            dist.all_reduce(sums, group=group)
        count, entropy, correct, tokens, aux_loss = sums.tolist()
        self._metrics[mode]["entropy"].append(entropy / count if count > 0 else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append(correct / count if count > 0 else 0.0)
        if aux is not None:  # TRL's aux_loss: the micro-batch's load-balancing loss, one process's
            self._metrics[mode]["aux_loss"].append(aux_loss)
        if mode == "train":
            self._total_train_tokens += round(tokens / self.sp_mesh.sp_size)
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        return (loss, outputs) if return_outputs else loss

    def eval_statistics(self, logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
        """Per evaluation batch: the labelled positions, entropy and correct predictions of this rank's shard."""
        return token_statistics(logits, shift_labels)

    def record_eval_statistics(self, per_batch: list[torch.Tensor]) -> None:
        """TRL's eval metrics: the mean over every evaluation batch of each batch's entropy and accuracy."""
        ratios = torch.zeros(3, dtype=torch.float64)
        for count, entropy, correct in (t.tolist() for t in per_batch):
            ratios += torch.tensor([entropy / count if count else 0.0, correct / count if count else 0.0, 1.0])
        group = self._world_group()
        if group is not None:  # each replica's batches are held by its sp_size ranks alike
            ratios = ratios.to(collective_device(group))
            dist.all_reduce(ratios, group=group)
        entropy, accuracy, batches = (ratios / self.sp_mesh.sp_size).tolist()
        self._metrics["eval"]["entropy"].append(entropy / batches if batches else 0.0)
        self._metrics["eval"]["mean_token_accuracy"].append(accuracy / batches if batches else 0.0)
        self._metrics["eval"]["num_tokens"] = [self._total_train_tokens]

    def eval_router_weight(self) -> float:
        """TRL's coefficient, whole: its evaluation calls ``compute_loss`` without ``num_items_in_batch``."""
        return self.router_aux_loss_coef

    def record_eval_router_losses(self, per_batch: list[float]) -> None:
        """TRL's eval ``aux_loss``: the mean over every evaluation batch of each batch's load-balancing loss."""
        if not self.aux_loss_enabled:
            return
        sums = torch.tensor([sum(per_batch), len(per_batch)], dtype=torch.float64)
        group = self._world_group()
        if group is not None:  # each replica's batches are held by its sp_size ranks alike
            sums = sums.to(collective_device(group))
            dist.all_reduce(sums, group=group)
        aux, batches = (sums / self.sp_mesh.sp_size).tolist()
        self._metrics["eval"]["aux_loss"].append(aux / batches if batches else 0.0)
