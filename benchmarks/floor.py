"""The least K/V traffic any placement of a packed causal row can have while its attention work stays even.

A reference for the placed layout's solver (Note [traffic floor]); ``benchmarks.placement`` and ``masks`` report it.

Note [traffic floor]
    Traffic is counted as the refining pass counts it (Note [placed layout]): a rank sends each of its keys
    that a peer's query sees twice (forward, and again in the backward pass) and receives each peer key its
    queries see once (its gradient goes home). Causal documents, no window. A placement is *even within*
    ``slack`` when no rank's planned work (``planner.plan_cost``) exceeds ``slack`` times the mean. The
    floor bounds that model from both sides, whatever the cuts: a query's planned work is at least its
    visible keys at ``min(plain, square)`` tile cost, and a document's diagonal squares add at most
    ``(square - plain / 2) min(n, 512) - plain / 2`` per token over its visible keys at the plain cost
    (``tiles.square_parts``: a square's diagonal 512-key blocks hold at most 512 of its area per token), so
    the mean is at most the row's visible keys at the plain cost plus that, over ``P``. Padding's own work
    (one chunk-sized square per chunk, a small fraction of a row's) is not counted.
    Take one document of ``n`` tokens and sort the ranks by the last of its tokens they hold:
    ``L_1 >= L_2 >= ... >= L_P`` (0 for a rank holding none). A key ``j`` is needed by every rank other than
    its holder whose last token lies after ``j``, and each such pair costs 3 tokens of traffic (2 sent, 1
    received), so the document costs at least ``3 (L_2 + ... + L_P)`` in all. The tokens after ``L_{i+1}``
    are all held by ranks ``1..i``, so their work and tokens fit ``i`` ranks: ``L_{i+1} >= x_i``, the start
    of the document's longest suffix that does (its work at the lower cost, against ``i`` caps from the
    upper mean, with those ranks filled to the fewest real tokens the token slack leaves them by the row's
    cheapest tokens). Hence:
    - the busiest rank pays at least ``3 / P`` of the sum of ``x_i`` over every document and ``i``;
    - the rank holding a document's last token receives every key of it that it does not hold: at least
      the document's tokens beyond a rank's.
    The larger of the two is the floor. It holds for every placement, whatever its order and chunks, and
    says how far a solver is from the best possible: on a row where one document holds most of the work it
    is close to what the zigzag layout's busiest rank needs while that rank does about twice the mean work,
    so no even placement moves much less than zigzag there (the measured rows: docs/benchmarks.md, "Masks
    and layouts"). It is a bound, not an achievable value: short rows and documents cut over few ranks sit
    well above it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from seqpar.errors import SeqparInputError
from seqpar.sequence_parallel.layouts.balanced import TILE_COSTS
from seqpar.sequence_parallel.masks.sequence_mask import check_packed_positions
from seqpar.sequence_parallel.tiling.tiles import SQUARE_BLOCK

__all__ = ["traffic_floor"]


def _suffix_starts(n: int, ranks: int, cap: float, tokens: tuple[int, int], cheapest: torch.Tensor,
                   low: float) -> list[int]:  # fmt: skip
    """``x_i`` for ``i = 1..ranks-1`` of an ``n``-token causal document (Note [traffic floor]): the least ``x``
    whose suffix ``[x, n)`` fits ``i`` ranks of at most ``tokens[1]`` tokens each and, with the cheapest tokens
    that fill them to ``tokens[0]`` each, ``i`` caps of work (visible keys at the cost ``low``); 0 once the
    whole document fits."""
    held, most = tokens
    x = torch.arange(n + 1, dtype=torch.float64)
    suffix = (n * (n + 1) - x * (x + 1)) / 2
    starts = []
    for i in range(1, ranks):
        fill = (i * held - (n - x)).clamp(min=0, max=cheapest.shape[0] - 1).long()
        fits = ((low * (suffix + cheapest[fill]) <= i * cap) & (n - x <= i * most)).nonzero()
        first = int(fits[0]) if len(fits) else n
        if first == 0:
            break
        starts.append(first)
    return starts


def traffic_floor(position_ids: torch.Tensor, world_size: int, slack: float = 1.05, token_slack: float = 1.05,
                  tile_costs: Sequence[float] = TILE_COSTS) -> float:  # fmt: skip
    """The least traffic of the busiest rank over every placement of a packed causal row even within ``slack``.

    Args:
        position_ids: ``[S]`` global position ids of one packed row (restarting at 0 at each document).
        world_size: the sequence-parallel degree P.
        slack: the most work a rank may hold over the mean (Note [traffic floor]).
        token_slack: the most tokens a rank may hold over the mean ``S/P`` (padding included).
        tile_costs: cost per score of a plain tile and a causal square (``TILE_COSTS``; a third is ignored).

    Returns:
        Tokens of traffic (each key sent counted twice, each received once; Note [traffic floor]).

    Raises:
        SeqparInputError: ids that are not one row of packed position ids, a world size below 1 or a slack below 1.
    """
    if position_ids.dim() != 1 or position_ids.numel() == 0 or int(position_ids[0]) != 0:
        raise SeqparInputError("traffic_floor takes one row [S] of position ids starting at 0")
    if not isinstance(world_size, int) or world_size < 1 or min(slack, token_slack) < 1:
        raise SeqparInputError(
            f"world_size must be >= 1 and both slacks >= 1, got {world_size!r}, {slack!r} and {token_slack!r}"
        )
    ids = position_ids.long()
    check_packed_positions(ids[None])
    starts = [*(ids == 0).nonzero().flatten().tolist(), ids.numel()]
    lengths = [b - a for a, b in zip(starts, starts[1:])]
    plain, square = float(tile_costs[0]), float(tile_costs[1])
    squares = sum(n * max(0.0, (square - plain / 2) * min(n, SQUARE_BLOCK) - plain / 2) for n in lengths)
    cap = slack * (plain * sum(n * (n + 1) / 2 for n in lengths) + squares) / world_size
    seq = ids.numel()
    most = math.floor(token_slack * seq / world_size)  # a rank's tokens, padding included
    held = max(0, seq - (world_size - 1) * most)  # the fewest real tokens a rank can hold
    cheapest = torch.cat([torch.zeros(1, dtype=torch.float64), (ids + 1).double().sort().values.cumsum(0)])
    starts = [_suffix_starts(n, world_size, cap, (held, most), cheapest, min(plain, square)) for n in lengths]
    received = max(0, max(lengths) - most)  # the last token's rank holds at most `most` of its document
    return max(float(received), 3.0 * sum(sum(xs) for xs in starts) / world_size)
