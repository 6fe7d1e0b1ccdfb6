"""Splitting long documents over ranks: contiguous pieces filled from the document's end, or zigzag runs.

The first half of Note [placed layout]; ``seqpar.sequence_parallel.layouts.placed.solver`` calls ``split_long``.
"""

from __future__ import annotations

import math

import torch

FILL_TARGETS = (1.02, 0.96, 0.9)
"""A rank takes a document's chunks from its end while its work, with its free tokens filled as cheaply as the
rest of the row allows, stays within this of the mean; the solver tries them in turn while whole short
documents cannot even the ranks (the refining pass then evens the work to 1.05)."""
WORK_SLACK = 1.05
"""A document with more work than this times a rank's mean work is split."""


class _Zone:
    """The long zone (long documents laid end to end, cut into chunks) and every rank's chunks and work in it."""

    def __init__(self, lengths: list[int], zone_work: list[float], c: int, k: int, p: int, cheap: torch.Tensor):
        self.edges = [0, *torch.tensor(lengths).cumsum(0).tolist()] if lengths else [0]
        self.work, self.c, self.k, self.p = zone_work, c, k, p
        self.cheap = cheap[::c].tolist()  # free and reserved tokens are whole chunks
        self.owner, self.count, self.load = [-1] * len(zone_work), [0] * p, [0.0] * p
        self.reserved = 0  # free chunks of ranks already filled to the budget: the cheapest fill is theirs

    def chunks(self, i: int) -> list[int]:
        """The chunks whose first token belongs to the ``i``-th long document."""
        return list(range(math.ceil(self.edges[i] / self.c), math.ceil(self.edges[i + 1] / self.c)))

    def give(self, ch: int, r: int) -> None:
        self.owner[ch], self.count[r], self.load[r] = r, self.count[r] + 1, self.load[r] + self.work[ch]

    def room(self, r: int, budget: float) -> float:
        """Work rank ``r`` can still take in one more chunk if its other free chunks are then filled with the
        cheapest of the rest."""
        top = len(self.cheap) - 1
        start = min(self.reserved, top)
        free = max(self.k - self.count[r] - 1, 0)
        return budget - self.load[r] - (self.cheap[min(start + free, top)] - self.cheap[start])

    def close(self, r: int) -> None:
        """Rank ``r`` is full to the budget: the cheapest free tokens left go to it."""
        self.reserved += self.k - self.count[r]


def fill_costs(lengths: list[int], work: list[float], padding: int) -> torch.Tensor:
    """``[n]``: the least work that fills ``n`` free tokens with padding, then whole documents by work per token.

    Args:
        lengths: tokens of each document that may fill a rank.
        work: attention work of each.
        padding: padding tokens available (no work).

    Returns:
        float64 ``[padding + sum(lengths) + 1]``, cumulative (a document's work spread over its tokens).
    """
    order = sorted((j for j in range(len(lengths)) if lengths[j]), key=lambda j: (work[j] / lengths[j], j))
    density = torch.tensor([0.0] + [work[j] / lengths[j] for j in order], dtype=torch.float64)
    counts = torch.tensor([padding + 1] + [lengths[j] for j in order])
    return density.repeat_interleave(counts).cumsum(0)


def _from_end(zone: _Zone, chunks: list[int], budget: float) -> None:
    """Contiguous pieces, the last first: a rank takes chunks backwards while it has room, then the next."""
    used: set[int] = set()
    rank = -1
    for ch in reversed(chunks):
        w = zone.work[ch]
        if rank < 0 or zone.count[rank] >= zone.k or zone.room(rank, budget) < w:
            if rank >= 0:
                zone.close(rank)
            free = [r for r in range(zone.p) if zone.count[r] < zone.k]
            fresh = [r for r in free if r not in used] or free
            rank = max(fresh, key=lambda r: (zone.room(r, budget), -r))
            used.add(rank)
        zone.give(ch, rank)


def _runs(zone: _Zone, chunks: list[int], m: int, paired: bool = True) -> None:
    """Equal runs on the ``m`` least loaded ranks with room: ``2m`` runs, runs ``i`` and ``2m-1-i`` on one rank
    (a causal document's zigzag), or ``m`` runs in order when not ``paired``."""
    while True:
        parts = 2 * m if paired else m
        sizes = [len(chunks) // parts + (j < len(chunks) % parts) for j in range(parts)]
        need = max(sizes) * (2 if paired else 1)
        ranks = sorted((r for r in range(zone.p) if zone.k - zone.count[r] >= need),
                       key=lambda r: (zone.load[r], r))[:m]  # fmt: skip
        if len(ranks) == m or m >= zone.p:
            break
        m += 1
    if len(ranks) < m:  # no m ranks with room: each chunk to the least loaded rank with room
        for ch in chunks:
            zone.give(ch, min((r for r in range(zone.p) if zone.count[r] < zone.k), key=lambda r: (zone.load[r], r)))
        return
    at = 0
    for j, size in enumerate(sizes):
        for ch in chunks[at : at + size]:
            zone.give(ch, ranks[min(j, parts - 1 - j) if paired else j])
        at += size


def split_long(
    docs: list[tuple[int, int]], long: list[int], work: list[float], tok_work: torch.Tensor, c: int, k: int,
    p: int, flat: list[bool], cheap: torch.Tensor, target: float = FILL_TARGETS[0],
) -> tuple[list[int], list[int], list[float]]:  # fmt: skip
    """Owners of the long zone's chunks, and each rank's chunk count and work in it (Note [placed layout]).

    A long document that needs at most two ranks, or whose work per token is flat, is cut into contiguous
    pieces from its end (a causal document's tail is its most expensive part per token, so its rank holds
    the fewest of its tokens, and only the tail's rank needs the head's keys); one that needs three ranks or
    more is cut into zigzag runs, which even its work with the fewest pieces.

    Args:
        docs: (start, length) of every document of the row.
        long: the indices of the long documents, in the order they are laid out.
        work: attention work of every document.
        tok_work: ``[S]`` attention work of each token of the row.
        c: tokens per chunk.
        k: chunks per rank.
        p: ranks.
        flat: per long document, whether its work per token is flat (bidirectional, or a short window).
        cheap: ``fill_costs`` of the short documents and the padding.
        target: the work a rank may reach, over the mean, when a document is cut from its end.

    Returns:
        The rank of each chunk of the long zone, and each rank's chunk count and work in it.
    """
    mean = sum(work) / p
    lengths = [docs[d][1] for d in long]
    total = sum(lengths)
    n_chunks = math.ceil(total / c)
    zone = torch.cat([tok_work[docs[d][0] : docs[d][0] + docs[d][1]] for d in long]) if long else tok_work[:0]
    zone_work = torch.nn.functional.pad(zone, (0, n_chunks * c - total)).view(n_chunks, c).sum(1).tolist()
    state = _Zone(lengths, zone_work, c, k, p, cheap)
    for i, d in enumerate(long):
        m = max(1, math.ceil(docs[d][1] / (k * c)), math.ceil(work[d] / (mean * WORK_SLACK)))
        if flat[i] or m <= 2:
            before = (list(state.owner), list(state.count), list(state.load), state.reserved)
            _from_end(state, state.chunks(i), mean * target)
            if flat[i] and len({state.owner[ch] for ch in state.chunks(i)}) > m:  # more ranks than it needs
                state.owner, state.count, state.load, state.reserved = before
                _runs(state, state.chunks(i), m, paired=False)
        else:
            _runs(state, state.chunks(i), m)
    return state.owner, state.count, state.load
