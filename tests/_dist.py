"""Run a function on N real gloo ranks (spawned processes, one thread each) and fail if any rank fails."""

from __future__ import annotations

import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, store_path: str, fn, args, backend: str = "gloo") -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        init_method=f"file://{store_path}",
        timeout=timedelta(seconds=120),
    )
    fn(rank, world_size, *args)
    dist.barrier()  # no rank tears its connections down while another still talks to it
    dist.destroy_process_group()
    # Leave without running C++ static destructors: gloo's worker threads have been seen to abort the
    # process there ("terminate called without an active exception") after every check had passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(world_size: int, fn, *args, backend: str = "gloo") -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` ranks; re-raise the first failure.

    ``backend="nccl"`` puts rank r on GPU r.
    """
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.start_processes(_entry, args=(world_size, store, fn, args, backend), nprocs=world_size, start_method="spawn")


def shard_index(layout: str, world_size: int, rank: int, seq_len: int) -> torch.Tensor:
    """Global token indices of ``rank``'s shard, written out independently of seqpar.layout."""
    if layout == "contiguous":
        n = seq_len // world_size
        return torch.arange(rank * n, (rank + 1) * n)
    c = seq_len // (2 * world_size)
    first = torch.arange(rank * c, (rank + 1) * c)
    second = torch.arange((2 * world_size - 1 - rank) * c, (2 * world_size - rank) * c)
    return torch.cat([first, second])
