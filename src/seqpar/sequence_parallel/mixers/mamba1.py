"""Mamba1 layers (Mamba, Falcon-Mamba, Jamba) under sequence parallelism: halo convolution, then the selective scan.

The adapters' ``forward`` (Note [mixer adapters]): seqpar's scan of a piece from a given state (Note [Mamba1 state]).

Note [Mamba1 state]
    Mamba1's selective scan keeps a state per channel ``d`` and state entry ``n``,
    ``h <- exp(dt_d A_dn) h + dt_d B_n x_d``, read as ``y_d = C . h_d + D_d x_d``. Its decay is one number per
    (channel, entry), so over a piece of tokens ``S_out = M * S_in + S_loc`` elementwise, with
    ``M = exp(A sum(dt))`` over the piece (the product of its steps' decays). seqpar passes it through
    ``chunked_state_scan`` as ``d_inner * d_state`` heads of a 1 x 1 state (Note [state passing]): ``M`` is that
    number, the exchange moves two numbers per channel, entry and chunk, and the state that enters a piece adds
    ``C_t . (prod_{s <= t} exp(dt_s A) * S_in)`` to token ``t``'s read, so the piece is scanned once. transformers' scan
    (``mamba_selective_scan``) starts from zeros only, so a piece's scan is seqpar's: transformers' sequential
    recurrence in its dtypes (decay and drive in float32, the read in the input's dtype), from the given state.
    It runs a Python step per token, as transformers' torch path does; the fused CUDA scan is not used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from seqpar.sequence_parallel.call_context import CONTEXT_KEY, CallContext, adapter_context
from seqpar.sequence_parallel.mixers.conv import halo_causal_conv
from seqpar.sequence_parallel.mixers.scan import Opening, chunked_state_scan


def _scan_piece(
    decay: torch.Tensor, drive: torch.Tensor, c: torch.Tensor, initial_state: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The selective scan of one piece from ``initial_state`` (Note [Mamba1 state]).

    Args:
        decay: ``[1, T, D, N]`` ``exp(dt A)``, float32.
        drive: ``[1, T, D, N]`` ``dt B x``, float32.
        c: ``[1, T, N]`` the read-out.
        initial_state: ``[1, D * N, 1, 1]`` the state entering the piece, or None for zeros.
        dtype: the dtype the state is read in (the scan input's).

    Returns:
        ``C . h`` per token ``[1, T, D]``, and the final state ``[1, D * N, 1, 1]``.
    """
    _, length, channels, entries = decay.shape
    if initial_state is None:
        state = decay.new_zeros(1, channels, entries).to(dtype)  # transformers starts in the input's dtype
    else:
        state = initial_state.reshape(1, channels, entries)
    reads = []
    for t in range(length):
        state = decay[:, t] * state + drive[:, t]
        reads.append(torch.matmul(state.to(dtype), c[:, t, :, None])[..., 0])
    return torch.stack(reads, dim=1), state.reshape(1, channels * entries, 1, 1)


def mamba1_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache: object | None = None,
    attention_mask: object | None = None,
    **kwargs: object,
) -> torch.Tensor:
    """``MambaMixer.forward`` (and ``FalconMambaMixer``'s and ``JambaMambaMixer``'s, with their norms on dt, B and C)
    on this rank's shard, the convolution and the scan's state exchanged (Note [Mamba1 state]).

    Args:
        self: the layer (``in_proj``, ``conv1d``, ``x_proj``, ``dt_proj``, ``A_log``, ``D``, ``out_proj``).
        hidden_states: ``[B, L, H]`` this rank's tokens.
        cache: must be None (seqpar trains without a cache).
        attention_mask: seqpar's call context, which these layers are handed in place of a mask (Note [context
            in the mask]); any other value is ignored, as seqpar's calls carry no mask.
        **kwargs: the layer's keywords.

    Returns:
        ``[B, L, H]``.

    Raises:
        SeqparInputError: called outside a prepared model's call, or with a cache.
    """
    if isinstance(attention_mask, CallContext):
        kwargs = {**kwargs, CONTEXT_KEY: attention_mask}
    ctx = adapter_context(self, cache, kwargs, silu=False)  # the layer's own activation is applied below
    dtype = hidden_states.dtype
    x, gate = self.in_proj(hidden_states).chunk(2, dim=-1)
    bias = self.conv1d.bias if self.use_conv_bias else None
    conv = halo_causal_conv(x.transpose(1, 2), self.conv1d.weight.squeeze(1), bias, ctx.mesh, ctx.layout, ctx.mask)
    u = self.act(conv).transpose(1, 2)  # [B, L, D]
    entries = self.ssm_state_size
    step, b, c = torch.split(self.x_proj(u), [self.time_step_rank, entries, entries], dim=-1)
    if getattr(self, "dt_layernorm", None) is not None:  # Falcon-Mamba's and Jamba's norms on dt, B and C
        step, b, c = self.dt_layernorm(step), self.b_layernorm(b), self.c_layernorm(c)
    dt = (self.dt_proj.weight @ step.transpose(1, 2)).transpose(1, 2)  # [B, L, D], the bias added below
    dt = F.softplus(dt + self.dt_proj.bias.float().to(dt.dtype))
    decay_rate = -torch.exp(self.A_log.float())  # [D, N]
    decay = torch.exp(decay_rate * dt[..., None])  # [B, L, D, N]
    drive = dt[..., None] * b[:, :, None, :].float() * u[..., None].float()

    def run(decay, drive, c, initial_state):
        return _scan_piece(decay, drive, c, initial_state, u.dtype)

    def opening(decay, drive, c):  # the state decays by the product of the steps' decays (Note [Mamba1 state])
        out, local = run(decay, drive, c, initial_state=None)
        grown = torch.cumprod(decay, dim=1)  # [1, T, D, N]: left at each token of the state that entered

        def respond(entering):  # [1, D * N, 1, 1] -> [1, T, D]
            kept = grown * entering.reshape(1, 1, *grown.shape[2:])
            return torch.matmul(kept.to(u.dtype), c[..., None])[..., 0]

        return Opening(out, local, grown[:, -1].reshape(1, -1, 1, 1), respond)

    state = (self.intermediate_size * entries, 1, 1)
    y = chunked_state_scan(run, opening, (decay, drive, c), state, ctx.mesh, ctx.layout, ctx.mask)
    y = (y + u * self.D.float()) * F.silu(gate)
    return self.out_proj(y.to(dtype))
