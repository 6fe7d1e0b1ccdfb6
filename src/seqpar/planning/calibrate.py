"""A short probe of this machine's rates for the planner: matmul and attention FLOP/s of one rank, link bandwidth.

``seqpar plan --calibrate FILE`` writes them (``seqpar.planning.cluster.Calibration``); ``--calibration FILE``
uses them.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from seqpar.planning.cluster import Calibration
from seqpar.runtime.spawn import spawn_ranks

# Transformer-like GEMMs: [tokens, width] x [width, width * k], as projections and MLPs multiply.
_MATMULS = ((4096, 256, 768), (4096, 768, 256), (4096, 512, 1536), (2048, 1024, 1024), (4096, 256, 4096))
_LINK_BYTES = 32 * 2**20

Clocks = tuple[Callable[[], float], ...]


def _seconds(fn, repeats: int, clocks: Clocks) -> list[float]:
    """Median seconds of ``fn`` on each of ``clocks``, all read around the same runs."""
    fn()  # warm-up
    times = [[] for _ in clocks]
    for _ in range(repeats):
        starts = [clock() for clock in clocks]
        fn()
        for elapsed, clock, start in zip(times, clocks, starts, strict=True):
            elapsed.append(clock() - start)
    return [statistics.median(t) for t in times]


def _matmul_flops(repeats: int, clocks: Clocks) -> list[float]:
    rates = []
    for m, k, n in _MATMULS:
        a, b = torch.randn(m, k), torch.randn(k, n)
        rates.append([2.0 * m * k * n / s for s in _seconds(lambda a=a, b=b: a @ b, repeats, clocks)])
    return [statistics.median(per_clock) for per_clock in zip(*rates, strict=True)]


def _attention_flops(repeats: int, seq: int, clocks: Clocks, heads: int = 8, dim: int = 64) -> list[float]:
    q = torch.randn(1, heads, seq, dim, requires_grad=True)
    k, v = (torch.randn(1, heads // 2, seq, dim, requires_grad=True) for _ in "kv")

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()

    # the planner's count: causal forward 2 S^2 H d, backward 2.5x that
    return [3.5 * 2.0 * seq**2 * heads * dim / s for s in _seconds(step, repeats, clocks)]


def probe_compute(
    repeats: int = 3, attention_seq: int = 2048, clocks: Clocks = (time.perf_counter,)
) -> list[tuple[float, float]]:
    """This process's matmul and causal attention rates now, on the threads torch has.

    Args:
        repeats: timed repetitions of each probe (the median is kept).
        attention_seq: tokens of the attention probe (8/4 heads of 64).
        clocks: the clocks the same probe runs are timed with: wall time, and/or ``time.process_time`` for
            the CPU time this process gets (what it would take on a machine of its own, the load of others aside).

    Returns:
        One (matmul FLOP/s, attention FLOP/s) per clock, attention counted as the planner counts it.
    """
    matmul = _matmul_flops(repeats, clocks)
    attention = _attention_flops(repeats, attention_seq, clocks)
    return list(zip(matmul, attention, strict=True))


def _link_rank(rank: int, _world: int, repeats: int, path: str) -> None:
    buf = torch.ones(_LINK_BYTES // 4)
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        if i:  # the first exchange sets up the connection
            times.append((time.perf_counter() - start) / 2)
    if rank == 0:
        with open(path, "w") as f:
            json.dump({"bytes_per_s": _LINK_BYTES / statistics.median(times)}, f)


def calibrate(repeats: int = 5) -> Calibration:
    """Measure one rank's matmul and causal attention rates (one thread) and the gloo link between 2 ranks.

    Args:
        repeats: timed repetitions of each probe (the median is kept).

    Returns:
        The rates, the link given in both of ``Cluster``'s units (there is no second node to measure).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the benchmarks run each rank
    try:
        ((matmul, attention),) = probe_compute(repeats)
    finally:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "link.json")
        spawn_ranks(_link_rank, 2, repeats, path)
        with open(path) as f:
            one_way = json.load(f)["bytes_per_s"]
    return Calibration(
        matmul_tflops=matmul / 1e12,
        attention_tflops=attention / 1e12,
        intra_node_gbps=2 * one_way / 1e9,
        inter_node_gbps=8 * one_way / 1e9,
        threads=1,
        note="one rank, one thread: median of transformer-shaped fp32 GEMMs; causal SDPA forward+backward at "
        "2048 tokens, 8/4 heads of 64; gloo send/recv of 32 MiB between 2 spawned ranks",
    )
