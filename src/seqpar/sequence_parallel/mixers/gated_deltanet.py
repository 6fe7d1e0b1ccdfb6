"""Gated DeltaNet layers (Qwen3-Next, Qwen3.5, Olmo-Hybrid, Lara; Kimi Linear's and Bailing's KDA, its decay per
channel) under sequence parallelism: halo convolution, state passing.

The adapters' ``forward`` (Note [mixer adapters]), with transformers' own chunked kernel (Note [state passing]).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from seqpar.sequence_parallel.call_context import CallContext, adapter_context
from seqpar.sequence_parallel.mixers.conv import layer_conv
from seqpar.sequence_parallel.mixers.implementations import takes_varlen
from seqpar.sequence_parallel.mixers.scan import Opening, Recurrence, chunked_state_scan


def delta_rule_opening(run: Recurrence, state: tuple[int, int, int]) -> Callable[..., Opening]:
    """A chunk's opening piece for a gated delta rule kernel, in one call (Note [state passing]).

    The kernel is linear column by column in the values and the initial state, so the values get ``dk`` zero
    columns and the run starts from ``[0 | I]``: the first ``dv`` columns are the zero-start output and ``S_loc``,
    the last ``dk`` the reads ``q_t^T A_t`` of the identity and ``M = A_T``.

    Args:
        run: ``run(q, k, v, g, beta, initial_state, **bounds)``, the layer's kernel from a given state (``bounds``:
            ``cu_seqlens`` where the pieces are laid end to end in one row).
        state: the state's ``(heads, dk, dv)``.

    Returns:
        ``opening(q, k, v, g, beta, cu_seqlens=None)`` for ``chunked_state_scan``.
    """
    heads, dk, dv = state

    def opening(q, k, v, g, beta, cu_seqlens=None):
        n = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        bounds = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        eye = torch.eye(dk, device=q.device).expand(n, heads, dk, dk)
        start = torch.cat([eye.new_zeros(n, heads, dk, dv), eye], dim=-1)  # [n, H, dk, dv + dk]
        wide = torch.cat([v, v.new_zeros(*v.shape[:-1], dk)], dim=-1)
        out, last = run(q, k, wide, g, beta, initial_state=start, **bounds)
        out, reads = out.split([dv, dk], dim=-1)  # [n, T, H, dv], [n, T, H, dk]: q_t^T A_t
        local, passes = last.split([dv, dk], dim=-1)  # S_loc [n, H, dk, dv], M [n, H, dk, dk]

        def respond(entering: torch.Tensor) -> torch.Tensor:  # [n, H, dk, dv] -> out's shape
            if cu_seqlens is None:
                return torch.einsum("bthk,bhkv->bthv", reads.float(), entering.float())
            pieces = reads.float().split(cu_seqlens.diff().tolist(), dim=1)  # each [1, T_i, H, dk]
            terms = [torch.einsum("bthk,bhkv->bthv", r, e[None].float()) for r, e in zip(pieces, entering, strict=True)]
            return torch.cat(terms, dim=1)

        return Opening(out, local, passes, respond)

    return opening


def _gated_deltanet(
    self: torch.nn.Module,
    ctx: CallContext,
    mixed: torch.Tensor,
    z: torch.Tensor,
    beta: torch.Tensor,
    a: torch.Tensor,
    out: tuple[torch.nn.Module, torch.nn.Module],
) -> torch.Tensor:
    """The layer after its projections: ``mixed`` ``[B, L, 2 key_dim + value_dim]`` (q, k, v before the
    convolution), ``z`` ``[B, L, Hv, dv]`` (the output gate), ``beta`` and ``a`` ``[B, L, Hv]``, ``out`` the gated
    norm and the output projection."""
    kernel = sys.modules[type(self).__mro__[1].__module__].torch_chunk_gated_delta_rule
    conv = layer_conv(self, mixed.transpose(1, 2), self.conv1d, ctx)
    query, key, value = torch.split(F.silu(conv).transpose(1, 2), [self.key_dim, self.key_dim, self.value_dim], -1)
    shape = (*query.shape[:2], -1)
    query, key = query.reshape(*shape, self.head_k_dim), key.reshape(*shape, self.head_k_dim)
    value = value.reshape(*shape, self.head_v_dim)
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

    def run(q, k, v, g, beta, initial_state, **bounds):
        return kernel(
            q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=True,
            use_qk_l2norm_in_kernel=True, **bounds,
        )  # fmt: skip

    state = (self.num_v_heads, self.head_k_dim, self.head_v_dim)
    opening = delta_rule_opening(run, state)
    varlen = takes_varlen(kernel, query.device.type)  # one call per kind of piece (Note [state passing])
    scanned = chunked_state_scan(
        run, opening, (query, key, value, g, beta), state, ctx.mesh, ctx.layout, ctx.mask, varlen=varlen
    )
    norm, projection = out
    gated = norm(scanned.reshape(-1, scanned.shape[-1]), z.reshape(-1, z.shape[-1])).reshape(z.shape)
    return projection(gated.reshape(gated.shape[0], gated.shape[1], -1))


def qwen3_next_gated_deltanet_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache: object | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: object,
) -> torch.Tensor:
    """``Qwen3NextGatedDeltaNet.forward`` on this rank's shard, the convolution and the recurrence exchanged.

    Args:
        self: the ``Qwen3NextGatedDeltaNet`` (its projections, ``conv1d``, ``A_log``, ``dt_bias``, ``norm``).
        hidden_states: ``[B, L, H]`` this rank's tokens.
        cache: must be None (seqpar trains without a cache).
        attention_mask: ignored, as seqpar's calls carry none (padding is its own document).
        **kwargs: the layer's keywords; seqpar's call context among them.

    Returns:
        ``[B, L, H]``.

    Raises:
        SeqparInputError: called outside a prepared model's call, with a cache, or another activation than silu.
    """
    ctx = adapter_context(self, cache, kwargs)
    query, key, value, z, b, a = self.fix_query_key_value_ordering(
        self.in_proj_qkvz(hidden_states), self.in_proj_ba(hidden_states)
    )
    mixed = torch.cat([t.reshape(t.shape[0], t.shape[1], -1) for t in (query, key, value)], dim=-1)
    return _gated_deltanet(self, ctx, mixed, z, b.sigmoid(), a, (self.norm, self.out_proj))


def qwen3_5_gated_deltanet_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache: object | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: object,
) -> torch.Tensor:
    """``Qwen3_5GatedDeltaNet.forward`` on this rank's shard (Qwen3.5's separate q/k/v, z, b and a projections).

    Args:
        self: the ``Qwen3_5GatedDeltaNet``.
        hidden_states: ``[B, L, H]`` this rank's tokens.
        cache: must be None (seqpar trains without a cache).
        attention_mask: ignored, as seqpar's calls carry none (padding is its own document).
        **kwargs: the layer's keywords; seqpar's call context among them.

    Returns:
        ``[B, L, H]``.

    Raises:
        SeqparInputError: called outside a prepared model's call, with a cache, or another activation than silu.
    """
    ctx = adapter_context(self, cache, kwargs)
    batch, length, _ = hidden_states.shape
    z = self.in_proj_z(hidden_states).reshape(batch, length, -1, self.head_v_dim)
    beta, a = self.in_proj_b(hidden_states).sigmoid(), self.in_proj_a(hidden_states)
    return _gated_deltanet(self, ctx, self.in_proj_qkv(hidden_states), z, beta, a, (self.norm, self.out_proj))


def olmo_hybrid_gated_deltanet_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache: object | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: object,
) -> torch.Tensor:
    """``OlmoHybridGatedDeltaNet.forward`` on this rank's shard (separate q/k/v/a/b projections, a ``g_proj`` gate,
    beta doubled when negative eigenvalues are allowed).

    Args:
        self: the ``OlmoHybridGatedDeltaNet``.
        hidden_states: ``[B, L, H]`` this rank's tokens.
        cache: must be None (seqpar trains without a cache).
        attention_mask: ignored, as seqpar's calls carry none (padding is its own document).
        **kwargs: the layer's keywords; seqpar's call context among them.

    Returns:
        ``[B, L, H]``.

    Raises:
        SeqparInputError: called outside a prepared model's call, with a cache, or another activation than silu.
    """
    ctx = adapter_context(self, cache, kwargs)
    batch, length, _ = hidden_states.shape
    mixed = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], dim=-1)
    z = self.g_proj(hidden_states).reshape(batch, length, -1, self.head_v_dim)
    beta = self.b_proj(hidden_states).sigmoid() * (2.0 if self.allow_neg_eigval else 1.0)
    return _gated_deltanet(self, ctx, mixed, z, beta, self.a_proj(hidden_states), (self.o_norm, self.o_proj))


def kimi_delta_attention_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache: object | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: object,
) -> torch.Tensor:
    """``KimiLinearDeltaAttention.forward`` (KDA) on this rank's shard, with ``chunk_kimi_delta_attention``.

    KDA is the gated delta rule with a decay per key channel, ``S <- (I - beta k k^T) diag(exp(g)) S + beta k v^T``:
    still affine in the state, and linear column by column in the values and the state, so a chunk's opening piece
    is one kernel call as for gated DeltaNet (Note [state passing]).

    Args:
        self: the ``KimiLinearDeltaAttention`` (q/k/v projections, ``conv1d``, ``forget_gate``, ``b_proj``, the
            ``g_a_proj`` / ``g_b_proj`` output gate, ``o_norm``, ``o_proj``).
        hidden_states: ``[B, L, H]`` this rank's tokens.
        cache: must be None (seqpar trains without a cache).
        attention_mask: ignored, as seqpar's calls carry none (padding is its own document).
        **kwargs: the layer's keywords; seqpar's call context among them.

    Returns:
        ``[B, L, H]``.

    Raises:
        SeqparInputError: called outside a prepared model's call, with a cache, or another activation than silu.
    """
    return _kda(self, adapter_context(self, cache, kwargs), hidden_states, self.g_b_proj(self.g_a_proj(hidden_states)))


def bailing_delta_attention_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache: object | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: object,
) -> torch.Tensor:
    """``BailingHybridDeltaAttention.forward``: KDA as Kimi Linear's, its output gate one projection (``g_proj``).

    Args:
        self: the ``BailingHybridDeltaAttention``.
        hidden_states: ``[B, L, H]`` this rank's tokens.
        cache: must be None (seqpar trains without a cache).
        attention_mask: ignored, as seqpar's calls carry none (padding is its own document).
        **kwargs: the layer's keywords; seqpar's call context among them.

    Returns:
        ``[B, L, H]``.

    Raises:
        SeqparInputError: called outside a prepared model's call, with a cache, or another activation than silu.
    """
    return _kda(self, adapter_context(self, cache, kwargs), hidden_states, self.g_proj(hidden_states))


def _kda(self: torch.nn.Module, ctx: CallContext, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """A KDA layer after its output gate's projection (``gate`` ``[B, L, heads * dv]``)."""
    kernel = sys.modules[type(self).__mro__[1].__module__].chunk_kimi_delta_attention
    batch, length, _ = hidden_states.shape
    shape = (batch, length, -1, self.head_dim)
    mixed = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], dim=-1)
    conv = layer_conv(self, mixed.transpose(1, 2), self.conv1d, ctx)
    query, key, value = (t.reshape(shape) for t in torch.split(F.silu(conv).transpose(1, 2), [self.qkv_dim] * 3, -1))
    g, beta = self.forget_gate(hidden_states), self.b_proj(hidden_states).sigmoid()  # [B, L, heads, dk], [B, L, heads]

    def run(q, k, v, g, beta, initial_state, **bounds):
        return kernel(
            q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=True,
            use_qk_l2norm_in_kernel=True, **bounds,
        )  # fmt: skip

    state = (self.num_heads, self.head_dim, self.head_dim)
    opening = delta_rule_opening(run, state)
    varlen = takes_varlen(kernel, query.device.type)  # one call per kind of piece (Note [state passing])
    scanned = chunked_state_scan(
        run, opening, (query, key, value, g, beta), state, ctx.mesh, ctx.layout, ctx.mask, varlen=varlen
    )
    return self.o_proj(self.o_norm(scanned, gate.view(shape)).reshape(batch, length, -1))
