"""The balanced layout: which chunks of a packed row each rank holds, so that every rank does the same attention work.

``balanced_layout`` solves it from the global position ids (no communication); ``shard_batch`` calls it.

Note [balanced layout]
    The zigzag layout evens out plain causal attention, where a query's work grows with its index. In a
    packed row it grows with the index inside the query's document instead, and a window or block-causal
    ranges change it again, so zigzag leaves one rank with the long documents' late tokens and another with
    short documents. The balanced layout cuts the row into ``n = k P`` equal chunks and gives every rank
    ``k`` of them (so token counts stay equal), choosing which by each chunk's work under the batch's mask:
    - visible area: for each query, the keys it may see (its document, causal, window, blocks), summed over
      the chunk's queries and the batch rows;
    - planned work: the area of the tiles the block planner computes for the chunk taken alone as a run
      (Note [masked tiles]: cut at document starts, ``run_tiles``), with the same corner rules
      (``seqpar.sequence_parallel.tiling.tiles.tile_kinds``), each kind weighted by what a kernel spends per score on it
      (``TILE_COSTS``: a causal square its diagonal key blocks whole, ``tiles.square_parts``; masked tiles
      more than plain ones). That is what the
      kernels compute when no two consecutive chunks share a rank; where they do, the planner tiles them as
      one run and its diagonal squares are larger. ``layout_balance`` reports the work of the plans
      themselves (``planner.plan_cost``).
    The solver minimises the larger of the two relative imbalances (a rank's share over the mean): a
    longest-first greedy pass (each chunk, by decreasing work, to the least loaded rank that still has
    room), then pairwise exchanges between the most loaded rank and any other while one lowers the larger
    of the two ranks' loads. It tries k = 2, 4, 8, 16 in turn (the k that divide the row) and keeps the
    first within ``tolerance``, else the best: fewer chunks mean fewer, larger kernel calls. Ties are broken
    by chunk and rank index, so every rank computes the same layout from the same ids. Every rank's chunks
    are kept in ascending order, so each rank's tiles stay in global order. Position ids and labels are
    sharded with the same layout (``shard_batch``), the loss is a token sum and needs no order, and
    ``gather_sequence`` with the layout puts the tokens back in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from seqpar.errors import SeqparInputError
from seqpar.sequence_parallel.layouts.chunks import ChunkLayout
from seqpar.sequence_parallel.masks.sequence_mask import SequenceMask, sequence_mask
from seqpar.sequence_parallel.tiling.planner import plan_cost
from seqpar.sequence_parallel.tiling.tiles import run_tiles, square_parts, tile_kinds

CHUNKS_PER_RANK = (2, 4, 8, 16)
"""The chunks per rank the solver tries, fewest first (Note [balanced layout])."""
TILE_COSTS = (1.0, 1.0, 1.3)
"""Kernel time per score of a plain tile, a causal square and a masked tile, relative to a plain tile.
For seqpar's CPU kernel (fwd + bwd, one thread, 128-token tiles of packed documents): a causal square costs
its whole area (the kernel skips little of it at this size; larger squares count their diagonal 512-key
blocks only, ``tiles.square_parts``), a masked tile more than a plain one (its boolean mask is read and
applied; the timings are in docs/benchmarks.md, "Cost model of the CPU kernel"). A kernel that skips the
upper half of a causal square (FlashAttention on a GPU) has about (1.0, 0.5, ...): pass its costs as
``tile_costs``."""


def _global_mask(
    position_ids: torch.Tensor, window: int | None, blocks: int | Sequence[tuple[int, int]] | None
) -> tuple[SequenceMask, int]:
    """The mask of *global* position ids (``sequence_mask`` on one process, which checks them) and their length."""
    return sequence_mask(position_ids, None, layout="contiguous", window=window, blocks=blocks), position_ids.shape[-1]


def visible_area(mask: SequenceMask, seq_len: int, causal: bool = True) -> torch.Tensor:
    """``[S]`` float64: keys each query may see under ``mask``, summed over the batch rows.

    Args:
        mask: the sequence mask (documents, window, blocks) over ``seq_len`` tokens.
        seq_len: the global sequence length.
        causal: the token-level causal rule (ignored under blocks, which carry their own).

    Returns:
        Per query token, the number of visible keys, summed over rows.
    """
    query = torch.arange(seq_len)[None]  # [1, S]
    lo, hi = torch.zeros_like(query), torch.full_like(query, seq_len - 1)
    if mask.starts is not None:
        ends = torch.searchsorted(mask.starts.contiguous(), mask.starts.contiguous(), right=True)  # next document
        lo, hi = torch.maximum(lo, mask.starts), torch.minimum(hi, ends - 1)
    if mask.blocks is not None:  # keys of this block and earlier ones: up to the end of the query's block
        block_start = mask.blocks.starts(query[0])  # [S], or [B, S] when the rows' blocks differ
        after = torch.searchsorted(block_start.contiguous(), block_start.contiguous(), right=True)
        hi = torch.minimum(hi, after - 1)
    elif causal:
        hi = torch.minimum(hi, query)
    if mask.window is not None:
        lo = torch.maximum(lo, query - mask.window + 1)
    return (hi - lo + 1).clamp(min=0).double().sum(0)


def planned_work(mask: SequenceMask, seq_len: int, chunk_len: int, causal: bool = True) -> torch.Tensor:
    """``[S / chunk_len, 3]`` float64: the area of the plain, causal and masked tiles of each chunk's queries.

    Args:
        mask: the sequence mask.
        seq_len: the global sequence length.
        chunk_len: tokens per chunk (each chunk is tiled as a run of its own).
        causal: the token-level causal rule (ignored under blocks, which carry their own).

    Returns:
        Per query chunk, the scores of its computed tiles against every key, by kind: plain rectangles,
        causal squares (their diagonal blocks; the blocks below count as plain, ``tiles.square_parts``),
        masked tiles (each tile's whole rectangle).
    """
    causal = causal and mask.blocks is None
    n = seq_len // chunk_len
    tiles = run_tiles([(c, c, 1) for c in range(n)], set(range(0, seq_len + 1, chunk_len)), chunk_len, mask)
    lo, hi = tiles.lo, tiles.hi
    size = (hi - lo + 1).double()
    weight = torch.eye(4, dtype=torch.float64)[:, 1:]  # SKIP, FULL, CAUSAL, MIXED -> plain, causal, masked columns
    rows = []
    for start in range(0, len(lo), 256):  # query tiles a slice at a time: [256, T] kinds, not [T, T]
        part = slice(start, start + 256)
        kinds = tile_kinds(lo[part], hi[part], lo, hi, causal, mask)
        rows.append((weight[kinds] * size[None, :, None]).sum(1) * size[part, None])
    per_tile = torch.cat(rows)  # [T, 3]
    diagonal, below = square_parts(size)  # a tile's causal square (the tile against itself), in its parts
    square = per_tile[:, 1] > 0
    per_tile[:, 0] += torch.where(square, below, 0.0)
    per_tile[:, 1] = torch.where(square, diagonal, 0.0)
    return torch.zeros(n, 3, dtype=torch.float64).index_add_(0, lo // chunk_len, per_tile)


@dataclass(frozen=True)
class LayoutBalance:
    """How evenly a layout spreads the work of one batch over the ranks (1.0 = perfectly even)."""

    visible: tuple[float, ...]
    """Visible attention area of each rank (query-key pairs a rank's queries may see)."""
    planned: tuple[float, ...]
    """Work of the blocks each rank computes: the blocks of its plans against every rank's keys, as the ring
    runs them (``planner.plan_cost``: a rank's runs of chunks tiled as one span), weighted by ``tile_costs``."""

    @property
    def visible_max_over_mean(self) -> float:
        """The largest rank's visible area over the mean."""
        return max(self.visible) * len(self.visible) / max(sum(self.visible), 1e-300)

    @property
    def planned_max_over_mean(self) -> float:
        """The largest rank's planned tile area over the mean."""
        return max(self.planned) * len(self.planned) / max(sum(self.planned), 1e-300)


def _costs(mask: SequenceMask, seq_len: int, n_chunks: int, causal: bool, tile_costs: Sequence[float]) -> torch.Tensor:
    """``[n, 2]``: visible area and planned work (tile areas weighted by ``tile_costs``) of each chunk."""
    chunk = seq_len // n_chunks
    planned = planned_work(mask, seq_len, chunk, causal) @ torch.tensor(tile_costs, dtype=torch.float64)
    visible = visible_area(mask, seq_len, causal).view(n_chunks, chunk).sum(1)
    return torch.stack([visible, planned], 1)


def layout_balance(
    position_ids: torch.Tensor,
    layout: ChunkLayout | str,
    world_size: int,
    *,
    causal: bool = True,
    window: int | None = None,
    blocks: int | Sequence[tuple[int, int]] | None = None,
    tile_costs: Sequence[float] = TILE_COSTS,
) -> LayoutBalance:
    """The per-rank work of a layout on one batch (to compare layouts; ``python -m benchmarks.masks`` reports it).

    Args:
        position_ids: global ``[B, S]`` or ``[S]`` position ids (restarting at 0 at each packed document).
        layout: "contiguous", "zigzag" or a ``ChunkLayout``.
        world_size: the ranks.
        causal: whether attention is causal.
        window: the sliding window, or None.
        blocks: block-causal blocks, as ``seqpar.sequence_mask`` takes them, or None.
        tile_costs: cost per score of a plain tile, a causal square and a masked tile (``TILE_COSTS``).

    Returns:
        A ``LayoutBalance``.

    Raises:
        SeqparInputError: position ids that are not packed ids, or a length the layout does not divide.
    """
    from seqpar.sequence_parallel.layouts.chunks import rank_chunk_ids

    mask, seq_len = _global_mask(position_ids, window, blocks)
    ids = [rank_chunk_ids(layout, world_size, r) for r in range(world_size)]
    n = sum(len(x) for x in ids)
    if seq_len % n:
        raise SeqparInputError(f"sequence length {seq_len} does not divide into {n} chunks")
    chunk = seq_len // n
    visible = visible_area(mask, seq_len, causal).view(n, chunk).sum(1)
    rule = causal and mask.blocks is None  # block-causal ranges carry their own rule, as in the strategies
    planned = [sum(plan_cost(q, kv, chunk, rule, mask, tile_costs) for kv in ids) for q in ids]
    return LayoutBalance(tuple(float(visible[list(q)].sum()) for q in ids), tuple(planned))


def _solve(costs: torch.Tensor, world_size: int, per_rank: int) -> tuple[list[list[int]], float]:
    """Assign ``n`` chunks with ``[n, 2]`` costs (each column summing to 1) to ranks, ``per_rank`` each.

    Returns the assignment and the largest rank's share of either column over the mean.
    """
    n = costs.shape[0]
    work = costs.tolist()
    load = [[0.0, 0.0] for _ in range(world_size)]
    owned: list[list[int]] = [[] for _ in range(world_size)]
    for c in sorted(range(n), key=lambda c: (-(work[c][0] + work[c][1]), c)):
        room = [r for r in range(world_size) if len(owned[r]) < per_rank]
        r = min(room, key=lambda r: (max(load[r]), sum(load[r]), r))
        owned[r].append(c)
        load[r] = [load[r][0] + work[c][0], load[r][1] + work[c][1]]

    def worst(x: list[float]) -> float:
        return max(x) * world_size

    for _ in range(4 * n):  # each exchange lowers the pair's larger load; few are ever needed
        top = max(range(world_size), key=lambda r: (worst(load[r]), -r))
        best = None
        for other in range(world_size):
            if other == top:
                continue
            bound = max(worst(load[top]), worst(load[other]))
            for a in owned[top]:
                for b in owned[other]:
                    new_top = [x - y + z for x, y, z in zip(load[top], work[a], work[b])]
                    new_other = [x + y - z for x, y, z in zip(load[other], work[a], work[b])]
                    after = max(worst(new_top), worst(new_other))
                    if after < bound - 1e-12 and (best is None or after < best[0]):
                        best = (after, other, a, b, new_top, new_other)
        if best is None:
            break
        _, other, a, b, new_top, new_other = best
        owned[top][owned[top].index(a)] = b
        owned[other][owned[other].index(b)] = a
        load[top], load[other] = new_top, new_other
    return [sorted(x) for x in owned], max(worst(x) for x in load)


def balanced_layout(
    position_ids: torch.Tensor,
    world_size: int,
    *,
    causal: bool = True,
    window: int | None = None,
    blocks: int | Sequence[tuple[int, int]] | None = None,
    chunks_per_rank: int | None = None,
    tolerance: float = 0.02,
    tile_costs: Sequence[float] = TILE_COSTS,
) -> ChunkLayout:
    """A layout that gives every rank equal attention work on this batch (Note [balanced layout]).

    Deterministic and local: every rank computes the same layout from the same global ids.

    Args:
        position_ids: the *global* position ids ``[B, S]`` or ``[S]`` (restarting at 0 at each packed document).
        world_size: the sequence-parallel degree P.
        causal: whether attention is causal (False: bidirectional documents).
        window: the sliding window the attention uses, or None.
        blocks: block-causal blocks, as ``seqpar.sequence_mask`` takes them, or None.
        chunks_per_rank: chunks each rank holds; None tries ``CHUNKS_PER_RANK`` (those dividing S) in turn.
        tolerance: stop at the first chunk count whose largest rank is within ``1 + tolerance`` of the mean.
        tile_costs: cost per score of a plain tile, a causal square and a masked tile (``TILE_COSTS``).

    Returns:
        A ``ChunkLayout`` for ``S`` tokens over ``world_size`` ranks.

    Raises:
        SeqparInputError: ids that are not packed ids, a world size below 1, or a length that divides into
            no candidate chunk count (pad it to a multiple of 2P; ``shard_batch`` does).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise SeqparInputError(f"world_size must be a positive integer, got {world_size!r}")
    mask, seq_len = _global_mask(position_ids, window, blocks)
    options = CHUNKS_PER_RANK if chunks_per_rank is None else (chunks_per_rank,)
    options = tuple(k for k in options if k >= 1 and seq_len % (k * world_size) == 0)
    if not options:
        wanted = 2 if chunks_per_rank is None else chunks_per_rank
        raise SeqparInputError(
            f"sequence length {seq_len} does not divide into {wanted} chunks per rank over {world_size} ranks; "
            f"pad it to a multiple of {wanted * world_size}"
        )
    best: tuple[float, list[list[int]]] | None = None
    for k in options:
        costs = _costs(mask, seq_len, k * world_size, causal, tile_costs)
        owned, score = _solve(costs / costs.sum(0).clamp(min=1e-300), world_size, k)
        if best is None or score < best[0] - 1e-12:
            best = (score, owned)
        if score <= 1 + tolerance:
            break
    return ChunkLayout(tuple(tuple(x) for x in best[1]))
