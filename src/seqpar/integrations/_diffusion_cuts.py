"""The cuts of ``seqpar.prepare_diffusers``: a planned value, a joint-sequence value, and a block's per-token tables.

Each returns this rank's shard in the layout's order; the same shapes on every rank make every rank raise alike.
"""

from __future__ import annotations

import torch

from seqpar.errors import SeqparInputError
from seqpar.integrations._diffusion_attention import WHERE, Region
from seqpar.mesh import SequenceParallelMesh
from seqpar.models.diffusion import FoldedSplit, JointSplit, Split
from seqpar.sequence_parallel.layouts.chunks import shard_sequence


def cut(value: object, split: Split | tuple[Split, ...], sp: SequenceParallelMesh, layout: str, where: str):
    """This rank's shard of one planned value (a tuple of tables cut element-wise); others pass whole."""
    if isinstance(split, tuple):
        if value is None:  # tables the configuration does not make (CogVideoX without rotary embeddings)
            return value
        if not isinstance(value, (list, tuple)) or len(value) != len(split):
            raise SeqparInputError(f"{WHERE}: {where} is not a pair of {len(split)} tensors as the plan expects")
        return type(value)(cut(v, s, sp, layout, where) for v, s in zip(value, split))
    if not isinstance(value, torch.Tensor) or (split.ndim is not None and value.dim() != split.ndim):
        return value
    try:
        return shard_sequence(value, sp, dim=split.dim, layout=layout)
    except SeqparInputError as error:  # the same shapes on every rank (checked), so every rank raises here
        raise SeqparInputError(
            f"{WHERE}: {where} has {value.shape[split.dim]} tokens along dim {split.dim}, which do not divide into "
            f"the {layout} layout over {sp.sp_size} ranks ({error}); choose a latent size (frames x height x width "
            "after patchify) or a text length that does"
        ) from None


def _cut_joint(value: object, split: JointSplit, lengths: list, sp: SequenceParallelMesh, layout: str, where: str):
    """This rank's [part 0 shard; part 1 shard; ...] of a tensor over the joint sequence (``JointSplit``)."""
    if not isinstance(value, torch.Tensor):
        return value
    if any(n is None for n in lengths) or value.shape[split.dim] != sp.sp_size * sum(lengths):
        raise SeqparInputError(
            f"{WHERE}: {where} has {value.shape[split.dim]} tokens along dim {split.dim}, not the joint sequence "
            f"of {' + '.join(split.parts)} ({sp.sp_size} ranks x {lengths} tokens) that the plan cuts it as"
        )
    pieces = value.split([sp.sp_size * n for n in lengths], dim=split.dim)
    return torch.cat([shard_sequence(piece, sp, dim=split.dim, layout=layout) for piece in pieces], dim=split.dim)


def _cut_folded(value: object, split: FoldedSplit, tokens: int | None, sp: SequenceParallelMesh, layout: str, where):
    """This rank's rows of a tensor folding the batch with the whole token sequence (``FoldedSplit``)."""
    if not isinstance(value, torch.Tensor):
        return value
    if tokens is None or value.shape[split.dim] % tokens:
        raise SeqparInputError(
            f"{WHERE}: {where} has {value.shape[split.dim]} rows along dim {split.dim}, not the batch times the "
            f"{tokens} tokens the plan cuts (a batch-major fold of the samples' tokens)"
        )
    folded = value.unflatten(split.dim, (-1, tokens))  # [B, S, ...]
    return shard_sequence(folded, sp, dim=split.dim + 1, layout=layout).flatten(split.dim, split.dim + 1)


def cut_any(value: object, split: object, lengths: list, sp: SequenceParallelMesh, layout: str, where: str):
    """This rank's shard of one planned value; ``lengths``: a ``JointSplit``'s parts' shard lengths, or a
    ``FoldedSplit``'s whole token length."""
    if isinstance(split, FoldedSplit):
        return _cut_folded(value, split, lengths[0] if lengths else None, sp, layout, where)
    if isinstance(split, JointSplit):
        return _cut_joint(value, split, lengths, sp, layout, where)
    return cut(value, split, sp, layout, where)


STREAMS = ("hidden_states", "encoder_hidden_states")  # the tokens (cut once, before the first block) and the text


def _table_cut(value: torch.Tensor, region: Region, where: str) -> Split | JointSplit | None:
    """How to cut one table: along its one dimension as long as the whole token sequence or the whole cut text,
    part by part ([text; tokens], the text first as a joint attention orders its keys) along one as long as both;
    None: it has none."""
    joint = None if region.text is None else region.text + (region.tokens or 0)
    named = {region.tokens: "the token sequence", region.text: "the text", joint: "the joint [text; tokens] sequence"}
    dims = [d for d in range(value.dim()) if value.shape[d] is not None and value.shape[d] in named]
    if dims == [value.dim() - 2, value.dim() - 1] and value.shape[-1] == value.shape[-2] == region.tokens:
        return Split(dims[0])  # a mask over token pairs: its query rows, its key columns whole (Note [gathered keys])
    if len(dims) > 1:
        raise SeqparInputError(
            f"{WHERE}: {where} has dims {list(value.shape)}, more than one as long as {named[value.shape[dims[0]]]} "
            "(a mask over token pairs, or a size that equals it), so the plan derived from the model's structure "
            "cannot tell what to cut; register a plan for the model"
        )
    if not dims:
        return None
    return JointSplit(dims[0]) if value.shape[dims[0]] == joint else Split(dims[0])


def _cut_tables(value: object, region: Region, sp: SequenceParallelMesh, layout: str, where: str) -> object:
    """``value`` with every tensor in it (nested in tuples, lists and dicts: RoPE tables) cut as ``_table_cut``
    says."""
    if isinstance(value, torch.Tensor):
        split = _table_cut(value, region, where) if value.dim() else None
        if split is None:
            return value
        lengths = [region.text // sp.sp_size, region.tokens // sp.sp_size] if isinstance(split, JointSplit) else []
        return cut_any(value, split, lengths, sp, layout, where)
    if isinstance(value, (tuple, list)):
        return type(value)(_cut_tables(v, region, sp, layout, where) for v in value)
    if isinstance(value, dict):
        return {k: _cut_tables(v, region, sp, layout, where) for k, v in value.items()}
    return value


def cut_token_tables(names, args, kwargs, entry, sp, layout, module_name, region) -> None:
    """Cut, in place in ``args`` / ``kwargs``, the module's per-token inputs (``TokenTables``)."""
    if region.tokens is None:
        return
    named = dict(zip(names, range(len(args)))) | {k: k for k in kwargs}
    for name, slot in named.items():
        if name not in STREAMS and name not in entry:
            holder = args if isinstance(slot, int) else kwargs
            holder[slot] = _cut_tables(holder[slot], region, sp, layout, f"{module_name}'s input {name}")
