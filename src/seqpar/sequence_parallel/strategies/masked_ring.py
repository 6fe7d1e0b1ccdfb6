"""Mask-aware ring attention: each step a rank receives from its ring source only the K/V tokens it needs.

Note [mask-aware ring schedule]
    The steps of Note [ring schedule] stay: at step i rank r attends to the K/V of source (r - i) mod P.
    But instead of relaying whole blocks around the ring, rank r sends directly to (r + i) mod P, at step
    i, the tokens of its own K/V that that rank needs (``needs[r + i][r]``, Note [mask-aware ring]) and
    receives from (r - i) mod P the tokens it needs; a pair with nothing to move posts nothing. The
    transfer for step i+1 is posted before step i is computed, so it overlaps as in the plain ring, and at
    most two steps' compact buffers are alive. A rank's bytes are then exactly the K/V its peers' queries
    see. The backward repeats the schedule (K/V again, not kept; Note [ring backward]) and sends each
    step's dK/dV rows of the received tokens straight back to their owner (float32, one step behind, so
    that transfer overlaps the next step's compute); the owner adds them into its float32 dK/dV.
    The backward runs whole blocks, not the pieces of Note [ring backward]: the zero-filled block of one
    source and its float32 dK/dV are the step's temporaries.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from seqpar.sequence_parallel.comm import SparseExchange
from seqpar.sequence_parallel.kernels.merge import new_accumulator
from seqpar.sequence_parallel.kernels.sinks import add_sinks, sink_grad
from seqpar.sequence_parallel.tiling.blocks import blocks_backward, blocks_forward
from seqpar.sequence_parallel.tiling.kv_needs import KVNeeds, take_tokens, zero_block_with
from seqpar.sequence_parallel.tiling.planner import plan

_KV_TAG, _DKV_TAG = 4, 5


def _post_kv(exchange: SparseExchange, k, v, needs: KVNeeds, rank: int, size: int, step: int) -> torch.Tensor:
    """Post step ``step``'s K/V transfer; return the receive buffer ``[2, B, Hkv, n, D]`` it fills."""
    dest, source = (rank + step) % size, (rank - step) % size
    b, h, _, d = k.shape
    recv = k.new_empty((2, b, h, len(needs[rank][source]), d))
    exchange.start({dest: take_tokens(k, v, needs[dest][rank])}, {source: recv})
    return recv


class _MaskedRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group, chunk_ids, causal, scale, kernel, mask, needs):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        q_ids, local = chunk_ids[rank], k.shape[2]
        chunk = q.shape[2] // len(q_ids)
        exchange = SparseExchange(group, _KV_TAG)
        recv = _post_kv(exchange, k, v, needs, rank, size, 1)
        out, lse = new_accumulator(q)  # [B, H, S/P, D], [B, H, S/P] float32
        blocks_forward(kernel, q, k, v, plan(q_ids, q_ids, chunk, causal, mask, q.device), scale, out, lse)
        for step in range(1, size):
            exchange.wait()
            got = recv
            if step + 1 < size:
                recv = _post_kv(exchange, k, v, needs, rank, size, step + 1)
            source = (rank - step) % size
            if got.shape[3]:
                kv = zero_block_with(got, needs[rank][source], k, local)  # [2, B, Hkv, S/P, D]
                blocks = plan(q_ids, chunk_ids[source], chunk, causal, mask, q.device)
                blocks_forward(kernel, q, kv[0], kv[1], blocks, scale, out, lse)
            del got
        if sinks is not None:  # Note [attention sinks]
            out, lse = add_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (group, chunk_ids, causal, scale, kernel, mask, needs)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        group, chunk_ids, causal, scale, kernel, mask, needs = ctx.args
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        q_ids, local = chunk_ids[rank], k.shape[2]
        chunk = q.shape[2] // len(q_ids)
        dout = dout.contiguous()
        kv_exchange, dkv_exchange = SparseExchange(group, _KV_TAG), SparseExchange(group, _DKV_TAG)
        recv = _post_kv(kv_exchange, k, v, needs, rank, size, 1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)  # this rank's dK, dV
        own = plan(q_ids, q_ids, chunk, causal, mask, q.device)
        blocks_backward(kernel, dout, q, k, v, out, lse, own, scale, dq, dkv[0], dkv[1])
        returned = None  # (buffer, local indices) of the dK/dV rows a peer sends home
        for step in range(1, size):
            kv_exchange.wait()
            got = recv
            if step + 1 < size:
                recv = _post_kv(kv_exchange, k, v, needs, rank, size, step + 1)
            source, dest = (rank - step) % size, (rank + step) % size
            index = needs[rank][source]
            back = torch.zeros(got.shape, dtype=torch.float32, device=k.device)  # [2, B, Hkv, n, D], n may be 0
            if got.shape[3]:
                kv = zero_block_with(got, index, k, local)  # [2, B, Hkv, S/P, D]
                part = torch.zeros(kv.shape, dtype=torch.float32, device=k.device)  # source's dK, dV from here
                blocks = plan(q_ids, chunk_ids[source], chunk, causal, mask, q.device)
                blocks_backward(kernel, dout, q, kv[0], kv[1], out, lse, blocks, scale, dq, part[0], part[1])
                del kv
                back = part.index_select(3, index.to(k.device))  # [2, B, Hkv, n, D] float32
                del part
            del got
            if returned is not None:
                dkv_exchange.wait()
                dkv.index_add_(3, returned[1].to(k.device), returned[0])
            incoming = needs[dest][rank]
            buffer = torch.empty((*back.shape[:3], len(incoming), back.shape[4]), dtype=torch.float32, device=k.device)
            dkv_exchange.start({source: back}, {dest: buffer})
            returned = (buffer, incoming)
            del back
        if returned is not None:
            dkv_exchange.wait()
            dkv.index_add_(3, returned[1].to(k.device), returned[0])
        dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks)
        grads = dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), dsinks
        return *grads, None, None, None, None, None, None, None


def masked_ring_attention(
    q, k, v, *, group, chunk_ids, causal, scale, kernel, mask, needs: KVNeeds, sinks=None
) -> torch.Tensor:
    """Ring attention moving only needed K/V tokens (Note [mask-aware ring schedule]).

    Args:
        q: ``[B, H, S_local, D]`` local queries; k, v: ``[B, Hkv, S_local, D]`` local keys/values.
        group: the ring (size P).
        chunk_ids: every ring rank's global chunk ids, in ring-rank order.
        causal, scale: as in ``seqpar.attention`` (causal False under block-causal masks).
        kernel: the local kernel.
        mask: the sequence mask the plans and ``needs`` come from.
        needs: ``kv_needs(mask, chunk_ids, ...)`` (Note [mask-aware ring]).
        sinks: ``[H]`` sink logits (Note [attention sinks]), or None.

    Returns:
        ``[B, H, S_local, D]`` local output.
    """
    return _MaskedRing.apply(q, k, v, sinks, group, chunk_ids, causal, scale, kernel, mask, needs)
