"""The traffic floor (Note [traffic floor]) is a lower bound: no placement even within the slacks moves less.

Checked against every placement of small rows (brute force) and against the zigzag, balanced and placed
layouts of larger rows, each at the balance it actually reaches.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import seqpar
from benchmarks.floor import traffic_floor
from benchmarks.rows import log_normal_documents, uneven_documents
from seqpar.errors import SeqparInputError
from seqpar.sequence_parallel.layouts.chunks import rank_chunk_ids
from seqpar.sequence_parallel.tiling.kv_needs import global_tokens


def _documents(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])


def _traffic(positions: torch.Tensor, owner: list[int], p: int) -> list[int]:
    """Each rank's traffic in tokens: every key a peer's later query of its document sees, sent twice by its
    holder and received once by the peer."""
    doc = ((positions == 0).long().cumsum(0) - 1).tolist()
    last: dict[tuple[int, int], int] = {}
    for j, r in enumerate(owner):
        last[doc[j], r] = j
    out = [0] * p
    for j, r in enumerate(owner):
        for s in range(p):
            if s != r and last.get((doc[j], s), -1) > j:
                out[r], out[s] = out[r] + 2, out[s] + 1
    return out


def _planned(positions: torch.Tensor, owner: list[int], p: int) -> list[float]:
    """Each rank's planned work with one-token chunks (``planner.plan_cost`` under ``TILE_COSTS``): its queries'
    visible keys, plus per piece (consecutive tokens of one document on one rank) its causal square's
    whole diagonal (a piece under 512 tokens is computed whole: ``(t * t - t) / 2`` more)."""
    load = [0.0] * p
    for j, r in enumerate(owner):
        load[r] += float(positions[j] + 1)
    start = 0
    for j in range(1, len(owner) + 1):
        if j == len(owner) or owner[j] != owner[start] or positions[j] == 0:
            t = j - start
            load[owner[start]] += (t * t - t) / 2
            start = j
    return load


def _best_by_search(positions: torch.Tensor, p: int, slack: float, token_slack: float) -> int:
    """The least busiest-rank traffic over every token-to-rank assignment even within the slacks."""
    seq = positions.numel()
    tokens = token_slack * seq / p
    best = None
    for owner in itertools.product(range(p), repeat=seq):
        load = _planned(positions, list(owner), p)
        if max(load) > slack * sum(load) / p + 1e-9 or max(owner.count(r) for r in range(p)) > tokens + 1e-9:
            continue
        top = max(_traffic(positions, list(owner), p))
        best = top if best is None else min(best, top)
    assert best is not None
    return best


def test_one_document_over_two_ranks_by_hand():
    # 8 tokens on 2 ranks of 4: the mean is at most (36 visible + 8 * 3.5 square) / 2 = 32, so the tokens
    # after the second rank's last one start at x_1 = 4 at the earliest (26 of work; from 3 they would be 5
    # tokens on one rank): the floor is max(8 - 4 tokens beyond a rank's, 3 * 4 / 2) = 6
    positions = torch.arange(8)
    assert traffic_floor(positions, 2, slack=1.0, token_slack=1.0) == 6.0
    assert _best_by_search(positions, 2, 1.0, 1.0) >= 6


@pytest.mark.parametrize(
    ("lengths", "p", "slack", "token_slack"),
    [([12], 2, 1.0, 1.0), ([9, 3], 2, 1.05, 1.0), ([14], 2, 1.1, 1.0), ([9], 3, 1.05, 1.0), ([6, 3], 3, 1.2, 1.0)],
)
def test_floor_is_below_every_even_placement_of_small_rows(lengths, p, slack, token_slack):
    positions = _documents(lengths)
    floor = traffic_floor(positions, p, slack, token_slack)
    assert 0 < floor <= _best_by_search(positions, p, slack, token_slack)


def _layout_traffic(row: torch.Tensor, layout, p: int) -> tuple[list[int], int]:
    """Traffic per rank of ``row`` cut by ``layout``, and its busiest rank's tokens."""
    ids = [rank_chunk_ids(layout, p, r) for r in range(p)]
    chunk = row.numel() // sum(len(x) for x in ids)
    owner = [0] * row.numel()
    for r, chunks in enumerate(ids):
        for t in global_tokens(chunks, chunk).tolist():
            owner[t] = r
    return _traffic(row, owner, p), max(len(x) for x in ids) * chunk


@pytest.mark.parametrize("p", [2, 3, 4])
def test_floor_is_below_the_layouts_of_packed_rows(p):
    seq = 4800
    for positions in (log_normal_documents(seq, 1, seq // 16), uneven_documents(seq, 9)):
        placement = seqpar.placed_layout(positions, p)
        rows = [(positions, "zigzag"), (positions, seqpar.balanced_layout(positions, p))]
        rows.append((placement.position_ids[0], placement.layout))
        for row, layout in rows:
            traffic, top_tokens = _layout_traffic(row, layout, p)
            balance = seqpar.layout_balance(row, layout, p).planned_max_over_mean
            slack, token_slack = max(1.0, balance), max(1.0, top_tokens * p / seq)
            assert traffic_floor(positions, p, slack, token_slack) <= max(traffic), (p, str(layout))
    # the SFT-like row of python -m benchmarks.masks at P = 4: one document holds most of the work, and no placement
    # even within 1.05 needs much less than zigzag, whose busiest rank does twice the mean work
    positions = log_normal_documents(8192, 0, 512)
    zigzag, _ = _layout_traffic(positions, "zigzag", 4)
    assert traffic_floor(positions, 4) >= 0.8 * max(zigzag)


def test_bad_input_is_refused():
    with pytest.raises(SeqparInputError, match="one row"):
        traffic_floor(torch.arange(8)[None], 2)
    with pytest.raises(SeqparInputError, match="count up"):
        traffic_floor(torch.tensor([0, 1, 3]), 2)
    with pytest.raises(SeqparInputError, match="slack"):
        traffic_floor(torch.arange(8), 2, slack=0.9)
