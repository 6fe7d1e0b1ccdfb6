"""The input checks of pipeline parallel, agreed by every rank before any pipeline communication can hang.

``agree_on_setup`` checks ``apply_pipeline_parallel``'s arguments and model; ``agree_on_step`` one ``step``'s shard.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from seqpar.errors import SeqparInputError
from seqpar.sequence_parallel.checks import Signature, by_rank, exchange_signatures

SCHEDULES = ("gpipe", "1f1b", "interleaved")
"""Pipeline schedules: torch's ScheduleGPipe, Schedule1F1B and ScheduleInterleaved1F1B."""

SHARD_KEYS = ("input_ids", "position_ids", "shift_labels")
"""What every rank passes to a pipeline step (``seqpar.shard_batch`` makes them)."""


@dataclass(frozen=True)
class SetupSignature(Signature):
    """``apply_pipeline_parallel``'s arguments and model as one rank sees them (Note [agreeing on errors])."""

    schedule: int  # index in SCHEDULES, -1 when unknown
    microbatches: int
    stages_per_rank: int
    layers: int  # -1 when the layers cannot be found
    prepared: bool  # attention is seqpar's
    chunk_size: int  # loss_chunk_size, 0 when not given
    chunked: bool  # loss_chunk_size given
    custom_loss: bool
    softcap: bool  # the model soft-caps its logits


def _schedule_problems(row: SetupSignature, pp: int) -> list[str]:
    if row.schedule < 0:
        return [f"unknown pipeline schedule; choose one of {SCHEDULES}"]
    name = SCHEDULES[row.schedule]
    if name == "interleaved" and row.stages_per_rank < 2:
        return [f"the interleaved schedule needs stages_per_rank of 2 or more, not {row.stages_per_rank}"]
    if name != "interleaved" and row.stages_per_rank != 1:
        return [
            f"the {name} schedule runs one stage per rank (stages_per_rank {row.stages_per_rank}); "
            "use schedule='interleaved' for several"
        ]
    if row.microbatches < pp:
        return [f"{row.microbatches} micro-batches cannot fill {pp} pipeline stages: use at least {pp}"]
    if name == "interleaved" and row.microbatches % max(1, row.microbatches // pp):
        return [
            f"the interleaved schedule runs micro-batches in rounds of {pp}: use a multiple of {pp} "
            f"(not {row.microbatches})"
        ]
    return []


def _setup_problems(row: SetupSignature, pp: int) -> list[str]:
    """What is wrong with one rank's setup; every rank runs it over every rank's row."""
    problems = _schedule_problems(row, pp)
    stages = pp * max(row.stages_per_rank, 1)
    if row.layers < 0:
        problems.append("the model's decoder layers cannot be found")
    elif row.layers < stages:
        problems.append(
            f"{row.layers} decoder layers cannot fill {stages} pipeline stages (pp {pp} x stages_per_rank "
            f"{row.stages_per_rank}); every stage needs at least one layer"
        )
    if not row.prepared:
        problems.append("call seqpar.prepare_model(model, mesh) before apply_pipeline_parallel")
    if row.chunked and row.chunk_size < 1:
        problems.append(f"loss_chunk_size must be a positive number of tokens, not {row.chunk_size}")
    if row.chunked and row.custom_loss:
        problems.append("give loss_fn or loss_chunk_size, not both")
    if row.chunked and row.softcap:
        problems.append("the chunked loss does not apply the model's final logit soft-capping; drop loss_chunk_size")
    return problems


def agree_on_setup(mine: SetupSignature, group: dist.ProcessGroup, pp: int, detail: str = "") -> None:
    """Check every rank's setup on every rank (one small all-gather); all raise, or none does.

    Args:
        mine: this rank's signature.
        group: every rank of the mesh.
        pp: the pipeline-parallel degree.
        detail: this rank's own words on what is wrong (appended to the error it raises).

    Raises:
        SeqparInputError: a problem on any rank, or ranks that disagree on the arguments or the model.
    """
    table = exchange_signatures(mine, group)
    problems = by_rank([_setup_problems(row, pp) for row in table])
    if not problems and any(row != table[0] for row in table):
        problems.append("apply_pipeline_parallel was called with different arguments or models on different ranks")
    if problems:
        raise SeqparInputError(" | ".join(problems) + (f" ({detail})" if detail else ""))


@dataclass(frozen=True)
class _StepSignature(Signature):
    """One ``step`` call's shard as one rank sees it."""

    missing: bool  # a key of SHARD_KEYS is absent or not a 2-D tensor
    unequal: bool  # the three tensors' shapes differ
    rows: int
    seq: int
    counted: bool  # num_valid_tokens was given


def _step_signature(shard: Mapping[str, object], num_valid_tokens: int | None) -> _StepSignature:
    tensors = [shard.get(key) for key in SHARD_KEYS]
    missing = not all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in tensors)
    shape = tuple(tensors[0].shape) if not missing else (0, 0)
    unequal = not missing and any(tuple(t.shape) != shape for t in tensors)
    return _StepSignature(missing, unequal, shape[0], shape[1], num_valid_tokens is not None)


def agree_on_step(
    shard: Mapping[str, object], num_valid_tokens: int | None, microbatches: int, group: dist.ProcessGroup
) -> None:
    """Check one pipeline step's inputs on every rank at once (one small all-gather over ``group``).

    Args:
        shard: this rank's shard.
        num_valid_tokens: as passed to the step.
        microbatches: micro-batches per step.
        group: every rank of the mesh.

    Raises:
        SeqparInputError: on every rank, when any rank's shard lacks a key, has tensors of different shapes
            or rows that do not cut into the micro-batches, shapes differ across ranks, or only some ranks
            pass ``num_valid_tokens``.
    """
    table = exchange_signatures(_step_signature(shard, num_valid_tokens), group)
    per_rank = []
    for row in table:
        problems = []
        if row.missing:
            problems.append(f"a pipeline step needs a shard with {list(SHARD_KEYS)} as [B, S] tensors")
        elif row.unequal:
            problems.append("the shard's input_ids, position_ids and shift_labels have different shapes")
        elif row.rows % microbatches or row.rows == 0:
            problems.append(f"{row.rows} rows do not cut into {microbatches} equal micro-batches")
        per_rank.append(problems)
    problems = by_rank(per_rank)
    shapes = {(row.rows, row.seq) for row in table if not row.missing}
    if not problems and len(shapes) > 1:
        problems.append(f"every rank's shard must have one shape; got {sorted(shapes)}")
    if len({row.counted for row in table}) > 1:
        problems.append("pass num_valid_tokens on every rank or on none")
    if problems:
        raise SeqparInputError(" | ".join(problems))
