"""Whole-batch calls of a TRL fused-LM-head model run on this rank's shard, with whole-width per-token outputs.

TRL's preference trainers call ``model(input_ids=..., attention_mask=..., labels=..., fused_lm_head=True)`` and
read per-token fields (``log_probs``, ``entropy``, ...) ``[B, S - 1]``; these hooks run such calls sequence-parallel.

Note [whole-width per-token outputs]
    TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``) returns per-token fields without logits:
    the log-probability of each next-token label and a few statistics, each ``[B, S - 1]``. seqpar hooks
    the model so that such a call, made with the *whole* rows, is turned into this rank's shard before the
    model runs: the labels are shifted on the whole row (Note [labels before sharding]), right padding and
    the prompt are ignored through them, and the model is called with the shard's ``input_ids``,
    ``position_ids`` and ``shift_labels`` (which TRL's head scores without shifting). After the call every
    per-token field is all-gathered over the sequence-parallel group back into the whole row's order
    (``seqpar.gather_sequence``) and cut to ``S - 1`` columns, so the trainer computes its sums, losses and
    metrics from exactly the tensors one process holds. The gather carries no vocabulary dimension: a few
    floats per token, against the activations and key/value exchanges of every layer. Its gradient is
    the adjoint of the all-gather: each rank's shard receives the sum over the group of the gradients every
    rank's (identical) loss gives it, that is ``sp`` times one process's; the data-parallel average over
    ``dp x sp`` processes divides that back, so the loss needs no scaling (Note [DPO over shards]).
"""

from __future__ import annotations

import dataclasses

import torch

from seqpar.data import IGNORE_INDEX
from seqpar.errors import SeqparInputError
from seqpar.hf.batches import model_inputs, to_shard
from seqpar.mesh import SequenceParallelMesh
from seqpar.sequence_parallel.layouts.chunks import gather_sequence

_PASSED_THROUGH = ("fused_lm_head", "use_cache", "output_router_logits")


def shift_completion_labels(input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``labels`` shifted left by one (what each position predicts), ``-100`` in the last column.

    Args:
        input_ids: ``[B, S]`` the whole rows (only its shape is read).
        labels: ``[B, S]`` unshifted labels, ``-100`` where no token is scored (prompt, padding).

    Returns:
        ``[B, S]`` shifted labels, on ``labels``' device.
    """
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, : input_ids.shape[1] - 1] = labels[:, 1:]
    return shifted


@dataclasses.dataclass
class _Pending:
    width: int  # S, the whole rows' width
    layout: object  # the layout the shard was cut with
    shift_labels: torch.Tensor  # this rank's shard of them: identifies the call in the forward hook


class ShardedCalls:
    """Hooks on a seqpar-prepared model that run whole-row fused-LM-head calls on this rank's shard.

    Install with ``ShardedCalls(mesh, layout, seq_length).install(model)`` after ``prepare_model``: the hook
    runs before seqpar's own call check (Note [whole-width per-token outputs]). Calls without
    ``fused_lm_head=True`` and ``labels`` are left alone.
    """

    def __init__(self, mesh: SequenceParallelMesh, layout: str, seq_length: int | None) -> None:
        self.mesh, self.layout, self.seq_length = mesh, layout, seq_length
        self.pending: list[_Pending] = []

    def install(self, model: torch.nn.Module) -> list:
        """Hook ``model`` (collective calls afterwards: every rank of the group must make the same calls).

        Args:
            model: the module TRL calls (the prepared model, or the PEFT model wrapping it).

        Returns:
            The two hook handles.
        """
        return [
            model.register_forward_pre_hook(self._to_shard, with_kwargs=True, prepend=True),
            model.register_forward_hook(self._to_whole, with_kwargs=True),
        ]

    def _to_shard(self, module, args, kwargs):
        if args or not kwargs.get("fused_lm_head") or kwargs.get("labels") is None or "shift_labels" in kwargs:
            return None
        ids, labels, mask = kwargs.pop("input_ids"), kwargs.pop("labels"), kwargs.pop("attention_mask", None)
        unknown = sorted(k for k, v in kwargs.items() if k not in _PASSED_THROUGH and v is not None)
        if unknown:
            raise SeqparInputError(
                f"model inputs {unknown} are not understood by seqpar.hf's preference trainers: the sequence is "
                "split from input_ids, attention_mask and the completion labels only (text models)"
            )
        batch = {"input_ids": ids, "shift_labels": shift_completion_labels(ids, labels)}
        if mask is not None:
            batch["attention_mask"] = mask
        shard = to_shard(batch, self.mesh, layout=self.layout, seq_length=self.seq_length)
        self.pending.append(_Pending(ids.shape[1], shard.get("seqpar_layout") or self.layout, shard["shift_labels"]))
        kwargs.update(model_inputs(shard), shift_labels=shard["shift_labels"], use_cache=False)
        return (), kwargs

    def _to_whole(self, module, args, kwargs, output):
        if not self.pending or kwargs.get("shift_labels") is not self.pending[-1].shift_labels:
            return None
        call = self.pending.pop()
        local = call.shift_labels.shape
        names = [k for k, v in output.items() if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[:2] == local]
        if not names:
            return None
        # one all-gather for every per-token field; only log_probs carries a gradient
        stacked = torch.stack([output[k] if k == "log_probs" else output[k].detach().float() for k in names])
        whole = gather_sequence(stacked.float(), self.mesh, dim=2, layout=call.layout)[:, :, : call.width - 1]
        fields = {}
        for k, value in zip(names, whole):
            dtype = output[k].dtype
            fields[k] = value > 0.5 if dtype == torch.bool else value.to(dtype)
        if "log_probs" in fields and "label_mask" in fields and output.get("loss") is not None:
            # the head's own loss (the token mean of -log p), now over the whole rows
            fields["loss"] = -fields["log_probs"].sum() / fields["label_mask"].sum().clamp(min=1)
        values = {f.name: getattr(output, f.name) for f in dataclasses.fields(output)}
        return type(output)(**{**values, **fields})
