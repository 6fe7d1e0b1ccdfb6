"""Ulysses attention: all-to-all to whole sequences of a subset of heads, local attention, all-to-all back.

Communication per rank per layer is about 4·N·h/P elements forward (Jacobs et al., DeepSpeed-Ulysses, 2023),
as much again backward, and 1.5x that in head groups (Note [ulysses memory]).

Note [ulysses heads]
    Query heads must divide by the degree P. Rank p gets query heads p*H/P .. (p+1)*H/P-1, which read
    key/value heads p*Hkv/P .. when Hkv % P == 0. With fewer KV heads than P (and P % Hkv == 0), each KV head
    is repeated P/Hkv times before the exchange so that rank p gets exactly the one KV head its query heads
    read; autograd sums the repeated gradients back. The layout only changes the chunk order of the
    exchange, so the local attention always sees the sequence in global order.

Note [ulysses memory]
    Exchanging all heads at once puts whole-sequence q, k, v, out and, in the backward, dout and three
    gradients of H/P heads on each rank next to the shards: at P = 2 that is as much as one process
    attending alone. With more than one KV head per rank after the exchange, the heads go instead in
    groups of one KV head per rank (and its query heads; Note [ulysses head groups]): each group is
    exchanged, attended and sent home before the next, and the backward exchanges q, k, v and out again
    rather than keeping their head-sharded copies from the forward. Between forward and backward only the
    shards (kept by the caller anyway), out and the log-sum-exp are held; the step's peak grows by one
    group's tensors instead of all heads'. The price is the re-exchange: 6 tensors' worth of all-to-all
    volume per step instead of 4, one all-to-all per tensor and group.
    (Tiling over heads to save memory is also done by Arctic Long Sequence
    Training, Bekman et al. 2025.)
"""

from __future__ import annotations

import torch

from seqpar.mesh import SequenceParallelMesh
from seqpar.sequence_parallel.comm import (
    head_group_to_seq,
    head_to_seq_ranges,
    head_to_seq_shards,
    seq_to_head_group,
    seq_to_head_ranges,
    seq_to_head_shards,
)
from seqpar.sequence_parallel.kernels import AttentionKernel
from seqpar.sequence_parallel.kernels.alibi import alibi_bias
from seqpar.sequence_parallel.kernels.sinks import head_slice, sink_grad
from seqpar.sequence_parallel.layouts.chunks import natural_order_index, owner_order_index
from seqpar.sequence_parallel.masks.sequence_mask import SequenceMask
from seqpar.sequence_parallel.strategies.heads import HeadSplit, head_split, kv_head_repeats
from seqpar.sequence_parallel.strategies.local import (
    local_backward,
    local_forward,
    local_plan,
    whole_sequence_attention,
)
from seqpar.sequence_parallel.tiling.planner import Block


def repeat_kv_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, degree: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` and ``v`` with each head copied as often as an all-to-all over ``degree`` ranks needs.

    Autograd sums the copies' gradients back into the original heads (Note [ulysses heads]).

    Args:
        q: ``[B, H, S, D]`` (only its head count is read).
        k, v: ``[B, Hkv, S, D]``.
        degree: ranks of the all-to-all; the heads must allow it (``policy.ulysses_degrees``).

    Returns:
        ``(k, v)`` with ``Hkv * repeats`` heads, the same tensors when no copy is needed.

    Raises:
        ValueError: heads that do not split over ``degree`` ranks (the input checks reject them earlier).
    """
    repeats = kv_head_repeats(q.shape[1], k.shape[1], degree)
    if repeats is None:
        raise ValueError(f"{q.shape[1]} query and {k.shape[1]} key/value heads do not split over {degree} ranks")
    if repeats == 1:
        return k, v
    return k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)


def uneven_head_exchange(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    split: HeadSplit,
    group,
    rank: int,
    to_natural: torch.Tensor,
    to_owner: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's heads of ``split`` for the whole sequence, K/V paired for the kernels (Note [uneven heads]).

    Args:
        q: ``[B, H, S/P, D]``; k, v: ``[B, Hkv, S/P, D]``, this rank's sequence shard.
        split: ``head_split(H, Hkv, P)``.
        group: the all-to-all group (size P); ``rank`` is this rank in it.
        rank: this rank's index in ``group``.
        to_natural, to_owner: the chunk orders of the exchange (Note [uneven all-to-all]).

    Returns:
        ``(q, k, v)``: ``[B, n, S, D]`` and ``[B, m, S, D]`` twice, where query head i reads KV head
        i // (n/m) (KV heads copied up to n where the range falls unevenly on them); autograd returns
        every gradient to its sequence shard, summed over the ranks that shared a KV head.
    """
    qh = seq_to_head_ranges(q, group, to_natural, to_owner, split.q_ranges)  # [B, n, S, D]
    kh, vh = (seq_to_head_ranges(t, group, to_natural, to_owner, split.kv_ranges) for t in (k, v))  # [B, m, S, D]
    index = split.local_kv_index(rank)
    if index is not None:
        pick = torch.tensor(index, device=q.device)
        kh, vh = kh.index_select(1, pick), vh.index_select(1, pick)  # [B, n, S, D]
    return qh, kh, vh


def ulysses_attention(
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
    """Ulysses attention over the mesh's SP group (Note [ulysses heads]); inputs already validated.

    Args:
        q: ``[B, H, S/P, D]``; k, v: ``[B, Hkv, S/P, D]``, sharded with ``layout``.
        mesh: the all-to-all runs over ``mesh.sp_group`` (size P).
        layout, causal, scale: as in ``seqpar.attention``.
        kernel: the local kernel.
        mask: packed documents and sliding window (Note [masked tiles]), or None.
        sinks: ``[H]`` sink logits (Note [attention sinks]); this rank applies those of its heads.
        alibi: ``[H]`` ALiBi slopes (Note [ALiBi]); this rank applies those of its heads over the whole sequence.

    Returns:
        ``[B, H, S/P, D]`` local output.
    """
    group, size = mesh.sp_group, mesh.sp_size
    to_natural = natural_order_index(layout, size, q.device)
    to_owner = owner_order_index(layout, size, q.device)
    split = head_split(q.shape[1], k.shape[1], size)
    if not split.even:  # Note [uneven heads]: this rank's range of heads, all at once
        start, stop = split.q_ranges[mesh.sp_rank]
        qh, kh, vh = uneven_head_exchange(q, k, v, split, group, mesh.sp_rank, to_natural, to_owner)
        sinks, alibi = (None if t is None else t[start:stop] for t in (sinks, alibi))
        options = dict(causal=causal, scale=scale, kernel=kernel, mask=mask, sinks=sinks, alibi=alibi)
        out = whole_sequence_attention(qh, kh, vh, **options)
        return head_to_seq_ranges(out, group, to_natural, to_owner, split.q_ranges, q.shape[1])
    sinks, alibi = (head_slice(t, mesh.sp_rank, size) for t in (sinks, alibi))  # [H/P]: the heads this rank attends
    k, v = repeat_kv_heads(q, k, v, size)
    groups = k.shape[1] // size  # one KV head per rank in each group (Note [ulysses memory])
    if groups > 1:
        blocks = local_plan(q.shape[2] * size, causal, mask, q.device)
        args = (group, to_natural, to_owner, groups, blocks, scale, kernel, alibi)
        return _GroupedUlysses.apply(q, k, v, sinks, *args)
    qh, kh, vh = (seq_to_head_shards(t, group, to_natural, to_owner) for t in (q, k, v))  # [B, H/P, S, D]
    options = dict(causal=causal, scale=scale, kernel=kernel, mask=mask, sinks=sinks, alibi=alibi)
    out = whole_sequence_attention(qh, kh, vh, **options)
    return head_to_seq_shards(out, group, to_natural, to_owner)


class _GroupedUlysses(torch.autograd.Function):
    """Ulysses attention a head group at a time, re-exchanging q, k, v and out in the backward."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, group, to_natural, to_owner, groups: int, blocks: list[Block], scale, kernel,
                alibi):  # fmt: skip
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [B, H, S/P, D], filled a group at a time
        lses = []
        for part in range(groups):
            qh, kh, vh = (seq_to_head_group(t, group, to_natural, part, groups) for t in (q, k, v))
            part_sinks = head_slice(sinks, part, groups)  # group `part` holds slice `part` of this rank's heads
            bias = _group_bias(alibi, part, groups, qh)
            out_h, lse = local_forward(qh, kh, vh, blocks, scale, kernel, part_sinks, bias)  # [B, H/(PG), S, D]
            del qh, kh, vh
            head_group_to_seq(out_h, group, to_owner, out, part, groups)
            del out_h
            lses.append(lse)
        ctx.save_for_backward(q, k, v, out, sinks, *lses)
        ctx.args = (group, to_natural, to_owner, groups, blocks, scale, kernel, alibi)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, sinks, *lses = ctx.saved_tensors
        group, to_natural, to_owner, groups, blocks, scale, kernel, alibi = ctx.args
        grads = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)]
        dsinks = None if sinks is None else torch.empty_like(sinks)
        dout = dout.contiguous()
        for part in range(groups):
            qh, kh, vh, out_h, dout_h = (
                seq_to_head_group(t, group, to_natural, part, groups) for t in (q, k, v, out, dout)
            )
            bias = _group_bias(alibi, part, groups, qh)
            grads_h = list(local_backward(dout_h, qh, kh, vh, out_h, lses[part], blocks, scale, kernel, bias))
            if sinks is not None:
                part_grad = sink_grad(dout_h, out_h, lses[part], head_slice(sinks, part, groups))
                head_slice(dsinks, part, groups).copy_(part_grad)
            del qh, kh, vh, out_h, dout_h
            for into in grads:  # pop: each head-sharded gradient is freed once it is home
                head_group_to_seq(grads_h.pop(0), group, to_owner, into, part, groups)
        return *grads, dsinks, None, None, None, None, None, None, None, None


def _group_bias(alibi: torch.Tensor | None, part: int, groups: int, qh: torch.Tensor):
    """The ALiBi bias of head group ``part`` over the whole sequence ``qh`` holds (Note [ALiBi]), or None."""
    whole = ((0,), qh.shape[2])
    return alibi_bias(head_slice(alibi, part, groups), whole, whole)
