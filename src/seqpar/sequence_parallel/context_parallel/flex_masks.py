"""Whole-sequence FlexAttention BlockMasks as seqpar masks: documents and a window where they are, else blockwise.

``flex_mode`` asks once per batch and mask; the strategies then run the ``SequenceMask`` it gets.

Note [flex masks recognised]
    A BlockMask is first read as a ``BlockwiseMask`` (Note [blockwise masks]). When it shows nothing above
    the diagonal, seqpar tries the masks it knows: causal attention inside packed documents, with or
    without a sliding window (torchtitan's document mask, its sliding-window layers, chunked attention,
    which is documents of equal length). Candidate: a query that does not see the token just before it
    starts a document (the first token does), which gives every token's document start, and the window is
    the number of keys a query sees where that is below its document's length so far. The candidate is
    then checked against FlexAttention's meaning of the mask everywhere, exactly: every EMPTY block must be
    a skipped tile of the candidate and every FULL block a wholly visible one (the corner rules of Note
    [masked tiles] are exact for one batch row, so each row is checked on its own), and inside every
    PARTIAL block the ``mask_mod`` is evaluated and compared pair by pair. Only a candidate that agrees on
    every pair replaces the blockwise mask; it then runs as any ``seqpar.sequence_mask`` does (tiles cut
    at document starts, fused kernels for whole tiles, and the mask-aware exchanges that send only the keys
    a rank's queries can see, Note [mask-aware ring]). The cost is one evaluation of each PARTIAL block
    and of a band along the diagonal, once per batch and mask, on top of the blockwise plan's own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.attention import flex_attention as torch_flex

from seqpar.sequence_parallel.masks.blockwise import EMPTY, FULL_BLOCK, PARTIAL, BlockwiseMask
from seqpar.sequence_parallel.masks.sequence_mask import SequenceMask
from seqpar.sequence_parallel.tiling.tiles import FULL, SKIP, tile_kinds


def _block_kinds(m: torch_flex.BlockMask, lengths: tuple[int, int]) -> torch.Tensor:
    """``[B, nQ, nK]`` int8 ``EMPTY`` / ``PARTIAL`` / ``FULL_BLOCK`` table of a BlockMask (head 0), on the CPU."""
    n_q, n_k = (-(-n // b) for n, b in zip(lengths, m.BLOCK_SIZE))
    kinds = torch.full((m.kv_num_blocks.shape[0], n_q, n_k), EMPTY, dtype=torch.int8)

    def mark(num: torch.Tensor | None, indices: torch.Tensor | None, kind: int) -> None:
        if num is None:
            return
        num, indices = num[:, 0, :n_q].long().cpu(), indices[:, 0, :n_q].long().cpu()  # [B, nQ], [B, nQ, K]
        listed = torch.arange(indices.shape[-1])[None, None] < num[..., None]
        b, q, slot = listed.nonzero(as_tuple=True)
        kinds[b, q, indices[b, q, slot]] = kind

    mark(m.kv_num_blocks, m.kv_indices, PARTIAL)
    mark(m.full_kv_num_blocks, m.full_kv_indices, FULL_BLOCK)
    return kinds


def _broadcast(mask_mod: Callable, rows: int, q: tuple[int, int], kv: tuple[int, int], device) -> torch.Tensor:
    """``mask_mod`` called once on broadcast index grids: ``[rows, q, kv]`` bool (elementwise mask_mods)."""
    index = dict(dtype=torch.int32, device=device)
    b = torch.arange(rows, **index)[:, None, None]
    q_idx, kv_idx = torch.arange(*q, **index)[None, :, None], torch.arange(*kv, **index)[None, None, :]
    seen = mask_mod(b, torch.zeros((), **index), q_idx, kv_idx)
    return torch.as_tensor(seen, device=device).bool().expand(rows, q[1] - q[0], kv[1] - kv[0])


def blockwise_mask(
    block_mask: torch_flex.BlockMask,
    batch: int,
    mask_mod: Callable | None = None,
    lengths: tuple[int, int] | None = None,
) -> BlockwiseMask:
    """The ``BlockwiseMask`` (Note [blockwise masks]) of a whole-sequence BlockMask, for ``batch`` query rows.

    Each masked tile is evaluated by one call of the mask_mod on broadcast index grids, once it has given
    ``create_mask``'s answer (torch's vmap over every index) on the first tile; otherwise by ``create_mask``.

    Args:
        block_mask: built with ``create_block_mask`` on the whole sequence.
        batch: the query batch size (flex calls the mask_mod per query row when the mask has one row).
        mask_mod: its ``mask_mod`` over global indices (default: ``block_mask.mask_mod``).
        lengths: its whole-sequence ``(Q_LEN, KV_LEN)`` (default: ``block_mask.seq_lengths``).

    Returns:
        Its block table (head 0) and the rule inside partial blocks.
    """
    m = block_mask
    mask_mod = m.mask_mod if mask_mod is None else mask_mod
    lengths = tuple(m.seq_lengths) if lengths is None else lengths
    device = m.kv_num_blocks.device
    rows = batch if m.kv_num_blocks.shape[0] == 1 else m.kv_num_blocks.shape[0]
    fast: list[bool] = []  # decided on the first tile: whether the broadcast call gives create_mask's answer

    def exact(q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        def shifted(b, h, q_idx, kv_idx):
            return mask_mod(b, h, q_idx + q0, kv_idx + k0)

        return torch_flex.create_mask(shifted, rows, 1, q1 - q0, k1 - k0, device=device)[:, 0]

    def evaluate(q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        if fast and not fast[0]:
            return exact(q0, q1, k0, k1)
        try:
            seen = _broadcast(mask_mod, rows, (q0, q1), (k0, k1), device)
        except Exception:  # Python control flow on index values, or a shape broadcasting cannot give
            seen = None
        if not fast:
            reference = exact(q0, q1, k0, k1)
            fast.append(seen is not None and seen.shape == reference.shape and torch.equal(seen, reference))
            return reference
        return seen if seen is not None else exact(q0, q1, k0, k1)

    return BlockwiseMask(lengths[0], tuple(m.BLOCK_SIZE), _block_kinds(m, lengths), evaluate)


def _bounds(length: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    lo = torch.arange(0, length, block)
    return lo, torch.clamp(lo + block, max=length) - 1


def _documents(whole: BlockwiseMask) -> torch.Tensor | None:
    """``[R, S]`` candidate document starts from the band along the diagonal, or None if a token is blind
    to itself."""
    length, (bq, _) = whole.length, whole.block
    new_rows = []
    for q0 in range(0, length, bq):
        q1, k0 = min(q0 + bq, length), max(q0 - 1, 0)
        band = whole.dense((q0, q1), (k0, q1))[:, 0]  # [R, q, k]
        i = torch.arange(q0, q1)
        if not band[:, i - q0, i - k0].all():
            return None
        new_rows.append(~band[:, i - q0, (i - 1 - k0).clamp(min=0)])
    new = torch.cat(new_rows, dim=1)  # [R, S]: a document starts here
    new[:, 0] = True
    index = torch.arange(length).expand_as(new)
    return torch.where(new, index, 0).cummax(dim=1).values


def recognise(whole: BlockwiseMask) -> SequenceMask | None:
    """Causal documents and a window equal to ``whole`` on every pair (Note [flex masks recognised]), or None.

    Args:
        whole: a blockwise mask that shows nothing above the diagonal (``within_causal``).

    Returns:
        The ``SequenceMask`` to run with ``causal=True``, or None when no such mask is equal to ``whole``.
    """
    starts = _documents(whole)
    if starts is None:
        return None
    rows, length = starts.shape
    (bq, bk), kinds = whole.block, whole.kinds.expand(rows, -1, -1)
    (q_lo, q_hi), (kv_lo, kv_hi) = _bounds(length, bq), _bounds(length, bk)
    width = (kv_hi - kv_lo + 1).long()
    counts = ((kinds == FULL_BLOCK).long() @ width)[:, torch.arange(length) // bq]  # [R, S] keys seen per query
    seen = {}
    for a, c in (kinds == PARTIAL).any(0).nonzero().tolist():
        block = whole.dense((int(q_lo[a]), int(q_hi[a]) + 1), (int(kv_lo[c]), int(kv_hi[c]) + 1))[:, 0]
        seen[a, c] = block.expand(rows, -1, -1)
        partial = (kinds[:, a, c] == PARTIAL)[:, None]  # rows where the block is FULL are counted above
        counts[:, int(q_lo[a]) : int(q_hi[a]) + 1] += seen[a, c].sum(-1) * partial
    index = torch.arange(length)
    whole_doc = index - starts + 1  # keys a query sees without a window
    if (counts > whole_doc).any():
        return None
    short = counts < whole_doc
    window = None
    if short.any():
        windows = counts[short].unique()
        if len(windows) != 1 or (whole_doc[~short] > windows[0]).any():
            return None
        window = int(windows[0])
    packed = bool((starts[:, 1:] == index[1:]).any())
    for b in range(rows):  # Note [masked tiles]: the corner rules are exact for one row
        row = SequenceMask(starts[b : b + 1] if packed else None, window)
        kind = tile_kinds(q_lo, q_hi, kv_lo, kv_hi, True, row)
        if ((kinds[b] == EMPTY) & (kind != SKIP)).any() or ((kinds[b] == FULL_BLOCK) & (kind != FULL)).any():
            return None
    for (a, c), block in seen.items():
        qi = torch.arange(int(q_lo[a]), int(q_hi[a]) + 1)[:, None]
        ki = torch.arange(int(kv_lo[c]), int(kv_hi[c]) + 1)[None]
        rule = (ki <= qi) & (starts[:, qi] == starts[:, ki])  # [R, q, k]
        if window is not None:
            rule &= qi - ki < window
        if not torch.equal(rule, block):
            return None
    return SequenceMask(starts if packed else None, window, int((index - starts).max()))


def sequence_mask_of(whole: BlockwiseMask) -> tuple[SequenceMask, bool]:
    """The ``SequenceMask`` a flex call runs with, and its ``causal`` (Note [flex masks recognised]).

    Args:
        whole: the call's whole-sequence mask.

    Returns:
        ``(documents and window, True)`` where they equal it, else ``(blockwise mask, within_causal)``.
    """
    causal = whole.within_causal()
    known = recognise(whole) if causal else None
    return (known, True) if known is not None else (SequenceMask(predicate=whole), causal)
