"""Ring attention: each rank keeps its queries while key/value blocks travel around the ring.

Partial results merge exactly by log-sum-exp; causal work is balanced by the zigzag layout.

Note [ring schedule]
    Step i (0..P-1) of rank r works on the key/values of source rank (r - i) mod P, while the transfer for
    step i+1 is already in flight (two reusable receive buffers, ``RingExchange``). Only the KV heads
    travel: grouped-query attention is expanded inside the kernel, never on the wire. With the zigzag
    layout and a causal mask every step after the first costs half a block on every rank (Note [block
    plan]). The backward replays the ring with the final out and lse (Note [ring backward]).
    A mask that hides some of a peer's K/V from all local queries switches to direct sends of the tokens
    that are seen (Note [mask-aware ring schedule]); plain causal attention keeps this ring.

Note [ring backward]
    Every local chunk's K/V is cut into pieces (up to 8; ``seqpar.sequence_parallel.tiling.pieces``), and the backward
    makes one ring pass per piece index j, carrying piece j of each of the rank's chunks (with zigzag, one
    piece from each end of the sequence, so that every rank's work stays balanced pass by pass: passes
    synchronise).
    In a pass, each source's dK/dV accumulator (float32) follows one hop behind its K/V, so after P hops
    it is home, complete, and is written into that piece of dK/dV. A rank waits for the incoming partial
    before computing and adds its gradients straight into it: the outgoing partial is freed one step
    earlier, at the price of not overlapping that one transfer (O(S/P) bytes against O((S/P)^2)
    compute). Blocks run in tiles of two pieces of queries, so that one tile's out-of-place kernel
    gradients are the only temporaries. What a rank holds beyond out and dQ/dK/dV is thus a few pieces,
    not whole K/V blocks and their dK/dV partials, which lowers the per-rank peak well below one process's
    (``seqpar bench attention``; the measured ratios are in docs/benchmarks.md). The pieces cost more,
    smaller messages and kernel calls; the bytes sent are the same. On CPU that costs little, so pieces go
    down to 256 tokens. On a GPU small pieces cost far more than they save (kernel launches and small tiles;
    the measured case is in docs/benchmarks.md, "One GPU"), so on CUDA a chunk is cut only into pieces of
    at least 16K tokens, i.e. for sequences of 64K x P tokens and more; below that the backward runs whole
    chunks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from seqpar.mesh import SequenceParallelMesh
from seqpar.sequence_parallel.comm import RingExchange
from seqpar.sequence_parallel.kernels import AttentionKernel
from seqpar.sequence_parallel.kernels.alibi import alibi_bias
from seqpar.sequence_parallel.kernels.merge import new_accumulator
from seqpar.sequence_parallel.kernels.sinks import add_sinks, sink_grad
from seqpar.sequence_parallel.layouts.chunks import rank_chunk_ids
from seqpar.sequence_parallel.masks.sequence_mask import SequenceMask
from seqpar.sequence_parallel.strategies.masked_ring import masked_ring_attention
from seqpar.sequence_parallel.tiling.blocks import blocks_backward, blocks_forward, is_whole
from seqpar.sequence_parallel.tiling.kv_needs import kv_needs
from seqpar.sequence_parallel.tiling.pieces import piece_ids, pieces_per_chunk, put_piece, take_piece
from seqpar.sequence_parallel.tiling.planner import plan

_KV_TAG, _DKV_TAG = 0, 2


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group, chunk_ids, causal, scale, kernel, mask, alibi):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        q_ids = chunk_ids[rank]
        chunk = q.shape[2] // len(q_ids)
        plans = [plan(q_ids, chunk_ids[(rank - step) % size], chunk, causal, mask, q.device) for step in range(size)]
        ring = RingExchange(group, _KV_TAG) if size > 1 else None
        kv = [k, v]  # [B, Hkv, S/P, D] each
        for step in range(size):
            if step + 1 < size:
                ring.start(kv)
            bias = alibi_bias(alibi, (q_ids, chunk), (chunk_ids[(rank - step) % size], chunk))  # Note [ALiBi]
            if step == 0 and is_whole(plans[0], q, k):
                # the own block covers every query: its result starts the running (out, lse), no zeros to merge into
                biased = {} if bias is None else {"alibi": bias}
                out, lse = kernel.forward(q, k, v, causal=plans[0][0].causal, scale=scale, **biased)
                out, lse = out.float(), lse.float()  # [B, H, S/P, D], [B, H, S/P]
            else:
                if step == 0:
                    out, lse = new_accumulator(q)
                blocks_forward(kernel, q, kv[0], kv[1], plans[step], scale, out, lse, bias)
            if step + 1 < size:
                kv = ring.wait()
        del kv, ring  # frees the receive buffers before the caller's next layer
        if sinks is not None:  # one more term once every block is merged (Note [attention sinks])
            out, lse = add_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (group, scale, kernel, chunk, chunk_ids, causal, mask, alibi)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        group, scale, kernel, chunk, chunk_ids, causal, mask, alibi = ctx.args
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        dout = dout.contiguous()
        split = pieces_per_chunk(chunk, q.device.type)
        piece = chunk // split
        q_pieces = piece_ids(chunk_ids[rank], split)
        chunks = len(chunk_ids[rank])
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        for j in range(split):  # one ring pass per piece j of every chunk (Note [ring backward])
            # rings per pass: their receive buffers are freed with the pass, not kept two turns deep
            kv_ring = RingExchange(group, _KV_TAG) if size > 1 else None
            dkv_ring = RingExchange(group, _DKV_TAG) if size > 1 else None
            kv = [take_piece(k, chunks, split, j), take_piece(v, chunks, split, j)]  # [B, Hkv, chunks * piece, D]
            for step in range(size):
                source = (rank - step) % size
                kv_ids = [c * split + j for c in chunk_ids[source]]
                blocks = plan(q_pieces, kv_ids, piece, causal, mask, q.device)
                if step + 1 < size:
                    kv_ring.start(kv)
                if step == 0:
                    dkv = [torch.zeros(kv[0].shape, dtype=torch.float32, device=k.device) for _ in range(2)]
                else:
                    dkv = dkv_ring.wait()  # partial sums for this piece from the ranks before us
                bias = alibi_bias(alibi, (q_pieces, piece), (kv_ids, piece))  # Note [ALiBi]
                grads = (dq, dkv[0], dkv[1], 2 * piece)
                blocks_backward(kernel, dout, q, kv[0], kv[1], out, lse, blocks, scale, *grads, alibi=bias)
                if step + 1 < size:
                    kv = kv_ring.wait()
                if size > 1:
                    dkv_ring.start(dkv)
                    del dkv
            if size > 1:
                dkv = dkv_ring.wait()  # this rank's pieces, home after P hops
            put_piece(dk, chunks, split, j, dkv[0])
            put_piece(dv, chunks, split, j, dkv[1])
            del dkv, kv, kv_ring, dkv_ring
        dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks)
        return dq.to(q.dtype), dk, dv, dsinks, None, None, None, None, None, None, None


def ring_attention(
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
    """Ring attention around the mesh's SP group (Note [ring schedule]); inputs already validated.

    Args:
        q: ``[B, H, S/P, D]`` local queries; k, v: ``[B, Hkv, S/P, D]`` local keys/values.
        mesh: the ring is ``mesh.sp_group`` (size P); SP rank ``i`` holds shard ``i`` of ``layout``.
        layout, causal, scale: as in ``seqpar.attention``.
        kernel: the local kernel.
        mask: packed documents and sliding window (Note [masked tiles]), or None.
        sinks: ``[H]`` sink logits (Note [attention sinks]), or None.
        alibi: ``[H]`` ALiBi slopes (Note [ALiBi]), or None.

    Returns:
        ``[B, H, S/P, D]`` local output.
    """
    size = mesh.sp_size
    chunk_ids = tuple(rank_chunk_ids(layout, size, r) for r in range(size))
    return ring_attention_on_chunks(
        q,
        k,
        v,
        group=mesh.sp_group,
        chunk_ids=chunk_ids,
        causal=causal,
        scale=scale,
        kernel=kernel,
        mask=mask,
        sinks=sinks,
        alibi=alibi,
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
    sinks: torch.Tensor | None = None,
    alibi: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ring attention where ring rank ``r`` holds the global chunks ``chunk_ids[r]`` (in local order).

    The general form behind ``ring_attention`` (one layout's chunks per rank) and the ring stage of hybrid
    attention (the chunks of a whole Ulysses group per ring rank).

    Args:
        q: ``[B, H, S_local, D]`` local queries; k, v: ``[B, Hkv, S_local, D]`` local keys/values.
        group: the ring.
        chunk_ids: every ring rank's global chunk ids, in ring-rank order.
        causal, scale: as in ``seqpar.attention``.
        kernel: the local kernel.
        mask: packed documents and sliding window (Note [masked tiles]), or None.
        sinks: ``[H]`` sink logits of these heads (Note [attention sinks]), or None.
        alibi: ``[H]`` ALiBi slopes of these heads (Note [ALiBi]), or None: then the plain ring runs, whatever the
            mask (the mask-aware one knows no ALiBi).

    Returns:
        ``[B, H, S_local, D]`` local output.
    """
    size = dist.get_world_size(group)
    chunk = q.shape[2] // len(chunk_ids[dist.get_rank(group)])
    needs = kv_needs(mask, chunk_ids, chunk, causal) if size > 1 and alibi is None else None
    if needs is not None:  # the mask spares some K/V: move only what is seen (Note [mask-aware ring])
        options = dict(group=group, chunk_ids=chunk_ids, causal=causal, scale=scale, kernel=kernel, mask=mask)
        return masked_ring_attention(q, k, v, needs=needs, sinks=sinks, **options)
    return _RingAttention.apply(q, k, v, sinks, group, chunk_ids, causal, scale, kernel, mask, alibi)
