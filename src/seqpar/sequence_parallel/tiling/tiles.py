"""Tile geometry of masked plans: the square tiles a rank's runs of chunks are cut into, and each tile's kind.

``plans.planner.plan`` turns them into kernel calls; the layouts' cost models count the same kinds.

Note [masked tiles]
    A ``SequenceMask`` with packed documents, a sliding window or blocks makes visibility depend on more than the
    chunk ids, so the planner cuts the visible part of ``q_chunks x kv_chunks`` into tiles and classifies each.
    Runs: chunks that follow each other both in the local order and in the global order (a rank's home run
    of the placed layout, the one run of a local plan) form one *run*, tiled as one span of tokens, so
    that tiles are not capped at the chunk length (64-token chunks would mean thousands of 64 x 64 calls).
    Cuts: a run is cut at its own ends and at every run end of the other side that falls inside it (so the
    queries' and the keys' tiles share their edges and a diagonal tile is an exact square), at each
    document start common to every batch row (so a tile never straddles two documents: the pair is
    skipped or plain, not masked), and at the ends of block-causal ranges. Each piece between two cuts is
    split evenly into pieces of at most ``tile_size``: ``MASK_TILE`` tokens, or with a window half the
    window (at least ``MIN_WINDOW_TILE``) cut at every multiple of it in the row, so that a query tile meets
    the band's ragged edge in one key tile, not two (even pieces a little under half a window put the edge
    across two tiles, each computed whole). Equal blocks also cut at every multiple of the block size (at
    least ``MIN_WINDOW_TILE``), so that blocks aligned with the grid leave no tile masked. Each tile pair is
    classified from its four corners alone:
    - skipped: nothing in it is visible. Every key comes after every query (causal), the last key lies a
      whole window or more before the first query, or in every batch row the queries' documents and the
      keys' documents are disjoint. It costs nothing.
    - plain: everything in it is visible, so the chosen (fused) kernel runs it with no mask: a full
      rectangle, or a square on the diagonal run as a plain causal call.
    - mixed: anything else. It carries a boolean mask ``[B or 1, 1, q, kv]`` built from the global
      positions and document starts, and runs on the chosen kernel if that takes masks, otherwise on the
      preferred kernel that does (``blocks_forward`` and ``blocks_backward`` swap it per tile).
    Why the corners suffice: causality and the window depend only on the query position minus the key
    position, which over a tile is smallest at (first query, last key) and largest at (last query, first
    key); those two bounds say whether all, none or some of the tile passes. Document starts never decrease
    along the sequence (Note [documents from position ids]): if a row has one start at the first and last
    query and at the first and last key, every pair between shares that document; if the keys' last start
    is below the queries' first, or the keys' first start above the queries' last, no pair does. Block
    starts behave the same way (Note [block-causal ranges]). Every reason to skip is tested before any
    reason to mask, so a tile hidden by one rule and cut by another is skipped rather than computed under an
    all-False mask.
    Empty rows: the document test is conservative, so a mixed tile may still hold query rows that see no
    key in it (batch rows whose documents differ), or even none at all. Kernels return out 0 and lse -inf
    for such rows (``kernels.base.mark_empty_rows`` for the fused ops), and the LSE merge leaves the
    running result untouched by them (Note [LSE merge]). In the backward a masked score's weight is
    exp(-inf - lse) = 0; an lse of -inf is first turned into +inf (``kernels.base.unmark_empty_rows``) so
    that it is 0 there too, not NaN. Every query sees at least itself somewhere in its plan, so no row is
    still empty once all its tiles are merged.
    Cost models: ``planner.plan_cost`` weighs a plan's tiles without building their masks;
    ``layout_balance`` sums it over the ring's plans, so the work it reports is what the kernels are asked
    to compute. The balanced layout prices each chunk tiled as a run of its own (Note [balanced layout]);
    the placed layout counts a rank's runs (Note [placed layout]): a document's piece in one run is one
    diagonal square per tile, and a causal square costs its diagonal key blocks whole (``square_parts``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from seqpar.sequence_parallel.masks.sequence_mask import SequenceMask

MASK_TILE = 1024
MIN_WINDOW_TILE = 128

SKIP, FULL, CAUSAL, MIXED = 0, 1, 2, 3
"""Tile kinds of ``tile_kinds``: nothing visible, all visible, a plain causal square, masked."""
SQUARE_BLOCK = 512
"""Key block of PyTorch's fused CPU flash kernel: a causal call computes whole blocks of this many keys up to
the diagonal, so the cost models count a causal square as its diagonal blocks (whole) and the blocks below
them (``square_parts``)."""


def square_parts(side: int | torch.Tensor) -> tuple:
    """``(diagonal, below)``: the area of a causal square of ``side`` in its diagonal ``SQUARE_BLOCK`` squares
    (computed whole at the causal square's cost) and below them (plain). Their sum is at most ``side ** 2``.

    The CPU kernel's causal call costs about its whole area up to one block and falls towards half of it for
    longer squares, as this model does (timings against the model: docs/benchmarks.md, "Cost model of the
    CPU kernel").
    """
    whole, rest = side // SQUARE_BLOCK, side % SQUARE_BLOCK
    diagonal = whole * SQUARE_BLOCK**2 + rest * rest
    return diagonal, (side * side - diagonal) / 2


def tile_size(chunk_len: int, mask: SequenceMask) -> int:
    """Largest tile side under ``mask`` for spans of ``chunk_len`` tokens (Note [masked tiles])."""
    tile = min(chunk_len, MASK_TILE)
    if mask.window is not None:  # tiles of half a window: the band's masked edge wastes less compute
        tile = min(tile, max(MIN_WINDOW_TILE, mask.window // 2))
    if mask.blocks is not None and mask.blocks.size is not None:  # tiles of whole blocks: none of them masked
        tile = min(tile, max(MIN_WINDOW_TILE, mask.blocks.size))
    return tile


def tile_kinds(
    q_lo: torch.Tensor, q_hi: torch.Tensor, kv_lo: torch.Tensor, kv_hi: torch.Tensor, causal: bool, mask: SequenceMask
) -> torch.Tensor:
    """Kinds of the tiles ``[q_lo, q_hi] x [kv_lo, kv_hi]`` (inclusive global bounds), from their corners.

    Every reason to skip is checked before any reason to mask, so a tile that is both on a window's edge
    and across documents is skipped, not computed under an all-False mask (Note [masked tiles]).

    Args:
        q_lo, q_hi: ``[Tq]`` int64 first and last query of each query tile.
        kv_lo, kv_hi: ``[Tk]`` int64 first and last key of each key tile.
        causal: the token-level causal rule.
        mask: the sequence mask.

    Returns:
        ``[Tq, Tk]`` int64 codes: ``SKIP``, ``FULL``, ``CAUSAL`` or ``MIXED``.
    """
    ql, qh, kl, kh = q_lo[:, None], q_hi[:, None], kv_lo[None], kv_hi[None]
    skip = torch.zeros(ql.shape[0], kl.shape[1], dtype=torch.bool)
    mixed = torch.zeros_like(skip)
    if causal:
        skip |= kl > qh
    if mask.window is not None:
        skip |= ql - kh >= mask.window
        mixed |= qh - kl >= mask.window
    if mask.starts is not None:
        starts = mask.starts  # [B, S]; starts never decrease, so disjoint corner ranges share no document
        q_first, q_last = starts[:, q_lo][:, :, None], starts[:, q_hi][:, :, None]
        kv_first, kv_last = starts[:, kv_lo][:, None], starts[:, kv_hi][:, None]
        skip |= ((kv_last < q_first) | (kv_first > q_last)).all(0)
        one_document = (q_first == q_last) & (kv_first == kv_last) & (q_first == kv_first)
        mixed |= ~one_document.all(0)
    if mask.blocks is not None:  # Note [block-causal ranges]; per row: skipped by all rows, whole in all rows
        later = mask.blocks.starts(kl) > mask.blocks.starts(qh)
        partial = mask.blocks.starts(kh) > mask.blocks.starts(ql)
        skip |= later.all(0) if mask.blocks.per_row else later
        mixed |= partial.any(0) if mask.blocks.per_row else partial
    if mask.predicate is not None:  # Note [blockwise masks]: from its block table
        hidden, masked = mask.predicate.tile_rules(q_lo, q_hi, kv_lo, kv_hi)
        skip |= hidden
        mixed |= masked
    square = (ql == kl) & (qh == kh) if causal else torch.zeros_like(skip)
    if causal:
        mixed |= (kh > ql) & ~square
    kinds = torch.where(square, CAUSAL, FULL)
    kinds = torch.where(mixed, MIXED, kinds)
    return torch.where(skip, SKIP, kinds)


def chunk_runs(chunks: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(first local index, first global id, length)`` of each run of chunks consecutive locally and globally."""
    runs: list[tuple[int, int, int]] = []
    for i, c in enumerate(chunks):
        if runs and runs[-1][0] + runs[-1][2] == i and runs[-1][1] + runs[-1][2] == c:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, c, 1))
    return runs


@dataclass(frozen=True)
class RunTiles:
    """The tiles of one side of a plan: global bounds (inclusive) and where each starts locally."""

    lo: torch.Tensor
    """``[T]`` int64 first global token of each tile."""
    hi: torch.Tensor
    """``[T]`` int64 last global token of each tile."""
    local: torch.Tensor
    """``[T]`` int64 local index of each tile's first token."""


def _document_cuts(mask: SequenceMask, lo: int, hi: int) -> list[int]:
    """Document starts inside ``(lo, hi)`` shared by every batch row."""
    if mask.starts is None:
        return []
    index = torch.arange(lo + 1, hi)
    common = (mask.starts[:, lo + 1 : hi] == index).all(0)
    return index[common].tolist()


def _block_cuts(mask: SequenceMask, lo: int, hi: int) -> list[int]:
    """Ends of block-causal ranges inside ``(lo, hi)``, or every block edge for equal blocks."""
    if mask.blocks is None:
        return []
    if mask.blocks.size is not None:
        return []  # the grid of ``run_tiles`` cuts at every multiple of the tile, a divisor or multiple of it
    return [x for x in mask.blocks.edges if lo < x < hi]


def run_tiles(runs: Sequence[tuple[int, int, int]], edges: set[int], chunk_len: int, mask: SequenceMask) -> RunTiles:
    """Cut each run into tiles (Note [masked tiles]).

    Args:
        runs: ``chunk_runs`` of one side's chunks.
        edges: global token indices where every tile must end: both sides' run ends.
        chunk_len: tokens per chunk.
        mask: the sequence mask (documents, window, blocks).

    Returns:
        The tiles of all runs, in local order.
    """
    tile = tile_size(MASK_TILE, mask)
    grid = mask.window is not None or (mask.blocks is not None and mask.blocks.size is not None)
    lo_all, hi_all, local_all = [], [], []
    for first, chunk, count in runs:
        lo, hi = chunk * chunk_len, (chunk + count) * chunk_len
        cuts = {lo, hi} | {e for e in edges if lo < e < hi}
        cuts |= set(_document_cuts(mask, lo, hi)) | set(_block_cuts(mask, lo, hi))
        ordered = sorted(cuts)
        starts: list[int] = []
        for a, b in zip(ordered, ordered[1:]):
            if grid:  # equal blocks: cut at the global multiples of the tile, so tiles hold whole blocks
                starts += [a, *range((a // tile + 1) * tile, b, tile)]
            else:  # even pieces: no sliver left at the end of a document
                pieces = -(-(b - a) // tile)
                starts += [a + (b - a) * i // pieces for i in range(pieces)]
        bounds = torch.tensor([*starts, hi])
        lo_all.append(bounds[:-1])
        hi_all.append(bounds[1:] - 1)
        local_all.append(bounds[:-1] - lo + first * chunk_len)
    if not lo_all:
        empty = torch.zeros(0, dtype=torch.long)
        return RunTiles(empty, empty, empty)
    return RunTiles(torch.cat(lo_all), torch.cat(hi_all), torch.cat(local_all))
