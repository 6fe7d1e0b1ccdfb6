"""Point-to-point ring exchange: send tensors to the next rank while receiving the previous rank's.

Two receive buffers are reused in turn, so a long ring allocates nothing per hop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


class RingExchange:
    """Non-blocking ring shifts over ``group``: ``start`` posts the transfer, ``wait`` returns what arrived.

    The tensors received by one ``wait`` may be passed to the next ``start`` (they are then forwarded
    while the caller computes on them). A buffer is written again only two ``start`` calls later, after
    ``wait`` has confirmed that its send completed, so a caller may use what ``wait`` returned until its
    second-next ``start``.

    Args:
        group: the ring's process group; rank ``r`` sends to ``r+1`` and receives from ``r-1``.
        tag: distinguishes concurrent rings on the same group (gloo matches messages by tag).
    """

    def __init__(self, group: dist.ProcessGroup, tag: int = 0) -> None:
        size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        self._group = group
        self._next = dist.get_global_rank(group, (rank + 1) % size)
        self._prev = dist.get_global_rank(group, (rank - 1) % size)
        self._tag = tag
        self._buffers: list[list[torch.Tensor] | None] = [None, None]
        self._turn = 0
        self._pending: tuple[list[dist.Work], list[torch.Tensor], list[torch.Tensor]] | None = None

    def start(self, tensors: Sequence[torch.Tensor]) -> None:
        """Send ``tensors`` to the next rank and receive the same shapes from the previous rank."""
        if self._pending is not None:
            raise RuntimeError("RingExchange.start called twice without wait")
        buffers = self._buffers[self._turn]
        if buffers is None:
            buffers = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
            self._buffers[self._turn] = buffers
        self._turn ^= 1
        sent = [t.contiguous() for t in tensors]  # held until wait: the transfer reads them
        ops = [dist.P2POp(dist.isend, t, self._next, self._group, self._tag + i) for i, t in enumerate(sent)]
        ops += [dist.P2POp(dist.irecv, b, self._prev, self._group, self._tag + i) for i, b in enumerate(buffers)]
        self._pending = (dist.batch_isend_irecv(ops), sent, buffers)

    def wait(self) -> list[torch.Tensor]:
        """Block until the last ``start`` finished sending and receiving; return the received tensors."""
        if self._pending is None:
            raise RuntimeError("RingExchange.wait called without start")
        works, _, buffers = self._pending
        for work in works:
            work.wait()
        self._pending = None
        return buffers
