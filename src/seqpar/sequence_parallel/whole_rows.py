"""Multimodal models under sequence parallelism: called on whole rows, only their text decoder's input sharded.

The checks of a whole-row call (every rank at once) and the sharding of the decoder's embeddings and positions.

Note [whole-row calls]
    A vision-language model merges image features into its text embeddings by position: its own code counts
    the placeholder tokens of the row, runs the vision tower on the row's images and scatters the features
    into the placeholders, and Qwen's mRoPE numbers every token from the whole row's image grids. None of that
    can run on a shard (a shard holds part of an image's placeholders, or none). So a prepared multimodal model
    is called with the *whole* rows on every rank of the SP group, exactly as it is called in one process:

    ======================  ===========================================================================
    the call passes         ``input_ids`` ``[B, S]`` (whole), the processor's pixel and grid tensors,
                            optionally ``attention_mask`` (right padding) and ``position_ids`` (whole),
                            and ``seqpar_layout=shard.layout`` under a per-batch layout (and
                            ``seqpar_placement=shard.placement`` under the placed one)
    the model's own code    embeds, runs the vision tower (its own attention, every image whole),
                            merges the features, computes positions (mRoPE from the grids)
    seqpar, at the decoder  pads the row as ``shard_batch`` pads it (or lays it out in the placed order),
                            keeps this rank's tokens of the embeddings, positions and DeepStack
                            features, builds the mask from the whole row (documents, Gemma 3's image
                            blocks, moved with their documents under the placed layout)
    comes back              logits ``[B, S'/P, V]`` of this rank's tokens, in ``shard_batch``'s order
    ======================  ===========================================================================

    The loss is ``seqpar.cross_entropy(logits, shard["shift_labels"], mesh)`` with the shard of
    ``seqpar.shard_batch({"input_ids": ..., "attention_mask": ...}, mesh, layout=...)`` of the same rows, so
    labels are shifted before sharding as for text. Each rank backpropagates through the vision tower from
    its own tokens only; summing gradients over the SP group (as for every other parameter) gives the
    one-process gradient. Text positions: ``[B, S]`` ids mark packed documents as for text; transformers'
    ``[4, B, S]`` mRoPE form carries them in its first row; the plain ``[3, B, S]`` form is one document per
    row. Gemma 3's ``token_type_ids`` make each run of image tokens a block that sees itself both ways
    (Note [block-causal ranges]); its sliding window composes with the blocks by AND, as transformers does.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from seqpar.errors import SeqparInputError
from seqpar.mesh import SequenceParallelMesh
from seqpar.models.families import Family
from seqpar.sequence_parallel.checks import Signature, by_rank, config_disagreement, exchange_signatures
from seqpar.sequence_parallel.layouts.chunks import NAMED_LAYOUTS, ChunkLayout, Layout, named_layout, shard_for_rank
from seqpar.sequence_parallel.layouts.placed import Placement
from seqpar.sequence_parallel.masks.block_ranges import image_runs

PLACEMENT_KEYWORD = "seqpar_placement"
"""The keyword that brings a whole-row call under the placed layout its row order (``shard.placement``)."""
ROW_KEY = "seqpar_whole_row"
"""The keyword that carries a checked whole-row call from the model's hook to its text decoder's hook."""
WHOLE_ROW_KEYS = ("pixel_values", "pixel_values_videos", "mm_encoder_outputs")
"""Keywords that make a call a whole-row call: the model merges vision features into the row."""
_ROW_DATA = (
    "input_ids",
    "pixel_values",
    "pixel_values_videos",
    "pixel_attention_mask",
    "image_position_ids",
    "image_grid_thw",
    "video_grid_thw",
    "second_per_grid_ts",
    "mm_token_type_ids",
    "token_type_ids",
    "image_sizes",
    "image_sizes_videos",
    "batch_num_images",
    "position_ids",
    "attention_mask",
)
"""The call's tensors every rank of an SP group must hold equal (one sample per group)."""
SHARD_REFUSED = tuple(k for k in _ROW_DATA if k not in ("input_ids", "position_ids", "attention_mask"))
"""Multimodal keywords a call on shards must not carry: each rank would merge or mask a part of a row."""


@dataclass(frozen=True)
class WholeRow:
    """A checked whole-row call, as the text decoder's hook receives it."""

    layout: Layout
    """The layout the call's shard was made with (``shard_batch``'s)."""
    blocks: tuple[tuple[int, int], ...] | tuple[tuple[tuple[int, int], ...], ...] | None
    """Global token ranges of image blocks that see themselves both ways (Gemma 3), or None; one set of ranges
    per row when the rows hold their images at different tokens; under the placed layout, ranges of the placed
    row."""
    placement: Placement | None = None
    """Under the placed layout: the order of the placed row (``shard.placement``), else None."""


def is_whole_row_call(kwargs: dict, family: Family) -> bool:
    """True when a call of a multimodal model merges vision features or marks image blocks (whole rows)."""
    marks = family.image_blocks and kwargs.get(family.image_blocks) is not None
    return any(kwargs.get(k) is not None for k in WHOLE_ROW_KEYS) or bool(marks)


def _digest(tensors: list[object]) -> int:
    """A CRC-32 of the call's tensors' shapes and bytes (ranks compare it: one sample per SP group)."""
    crc = 0
    for t in tensors:
        if isinstance(t, (list, tuple)):
            crc = zlib.crc32(str(_digest(list(t))).encode(), crc)
            continue
        if not isinstance(t, torch.Tensor):
            crc = zlib.crc32(repr(t).encode(), crc)
            continue
        data = t.detach().cpu().contiguous()
        crc = zlib.crc32(repr((tuple(data.shape), str(data.dtype))).encode(), crc)
        crc = zlib.crc32(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"", crc)
    return crc


def _document_faults(
    ids: torch.Tensor | None, positions: torch.Tensor | None, keep: torch.Tensor | None, marks: torch.Tensor | None
) -> tuple[bool, bool, bool]:
    """(packed rows in plain ``[3, B, S]`` mRoPE positions, a text-position row that is not packed ids, a run of
    image or video tokens that a document start splits) for whole-row ``positions``; padding is ignored."""
    if ids is None or positions is None or positions.dim() not in (2, 3) or positions.shape[-1] != ids.shape[-1]:
        return False, False, False
    real = torch.ones_like(ids, dtype=torch.bool) if keep is None or keep.shape != ids.shape else keep
    inside = real[:, 1:] & real[:, :-1]  # neighbouring real tokens
    if positions.dim() == 3 and positions.shape[0] == 3:  # no text row: a token at (0, 0, 0) after the first starts one
        return bool(((positions[:, :, 1:] == 0).all(0) & inside).any()), False, False
    text = positions[0] if positions.dim() == 3 else positions
    if text.shape != ids.shape:
        return False, False, False
    starts = text[:, 1:] == 0
    broken = bool(((text < 0) & real).any() or (~((text[:, 1:] - text[:, :-1] == 1) | starts) & inside).any())
    split = marks is not None and bool((marks[:, 1:] & marks[:, :-1] & starts & inside).any())
    return False, broken, split


@dataclass(frozen=True)
class _RowSignature(Signature):
    """One whole-row call as the ranks compare it: its mistakes, its layout and a digest of its tensors."""

    positional_args: bool
    labels: bool
    use_cache: bool
    no_input_ids: bool
    sharded_positions: bool
    flat_mrope: bool
    packed_plain_mrope: bool
    broken_text_positions: bool
    image_across_documents: bool
    left_padding: bool
    reordering_layout: bool
    wrong_placement: bool
    placement_cuts_block: bool
    no_layout: bool
    bad_layout: bool
    layout_digest: int
    config_digest: int
    data_digest: int


_ROW_PROBLEMS = {
    "positional_args": "call a seqpar-prepared model with keywords: model(input_ids=..., pixel_values=..., ...)",
    "labels": "do not pass labels to a seqpar-prepared model: compute seqpar.cross_entropy(logits, "
    "shard['shift_labels'], mesh) with the shard of seqpar.shard_batch of the same rows",
    "use_cache": "seqpar-prepared models train without a KV cache; pass use_cache=False",
    "no_input_ids": "a multimodal call needs the whole rows' input_ids (the model finds its image placeholders "
    "in them); inputs_embeds are not taken",
    "sharded_positions": "a multimodal call takes whole rows (Note [whole-row calls]): position_ids must cover "
    "the whole row, as input_ids do, not this rank's shard",
    "flat_mrope": "this model numbers image tokens with mRoPE from the image grids: pass no position_ids (the "
    "model computes them from the whole row) or their [3, B, S] / [4, B, S] form, not [B, S] text positions",
    "packed_plain_mrope": "position_ids [3, B, S] restart at (0, 0, 0) inside a row: packed documents need "
    "transformers' [4, B, S] form, whose first row holds the text positions that mark where each document starts",
    "broken_text_positions": "the text positions of the row (position_ids [B, S], or the first row of [4, B, S]) "
    "must count up by 1 inside a document and restart at 0 where a document starts",
    "image_across_documents": "a run of image or video tokens crosses a document start (the text positions "
    "restart inside it): each image belongs to one document",
    "left_padding": "attention_mask has padding before real tokens; only right padding is supported",
    "no_layout": "a model prepared with a per-batch layout needs each batch's layout: pass "
    "seqpar_layout=shard.layout with the shard of seqpar.shard_batch of the same rows",
    "bad_layout": "seqpar_layout must be 'contiguous', 'zigzag' or the ChunkLayout of seqpar.shard_batch "
    "(shard.layout) for this many ranks",
    "reordering_layout": "the placed layout reorders the rows: pass seqpar_placement=shard.placement with "
    "seqpar_layout=shard.layout (the shard of seqpar.shard_batch(..., layout='placed') of the same rows)",
    "wrong_placement": "seqpar_placement is not the placement of these rows under this layout: pass "
    "shard.placement and shard.layout of seqpar.shard_batch of the same rows and text positions",
    "placement_cuts_block": "the placed layout cut an image block (token_type_ids) into pieces that are not "
    "next to each other in the placed row; use the 'balanced' layout for this batch",
}


def agree_on_whole_row(
    args: tuple,
    kwargs: dict,
    sp: SequenceParallelMesh,
    family: Family,
    layout: Layout,
    *,
    layout_digest: int,
    config_digest: int,
    no_layout: bool,
    bad_layout: bool,
    placeholders: tuple[int, ...] = (),
    placement: Placement | None = None,
) -> WholeRow:
    """Check one whole-row call on every rank at once (Note [agreeing on errors]): all raise, or none does.

    Args:
        args: the call's positional arguments (there must be none).
        kwargs: the call's keywords.
        sp: the sequence-parallel mesh.
        family: the model's family entry.
        layout: the layout the call's rows were sharded with by ``shard_batch``.
        layout_digest: the number the ranks compare to agree on that layout.
        config_digest: the number the ranks compare to agree on the model's config (``checks.config_digest``).
        no_layout: the model was prepared with a per-batch layout and the call brought none.
        bad_layout: the call's layout does not fit the mesh.
        placeholders: the model's image and video placeholder token ids (their runs must not cross documents).
        placement: the call's ``seqpar_placement`` (the placed layout's row order), or None.

    Returns:
        The ``WholeRow`` the text decoder's hook shards with.

    Raises:
        SeqparInputError: the same message on every rank, naming each rank's mistakes.
    """
    ids = kwargs.get("input_ids")
    positions = kwargs.get("position_ids")
    length = ids.shape[-1] if ids is not None else None
    mask = kwargs.get("attention_mask")
    keep = torch.as_tensor(mask).bool() if mask is not None and not isinstance(mask, dict) else None
    blocks = None
    if family.image_blocks and kwargs.get(family.image_blocks) is not None:
        runs = image_runs(kwargs[family.image_blocks])
        if any(runs):  # one set of ranges when every row holds its images at the same tokens
            blocks = runs[0] if all(r == runs[0] for r in runs) else tuple(runs)
    types = kwargs.get(family.image_blocks) if family.image_blocks else None
    types = kwargs.get("mm_token_type_ids") if types is None else types
    marks = torch.as_tensor(types) != 0 if types is not None else None
    if marks is None and ids is not None and placeholders:
        marks = torch.isin(ids, torch.tensor(placeholders, device=ids.device))
    plain_packed, broken, split = _document_faults(ids, positions, keep, marks)
    row = NAMED_LAYOUTS.get(layout.name) if isinstance(layout, ChunkLayout) else named_layout(layout)
    reorders = getattr(row, "reorders_row", False)
    wrong_placement = placement is not None and not (reorders and _fits(placement, layout, ids, positions))
    cut = False
    if blocks and placement is not None and not wrong_placement:
        blocks, cut = _placed_blocks(blocks, placement)
    signature = _RowSignature(
        positional_args=bool(args),
        labels=kwargs.get("labels") is not None,
        use_cache=bool(kwargs.get("use_cache")),
        no_input_ids=ids is None,
        sharded_positions=positions is not None and length is not None and positions.shape[-1] != length,
        flat_mrope=family.positions == "mrope" and positions is not None and positions.dim() == 2,
        packed_plain_mrope=plain_packed,
        broken_text_positions=broken,
        image_across_documents=split,
        left_padding=keep is not None and keep.dim() == 2 and bool((keep[:, 1:] & ~keep[:, :-1]).any()),
        reordering_layout=reorders and placement is None,
        wrong_placement=wrong_placement,
        placement_cuts_block=cut,
        no_layout=no_layout,
        bad_layout=bad_layout,
        layout_digest=layout_digest ^ (_digest([placement.order]) if placement is not None else 0),
        config_digest=config_digest,
        data_digest=_digest([kwargs.get(k) for k in _ROW_DATA]),
    )
    table = [signature] if sp.sp_size == 1 else exchange_signatures(signature, sp.sp_group)
    problems = by_rank([[m for name, m in _ROW_PROBLEMS.items() if getattr(row, name)] for row in table])
    if not problems and any(row.data_digest != table[0].data_digest for row in table):
        differ = [r for r, row in enumerate(table) if row.data_digest != table[0].data_digest]
        problems.append(
            f"ranks {differ} of the sequence-parallel group passed other rows than rank 0 (input_ids, pixels, grids, "
            "token types, positions): a multimodal model takes the same whole rows on every rank of the group "
            "(Note [whole-row calls])"
        )
    differing = config_disagreement([row.config_digest for row in table])
    if not problems and differing:
        problems.append(differing)
    if not problems and any(row.layout_digest != table[0].layout_digest for row in table):
        problems.append("the ranks passed different seqpar_layout values; pass every rank its shard's layout")
    if problems:
        raise SeqparInputError(" | ".join(problems))
    return WholeRow(layout, blocks, placement)


def _fits(placement: object, layout: Layout, ids: torch.Tensor | None, positions: torch.Tensor | None) -> bool:
    """Whether ``placement`` is the placed order of these rows (their text positions) under ``layout``."""
    if not isinstance(placement, Placement) or placement.layout != layout or ids is None:
        return False
    order = placement.order
    if order.dim() != 2 or order.shape[0] != ids.shape[0] or int(order.max()) >= ids.shape[1]:
        return False
    text = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape) if positions is None else positions
    text = text[0] if text.dim() == 3 and text.shape[0] == 4 else text
    if text.dim() != 2:  # [3, B, S]: one document a row, numbered from 0
        text = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape)
    real = order >= 0
    placed = placement.place(text.to(order.device), 0)
    return bool((placed[real] == placement.position_ids.to(order.device)[real]).all())


def _placed_blocks(blocks: tuple, placement: Placement) -> tuple[tuple, bool]:
    """The image blocks (one set of ranges, or one per row) as ranges of the placed row (per row where they
    differ), and whether the placement cut one apart."""
    given_per_row = any(not row or isinstance(row[0], tuple) for row in blocks)  # a range is a pair of ints
    row_blocks = blocks if given_per_row else (blocks,) * len(placement.order)
    per_row = []
    for order, ranges in zip(placement.order, row_blocks, strict=True):
        moved = []
        for start, stop in ranges:
            where = ((order >= start) & (order < stop)).nonzero().flatten()
            steps = order[where]
            whole = where.numel() == stop - start and bool((torch.diff(where) == 1).all())
            if not whole or bool((torch.diff(steps) != 1).any()):
                return blocks, True
            moved.append((int(where[0]), int(where[0]) + stop - start))
        per_row.append(tuple(sorted(moved)))  # the placed row may hold documents in another order
    return (per_row[0] if all(row == per_row[0] for row in per_row) else tuple(per_row)), False


def padded_row_length(length: int, sp_size: int, layout: Layout) -> int:
    """The row length ``shard_batch`` pads a row of ``length`` tokens to under ``layout``.

    Raises:
        SeqparInputError: a ``ChunkLayout`` whose chunks do not divide that length.
    """
    if isinstance(layout, ChunkLayout):
        row = NAMED_LAYOUTS.get(layout.name)
        per_rank = row.pad_chunks if row is not None and row.per_batch else layout.chunks_per_rank
    else:
        row = named_layout(layout)
        per_rank = row.pad_chunks if row.per_batch else row.chunks_per_rank
    padded = length + (-length % (sp_size * per_rank))
    if isinstance(layout, ChunkLayout) and padded % (sp_size * layout.chunks_per_rank):
        raise SeqparInputError(f"a row of {length} tokens does not divide into the {layout}")
    return padded


PER_TOKEN_ROW_KEYS = ("per_layer_inputs", "ple_input_ids")
"""Text decoder keywords that hold one entry per token of the whole row (Gemma 4's per-layer inputs ``[B, S, L,
D]``, Qwen4-Exp's token ids ``[B, S]`` for its n-gram embeddings, Note [n-gram halo]): cut like the embeddings."""


def _shard(
    x: torch.Tensor, dim: int, pad: int, fill: torch.Tensor | float, sp: SequenceParallelMesh, layout: Layout
) -> torch.Tensor:
    """This rank's shard of a whole-row tensor, padded at the end of ``dim`` by ``pad`` entries of ``fill``."""
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        filler = fill.to(x.device, x.dtype).expand(shape) if isinstance(fill, torch.Tensor) else x.new_full(shape, fill)
        x = torch.cat([x, filler], dim=dim)
    return shard_for_rank(x, sp.sp_rank, sp.sp_size, dim, layout)


def shard_decoder_inputs(kwargs: dict, row: WholeRow, sp: SequenceParallelMesh) -> tuple[dict, torch.Tensor]:
    """This rank's share of the text decoder's whole-row inputs (Note [whole-row calls]).

    Args:
        kwargs: the decoder call's keywords: whole ``inputs_embeds`` ``[B, S, H]``, ``position_ids`` (None,
            ``[B, S]``, ``[3, B, S]`` or ``[4, B, S]``), optional DeepStack ``visual_pos_masks`` and
            ``deepstack_visual_embeds``.
        row: the checked call.
        sp: the sequence-parallel mesh.

    Returns:
        The keywords with this rank's embeddings, positions and DeepStack features (``attention_mask``
        dropped), and this rank's shard of the text positions ``[B, S'/P]`` the mask is built from.

    Raises:
        SeqparInputError: no ``inputs_embeds`` (the model did not merge its row), positions of another shape.
    """
    embeds = kwargs.get("inputs_embeds")
    if not isinstance(embeds, torch.Tensor) or embeds.dim() != 3:
        raise SeqparInputError(
            "the text decoder of a multimodal model was not given the merged row (inputs_embeds [B, S, H]); "
            "its family entry may name the wrong text_model"
        )
    b, s, _ = embeds.shape
    if row.placement is not None:
        return _placed_decoder_inputs(kwargs, row, sp)
    padded = padded_row_length(s, sp.sp_size, row.layout)
    pad = padded - s
    positions = kwargs.get("position_ids")
    filler = torch.arange(pad, device=embeds.device)  # padding is a document of its own (Note [labels before sharding])
    whole_text = torch.arange(s, device=embeds.device).expand(b, s) if positions is None else None
    if positions is not None:
        if positions.shape[-1] != s or positions.dim() not in (2, 3):
            raise SeqparInputError(f"position_ids {tuple(positions.shape)} do not cover the row of {s} tokens")
        whole_text = positions if positions.dim() == 2 else positions[0] if positions.shape[0] == 4 else None
        if whole_text is None:  # [3, B, S] mRoPE: one document per row
            whole_text = torch.arange(s, device=embeds.device).expand(b, s)
        kwargs["position_ids"] = _shard(positions, positions.dim() - 1, pad, filler, sp, row.layout)
    text = _shard(whole_text, 1, pad, filler, sp, row.layout)
    if positions is None:
        kwargs["position_ids"] = text
    kwargs["inputs_embeds"] = _shard(embeds, 1, pad, 0.0, sp, row.layout)
    for key in PER_TOKEN_ROW_KEYS:
        if isinstance(kwargs.get(key), torch.Tensor):
            kwargs[key] = _shard(kwargs[key], 1, pad, 0.0, sp, row.layout)
    visual = kwargs.get("visual_pos_masks")
    if visual is not None:  # Qwen3-VL's DeepStack: features added at the visual tokens of chosen layers
        order = (visual.flatten().long().cumsum(0) - 1).view(visual.shape)  # each visual token's feature row
        local = _shard(visual, 1, pad, False, sp, row.layout)
        rows = _shard(order, 1, pad, -1, sp, row.layout)[local]
        kwargs["visual_pos_masks"] = local
        kwargs["deepstack_visual_embeds"] = [e[rows] for e in kwargs.get("deepstack_visual_embeds") or ()]
    kwargs.pop("attention_mask", None)
    kwargs["use_cache"] = False
    return kwargs, text


def _placed_decoder_inputs(kwargs: dict, row: WholeRow, sp: SequenceParallelMesh) -> tuple[dict, torch.Tensor]:
    """``shard_decoder_inputs`` under the placed layout: the row laid out in the placed order, then cut.

    Padding takes the placed row's own position ids (each padding run its own document, Note [placed layout]),
    in every mRoPE component; the text positions the mask is built from are the placement's.
    """
    placement, layout = row.placement, row.layout
    embeds = kwargs["inputs_embeds"]
    s = embeds.shape[1]
    pad = (placement.order < 0).to(embeds.device)
    filler = placement.position_ids.to(embeds.device)

    def cut(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return shard_for_rank(x, sp.sp_rank, sp.sp_size, dim, layout)

    positions = kwargs.get("position_ids")
    if positions is not None:
        if positions.shape[-1] != s or positions.dim() not in (2, 3):
            raise SeqparInputError(f"position_ids {tuple(positions.shape)} do not cover the row of {s} tokens")
        if positions.dim() == 3:  # each mRoPE component placed along the row
            placed = placement.place(positions.movedim(0, -1), 0).movedim(-1, 0)
            kwargs["position_ids"] = cut(torch.where(pad, filler, placed), 2)
        else:
            kwargs["position_ids"] = cut(filler)
    text = cut(filler)
    if positions is None:
        kwargs["position_ids"] = text
    kwargs["inputs_embeds"] = cut(placement.place(embeds, 0.0))
    for key in PER_TOKEN_ROW_KEYS:
        if isinstance(kwargs.get(key), torch.Tensor):
            kwargs[key] = cut(placement.place(kwargs[key], 0.0))
    visual = kwargs.get("visual_pos_masks")
    if visual is not None:  # Qwen3-VL's DeepStack, as in shard_decoder_inputs
        order = (visual.flatten().long().cumsum(0) - 1).view(visual.shape)
        local = cut(placement.place(visual, False))
        rows = cut(placement.place(order, -1))[local]
        kwargs["visual_pos_masks"] = local
        kwargs["deepstack_visual_embeds"] = [e[rows] for e in kwargs.get("deepstack_visual_embeds") or ()]
    kwargs.pop("attention_mask", None)
    kwargs["use_cache"] = False
    return kwargs, text
