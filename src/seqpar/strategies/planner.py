"""The block planner: which (query rows, key columns) rectangles a rank computes, and with which mask.

Every strategy reduces to this: local query chunks against a key/value piece whose chunk ids are known.

Note [block plan]
    The global sequence is cut into equal chunks with global ids (``seqpar.layout``). Under a causal mask,
    query chunk g sees key chunk j fully when j < g, causally when j == g, and not at all when j > g.
    When the query and key chunks are the same strictly increasing list, one causal call over the whole
    square is exact (an earlier local chunk is also earlier globally). Otherwise each query chunk gets its
    fully visible key chunks (grouped into contiguous runs) and its diagonal; neighbouring query chunks with
    the same runs share one call. Invisible rectangles are never computed.

Note [masked tiles]
    A ``SequenceMask`` with packed documents, a sliding window or blocks makes visibility depend on more than the
    chunk ids, so each chunk pair the causal rule leaves visible (key chunk not after the query chunk) is
    cut into square tiles of ``MASK_TILE`` tokens a side, or of half the window (at least
    ``MIN_WINDOW_TILE``) with a window, so that the band's ragged edge wastes fewer scores. Each tile is
    classified from its four corners alone:
    - skipped: nothing in it is visible. Every key comes after every query (causal), the last key lies a
      whole window or more before the first query, or in every batch row the queries' documents and the
      keys' documents are disjoint. It costs nothing.
    - plain: everything in it is visible, so the chosen (fused) kernel runs it with no mask: a full
      rectangle, or a square on the diagonal run as a plain causal call.
    - mixed: anything else. It carries a boolean mask ``[B or 1, 1, q, kv]`` built from the global
      positions and document starts, and runs on the chosen kernel if that takes masks, otherwise on the
      preferred kernel that does (``blocks_forward`` and ``blocks_backward`` swap it per tile).
    Block-causal ranges are decided from the corners too (Note [block-causal ranges]); a chunk pair whose
    corners already say "skipped" is not cut into tiles at all. Equal blocks cut the tiles to the block size
    (at least ``MIN_WINDOW_TILE``), so that blocks aligned with the chunks leave no tile masked.
    Why the corners suffice: causality and the window depend only on the query position minus the key
    position, which over a tile is smallest at (first query, last key) and largest at (last query, first
    key); those two bounds say whether all, none or some of the tile passes. Document starts never decrease
    along the sequence (Note [documents from position ids]): if a row has one start at the first and last
    query and at the first and last key, every pair between shares that document; if the keys' last start
    is below the queries' first, or the keys' first start above the queries' last, no pair does. Every
    reason to skip is tested before any reason to mask, so a tile hidden by one rule and cut by another is
    skipped rather than computed under an all-False mask.
    Empty rows: the document test is conservative, so a mixed tile may still hold query rows that see no
    key in it (a query just past a document start, against keys of the previous document), or even none
    at all. Kernels return out 0 and lse -inf for such rows (``kernels.base.mark_empty_rows`` for the
    fused ops), and the LSE merge leaves the running result untouched by them (Note [LSE merge]). In the
    backward a masked score's weight is exp(-inf - lse) = 0; an lse of -inf is first turned into +inf
    (``kernels.base.unmark_empty_rows``) so that it is 0 there too, not NaN. Every query sees at least
    itself somewhere in its plan, so no row is still empty once all its tiles are merged.
    Tiles depend only on the mask, the chunk ids, the chunk length and the causal flag, so ``plan``
    keeps them on the mask (``SequenceMask.plans``) and every layer of one forward shares them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from seqpar.strategies.masking import SequenceMask

__all__ = ["MASK_TILE", "MIN_WINDOW_TILE", "Block", "chunk_tiles", "plan", "plan_blocks", "tile_kinds", "tile_size"]

MASK_TILE = 1024
MIN_WINDOW_TILE = 128


@dataclass(frozen=True)
class Block:
    """One kernel call: query token range ``q``, key token range ``kv``, and whether it is a causal square.

    ``mask`` (``[B, 1, len(q), len(kv)]`` bool, True = visible) is set for mixed tiles (Note [masked tiles]).
    """

    q: slice
    kv: slice
    causal: bool
    mask: torch.Tensor | None = None


def _runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous runs of sorted local indices as half-open ``(start, stop)``."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def plan_blocks(q_chunks: Sequence[int], kv_chunks: Sequence[int], chunk_len: int, causal: bool) -> list[Block]:
    """Kernel calls that cover exactly the visible part of ``q_chunks x kv_chunks`` (Note [block plan]).

    Args:
        q_chunks: global chunk ids of the local queries, in local order.
        kv_chunks: global chunk ids of the keys/values in hand, in their local order.
        chunk_len: tokens per chunk (the same for all chunks).
        causal: whether a causal mask applies.

    Returns:
        Unmasked blocks in local token coordinates; empty when nothing is visible.
    """
    q_all = slice(0, len(q_chunks) * chunk_len)
    kv_all = slice(0, len(kv_chunks) * chunk_len)
    if not causal:
        return [Block(q_all, kv_all, False)]
    if list(q_chunks) == list(kv_chunks) and all(a < b for a, b in zip(q_chunks, q_chunks[1:])):
        return [Block(q_all, kv_all, True)]

    def tokens(start: int, stop: int) -> slice:
        return slice(start * chunk_len, stop * chunk_len)

    full: list[tuple[tuple[int, int], list[tuple[int, int]]]] = []  # (q run, kv runs)
    diagonal: list[Block] = []
    for i, g in enumerate(q_chunks):
        visible = _runs([j for j, c in enumerate(kv_chunks) if c < g])
        if visible:
            if full and full[-1][1] == visible and full[-1][0][1] == i:
                full[-1] = ((full[-1][0][0], i + 1), visible)
            else:
                full.append(((i, i + 1), visible))
        diagonal += [Block(tokens(i, i + 1), tokens(j, j + 1), True) for j, c in enumerate(kv_chunks) if c == g]
    blocks = [Block(tokens(*q_run), tokens(*kv_run), False) for q_run, kv_runs in full for kv_run in kv_runs]
    return blocks + diagonal


def plan(
    q_chunks: Sequence[int],
    kv_chunks: Sequence[int],
    chunk_len: int,
    causal: bool,
    mask: SequenceMask | None,
    device: torch.device | None = None,
) -> list[Block]:
    """``plan_blocks``, or with a non-trivial ``mask`` the tiles of Note [masked tiles] (masks on ``device``).

    Masked plans are kept on the mask, so the layers of one forward share them.

    Args:
        q_chunks: global chunk ids of the local queries, in local order.
        kv_chunks: global chunk ids of the keys/values in hand, in their local order.
        chunk_len: tokens per chunk.
        causal: whether a causal mask applies.
        mask: packed documents and sliding window, or None.
        device: where the tile masks go (None: the CPU).

    Returns:
        The blocks to run, in local token coordinates.
    """
    if mask is None or mask.trivial:
        return plan_blocks(q_chunks, kv_chunks, chunk_len, causal)
    key = (tuple(q_chunks), tuple(kv_chunks), chunk_len, causal, str(device))
    if key not in mask.plans:
        mask.plans[key] = _masked_plan(q_chunks, kv_chunks, chunk_len, causal, mask, device)
    return mask.plans[key]


def tile_size(chunk_len: int, mask: SequenceMask) -> int:
    """Side of the square tiles a chunk pair is cut into under ``mask`` (Note [masked tiles])."""
    tile = min(chunk_len, MASK_TILE)
    if mask.window is not None:  # tiles of half a window: the band's masked edge wastes less compute
        tile = min(tile, max(MIN_WINDOW_TILE, mask.window // 2))
    if mask.blocks is not None and mask.blocks.size is not None:  # tiles of whole blocks: none of them masked
        tile = min(tile, max(MIN_WINDOW_TILE, mask.blocks.size))
    return tile


SKIP, FULL, CAUSAL, MIXED = 0, 1, 2, 3
"""Tile kinds of ``tile_kinds``: nothing visible, all visible, a plain causal square, masked."""


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
    if mask.blocks is not None:  # Note [block-causal ranges]
        skip |= mask.blocks.starts(kl) > mask.blocks.starts(qh)
        mixed |= mask.blocks.starts(kh) > mask.blocks.starts(ql)
    square = (ql == kl) & (qh == kh) if causal else torch.zeros_like(skip)
    if causal:
        mixed |= (kh > ql) & ~square
    kinds = torch.where(square, CAUSAL, FULL)
    kinds = torch.where(mixed, MIXED, kinds)
    return torch.where(skip, SKIP, kinds)


def chunk_tiles(chunk_id: int, chunk_len: int, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """First and last global token of each tile of chunk ``chunk_id`` (the last tile may be shorter)."""
    lo = torch.arange(0, chunk_len, tile) + chunk_id * chunk_len
    return lo, torch.clamp(lo + tile, max=(chunk_id + 1) * chunk_len) - 1


def _masked_plan(
    q_chunks: Sequence[int],
    kv_chunks: Sequence[int],
    chunk_len: int,
    causal: bool,
    mask: SequenceMask,
    device: torch.device | None,
) -> list[Block]:
    tile = tile_size(chunk_len, mask)
    names = {FULL: "full", CAUSAL: "causal", MIXED: "mixed"}
    blocks = []
    for i, g in enumerate(q_chunks):
        for j, c in enumerate(kv_chunks):
            if causal and c > g:
                continue
            whole = ((g * chunk_len, (g + 1) * chunk_len), (c * chunk_len, (c + 1) * chunk_len))
            if _classify(*whole, causal, mask) == "skip":  # the skip rules hold for the whole pair at once
                continue
            (q_lo, q_hi), (kv_lo, kv_hi) = chunk_tiles(g, chunk_len, tile), chunk_tiles(c, chunk_len, tile)
            kinds = tile_kinds(q_lo, q_hi, kv_lo, kv_hi, causal, mask).tolist()
            for a, row in enumerate(kinds):
                for b, kind in enumerate(row):
                    if kind == SKIP:
                        continue
                    q_glob, kv_glob = (int(q_lo[a]), int(q_hi[a]) + 1), (int(kv_lo[b]), int(kv_hi[b]) + 1)
                    q0, k0 = q_glob[0] - g * chunk_len, kv_glob[0] - c * chunk_len
                    q_loc = slice(i * chunk_len + q0, i * chunk_len + q0 + q_glob[1] - q_glob[0])
                    kv_loc = slice(j * chunk_len + k0, j * chunk_len + k0 + kv_glob[1] - kv_glob[0])
                    keep = _dense_mask(q_glob, kv_glob, causal, mask, device) if kind == MIXED else None
                    blocks.append(Block(q_loc, kv_loc, names[kind] == "causal", keep))
    return blocks


def _classify(q: tuple[int, int], kv: tuple[int, int], causal: bool, mask: SequenceMask) -> str:
    """ "skip", "full", "causal" (a plain causal square) or "mixed" for one half-open tile (``tile_kinds``)."""
    kind = tile_kinds(
        torch.tensor([q[0]]), torch.tensor([q[1] - 1]), torch.tensor([kv[0]]), torch.tensor([kv[1] - 1]), causal, mask
    )
    return {SKIP: "skip", FULL: "full", CAUSAL: "causal", MIXED: "mixed"}[int(kind[0, 0])]


def _dense_mask(
    q: tuple[int, int], kv: tuple[int, int], causal: bool, mask: SequenceMask, device: torch.device | None
) -> torch.Tensor:
    """``[B or 1, 1, q, kv]`` bool visibility of one tile."""
    qi = torch.arange(*q)[:, None]
    ki = torch.arange(*kv)[None, :]
    keep = torch.ones(len(range(*q)), len(range(*kv)), dtype=torch.bool)
    if causal:
        keep &= ki <= qi
    if mask.window is not None:
        keep &= qi - ki < mask.window
    if mask.blocks is not None:
        keep &= mask.blocks.starts(ki) <= mask.blocks.starts(qi)
    keep = keep[None, None]
    if mask.starts is not None:
        same = mask.starts[:, q[0] : q[1], None] == mask.starts[:, None, kv[0] : kv[1]]  # [B, q, kv]
        keep = keep & same[:, None]
    return keep if device is None else keep.to(device)
