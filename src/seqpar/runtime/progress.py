"""Where each rank last was, kept in the process group's key-value store, so a timed-out collective can name
the ranks that stopped answering and what they were doing.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

_LOST_PEER = ("Connection closed by peer", "Connection reset by peer")

_STORE_WAIT = timedelta(seconds=5)
"""The longest one store operation may wait once a collective has failed (the store may have gone)."""


def lost_peer(message: str) -> bool:
    """Whether a collective's error says a peer closed its connection (it died, or gave up waiting itself)."""
    return any(text in message for text in _LOST_PEER)


def _ranks(ranks: list[int], singular: str, plural: str) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (" ..." if len(ranks) > 8 else "")
    return f"rank {shown} {singular}" if len(ranks) == 1 else f"ranks {shown} {plural}"


class RankProgress:
    """This rank's current phase in the default group's store (``seqpar/progress/<rank>``).

    A store write per phase is a file append (file store) or one round trip to the store server (torchrun),
    small next to a training step. Without a store (no process group) it records nothing.
    """

    def __init__(self, interrupted: Callable[[], bool] | None = None) -> None:
        """Find the default group's store, if there is one.

        Args:
            interrupted: whether this rank has been asked to stop (a launcher ending the run stops a rank with
                SIGTERM); ``stalled`` then stops waiting for the other ranks. None: never.
        """
        self.interrupted = interrupted or (lambda: False)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.store = None
        self.current = "nothing yet"
        """What this rank last recorded."""
        if dist.is_initialized():
            with contextlib.suppress(RuntimeError, ValueError):
                self.store = dist.distributed_c10d._get_default_store()

    def mark(self, what: str) -> None:
        """Record that this rank is now doing ``what`` (e.g. "optimizer step 12")."""
        self.current = what
        if self.store is not None:
            self.store.set(f"seqpar/progress/{self.rank}", what)

    def _read(self, key: str, default: str) -> str:
        return self.store.get(key).decode() if self.store.check([key]) else default

    def stalled(self, grace_s: float = 5.0) -> str:
        """After a collective of this rank failed (timed out, or lost a peer): which other ranks are stalled or
        dead, and where.

        This rank records that its collective failed (``seqpar/waiting/<rank>``, holding its phase), then
        watches for up to ``grace_s`` seconds for the other ranks to record the same: healthy ranks blocked on
        the same stalled peer fail too, each ``--timeout-s`` after it entered its collective (or at once when a
        peer that timed out closes its connections), so at slightly different moments. The ranks that have not
        recorded it by then are named stalled or dead with the phase they last reported; ranks that failed in
        another phase are named too. A healthy rank that entered its collective more than ``grace_s`` later
        than this one would be named as well. The wait is bounded by ``grace_s`` and ends early once this
        rank is asked to stop (the launcher is already ending the run); each store operation waits at most
        five seconds (the store may have gone with the failed ranks).

        Args:
            grace_s: how long to wait for the other ranks to report that their collectives failed too.

        Returns:
            e.g. "rank 1 is stalled or dead: not waiting on the others (last reported optimizer step 3)";
            "" when the store cannot be read (no process group, or the store went with the failed ranks).
        """
        if self.store is None:
            return ""
        others = [rank for rank in range(self.world) if rank != self.rank]
        try:
            self.store.set_timeout(_STORE_WAIT)
            self.store.set(f"seqpar/waiting/{self.rank}", self.current)
            deadline = time.monotonic() + grace_s
            keys = [f"seqpar/waiting/{rank}" for rank in others]
            while keys and not self.store.check(keys) and time.monotonic() < deadline and not self.interrupted():
                time.sleep(0.2)
            stalled: dict[str, list[int]] = defaultdict(list)
            waiting: dict[str, list[int]] = defaultdict(list)
            for rank in others:
                phase = self._read(f"seqpar/waiting/{rank}", "")
                if not phase:
                    stalled[self._read(f"seqpar/progress/{rank}", "nothing yet")].append(rank)
                elif phase != self.current:
                    waiting[phase].append(rank)
        except RuntimeError:  # the store's own errors (DistStoreError, timeouts) derive from RuntimeError
            return ""
        lines = [
            f"{_ranks(ranks, 'is', 'are')} stalled or dead: not waiting on the others (last reported {phase})"
            for phase, ranks in stalled.items()
        ]
        if not stalled:
            lines.append("every rank failed waiting, none is stalled")
        lines += [f"{_ranks(ranks, 'failed', 'failed')} waiting too, in {phase}" for phase, ranks in waiting.items()]
        return "; ".join(lines)
