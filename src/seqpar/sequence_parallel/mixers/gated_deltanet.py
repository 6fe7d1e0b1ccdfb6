"""Qwen3-Next's gated DeltaNet layer under sequence parallelism: halo convolution, then the state-passing scan.

The adapter's ``forward`` (Note [mixer adapters]), with transformers' own chunked kernel (Note [state passing]).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from seqpar.errors import SeqparInputError
from seqpar.sequence_parallel.call_context import CONTEXT_KEY
from seqpar.sequence_parallel.mixers.conv import halo_causal_conv
from seqpar.sequence_parallel.mixers.scan import chunked_state_scan

__all__ = ["qwen3_next_gated_deltanet_forward"]


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
        SeqparInputError: called outside a prepared model's call, or with a cache.
    """
    ctx = kwargs.get(CONTEXT_KEY)
    if ctx is None or cache is not None:
        raise SeqparInputError("a seqpar-adapted gated DeltaNet runs inside a prepared model's call, without a cache")
    if self.activation not in ("silu", "swish"):
        raise SeqparInputError(f"{type(self).__name__}'s convolution activation is {self.activation!r}, not silu")
    kernel = sys.modules[type(self).__mro__[1].__module__].torch_chunk_gated_delta_rule
    query, key, value, z, b, a = self.fix_query_key_value_ordering(
        self.in_proj_qkvz(hidden_states), self.in_proj_ba(hidden_states)
    )
    mixed = torch.cat([t.reshape(t.shape[0], t.shape[1], -1) for t in (query, key, value)], dim=-1).transpose(1, 2)
    mixed = halo_causal_conv(mixed, self.conv1d.weight.squeeze(1), self.conv1d.bias, ctx.mesh, ctx.layout, ctx.mask)
    mixed = F.silu(mixed).transpose(1, 2)
    query, key, value = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    shape = (*query.shape[:2], -1)
    query, key = query.reshape(*shape, self.head_k_dim), key.reshape(*shape, self.head_k_dim)
    value = value.reshape(*shape, self.head_v_dim)
    beta = b.sigmoid()
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

    def run(q, k, v, g, beta, initial_state):
        return kernel(
            q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=True, use_qk_l2norm_in_kernel=True
        )

    out = chunked_state_scan(run, query, key, value, g, beta, ctx.mesh, ctx.layout, ctx.mask)
    gated = self.norm(out.reshape(-1, out.shape[-1]), z.reshape(-1, z.shape[-1])).reshape(z.shape)
    return self.out_proj(gated.reshape(gated.shape[0], gated.shape[1], -1))

