"""What ``python -m benchmarks.masks`` compares with: the bytes a rank must send under a mask, and the visible area.

``needed_bytes`` counts, from the mask's own table (Note [mask-aware ring]), the K/V of this rank that some
peer query sees (sent forward and again backward) and the dK/dV of the peers' tokens this rank's queries
saw (sent home), plus the input check; Ulysses moves whole head shards whatever the mask, so its need is
its all-to-all volume. Plain causal counts its true need too (a zigzag ring sends about twice that).
"""

from __future__ import annotations

import torch

from benchmarks.floor import traffic_floor
from benchmarks.strategies import expected_bytes
from seqpar.sequence_parallel.checks import SIGNATURE_LENGTH
from seqpar.sequence_parallel.layouts.chunks import rank_chunk_ids
from seqpar.sequence_parallel.masks.sequence_mask import SequenceMask
from seqpar.sequence_parallel.strategies.registry import strategy_row
from seqpar.sequence_parallel.tiling.kv_needs import kv_needs

__all__ = ["check_bytes", "floor_bytes", "needed_bytes", "visible_fraction"]

_FLOAT32 = 4


def check_bytes(ranks: int) -> int:
    """Bytes every rank sends in the input check whatever the layout: its int64 signature to each peer."""
    return (ranks - 1) * SIGNATURE_LENGTH * 8


def floor_bytes(positions: torch.Tensor, ranks: int, kv_heads: int, head_dim: int) -> float:
    """The least bytes the busiest rank needs under ring or all-gather (fp32), over every placement of the packed
    row ``positions`` ``[S]`` even within 1.05 in work and tokens: ``placement.traffic_floor`` (Note [traffic
    floor]: a sent token counts twice, a received one once) in K and V of one token, plus ``check_bytes``."""
    return check_bytes(ranks) + 2 * kv_heads * head_dim * _FLOAT32 * traffic_floor(positions, ranks)


def _flat_and_ring_ids(strategy: str, cfg: dict, layout: str) -> tuple[tuple[tuple[int, ...], ...], int]:
    """Chunk ids of every rank of the K/V exchange (SP ranks, or hybrid's ring ranks) and the ranks per member."""
    p = cfg["ranks"]
    ids = rank_chunk_ids(layout, p)
    per = len(ids) // p
    u = cfg["ulysses"] if strategy_row(strategy).two_d else 1
    return tuple(tuple(sorted(ids[j * u * per : (j + 1) * u * per])) for j in range(p // u)), u


def needed_bytes(strategy: str, cfg: dict, mask: SequenceMask, layout: str, rank: int) -> float:
    """Bytes SP rank ``rank`` must send in one forward + backward step (fp32) under ``mask``.

    Args:
        strategy: "ring", "allgather", "hybrid" or "ulysses".
        cfg: ranks, ulysses, seq, heads, kv_heads, head_dim (as for ``bench.strategies.expected_bytes``).
        mask: the step's mask (plain causal: a trivial one).
        layout: the sharding layout.
        rank: the SP rank.
    """
    if strategy_row(strategy).kv_exchange is None:  # whole head shards whatever the mask
        return expected_bytes(strategy, cfg)
    p, seq, d = cfg["ranks"], cfg["seq"], cfg["head_dim"]
    chunk_ids, u = _flat_and_ring_ids(strategy, cfg, layout)
    chunk = seq // sum(len(c) for c in chunk_ids)
    causal = mask.blocks is None
    exact = SequenceMask(mask.starts, mask.window or seq, mask.max_position, mask.blocks)  # never trivial
    needs = kv_needs(exact, chunk_ids, chunk, causal)
    sizes = [[chunk * len(chunk_ids[s])] * len(chunk_ids) for s in range(len(chunk_ids))]
    counts = [[len(n) for n in row] for row in needs] if needs is not None else sizes
    me = rank // u
    sent = sum(counts[r][me] for r in range(len(chunk_ids)) if r != me)
    returned = sum(counts[me][s] for s in range(len(chunk_ids)) if s != me)
    kv_heads = cfg["kv_heads"] if cfg["kv_heads"] % u == 0 else u  # copied up for the all-to-all
    ulysses = 0.0
    if u > 1:
        local = seq // p
        ulysses = (u - 1) / u * 4 * (cfg["heads"] + kv_heads) * local * d * _FLOAT32
    return check_bytes(p) + ulysses + 2 * (kv_heads // u) * d * _FLOAT32 * (2 * sent + returned)


def visible_fraction(positions: torch.Tensor, window: int | None, block: int | None) -> float:
    """Visible (query, key) pairs of one row under documents, window and blocks, relative to plain causal.

    Args:
        positions: ``[S]`` global position ids (restarting at 0 at each document).
        window: sliding window, or None.
        block: block-causal block size, or None.
    """
    s = positions.shape[0]
    starts = torch.arange(s) - positions
    j = torch.arange(s)[None, :]
    seen = 0
    for lo in range(0, s, 1024):  # rows a slab at a time: [1024, S] at most
        i = torch.arange(lo, min(lo + 1024, s))[:, None]
        keep = starts[i] == starts[j]
        keep &= (j // block <= i // block) if block else (j <= i)
        if window:
            keep &= i - j < window
        seen += int(keep.sum())
    return seen / (s * (s + 1) / 2)
