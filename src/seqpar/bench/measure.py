"""Benchmark runs in spawned ranks: step time from a run with the normal allocator, peak memory from a second run.

Shared by the benchmarks that report both step time and peak resident-set growth (``seqpar bench``, benchmarks/).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from seqpar.runtime.spawn import spawn_ranks

MEMORY_RUN_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""Environment of the memory run. glibc, reading it at process start, then serves every large allocation by
mmap and unmaps it on free, so the resident-set peak tracks live tensors instead of what the heap kept from
earlier allocations."""


def write_slowest(path: str, seconds: float, growth_mb: float, **extra: object) -> None:
    """Rank 0 writes the slowest rank's step time and the largest peak growth to ``path`` as JSON.

    Collective over the default group: call it on every rank.

    Args:
        path: the JSON file to write (on rank 0).
        seconds: this rank's step time.
        growth_mb: this rank's peak resident-set growth in MiB.
        **extra: further JSON values written as they are (rank 0's).
    """
    stats = torch.tensor([seconds, growth_mb], dtype=torch.float64)
    gathered = [torch.empty_like(stats) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, stats)
    if dist.get_rank() == 0:
        worst = {"seconds": max(float(g[0]) for g in gathered), "growth_mb": max(float(g[1]) for g in gathered)}
        with open(path, "w") as f:
            json.dump({**worst, **extra}, f)


def time_and_memory(
    fn: Callable[..., None],
    args_for: Callable[[bool], tuple],
    world_size: int,
    path: str,
    *,
    backend: str | None = "gloo",
    timeout: timedelta = timedelta(minutes=10),
) -> dict:
    """Run ``fn`` on ``world_size`` spawned ranks (``spawn_ranks``, one thread each) twice: for time, then memory.

    Under ``MEMORY_RUN_ENV`` every new tensor also pays for its page faults, which the normal allocator
    (reusing freed heap) does not; so times come from the first run and peak growth from the second.

    Args:
        fn: called as ``fn(rank, world_size, *args_for(memory))``; it writes its JSON result to ``path``
            (``write_slowest``), with at least ``growth_mb``.
        args_for: ``args_for(memory)`` gives ``fn``'s further arguments for each run.
        world_size: ranks per run.
        path: where ``fn`` writes its JSON result.
        backend: the process group backend, or None for a single process without a group.
        timeout: how long a collective waits for the other ranks.

    Returns:
        The timing run's result, with ``growth_mb`` from the memory run.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank raised (see ``spawn_ranks``).
    """
    results = []
    for memory in (False, True):
        env = MEMORY_RUN_ENV if memory else None
        spawn_ranks(fn, world_size, *args_for(memory), backend=backend, timeout=timeout, env=env)
        with open(path) as f:
            results.append(json.load(f))
    return {**results[0], "growth_mb": results[1]["growth_mb"]}
