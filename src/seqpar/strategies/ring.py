"""Ring attention: each rank keeps its queries while key/value blocks travel around the ring.

Partial results merge exactly by log-sum-exp; causal work is balanced by the zigzag layout.

Note [ring schedule]
    Step i (0..P-1) of rank r works on the key/values of source rank (r - i) mod P, while the transfer for
    step i+1 is already in flight (two reusable receive buffers, ``RingExchange``). Only the KV heads
    travel: grouped-query attention is expanded inside the kernel, never on the wire. With the zigzag
    layout and a causal mask every step after the first costs half a block on every rank (Note [block
    plan]). The backward replays the same ring with the final out and lse; each source's dK/dV
    accumulator (float32) follows one hop behind its K/V, so after P hops it is home, complete. A rank
    waits for the incoming partial before computing its block and adds the block's gradients straight
    into it: the outgoing partial is freed one step earlier, at the price of not overlapping that one
    transfer (memory first: it is O(S/P) bytes against O((S/P)^2) compute). The own block's gradients
    become the accumulators (no zero-filled copies), and remote blocks run in chunk-sized tiles so that
    one tile's out-of-place kernel gradients are the only temporaries.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from seqpar.comm import RingExchange
from seqpar.kernels import AttentionKernel
from seqpar.layout import rank_chunk_ids
from seqpar.masking import SequenceMask
from seqpar.merge import new_accumulator
from seqpar.strategies._blocks import blocks_backward, blocks_forward, is_whole, plan

__all__ = ["ring_attention", "ring_attention_on_chunks"]

_KV_TAG, _DKV_TAG = 0, 2


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, chunk_ids, causal, scale, kernel, mask):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        q_ids = chunk_ids[rank]
        chunk = q.shape[2] // len(q_ids)
        # The plan of every step, made once and replayed by the backward.
        plans = [plan(q_ids, chunk_ids[(rank - step) % size], chunk, causal, mask, q.device) for step in range(size)]
        ring = RingExchange(group, _KV_TAG) if size > 1 else None
        kv = [k, v]  # [B, Hkv, S/P, D] each
        for step in range(size):
            if step + 1 < size:
                ring.start(kv)
            if step == 0 and is_whole(plans[0], q, k):
                # the own block covers every query: its result starts the running (out, lse), no zeros to merge into
                out, lse = kernel.forward(q, k, v, causal=plans[0][0].causal, scale=scale)
                out, lse = out.float(), lse.float()  # [B, H, S/P, D], [B, H, S/P]
            else:
                if step == 0:
                    out, lse = new_accumulator(q)
                blocks_forward(kernel, q, kv[0], kv[1], plans[step], scale, out, lse)
            if step + 1 < size:
                kv = ring.wait()
        del kv, ring  # frees the receive buffers before the caller's next layer
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, scale, kernel, plans, chunk)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale, kernel, plans, chunk = ctx.args
        size = dist.get_world_size(group)
        dout = dout.contiguous()
        kv_ring = RingExchange(group, _KV_TAG) if size > 1 else None
        dkv_ring = RingExchange(group, _DKV_TAG) if size > 1 else None
        kv = [k, v]
        for step in range(size):
            if step + 1 < size:
                kv_ring.start(kv)
            if step == 0 and is_whole(plans[0], q, k):
                # The own block is one call over everything (Note [block plan]): its gradients start the
                # accumulators, instead of zeros plus a copy.
                dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal=plans[0][0].causal, scale=scale)
                dq = dq.float()
                dkv = [dk.float().contiguous(), dv.float().contiguous()]  # sent as they are
                del dk, dv
            else:
                if step == 0:
                    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
                    dkv = [torch.zeros(k.shape, dtype=torch.float32, device=k.device) for _ in range(2)]
                else:
                    dkv = dkv_ring.wait()  # partial sums for this source from the ranks before us
                blocks_backward(kernel, dout, q, kv[0], kv[1], out, lse, plans[step], scale, dq, dkv[0], dkv[1], chunk)
            if step + 1 < size:
                kv = kv_ring.wait()
            else:
                del kv, kv_ring  # the last K/V block is done: free its buffers before dK/dV arrive
            if size > 1:
                dkv_ring.start(dkv)
                del dkv
        if size > 1:
            dkv = dkv_ring.wait()  # our own block, home after P hops
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    layout: str,
    causal: bool,
    scale: float,
    kernel: AttentionKernel,
    mask: SequenceMask | None = None,
) -> torch.Tensor:
    """Ring attention over ``group`` (Note [ring schedule]); inputs already validated.

    Args:
        q: ``[B, H, S/P, D]`` local queries; k, v: ``[B, Hkv, S/P, D]`` local keys/values.
        group: the ring (size P); SP rank ``i`` holds shard ``i`` of ``layout``.
        layout, causal, scale: as in ``seqpar.attention``.
        kernel: the local kernel.
        mask: packed documents and sliding window (Note [masked tiles]), or None.

    Returns:
        ``[B, H, S/P, D]`` local output.
    """
    size = dist.get_world_size(group)
    chunk_ids = tuple(rank_chunk_ids(layout, size, r) for r in range(size))
    return ring_attention_on_chunks(
        q, k, v, group=group, chunk_ids=chunk_ids, causal=causal, scale=scale, kernel=kernel, mask=mask
    )


def ring_attention_on_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    chunk_ids: tuple[tuple[int, ...], ...],
    causal: bool,
    scale: float,
    kernel: AttentionKernel,
    mask: SequenceMask | None = None,
) -> torch.Tensor:
    """Ring attention where ring rank ``r`` holds the global chunks ``chunk_ids[r]`` (in local order).

    The general form behind ``ring_attention`` (one layout's chunks per rank) and the ring stage of hybrid
    attention (the chunks of a whole Ulysses group per ring rank).
    """
    return _RingAttention.apply(q, k, v, group, chunk_ids, causal, scale, kernel, mask)
