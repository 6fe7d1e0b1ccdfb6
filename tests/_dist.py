"""Run a test function on N real ranks (spawned processes, one thread each) and fail if any rank fails.

A thin layer over ``seqpar.runtime.spawn_ranks`` with the tests' timeout, and the tests' shard indices.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch

import seqpar
from seqpar.runtime.spawn import spawn_ranks

__all__ = ["run_ranks", "shard_index"]


def run_ranks(world_size: int, fn: Callable[..., None], *args: object, backend: str = "gloo") -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` ranks; re-raise the first failure.

    ``backend="nccl"`` puts rank r on GPU r. A rank leaves by ``os._exit(0)`` after the group is torn down
    (gloo's threads have aborted finished processes in C++ static destructors; see ``spawn_ranks``).
    """
    spawn_ranks(fn, world_size, *args, backend=backend, timeout=timedelta(seconds=120))


def shard_index(layout, world_size: int, rank: int, seq_len: int) -> torch.Tensor:
    """Global token indices of ``rank``'s shard, written out independently of seqpar.layouts.chunks."""
    if isinstance(layout, seqpar.ChunkLayout):  # equal chunks; the rank's chunk ids in order
        n = seq_len // (world_size * len(layout.chunk_ids[rank]))
        return torch.cat([torch.arange(c * n, (c + 1) * n) for c in layout.chunk_ids[rank]])
    if layout == "contiguous":
        n = seq_len // world_size
        return torch.arange(rank * n, (rank + 1) * n)
    c = seq_len // (2 * world_size)
    first = torch.arange(rank * c, (rank + 1) * c)
    second = torch.arange((2 * world_size - 1 - rank) * c, (2 * world_size - rank) * c)
    return torch.cat([first, second])
