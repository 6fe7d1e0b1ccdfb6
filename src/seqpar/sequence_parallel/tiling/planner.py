"""The block planner: which (query rows, key columns) rectangles a rank computes, and with which mask.

Every strategy reduces to this: local query chunks against a key/value piece whose chunk ids are known.

Note [block plan]
    The global sequence is cut into equal chunks with global ids (``layouts.chunks``). Under a causal mask,
    query chunk g sees key chunk j fully when j < g, causally when j == g, and not at all when j > g.
    When the query and key chunks are the same strictly increasing list, one causal call over the whole
    square is exact (an earlier local chunk is also earlier globally). Otherwise each query chunk gets its
    fully visible key chunks (grouped into contiguous runs) and its diagonal; neighbouring query chunks with
    the same runs share one call. Invisible rectangles are never computed.

    With a non-trivial ``SequenceMask`` the plan is instead the tiles of Note [masked tiles]
    (``seqpar.sequence_parallel.tiling.tiles``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from seqpar.sequence_parallel.masks.sequence_mask import SequenceMask
from seqpar.sequence_parallel.tiling.tiles import (
    CAUSAL,
    MIXED,
    SKIP,
    RunTiles,
    chunk_runs,
    run_tiles,
    square_parts,
    tile_kinds,
)


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


def plan_cost(
    q_chunks: Sequence[int],
    kv_chunks: Sequence[int],
    chunk_len: int,
    causal: bool,
    mask: SequenceMask | None,
    tile_costs: Sequence[float],
) -> float:
    """The work of ``plan(q_chunks, kv_chunks, ...)``: each block's area (its whole rectangle) times the cost
    per score of its kind, a causal square as its diagonal blocks and the blocks below them
    (``tiles.square_parts``), without building any tile mask.

    Args:
        q_chunks, kv_chunks, chunk_len, causal, mask: as for ``plan``.
        tile_costs: cost per score of a plain block, a causal square and a masked tile.

    Returns:
        The weighted area, in scores.
    """
    plain, square, masked = (float(x) for x in tile_costs)

    def causal_cost(side: int) -> float:
        diagonal, below = square_parts(side)
        return square * diagonal + plain * below

    if mask is None or mask.trivial:
        return sum(
            causal_cost(b.q.stop - b.q.start) if b.causal else (b.q.stop - b.q.start) * (b.kv.stop - b.kv.start) * plain
            for b in plan_blocks(q_chunks, kv_chunks, chunk_len, causal)
        )
    q, kv, kinds = _tiles(q_chunks, kv_chunks, chunk_len, causal, mask)
    weight = torch.tensor([0.0, plain, 0.0, masked], dtype=torch.float64)[kinds]  # causal squares: below
    total = float((q.hi - q.lo + 1).double() @ weight @ (kv.hi - kv.lo + 1).double())
    sides = (q.hi - q.lo + 1)[(kinds == CAUSAL).nonzero()[:, 0]].tolist()
    return total + sum(causal_cost(side) for side in sides)


def _tiles(q_chunks: Sequence[int], kv_chunks: Sequence[int], chunk_len: int, causal: bool,
           mask: SequenceMask) -> tuple[RunTiles, RunTiles, torch.Tensor]:  # fmt: skip
    """Both sides' tiles (Note [masked tiles]: runs cut at both sides' run ends) and ``[Tq, Tk]`` the kinds."""
    q_runs, kv_runs = chunk_runs(q_chunks), chunk_runs(kv_chunks)
    edges = {(c + n * end) * chunk_len for _, c, n in q_runs + kv_runs for end in (0, 1)}
    q, kv = run_tiles(q_runs, edges, chunk_len, mask), run_tiles(kv_runs, edges, chunk_len, mask)
    return q, kv, tile_kinds(q.lo, q.hi, kv.lo, kv.hi, causal, mask)


def _masked_plan(
    q_chunks: Sequence[int],
    kv_chunks: Sequence[int],
    chunk_len: int,
    causal: bool,
    mask: SequenceMask,
    device: torch.device | None,
) -> list[Block]:
    q, kv, kinds = _tiles(q_chunks, kv_chunks, chunk_len, causal, mask)
    (q_lo, q_hi, q_at), (kv_lo, kv_hi, kv_at) = ([t.tolist() for t in (s.lo, s.hi, s.local)] for s in (q, kv))
    blocks, kind_of = [], kinds.tolist()
    for a, b in (kinds != SKIP).nonzero().tolist():
        q_glob, kv_glob = (q_lo[a], q_hi[a] + 1), (kv_lo[b], kv_hi[b] + 1)
        q_loc = slice(q_at[a], q_at[a] + q_glob[1] - q_glob[0])
        kv_loc = slice(kv_at[b], kv_at[b] + kv_glob[1] - kv_glob[0])
        kind = kind_of[a][b]
        keep = dense_mask(q_glob, kv_glob, causal, mask, device) if kind == MIXED else None
        blocks.append(Block(q_loc, kv_loc, kind == CAUSAL, keep))
    return blocks


def dense_mask(
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
    if mask.blocks is not None:  # [q, kv], or [B, q, kv] when the rows' blocks differ
        keep = keep & (mask.blocks.starts(ki) <= mask.blocks.starts(qi))
    keep = keep[:, None] if keep.dim() == 3 else keep[None, None]
    if mask.predicate is not None:  # Note [blockwise masks]
        keep = keep & mask.predicate.dense(q, kv)
    if mask.starts is not None:
        same = mask.starts[:, q[0] : q[1], None] == mask.starts[:, None, kv[0] : kv[1]]  # [B, q, kv]
        keep = keep & same[:, None]
    return keep if device is None else keep.to(device)
