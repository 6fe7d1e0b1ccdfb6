"""Sparse point-to-point exchange: each rank sends a different tensor to some peers and receives from some.

The caller decides who sends what; every pair must agree on the shapes (they compute the same table).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist


class SparseExchange:
    """One non-blocking batch of sends and receives over ``group``: ``start`` posts them, ``wait`` completes them.

    Args:
        group: the process group; peers are named by their rank in it.
        tag: distinguishes concurrent exchanges between the same pair (gloo matches messages by tag).
    """

    def __init__(self, group: dist.ProcessGroup, tag: int = 0) -> None:
        self._group = group
        self._tag = tag
        self._pending: tuple[list[dist.Work], list[torch.Tensor]] | None = None

    def start(self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor]) -> None:
        """Send ``sends[peer]`` to each peer and receive into ``recvs[peer]`` (preallocated) from each peer.

        Empty tensors are neither sent nor received; with nothing to move, nothing is posted.
        """
        if self._pending is not None:
            raise RuntimeError("SparseExchange.start called twice without wait")
        held = [t.contiguous() for t in sends.values()]  # read by the transfer until wait
        ops = [
            dist.P2POp(dist.isend, t, dist.get_global_rank(self._group, peer), self._group, self._tag)
            for peer, t in zip(sends, held)
            if t.numel()
        ]
        ops += [
            dist.P2POp(dist.irecv, t, dist.get_global_rank(self._group, peer), self._group, self._tag)
            for peer, t in recvs.items()
            if t.numel()
        ]
        self._pending = (dist.batch_isend_irecv(ops) if ops else [], held)

    def wait(self) -> None:
        """Block until the last ``start``'s sends and receives are done (its receive tensors are then filled)."""
        if self._pending is None:
            raise RuntimeError("SparseExchange.wait called without start")
        for work in self._pending[0]:
            work.wait()
        self._pending = None
