"""A causal depthwise convolution over a sequence split into chunks across ranks, exact at every chunk edge.

The short convolutions of hybrid models (LFM2's, and the ones before Mamba2 and gated DeltaNet mixers) use it.
ZAYA's attention exchanges its q/k and delayed-value halos with ``chunk_halos`` (Note [CCA halo]).

Note [halo convolution]
    A causal depthwise convolution of width K mixes each token with the K - 1 tokens before it. On a rank
    that holds chunks of the sequence (any layout: contiguous, zigzag, balanced, placed), a chunk's first
    K - 1 outputs need the last K - 1 inputs of the chunk before it in the sequence, which another rank may
    hold. Every rank sends the last K - 1 inputs of each of its chunks (its "tails", ``[chunks, B, C, K - 1]``,
    independent of the sequence length; a chunk shorter than that sends all of itself) in one all-gather; each
    chunk then convolves its own inputs with the K - 1 tokens before it, taken from the tails of the chunks
    before it in the sequence (zeros before the first). The backward of the all-gather is a reduce-scatter,
    so every rank takes part in it, whether or not its outputs used another rank's tail (Note [symmetric
    exchange]: a rank that skipped it would leave the others waiting).
    Packed documents: the tap ``k`` tokens back belongs to the same document exactly when it lies at or after
    the token's document start (``SequenceMask.starts``); other taps are left out, so a document's first
    token sees only itself, as when the document runs alone (transformers' one process lets the convolution
    cross document starts). Padding that the layouts add is a document of its own.
    The kernel: where no document starts inside the shard's rows, each chunk with its halo in front,
    ``[halo | chunk]``, goes through the model's own ``causal_conv1d_fn`` (transformers' dispatcher: the
    ``causal_conv1d`` CUDA kernel where it is installed and the tensors are on a GPU, else ``F.conv1d``), all chunks
    of all rows in one call, and the first K - 1 outputs of each are dropped. With document starts inside, the
    taps are summed one by one in PyTorch, each masked at the starts (the fallback refuses ``seq_idx``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from seqpar.mesh import SequenceParallelMesh
from seqpar.sequence_parallel.call_context import CallContext
from seqpar.sequence_parallel.layouts.chunks import (
    Layout,
    chunks_per_rank,
    gather_sequence,
    rank_chunk_ids,
    shard_for_rank,
)
from seqpar.sequence_parallel.masks import SequenceMask


def token_positions(layout: Layout, sp: SequenceParallelMesh, local: int) -> torch.Tensor:
    """Each of this rank's ``local`` tokens' index in the whole sequence (natural order), ``[local]``."""
    return shard_for_rank(torch.arange(local * sp.sp_size), sp.sp_rank, sp.sp_size, 0, layout)


def document_starts(
    sp: SequenceParallelMesh, layout: Layout, mask: SequenceMask | None, local: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of this rank's ``local`` tokens' index in the whole sequence, ``[local]``, and the index of its
    document's first token, ``[B or 1, local]`` (0 where the batch has no documents)."""
    index = token_positions(layout, sp, local)
    no_documents = mask is None or mask.starts is None
    return index, torch.zeros(1, local, dtype=index.dtype) if no_documents else mask.starts[:, index]


def conv_kernel(cls: type) -> Callable[..., torch.Tensor] | None:
    """The ``causal_conv1d_fn`` of the transformers module that defines the mixer class ``cls``, or None where
    that module has none (Note [halo convolution])."""
    kernel = getattr(sys.modules.get(cls.__module__), "causal_conv1d_fn", None)
    return kernel if callable(kernel) else None


def layer_conv(layer: torch.nn.Module, x: torch.Tensor, conv: torch.nn.Conv1d, ctx: CallContext, bias: bool = True):
    """``halo_causal_conv`` of ``x`` ``[B, C, L]`` with an adapted mixer layer's depthwise ``conv`` (its bias
    unless ``bias`` is False) and the kernel of the module its transformers class comes from, in the call ``ctx``
    (Note [halo convolution])."""
    weight, conv_bias = conv.weight.squeeze(1), conv.bias if bias else None
    kernel = conv_kernel(type(layer).__mro__[1])  # the adapter subclasses the transformers class
    return halo_causal_conv(x, weight, conv_bias, ctx.mesh, ctx.layout, ctx.mask, kernel)


def chunk_halos(pieces: torch.Tensor, halo: int, sp: SequenceParallelMesh, layout: Layout) -> torch.Tensor:
    """The ``halo`` inputs before each of this rank's chunks in the whole sequence (zeros before its start), in one
    all-gather of every chunk's tail (Note [halo convolution]).

    Args:
        pieces: ``[B, C, chunks, size]`` this rank's inputs, its chunks in ``layout`` order (one chunk at sp 1).
        halo: how many tokens before each chunk.
        sp: the sequence-parallel mesh.
        layout: the layout the sequence is sharded with.

    Returns:
        ``[B, C, chunks, halo]``.
    """
    b, c, chunks, size = pieces.shape
    if sp.sp_size == 1 or not halo:  # one rank holds the whole sequence: zeros before it
        return pieces.new_zeros(b, c, chunks, halo)
    tail = min(size, halo)  # a chunk shorter than the halo sends all of itself; the halo spans several chunks
    spans = -(-halo // tail)  # chunks a halo reaches back over
    tails = pieces[..., size - tail :].permute(2, 0, 1, 3).contiguous()  # [chunks, B, C, tail]
    by_chunk = gather_sequence(tails, sp, dim=0, layout=layout)  # every chunk's tail, in the sequence's order
    earlier = torch.cat([torch.zeros_like(by_chunk[:1]).expand(spans, -1, -1, -1), by_chunk])
    mine = torch.tensor(rank_chunk_ids(layout, sp.sp_size, sp.sp_rank))
    before = torch.cat([earlier[mine + j] for j in range(spans)], dim=-1)[..., -halo:]  # the tokens before each
    return before.permute(1, 2, 0, 3)  # [B, C, chunks, halo]


def halo_causal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    sp: SequenceParallelMesh,
    layout: Layout,
    mask: SequenceMask | None = None,
    kernel: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """The causal depthwise convolution of the whole sequence, on this rank's chunks (Note [halo convolution]).

    Args:
        x: ``[B, C, L]`` this rank's inputs, its chunks in ``layout`` order.
        weight: ``[C, K]`` the depthwise kernel (``conv1d.weight.squeeze(1)``).
        bias: ``[C]`` or None.
        sp: the sequence-parallel mesh.
        layout: the layout the sequence is sharded with.
        mask: the batch's mask; its ``starts`` keep the convolution inside each packed document.
        kernel: the model's ``causal_conv1d_fn`` (``conv_kernel``), run where no document starts in the shard.

    Returns:
        ``[B, C, L]``: the convolution's output for this rank's tokens, as ``F.conv1d`` with ``K - 1`` zeros of
        left padding would give it for the whole sequence (and for each packed document alone).
    """
    b, c, local = x.shape
    width = weight.shape[-1]
    halo = width - 1
    chunks = chunks_per_rank(layout) if sp.sp_size > 1 else 1
    size = local // chunks
    pieces = x.view(b, c, chunks, size)
    extended = torch.cat([chunk_halos(pieces, halo, sp, layout), pieces], dim=-1)  # [B, C, chunks, K - 1 + size]
    index, starts = document_starts(sp, layout, mask, local)
    if kernel is not None and not starts.any():  # one document from the sequence's start: every tap is inside
        rows = extended.permute(0, 2, 1, 3).reshape(b * chunks, c, halo + size)
        out = kernel(rows, weight, bias, activation=None)[..., halo:]  # [B * chunks, C, size]
        return out.reshape(b, chunks, c, size).permute(0, 2, 1, 3).reshape(b, c, local).to(x.dtype)
    back = (index - starts.to(index.device)).to(x.device)  # tokens since the document's start, [B or 1, L]
    # summed in float32 whatever x's dtype, as a convolution kernel accumulates
    out = torch.zeros(b, c, chunks, size, dtype=torch.float32, device=x.device)
    if bias is not None:
        out = out + bias.float().view(1, c, 1, 1)
    for k in range(width):  # tap k: the input k tokens back, weighted by the kernel's (K - 1 - k)-th entry
        tap = extended[..., halo - k : halo - k + size].float()
        inside = (back >= k).view(back.shape[0], 1, chunks, size)
        out = out + weight[:, width - 1 - k].float().view(1, c, 1, 1) * tap * inside
    return out.to(x.dtype).reshape(b, c, local)
