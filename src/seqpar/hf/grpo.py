"""TRL's ``GRPOTrainer`` with the sequence split over ranks (needs ``trl``: ``pip install "seqpar[hf]"``).

Completions are sampled once per sequence-parallel group with the whole model; scoring and the loss run sharded.

Note [GRPO generation per group]
    Each data-parallel replica is one process of TRL's view (Note [one process per group]): its ``sp_size``
    ranks load the same prompts, and the group's first rank samples their completions with the whole model and
    its own attention (``seqpar.integrations.unsharded``: seqpar's hooks stand aside, so no collective runs
    while one rank generates). It then broadcasts the completions to the group together with its random
    number generator state, so every rank of the group continues with one stream: the one a single process
    seeded with ``seed + replica`` draws (TRL seeds ``seed + process index``). At one replica the group thus
    samples exactly what one process with the same seed samples. A ``rollout_func`` (TRL's generation hook)
    runs the same way, once per group. vLLM is refused: its engines are placed per process.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from accelerate.utils import set_seed
from trl import GRPOTrainer

from seqpar.errors import SeqparInputError
from seqpar.hf.completions import completion_shard, from_completions, to_completions
from seqpar.hf.grpo_checks import check_grpo_arguments, check_grpo_trainer, replica_generation_batch
from seqpar.hf.grpo_loss import ShardGroups, policy_loss, record_metrics
from seqpar.hf.replica_view import ReplicaAccelerator, replica_collectives
from seqpar.hf.trainer import SequenceParallelMixin
from seqpar.integrations.unsharded import unsharded
from seqpar.layouts.chunks import ChunkLayout
from seqpar.sequence_parallel.prepare import LAYOUT_KEYWORD, prepare_model

__all__ = ["SequenceParallelGRPOTrainer"]


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


class SequenceParallelGRPOTrainer(SequenceParallelMixin, GRPOTrainer):
    """``trl.GRPOTrainer`` with sequence parallelism; the same constructor plus ``sequence_parallel=``.

    ``per_device_train_batch_size`` counts completions per data-parallel replica (the ``sp_size`` ranks of
    a group share them) and the generation batch is ``per_device_train_batch_size x replicas x
    steps_per_generation``. Completions are sampled once per group with the whole model (Note [GRPO
    generation per group]); rewards and advantages are TRL's, over every replica; log-probabilities, the
    clipped loss of every ``loss_type``, the KL term and the metrics are computed on the shards with TRL's
    normalisations (Note [GRPO over shards]). The logged loss, grad_norm and metrics equal TRL's with one
    process per replica (and one process overall where TRL's normalisation spans every process).

    Raises:
        SeqparInputError: on every rank, for settings seqpar cannot serve (``check_grpo_arguments``: vLLM,
            tools, evaluation, entropy bonus ...) and those of the plain Trainer.
    """

    def __init__(self, *args, sequence_parallel=None, **kwargs) -> None:
        names = list(inspect.signature(GRPOTrainer.__init__).parameters)[1:]
        kwargs.update(zip(names, args))  # by keyword: the mixin finds the arguments under "args"
        check_grpo_arguments(kwargs.get("args"), kwargs)  # before TRL starts vLLM or anything collective
        replica_generation_batch(kwargs.get("args"), sequence_parallel)
        super().__init__(sequence_parallel=sequence_parallel, **kwargs)
        check_grpo_trainer(self)
        config = self.sequence_parallel
        if self.ref_model is not None:
            reference = self.accelerator.unwrap_model(self.ref_model)
            prepare_model(reference, self.sp_mesh, strategy=config.strategy, layout=config.layout, kernel=config.kernel)
        mesh = self.sp_mesh.device_mesh
        dp_group = mesh.get_group("dp") if self.dp_size > 1 else None
        self.shard_groups = ShardGroups(
            self.sp_mesh.sp_group,
            self.sp_mesh.sp_size,
            self.sp_mesh.sp_rank,
            dp_group,
            self.dp_size,
            self._world_group(),
        )
        self.replica_accelerator = ReplicaAccelerator(self.accelerator, dp_group, self.dp_size, self.dp_rank)
        if self.rollout_func is not None:
            user_rollout = self.rollout_func
            self.rollout_func = lambda prompts, trainer: self.once_per_group(lambda: user_rollout(prompts, trainer))
        set_seed(self.args.seed + self.dp_rank)  # TRL's device-specific seed, one per replica (Note [GRPO ...])

    # ---- generation (Note [GRPO generation per group], Note [one process per group]) ----

    def once_per_group(self, sample):
        """``sample()`` on the group's first rank with the model's own attention; its result on every rank.

        Args:
            sample: a function of no argument returning something picklable (completions).

        Returns:
            What ``sample()`` returned on the group's first rank; every rank continues with its RNG state.

        Raises:
            SeqparInputError: on the other ranks of the group when ``sample`` raised on the first.
        """
        mesh = self.sp_mesh
        if mesh.sp_size == 1:
            with unsharded(self.model):
                return sample()
        payload: list = [None]
        if mesh.sp_rank == 0:
            try:
                with unsharded(self.model):
                    payload = [(sample(), _rng_state(), None)]
            except Exception as error:  # the group must hear of it, or it would wait in the broadcast
                dist.broadcast_object_list([(None, None, repr(error))], src=dist.get_rank(), group=mesh.sp_group)
                raise
        leader = dist.get_process_group_ranks(mesh.sp_group)[0]
        dist.broadcast_object_list(payload, src=leader, group=mesh.sp_group)
        result, state, error = payload[0]
        if error is not None:
            raise SeqparInputError(f"sampling completions failed on rank {leader} of this group: {error}")
        if mesh.sp_rank != 0:
            _set_rng_state(state)
        return result

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's sampling, run once per sequence-parallel group (Note [GRPO generation per group])."""
        parent = super()._generate_single_turn
        return self.once_per_group(lambda: parent(prompt_ids, images, multimodal_fields, num_generations))

    def _generate_and_score_completions(self, inputs):
        """TRL's generation, rewards and advantages, each group acting as one process (Note [one process ...])."""
        with replica_collectives(self, self.replica_accelerator, GRPOTrainer.__module__):
            return super()._generate_and_score_completions(inputs)

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """The Trainer's own: GRPO's batches are prompts, sharded only once completions exist."""
        return GRPOTrainer.get_batch_samples(self, epoch_iterator, num_batches, device)

    # ---- log-probabilities on shards (Note [completion rows]) ----

    def _shard_logps(self, model, shard, compute_entropy: bool):
        """Per-position log-probabilities (and entropies) of the completion tokens this rank's shard predicts."""
        call = {k: shard[k] for k in ("input_ids", "position_ids", "shift_labels")}
        if isinstance(shard.layout, ChunkLayout):
            call[LAYOUT_KEYWORD] = shard.layout
        with self.accelerator.autocast():
            out = model(**call, fused_lm_head=True)
        return out.log_probs, (out.entropy if compute_entropy else None)

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **others
    ):
        """TRL's ``[B, C]`` log-probabilities of the completions, computed on shards (collective; no gradient)."""
        if torch.is_grad_enabled():
            raise SeqparInputError("whole-row log-probabilities are gathered without gradient; use compute_loss")
        prompt = input_ids.shape[1] - logits_to_keep
        shard = completion_shard(
            input_ids[:, :prompt], attention_mask[:, :prompt], input_ids[:, prompt:], attention_mask[:, prompt:],
            self.sp_mesh, layout=self.sequence_parallel.layout, pad_id=self._tokenizer.pad_token_id,
        )  # fmt: skip
        logps, entropies = self._shard_logps(model, shard, compute_entropy)
        full = [
            to_completions(x, shard["column"], logits_to_keep, self.sp_mesh)
            for x in (logps, entropies)
            if x is not None
        ]
        return full[0], (full[1] if compute_entropy else None), None

    # ---- loss (Note [GRPO over shards]) ----

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """This rank's share of TRL's GRPO loss, scaled for DDP's average over every rank (collective).

        Args:
            model: the (wrapped) prepared model.
            inputs: one micro-batch of TRL's scored completions (the same on every rank of the group).
            return_outputs: not supported (as in TRL).
            num_items_in_batch: unused (TRL's normaliser travels in ``inputs``).

        Returns:
            The loss tensor.
        """
        if return_outputs:
            raise ValueError("The GRPOTrainer does not support returning outputs")
        training = self.model.training
        shard = completion_shard(
            inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"], inputs["completion_mask"],
            self.sp_mesh, layout=self.sequence_parallel.layout, pad_id=self._tokenizer.pad_token_id,
        )  # fmt: skip
        logps, entropies = self._shard_logps(model, shard, compute_entropy=True)
        column = shard["column"]
        mask = (column >= 0).to(logps.dtype)
        adv = inputs["advantages"]
        adv = adv.unsqueeze(1) if adv.dim() == 1 else from_completions(adv, column)
        tensors = {
            "logps": logps,
            "entropies": entropies,
            "mask": mask,
            "adv": adv,
            "row_tokens": inputs["completion_mask"].sum(-1).to(logps.dtype),
            "num_items": inputs["num_items_in_batch"],
            "old": from_completions(inputs["old_per_token_logps"], column) if "old_per_token_logps" in inputs else None,
            "ref": from_completions(inputs["ref_per_token_logps"], column) if self.beta != 0.0 else None,
        }
        if self.top_entropy_quantile < 1.0:  # TRL's quantile over every rank's tokens: the shards partition them
            tensors["entropy_mask"] = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
        loss, parts = policy_loss(self, tensors, self.shard_groups, training)
        record_metrics(self, "train" if training else "eval", parts, tensors, self.shard_groups)
        return loss * self.sp_mesh.sp_size  # DDP averages over every rank; TRL's processes are the replicas
