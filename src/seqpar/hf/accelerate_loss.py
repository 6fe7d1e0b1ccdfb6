"""``outputs.loss`` of a model prepared by ``seqpar.hf.Accelerator``: from ``shift_labels``, exact over shards.

Forward hooks on the model (documented ``nn.Module`` extension points); see Note [loss under seqpar.hf.Accelerator].

Note [loss under seqpar.hf.Accelerator]
    accelerate's guides call the model with ``labels`` and ``shift_labels`` and read ``outputs.loss``. A
    seqpar-prepared model refuses ``labels`` (it would shift them inside a shard), so a hook put in front of
    seqpar's takes ``labels``, ``shift_labels`` (and, inside ``maybe_context_parallel``, ``attention_mask``)
    out of the call, and a forward hook adds the loss to the output, computed in float32 from the logits:

    - sequence parallel (``sp_size``, the batches are shards): this rank's mean over its valid tokens, as
      transformers computes it from ``shift_labels``, except that a shard with no valid token gives 0, not
      NaN. The guide's differentiable all-gather then weights each rank's mean by its count; its backward
      sums over the SP ranks, so each rank's gradient is ``sp_size x (its token-loss sum) / (group count)``
      and DDP's average over the ``dp x sp`` processes gives, at dp 1, exactly one process's gradient of
      the batch's token mean (at dp > 1 the average of the replicas' token means, as upstream defines it).
    - context parallel (``cp_size``, inside ``maybe_context_parallel``): this rank's *share*,
      ``cp_size x (its token-loss sum) / (valid tokens of the whole sequence)`` (one all-reduce of a count
      over the CP group). A plain per-shard mean averaged over ranks is not the token mean when shards hold
      different numbers of valid tokens (the last one loses a token to the shift; packed documents and
      padding lose more); the shares average, over the CP ranks, to exactly the token mean, so
      ``dist.all_reduce(loss, AVG, group=dp_cp)`` logs one process's loss and DDP's average over the
      processes gives one process's gradient (at dp > 1: the average of the replicas' token means).
    - context parallel outside the block: the model holds whole sequences and the loss is their mean.

    Inside the block, ``attention_mask`` is dropped after checking, on the gathered mask, that it pads on
    the right only (causal attention never lets a real token see later padding; ``shift_labels`` must
    ignore padding, as collators do). Missing ``position_ids`` are the layout's shard of ``0..S-1``.
"""

from __future__ import annotations

import torch

from seqpar.data import IGNORE_INDEX
from seqpar.errors import SeqparInputError
from seqpar.loss import cross_entropy
from seqpar.mesh import SequenceParallelMesh
from seqpar.sequence_parallel.layouts.chunks import gather_sequence, shard_sequence

SHIFT_FIRST = (
    "the batch has labels but no shift_labels, and this rank holds a shard of the sequence: labels shifted inside "
    "a shard lose the token at each shard's edge. Shift them before sharding and pass shift_labels (a "
    "maybe_context_parallel buffer), as accelerate's context-parallel guide says"
)


class ShardLoss:
    """The hooks of Note [loss under seqpar.hf.Accelerator] for one prepared model.

    Attributes:
        sharded: True when every call holds a shard (sequence parallel: the loader yields shards).
        block: the mesh of the ``maybe_context_parallel`` block running now, or None.
        layout: the layout of the shards.
    """

    def __init__(self, model: torch.nn.Module, *, sharded: bool, layout: str = "zigzag") -> None:
        self.sharded, self.block, self.layout = sharded, None, layout
        self._pending: list[torch.Tensor | None] = []
        self.handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True, prepend=True),
            model.register_forward_hook(self._after, with_kwargs=True),
        ]

    def _before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        labels, shift = kwargs.pop("labels", None), kwargs.pop("shift_labels", None)
        block = self.block
        if shift is None and labels is not None:
            if self.sharded or block is not None:
                raise SeqparInputError(SHIFT_FIRST)
            shift = torch.full_like(labels, IGNORE_INDEX)  # a whole sequence: shift it as transformers does
            shift[..., :-1] = labels[..., 1:]
        if block is not None:
            _drop_right_padding(kwargs, block, self.layout)
            if kwargs.get("position_ids") is None and kwargs.get("input_ids") is not None:
                ids = kwargs["input_ids"]
                whole = torch.arange(ids.shape[1] * block.sp_size, device=ids.device).expand(ids.shape[0], -1)
                kwargs["position_ids"] = shard_sequence(whole, block, dim=1, layout=self.layout).contiguous()
        self._pending.append(shift)
        return args, kwargs

    def _after(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: object) -> object:
        shift = self._pending.pop() if self._pending else None
        logits = getattr(output, "logits", None)
        if shift is None or logits is None:
            return output
        block = self.block
        if block is not None:
            loss = cross_entropy(logits, shift, block.sp_group) * block.sp_size
        else:
            loss = cross_entropy(logits, shift)
        fields = {k: v for k, v in output.items() if k != "loss"}
        return type(output)(loss=loss, **fields)

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self.handles:
            handle.remove()


def _drop_right_padding(kwargs: dict, block: SequenceParallelMesh, layout: str) -> None:
    mask = kwargs.pop("attention_mask", None)
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        shape = getattr(mask, "shape", type(mask))
        raise SeqparInputError(f"attention_mask must be a [batch, seq] padding mask, got {shape}")
    with torch.no_grad():
        keep = gather_sequence(mask, block, dim=1, layout=layout) != 0  # the same on every rank
    if bool((keep[:, 1:] & ~keep[:, :-1]).any()):
        raise SeqparInputError(
            "attention_mask has padding before real tokens; under context parallelism seqpar takes right padding "
            "only (packed documents: position_ids restarting at 0, no attention_mask)"
        )
