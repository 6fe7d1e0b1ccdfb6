"""Sparse attention whose keys an indexer selects (DeepSeek Sparse Attention), served over a sharded sequence.

The attention module gets the global visibility as its mask, its indexer gathered keys, seqpar's attention the picks.

Note [indexed attention]
    A DSA layer (DeepSeek-V3.2, GLM-5) scores each query against every key it may see with a small indexer of
    its own, keeps the ``index_topk`` best, and attends to those keys only. transformers' modules take the
    indexer's keys from the cache (``cache.update_indexer``), mask its scores with the layer's attention mask,
    and, under an attention implementation other than eager or SDPA, hand the picked key indices to the
    attention function (``indices=``). On a shard each rank would rank its own keys alone. Under seqpar:

    - the attention module's pre-hook hands it, as its ``attention_mask``, what each local query may see of
      the whole sequence (``[B, 1, S/P, S]`` bool from the call's ``SequenceMask``: causal, documents,
      windows), which the module passes on to its indexer and to the attention function;
    - the indexer's pre-hook hands it, as its cache, ``IndexerKeys``: ``update_indexer`` all-gathers the
      indexer's keys into global order (``index_head_dim`` values a token: 128 in DeepSeek-V3.2, under
      no_grad as the indexer runs), so each local query's scores are the row of global keys one process
      ranks, and the picks are global key indices; where the call gives its rows' width before
      ``shard_batch``'s layout padding (``seqpar_width=shard.width``: the Trainer and ``seqpar train`` doors do),
      the row ends there, as one process's does;
    - seqpar's attention, given those indices and that mask, all-gathers keys and values (their gradients
      reduce-scattered back) and attends each local query to the picked keys it may see.

    The indexer's scores of a query are the same products as one process's, masked alike, and ``topk`` ranks
    the same row alike, ties included (a ReLU'd score is often exactly 0). Which of several exactly equal scores
    ``topk`` keeps depends on the row's length and order, in one process too: hence the width above. A row
    padded without it, or reordered (the placed layout), may keep other keys where scores tie at the k-th place
    than one process on the unpadded row. The tiny models' 2 index heads make such ties common; 64 make them rare.
    A padding token's query sees no key below the width: its output is 0, and no real token sees it.

    The strategy asked for serves the model's other layers; a DSA layer gathers as the allgather strategy does,
    keys and values after the MLA expansion (``2 x heads x head_dim`` values a token, where the latent before it
    holds ``kv_lora_rank + rope`` values), and the local kernel attends each local query over the whole gathered
    row under the dense mask: ``S/P x S`` booleans a layer, which at long rows is memory a sparse kernel over the
    picks would not need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seqpar.errors import SeqparInputError
from seqpar.sequence_parallel.api import AttentionChoice, same_head_width
from seqpar.sequence_parallel.call_context import CallContext
from seqpar.sequence_parallel.kernels import select_kernel
from seqpar.sequence_parallel.layouts.chunks import gather_sequence, rank_chunk_ids
from seqpar.sequence_parallel.strategies.local import masked_attention
from seqpar.sequence_parallel.tiling.planner import dense_mask

VISIBLE_KEY = "indexed"
"""``CallContext.cache`` key of the call's global visibility, one tensor per (batch, local length)."""


@dataclass(frozen=True)
class IndexerKeys:
    """The cache a DSA indexer is handed inside a sharded call: its keys come back gathered in global order."""

    ctx: CallContext

    def update_indexer(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """``[B, S/P, D]`` -> ``[B, W, D]``: every rank's indexer keys in global order, up to the call's width."""
        return gather_sequence(keys, self.ctx.mesh, dim=1, layout=self.ctx.layout)[:, : self.ctx.width]


def visibility(
    ctx: CallContext, batch: int, local: int, device: torch.device, window: int | None = None
) -> torch.Tensor:
    """``[B or 1, 1, S/P, W]`` bool: the global keys each local query may see (causal and the call's mask, under
    ``window`` where given), up to the call's width ``W`` (``S`` where the call gave none)."""
    sp = ctx.mesh
    key = (VISIBLE_KEY, batch, local, device, window)
    mask = ctx.mask if window is None else ctx.mask.with_window(window)
    if key not in ctx.cache:
        seq = local * sp.sp_size
        chunks = rank_chunk_ids(ctx.layout, sp.sp_size, sp.sp_rank)
        size = local // len(chunks)
        width = seq if ctx.width is None else ctx.width
        rows = [dense_mask((c * size, (c + 1) * size), (0, width), True, mask, None) for c in chunks]
        ctx.cache[key] = torch.cat(rows, dim=2).to(device)
    return ctx.cache[key]


def indexed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    indices: torch.Tensor,
    scale: float | None,
    ctx: CallContext,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, AttentionChoice]:
    """Each local query attends to the keys its indexer picked among those it may see (Note [indexed attention]).

    Args:
        q: ``[B, H, S/P, D]`` local queries.
        k: ``[B, Hkv, S/P, D]`` local keys.
        v: ``[B, Hkv, S/P, Dv]`` local values.
        visible: the call's visibility (``visibility``), as the module handed it back.
        indices: ``[B, S/P, topk]`` global key indices the indexer picked for each local query.
        scale: the softmax scale.
        ctx: the call context.
        sinks: ``[H]`` sink logits (HY-V4's, Note [attention sinks]), or None.

    Returns:
        ``[B, H, S/P, Dv]``, and the strategy and kernel that computed it (the allgather strategy's gathering).

    Raises:
        SeqparInputError: indices that do not name one row of global keys per local query.
    """
    seq = q.shape[2] * ctx.mesh.sp_size
    if indices.dim() != 3 or indices.shape[:2] != (q.shape[0], q.shape[2]):
        raise SeqparInputError(
            f"the indexer's picks have shape {tuple(indices.shape)}, not [batch, local tokens, top-k] "
            f"({q.shape[0]}, {q.shape[2]}, k)"
        )
    width = v.shape[-1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale  # the queries' own head size (Note [value head size])
    q, k, v = same_head_width(q, k, v)
    keys, values = (gather_sequence(t, ctx.mesh, dim=2, layout=ctx.layout) for t in (k, v))
    picked = torch.zeros(q.shape[0], q.shape[2], visible.shape[-1], dtype=torch.bool, device=q.device)
    picked.scatter_(-1, indices.long(), True)
    allowed = torch.nn.functional.pad(visible & picked[:, None], (0, seq - visible.shape[-1]))  # padding: unseen
    kernel = select_kernel(q, keys, values, ctx.kernel, mask=allowed)
    out = masked_attention(q, keys, values, allowed, scale, kernel, sinks)
    return out[..., :width], AttentionChoice("allgather", kernel)
