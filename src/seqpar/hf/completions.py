"""Prompt + completion rows as sequence shards, and per-completion-token values moved between shards and rows.

Used by ``SequenceParallelGRPOTrainer`` to score completions on the split sequence (Note [completion rows]).

Note [completion rows]
    TRL holds a generation batch as left-padded prompts ``[B, P]`` beside right-padded completions ``[B, C]``
    and runs the model on their concatenation with an attention mask. seqpar's attention takes right padding
    only, so each row is rebuilt as its real prompt tokens followed by its real completion tokens, then right
    padding: the tokens every real token attends to are the same (causal attention over the real tokens), and
    the positions start at 0 as they did when the completion was generated (RoPE scores depend on position
    differences only, so this equals TRL's forward up to float rounding). The label of position ``t`` is the
    completion token ``j`` it predicts (``t = prompt length - 1 + j``), and every other label is ignored, so
    ``shard_batch`` gives each rank the completion tokens its shard predicts. ``column`` (sharded alike) says
    which completion token ``j`` each local position predicts (-1: none), so per-token values of TRL's ``[B, C]``
    layout (old and reference log-probabilities) are read into the shard, and shard values written back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from seqpar.data import IGNORE_INDEX, shard_batch
from seqpar.errors import SeqparInputError
from seqpar.mesh import SequenceParallelMesh
from seqpar.sequence_parallel.comm.collectives import collective_device
from seqpar.sequence_parallel.layouts.chunks import Layout, layout_row, shard_for_rank


class CompletionShard(dict):
    """This rank's shard of prompt + completion rows: ``input_ids``, ``position_ids``, ``shift_labels``, ``column``.

    ``layout`` is the layout the rows were sharded with (a ``ChunkLayout`` under "balanced").
    """

    layout: Layout = "zigzag"


def _rows(prompt_ids, prompt_mask, completion_ids, completion_mask, pad_id: int):
    """Whole rows ``[B, S]``: ids, completion labels and the completion column each position predicts."""
    prompts = [ids[m.bool()] for ids, m in zip(prompt_ids, prompt_mask)]
    lengths = completion_mask.sum(-1).tolist()
    if bool((completion_mask[:, 1:] > completion_mask[:, :-1]).any()):
        raise SeqparInputError("a completion mask with holes (tool masks): seqpar scores contiguous completions only")
    if any(p.numel() == 0 for p in prompts):
        raise SeqparInputError("an empty prompt: the first completion token would have no position to predict it")
    width = max(p.numel() + n for p, n in zip(prompts, lengths))
    b, device = len(prompts), completion_ids.device
    ids = torch.full((b, width), pad_id, dtype=torch.long, device=device)
    labels = torch.full_like(ids, IGNORE_INDEX)
    column = torch.full_like(ids, -1)
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        start = p.numel()
        ids[i, :start] = p
        ids[i, start : start + n] = completion_ids[i, :n]
        labels[i, start - 1 : start - 1 + n] = completion_ids[i, :n]
        column[i, start - 1 : start - 1 + n] = torch.arange(n, device=device)
    return ids, labels, column


def completion_shard(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    mesh: SequenceParallelMesh,
    *,
    layout: Layout = "zigzag",
    pad_id: int = 0,
) -> CompletionShard:
    """This rank's shard of TRL's prompt + completion rows (Note [completion rows]); no communication.

    Args:
        prompt_ids: ``[B, P]`` left-padded prompts (the same on every rank of the SP group).
        prompt_mask: ``[B, P]`` 1 on prompt tokens.
        completion_ids: ``[B, C]`` right-padded completions.
        completion_mask: ``[B, C]`` 1 on the completion tokens that are scored (a prefix of each row).
        mesh: the sequence-parallel mesh.
        layout: the layout the model was prepared with ("balanced": this batch's own).
        pad_id: the token that fills the padding.

    Returns:
        A ``CompletionShard`` of ``[B, S'/P]`` tensors; ``shift_labels`` holds the completion token each local
        position predicts and ``column`` its index in the completion (-1 elsewhere).

    Raises:
        SeqparInputError: an empty prompt, a completion mask that is not a prefix of the row.
    """
    ids, labels, column = _rows(prompt_ids, prompt_mask, completion_ids, completion_mask, pad_id)
    # "auto" pads as "balanced", which it is here: prompt + completion rows hold one document each (Note [placed
    # layout]); a layout that reorders the row is refused (the column would have to be placed alike)
    multiple = layout_row(layout).pad_multiple(mesh.sp_size)
    pad = -ids.shape[1] % multiple
    if pad:  # padded here, not by shard_batch, so that the column is padded alike
        ids = torch.cat([ids, ids.new_full((ids.shape[0], pad), pad_id)], dim=1)
        labels = torch.cat([labels, labels.new_full((ids.shape[0], pad), IGNORE_INDEX)], dim=1)
        column = torch.cat([column, column.new_full((ids.shape[0], pad), -1)], dim=1)
    sharded = shard_batch({"input_ids": ids, "shift_labels": labels}, mesh, layout=layout, pad_token_id=pad_id)
    shard = CompletionShard({k: sharded[k] for k in ("input_ids", "position_ids", "shift_labels")})
    shard["column"] = shard_for_rank(column, mesh.sp_rank, mesh.sp_size, 1, sharded.layout)
    shard.layout = sharded.layout
    return shard


def from_completions(values: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    """Per-completion-token values ``[B, C]`` read into the shard's positions ``[B, L]`` (0 where none).

    Args:
        values: TRL's ``[B, C]`` per-token tensor (old or reference log-probabilities, ...).
        column: the shard's ``column``.

    Returns:
        ``[B, L]``: ``values[b, column[b, l]]``, 0 where ``column`` is -1.
    """
    picked = values.gather(1, column.clamp(min=0))
    return picked.masked_fill(column < 0, 0)


def to_completions(values: torch.Tensor, column: torch.Tensor, width: int, mesh: SequenceParallelMesh) -> torch.Tensor:
    """The shards' per-token values ``[B, L]`` as TRL's whole ``[B, width]`` completions (collective, no grad).

    Every completion token is predicted by exactly one position of one rank: each rank writes its own and
    one all-reduce over the SP group sums the rows together.

    Args:
        values: this rank's ``[B, L]`` values (detached).
        column: the shard's ``column``.
        width: the completions' width ``C``.
        mesh: the sequence-parallel mesh.

    Returns:
        ``[B, width]`` on every rank of the group, 0 where no token is.
    """
    out = values.new_zeros(values.shape[0], width)
    out.scatter_add_(1, column.clamp(min=0), values.detach().masked_fill(column < 0, 0))
    if mesh.sp_group is not None and mesh.sp_size > 1:
        home = out.device
        out = out.to(collective_device(mesh.sp_group))
        dist.all_reduce(out, group=mesh.sp_group)
        out = out.to(home)
    return out
