"""Sparse attention whose keys an indexer selects (DeepSeek Sparse Attention, Qwen4-Exp's QSA), over a sharded sequence.

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

    Qwen4-Exp's QSA indexer (its ``SPARSE_INDEXERS`` row says how) ranks, for each query, the means of blocks of
    ``indexer_compress_ratio`` keys it may see, counted from its document's first token, keeps the best blocks and
    its last partial one, and returns a boolean mask over the keys, which its attention module joins to its mask
    and hands the attention function as that mask (no ``indices=``): seqpar's attention takes it where it is the
    visibility it made joined with the picks. It rotates each block key by the rotary row of the block's first
    token and its queries by the table's last rows: its pre-hook hands it the whole row's table (cos and sin
    all-gathered, ``rotary_dim`` values a token each) followed by the shard's own rows.

    The strategy asked for serves the model's other layers; a DSA layer gathers as the allgather strategy does,
    keys and values after the MLA expansion (``2 x heads x head_dim`` values a token, where the latent before it
    holds ``kv_lora_rank + rope`` values), and the local kernel attends each local query over the whole gathered
    row under the dense mask: ``S/P x S`` booleans a layer, which at long rows is memory a sparse kernel over the
    picks would not need.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from seqpar.errors import SeqparInputError
from seqpar.models.own_attention import indexer_row, sparse_indexer
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


def indexer_arguments(indexer: torch.nn.Module, args: tuple, kwargs: dict, ctx: CallContext) -> tuple[tuple, dict]:
    """An indexer's call inside a sharded call: its cache gathers its keys, its mask is one per row, and an indexer
    that rotates keys by their positions gets the whole row's rotary table (Note [indexed attention])."""
    signature = inspect.signature(indexer.forward)
    bound = signature.bind(*args, **kwargs).arguments  # named, as the module may pass its cache by position
    rest = [n for n, p in signature.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD]
    called = {**(bound.pop(rest[0], {}) if rest else {}), **bound}
    called["cache"] = IndexerKeys(ctx)
    mask = called.get("attention_mask")
    hidden = called.get("hidden_states")
    if isinstance(mask, torch.Tensor) and hidden is not None:  # each row's own, as the indexer may index it by row
        called["attention_mask"] = mask.expand(hidden.shape[0], *mask.shape[1:])
    if indexer_row(indexer).positions:
        width = ctx.width or hidden.shape[1] * ctx.mesh.sp_size
        table = called["position_embeddings"]
        # the whole row's table, then the shard's own rows, which it rotates its queries by (as after a cache)
        whole = (gather_sequence(t, ctx.mesh, 1, ctx.layout)[:, :width] for t in table)
        called["position_embeddings"] = tuple(torch.cat([w, t], dim=1) for w, t in zip(whole, table))
    return (), called


def picked_keys(module: torch.nn.Module, mask: object, kwargs: dict, ctx: CallContext) -> torch.Tensor | None:
    """``[B or 1, 1, S/P, W]`` bool: the keys a sparse layer's local queries attend to (what they may see and their
    indexer picked), or None where the call is not a sparse layer's over the mask seqpar made.

    Raises:
        SeqparInputError: picks that do not name one row of global keys per local query.
    """
    indices = kwargs.get("indices")
    if indices is not None and any(mask is t for t in ctx.cache.values()):  # DSA: the picks as key indices
        if indices.dim() != 3 or indices.shape[1] != mask.shape[-2]:
            raise SeqparInputError(
                f"the indexer's picks have shape {tuple(indices.shape)}, not [batch, local tokens, top-k] "
                f"(batch, {mask.shape[-2]}, k)"
            )
        picked = torch.zeros(*indices.shape[:2], mask.shape[-1], dtype=torch.bool, device=mask.device)
        return mask & picked.scatter_(-1, indices.long(), True)[:, None]
    row = indexer_row(indexer) if (indexer := sparse_indexer(module)) is not None else None
    if row is None or row.picks != "mask" or not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        return None
    seen = next((t for k, t in ctx.cache.items() if k[0] == VISIBLE_KEY and t.shape[-2:] == mask.shape[-2:]), None)
    if seen is None or mask.dim() != 4:  # the module's mask is seqpar's visibility joined with its indexer's picks
        raise SeqparInputError(
            f"{type(module).__name__} handed seqpar's attention a mask of shape {tuple(mask.shape)} that is not its "
            "indexer's picks over the visibility seqpar made (Note [indexed attention])"
        )
    return mask


def indexed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float | None,
    ctx: CallContext,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, AttentionChoice]:
    """Each local query attends to the keys its indexer picked among those it may see (Note [indexed attention]).

    Args:
        q: ``[B, H, S/P, D]`` local queries.
        k: ``[B, Hkv, S/P, D]`` local keys.
        v: ``[B, Hkv, S/P, Dv]`` local values.
        allowed: ``[B or 1, 1, S/P, W]`` the global keys each local query attends to (``picked_keys``).
        scale: the softmax scale.
        ctx: the call context.
        sinks: ``[H]`` sink logits (HY-V4's, Note [attention sinks]), or None.

    Returns:
        ``[B, H, S/P, Dv]``, and the strategy and kernel that computed it (the allgather strategy's gathering).
    """
    seq = q.shape[2] * ctx.mesh.sp_size
    width = v.shape[-1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale  # the queries' own head size (Note [value head size])
    q, k, v = same_head_width(q, k, v)
    keys, values = (gather_sequence(t, ctx.mesh, dim=2, layout=ctx.layout) for t in (k, v))
    allowed = torch.nn.functional.pad(allowed, (0, seq - allowed.shape[-1]))  # the layout's padding: unseen
    kernel = select_kernel(q, keys, values, ctx.kernel, mask=allowed)
    out = masked_attention(q, keys, values, allowed, scale, kernel, sinks)
    return out[..., :width], AttentionChoice("allgather", kernel)
