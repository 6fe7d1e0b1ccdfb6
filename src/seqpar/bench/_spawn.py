"""Spawning benchmark processes: a timing run with the normal allocator, a memory run that returns freed memory.

Shared by the benchmarks that report both step time and peak resident memory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["time_and_memory", "write_slowest"]


def write_slowest(path: str, seconds: float, growth_mb: float, **extra) -> None:
    """Rank 0 writes the slowest rank's step time and the largest peak growth to ``path`` (collective)."""
    stats = torch.tensor([seconds, growth_mb], dtype=torch.float64)
    gathered = [torch.empty_like(stats) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, stats)
    if dist.get_rank() == 0:
        worst = {"seconds": max(float(g[0]) for g in gathered), "growth_mb": max(float(g[1]) for g in gathered)}
        with open(path, "w") as f:
            json.dump({**worst, **extra}, f)


def _spawn(target: Callable, args: tuple, nprocs: int, memory: bool) -> None:
    if memory:
        # glibc (read in the spawned processes) then serves every large allocation by mmap and unmaps it on
        # free, so the resident-set peak tracks live tensors instead of what the heap kept from earlier
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    try:
        mp.start_processes(target, args=args, nprocs=nprocs, start_method="spawn")
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)


def time_and_memory(target: Callable, args_for: Callable[[bool], tuple], nprocs: int, path: str) -> dict:
    """Run ``target`` on ``nprocs`` processes twice: for time, then for memory.

    Under the memory setting every new tensor also pays for its page faults, which the normal allocator
    (reusing freed heap) does not; so times come from the first run and peak growth from the second.

    Args:
        target: the spawned function; it writes its result to ``path`` (``write_slowest``).
        args_for: ``args_for(memory)`` gives ``target``'s arguments for each run.
        nprocs: processes per run.
        path: where ``target`` writes its JSON result.

    Returns:
        The timing run's result, with ``growth_mb`` from the memory run.
    """
    results = []
    for memory in (False, True):
        _spawn(target, args_for(memory), nprocs, memory)
        with open(path) as f:
            results.append(json.load(f))
    return {**results[0], "growth_mb": results[1]["growth_mb"]}
