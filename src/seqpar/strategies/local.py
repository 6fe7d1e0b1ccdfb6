"""Attention of a whole sequence held by one rank, as an autograd function around a kernel.

Used for a sequence-parallel size of 1 and inside Ulysses after the all-to-all; with a ``SequenceMask`` it
runs the tiles of Note [masked tiles] instead of one call.
"""

from __future__ import annotations

import torch

from seqpar.kernels import AttentionKernel
from seqpar.masking import SequenceMask
from seqpar.merge import new_accumulator
from seqpar.strategies._blocks import blocks_backward, blocks_forward, is_whole, plan

__all__ = ["local_attention"]

# Chunks the whole sequence is cut into for planning masked tiles (the tile size caps the work per call).
_PLAN_CHUNKS = 8


class _LocalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, blocks, scale, kernel):
        if is_whole(blocks, q, k):  # one kernel call: its own (out, lse) are the result
            out, lse = kernel.forward(q, k, v, causal=blocks[0].causal, scale=scale)
        else:
            out, lse = new_accumulator(q)  # [B, H, S, D], [B, H, S] float32
            blocks_forward(kernel, q, k, v, blocks, scale, out, lse)
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (blocks, scale, kernel)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        blocks, scale, kernel = ctx.args
        dout = dout.contiguous()
        if is_whole(blocks, q, k):
            dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal=blocks[0].causal, scale=scale)
            return dq, dk, dv, None, None, None
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        blocks_backward(kernel, dout, q, k, v, out, lse, blocks, scale, dq, dk, dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    kernel: AttentionKernel,
    mask: SequenceMask | None = None,
) -> torch.Tensor:
    """Attention of ``q`` ``[B, H, S, D]`` against ``k``, ``v`` ``[B, Hkv, S, D]`` on this rank alone.

    The sequence is whole and in global order; ``mask`` adds packed documents and a sliding window.
    Without one, the plan is a single kernel call over everything (Note [block plan]).
    """
    seq = q.shape[2]
    chunks = _PLAN_CHUNKS if mask is not None and not mask.trivial and seq % _PLAN_CHUNKS == 0 else 1
    ids = range(chunks)
    return _LocalAttention.apply(q, k, v, plan(ids, ids, seq // chunks, causal, mask, q.device), scale, kernel)
