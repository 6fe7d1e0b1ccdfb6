"""All-gather attention: gather every rank's keys/values once, attend locally, reduce-scatter dK/dV.

Cheap with grouped-query attention (only KV heads travel) and the simplest base for arbitrary masks.

Note [allgather memory]
    The gathered K/V are P times the local ones, so they are not kept for the backward: the backward
    gathers them again (one more all-gather) instead of holding them through the rest of the model's
    forward pass, the same trade the ring makes. dK/dV accumulate in float32 and are reduce-scattered.
    A mask that hides some K/V from every query of a rank gathers only the rest (Note [mask-aware allgather]).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from seqpar.mesh import SequenceParallelMesh
from seqpar.sequence_parallel.comm import all_gather_first_dim, reduce_scatter_first_dim
from seqpar.sequence_parallel.kernels import AttentionKernel
from seqpar.sequence_parallel.kernels.alibi import alibi_bias
from seqpar.sequence_parallel.kernels.merge import new_accumulator
from seqpar.sequence_parallel.kernels.sinks import add_sinks, sink_grad
from seqpar.sequence_parallel.layouts.chunks import (
    chunks_per_rank,
    natural_order_index,
    owner_order_index,
    rank_chunk_ids,
)
from seqpar.sequence_parallel.masks.sequence_mask import SequenceMask
from seqpar.sequence_parallel.strategies.masked_allgather import masked_allgather_attention
from seqpar.sequence_parallel.tiling.blocks import blocks_backward, blocks_forward
from seqpar.sequence_parallel.tiling.kv_needs import kv_needs
from seqpar.sequence_parallel.tiling.planner import plan


def _gather_kv(k: torch.Tensor, v: torch.Tensor, group, layout: str) -> torch.Tensor:
    """``[2, B, Hkv, S, D]``: every rank's keys and values, in global sequence order."""
    size = dist.get_world_size(group)
    b, h, s_local, d = k.shape
    n = chunks_per_rank(layout)
    c = s_local // n
    send = k.new_empty((n, 2, b, h, c, d))
    send[:, 0] = k.view(b, h, n, c, d).permute(2, 0, 1, 3, 4)
    send[:, 1] = v.view(b, h, n, c, d).permute(2, 0, 1, 3, 4)
    gathered = all_gather_first_dim(send, group)  # [P*n, 2, B, Hkv, C, D], rank-major chunks
    to_natural = natural_order_index(layout, size, k.device)
    full = gathered.permute(1, 2, 3, 0, 4, 5).index_select(3, to_natural)  # [2, B, Hkv, P*n, C, D]
    return full.view(2, b, h, size * n * c, d)


def _scatter_dkv(dkv: torch.Tensor, group, layout: str) -> torch.Tensor:
    """Sum ``[2, B, Hkv, S, D]`` over ranks and return this rank's shard ``[2, B, Hkv, S/P, D]``."""
    size = dist.get_world_size(group)
    _, b, h, s, d = dkv.shape
    n = chunks_per_rank(layout)
    c = s // (size * n)
    to_owner = owner_order_index(layout, size, dkv.device)
    send = dkv.view(2, b, h, size * n, c, d).permute(3, 0, 1, 2, 4, 5).index_select(0, to_owner)
    local = reduce_scatter_first_dim(send, group)  # [n, 2, B, Hkv, C, D]
    return local.permute(1, 2, 3, 0, 4, 5).reshape(2, b, h, n * c, d)


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group, layout, causal, scale, kernel, mask, alibi):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        chunk = q.shape[2] // chunks_per_rank(layout)
        kv = _gather_kv(k, v, group, layout)
        mine = rank_chunk_ids(layout, size, rank)
        blocks = plan(mine, range(kv.shape[3] // chunk), chunk, causal, mask, q.device)
        # Note [ALiBi]: this rank's query chunks against the whole gathered sequence, in global order
        bias = alibi_bias(alibi, (mine, chunk), ((0,), kv.shape[3]))
        out, lse = new_accumulator(q)
        blocks_forward(kernel, q, kv[0], kv[1], blocks, scale, out, lse, bias)
        del kv  # Note [allgather memory]
        if sinks is not None:  # Note [attention sinks]
            out, lse = add_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (group, layout, causal, scale, kernel, blocks, bias)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        group, layout, _, scale, kernel, blocks, bias = ctx.args
        kv = _gather_kv(k, v, group, layout)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # [2, B, Hkv, S, D]
        grads = (dq, dkv[0], dkv[1])
        blocks_backward(kernel, dout.contiguous(), q, kv[0], kv[1], out, lse, blocks, scale, *grads, alibi=bias)
        del kv
        dk, dv = _scatter_dkv(dkv, group, layout)
        dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None, None, None, None, None, None


def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mesh: SequenceParallelMesh,
    layout: str,
    causal: bool,
    scale: float,
    kernel: AttentionKernel,
    mask: SequenceMask | None,
    sinks: torch.Tensor | None = None,
    alibi: torch.Tensor | None = None,
) -> torch.Tensor:
    """All-gather attention over the mesh's SP group (Note [allgather memory]); inputs already validated.

    Args:
        q: ``[B, H, S/P, D]``; k, v: ``[B, Hkv, S/P, D]``, sharded with ``layout``.
        mesh: keys/values are gathered over ``mesh.sp_group`` (size P).
        layout, causal, scale: as in ``seqpar.attention``.
        kernel: the local kernel.
        mask: packed documents and sliding window (Note [masked tiles]), or None.
        sinks: ``[H]`` sink logits (Note [attention sinks]), or None.
        alibi: ``[H]`` ALiBi slopes (Note [ALiBi]), or None: then every rank's K/V is gathered, whatever the mask.

    Returns:
        ``[B, H, S/P, D]`` local output.
    """
    chunk_ids = tuple(rank_chunk_ids(layout, mesh.sp_size, r) for r in range(mesh.sp_size))
    spares = mesh.sp_size > 1 and alibi is None  # the mask-aware gather knows no ALiBi (Note [ALiBi])
    needs = kv_needs(mask, chunk_ids, q.shape[2] // len(chunk_ids[0]), causal) if spares else None
    if needs is not None:  # the mask spares some K/V: gather only what is seen (Note [mask-aware allgather])
        options = dict(group=mesh.sp_group, chunk_ids=chunk_ids, causal=causal, scale=scale, kernel=kernel)
        return masked_allgather_attention(q, k, v, mask=mask, needs=needs, sinks=sinks, **options)
    return _AllGatherAttention.apply(q, k, v, sinks, mesh.sp_group, layout, causal, scale, kernel, mask, alibi)
