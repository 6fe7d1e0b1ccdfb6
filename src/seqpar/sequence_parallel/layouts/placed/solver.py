"""The solver of Note [placed layout]: which rank holds each document, in what order the row is laid out.

Deterministic and local (no communication): every rank computes the same placement from the same global ids.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from seqpar.errors import SeqparInputError
from seqpar.sequence_parallel.layouts.balanced import TILE_COSTS, balanced_layout, visible_area
from seqpar.sequence_parallel.layouts.chunks import ChunkLayout
from seqpar.sequence_parallel.layouts.placed.chain import chain_segments
from seqpar.sequence_parallel.layouts.placed.home import BALANCE_SLACK, assign_homes, fill_homes
from seqpar.sequence_parallel.layouts.placed.refine import Refiner, square_extra, token_costs
from seqpar.sequence_parallel.layouts.placed.split import FILL_TARGETS, WORK_SLACK, fill_costs, split_long
from seqpar.sequence_parallel.masks.sequence_mask import SequenceMask, sequence_mask
from seqpar.sequence_parallel.tiling.tiles import MASK_TILE, tile_size

KEY_COST = 32.0
"""The refining pass's score of one token of K/V traffic, in attention scores (Note [placed layout])."""
TOKEN_SLACK = 1.05
"""The most tokens a rank holds (padding included) over the mean ``S/P``."""
REFINE_ROUNDS = 200
"""The most chunk exchanges of the refining pass (Note [placed layout])."""


@dataclass(frozen=True, eq=False)
class Placement:
    """A placed row: the order of its tokens and the ``ChunkLayout`` that cuts it (Note [placed layout])."""

    order: torch.Tensor
    """``[B, S']`` int64: the index in the batch's row of each placed token, -1 for padding."""
    position_ids: torch.Tensor
    """``[B, S']`` position ids of the placed row (padding restarts at 0)."""
    layout: ChunkLayout
    """The layout of the placed row (name "placed")."""

    @property
    def seq_len(self) -> int:
        """Tokens of the placed row, padding included."""
        return self.order.shape[1]

    def place(self, x: torch.Tensor, fill: int | float = 0) -> torch.Tensor:
        """``x`` ``[B, S, ...]`` laid out as the placed row ``[B, S', ...]``, ``fill`` at padding."""
        index = self.order.clamp(min=0).to(x.device)
        index = index.view(*index.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
        out = x.gather(1, index)
        pad = (self.order < 0).to(x.device).view(*self.order.shape, *([1] * (x.dim() - 2)))
        return out.masked_fill(pad, fill)

    def restore(self, x: torch.Tensor, seq_len: int, fill: int | float = 0) -> torch.Tensor:
        """The inverse of ``place``: ``x`` ``[B, S', ...]`` (a gathered placed row) back to ``[B, seq_len, ...]``."""
        out = x.new_full((x.shape[0], seq_len, *x.shape[2:]), fill)
        for b in range(x.shape[0]):
            keep = self.order[b] >= 0
            out[b, self.order[b][keep].to(x.device)] = x[b, keep.to(x.device)]
        return out

    def tokens_per_rank(self) -> tuple[int, ...]:
        """Real (not padding) tokens each rank holds, summed over rows."""
        chunk = self.seq_len // (self.layout.world_size * self.layout.chunks_per_rank)
        real = (self.order >= 0).sum(0).view(-1, chunk).sum(1)
        return tuple(int(real[list(ids)].sum()) for ids in self.layout.chunk_ids)


def chunk_length(seq_len: int, world_size: int) -> int:
    """Chunk length of Note [placed layout]: a power of two near a 32nd of a rank's share (an 8th when short)."""
    share = max(1, seq_len // world_size)
    n = max(1, share // 32 if share >= 512 else share // 8)
    return 1 << (n.bit_length() - 1)


def _documents(row: torch.Tensor) -> list[tuple[int, int]]:
    """(start, length) of each document of one row of position ids, in order."""
    starts = torch.arange(row.shape[0]) - row
    cut = [0, *((starts[1:] != starts[:-1]).nonzero().flatten() + 1).tolist(), row.shape[0]]
    return [(a, b - a) for a, b in zip(cut, cut[1:])]


def _build(docs: list[tuple[int, int]], work: list[float], tok_work: torch.Tensor, p: int, c: int, k: int,
           flat_window: int | None, causal: bool,
           whole: bool) -> tuple[torch.Tensor, torch.Tensor, list[int]]:  # fmt: skip
    """One candidate for ``k`` chunks per rank: the order ``[S']`` (-1 padding), its position ids (padding
    restarts at every chunk), and the rank of every chunk. ``whole``: keeping documents whole before even."""
    mean, share = sum(work) / p, k * c
    long = [d for d, (_, n) in enumerate(docs) if n > share or work[d] > mean * WORK_SLACK]
    flat = [not causal or (flat_window is not None and docs[d][1] > 2 * flat_window) for d in long]
    short = sorted(set(range(len(docs))) - set(long))
    lengths, works = [docs[d][1] for d in short], [work[d] for d in short]
    cheap = fill_costs(lengths, works, p * share - tok_work.shape[0])
    best = None
    for target in FILL_TARGETS:  # a smaller share of the long documents per rank when whole ones cannot even it
        owner, count, load = split_long(docs, long, work, tok_work, c, k, p, flat, cheap, target)
        first = owner[-1] if owner else 0  # the long zone's last (partial) chunk opens this rank's home run
        homes = [first, *sorted((r for r in range(p) if r != first), key=lambda r: (load[r], r))]
        caps = [(k - count[r]) * c for r in homes]
        caps[0] += len(owner) * c - sum(docs[d][1] for d in long)
        home, top = assign_homes(lengths, works, caps, [load[r] for r in homes], mean, whole)
        even = top <= BALANCE_SLACK
        key = (not even, home.count(-1) if even else 0, top if not even else 0.0)
        if best is None or key < best[0]:
            best = (key, owner, homes, caps, home)
        if not long or key == (False, 0, 0.0):
            break
    _, owner, homes, caps, home = best
    zone = sum(docs[d][1] for d in long)
    pieces = fill_homes(lengths, caps, home)
    # segments of the placed row: (first source token or -1 for padding, tokens, position id of the first)
    segments = [(docs[d][0], docs[d][1], 0) for d in long]
    segments += [(docs[short[j]][0] + offset if j >= 0 else -1, n, offset) for j, offset, n in pieces]
    ranks = list(owner)  # the long zone's chunks, then every home run's, in row order
    for r, cap in zip(homes, caps):
        ranks += [r] * ((cap - (len(owner) * c - zone if r == homes[0] else 0)) // c)
    return (*_lay_out(segments, c), ranks)


def _lay_out(segments: list[tuple[int, int, int]], c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The order ``[S']`` (-1 padding) and position ids of a row of ``(first source token or -1, tokens, position
    id of the first)`` segments; padding restarts at every chunk of ``c`` tokens."""
    first, size, offset = (torch.tensor(x, dtype=torch.long) for x in zip(*segments))
    head = torch.cumsum(size, 0) - size  # where each segment starts in the placed row
    index = torch.arange(int(size.sum()))
    seg = torch.repeat_interleave(torch.arange(len(segments)), size)  # each token's segment
    pad = (first < 0)[seg]
    order = torch.where(pad, -1, (first - head)[seg] + index)
    places = (offset - head)[seg] + index
    at = pad.nonzero().flatten()  # padding is its own document, restarting at every chunk it touches
    places[at] = at - torch.maximum(at // c * c, head[seg[at]])
    return order, places


def _build_chain(docs: list[tuple[int, int]], work: list[float], total: torch.Tensor, p: int, c: int, k: int,
                 causal: bool) -> tuple[torch.Tensor, torch.Tensor, list[int]] | None:  # fmt: skip
    """The chain candidate (``layouts.placed.chain``) for ``k`` chunks per rank, as ``_build`` returns it."""
    if not causal:
        return None
    segments = chain_segments(docs, work, total, p, k * c)
    if segments is None:
        return None
    return (*_lay_out(segments, c), [r for r in range(p) for _ in range(k)])


def _token_work(positions: torch.Tensor, mask: SequenceMask, causal: bool, docs: list[tuple[int, int]],
                tile_costs: Sequence[float]) -> torch.Tensor:  # fmt: skip
    """``[S]`` attention work of each token as the refining pass counts it (``token_costs``), plus its even share
    of its document's diagonal squares when the document is held whole (``square_extra``)."""
    seq_len = positions.shape[-1]
    if not causal:
        return visible_area(mask, seq_len, causal)[:seq_len] / positions.shape[0] * float(tile_costs[0])
    work = token_costs(positions[0], mask, causal, tile_costs)
    tile = tile_size(MASK_TILE, mask)
    extra = [square_extra(0, n, tile, False, causal, tile_costs) / n for _, n in docs]  # where it lands is unknown
    return work + torch.tensor(extra, dtype=torch.float64).repeat_interleave(torch.tensor([n for _, n in docs]))


def placed_layout(
    position_ids: torch.Tensor,
    world_size: int,
    *,
    causal: bool = True,
    window: int | None = None,
    blocks: int | Sequence[tuple[int, int]] | None = None,
    chunk_len: int | None = None,
    key_cost: float = KEY_COST,
    tile_costs: Sequence[float] = TILE_COSTS,
) -> Placement:
    """Place a packed row's documents on ranks (Note [placed layout]).

    Args:
        position_ids: the *global* position ids ``[B, S]`` or ``[S]`` (restarting at 0 at each packed document).
        world_size: the sequence-parallel degree P.
        causal: whether attention is causal (False: bidirectional documents).
        window: the sliding window the attention uses, or None.
        blocks: block-causal blocks (the row is then not reordered), or None.
        chunk_len: tokens per chunk; None picks about a 32nd of ``S/P``.
        key_cost: the refining pass's score of one token of K/V traffic, in attention scores.
        tile_costs: cost per score of a plain tile, a causal square and a masked tile (``TILE_COSTS``).

    Returns:
        A ``Placement``: the order of the placed row, its position ids and its ``ChunkLayout``.

    Raises:
        SeqparInputError: ids that are not packed ids, or a world size below 1.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise SeqparInputError(f"world_size must be a positive integer, got {world_size!r}")
    positions = position_ids[None] if position_ids.dim() == 1 else position_ids
    mask = sequence_mask(positions, None, layout="contiguous", window=window, blocks=blocks)  # checks the ids
    seq_len = positions.shape[-1]
    positions = positions.cpu().long()
    same_rows = bool((positions == positions[:1]).all())
    if blocks is not None or not same_rows or int(positions[0, 0]) != 0:  # not reordered (Note [placed layout])
        pad = -seq_len % (2 * world_size)
        padded = torch.cat([positions, torch.arange(pad).expand(positions.shape[0], pad)], 1)
        solved = balanced_layout(padded, world_size, causal=causal, window=window, blocks=blocks)
        order = torch.cat([torch.arange(seq_len), torch.full((pad,), -1)]).expand(positions.shape[0], -1)
        return Placement(order, padded, ChunkLayout(solved.chunk_ids, name="placed"))
    c = chunk_len or chunk_length(seq_len, world_size)
    k_min = math.ceil(seq_len / (world_size * c))
    docs = _documents(positions[0])
    options = [k_min] + ([k_min + 1] if (k_min + 1) * c * world_size <= TOKEN_SLACK * seq_len else [])
    tok_work = _token_work(positions, mask, causal, docs, tile_costs)
    total = torch.cat([tok_work.new_zeros(1), tok_work.cumsum(0)])  # [S + 1] cumulative work
    bounds = torch.tensor([[s, s + n] for s, n in docs])
    work = (total[bounds[:, 1]] - total[bounds[:, 0]]).tolist()  # each document's
    # every document within S / (2P): the candidates hold them whole (no K/V between ranks) and are not refined;
    # the one with the least traffic, then the most even, wins (Note [placed layout])
    short = causal and 2 * world_size * max(n for _, n in docs) <= seq_len
    builds = [lambda k=k: _build(docs, work, tok_work, world_size, c, k, window, causal, short) for k in options]
    builds.append(lambda: _build_chain(docs, work, total, world_size, c, options[-1], causal))  # it needs padding
    best = None
    for build in builds:  # each candidate refined
        built = build()
        if built is None:
            continue
        order, placed, owner = built
        k = len(owner) // world_size
        refiner = Refiner(placed, c, owner, causal, window, key_cost, tile_costs, BALANCE_SLACK)
        owner = owner if short else refiner.run(REFINE_ROUNDS)
        over, traffic = max(refiner.load) > refiner.cap * (1 + 1e-9), max(refiner.traffic)
        key = (traffic, over) if short else (over, traffic)  # short documents: no traffic first, then the balance
        if best is None or (*key, max(refiner.load), k) < best[0]:
            best = ((*key, max(refiner.load), k), order, placed, owner)
        if not over and traffic == 0:  # even and silent: no candidate can do better
            break
    _, order, placed, owner = best
    ids = tuple(tuple(g for g, r in enumerate(owner) if r == rank) for rank in range(world_size))
    rows = positions.shape[0]
    return Placement(order.expand(rows, -1), placed.expand(rows, -1), ChunkLayout(ids, name="placed"))
