"""RecurrentGemma's recurrent block (Griffin's RG-LRU) under sequence parallelism: halo convolution, then the scan.

The adapter's ``forward`` (Note [mixer adapters]): the gates as transformers computes them, the state passed on.

Note [RG-LRU state]
    The RG-LRU keeps one number per channel, ``h_t = a_t h_{t-1} + m_t (i_t x_t)``, with the decay ``a_t`` and
    the input gate ``i_t`` read from token t alone, and ``m_t = sqrt(1 - a_t^2)``. Where a token's position id
    is 0 the model resets (its ``reset``): ``a_t = 0`` and ``m_t = 1``. The position ids a rank holds are the
    global ones (``seqpar.shard_batch``), so each rank resets exactly at the tokens one process resets at, and
    a shard that does not begin the sequence does not reset at its first token. Over a piece of tokens the
    recurrence is affine in the state entering it, elementwise: ``S_out = M * S_in + S_loc`` with ``M`` the
    product of the piece's ``a_t`` per channel, and token t's state gains ``cumprod(a)_t * S_in``. seqpar passes
    it through ``chunked_state_scan`` as ``lru_width`` heads of a 1 x 1 state (Note [state passing]): two numbers
    per channel and chunk travel. Packed documents restart at their starts (``SequenceMask.starts``), which are
    the position-0 tokens, so the mask's pieces and the model's resets agree, and each document gives what it
    gives alone (where one process would also reset, as its positions restart too). The state is accumulated in
    float32 as transformers' ``_rnn_scan`` does (its own loop, token by token: it has no fused kernel, and its
    linear mode takes a state only through the module's mutable ``recurrent_states``, which the adapter leaves
    alone); each token's state is cast to the input's dtype once, after the entering state's term is added.
    The convolution before it is ``conv_1d`` (zero padding of ``K - 1`` in front, the outputs past the length
    dropped: causal, with a bias), served by the halo exchange (Note [halo convolution]).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from seqpar.sequence_parallel.call_context import adapter_context
from seqpar.sequence_parallel.mixers.conv import layer_conv
from seqpar.sequence_parallel.mixers.scan import Opening, chunked_state_scan


def _scan(
    decay: torch.Tensor, drive: torch.Tensor, initial_state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``_rnn_scan`` over n pieces stacked as rows, from ``initial_state`` (Note [RG-LRU state]).

    Args:
        decay: ``[n, T, W]`` the decays ``a_t`` (zero at a reset).
        drive: ``[n, T, W]`` the normalised, gated inputs.
        initial_state: ``[n, W, 1, 1]`` the state entering each piece, or None for zeros.

    Returns:
        Each token's state ``[n, T, W]`` in float32, and the final states ``[n, W, 1, 1]``.
    """
    rows, _, width = drive.shape
    if initial_state is None:
        state = drive.new_zeros(rows, width, dtype=torch.float32)
    else:
        state = initial_state.reshape(rows, width)
    states = []
    # unbind, not x[:, t]: each step's backward would otherwise make a zero tensor of the whole input
    for a, x in zip(decay.unbind(1), drive.unbind(1), strict=True):
        state = a.float() * state + x.float()  # transformers' order of the two float32 operations
        states.append(state)
    return torch.stack(states, dim=1), state.reshape(rows, width, 1, 1)


def _opening(decay: torch.Tensor, drive: torch.Tensor) -> Opening:
    """Chunks' first pieces that continue a document: the state entering them decays by ``cumprod(a)``."""
    out, local = _scan(decay, drive, initial_state=None)
    kept = torch.cumprod(decay.float(), dim=1)  # [n, T, W]: no reset inside (pieces are cut at document starts)

    def respond(entering: torch.Tensor) -> torch.Tensor:  # [n, W, 1, 1] -> [n, T, W]
        return kept * entering.reshape(entering.shape[0], 1, -1)

    return Opening(out, local, kept[:, -1, :, None, None], respond)


def _gates(lru: torch.nn.Module, x: torch.Tensor, reset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``RecurrentGemmaRglru.forward`` up to its scan: (decays zeroed at resets, normalised gated inputs)."""
    batch, length, width = x.shape
    heads, block = lru.num_attention_heads, lru.block_width
    blocks = x.reshape(batch * length, heads, block).permute(1, 0, 2)
    res = torch.baddbmm(lru.input_gate_bias[:, None, :], blocks, lru.input_gate_weight)
    input_gate = torch.sigmoid(res.transpose(0, 1).reshape(batch, length, width))
    res = torch.baddbmm(lru.recurrent_gate_bias[:, None, :], blocks, lru.recurrent_gate_weight)
    recurrent_gate = torch.sigmoid(res.transpose(0, 1).reshape(batch, length, width))
    log_decay = -8.0 * recurrent_gate * F.softplus(lru.recurrent_param)
    decay, decay_squared = torch.exp(log_decay), torch.exp(2 * log_decay)
    # the model's own square root, whose gradient it clips (bf16 training would make NaNs near a = 1)
    sqrt_bound = sys.modules[type(lru).__module__].SqrtBoundDerivative
    multiplier = sqrt_bound.apply(1 - decay_squared)
    multiplier = reset + ~reset * multiplier
    drive = x * input_gate * multiplier.type(x.dtype)
    return decay * ~reset, drive


def recurrent_gemma_recurrent_forward(
    self: torch.nn.Module,
    input_states: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: object | None = None,
    use_cache: bool | None = None,
    cache: object | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """``RecurrentGemmaRecurrentBlock.forward`` on this rank's shard, the convolution's halo and the RG-LRU's state
    exchanged (Note [RG-LRU state]).

    Args:
        self: the block (``linear_y``, ``linear_x``, ``conv_1d``, ``rg_lru``, ``act_fn``, ``linear_out``).
        input_states: ``[B, L, H]`` this rank's tokens.
        position_ids: ``[B or 1, L]`` their global position ids (0 resets the recurrence, as in the model).
        attention_mask: ignored: seqpar's calls carry none, and the block's keywords carry the call context.
        use_cache: must be falsy (seqpar trains without a cache).
        cache: must be None.
        **kwargs: the layer's keywords; seqpar's call context among them.

    Returns:
        ``([B, L, H], None)``, as the block returns.

    Raises:
        SeqparInputError: called outside a prepared model's call, or with a cache.
    """
    # use_cache makes the block keep its conv and recurrent states on the module: a cache by another name
    held = cache if cache is not None else (use_cache or None)
    ctx = adapter_context(self, held, kwargs, silu=False)  # the block applies no activation after its convolution
    gate = self.act_fn(self.linear_y(input_states))
    x = layer_conv(self, self.linear_x(input_states).transpose(1, 2), self.conv_1d, ctx).transpose(1, 2)
    reset = (position_ids == 0)[:, :, None]
    decay, drive = _gates(self.rg_lru, x, reset)
    state = (decay.shape[-1], 1, 1)  # a 1 x 1 state per channel, M its decay
    states = chunked_state_scan(_scan, _opening, (decay, drive), state, ctx.mesh, ctx.layout, ctx.mask, decay_only=True)
    return self.linear_out(states.to(drive.dtype) * gate), None
