"""Collator output -> this rank's shard, for every micro-batch of an optimizer step, checked on all ranks at once.

Used by the Trainer mixin, ``seqpar.hf.Accelerator`` and hand-written loops (``shard_step``, ``model_inputs``).

Note [one exchange per step]
    Before the model runs, every rank turns its micro-batches into shards (``seqpar.shard_batch``: labels
    shifted before sharding, rows padded to the layout) and checks them. The ranks then all-gather one short
    row each: an error flag, the valid-token count of their shards, and a fingerprint of the rows they
    loaded. From that table every rank knows (1) whether any rank was given bad input, and raises the same
    ``SeqparInputError`` if so (the messages travel only then), before any collective that could hang;
    (2) the number of valid tokens of the whole step over every data-parallel replica and micro-batch, the
    normaliser of the exact loss (Note [global token normalisation]); (3) whether the ranks of each
    sequence-parallel group loaded the same rows, which they must (the dataloader shards by replica). Asked
    (``per_micro_batch=True``), the rows also carry each micro-batch's count, so that every rank knows each
    micro-batch's valid tokens over every rank too (Note [micro-batch means]).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from seqpar.data import IGNORE_INDEX, shard_batch
from seqpar.errors import SeqparInputError
from seqpar.mesh import SequenceParallelMesh
from seqpar.sequence_parallel.call_checks import LAYOUT_KEYWORD, PACKING_KEYS, WIDTH_KEYWORD
from seqpar.sequence_parallel.comm.collectives import collective_device
from seqpar.sequence_parallel.layouts.chunks import ChunkLayout, Layout
from seqpar.sequence_parallel.whole_rows import PLACEMENT_KEYWORD, SHARD_REFUSED

SEQUENCE_KEYS = ("input_ids", "labels", "shift_labels", "position_ids", "attention_mask")
DROPPED_KEYS = ("use_cache", "return_loss", "num_items_in_batch")
MULTIMODAL_KEYS = SHARD_REFUSED
"""A multimodal collator's keys (pixels, grids, token types): the model takes such a batch's whole rows."""
ROWS = "seqpar_rows"
"""Key of a ``SequenceShard``: a multimodal batch's whole rows, which its model call takes (Note [whole-row calls])."""


class SequenceShard(dict):
    """This rank's shard of one micro-batch: ``input_ids``, ``position_ids``, ``shift_labels`` ``[B, S'/P]``.

    A dict subclass so that the Trainer's device move (which rebuilds mappings with their own type) keeps
    it recognisable as already sharded. Under ``layout="balanced"`` it also holds the batch's own
    ``ChunkLayout`` under ``"seqpar_layout"`` (``LAYOUT_KEYWORD``): an entry, not an attribute, because that
    rebuild keeps entries only (non-tensor ones unchanged). A multimodal batch's shard also holds the batch's
    whole rows under ``"seqpar_rows"`` (``ROWS``): the model merges its images on whole rows and shards its
    text decoder's input itself (Note [whole-row calls]). Call the model with ``model_inputs(shard)``.
    """


def model_inputs(shard: Mapping[str, object]) -> dict[str, object]:
    """The keyword arguments of the prepared model's call for one shard.

    Args:
        shard: a ``SequenceShard`` (from ``shard_step`` / ``to_shard``, moved to the device or not).

    Returns:
        ``{"input_ids", "position_ids"}`` (a multimodal batch: its whole rows, pixels and grids), and
        ``seqpar_layout`` when the shard carries its batch's own layout (``layout="balanced"``), ``seqpar_width``
        when the shard carries its batch's width (the Trainer's shards), and for a multimodal batch under the placed
        layout ``seqpar_placement``: ``model(**model_inputs(shard))``.
    """
    rows = shard.get(ROWS)
    if rows is not None:
        inputs = dict(rows)
    else:
        inputs = {"input_ids": shard["input_ids"], "position_ids": shard["position_ids"]}
    for key in (LAYOUT_KEYWORD, PLACEMENT_KEYWORD, WIDTH_KEYWORD):
        if shard.get(key) is not None:
            inputs[key] = shard[key]
    return inputs


@dataclass
class StepShards:
    """The shards of one optimizer step and the normaliser of its exact loss.

    Attributes:
        shards: one ``SequenceShard`` per micro-batch, in order.
        num_valid_tokens: valid (shifted, not ignored) tokens of the whole step over every rank.
        micro_batch_tokens: the valid tokens of each micro-batch over every rank (``shard_step(...,
            per_micro_batch=True)``), else None.
    """

    shards: list[SequenceShard]
    num_valid_tokens: int
    micro_batch_tokens: list[int] | None = None


def padding_batch(mesh: SequenceParallelMesh, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """A one-row batch of two chunks per rank, all padding: a forward and backward with no effect.

    A replica with no rows left in a micro-batch (Note [epoch ends]) or an evaluation batch fewer than the
    others runs it, so that every rank makes the same collectives.

    Args:
        mesh: the sequence-parallel mesh.
        device: where the tensors live.

    Returns:
        ``{"input_ids", "labels", "attention_mask"}`` of shape ``[1, 2 x sp_size]``: no label and no token
        counts (nor does it count in a router loss).
    """
    n = 2 * mesh.sp_size
    ids = torch.zeros(1, n, dtype=torch.long, device=device)
    return {"input_ids": ids, "labels": torch.full_like(ids, IGNORE_INDEX), "attention_mask": torch.zeros_like(ids)}


def _problem(batch: Mapping[str, object], sp_size: int, seq_length: int | None = None) -> str | None:
    """What is wrong with one collator output, or None (``seq_length``: the width every batch must have)."""
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        return "each batch must be a mapping with 'input_ids' (inputs_embeds and other inputs are not supported)"
    ids = batch["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return f"input_ids must be a [batch, seq] tensor, got {getattr(ids, 'shape', type(ids))}"
    known = (*SEQUENCE_KEYS, *PACKING_KEYS, *DROPPED_KEYS, *MULTIMODAL_KEYS)
    unknown = sorted(str(k) for k in batch if k not in known)
    if unknown:
        return (
            f"batch keys {unknown} are not understood by seqpar.hf: sequence parallelism shards input_ids, labels, "
            "position_ids and attention_mask, and takes a multimodal batch's pixels, grids and token types whole "
            f"({', '.join(MULTIMODAL_KEYS)})"
        )
    multimodal = any(batch.get(k) is not None for k in MULTIMODAL_KEYS)
    positions = batch.get("position_ids")
    if multimodal and isinstance(positions, torch.Tensor) and positions.dim() == 3 and positions.shape[0] != 4:
        return (
            f"position_ids {tuple(positions.shape)} of a multimodal batch: pass none (the model computes them from "
            "the whole rows), [B, S] text positions or transformers' [4, B, S] mRoPE form, whose first row marks "
            "packed documents; the [3, B, S] form does not say where documents start"
        )
    packed = [k for k in PACKING_KEYS if batch.get(k) is not None]
    if packed and batch.get("position_ids") is None:
        return (
            f"the batch packs several documents per row ({packed}) but has no position_ids: seqpar finds document "
            "boundaries from position ids restarting at 0 (DataCollatorWithFlattening(return_position_ids=True))"
        )
    mask = batch.get("attention_mask")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
        return f"attention_mask must be a [batch, seq] padding mask, got {getattr(mask, 'shape', type(mask))}"
    if seq_length is not None and ids.shape[1] != seq_length:
        return (
            f"a batch {ids.shape[1]} tokens wide, but the width is fixed at {seq_length} (sp_seq_length with "
            "sp_seq_length_is_variable=False): pad every batch to it (padding='max_length' / pad_to_multiple_of) or "
            "set sp_seq_length_is_variable=True"
        )
    if ids.shape[1] < sp_size:
        return (
            f"a sequence of {ids.shape[1]} tokens cannot be split over sp_size={sp_size} ranks (some would hold "
            "no token of it); use longer sequences or a smaller sp_size"
        )
    return None


def to_shard(
    batch: Mapping[str, object],
    mesh: SequenceParallelMesh,
    *,
    layout: Layout = "zigzag",
    seq_length: int | None = None,
) -> SequenceShard:
    """This rank's shard of one collator output (no communication).

    Args:
        batch: a Hugging Face collator's output for the *whole* rows of this data-parallel replica:
            ``input_ids``, optional unshifted ``labels`` (or ``shift_labels``), ``position_ids`` (restarting at 0
            at every packed document), ``attention_mask`` (right padding only). Varlen keys
            (``cu_seq_lens_q`` ...) are dropped: the documents are read from ``position_ids``. A multimodal
            collator's pixels, grids and token types (``pixel_values``, ``image_grid_thw``, ``token_type_ids``
            ...) are kept with the whole rows for the model call (``model_inputs``), which merges the images
            and shards its text decoder's input as the labels are sharded here (Note [whole-row calls]).
        mesh: the sequence-parallel mesh.
        layout: the layout the prepared model was told: "zigzag", "contiguous", "balanced" (solved for this
            batch, Note [balanced layout]) or a ``ChunkLayout``.
        seq_length: the width every batch must have, or None for any (a padding batch is exempt).

    Returns:
        A ``SequenceShard``; rows that do not divide into the layout are padded, and the padding is ignored.
        A batch of zero rows (a replica with no rows left at an epoch's end, Note [epoch ends]) becomes the
        shard of ``padding_batch``: no valid token. A ``ChunkLayout`` (the one solved under "balanced") is
        kept in the shard under ``"seqpar_layout"`` for the model call (``model_inputs``).

    Raises:
        SeqparInputError: unknown keys, packed rows without position ids, left padding, a sequence shorter
            than ``sp_size``, labels that look shifted already, a width other than ``seq_length``, ``[3, B, S]``
            positions of a multimodal batch.
    """
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[0] == 0:
        batch, seq_length = padding_batch(mesh, ids.device), None
    problem = _problem(batch, mesh.sp_size, seq_length)
    if problem is not None:
        raise SeqparInputError(problem)
    wanted = {k: batch[k] for k in SEQUENCE_KEYS if batch.get(k) is not None}
    rows = _whole_rows(batch)
    if rows is not None and wanted.get("position_ids") is not None and wanted["position_ids"].dim() == 3:
        wanted["position_ids"] = wanted["position_ids"][0]  # mRoPE's text row: where packed documents start
    sharded = shard_batch(wanted, mesh, layout=layout)
    shard = SequenceShard(sharded)
    if rows is not None:
        shard[ROWS] = rows
        if sharded.placement is not None:  # the whole rows are placed at the text decoder (Note [whole-row calls])
            shard[PLACEMENT_KEYWORD] = sharded.placement
    if isinstance(sharded.layout, ChunkLayout):  # per batch: the model must be told it with this shard
        shard[LAYOUT_KEYWORD] = sharded.layout
    return shard


def _whole_rows(batch: Mapping[str, object]) -> dict[str, object] | None:
    """A multimodal batch's model call on whole rows (Note [whole-row calls]), or None for a text batch."""
    if not any(batch.get(k) is not None for k in MULTIMODAL_KEYS):
        return None
    keys = ("input_ids", "attention_mask", "position_ids", *MULTIMODAL_KEYS)
    return {k: batch[k] for k in keys if batch.get(k) is not None}


def _fingerprint(batch: Mapping[str, object]) -> int:
    """A number that differs, almost surely, between two different batches (same on every rank for one)."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if not isinstance(ids, torch.Tensor):
        return 0
    flat = ids.detach().reshape(-1).long().cpu()
    weights = torch.arange(flat.numel()) % 65521 + 1
    return int((flat % 1048573 * weights).sum()) + 1000003 * flat.numel()


def _gather_rows(row: list[int], group: dist.ProcessGroup | None) -> list[list[int]]:
    if group is None:
        return [row]
    mine = torch.tensor(row, dtype=torch.int64, device=collective_device(group))
    table = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(table, mine, group=group)
    return [t.tolist() for t in table]


def _raise_agreed(message: str | None, group: dist.ProcessGroup | None) -> None:
    """Raise on every rank with the messages of the ranks that failed (called only when some rank failed)."""
    messages = [message]
    if group is not None:
        messages = [None] * dist.get_world_size(group)
        dist.all_gather_object(messages, message, group=group)
    by_message: dict[str, list[int]] = {}
    for r, m in enumerate(messages):
        if m is not None:
            by_message.setdefault(m, []).append(r)
    failed = [f"rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}: {m}" for m, r in by_message.items()]
    raise SeqparInputError("bad batch for sequence parallelism | " + " | ".join(failed))


def shard_step(
    batches: Sequence[Mapping[str, object]],
    mesh: SequenceParallelMesh,
    *,
    group: dist.ProcessGroup | None = None,
    layout: Layout = "zigzag",
    seq_length: int | None = None,
    per_micro_batch: bool = False,
) -> StepShards:
    """Shard the micro-batches of one optimizer step and count its valid tokens over every rank (collective).

    Note [one exchange per step]: one all-gather of a few integers over ``group``.

    Args:
        batches: this data-parallel replica's micro-batches (collator outputs), the same on every rank of
            its sequence-parallel group.
        mesh: the sequence-parallel mesh.
        group: every rank that trains together (dp x sp; the default group under torchrun), or None for a
            single process.
        layout: the layout the prepared model was told ("balanced": each shard carries its own, see
            ``to_shard``).
        seq_length: the width every batch must have, or None for any.
        per_micro_batch: also count each micro-batch's valid tokens over every rank (``micro_batch_tokens``), in
            the same exchange; every rank must then pass as many micro-batches (the Trainer's replicas do: Note
            [epoch ends]).

    Returns:
        The shards and ``num_valid_tokens`` for ``seqpar.cross_entropy`` (and ``micro_batch_tokens``).

    Raises:
        SeqparInputError: on every rank, when any rank's batch is bad (naming the rank and the problem) or
            the ranks of a sequence-parallel group loaded different rows.
    """
    shards, message = [], None
    try:
        shards = [to_shard(b, mesh, layout=layout, seq_length=seq_length) for b in batches]
    except SeqparInputError as error:
        message = str(error)
    counts = [int((s["shift_labels"] != IGNORE_INDEX).sum()) for s in shards]
    fingerprint = sum(_fingerprint(b) for b in batches) % (1 << 62)
    # a rank whose batch was refused has no shard: its counts are zeros, so that every row has the same width
    own = counts + [0] * (len(batches) - len(counts)) if per_micro_batch else []
    table = _gather_rows([int(message is not None), sum(counts), fingerprint, len(batches), *own], group)
    if any(row[0] for row in table):
        _raise_agreed(message, group)
    if group is not None and mesh.sp_group is not None:
        peers = dist.get_process_group_ranks(mesh.sp_group)
        seen = {tuple(table[dist.get_group_rank(group, r)][2:4]) for r in peers}  # rows loaded, micro-batches
        if len(seen) > 1:
            raise SeqparInputError(
                f"the ranks {peers} of one sequence-parallel group loaded different batches; every rank of a group "
                "must get the same rows (shard the dataset by data-parallel replica, e.g. with replica_sampler)"
            )
    totals = [sum(row[4 + k] for row in table) for k in range(len(own))] if per_micro_batch else None
    return StepShards(shards, sum(row[1] for row in table), totals)


def replica_of(mesh: SequenceParallelMesh) -> tuple[int, int]:
    """How many data-parallel replicas there are and which one this rank belongs to.

    Args:
        mesh: a mesh from ``seqpar.make_mesh`` (its "dp" axis), or any other mesh (one replica).

    Returns:
        ``(dp_size, dp_rank)``.
    """
    dm = mesh.device_mesh
    if dm is None or "dp" not in (dm.mesh_dim_names or ()):
        return 1, 0
    return dm.size(dm.mesh_dim_names.index("dp")), dm.get_local_rank("dp")
