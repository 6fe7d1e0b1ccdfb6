"""RWKV-4's time mixing (the WKV recurrence) and channel mixing under sequence parallelism: the token shift's halo of
one token, then the WKV state passed on.

The adapters' ``forward`` (Note [mixer adapters]); the call context reaches them as the blocks' ``state``
(Note [context in the mask]).

Note [WKV state]
    Both mixers of an RWKV-4 block mix each token with the one before it (``time_shift``, zero before a
    sequence's first token): a causal depthwise convolution of width 2 whose taps are (1, 0), served by the halo
    exchange (Note [halo convolution]), cut at document starts. The time mixing then runs the WKV recurrence,
    per channel a numerator and a denominator decayed by ``w = exp(-exp(time_decay))`` per token,
    ``num <- w num + e^k v``, ``den <- w den + e^k``, and reads ``(num + e^(u + k) v) / (den + e^(u + k))`` (``u``
    the ``time_first`` bonus of the current token) from the state before the token. Both halves are affine in
    the state entering a piece, with ``M = w^T`` per channel over T tokens, so the pair passes through
    ``chunked_state_scan`` as ``C`` heads of a 1 x 2 state (``decay_only``, Note [state passing]), and the read
    is divided only after the entering state's term is added. transformers' loop (``rwkv_linear_attention_cpu``)
    keeps num and den scaled by ``e^-max`` of the exponents seen, for float16's range; a piece here runs that
    same loop from a zero state and keeps each read as (numerator, denominator, the exponent ``p`` they are
    scaled by), so a piece that enters nothing reads exactly what transformers' loop reads, and the entering
    state's term is ``w^t e^-p S_in`` on both halves, ``S_in`` and the summaries in plain float32 (``e^max``
    applied): a key past ~88 would overflow them. The loop is seqpar's on every device: transformers' CUDA
    kernel passes no gradient to or from a state. Packed documents restart both the shift and the state at their
    starts, so each document gives what it gives alone (transformers' one process carries both across).
"""

from __future__ import annotations

import torch

from seqpar.sequence_parallel.call_context import CONTEXT_KEY, CallContext, adapter_context
from seqpar.sequence_parallel.mixers.conv import halo_causal_conv
from seqpar.sequence_parallel.mixers.scan import Opening, chunked_state_scan

_FAR = -1e38
"""transformers' starting maximum of the exponents (nothing seen yet)."""


def _context(module: torch.nn.Module, state: object, use_cache: object) -> CallContext:
    """The call context handed as the blocks' ``state`` (Note [context in the mask]); a real state is a cache."""
    if isinstance(state, CallContext):
        return adapter_context(module, use_cache or None, {CONTEXT_KEY: state}, silu=False)
    return adapter_context(module, state if state is not None else (use_cache or None), {}, silu=False)


def _shifted(hidden: torch.Tensor, ctx: CallContext) -> torch.Tensor:
    """``time_shift`` over the whole sequence: each token's predecessor, zero at a document start (Note [WKV state])."""
    channels = hidden.shape[-1]
    taps = torch.stack([hidden.new_ones(channels), hidden.new_zeros(channels)], dim=1)  # [C, 2]: one token back
    return halo_causal_conv(hidden.transpose(1, 2), taps, None, ctx.mesh, ctx.layout, ctx.mask).transpose(1, 2)


def _wkv(
    decay: torch.Tensor, first: torch.Tensor, key: torch.Tensor, value: torch.Tensor, initial_state: None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' WKV loop over n pieces (stacked as rows) from a zero state (Note [WKV state]).

    Args:
        decay: ``[C]`` ``-exp(time_decay)``.
        first: ``[C]`` ``time_first``.
        key: ``[n, T, C]``.
        value: ``[n, T, C]``.
        initial_state: None: pieces that enter a state are opened by ``_opening``.

    Returns:
        Each token's (numerator, denominator, their exponent) ``[n, T, C, 3]`` in float32, and the final
        states ``[n, C, 1, 2]`` (num, den) in plain float32.
    """
    num = torch.zeros_like(key[:, 0], dtype=torch.float32)
    den = torch.zeros_like(num)
    top = torch.zeros_like(num) + _FAR
    reads = []
    for k, v in zip(key.float().unbind(1), value.unbind(1), strict=True):  # unbind: no whole-input zeros per step
        p = torch.maximum(top, k + first)
        e1, e2 = torch.exp(top - p), torch.exp(k + first - p)
        reads.append(torch.stack([e1 * num + e2 * v, e1 * den + e2, p], dim=-1))
        q = torch.maximum(top + decay, k)
        e1, e2 = torch.exp(top + decay - q), torch.exp(k - q)
        num, den, top = e1 * num + e2 * v, e1 * den + e2, q
    scale = torch.exp(top)
    return torch.stack(reads, dim=1), torch.stack([num * scale, den * scale], dim=-1)[:, :, None, :]


def _opening(decay: torch.Tensor, first: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Opening:
    """Chunks' first pieces that continue a document: the entering state decays by ``w^t`` (Note [WKV state])."""
    out, local = _wkv(decay, first, key, value)
    steps = torch.arange(key.shape[1], device=key.device, dtype=torch.float32)[None, :, None]  # [1, T, 1]

    def respond(entering: torch.Tensor) -> torch.Tensor:  # [n, C, 1, 2] -> [n, T, C, 3]
        kept = torch.exp(steps * decay - out[..., 2])  # w^t e^-p: the entering state in the read's scale
        term = kept[..., None] * entering[:, None, :, 0, :]  # [n, T, C, 2]
        return torch.cat([term, torch.zeros_like(term[..., :1])], dim=-1)

    return Opening(out, local, torch.exp(key.shape[1] * decay).expand(key.shape[0], -1)[..., None, None], respond)


def rwkv_time_mix_forward(
    self: torch.nn.Module, hidden: torch.Tensor, state: object = None, use_cache: bool = False
) -> tuple[torch.Tensor, object]:
    """``RwkvSelfAttention.forward`` on this rank's shard: the shift's halo and the WKV state exchanged (Note [WKV
    state]).

    Args:
        self: the layer (``time_decay``, ``time_first``, the ``time_mix_*`` weights, ``key``, ``value``,
            ``receptance``, ``output``).
        hidden: ``[B, L, H]`` this rank's tokens.
        state: seqpar's call context, handed as the blocks' state (Note [context in the mask]).
        use_cache: must be falsy (seqpar trains without a cache).

    Returns:
        ``([B, L, H], state)``, as the layer returns (the context handed on to the channel mixing).

    Raises:
        SeqparInputError: called outside a prepared model's call, or with a cache.
    """
    ctx = _context(self, state, use_cache)
    shifted = _shifted(hidden, ctx)
    key = self.key(hidden * self.time_mix_key + shifted * (1 - self.time_mix_key))
    value = self.value(hidden * self.time_mix_value + shifted * (1 - self.time_mix_value))
    receptance = torch.sigmoid(
        self.receptance(hidden * self.time_mix_receptance + shifted * (1 - self.time_mix_receptance))
    )
    decay, first = -torch.exp(self.time_decay), self.time_first

    def run(key, value, initial_state):
        return _wkv(decay, first, key, value, initial_state)

    def opening(key, value):
        return _opening(decay, first, key, value)

    heads = (key.shape[-1], 1, 2)  # a 1 x 2 state (num, den) per channel, M its decay
    read = chunked_state_scan(run, opening, (key, value), heads, ctx.mesh, ctx.layout, ctx.mask, decay_only=True)
    wkv = (read[..., 0] / read[..., 1]).to(key.dtype)
    return self.output(receptance * wkv), state


def rwkv_channel_mix_forward(
    self: torch.nn.Module, hidden: torch.Tensor, state: object = None
) -> tuple[torch.Tensor, object]:
    """``RwkvFeedForward.forward`` on this rank's shard: its token shift's halo exchanged (Note [WKV state]).

    Args:
        self: the layer (``time_mix_key``, ``time_mix_receptance``, ``key``, ``receptance``, ``value``).
        hidden: ``[B, L, H]`` this rank's tokens.
        state: seqpar's call context, handed as the blocks' state (Note [context in the mask]).

    Returns:
        ``([B, L, H], state)``, as the layer returns.

    Raises:
        SeqparInputError: called outside a prepared model's call, or with a cache.
    """
    shifted = _shifted(hidden, _context(self, state, None))
    key = hidden * self.time_mix_key + shifted * (1 - self.time_mix_key)
    receptance = hidden * self.time_mix_receptance + shifted * (1 - self.time_mix_receptance)
    value = self.value(torch.square(torch.relu(self.key(key))))
    return torch.sigmoid(self.receptance(receptance)) * value, state
