"""A kernel wrapper that adds up the CPU time its calls take in this thread: a rank's attention compute alone.

Ranks that wait for a peer spend wall time but no CPU time here, so the sum is the rank's own work.
"""

from __future__ import annotations

import time

import torch

from seqpar.sequence_parallel.kernels import AttentionKernel

__all__ = ["TimedKernel"]


class TimedKernel(AttentionKernel):
    """Runs ``inner`` and adds the thread CPU seconds of every forward and backward call to ``seconds``.

    Thread CPU time, not wall time: on a machine whose cores the ranks share, a rank that is descheduled
    or waiting in a receive is not charged, so the sum measures the attention work the rank itself did
    (with one compute thread per rank, as ``seqpar.runtime.spawn_ranks`` sets).
    """

    def __init__(self, inner: AttentionKernel) -> None:
        self.inner = inner
        self.name = f"timed {inner.name}"
        self.takes_masks = inner.takes_masks
        self.seconds = 0.0

    def unsupported_reason(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> str | None:
        """The inner kernel's reason."""
        return self.inner.unsupported_reason(q, k, v, mask)

    def forward(self, q, k, v, *, causal: bool, scale: float, mask: torch.Tensor | None = None):
        """The inner kernel's forward, timed."""
        start = time.thread_time()
        try:
            return self.inner.forward(q, k, v, causal=causal, scale=scale, mask=mask)
        finally:
            self.seconds += time.thread_time() - start

    def backward(self, dout, q, k, v, out, lse, *, causal: bool, scale: float, mask: torch.Tensor | None = None):
        """The inner kernel's backward, timed."""
        start = time.thread_time()
        try:
            return self.inner.backward(dout, q, k, v, out, lse, causal=causal, scale=scale, mask=mask)
        finally:
            self.seconds += time.thread_time() - start
