"""Self-attention calls of ``seqpar.prepare_diffusers`` served by gathering every rank's keys and values.

Masks over token pairs, a processor's padding product or block-causal runs, and keys joined to a whole text.

Note [gathered keys]
    Three kinds of attention call over the shards are not the ring's or Ulysses' (queries and keys the same
    shards under at most a key-padding mask). Each is served as the allgather strategy serves a call: the keys
    and values of every rank all-gathered (their gradients reduce-scattered back, so each rank's keys get the sum
    over every rank's queries, as in one process), then torch's own SDPA on this rank's queries against them, so
    every row, a fully masked one included, is what one process's SDPA gives it:

    - A mask over token pairs (``[B, H|1, S, S]``: a sliding window, segments, a causal prompt before a
      bidirectional image) built over the whole sequence before the blocks: a plan derived from the structure cuts
      its query rows with the tokens and keeps its key columns whole (Note [diffusion plans]), so the call holds
      ``[B, H|1, S/P, S]``, the rows of its own queries, and the keys are gathered in the layout's global order,
      the columns' order. Such a mask over a joint [text; tokens] sequence is refused.
    - A mask over the call's own query-key pairs that its processor builds as the product of one per-token padding
      mask, as queries and as keys (an ``AttentionRow`` with ``padding_product``): each rank reads its keys'
      padding off the mask's columns (a column is its key's padding in any row that sees some key), gathers it
      with the keys, and attends under its rows' padding x every key's padding. A rank none of whose queries sees
      a key cannot read its keys' padding: refused on every rank; so is a mask that is no such product.
    - Keys that are not the shards of the queries but [the text's keys; the shard's keys] (or the shard's first): a
      processor joining the text (whole on every rank) to the keys of image queries (an ``AttentionRow`` with
      ``text_keys``, whose text the plan therefore keeps whole). Only the shard's part is gathered; the text's part
      stays local (attention does not depend on the order of its keys without a mask over pairs; a key-padding
      mask is split and gathered alike). Each rank's text keys then get the gradients of its own queries only, and
      the sum over the ranks (``seqpar.reduce_gradients``) gives one process's, as for local cross-attention.
      Other keys that are not the shards of the queries (memory or register tokens) stay refused.

    A processor that slices its queries by the global positions of a block-causal structure (an ``AttentionRow``
    with ``segments``: Qwen-Image 2.1's runs of a causal prompt and condition images) would slice a rank's shard
    by them: the door builds that structure's mask over the whole sequence instead, keys' padding included, hands
    the call the rows of its own queries as its mask and no runs, and the processor's one call over every query is
    served as the first kind.

    A processor that drops the text's padding from its joint sequence and puts the valid tokens' outputs first, by
    their place in the text it is given (an ``AttentionRow`` with ``compacts_text``: Mochi's), would place them by
    the rank's cut text, not the whole one: a call whose text has padding on any rank is refused on every rank.

    The call costs the allgather strategy's bytes (the whole keys and values on every rank) whatever strategy
    the door was given, and the mask's rows: ``S/P x S`` per call, as the model's own mask costs ``S x S``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from seqpar.errors import SeqparInputError
from seqpar.mesh import SequenceParallelMesh
from seqpar.models.diffusion_attention import AttentionRow
from seqpar.sequence_parallel.context_parallel.sdpa_mode import agree_or_raise
from seqpar.sequence_parallel.layouts.chunks import gather_sequence, shard_sequence

_RANK_ORDER = "contiguous"  # the layout whose gather concatenates the ranks' shards in rank order
_PRODUCT_PROBLEMS = (
    "its processor's mask over the call's own query-key pairs is not the product of one padding mask as queries "
    "and as keys (its row says it is; Note [gathered keys])",
    "none of this rank's queries sees any key, so its keys' padding cannot be read off the mask (Note [gathered keys])",
)


def _gather_mask(mask: torch.Tensor, sp: SequenceParallelMesh, layout: str) -> torch.Tensor:
    """A mask's key columns (its last dim) gathered from every rank, in ``layout``'s order (bool or additive)."""
    if mask.dtype == torch.bool:
        return gather_sequence(mask.to(torch.uint8), sp, dim=mask.dim() - 1, layout=layout).bool()
    return gather_sequence(mask.detach(), sp, dim=mask.dim() - 1, layout=layout)


def _sdpa(query, key, value, mask, named: dict, sp: SequenceParallelMesh, layout: str) -> torch.Tensor:
    """This rank's queries against every rank's keys and values gathered in ``layout``'s order, by torch's SDPA."""
    keys, values = (gather_sequence(t, sp, dim=t.dim() - 2, layout=layout) for t in (key, value))
    scale, gqa = named.get("scale"), bool(named.get("enable_gqa", False))
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _product_mask(mask: torch.Tensor, sp: SequenceParallelMesh, where: str) -> torch.Tensor:
    """``[..., S/P, S]``: this rank's rows' padding x every key's padding, read off a padding product over the
    call's own pairs (Note [gathered keys]); the columns in rank order."""
    problem = None
    rows, cols = mask.any(-1, keepdim=True), mask.any(-2, keepdim=True)
    if mask.dtype != torch.bool or not torch.equal(mask, rows & cols):
        problem = (0, _PRODUCT_PROBLEMS[0])
    elif not bool(rows.any(-2).all()):
        problem = (1, _PRODUCT_PROBLEMS[1])
    agree_or_raise(sp.sp_group, f"{where}: scaled_dot_product_attention", problem, _PRODUCT_PROBLEMS)
    return rows & _gather_mask(cols, sp, _RANK_ORDER)


def _refuse(why: str, where: str) -> None:
    raise SeqparInputError(f"{where}: {why} (Note [gathered keys])")


def gathered_call(
    query: torch.Tensor,
    key: torch.Tensor,
    named: dict,
    sp: SequenceParallelMesh,
    layout: str,
    lengths: tuple[int | None, int | None],
    row: AttentionRow | None,
    where: str,
) -> torch.Tensor | None:
    """Serve one SDPA call of the kinds Note [gathered keys] names; None: the call is the ring's (shards of one
    sequence under at most a key-padding mask), left to ``seqpar.attention``.

    Args:
        query, key: the call's ``[..., S/P, D]`` tensors; ``named``: its other arguments by name.
        sp, layout: the door's mesh and layout.
        lengths: ``(tokens, text)``: the whole lengths of the sequences the plan cut (None: not cut).
        row: the attention module's ``AttentionRow``, or None.
        where: the door's name, for errors.

    Raises:
        SeqparInputError: a call of those kinds seqpar cannot serve exactly, on every rank (the same shapes, or one
            agreement).
    """
    mask, queries, keys, size = named.get("attn_mask"), query.shape[-2], key.shape[-2], sp.sp_size
    mask = mask if isinstance(mask, torch.Tensor) and mask.dim() >= 2 else None
    tokens, text = lengths
    rows = mask is not None and queries == keys and mask.shape[-1] == keys * size and mask.shape[-2] in (1, queries)
    product = row is not None and row.padding_product and mask is not None and mask.shape[-2:] == (queries, keys)
    if not (rows or product or queries != keys):
        return None
    if named.get("is_causal") or named.get("dropout_p"):
        _refuse("a gathered call takes neither is_causal nor dropout_p", where)
    if rows:
        if tokens is None or keys * size != tokens:
            _refuse(
                f"a mask over token pairs of {keys * size} keys, not the {tokens} tokens cut at the first block (a "
                "mask over a joint [text; tokens] sequence)",
                where,
            )
        return _sdpa(query, key, named["value"], mask, named, sp, layout)
    if product:
        return _sdpa(query, key, named["value"], _product_mask(mask, sp, where), named, sp, _RANK_ORDER)
    joined = row.text_keys if row is not None else ""
    if not joined or keys <= queries or text is not None:
        _refuse(
            f"an attention over the sharded tokens has {queries} queries but {keys} keys on this rank: keys that "
            "are not the shards of its queries (memory or register tokens every rank holds whole, or another "
            "sequence) would count once per rank",
            where,
        )
    if mask is not None and (mask.shape[-2] != 1 or mask.shape[-1] not in (keys, keys + queries * (size - 1))):
        _refuse(
            f"keys joined to a text take a key-padding mask over this rank's keys or over every key, not one of "
            f"shape {tuple(mask.shape)}",
            where,
        )
    return _joined_sdpa(query, key, named, mask, keys - queries, joined == "first", sp, layout)


def _joined_sdpa(query, key, named: dict, mask, text: int, first: bool, sp: SequenceParallelMesh, layout: str):
    """This rank's queries against [the whole text's keys; every rank's shard's keys] (Note [gathered keys])."""
    cut = [text, key.shape[-2] - text] if first else [key.shape[-2] - text, text]
    parts = [t.split(cut, dim=-2) for t in (key, named["value"])]
    shard = 1 if first else 0
    keys, values = (
        torch.cat([p[1 - shard], gather_sequence(p[shard], sp, dim=p[shard].dim() - 2, layout=layout)], dim=-2)
        for p in parts
    )
    if mask is not None and mask.shape[-1] == key.shape[-2]:  # this rank's keys': the shard's part gathered
        parts = mask.split(cut, dim=-1)
        mask = torch.cat([parts[1 - shard], _gather_mask(parts[shard], sp, layout)], dim=-1)
    elif mask is not None:  # every key's, the tokens' part in global order (the gathered keys' order)
        tokens = mask.shape[-1] - text
        parts = mask.split([text, tokens] if first else [tokens, text], dim=-1)
        mask = torch.cat([parts[1 - shard], parts[shard]], dim=-1)
    scale, gqa = named.get("scale"), bool(named.get("enable_gqa", False))
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)


def segment_rows(kwargs: dict, local: int, sp: SequenceParallelMesh, layout: str, where: str) -> dict:
    """A call's arguments with its block-causal ``segments`` (and ``key_valid``) turned into the rows of their mask
    over the whole sequence, ``[B|1, 1, S/P, S]`` as ``attention_mask`` (Note [gathered keys]); ``local``: the
    call's tokens on this rank."""
    if kwargs.get("segments") is None:
        return kwargs
    if kwargs.get("kv_cache_mode") is not None or kwargs.get("layer_cache") is not None:
        _refuse("a block-causal call through a KV cache reads the prefix's keys by global position", where)
    size = local * sp.sp_size
    start, end = torch.zeros(size, dtype=torch.long), torch.full((size,), size)
    text = torch.zeros(size, dtype=torch.bool)
    for first, stop, is_text in kwargs["segments"]:
        start[first:stop], end[first:stop], text[first:stop] = first, stop, bool(is_text)
    query, key = torch.arange(size)[:, None], torch.arange(size)[None, :]
    seen = (key < end[:, None]) & ~(text[:, None] & (key >= start[:, None]) & (key > query))  # [S, S]
    seen = seen[None, None]
    valid = kwargs.get("key_valid")
    if valid is not None:  # cut with the tokens as a per-token table: gathered back to the whole row
        whole = gather_sequence(valid.to(torch.uint8), sp, dim=1, layout=layout).bool()  # [B, S]
        seen = seen.to(whole.device) & whole[:, None, None, :]
    rows = shard_sequence(seen.to(torch.uint8), sp, dim=2, layout=layout).bool()
    return {**kwargs, "segments": None, "key_valid": None, "attention_mask": rows}


_COMPACTED = (
    "the processor drops the text's padding tokens and puts the valid ones' outputs first by their place in the text "
    "it is given, which on a rank's cut text is another place than one process's (its row's compacts_text): pass no "
    "text padding",
)


def check_compacted_text(mask: object, sp: SequenceParallelMesh, where: str) -> None:
    """Refuse, on every rank, a call whose processor compacts its text (``AttentionRow.compacts_text``) given a text
    mask with padding on any rank (one small all-gather)."""
    problem = None if not isinstance(mask, torch.Tensor) or bool(mask.bool().all()) else (0, _COMPACTED[0])
    agree_or_raise(sp.sp_group, where, problem, _COMPACTED)
