"""Autograd-aware all-to-all where each rank takes its own range of heads, of any size, ranges possibly shared.

The two directions are each other's adjoints (Note [uneven all-to-all]), so each is the other's backward.

Note [uneven all-to-all]
    Rank p of P holds ``[B, H, S/P, D]``, k chunks of the sequence for all H heads; after
    ``seq_to_head_ranges`` rank r holds ``[B, n_r, S, D]``, heads ``ranges[r] = [a_r, b_r)`` for the whole
    sequence in global order. The ranges may differ in size and overlap (a KV head read by two ranks' query
    heads goes to both). One ``all_to_all_single`` with split sizes moves it: the block from rank p to rank r
    is ``[k, n_r, B, C, D]`` (flat on the wire), so the receiver's blocks stack to ``[P k, n_r, B, C, D]``,
    rank-major chunks that one ``index_select`` both reorders into sequence order and makes contiguous;
    the sender fills its flat buffer with one copy per destination. ``head_to_seq_ranges`` is the adjoint:
    every rank sends each peer that peer's chunks of its own heads, and the receiver sums the blocks into
    their head ranges, so a head sent to several ranks gets the sum of their gradients.
    All-to-all with split sizes runs on NCCL (grouped send/recv) and on gloo (``alltoallv``, CPU tensors) in
    torch 2.13, so nothing is padded: each rank sends and receives exactly its heads' bytes. (Padding every
    rank to ceil(H/P) heads would move P ceil(H/P) / H times the bytes on every rank, not only the slowest.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

Ranges = tuple[tuple[int, int], ...]


def _seq_to_head(x: torch.Tensor, group, to_natural: torch.Tensor, ranges: Ranges) -> torch.Tensor:
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    b, _, s_local, d = x.shape
    n_chunks = to_natural.numel()
    k = n_chunks // size
    c = s_local // k
    per_head = k * b * c * d  # elements of one head's block for one peer
    lanes = x.reshape(b, x.shape[1], k, c, d).permute(2, 1, 0, 3, 4)  # [k, H, B, C, D]
    sizes = [(stop - start) * per_head for start, stop in ranges]
    send = torch.empty(sum(sizes), dtype=x.dtype, device=x.device)
    offset = 0
    for (start, stop), n in zip(ranges, sizes, strict=True):
        send[offset : offset + n].view(k, stop - start, b, c, d).copy_(lanes[:, start:stop])
        offset += n
    mine = ranges[rank][1] - ranges[rank][0]
    recv = torch.empty(size * mine * per_head, dtype=x.dtype, device=x.device)
    dist.all_to_all_single(recv, send, [mine * per_head] * size, sizes, group=group)
    del send
    full = recv.view(n_chunks, mine, b, c, d).permute(2, 1, 0, 3, 4).index_select(2, to_natural)
    return full.view(b, mine, n_chunks * c, d)  # [B, n_r, S, D]


def _head_to_seq(y: torch.Tensor, group, to_owner: torch.Tensor, ranges: Ranges, heads: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    b, mine, s, d = y.shape
    n_chunks = to_owner.numel()
    k = n_chunks // size
    c = s // n_chunks
    per_head = k * b * c * d
    send = y.reshape(b, mine, n_chunks, c, d).permute(2, 1, 0, 3, 4).index_select(0, to_owner)  # [P k, n_r, B, C, D]
    sizes = [(stop - start) * per_head for start, stop in ranges]
    recv = torch.empty(sum(sizes), dtype=y.dtype, device=y.device)
    dist.all_to_all_single(recv, send.view(-1), sizes, [mine * per_head] * size, group=group)
    del send
    disjoint = all(ranges[i][1] <= ranges[i + 1][0] for i in range(size - 1))
    covered = disjoint and ranges[0][0] == 0 and ranges[-1][1] == heads
    into = (torch.empty if covered else torch.zeros)((b, heads, k, c, d), dtype=y.dtype, device=y.device)
    offset = 0
    for (start, stop), n in zip(ranges, sizes, strict=True):
        got = recv[offset : offset + n].view(k, stop - start, b, c, d).permute(2, 1, 0, 3, 4)  # [B, n_p, k, C, D]
        if covered:
            into[:, start:stop].copy_(got)
        else:  # shared heads: the adjoint sums what every rank returns
            into[:, start:stop].add_(got)
        offset += n
    return into.view(b, heads, k * c, d)  # [B, H, S/P, D]


class _SeqToHeadRanges(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, to_natural, to_owner, ranges):
        ctx.group, ctx.to_owner, ctx.ranges, ctx.heads = group, to_owner, ranges, x.shape[1]
        return _seq_to_head(x, group, to_natural, ranges)

    @staticmethod
    def backward(ctx, grad):
        return _head_to_seq(grad, ctx.group, ctx.to_owner, ctx.ranges, ctx.heads), None, None, None, None


class _HeadToSeqRanges(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, to_natural, to_owner, ranges, heads):
        ctx.group, ctx.to_natural, ctx.ranges = group, to_natural, ranges
        return _head_to_seq(y, group, to_owner, ranges, heads)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_head(grad, ctx.group, ctx.to_natural, ctx.ranges), None, None, None, None, None


def seq_to_head_ranges(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    to_natural: torch.Tensor,
    to_owner: torch.Tensor,
    ranges: tuple[tuple[int, int], ...],
) -> torch.Tensor:
    """``[B, H, S/P, D]`` sequence shard -> ``[B, n_r, S, D]``, this rank's heads ``ranges[r]`` in global order.

    Args:
        x: this rank's shard.
        group: the all-to-all group (size P).
        to_natural: chunk index turning rank-major chunks into sequence order (length P*k).
        to_owner: its inverse, used by the backward.
        ranges: every rank's ``(start, stop)`` heads, in group-rank order; of any sizes (at least one head
            each), possibly overlapping (Note [uneven all-to-all]).

    Returns:
        The rank's heads for the whole sequence; the backward sums a shared head's gradients.
    """
    return _SeqToHeadRanges.apply(x, group, to_natural, to_owner, ranges)


def head_to_seq_ranges(
    y: torch.Tensor,
    group: dist.ProcessGroup,
    to_natural: torch.Tensor,
    to_owner: torch.Tensor,
    ranges: tuple[tuple[int, int], ...],
    heads: int,
) -> torch.Tensor:
    """``[B, n_r, S, D]`` heads ``ranges[r]`` -> ``[B, heads, S/P, D]`` shard, the adjoint of ``seq_to_head_ranges``.

    Args:
        y: this rank's heads for the whole sequence, in global order.
        group: the all-to-all group (size P).
        to_natural: chunk index turning rank-major chunks into sequence order, used by the backward.
        to_owner: its inverse.
        ranges: as for ``seq_to_head_ranges``; a head in several ranges receives the sum of their values.
        heads: H, the heads of the sequence shard.

    Returns:
        This rank's sequence shard of all heads.
    """
    return _HeadToSeqRanges.apply(y, group, to_natural, to_owner, ranges, heads)
