"""Mamba2 (SSD) layers under sequence parallelism: halo convolution, then the selective scan's state passed on.

The adapters' ``forward`` (Note [mixer adapters]), with transformers' own ``mamba2_chunk_scan`` (Note [state passing]).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from seqpar.sequence_parallel.call_context import adapter_context
from seqpar.sequence_parallel.mixers.conv import layer_conv
from seqpar.sequence_parallel.mixers.scan import Opening, chunked_state_scan


def mamba2_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache: object | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: object,
) -> torch.Tensor:
    """``GraniteMoeHybridMambaLayer.forward`` (and ``BambaMixer``'s, the same layer, and ``FalconH1Mixer``'s, with its
    input and projection multipliers and its optional gated norm) on this rank's shard, the convolution and the
    scan's state exchanged.

    The SSD state ``[heads, head_dim, d_state]`` decays by one number per head over a piece, ``exp(A sum(dt))``,
    so ``M`` is that number times the identity, and the number alone travels (``decay_only``, Note [state
    passing]); the state that enters a piece adds ``exp(A cumsum(dt)_t) C_t . S_in`` to token ``t``'s output.

    Args:
        self: the layer (``in_proj``, ``conv1d``, ``A_log``, ``D``, ``dt_bias``, ``norm``, ``out_proj``).
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
    kernel = sys.modules[type(self).__mro__[1].__module__].mamba2_chunk_scan
    dtype, (batch, length, _) = hidden_states.dtype, hidden_states.shape
    projected = self.in_proj(hidden_states * getattr(self, "ssm_in_multiplier", 1.0))  # Falcon-H1's muP multipliers
    if getattr(self, "mup_vector", None) is not None:
        projected = projected * self.mup_vector
    gate, xbc, dt = projected.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
    conv = layer_conv(self, xbc.transpose(1, 2), self.conv1d, ctx)
    groups = self.n_groups * self.ssm_state_size
    x, b, c = torch.split(F.silu(conv).transpose(1, 2), [self.intermediate_size, groups, groups], dim=-1)
    x = x.reshape(batch, length, self.num_heads, self.head_dim)
    b = b.reshape(batch, length, self.n_groups, self.ssm_state_size)
    c = c.reshape(batch, length, self.n_groups, self.ssm_state_size)
    decay = -torch.exp(self.A_log.float())
    low, high = self.time_step_limit

    def run(x, dt, b, c, initial_state):
        return kernel(
            x, dt, decay, b, c, chunk_size=self.chunk_size, D=self.D, dt_bias=self.dt_bias, dt_softplus=True,
            initial_states=initial_state, dt_limit=self.time_step_limit, return_final_states=True,
        )  # fmt: skip

    def opening(x, dt, b, c):  # the state decays by exp(A cumsum(dt)) per head: M is its last value times I
        out, local = run(x, dt, b, c, initial_state=None)
        steps = torch.clamp(F.softplus(dt + self.dt_bias), min=low, max=high).float().cumsum(1)  # [1, T, heads]
        grown = torch.exp(decay * steps)  # [1, T, heads]: what is left at each token of the state that entered
        reads = c.float().repeat_interleave(self.num_heads // self.n_groups, dim=2)  # [1, T, heads, N]

        def respond(entering):  # [1, heads, head_dim, N] -> [1, T, heads, head_dim]
            return grown[..., None] * torch.einsum("bthn,bhpn->bthp", reads, entering.float())

        return Opening(out, local, grown[:, -1, :, None, None], respond)

    state = (self.num_heads, self.head_dim, self.ssm_state_size)
    out = chunked_state_scan(run, opening, (x, dt, b, c), state, ctx.mesh, ctx.layout, ctx.mask, decay_only=True)
    out = out.reshape(batch, length, -1)
    out = self.norm(out, gate) if getattr(self, "mamba_rms_norm", True) else out * F.silu(gate)
    return self.out_proj(out.to(dtype))
