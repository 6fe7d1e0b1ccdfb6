"""Refining a placed row: exchanging chunks between ranks while the largest rank's score falls.

The second pass of Note [placed layout]: the row's order is fixed, only which rank holds each chunk changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from seqpar.strategies.masking import SequenceMask
from seqpar.strategies.tiles import tile_kinds, tile_size

__all__ = ["Refiner", "chunk_costs"]

OVER = 1000.0
"""Weight of planned work above the balance target: evening the work comes first (Note [placed layout])."""
_CANDIDATES = 8
"""Exchanges scored exactly per round (the most promising by loads and guessed traffic)."""


def chunk_costs(positions: torch.Tensor, chunk: int, causal: bool, window: int | None,
                tile_costs: Sequence[float]) -> torch.Tensor:  # fmt: skip
    """``[S' / chunk]`` float64: each chunk's planned work (``balanced.planned_work`` weighted by ``tile_costs``).

    The same tiles and kinds as the planner, all chunks at once (one ``tile_kinds`` call over the row's tiles).
    """
    seq = positions.shape[0]
    mask = SequenceMask((torch.arange(seq) - positions)[None], window, int(positions.max()))
    tile = tile_size(chunk, mask)
    offsets = torch.arange(0, chunk, tile)
    lo = (torch.arange(seq // chunk)[:, None] * chunk + offsets[None]).flatten()
    hi = torch.minimum(lo + tile, (lo // chunk + 1) * chunk) - 1
    size = (hi - lo + 1).double()
    weight = torch.tensor([0.0, *tile_costs], dtype=torch.float64)  # SKIP, FULL, CAUSAL, MIXED
    per_tile = (weight[tile_kinds(lo, hi, lo, hi, causal, mask)] * size[None]).sum(1) * size
    return per_tile.view(-1, len(offsets)).sum(1)


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
        self.cost = chunk_costs(positions, chunk, causal, window, tile_costs)
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
        self.load = [0.0] * self.p
        for g, r in enumerate(owner):
            self.load[r] += self.costs[g]
        self.cap = sum(self.load) / self.p * slack
        self.contrib = [self._traffic(d, self.owner) for d in range(len(self.docs))]
        self.traffic = [0.0] * self.p
        for row in self.contrib:
            for r, t in row.items():
                self.traffic[r] += t

    def _traffic(self, d: int, owner: list[int]) -> dict[int, float]:
        """Tokens of traffic document ``d`` gives each rank (twice the keys it sends, once those it receives)."""
        start, end = self.docs[d]
        runs: list[list[int]] = []  # [rank, lo, hi]: consecutive tokens on one rank
        for g, lo, hi in self.segments[d]:
            if runs and runs[-1][0] == owner[g]:
                runs[-1][2] = hi
            else:
                runs.append([owner[g], lo, hi])
        if len(runs) == 1:
            return {}
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
        return out

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
        changed = [(d, self._traffic(d, owner)) for d in {*self.of_chunk[a], *self.of_chunk[b]}]
        owner[a], owner[b] = ra, rb
        traffic, load = list(self.traffic), list(self.load)
        for d, row in changed:
            for r, t in self.contrib[d].items():
                traffic[r] -= t
            for r, t in row.items():
                traffic[r] += t
        delta = self.costs[a] - self.costs[b]
        load[ra] -= delta
        load[rb] += delta
        return [self.score(x, t) for x, t in zip(load, traffic)], changed

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
        """Exchange chunks while the largest score falls (at most ``rounds`` times); returns the owners."""
        owner_t = torch.tensor(self.owner)
        for _ in range(rounds):
            score = self.scores()
            top = max(range(self.p), key=lambda r: (score[r], -r))
            current, best = score[top], None
            if current <= self.cap * (1 + 1e-12) and not any(self.traffic):
                break  # even and silent: nothing to gain
            for a, b in self._candidates(top, owner_t):
                new, changed = self._exchange(a, b)
                # the top rank falls and no rank rises to it: several ranks at the top fall one by one
                pair = max(new[top], new[self.owner[b]])
                value = (max(new), pair)
                if pair < current * (1 - 1e-9) and value[0] <= current and (best is None or value < best[0]):
                    best = (value, a, b, changed)
            if best is None:
                break
            _, a, b, changed = best
            ra, rb = self.owner[a], self.owner[b]
            delta = self.costs[a] - self.costs[b]
            self.load[ra] -= delta
            self.load[rb] += delta
            for d, row in changed:
                for r, t in self.contrib[d].items():
                    self.traffic[r] -= t
                for r, t in row.items():
                    self.traffic[r] += t
                self.contrib[d] = row
            self.owner[a], self.owner[b] = rb, ra
            owner_t[a], owner_t[b] = rb, ra
        return self.owner
