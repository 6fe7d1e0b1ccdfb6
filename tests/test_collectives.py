"""Each strategy issues exactly the collectives it should (counted by the PyTorch profiler on real gloo ops).

A change that adds a hidden gather or an extra ring hop fails here.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import seqpar
from tests._dist import run_ranks

_COLLECTIVES = ("alltoall", "allgather", "reduce_scatter", "send", "recv", "allreduce", "broadcast")


def _count(fn) -> Counter:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counts = Counter()
    for event in prof.events():
        if event.name.startswith("c10d::"):
            op = event.name[len("c10d::") :].strip("_")
            counts[next((c for c in _COLLECTIVES if c in op), op)] += 1
    return counts


def expected(strategy: str, size: int, check_inputs: bool, kv_heads: int, pieces: int = 1) -> Counter:
    check = Counter(allgather=1) if check_inputs else Counter()
    if strategy == "ulysses":  # q, k, v and out forward; dout, dq, dk, dv backward
        groups = kv_heads // size  # per head group: q, k, v, out forward; q, k, v, out, dout, dq, dk, dv backward
        return check + Counter(alltoall=8 if groups == 1 else 12 * groups)
    if strategy == "allgather":  # K/V gathered forward and again backward; dK/dV reduce-scattered
        return check + Counter(allgather=2, reduce_scatter=1)
    # ring: K and V hop P-1 times forward; the backward makes one ring pass per K/V piece, in which K and V
    # hop P-1 times and dK and dV P times (Note [ring backward])
    hops = 2 * (size - 1) + pieces * (2 * (size - 1) + 2 * size)
    return check + Counter(send=hops, recv=hops)


# (strategy, KV heads, local tokens, ring backward pieces): 6-token chunks are not cut; 512-token chunks
# are cut into 2 pieces of 256 on CPU
RUNS = [
    ("ulysses", 3, 12, 1),
    ("ulysses", 6, 12, 1),
    ("ring", 3, 12, 1),
    ("ring", 3, 1024, 2),
    ("allgather", 3, 12, 1),
]


def _count_worker(rank, world_size, run, check_inputs):
    mesh = seqpar.make_mesh()
    strategy, kv_heads, local, pieces = run
    q = torch.randn(1, 6, local, 16, requires_grad=True)
    k = torch.randn(1, kv_heads, local, 16, requires_grad=True)
    v = torch.randn(1, kv_heads, local, 16, requires_grad=True)

    def step():
        out = seqpar.attention(q, k, v, mesh=mesh, strategy=strategy, check_inputs=check_inputs)
        out.sum().backward()

    got = _count(step)
    want = expected(strategy, world_size, check_inputs, kv_heads, pieces)
    what = f"{strategy} kv_heads={kv_heads} tokens={local} check_inputs={check_inputs} on {world_size} ranks"
    assert got == want, f"{what}: {got} != {want}"


@pytest.mark.parametrize(
    ("run", "check_inputs"),
    [
        pytest.param(run, check, id=f"{run[0]}-kv{run[1]}-tokens{run[2]}-{'checked' if check else 'unchecked'}")
        for run, check in itertools.product(RUNS, (True, False))
    ],
)
def test_collective_counts_three_ranks(run, check_inputs):
    run_ranks(3, _count_worker, run, check_inputs)
