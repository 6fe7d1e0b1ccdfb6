"""Mask-aware all-gather attention: gather from each peer only the K/V tokens some local query sees.

Note [mask-aware allgather]
    Like the all-gather (Note [allgather memory]) but with the table of Note [mask-aware ring]: one batch
    of point-to-point sends and receives (every peer at once, a sparse all-to-all) brings each rank the
    tokens it needs; they go into a zero-filled ``[2, B, Hkv, S - S/P, D]`` holding the peers' chunks in
    global order, and the plan of the local queries against those chunks runs on it (the own block is
    planned apart, so no tile mixes own and peer keys). The backward gathers the same tokens again and,
    in place of the reduce-scatter, sends each owner back the float32 dK/dV rows of exactly the tokens it
    sent; the owner adds them to its own. While the transfers are in flight the rank computes its own
    block, so they overlap that compute.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from seqpar.sequence_parallel.comm import SparseExchange
from seqpar.sequence_parallel.kernels.merge import new_accumulator
from seqpar.sequence_parallel.kernels.sinks import add_sinks, sink_grad
from seqpar.sequence_parallel.tiling.blocks import blocks_backward, blocks_forward
from seqpar.sequence_parallel.tiling.kv_needs import KVNeeds, global_tokens, take_tokens
from seqpar.sequence_parallel.tiling.planner import plan

_KV_TAG, _DKV_TAG = 6, 7


def _start_gather(exchange: SparseExchange, k, v, needs: KVNeeds, rank: int) -> dict[int, torch.Tensor]:
    """Post every peer's needed tokens out and this rank's in; return the receive buffers by peer."""
    b, h, _, d = k.shape
    peers = [p for p in range(len(needs)) if p != rank]
    recvs = {s: k.new_empty((2, b, h, len(needs[rank][s]), d)) for s in peers}
    exchange.start({p: take_tokens(k, v, needs[p][rank]) for p in peers}, recvs)
    return recvs


def _peer_places(chunk_ids, chunk: int, rank: int, needs: KVNeeds, device) -> tuple[list[int], dict]:
    """The peers' chunk ids in global order, and per peer where its sent tokens sit among their tokens."""
    others = sorted(c for r, ids in enumerate(chunk_ids) if r != rank for c in ids)
    slots = torch.full((chunk * sum(len(ids) for ids in chunk_ids),), -1, dtype=torch.long)
    slots[global_tokens(others, chunk)] = torch.arange(len(others) * chunk)
    peers = (s for s in range(len(chunk_ids)) if s != rank)
    return others, {s: slots[global_tokens(chunk_ids[s], chunk)[needs[rank][s]]].to(device) for s in peers}


def _peer_kv(k, recvs, places: dict, tokens: int) -> torch.Tensor:
    """``[2, B, Hkv, tokens, D]``: the peers' chunks in global order, received tokens set, zeros elsewhere."""
    b, h, _, d = k.shape
    kv = torch.zeros((2, b, h, tokens, d), dtype=k.dtype, device=k.device)
    for s, got in recvs.items():
        kv.index_copy_(3, places[s], got)
    return kv


class _MaskedAllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group, chunk_ids, causal, scale, kernel, mask, needs):
        rank = dist.get_rank(group)
        chunk = q.shape[2] // len(chunk_ids[rank])
        exchange = SparseExchange(group, _KV_TAG)
        recvs = _start_gather(exchange, k, v, needs, rank)
        own = plan(chunk_ids[rank], chunk_ids[rank], chunk, causal, mask, q.device)
        out, lse = new_accumulator(q)  # [B, H, S/P, D], [B, H, S/P] float32
        blocks_forward(kernel, q, k, v, own, scale, out, lse)  # overlaps the transfers
        exchange.wait()
        others, places = _peer_places(chunk_ids, chunk, rank, needs, k.device)
        kv = _peer_kv(k, recvs, places, len(others) * chunk)
        del recvs
        blocks = plan(chunk_ids[rank], others, chunk, causal, mask, q.device)
        blocks_forward(kernel, q, kv[0], kv[1], blocks, scale, out, lse)
        del kv  # Note [allgather memory]
        if sinks is not None:  # Note [attention sinks]
            out, lse = add_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (group, chunk_ids, scale, kernel, needs, own, blocks, places, len(others) * chunk)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        group, chunk_ids, scale, kernel, needs, own, blocks, places, peer_tokens = ctx.args
        rank = dist.get_rank(group)
        dout = dout.contiguous()
        exchange = SparseExchange(group, _KV_TAG)
        recvs = _start_gather(exchange, k, v, needs, rank)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)  # this rank's dK, dV
        blocks_backward(kernel, dout, q, k, v, out, lse, own, scale, dq, dkv[0], dkv[1])
        exchange.wait()
        kv = _peer_kv(k, recvs, places, peer_tokens)
        del recvs
        peer_grads = torch.zeros(kv.shape, dtype=torch.float32, device=k.device)  # [2, B, Hkv, S - S/P, D]
        blocks_backward(kernel, dout, q, kv[0], kv[1], out, lse, blocks, scale, dq, peer_grads[0], peer_grads[1])
        del kv
        b, h, _, d = k.shape
        peers = [p for p in range(len(chunk_ids)) if p != rank]
        back = {s: peer_grads.index_select(3, places[s]) for s in peers}
        incoming = {p: peer_grads.new_empty((2, b, h, len(needs[p][rank]), d)) for p in peers}
        del peer_grads
        exchange = SparseExchange(group, _DKV_TAG)
        exchange.start(back, incoming)
        exchange.wait()
        for p, got in incoming.items():
            dkv.index_add_(3, needs[p][rank].to(k.device), got)
        dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks)
        grads = dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), dsinks
        return *grads, None, None, None, None, None, None, None


def masked_allgather_attention(
    q, k, v, *, group, chunk_ids, causal, scale, kernel, mask, needs, sinks=None
) -> torch.Tensor:
    """All-gather attention moving only needed K/V tokens (Note [mask-aware allgather]).

    Args:
        q: ``[B, H, S/P, D]``; k, v: ``[B, Hkv, S/P, D]``.
        group: the SP group (size P).
        chunk_ids: every rank's global chunk ids, in rank order.
        causal, scale: as in ``seqpar.attention`` (causal False under block-causal masks).
        kernel: the local kernel.
        mask: the sequence mask the plans and ``needs`` come from.
        needs: ``kv_needs(mask, chunk_ids, ...)`` (Note [mask-aware ring]).
        sinks: ``[H]`` sink logits (Note [attention sinks]), or None.

    Returns:
        ``[B, H, S/P, D]`` local output.
    """
    return _MaskedAllGather.apply(q, k, v, sinks, group, chunk_ids, causal, scale, kernel, mask, needs)
