"""The checks of a prepared model's call on shards, made on every rank at once (Note [agreeing on errors]).

One flag per mistake, exchanged as one signature, so that every rank raises the same error or none does.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from seqpar.errors import SeqparInputError
from seqpar.mesh import SequenceParallelMesh
from seqpar.sequence_parallel.checks import Signature, by_rank, config_digest, config_disagreement, exchange_signatures
from seqpar.sequence_parallel.layouts.chunks import LAYOUTS, PER_BATCH_LAYOUTS, ChunkLayout, Layout
from seqpar.sequence_parallel.whole_rows import SHARD_REFUSED

LAYOUT_KEYWORD = "seqpar_layout"
"""The model-call keyword that carries a batch's own layout (``shard.layout`` of ``shard_batch``); the
forward pre-hook takes it out before the model sees its arguments."""
WIDTH_KEYWORD = "seqpar_width"
"""The model-call keyword (and ``seqpar.hf`` shards' entry) that carries the rows' global width before
``shard_batch``'s layout padding (``shard.width``), which a sparse-attention indexer ranks (Note [indexed
attention]) and NEFTune's noise spans; taken out by the hook (0, a padding batch's, stands for none)."""
PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
"""Keywords that give varlen kernels a whole row's packed documents; seqpar reads the documents of a shard from
its position ids, so a prepared model's call refuses them (the Trainer doors drop them from their batches)."""

# One flag of CallSignature per mistake, with what to do instead.
CALL_PROBLEMS = {
    "positional_args": "call a seqpar-prepared model with keywords: model(input_ids=..., position_ids=...)",
    "no_position_ids": "a seqpar-prepared model needs position_ids (the global positions of this rank's tokens, "
    "from seqpar.shard_batch); without them RoPE would use local positions",
    "labels": "do not pass labels to a seqpar-prepared model: it would shift them again inside its shard; "
    "compute seqpar.cross_entropy(logits, shard['shift_labels'], mesh) instead",
    "attention_mask": "seqpar reads documents and padding from position_ids and shift_labels; drop attention_mask "
    "(shard_batch already masks padding out of the loss)",
    "use_cache": "seqpar-prepared models train without a KV cache; pass use_cache=False",
    "packing_keys": f"{' / '.join(PACKING_KEYS)} describe a whole row's packed documents, not this rank's shard: "
    "drop them, seqpar reads the documents from position_ids (restarting at 0 at each document start)",
    "no_layout": f"a model prepared with layout='balanced' needs each batch's layout: call it as "
    f"model(input_ids=..., position_ids=..., {LAYOUT_KEYWORD}=shard.layout) with the shard from seqpar.shard_batch",
    "bad_layout": f"{LAYOUT_KEYWORD} must be 'contiguous', 'zigzag' or the ChunkLayout of seqpar.shard_batch "
    f"(shard.layout) for this many ranks",
    "bad_width": f"{WIDTH_KEYWORD} must be shard.width of seqpar.shard_batch: a whole number of tokens, at most "
    "the call's global length",
    "multimodal_keys": f"{', '.join(SHARD_REFUSED)} belong to a whole-row call of a multimodal model (Note "
    "[whole-row calls]); on shards each rank would merge or mask a part of a row (a text model ignores them)",
    "mrope_embeds": "this model numbers image tokens with mRoPE from its whole rows: call it with whole rows "
    "(input_ids, pixel_values, image_grid_thw; Note [whole-row calls]) or with input_ids shards of text, not "
    "with inputs_embeds shards (their [B, S] positions would be wrong for any image token in them)",
    "placeholders": "input_ids hold image or video placeholder tokens but no pixels came with them: call a "
    "multimodal model with whole rows and their pixel_values (Note [whole-row calls])",
}


def layout_digest(layout: object) -> int:
    """A number the ranks compare to agree on one call's layout (0 when none was passed)."""
    if layout is None:
        return 0
    return (layout.digest if isinstance(layout, ChunkLayout) else zlib.crc32(repr(layout).encode())) + 1


@dataclass(frozen=True)
class CallSignature(Signature):
    """One model call as the ranks compare it: the mistakes of ``CALL_PROBLEMS`` and the position ids' shape."""

    positional_args: bool
    no_position_ids: bool
    labels: bool
    attention_mask: bool  # one that masks something out (an all-ones mask is harmless)
    use_cache: bool
    packing_keys: bool
    no_layout: bool
    bad_layout: bool
    bad_width: bool
    multimodal_keys: bool
    mrope_embeds: bool
    placeholders: bool
    config_digest: int  # config_digest of the model's config: every rank must have built the same model
    layout_digest: int  # layout_digest of the call's layout keyword: every rank must pass the same one
    row_width: int  # the call's width keyword (0: none): every rank must pass the same one
    positions_ndim: int
    positions_dims: tuple[int, int]  # the first two sizes, zero-padded

    @property
    def positions_shape(self) -> list[int]:
        """The position ids' sizes as far as they were sent (at most two)."""
        return list(self.positions_dims[: self.positions_ndim])


def placeholder_ids(config: object) -> list[int]:
    """The image and video placeholder token ids of a multimodal model's config (none for a text model)."""
    names = ("image_token_id", "video_token_id", "image_token_index", "video_token_index")
    return [v for v in (getattr(config, n, None) for n in names) if isinstance(v, int)]


def _fits_width(width: object, ids: object, sp_size: int) -> bool:
    """A width of whole tokens, at most the call's global length (when its input ids tell it)."""
    if not isinstance(width, int) or isinstance(width, bool) or width < 1:
        return False
    return not isinstance(ids, torch.Tensor) or width <= ids.shape[-1] * sp_size


def layout_fault(sp: SequenceParallelMesh, prepared: Layout, call_layout: object) -> tuple[bool, bool]:
    """(no layout where the prepared one is per-batch, a call layout that does not fit the mesh)."""
    fits = isinstance(call_layout, ChunkLayout) and call_layout.world_size == sp.sp_size
    return prepared in PER_BATCH_LAYOUTS and call_layout is None, call_layout is not None and not (
        fits or call_layout in LAYOUTS
    )


def agree_on_call(
    args: tuple,
    kwargs: dict,
    sp: SequenceParallelMesh,
    prepared: Layout,
    call_layout: object,
    config: object,
    family: object,
    width: object = None,
) -> None:
    """Check one model call on every rank at once (Note [agreeing on errors]): all raise, or none does."""
    attention_mask = kwargs.get("attention_mask")
    no_layout, bad_layout = layout_fault(sp, prepared, call_layout)
    ids = kwargs.get("input_ids")
    placeholders = placeholder_ids(config)
    held = isinstance(ids, torch.Tensor) and bool(placeholders)
    held = held and bool(torch.isin(ids, torch.tensor(placeholders, device=ids.device)).any())
    positions = kwargs.get("position_ids")
    shape = list(positions.shape) if positions is not None else []
    signature = CallSignature(
        positional_args=bool(args),
        no_position_ids=positions is None,
        labels=kwargs.get("labels") is not None,
        attention_mask=attention_mask is not None and not bool(torch.as_tensor(attention_mask).bool().all()),
        # RWKV's state is its cache, and its blocks get seqpar's context there (Note [context in the mask])
        use_cache=bool(kwargs.get("use_cache")) or (family.mask_context == "state" and kwargs.get("state") is not None),
        packing_keys=any(kwargs.get(k) is not None for k in PACKING_KEYS),
        no_layout=no_layout,
        bad_layout=bad_layout,
        bad_width=width is not None and not _fits_width(width, ids, sp.sp_size),
        multimodal_keys=any(kwargs.get(k) is not None for k in SHARD_REFUSED),
        mrope_embeds=family.positions == "mrope" and kwargs.get("inputs_embeds") is not None,
        placeholders=held,
        config_digest=config_digest(config),
        layout_digest=layout_digest(call_layout),
        row_width=width if isinstance(width, int) and _fits_width(width, ids, sp.sp_size) else 0,
        positions_ndim=len(shape),
        positions_dims=tuple([*shape, 0, 0][:2]),
    )
    table = [signature] if sp.sp_size == 1 else exchange_signatures(signature, sp.sp_group)
    said = CALL_PROBLEMS
    if getattr(family, "images", None):  # images seqpar cannot serve for this model: the reason first
        said = {"multimodal_keys": family.images} | {k: m for k, m in said.items() if k != "multimodal_keys"}
    problems = by_rank([[m for name, m in said.items() if getattr(row, name)] for row in table])
    same = (table[0].positions_ndim, table[0].positions_dims)
    if not problems and any((row.positions_ndim, row.positions_dims) != same for row in table):
        shapes = "; ".join(f"rank {r}: {row.positions_shape}" for r, row in enumerate(table))
        problems.append(f"position_ids shapes differ across ranks (every rank holds one equal shard): {shapes}")
    differing = config_disagreement([row.config_digest for row in table])
    if not problems and differing:
        problems.append(differing)
    if not problems and any(row.layout_digest != table[0].layout_digest for row in table):
        problems.append(f"the ranks passed different {LAYOUT_KEYWORD} values; pass every rank its shard's layout")
    if not problems and any(row.row_width != table[0].row_width for row in table):
        problems.append(f"the ranks passed different {WIDTH_KEYWORD} values; pass every rank its shard's width")
    if problems:
        raise SeqparInputError(" | ".join(problems))
