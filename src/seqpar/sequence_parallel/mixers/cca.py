"""ZAYA's Compressed Convolutional Attention projection on a shard: its convolutions and token shift see across chunks.

``ZayaAttention``'s adapter (Note [attention adapters]) calls ``cca_projection`` in place of the module's own.

Note [CCA halo]
    ZAYA's attention makes q, k and v with ``ZayaCCAProjection``: the projected q and k channels go through a
    depthwise causal convolution of width K0 and then a grouped one of width K1 (one process pads the projected
    channels with H = K0 + K1 - 2 zeros in front and runs both without padding), and half of each value head is
    the previous token's ``v_proj_delayed`` (the first token's is that projection of a zero input: its bias).
    So a token's q and k read the H projected tokens before it and its value the one before it, which on a
    shard another rank may hold. The adapter exchanges them as the halo convolution does (Note [halo
    convolution], ``chunk_halos``): each chunk's last H projected q/k tokens and its last delayed value, in one
    all-gather each, which every rank joins (so the reduce-scatters of the backward match). Where no document
    starts inside the shard's rows, each chunk runs the module's own two convolutions on ``[halo | chunk]``
    and keeps its own outputs. Packed documents: a document alone pads zeros before its first token, and the
    second convolution reads the first one's outputs there (its bias, not zero), so masking one intermediate
    would not give it; instead each token's window of H + 1 inputs, zeroed before its document's start, runs
    through both convolutions by itself (H + 1 times the q/k inputs, on rows with packed documents only). A
    document's first token takes the delayed value of a zero input, as the module's first token does.
"""

from __future__ import annotations

import torch

from seqpar.sequence_parallel.call_context import CallContext
from seqpar.sequence_parallel.layouts.chunks import chunks_per_rank
from seqpar.sequence_parallel.mixers.conv import chunk_halos, token_positions


def _since_start(ctx: CallContext, local: int, device: torch.device) -> torch.Tensor | None:
    """Each of this rank's tokens' distance from its document's start, ``[B, L]``; None where no row holds a
    document that starts after the sequence's first token."""
    starts = ctx.mask.starts
    if starts is None:
        return None
    index = token_positions(ctx.layout, ctx.mesh, local)
    starts = starts[:, index]
    return (index - starts.to(index.device)).to(device) if starts.any() else None


def _with_halo(x: torch.Tensor, halo: int, ctx: CallContext) -> tuple[torch.Tensor, int]:
    """``[B, C, L]`` -> each chunk with the ``halo`` inputs before it in front, ``[B, C, chunks, halo + size]``."""
    b, c, local = x.shape
    chunks = chunks_per_rank(ctx.layout) if ctx.mesh.sp_size > 1 else 1
    pieces = x.reshape(b, c, chunks, local // chunks)
    return torch.cat([chunk_halos(pieces, halo, ctx.mesh, ctx.layout), pieces], dim=-1), chunks


def _convolved(proj: torch.nn.Module, x: torch.Tensor, ctx: CallContext) -> torch.Tensor:
    """The module's two causal convolutions of the projected q/k channels ``[B, C, L]`` over the whole sequence (and
    each packed document alone), on this rank's tokens (Note [CCA halo])."""
    b, c, local = x.shape
    halo = proj.conv_kernel_size
    extended, chunks = _with_halo(x, halo, ctx)
    size = local // chunks
    back = _since_start(ctx, local, x.device)
    if back is None:  # one document from the sequence's start: every chunk's window is its halo and itself
        rows = extended.permute(0, 2, 1, 3).reshape(b * chunks, c, halo + size)
        out = proj.conv_qk_grouped(proj.conv_qk_depthwise(rows))  # [B * chunks, C, size]
        return out.reshape(b, chunks, c, size).permute(0, 2, 1, 3).reshape(b, c, local)
    windows = extended.unfold(-1, halo + 1, 1)  # [B, C, chunks, size, H + 1]: entry j is H - j tokens back
    reach = torch.arange(halo, -1, -1, device=x.device)
    inside = back.view(back.shape[0], 1, chunks, size, 1) >= reach
    rows = windows.masked_fill(~inside, 0).permute(0, 2, 3, 1, 4).reshape(-1, c, halo + 1)
    out = proj.conv_qk_grouped(proj.conv_qk_depthwise(rows))  # [B * chunks * size, C, 1]
    return out.view(b, chunks, size, c).permute(0, 3, 1, 2).reshape(b, c, local)


def _previous(delayed: torch.Tensor, first: torch.Tensor, ctx: CallContext) -> torch.Tensor:
    """Each token's previous token's ``delayed`` ``[B, L, C]``, or ``first`` ``[B, 1, C]`` at a document's start."""
    b, local, c = delayed.shape
    extended, chunks = _with_halo(delayed.transpose(1, 2), 1, ctx)
    shifted = extended[..., : local // chunks].reshape(b, c, local).transpose(1, 2)
    index = token_positions(ctx.layout, ctx.mesh, local).to(delayed.device)
    back = _since_start(ctx, local, delayed.device)
    back = index.view(1, local) if back is None else back
    return torch.where((back >= 1).unsqueeze(-1), shifted, first)


def cca_projection(
    proj: torch.nn.Module, hidden_states: torch.Tensor, ctx: CallContext
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ZayaCCAProjection.forward`` on this rank's shard, without a cache or padding mask (Note [CCA halo]).

    Args:
        proj: the ``ZayaCCAProjection`` (its projections, convolutions, ``conv_kernel_size``, ``head_dim`` and
            ``num_key_value_groups``).
        hidden_states: ``[B, L, hidden]`` this rank's tokens.
        ctx: the call context (mesh, layout, the mask's document starts).

    Returns:
        q ``[B, L, heads, D]``, k and v ``[B, L, kv heads, D]``, as the module returns them.
    """
    b, local, width = hidden_states.shape
    shape = (b, local, -1, proj.head_dim)
    queries, keys = proj.q_proj(hidden_states), proj.k_proj(hidden_states)
    query_residual = queries.view(*shape)
    key_residual = keys.view(*shape).repeat_interleave(proj.num_key_value_groups, dim=2)  # the module's repeat_kv
    query_residual = (query_residual + key_residual) * 0.5
    key_residual = query_residual.view(b, local, -1, proj.num_key_value_groups, proj.head_dim).mean(dim=-2)
    qk = _convolved(proj, torch.cat([queries, keys], dim=-1).transpose(1, 2), ctx).transpose(1, 2)
    split = queries.shape[-1]
    query = qk[..., :split].reshape(*shape) + query_residual
    key = qk[..., split:].reshape(*shape) + key_residual
    first = proj.v_proj_delayed(hidden_states.new_zeros(b, 1, width))
    delayed = _previous(proj.v_proj_delayed(hidden_states), first, ctx)
    value = torch.cat([proj.v_proj_current(hidden_states), delayed], dim=-1).view(*shape)
    return query, key, value
