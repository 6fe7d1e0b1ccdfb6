"""Run a test function on N real ranks and fail if any rank fails: on a shared pool of live ranks, or freshly spawned.

A thin layer over ``tests._pool.RankPool`` / ``spawn_ranks`` with the tests' timeout, and the tests' shard indices.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta

import torch

import seqpar
from seqpar.runtime.spawn import spawn_ranks
from tests._pool import RankPool

__all__ = ["RankPools", "run_ranks", "session_pool", "shard_index", "use_pools"]

COLLECTIVE_TIMEOUT = timedelta(seconds=120)
MAX_POOLED_RANKS = 10
"""Live pooled processes kept at once (world sizes 1-4 fit; the 8-rank pool evicts the least recently used)."""


class RankPools:
    """One ``RankPool`` per world size, started on first use; the least recently used are closed beyond a cap."""

    def __init__(self, max_ranks: int = MAX_POOLED_RANKS) -> None:
        self.max_ranks = max_ranks
        self._pools: OrderedDict[int, RankPool] = OrderedDict()

    def run(self, world_size: int, fn: Callable[..., None], *args: object) -> None:
        self.pool(world_size).run(fn, *args)

    def pool(self, world_size: int) -> RankPool:
        """The pool of ``world_size`` ranks, now the most recently used (started by its first run); the least
        recently used others are closed so that at most ``max_ranks`` ranks live with it."""
        pool = self._pools.pop(world_size, None) or RankPool(world_size, timeout=COLLECTIVE_TIMEOUT)
        self._pools[world_size] = pool  # now the most recently used
        live = [p for p in self._pools.values() if p.alive and p is not pool]
        while live and sum(p.world_size for p in live) + world_size > self.max_ranks:
            live.pop(0).close()
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


_pools: list[RankPools] = []  # the session's pools (tests/conftest.py), empty outside a pytest session


def use_pools(pools: RankPools | None) -> None:
    """Make ``run_ranks`` run on ``pools`` (None: spawn fresh ranks for every call again)."""
    _pools.clear()
    if pools is not None:
        _pools.append(pools)


def session_pool(world_size: int) -> RankPool | None:
    """The session's pool of ``world_size`` ranks (the one ``run_ranks`` uses), for a caller that runs its own
    functions on it (the zoo sweeps); None outside a pytest session."""
    return _pools[0].pool(world_size) if _pools else None


def run_ranks(
    world_size: int, fn: Callable[..., None], *args: object, backend: str = "gloo", fresh: bool = False
) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` ranks; re-raise the first failure.

    Gloo runs go to the session's pool of live ranks (a fresh process's torch state is restored before each
    function; a failure tears the pool down and the next test gets a new one). ``fresh=True`` spawns new processes
    instead, for functions that change process-wide state the pool cannot put back (their own process group, a
    library's first-use settings, signals and faults). ``backend="nccl"`` (always fresh) puts rank r on GPU r. A
    spawned rank leaves by ``os._exit(0)`` after the group is torn down (see ``spawn_ranks``).
    """
    if fresh or backend != "gloo" or not _pools:
        spawn_ranks(fn, world_size, *args, backend=backend, timeout=COLLECTIVE_TIMEOUT)
    else:
        _pools[0].run(world_size, fn, *args)


def shard_index(layout, world_size: int, rank: int, seq_len: int) -> torch.Tensor:
    """Global token indices of ``rank``'s shard, written out independently of seqpar's layouts.chunks."""
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
