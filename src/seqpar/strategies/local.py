"""Attention of a whole sequence held by one rank, as an autograd function around a kernel.

Used for a sequence-parallel size of 1 and inside Ulysses after the all-to-all.
"""

from __future__ import annotations

import torch

from seqpar.kernels import AttentionKernel

__all__ = ["local_attention"]


class _LocalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, kernel):
        out, lse = kernel.forward(q, k, v, causal=causal, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, scale, kernel)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        causal, scale, kernel = ctx.args
        dq, dk, dv = kernel.backward(dout.contiguous(), q, k, v, out, lse, causal=causal, scale=scale)
        return dq, dk, dv, None, None, None


def local_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float, kernel: AttentionKernel
) -> torch.Tensor:
    """Attention of ``q`` ``[B, H, S, D]`` against ``k``, ``v`` ``[B, Hkv, S, D]`` on this rank alone."""
    return _LocalAttention.apply(q, k, v, causal, scale, kernel)
