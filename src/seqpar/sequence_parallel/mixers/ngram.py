"""Qwen4-Exp's per-layer n-gram embeddings (PLE) under sequence parallelism: each token's preceding ids and the
inputs of the layer's dilated convolution, taken across chunk edges.

Note [n-gram halo]
    A PLE layer (Qwen4-Exp's ``ple_layer_ids``) embeds each token by hashing its id with the ``n - 1`` ids before
    it (``ngram_size`` n); transformers replaces a preceding id by the end-of-text id where an end-of-text token
    lies between, and starts a row from ``n - 1`` end-of-text ids (its cache's empty context). On a shard the
    first ``n - 1`` tokens of each chunk would hash another context. Under seqpar each chunk takes the ``n - 1``
    ids before it in the whole row from the tails of the chunks before it (``chunk_halos``, Note [halo
    convolution]: one all-gather of ``n - 1`` ids a chunk, with no gradient), and each local token gets its own
    window of the ``n - 1`` ids before it, an id before the token's document start (``SequenceMask.starts``) or
    the row's start replaced by the end-of-text id, as when the document runs alone. The embedding's own forward
    then runs on those windows, each token a row of one id whose cache holds its window (``ContextIds``), so the
    hashing, its heads and the end-of-text rule are transformers' own. The layer's depthwise convolution is
    dilated (``ple_conv_kernel_size`` taps ``ngram_size`` tokens apart): it is the causal convolution whose kernel
    holds zeros between the taps, run by ``halo_causal_conv`` with its halo of ``(K - 1) x n`` inputs, kept inside
    each document. The rest of the layer acts on each token. seqpar's calls carry no padding mask (``conv_mask``):
    padding is a document of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from seqpar.sequence_parallel.call_context import CallContext, adapter_context
from seqpar.sequence_parallel.layouts.chunks import chunks_per_rank
from seqpar.sequence_parallel.mixers.conv import chunk_halos, conv_kernel, document_starts, halo_causal_conv


@dataclass(frozen=True)
class ContextIds:
    """The cache an n-gram embedding is handed inside a sharded call: each of its rows' preceding ids."""

    context: torch.Tensor
    """``[rows, n - 1]`` the ids before each row (Note [n-gram halo])."""

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.context

    def update_conv_state(self, *args: object, **kwargs: object) -> None:
        """Nothing is kept: seqpar trains without a cache, and each call brings its own context."""


def token_windows(ids: torch.Tensor, width: int, fill: int, ctx: CallContext) -> torch.Tensor:
    """``[B, L, width]``: the ``width`` ids before each of this rank's tokens ``ids`` ``[B, L]`` in the whole row,
    ``fill`` where one lies before the token's document or row (Note [n-gram halo]); column ``j`` is ``width - j``
    tokens back."""
    b, local = ids.shape
    sp, layout = ctx.mesh, ctx.layout
    chunks = chunks_per_rank(layout) if sp.sp_size > 1 else 1
    size = local // chunks
    pieces = ids.view(b, 1, chunks, size)
    extended = torch.cat([chunk_halos(pieces, width, sp, layout), pieces], dim=-1)[:, 0]  # [B, chunks, width + size]
    windows = extended.unfold(-1, width, 1)[:, :, :size].reshape(b, local, width)
    index, starts = document_starts(sp, layout, ctx.mask, local)
    since = (index - starts.to(index.device)).to(ids.device)  # tokens since the document's start, [B or 1, L]
    reach = torch.arange(width, 0, -1, device=ids.device)
    return torch.where(since[..., None] >= reach, windows, fill)


def ngram_embeddings(embedding: torch.nn.Module, ids: torch.Tensor, ctx: CallContext) -> torch.Tensor:
    """``[B, L, D]``: a ``Qwen4ExpTextNGramEmbedding``'s output for this rank's tokens ``ids`` ``[B, L]`` as one
    process gives it for the whole row (Note [n-gram halo])."""
    width = embedding.context_len
    windows = token_windows(ids.long(), width, embedding.eos_token_id, ctx).reshape(-1, width)
    return embedding(ids.reshape(-1, 1).long(), ContextIds(windows)).reshape(*ids.shape, -1)


def dilated_halo_conv(conv: torch.nn.Conv1d, x: torch.Tensor, kernel: object, ctx: CallContext) -> torch.Tensor:
    """A depthwise ``conv`` (dilated, no padding of its own) over ``x`` ``[B, C, L]`` as a causal convolution of the
    whole row, its kernel spread out with zeros between the taps (Note [n-gram halo])."""
    weight, dilation = conv.weight.squeeze(1), conv.dilation[0]
    channels, taps = weight.shape
    spread = torch.cat([weight[..., None], weight.new_zeros(channels, taps, dilation - 1)], dim=-1)
    spread = spread.reshape(channels, taps * dilation)[:, : (taps - 1) * dilation + 1]
    return halo_causal_conv(x, spread, conv.bias, ctx.mesh, ctx.layout, ctx.mask, kernel)


def qwen4_exp_ple_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    input_ids: torch.Tensor,
    cache: object | None = None,
    conv_mask: torch.Tensor | None = None,
    **kwargs: object,
) -> torch.Tensor:
    """``Qwen4ExpTextPLELayer.forward`` on this rank's shard: the n-gram ids and the convolution's inputs across
    chunk edges (Note [n-gram halo]).

    Args:
        self: the ``Qwen4ExpTextPLELayer`` (its n-gram embedding, projections, norms and ``conv1d``).
        hidden_states: ``[B, L, hc_count x H]`` this rank's residual streams.
        input_ids: ``[B, L]`` this rank's token ids.
        cache: must be None (seqpar trains without a cache).
        conv_mask: ignored, as seqpar's calls carry none (padding is its own document).
        **kwargs: the layer's keywords; seqpar's call context among them.

    Returns:
        ``[B, L, hc_count x H]``.

    Raises:
        SeqparInputError: called outside a prepared model's call, or with a cache.
    """
    ctx = adapter_context(self, cache, kwargs, silu=False)  # its activation after the convolution is silu alone
    embeddings = ngram_embeddings(self.ple_embedding, input_ids, ctx)
    streams = (self.hc_count, self.hidden_size)
    key_normed = self.norm_key(self.key_proj(embeddings)).unflatten(-1, streams)
    value = self.value_proj(embeddings)
    query_normed = self.norm_query(hidden_states).unflatten(-1, streams)
    gate = (key_normed * query_normed).sum(dim=-1, keepdim=True) / math.sqrt(self.hidden_size)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gated_value = (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)
    normed = self.norm_conv(gated_value).transpose(1, 2)
    kernel = conv_kernel(type(self).__mro__[1])  # the adapter subclasses the transformers class
    return gated_value + F.silu(dilated_halo_conv(self.conv1d, normed, kernel, ctx)).transpose(1, 2)
