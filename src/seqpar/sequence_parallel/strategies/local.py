"""Attention of a whole sequence held by one rank, as an autograd function around a kernel.

The strategy for a sequence-parallel size of 1, and the inner step of Ulysses after the all-to-all; with a
``SequenceMask`` it runs the tiles of Note [masked tiles] instead of one call.
"""

from __future__ import annotations

import torch

from seqpar.mesh import SequenceParallelMesh
from seqpar.sequence_parallel.kernels import AttentionKernel
from seqpar.sequence_parallel.kernels.alibi import AlibiBias, alibi_bias
from seqpar.sequence_parallel.kernels.merge import new_accumulator
from seqpar.sequence_parallel.kernels.sinks import add_sinks, sink_grad
from seqpar.sequence_parallel.masks.sequence_mask import SequenceMask
from seqpar.sequence_parallel.tiling.blocks import blocks_backward, blocks_forward, is_whole
from seqpar.sequence_parallel.tiling.planner import Block, plan

# Chunks the whole sequence is cut into for planning masked tiles (the tile size caps the work per call).
_PLAN_CHUNKS = 8


def _keyword(bias: AlibiBias | None) -> dict:
    """The kernel keyword of an ALiBi bias (Note [ALiBi]): none without one, so kernels without it run."""
    return {} if bias is None else {"alibi": bias}


def local_plan(seq: int, causal: bool, mask: SequenceMask | None, device: torch.device) -> list[Block]:
    """The kernel calls for a whole sequence of ``seq`` tokens: one call, or masked tiles (Note [masked tiles]).

    Args:
        seq: tokens in the sequence.
        causal: whether a causal mask applies.
        mask: packed documents and sliding window, or None.
        device: where the tile masks go.

    Returns:
        The plan, in the sequence's own token coordinates.
    """
    chunks = _PLAN_CHUNKS if mask is not None and not mask.trivial and seq % _PLAN_CHUNKS == 0 else 1
    ids = range(chunks)
    return plan(ids, ids, seq // chunks, causal, mask, device)


def local_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: list[Block],
    scale: float,
    kernel: AttentionKernel,
    sinks: torch.Tensor | None = None,
    bias: AlibiBias | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of ``blocks`` over the whole local sequence.

    Args:
        q: ``[B, H, S, D]``; k, v: ``[B, Hkv, S, D]``.
        blocks: the plan (``local_plan``).
        scale: softmax scale.
        kernel: the local kernel.
        sinks: ``[H]`` sink logits of these heads (Note [attention sinks]), or None.
        bias: the ALiBi bias of these heads, rows and columns (Note [ALiBi]), or None.

    Returns:
        out ``[B, H, S, D]`` in ``q``'s dtype and lse ``[B, H, S]`` (float32 when the plan has several blocks
        or sinks), both final (sinks included).
    """
    if is_whole(blocks, q, k):  # one kernel call: its own (out, lse) are the result
        out, lse = kernel.forward(q, k, v, causal=blocks[0].causal, scale=scale, **_keyword(bias))
    else:
        out, lse = new_accumulator(q)  # [B, H, S, D], [B, H, S] float32
        blocks_forward(kernel, q, k, v, blocks, scale, out, lse, bias)
    if sinks is not None:
        out, lse = add_sinks(out, lse, sinks)
    return out.to(q.dtype), lse


def local_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    blocks: list[Block],
    scale: float,
    kernel: AttentionKernel,
    bias: AlibiBias | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of ``local_forward``, in the inputs' dtypes, given its final out and lse.

    Args:
        dout: gradient of the output ``[B, H, S, D]``.
        q, k, v: the forward's inputs.
        out, lse: the forward's results.
        blocks, scale, kernel, bias: as for ``local_forward``.

    Returns:
        ``(dq, dk, dv)`` shaped and typed like ``q``, ``k``, ``v``.
    """
    if is_whole(blocks, q, k):
        return kernel.backward(dout, q, k, v, out, lse, causal=blocks[0].causal, scale=scale, **_keyword(bias))
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    blocks_backward(kernel, dout, q, k, v, out, lse, blocks, scale, dq, dk, dv, alibi=bias)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _LocalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, blocks, scale, kernel, bias):
        out, lse = local_forward(q, k, v, blocks, scale, kernel, sinks, bias)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (blocks, scale, kernel, bias)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        grads = local_backward(dout, q, k, v, out, lse, *ctx.args)
        dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks)
        return *grads, dsinks, None, None, None, None


def whole_sequence_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    kernel: AttentionKernel,
    mask: SequenceMask | None = None,
    sinks: torch.Tensor | None = None,
    alibi: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q`` ``[B, H, S, D]`` against ``k``, ``v`` ``[B, Hkv, S, D]`` on this rank alone.

    The sequence is whole and in global order; ``mask`` adds packed documents and a sliding window.
    Without one, the plan is a single kernel call over everything (Note [block plan]).

    Args:
        q: ``[B, H, S, D]``; k, v: ``[B, Hkv, S, D]``, the whole sequence in global order.
        causal, scale: as in ``seqpar.attention``.
        kernel: the local kernel.
        mask: packed documents and sliding window (Note [masked tiles]), or None.
        sinks: ``[H]`` sink logits (Note [attention sinks]), or None.
        alibi: ``[H]`` ALiBi slopes of these heads (Note [ALiBi]), or None.

    Returns:
        ``[B, H, S, D]`` in ``q``'s dtype.
    """
    blocks = local_plan(q.shape[2], causal, mask, q.device)
    whole = ((0,), q.shape[2])
    bias = alibi_bias(alibi, whole, whole)
    return _LocalAttention.apply(q, k, v, sinks, blocks, scale, kernel, bias)


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor,
    scale: float,
    kernel: AttentionKernel,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q`` ``[B, H, Sq, D]`` against ``k``, ``v`` ``[B, Hkv, Sk, D]`` under a dense ``keep`` mask
    (``[B or 1, 1, Sq, Sk]`` bool, True = visible; a row that sees no key gives 0), in one kernel call, with the
    heads' sink logits in every row's softmax where given (Note [attention sinks])."""
    block = Block(slice(0, q.shape[2]), slice(0, k.shape[2]), False, keep)
    return _LocalAttention.apply(q, k, v, sinks, [block], scale, kernel, None)


def local_attention(
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
    """The strategy for a sequence-parallel size of 1: this rank holds the whole sequence.

    Every layout of one rank is the global order itself, so ``layout`` changes nothing here.

    Args:
        q: ``[B, H, S, D]``; k, v: ``[B, Hkv, S, D]``.
        mesh: a mesh whose SP size is 1 (nothing is communicated).
        layout, causal, scale: as in ``seqpar.attention``.
        kernel: the local kernel.
        mask: packed documents and sliding window (Note [masked tiles]), or None.
        sinks: ``[H]`` sink logits (Note [attention sinks]), or None.
        alibi: ``[H]`` ALiBi slopes (Note [ALiBi]), or None.

    Returns:
        ``[B, H, S, D]`` output.
    """
    del mesh, layout  # one rank: no group to talk to, and every layout is the natural order
    options = dict(causal=causal, scale=scale, kernel=kernel, mask=mask, sinks=sinks, alibi=alibi)
    return whole_sequence_attention(q, k, v, **options)
