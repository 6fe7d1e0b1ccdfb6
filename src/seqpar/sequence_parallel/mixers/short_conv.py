"""LFM2's gated short convolution under sequence parallelism: its causal convolution sees across chunk edges.

The adapter's ``forward`` (Note [mixer adapters]); the convolution itself is ``halo_causal_conv`` (``layer_conv``).
"""

from __future__ import annotations

import torch

from seqpar.sequence_parallel.call_context import adapter_context
from seqpar.sequence_parallel.mixers.conv import layer_conv


def lfm2_short_conv_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache: object | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: object,
) -> torch.Tensor:
    """``Lfm2ShortConv.forward`` on this rank's shard: ``out_proj(C * conv(B * x))`` with the halo exchange.

    Args:
        self: the ``Lfm2ShortConv`` (its ``in_proj``, ``conv``, ``out_proj``).
        hidden_states: ``[B, L, H]`` this rank's tokens.
        cache: must be None (seqpar trains without a cache).
        attention_mask: ignored, as seqpar's calls carry none (padding is its own document).
        **kwargs: the layer's keywords; seqpar's call context among them.

    Returns:
        ``[B, L, H]``.

    Raises:
        SeqparInputError: called outside a prepared model's call, or with a cache.
    """
    ctx = adapter_context(self, cache, kwargs, silu=False)  # LFM2's convolution has no activation
    gates = self.in_proj(hidden_states).transpose(-1, -2)
    b, c, x = gates.chunk(3, dim=-2)
    conv = layer_conv(self, b * x, self.conv, ctx)
    return self.out_proj((c * conv).transpose(-1, -2).contiguous())
