"""Refining a placed row: exchanging chunks between ranks while the largest rank's score falls.

The second pass of Note [placed layout]: the row's order is fixed, only which rank holds each chunk changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from seqpar.sequence_parallel.layouts.balanced import visible_area
from seqpar.sequence_parallel.masks.sequence_mask import SequenceMask
from seqpar.sequence_parallel.tiling.tiles import MASK_TILE, square_parts, tile_size

OVER = 1000.0
"""Weight of planned work above the balance target: evening the work comes first (Note [placed layout])."""
PASSES = 10
"""The most refining passes, each under a balance target set from the mean the previous one left."""
_CANDIDATES = 8
"""Exchanges scored exactly per round (the most promising by loads and guessed traffic)."""


def square_extra(lo: int, hi: int, tile: int, grid: bool, causal: bool, tile_costs: Sequence[float]) -> float:
    """Work a rank's piece ``[lo, hi)`` of one document (consecutive tokens of one run) costs beyond its visible
    area at the plain cost: the planner cuts it into tiles (Note [masked tiles]: ``ceil((hi - lo) / tile)``
    even pieces, or at the multiples of ``tile`` when ``grid``) whose diagonal squares cost their diagonal
    blocks at the causal square's cost and the blocks below at the plain cost (``tiles.square_parts``;
    nothing when not causal: they are plain)."""
    if not causal or hi <= lo:
        return 0.0
    if grid:  # a head to the first multiple, whole tiles, a tail
        head, tail = min(hi, (lo // tile + 1) * tile) - lo, hi - max(lo, hi // tile * tile)
        sides = [(head, 1), (tile, max(0, (hi - lo - head - tail) // tile)), (tail, 1 if hi // tile * tile > lo else 0)]
    else:  # ceil(n / tile) even pieces: some of n // pieces tokens, the rest one longer
        pieces = -(-(hi - lo) // tile)
        short, longer = (hi - lo) // pieces, (hi - lo) % pieces
        sides = [(short, pieces - longer), (short + 1, longer)]
    plain, square = float(tile_costs[0]), float(tile_costs[1])

    def extra(t: int) -> float:
        diagonal, below = square_parts(t)
        return square * diagonal + plain * below - plain * t * (t + 1) / 2

    return sum(count * extra(t) for t, count in sides if t > 0)


def token_costs(positions: torch.Tensor, mask: SequenceMask, causal: bool, tile_costs: Sequence[float]) -> torch.Tensor:
    """``[S]`` float64: each token's visible keys at the plain cost, plus, with a causal window, the masked tile
    the band's edge crosses (``chunk_costs``); diagonal squares are not in it (``square_extra``).

    ``positions`` is one row ``[S]``; ``mask`` is that row's (its window sets the tiles).
    """
    seq, window = positions.shape[-1], mask.window
    plain, masked = float(tile_costs[0]), float(tile_costs[2])
    if not causal:
        return visible_area(mask, seq, causal) * plain
    per_token = (positions + 1).clamp(max=window or seq).double() * plain  # its document's keys, up to the window
    if window is not None:
        tile = tile_size(MASK_TILE, mask)
        per_token += (positions >= window).double() * (masked * tile - plain * (tile - 1) / 2)
    return per_token


def chunk_costs(positions: torch.Tensor, mask: SequenceMask, chunk: int, causal: bool,
                tile_costs: Sequence[float]) -> torch.Tensor:  # fmt: skip
    """``[S' / chunk]`` float64: the work of each chunk that does not depend on which rank holds its neighbours.

    Its visible area at the plain cost, plus the diagonal squares of the documents that lie inside it
    (``square_extra``); a document over several chunks adds its squares per rank (``Refiner``). Exact without
    a window. With a causal window, a query tile a window or more into its document also computes the masked
    tile the band's edge crosses, whole: each such token adds that tile's width at the masked cost, less the
    half of it it sees (tiles on the grid of a long run; a run's ends move the grid, so this is approximate).
    """
    seq, tile = positions.shape[0], tile_size(MASK_TILE, mask)
    cost = token_costs(positions, mask, causal, tile_costs).view(-1, chunk).sum(1)
    first = (positions == 0).nonzero().flatten().tolist()
    for a, b in zip(first, [*first[1:], seq]):
        if a // chunk == (b - 1) // chunk:
            cost[a // chunk] += square_extra(a, b, tile, mask.window is not None, causal, tile_costs)
    return cost


class Refiner:
    """Per-rank planned work and K/V traffic of one placed row, and the exchanges that lower the largest score.

    A rank's score: its planned work (at least ``slack`` of the mean), ``OVER`` per unit of work above that,
    and ``key_cost`` per token of traffic (keys it sends count twice: forward and backward, those it
    receives once: their gradients go home).

    Args:
        positions: ``[S']`` position ids of the placed row (documents restart at 0).
        chunk: tokens per chunk.
        owner: the rank of each chunk.
        causal: whether attention is causal.
        window: the sliding window, or None.
        key_cost: the score of one token of traffic.
        tile_costs: cost per score of a plain tile, a causal square and a masked tile.
        slack: planned work up to this times the mean costs nothing extra (the balance aimed at).
    """

    def __init__(self, positions: torch.Tensor, chunk: int, owner: list[int], causal: bool, window: int | None,
                 key_cost: float, tile_costs: Sequence[float], slack: float) -> None:  # fmt: skip
        seq = positions.shape[0]
        mask = SequenceMask((torch.arange(seq) - positions)[None], window, int(positions.max()))
        self.cost = chunk_costs(positions, mask, chunk, causal, tile_costs)
        self.tile, self.tile_costs = tile_size(MASK_TILE, mask), tile_costs
        self.costs = self.cost.tolist()
        self.owner, self.p, self.key_cost = list(owner), max(owner) + 1, key_cost
        self.causal, self.window = causal, window
        first = (positions == 0).nonzero().flatten().tolist()
        # documents over two chunks or more: the only ones whose keys can travel
        self.docs = [(a, b) for a, b in zip(first, [*first[1:], seq]) if a // chunk != (b - 1) // chunk]
        self.segments = [
            [(g, max(a, g * chunk), min(b, g * chunk + chunk)) for g in range(a // chunk, (b - 1) // chunk + 1)]
            for a, b in self.docs
        ]
        self.of_chunk: list[list[int]] = [[] for _ in owner]
        # traffic a chunk's move is likely to add: to its new rank (the document's keys before it, then
        # sending it back for the rest) and to its old one (sending those keys, receiving it)
        to_new, to_old = [0.0] * len(owner), [0.0] * len(owner)
        for d, ((a, b), segs) in enumerate(zip(self.docs, self.segments)):
            for g, lo, hi in segs:
                self.of_chunk[g].append(d)
                before = (lo - a if window is None else min(lo - a, window - 1)) if causal else b - a - (hi - lo)
                after = float(hi < b or not causal)
                to_new[g] += before + 2 * (hi - lo) * after
                to_old[g] += 2 * before + (hi - lo) * after
        self.to_new, self.to_old = torch.tensor(to_new, dtype=torch.float64), torch.tensor(to_old, dtype=torch.float64)
        self.load, self.traffic = [0.0] * self.p, [0.0] * self.p
        for g, r in enumerate(owner):
            self.load[r] += self.costs[g]
        self.memo: dict[tuple, tuple[dict[int, float], dict[int, float]]] = {}
        self.squares: dict[tuple[int, int], float] = {}
        self.contrib = [self._terms(d, self.owner) for d in range(len(self.docs))]
        for traffic, extra in self.contrib:
            for r, t in traffic.items():
                self.traffic[r] += t
            for r, x in extra.items():
                self.load[r] += x
        self.slack = slack
        self.cap = sum(self.load) / self.p * slack

    def _terms(self, d: int, owner: list[int]) -> tuple[dict[int, float], dict[int, float]]:
        """Tokens of traffic document ``d`` gives each rank (twice the keys it sends, once those it receives),
        and the work its pieces' diagonal squares add to each rank (``square_extra``). Kept per pattern of its
        chunks' ranks: the same exchanges are scored again round after round."""
        first, last = self.segments[d][0][0], self.segments[d][-1][0]
        key = (d, tuple(owner[first : last + 1]))
        if key not in self.memo:
            self.memo[key] = self._count(d, owner)
        return self.memo[key]

    def _count(self, d: int, owner: list[int]) -> tuple[dict[int, float], dict[int, float]]:
        start, end = self.docs[d]
        runs: list[list[int]] = []  # [rank, lo, hi]: consecutive tokens on one rank, one run of its chunks
        for g, lo, hi in self.segments[d]:
            if runs and runs[-1][0] == owner[g]:
                runs[-1][2] = hi
            else:
                runs.append([owner[g], lo, hi])
        extra: dict[int, float] = {}
        grid = self.window is not None
        for r, lo, hi in runs:
            shape = (lo % self.tile if grid else 0, hi - lo)  # all a piece's squares depend on
            if shape not in self.squares:
                self.squares[shape] = square_extra(shape[0], sum(shape), self.tile, grid, self.causal, self.tile_costs)
            extra[r] = extra.get(r, 0.0) + self.squares[shape]
        if len(runs) == 1:
            return {}, extra
        span: dict[int, list[int]] = {}  # rank -> [first, last (exclusive), held]
        for r, lo, hi in runs:
            s = span.setdefault(r, [lo, hi, 0])
            s[1], s[2] = hi, s[2] + hi - lo
        need = {}  # the keys of the document some query of the rank sees (one interval)
        for r, (lo, hi, _) in span.items():
            if not self.causal:
                need[r] = (start, end)
            else:
                need[r] = (start if self.window is None else max(start, lo - self.window + 1), hi)
        out = {r: float(need[r][1] - need[r][0] - held) for r, (_, _, held) in span.items()}
        for r, lo, hi in runs:
            for s, (a, b) in need.items():
                if s != r and hi > a and lo < b:
                    out[r] += 2.0 * (min(hi, b) - max(lo, a))
        return out, extra

    def score(self, load: float, traffic: float) -> float:
        """One rank's score from its planned work and traffic."""
        return max(load, self.cap) + OVER * max(load - self.cap, 0.0) + self.key_cost * traffic

    def scores(self) -> list[float]:
        """Every rank's score."""
        return [self.score(x, t) for x, t in zip(self.load, self.traffic)]

    def _exchange(self, a: int, b: int) -> tuple[list[float], list[tuple[int, dict[int, float]]]]:
        """Scores after exchanging chunks ``a`` and ``b`` (not applied), and the changed documents' traffic."""
        owner = self.owner
        ra, rb = owner[a], owner[b]
        owner[a], owner[b] = rb, ra
        changed = [(d, self._terms(d, owner)) for d in {*self.of_chunk[a], *self.of_chunk[b]}]
        owner[a], owner[b] = ra, rb
        load, traffic = self._apply(a, b, changed, list(self.load), list(self.traffic))
        return [self.score(x, t) for x, t in zip(load, traffic)], changed

    def _apply(self, a: int, b: int, changed: list, load: list[float], traffic: list[float]) -> tuple[list, list]:
        """``load`` and ``traffic`` (in place) once chunks ``a`` and ``b`` change ranks and the documents of
        ``changed`` take their new terms."""
        for d, terms in changed:
            for old, new, into in zip(self.contrib[d], terms, (traffic, load)):
                for r, x in old.items():
                    into[r] -= x
                for r, x in new.items():
                    into[r] += x
        delta = self.costs[a] - self.costs[b]
        load[self.owner[a]] -= delta
        load[self.owner[b]] += delta
        return load, traffic

    def _candidates(self, top: int, owner_t: torch.Tensor) -> list[tuple[int, int]]:
        """The exchanges of a chunk of ``top`` with another rank's that look best (loads and guessed traffic)."""
        mine, other = (owner_t == top).nonzero().flatten(), (owner_t != top).nonzero().flatten()
        if not len(other):
            return []
        load, traffic = torch.tensor(self.load, dtype=torch.float64), torch.tensor(self.traffic, dtype=torch.float64)
        delta = self.cost[mine][:, None] - self.cost[other][None]

        def score(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return x.clamp(min=self.cap) + OVER * (x - self.cap).clamp(min=0) + self.key_cost * t

        theirs = owner_t[other][None]
        guess = torch.maximum(
            score(load[top] - delta, traffic[top] + self.to_old[mine][:, None] + self.to_new[other][None]),
            score(load[theirs] + delta, traffic[theirs] + self.to_new[mine][:, None] + self.to_old[other][None]),
        ).flatten()
        best = guess.topk(min(_CANDIDATES, len(guess)), largest=False).indices.tolist()
        return [(int(mine[i // len(other)]), int(other[i % len(other)])) for i in best]

    def run(self, rounds: int) -> list[int]:
        """Exchange chunks while the largest score falls (at most ``rounds`` times in all); returns the owners.

        The balance target stays fixed during a pass: a cut document's pieces cost less than the whole (smaller
        diagonal squares), so the mean falls as documents are cut, and a moving target would turn every cut into
        a new excess elsewhere. Between passes the target is set from the new mean, while that leaves a rank
        above it (at most ``PASSES`` passes).
        """
        owner_t = torch.tensor(self.owner)
        for _ in range(PASSES):
            rounds -= self._pass(rounds, owner_t)
            cap = sum(self.load) / self.p * self.slack
            settled = max(self.load) <= cap * (1 + 1e-12) or abs(cap - self.cap) <= 1e-12 * cap
            self.cap = cap
            if settled or rounds <= 0:
                break
        return self.owner

    def _pass(self, rounds: int, owner_t: torch.Tensor) -> int:
        """Exchanges under the current target while the largest score falls; returns how many were made."""
        for done in range(rounds):
            score = self.scores()
            top = max(range(self.p), key=lambda r: (score[r], -r))
            current, best = score[top], None
            if current <= self.cap * (1 + 1e-12) and not any(self.traffic):
                return done  # even and silent: nothing to gain
            for a, b in self._candidates(top, owner_t):
                new, changed = self._exchange(a, b)
                # the top rank falls and no rank rises to it: several ranks at the top fall one by one
                pair = max(new[top], new[self.owner[b]])
                value = (max(new), pair)
                if pair < current * (1 - 1e-9) and value[0] <= current and (best is None or value < best[0]):
                    best = (value, a, b, changed)
            if best is None:
                return done
            _, a, b, changed = best
            ra, rb = self.owner[a], self.owner[b]
            self._apply(a, b, changed, self.load, self.traffic)
            for d, terms in changed:
                self.contrib[d] = terms
            self.owner[a], self.owner[b] = rb, ra
            owner_t[a], owner_t[b] = rb, ra
        return rounds
