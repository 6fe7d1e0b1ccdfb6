"""Bytes each rank writes to its sockets in one step equal each strategy's analytical volume (within 1%).

Uneven head splits (Note [uneven heads]) are checked rank by rank.

Read from /proc/self/io (the kernel's count), so an extra or larger transfer anywhere fails this test. The
expected volumes are worked out here from the algorithms, independently of the code under test.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

import seqpar
from seqpar.runtime.memory import written_bytes
from seqpar.sequence_parallel.strategies.registry import strategy_row
from tests._dist import run_ranks

RANKS, ULYSSES, SEQ, HEADS, HEAD_DIM = 4, 2, 2048, 8, 64
FLOAT32 = 4  # bytes per element: inputs, outputs and the float32 dK/dV partials alike
SIGNATURE_INTS = 26  # int64 values in one rank's input signature: 8 options + 6 per tensor for q, k, v


def _analytical_bytes(strategy: str, kv_heads: int) -> float:
    """Bytes one rank sends in one causal forward + backward step, from each algorithm's own arithmetic."""
    p = RANKS
    local = SEQ // p  # tokens per rank
    q_bytes = HEADS * local * HEAD_DIM * FLOAT32  # one [1, H, S/P, D] tensor: q, out, dout or dq

    def sent_kv_heads(degree: int) -> int:
        """KV heads on the wire around an all-to-all over ``degree`` ranks: too few to divide are copied up."""
        return kv_heads if kv_heads % degree == 0 else degree

    def kv_bytes(degree: int) -> int:
        """One local K (or V, dK, dV) tensor with ``sent_kv_heads(degree)`` heads."""
        return sent_kv_heads(degree) * local * HEAD_DIM * FLOAT32

    # The input check: a gloo all-gather of SIGNATURE_INTS int64 per rank; each rank forwards P - 1 rows.
    check = (p - 1) * SIGNATURE_INTS * 8
    if strategy == "ring":
        # K and V go P - 1 hops forward and again backward; dK and dV travel P hops to get home.
        return check + (p - 1) * 4 * kv_bytes(1) + p * 2 * kv_bytes(1)
    if strategy == "ulysses":
        # An all-to-all keeps 1/P of each tensor. Forward q, k, v, out and backward dout, dq, dk, dv: four
        # tensors of each size. With more than one KV head per rank after the exchange the heads go in groups,
        # and the backward exchanges q, k, v and out once more: six of each size.
        pairs = 6 if sent_kv_heads(p) > p else 4
        return check + (p - 1) / p * pairs * (q_bytes + kv_bytes(p))
    if strategy == "hybrid":
        # All-to-all inside U ranks (four tensors of each size, no head groups), then a ring of R = P / U
        # ranks over the head-sharded tensors each rank then holds.
        u = ULYSSES
        r = p // u
        ulysses = (u - 1) / u * (4 * q_bytes + 4 * kv_bytes(u))
        return check + ulysses + (r - 1) * 4 * kv_bytes(u) + r * 2 * kv_bytes(u)
    if strategy == "allgather":
        # K and V are gathered forward and again backward (P - 1 chunks each time); gloo reduce-scatters
        # the P-times larger dK and dV as a ring all-reduce: 2 (P - 1) / P of the whole tensor.
        gathers = 2 * (p - 1) * 2 * kv_bytes(1)
        return check + gathers + 2 * (p - 1) / p * (p * 2 * kv_bytes(1))
    raise ValueError(strategy)


def _uneven_bytes(strategy: str, heads: int, kv_heads: int, rank: int) -> float:
    """Bytes ``rank`` sends when the all-to-all's degree does not split the heads evenly (Note [uneven heads])."""
    degree = RANKS if strategy == "ulysses" else ULYSSES
    base, extra = divmod(heads, degree)
    group = heads // kv_heads  # query heads per KV head
    shares, start = [], 0  # per all-to-all rank: (query heads, KV heads, KV heads held after the exchange)
    for r in range(degree):
        n = base + (r < extra)  # the first heads % degree ranks take one more
        reads = [(start + i) // group for i in range(n)]
        kv = len(set(reads))
        even = len({reads.count(j) for j in set(reads)}) == 1  # every KV head read by as many of its heads
        shares.append((n, kv, kv if even else n))  # else copied up to one per query head after the exchange
        start += n
    n, m, held = shares[rank % degree]
    wire = sum(kv for _, kv, _ in shares)  # a KV head read by two ranks goes to both
    # q and out, dout and dq: the shard's other ranks' heads out, then P - 1 chunks of its own heads back; k, v
    # out and dk, dv back alike
    heads_sent = 2 * (heads - n) + 2 * (degree - 1) * n + 2 * (wire - m) + 2 * (degree - 1) * m
    local = SEQ // RANKS
    total = (RANKS - 1) * SIGNATURE_INTS * 8 + heads_sent * local * HEAD_DIM * FLOAT32
    if strategy == "hybrid":  # the ring over R carries the KV heads the rank holds, for U x its tokens
        r, kv_tensor = RANKS // degree, held * degree * local * HEAD_DIM * FLOAT32
        total += (r - 1) * 4 * kv_tensor + r * 2 * kv_tensor
    return total


def _bytes_worker(rank, world_size, kv_heads, strategy, heads=HEADS):
    mesh = seqpar.make_mesh(ulysses_size=ULYSSES) if strategy == "hybrid" else seqpar.make_mesh()
    s = SEQ // world_size
    q = torch.randn(1, heads, s, HEAD_DIM, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, s, HEAD_DIM, requires_grad=True) for _ in "kv")
    dist.barrier()
    before = written_bytes()
    seqpar.attention(q, k, v, mesh=mesh, strategy=strategy).sum().backward()
    sent = written_bytes() - before
    want = _analytical_bytes(strategy, kv_heads) if heads == HEADS else _uneven_bytes(strategy, heads, kv_heads, rank)
    what = f"{strategy} heads={heads} kv_heads={kv_heads} rank {rank}"
    assert abs(sent / want - 1) < 0.01, f"{what}: sent {sent} bytes, expected {want}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/io")
@pytest.mark.parametrize("strategy", ["ring", "ulysses", "hybrid", "allgather"])
@pytest.mark.parametrize("kv_heads", [2, 8])
def test_bytes_sent_match_analytical_volume(kv_heads, strategy):
    run_ranks(RANKS, _bytes_worker, kv_heads, strategy)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/io")
@pytest.mark.parametrize(("strategy", "heads", "kv_heads"), [("ulysses", 6, 2), ("ulysses", 14, 2), ("hybrid", 6, 3)])
def test_uneven_heads_bytes_sent_match_analytical_volume(strategy, heads, kv_heads):
    """Every rank's own bytes: ceil(H/P) heads on some, KV heads shared between neighbours, copies for the ring; the
    registry's bytes model (what "auto" and the planner read) is the busiest rank's."""
    run_ranks(RANKS, _bytes_worker, kv_heads, strategy, heads)
    busiest = max(_uneven_bytes(strategy, heads, kv_heads, r) for r in range(RANKS)) - (RANKS - 1) * SIGNATURE_INTS * 8
    model = strategy_row(strategy).bytes_sent(heads, kv_heads, RANKS, ULYSSES, SEQ // RANKS, HEAD_DIM, FLOAT32)
    assert model == pytest.approx(busiest, rel=1e-12)
