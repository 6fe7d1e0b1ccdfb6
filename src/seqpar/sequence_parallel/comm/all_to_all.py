"""Autograd-aware all-to-all that trades a sequence shard of all heads for the whole sequence of some heads.

The backward of each direction is the other direction (Note [ulysses all-to-all]).

Note [ulysses all-to-all]
    Rank p of P holds ``[B, H, S/P, D]``: k chunks of the sequence (in the caller's chunk order) for all H
    heads. After the exchange it holds ``[B, H/P, S, D]``: heads ``p*H/P .. (p+1)*H/P - 1`` for the whole
    sequence. The send buffer is laid out ``[P, k, B, H/P, C, D]`` so that the receiver gets rank-major
    chunks and one ``index_select`` both reorders them into sequence order and makes the result
    contiguous: one copy on each side of the wire.

Note [ulysses head groups]
    ``seq_to_head_group`` / ``head_group_to_seq`` move one slice of heads at a time: part j of ``parts``
    takes heads ``j*h .. (j+1)*h - 1`` (h = H/(P*parts)) of every rank's block of H/P heads, so running all
    parts gives each rank exactly the heads of the whole exchange, a slice at a time. Each tensor has its
    own all-to-all, so that only one tensor's send and receive buffers exist at a time.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _seq_to_head(x: torch.Tensor, group, to_natural: torch.Tensor) -> torch.Tensor:
    return seq_to_head_group(x, group, to_natural, 0, 1)  # [B, H/P, S, D]


def _head_to_seq(y: torch.Tensor, group, to_owner: torch.Tensor) -> torch.Tensor:
    b, h_local, s, d = y.shape
    size = dist.get_world_size(group)
    into = torch.empty((b, size * h_local, s // size, d), dtype=y.dtype, device=y.device)
    return head_group_to_seq(y, group, to_owner, into, 0, 1)  # [B, H, S/P, D]


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, to_natural, to_owner):
        ctx.group, ctx.to_owner = group, to_owner
        return _seq_to_head(x, group, to_natural)

    @staticmethod
    def backward(ctx, grad):
        return _head_to_seq(grad, ctx.group, ctx.to_owner), None, None, None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, to_natural, to_owner):
        ctx.group, ctx.to_natural = group, to_natural
        return _head_to_seq(y, group, to_owner)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_head(grad, ctx.group, ctx.to_natural), None, None, None


def seq_to_head_shards(
    x: torch.Tensor, group: dist.ProcessGroup, to_natural: torch.Tensor, to_owner: torch.Tensor
) -> torch.Tensor:
    """``[B, H, S/P, D]`` sequence shard -> ``[B, H/P, S, D]`` head shard, sequence in global order.

    Args:
        x: this rank's shard; ``H`` divisible by the group size.
        group: the all-to-all group (size P).
        to_natural: chunk index turning rank-major chunks into sequence order (length P*k).
        to_owner: its inverse, used by the backward.
    """
    return _SeqToHead.apply(x, group, to_natural, to_owner)


def head_to_seq_shards(
    y: torch.Tensor, group: dist.ProcessGroup, to_natural: torch.Tensor, to_owner: torch.Tensor
) -> torch.Tensor:
    """``[B, H/P, S, D]`` head shard -> ``[B, H, S/P, D]`` sequence shard (the inverse of ``seq_to_head_shards``)."""
    return _HeadToSeq.apply(y, group, to_natural, to_owner)


def seq_to_head_group(
    x: torch.Tensor, group: dist.ProcessGroup, to_natural: torch.Tensor, part: int, parts: int
) -> torch.Tensor:
    """Head slice ``part`` of ``parts`` of ``seq_to_head_shards(x)``, ``[B, H/(P*parts), S, D]`` (no autograd).

    Args:
        x: ``[B, H, S/P, D]``, this rank's sequence shard; ``H`` divisible by ``P * parts``.
        group: the all-to-all group (size P).
        to_natural: chunk index turning rank-major chunks into sequence order (length P*k).
        part, parts: which slice of each rank's heads (Note [ulysses head groups]).

    Returns:
        The slice's heads for the whole sequence, in global order.
    """
    size = dist.get_world_size(group)
    b, h, s_local, d = x.shape
    n_chunks = to_natural.numel()
    k = n_chunks // size
    c = s_local // k
    h_part = h // (size * parts)
    mine = x.reshape(b, size, h // size, k, c, d)[:, :, part * h_part : (part + 1) * h_part]
    send = mine.permute(1, 3, 0, 2, 4, 5).contiguous()  # [P, k, B, h, C, D]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[p] = rank p's chunks of my heads
    del send
    full = recv.view(n_chunks, b, h_part, c, d).permute(1, 2, 0, 3, 4).index_select(2, to_natural)
    return full.view(b, h_part, n_chunks * c, d)


def head_group_to_seq(
    y: torch.Tensor, group: dist.ProcessGroup, to_owner: torch.Tensor, into: torch.Tensor, part: int, parts: int
) -> torch.Tensor:
    """Write ``y``, head slice ``part`` of ``parts``, back into the sequence shard ``into`` (no autograd).

    The inverse of ``seq_to_head_group``.

    Args:
        y: ``[B, h, S, D]``, this rank's slice of heads for the whole sequence.
        group: the all-to-all group (size P).
        to_owner: chunk index from sequence order to rank-major order.
        into: contiguous ``[B, h * P * parts, S/P, D]`` shard receiving the slice.
        part, parts: which slice of each rank's heads (Note [ulysses head groups]).

    Returns:
        ``into``.
    """
    size = dist.get_world_size(group)
    b, h, s, d = y.shape
    n_chunks = to_owner.numel()
    k = n_chunks // size
    c = s // n_chunks
    send = y.reshape(b, h, n_chunks, c, d).permute(2, 0, 1, 3, 4).index_select(0, to_owner)  # [P*k, B, h, C, D]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[p] = my chunks of rank p's heads
    del send
    got = recv.view(size, k, b, h, c, d).permute(2, 0, 3, 1, 4, 5)  # [B, P, h, k, C, D]
    into.view(b, size, h * parts, k, c, d)[:, :, part * h : (part + 1) * h].copy_(got)
    return into
