"""Turning a global batch into this rank's shard: tokens, global position ids and labels shifted before sharding.

Also packs documents into fixed-length rows whose position ids restart at every document start.

Note [labels before sharding]
    A causal language model predicts token i+1 from tokens 0..i. If labels were shifted after sharding, the
    last token of each shard would have nothing to predict and the first token of the next shard would
    never be predicted. ``shard_batch`` therefore shifts the whole row first, marks the last token of every
    document (and of the row) as ignored so that no document predicts its neighbour's first token, and only
    then shards tokens, labels and position ids with one layout. Rows that do not divide into the layout
    are padded with one extra "document" of padding tokens whose labels are ignored; causal attention never
    lets a real token see it, and its position ids restart at 0 so that they stay inside the model's range.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from seqpar.errors import SeqparInputError
from seqpar.mesh import as_sp_mesh
from seqpar.sequence_parallel.layouts.chunks import ChunkLayout, Layout, layout_row, named_layout, shard_for_rank
from seqpar.sequence_parallel.layouts.placed import Placement
from seqpar.sequence_parallel.masks.sequence_mask import check_packed_positions

IGNORE_INDEX = -100


class BatchShard(dict):
    """This rank's shard of a batch: a dict of tensors, and ``layout``, the layout it was sharded with.

    With ``shard_batch(layout="balanced")`` (or "placed", "auto") the layout is this batch's own ``ChunkLayout``:
    give it to every call that takes a layout for this batch (``seqpar.attention``, ``gather_sequence``, the model
    prepared with ``layout="balanced"`` as ``model(..., seqpar_layout=shard.layout)``).
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        layout: Layout,
        placement: Placement | None = None,
        width: int | None = None,
    ) -> None:
        super().__init__(tensors)
        self.layout = layout
        self.placement = placement
        """Under ``layout="placed"``: the placed row's order (``placement.restore`` puts a gathered row back)."""
        self.width = width
        """The rows' global width before the layout's padding where ``shard_batch`` padded them, else None: a
        sparse-attention indexer ranks that many keys, as one process does (``model(..., seqpar_width=shard.width)``,
        Note [indexed attention])."""


def _as_2d(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(t)
    if t.dim() == 1:
        t = t[None]
    if t.dim() != 2 or t.is_floating_point():
        raise SeqparInputError(f"{name} must be an integer tensor [batch, seq], got {t.dtype} {tuple(t.shape)}")
    return t.long()


def shard_batch(
    batch: Mapping[str, object],
    mesh: object = None,
    *,
    layout: Layout = "zigzag",
    pad_token_id: int = 0,
    ignore_index: int = IGNORE_INDEX,
) -> BatchShard:
    """This rank's shard of a global batch (Note [labels before sharding]); no communication.

    Args:
        batch: the *global* batch, identical on every rank of the SP group: ``input_ids`` ``[B, S]``;
            optional ``labels`` ``[B, S]`` aligned with ``input_ids`` as Hugging Face models take them
            (unshifted; default: ``input_ids``), or ``shift_labels`` already shifted (then used as they are);
            optional ``position_ids`` ``[B, S]`` restarting at 0 at each packed document (default: 0..S-1);
            optional ``attention_mask`` ``[B, S]`` with right padding only (0 = padding, ignored by the loss).
        mesh: the sequence-parallel mesh, group, or None.
        layout: "zigzag", "contiguous", "balanced" (this batch's own layout: every rank equal attention work on
            its packed documents, Note [balanced layout]), "placed" (whole short documents on one rank, long
            ones over few ranks, the row reordered and padded: Note [placed layout]), "auto" ("placed" when the
            rows are packed documents, else "balanced", chosen from the global position ids: Note [placed
            layout]) or a ``ChunkLayout``; the layout every attention call of this batch will be told.
        pad_token_id: token used when a row is padded up to a multiple of the layout.
        ignore_index: label value the loss ignores.

    Returns:
        A ``BatchShard``: ``{"input_ids", "position_ids", "shift_labels", "token_mask"}``, each ``[B, S'/P]``
        (``S'`` = ``S`` padded up to a multiple of the layout, 2P for "balanced"; ``token_mask`` is 1 on the
        batch's tokens, 0 on its padding and the layout's), and ``.layout``, the layout used (a ``ChunkLayout``
        for "balanced", "placed" and "auto", whose ``name`` says which it is; under "placed", and "auto" resolved
        to it, the tensors are those of the placed row, whose order is ``.placement``). Call the model as
        ``model(input_ids=..., position_ids=...)`` and the loss as ``seqpar.cross_entropy(logits,
        shard["shift_labels"], mesh)`` (plus ``seqpar.router_aux_loss`` for a mixture-of-experts model's router
        loss).

    Raises:
        SeqparInputError: missing ``input_ids``, shapes that differ, labels that look shifted already
            (``labels[:, :-1] == input_ids[:, 1:]``), left padding, position ids that are not packed ids.
    """
    if "input_ids" not in batch:
        raise SeqparInputError("shard_batch needs 'input_ids' in the batch")
    sp = as_sp_mesh(mesh)
    ids = _as_2d("input_ids", batch["input_ids"])
    b, s = ids.shape
    shape_of = {}
    for key in ("labels", "shift_labels", "position_ids", "attention_mask"):
        if batch.get(key) is not None:
            shape_of[key] = _as_2d(key, batch[key]).to(ids.device)
            if shape_of[key].shape != ids.shape:
                raise SeqparInputError(f"{key} {tuple(shape_of[key].shape)} must match input_ids {tuple(ids.shape)}")
    if "labels" in shape_of and "shift_labels" in shape_of:
        raise SeqparInputError("give either labels (unshifted) or shift_labels (shifted), not both")

    positions = shape_of.get("position_ids")
    if positions is None:
        positions = torch.arange(s, device=ids.device).expand(b, s)
    else:
        check_packed_positions(positions)
    doc_end = torch.ones_like(ids, dtype=torch.bool)  # last token of a document: nothing of its own to predict
    doc_end[:, :-1] = positions[:, 1:] == 0

    if "shift_labels" in shape_of:
        shifted = shape_of["shift_labels"].clone()
    else:
        labels = shape_of.get("labels", ids)
        valid = labels != ignore_index
        if "labels" in shape_of and s > 1 and not torch.equal(labels, ids):
            looks_shifted = (labels[:, :-1] == ids[:, 1:]) | ~valid[:, :-1]
            if bool(looks_shifted.all()) and bool(valid[:, :-1].any()):
                raise SeqparInputError(
                    "labels look shifted already (labels[:, i] == input_ids[:, i + 1]); shard_batch shifts them "
                    "(labels shifted twice would train on the token after next): pass unshifted labels, or "
                    "pass them as shift_labels"
                )
        shifted = torch.full_like(labels, ignore_index)
        shifted[:, :-1] = labels[:, 1:]
        shifted[doc_end] = ignore_index

    keep = torch.ones_like(ids, dtype=torch.bool)  # the batch's own tokens (a router loss counts them)
    if "attention_mask" in shape_of:
        keep = shape_of["attention_mask"] != 0
        if (keep[:, 1:] & ~keep[:, :-1]).any():
            raise SeqparInputError("attention_mask has padding before real tokens; only right padding is supported")
        shifted[~keep] = ignore_index
        # the last real token has no real successor to predict
        shifted[:, :-1][keep[:, :-1] & ~keep[:, 1:]] = ignore_index

    row = layout_row(layout)
    if row.chooses:  # "auto": from the batch's own ids, before any padding
        row = named_layout(row.solver(positions))
    if row.reorders_row:  # Note [placed layout]: the row is reordered (and padded), then sharded
        return _placed_shard(row.solver(positions, sp.sp_size), ids, shifted, keep, sp, pad_token_id, ignore_index)
    multiple = row.pad_multiple(sp.sp_size)
    if isinstance(layout, ChunkLayout) and layout.world_size != sp.sp_size:
        raise SeqparInputError(f"the {layout} does not fit the {sp.sp_size} sequence-parallel ranks")
    pad = -s % multiple
    if pad:
        ids = torch.cat([ids, ids.new_full((b, pad), pad_token_id)], dim=1)
        shifted = torch.cat([shifted, shifted.new_full((b, pad), ignore_index)], dim=1)
        positions = torch.cat([positions, torch.arange(pad, device=ids.device).expand(b, pad)], dim=1)
        keep = torch.cat([keep, keep.new_zeros((b, pad))], dim=1)
    if row.per_batch:  # a per-batch layout that keeps the row's order: its solver cuts the padded row
        layout = row.solver(positions, sp.sp_size)
    tensors = {"input_ids": ids, "position_ids": positions, "shift_labels": shifted, "token_mask": keep.long()}
    shards = {k: shard_for_rank(t, sp.sp_rank, sp.sp_size, 1, layout) for k, t in tensors.items()}
    return BatchShard(shards, layout, width=s if pad and s else None)  # a row of padding alone has no width


def _placed_shard(placement: Placement, ids, shifted, keep, sp, pad_token_id: int, ignore_index: int) -> BatchShard:
    """``shard_batch`` under a layout that reorders the row: lay every tensor out in the placement's order, shard it."""
    tensors = {
        "input_ids": placement.place(ids, pad_token_id),
        "position_ids": placement.position_ids.to(ids.device),
        "shift_labels": placement.place(shifted, ignore_index),
        "token_mask": placement.place(keep.long(), 0),
    }
    layout = placement.layout
    shards = {k: shard_for_rank(t, sp.sp_rank, sp.sp_size, 1, layout) for k, t in tensors.items()}
    return BatchShard(shards, layout, placement)


def pack_documents(
    documents: Iterable[Sequence[int]], seq_len: int, *, pad_token_id: int = 0, drop_last: bool = False
) -> list[dict[str, torch.Tensor]]:
    """Pack token lists into rows of ``seq_len`` tokens; a document longer than a row is split across rows.

    Args:
        documents: token id lists, in order.
        seq_len: tokens per row.
        pad_token_id: fills the last row (its labels are ignored through ``attention_mask``).
        drop_last: drop a final row that would need padding.

    Returns:
        Rows ``{"input_ids": [seq_len], "position_ids": [seq_len], "attention_mask": [seq_len]}``; position
        ids restart at 0 where a document (or the remainder of a split one) starts.

    Raises:
        SeqparInputError: ``seq_len`` below 2.
    """
    if seq_len < 2:
        raise SeqparInputError(f"seq_len must be at least 2, got {seq_len}")
    rows: list[dict[str, torch.Tensor]] = []
    ids: list[int] = []
    pos: list[int] = []

    def flush(fill: bool) -> None:
        n = len(ids)
        rows.append(
            {
                "input_ids": torch.tensor(ids + [pad_token_id] * (seq_len - n)),
                "position_ids": torch.tensor(pos + list(range(seq_len - n))),
                "attention_mask": torch.tensor([1] * n + [0] * (seq_len - n)),
            }
        )
        ids.clear()
        pos.clear()

    for doc in documents:
        doc = list(doc)
        while doc:
            take = doc[: seq_len - len(ids)]
            doc = doc[len(take) :]
            ids.extend(take)
            pos.extend(range(len(take)))
            if len(ids) == seq_len:
                flush(False)
    if ids and not drop_last:
        flush(True)
    return rows
