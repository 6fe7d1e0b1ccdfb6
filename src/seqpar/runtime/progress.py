"""Where each rank last was, kept in the process group's key-value store, so a timed-out collective can name
the ranks that stopped answering and what they were doing.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch.distributed as dist

__all__ = ["RankProgress"]


class RankProgress:
    """This rank's current phase in the default group's store (``seqpar/progress/<rank>``).

    A store write per phase is a file append (file store) or one round trip to the store server (torchrun),
    small next to a training step. Without a store (no process group) it records nothing.
    """

    def __init__(self) -> None:
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

    def elsewhere(self) -> str:
        """The other ranks whose last recorded phase differs from this rank's, with that phase.

        Returns:
            e.g. "rank 1 last reported optimizer step 3"; "" when every rank reported this rank's phase, or the
            store cannot be read (it may have gone with the failed ranks).
        """
        if self.store is None:
            return ""
        by_phase: dict[str, list[int]] = defaultdict(list)
        try:
            for rank in range(self.world):
                key = f"seqpar/progress/{rank}"
                phase = self.store.get(key).decode() if self.store.check([key]) else "nothing yet"
                if phase != self.current:
                    by_phase[phase].append(rank)
        except RuntimeError:
            return ""
        return "; ".join(
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks[:8]))}"
            f"{' ...' if len(ranks) > 8 else ''} last reported {phase}"
            for phase, ranks in by_phase.items()
        )
