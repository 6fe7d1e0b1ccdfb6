"""Pipeline parallel on the mesh's "pp" axis for seqpar-prepared transformers causal LMs, with exact token-mean loss.

``apply_pipeline_parallel`` splits the model into stages (Note [pipeline stages]) run by torch.distributed.pipelining.

Note [pipeline loss]
    A pipeline step runs ``microbatches`` micro-batches (equal slices of the rows of this rank's
    ``seqpar.shard_batch`` shard) through torch's ``PipelineStage`` and ``ScheduleGPipe`` /
    ``Schedule1F1B`` / ``ScheduleInterleaved1F1B``; the sequence stays split over the SP group inside every
    stage. The last stage's loss of one micro-batch is ``seqpar.cross_entropy`` (or the chunked
    ``lm_head_cross_entropy``) of its tokens normalised by N, the valid tokens of the whole optimizer step:
    every micro-batch, every dp replica and SP shard, and every ``step`` call when accumulating (Note [global
    token normalisation]). The schedules run with ``scale_grads=False``, so nothing divides by the number of
    micro-batches: each stage's parameter gradients are the exact gradients of this rank's tokens, and
    ``reduce_gradients`` sums them over dp x sp (``seqpar.data_parallel_group``). Stages hold disjoint
    parameters, so nothing is summed over pp, except a tied embedding: its gradient on the first stage and
    the gradient of the last stage's copy are summed between those two ranks (Note [pipeline stages]). The
    gradient norm is the norm over all stages (p-th powers summed over pp), counting the tied weight once.
    The loss that ``step`` returns is the sum over micro-batches, dp, SP and pp (only the last stage holds
    one), the same on every rank: the mean token loss of the step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from seqpar.data_parallel import data_parallel_group
from seqpar.errors import SeqparInputError
from seqpar.gradients import SUMMED_BY_WRAPPER, reduce_gradients
from seqpar.loss import count_valid_tokens, cross_entropy, lm_head_cross_entropy, sum_over
from seqpar.mesh import SequenceParallelMesh, flattened_group
from seqpar.pipeline_parallel.balance import balanced_split, part_sizes
from seqpar.pipeline_parallel.checks import SCHEDULES, SHARD_KEYS, SetupSignature, agree_on_setup, agree_on_step
from seqpar.pipeline_parallel.gradients import end_group, pipeline_grad_norm_, sum_tied_gradient
from seqpar.pipeline_parallel.schedule import build_schedule
from seqpar.pipeline_parallel.stages import (
    DecoderStage,
    ModelParts,
    find_parts,
    original_names,
    split_model,
)
from seqpar.sequence_parallel.prepare import is_prepared

LossFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


class PipelineParallel:
    """This rank's pipeline stages and the schedule that runs them (Note [pipeline loss]).

    Build it with ``apply_pipeline_parallel``. Per optimizer step: ``step`` once per accumulated batch,
    ``reduce_gradients``, ``clip_grad_norm_``, then the optimizer (built on ``parameters()``). For FSDP2 over
    dp x sp, call ``seqpar.apply_data_parallel(stage, mesh, "fsdp")`` on each of ``stages`` before building the
    optimizer; the schedule then reduce-scatters each stage's gradients once, after its last micro-batch.
    """

    def __init__(
        self,
        mesh: SequenceParallelMesh,
        stages: list[DecoderStage],
        *,
        schedule: str,
        microbatches: int,
        layers_per_stage: list[int],
        tied: bool,
        loss: tuple[LossFn | None, int | None],
        dtype: torch.dtype,
    ) -> None:
        self.mesh = mesh
        self.stages = stages
        """This rank's stage modules (``DecoderStage``), in stage order."""
        self.schedule, self.microbatches = schedule, microbatches
        self.layers_per_stage = layers_per_stage
        """Decoder layers of every stage of the pipeline, first to last."""
        self._loss_fn, self._chunk = loss
        self._tied, self._dtype = tied, dtype
        axes = list(mesh.device_mesh.mesh_dim_names)
        self._dp_group = data_parallel_group(mesh)
        self._all_group = flattened_group(mesh.device_mesh, axes)
        self._loss_group = flattened_group(mesh.device_mesh, [a for a in axes if a != "tp"])
        self._end_group = end_group(mesh) if tied else None
        cuda = mesh.device_mesh.device_type == "cuda"
        self._device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self._built: tuple[tuple[int, int], object] | None = None  # (micro-batch shape, torch schedule)

    @property
    def stage_indices(self) -> list[int]:
        """The indices of this rank's stages."""
        return [s.index for s in self.stages]

    @property
    def num_stages(self) -> int:
        """Stages in the whole pipeline."""
        return len(self.layers_per_stage)

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (every stage it runs; a tied head's copy included), each once."""
        return list({id(p): p for s in self.stages for p in s.parameters()}.values())

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under their names in the original model (a tied head's copy as the head)."""
        seen = set()
        for stage in self.stages:
            for name, p in original_names(stage):
                if id(p) not in seen:
                    seen.add(id(p))
                    yield name, p

    def _is_tied_copy(self, p: nn.Parameter) -> bool:
        return self._tied and any(s.last and not s.first and s.lm_head.weight is p for s in self.stages)

    def _tied_weight(self) -> nn.Parameter | None:
        for s in self.stages:
            if s.first:
                return s.get_input_embeddings().weight
            if s.last:
                return s.lm_head.weight
        return None

    def _loss(self, output: torch.Tensor, target: torch.Tensor, num_valid_tokens: int) -> torch.Tensor:
        if self._chunk is not None:
            head = next(s.lm_head for s in self.stages if s.last)
            return lm_head_cross_entropy(
                output, head, target, chunk_size=self._chunk, num_valid_tokens=num_valid_tokens
            )
        if self._loss_fn is not None:
            return self._loss_fn(output, target, num_valid_tokens)
        return cross_entropy(output, target, num_valid_tokens=num_valid_tokens)

    def _schedule(self, rows: int, seq: int) -> object:
        """torch's schedule for micro-batches of ``rows x seq`` tokens (rebuilt when the shape changes)."""
        if self._built is None or self._built[0] != (rows, seq):
            built = build_schedule(
                self.stages,
                schedule=self.schedule,
                num_stages=self.num_stages,
                microbatches=self.microbatches,
                shape=(rows, seq),
                sizes=(self.stages[0].model.config.hidden_size, self.stages[0].model.config.vocab_size),
                dtype=self._dtype,
                loss=self._loss,
                last_returns_hidden=self._chunk is not None,
                group=self.mesh.pp_group,
                device=self._device,
            )
            self._built = ((rows, seq), built)
        return self._built[1]

    def step(self, shard: Mapping[str, torch.Tensor], *, num_valid_tokens: int | None = None) -> torch.Tensor:
        """Run forward and backward of this rank's shard through the pipeline; gradients accumulate.

        Every rank passes its shard (``seqpar.shard_batch`` of its dp replica's rows, for its SP rank; the
        same on every pp rank of the replica), all of one shape. Its rows are cut into ``microbatches``
        equal micro-batches.

        Args:
            shard: ``{"input_ids", "position_ids", "shift_labels"}``, each ``[B, S/P]``, ``B`` a multiple of
                ``microbatches``.
            num_valid_tokens: valid tokens of the whole optimizer step over dp x sp (``seqpar.count_valid_tokens``
                over ``seqpar.data_parallel_group(mesh)`` and every accumulated shard); default: this shard's,
                counted over that group (no accumulation).

        Returns:
            The loss of this call summed over micro-batches, dp, SP and pp (detached; the same on every rank):
            with the default count, the mean token loss of the call's global batch.

        Raises:
            SeqparInputError: on every rank, when any rank's shard lacks a key, has tensors of different
                shapes or rows that do not divide into the micro-batches, shapes differ across ranks, or only
                some ranks pass ``num_valid_tokens``.
        """
        agree_on_step(shard, num_valid_tokens, self.microbatches, self._all_group)
        ids, positions, labels = (shard[k] for k in SHARD_KEYS)
        if num_valid_tokens is None:
            num_valid_tokens = count_valid_tokens(labels, self._dp_group)
        schedule = self._schedule(ids.shape[0] // self.microbatches, ids.shape[1])
        holds_first = any(s.first for s in self.stages)
        holds_last = any(s.last for s in self.stages)
        losses: list[torch.Tensor] = []
        schedule.step(
            *((ids.to(self._device),) if holds_first else ()),
            target=labels.to(self._device) if holds_last else None,
            losses=losses if holds_last else None,
            return_outputs=False,
            loss_kwargs={"num_valid_tokens": num_valid_tokens},
            position_ids=positions.to(self._device),
        )
        local = torch.stack([loss.detach().float() for loss in losses]).sum() if losses else torch.zeros(())
        return sum_over(local.to(self._device), self._loss_group)

    def reduce_gradients(self) -> None:
        """Sum the step's gradients over dp x sp, and a tied embedding's over the first and last stage.

        Collective: call it on every rank once per optimizer step, after the last ``step``. Gradients that
        FSDP2 or DDP already summed (``apply_data_parallel`` on a stage) are not summed again.
        """
        own = [p for p in self.parameters() if not hasattr(p, SUMMED_BY_WRAPPER)]
        reduce_gradients(own, self._dp_group)
        if self._end_group is not None:
            sum_tied_gradient(self._tied_weight(), self._end_group)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every stage's gradients so that the norm over the whole model is at most ``max_norm``.

        Collective over all ranks. The norm is taken over all stages (each rank's norm to the power
        ``norm_type`` summed over pp; the maximum for ``inf``), tensor-parallel and FSDP2 shards included,
        with a tied weight counted once. Call it after ``reduce_gradients``.

        Args:
            max_norm: the largest allowed norm (``inf``: measure only).
            norm_type: the p of the p-norm.

        Returns:
            The norm before clipping, a float32 scalar, the same on every rank.
        """
        counted = [p for p in self.parameters() if not self._is_tied_copy(p)]
        return pipeline_grad_norm_(self.parameters(), counted, max_norm, norm_type, self.mesh.pp_group)


def apply_pipeline_parallel(
    model: nn.Module,
    mesh: SequenceParallelMesh,
    *,
    schedule: str = "1f1b",
    microbatches: int,
    stages_per_rank: int = 1,
    loss_fn: LossFn | None = None,
    loss_chunk_size: int | None = None,
) -> PipelineParallel:
    """Split a seqpar-prepared causal LM into pipeline stages over the mesh's "pp" axis (Note [pipeline stages]).

    Collective: call it on every rank with the same model (built from the same seed or checkpoint) and the
    same arguments. Layers are cut into ``pp_size * stages_per_rank`` contiguous stages balanced by
    parameter count, the embedding on the first and the final norm and head on the last; stage ``s`` runs
    on pp rank ``s % pp_size``. The stages share the model's parameters; drop the model and train through
    the returned object (Note [pipeline loss]).

    Args:
        model: a transformers causal LM (Llama, Qwen2/3, Mistral, Gemma 3, ...) after
            ``seqpar.prepare_model(model, mesh)`` (and ``apply_tensor_parallel``, if any).
        mesh: a mesh from ``seqpar.make_mesh(pp_size=...)`` with ``pp_size`` of 2 or more.
        schedule: "gpipe", "1f1b" or "interleaved" (torch's ScheduleGPipe, Schedule1F1B,
            ScheduleInterleaved1F1B).
        microbatches: micro-batches per ``step``; at least ``pp_size`` (for "interleaved", a multiple of
            ``pp_size`` when above it).
        stages_per_rank: stages each rank runs: 1, or 2 and more with "interleaved".
        loss_fn: ``loss_fn(logits, shift_labels, num_valid_tokens)`` of one micro-batch on the last stage
            (default: ``seqpar.cross_entropy``); it must normalise by ``num_valid_tokens``.
        loss_chunk_size: use ``seqpar.lm_head_cross_entropy`` with pieces of this many tokens instead: the
            last stage then never holds a micro-batch's whole logits.

    Returns:
        A ``PipelineParallel`` holding this rank's stages.

    Raises:
        SeqparInputError: on every rank, before any pipeline communication: a mesh without a "pp" axis of 2 or
            more, an unknown schedule, stages_per_rank that does not suit it, fewer micro-batches than pp
            ranks, fewer decoder layers than stages, a model whose decoder layers cannot be found or that
            seqpar did not prepare, or arguments that differ across ranks.
    """
    if mesh.device_mesh is None or mesh.pp_size < 2:
        raise SeqparInputError(
            "apply_pipeline_parallel needs a mesh from seqpar.make_mesh(pp_size=...) with pp_size of 2 or more"
        )
    pp = mesh.pp_size
    parts = find_parts(model)
    found = isinstance(parts, ModelParts)
    mine = SetupSignature(
        schedule=SCHEDULES.index(schedule) if schedule in SCHEDULES else -1,
        microbatches=int(microbatches),
        stages_per_rank=int(stages_per_rank),
        layers=len(parts.layers) if found else -1,
        prepared=is_prepared(model),
        chunk_size=int(loss_chunk_size or 0),
        chunked=loss_chunk_size is not None,
        custom_loss=loss_fn is not None,
        softcap=found and parts.softcap is not None,
    )
    everyone = flattened_group(mesh.device_mesh, list(mesh.device_mesh.mesh_dim_names))
    agree_on_setup(mine, everyone, pp, detail="" if found else parts)
    sizes, embedding, head = part_sizes(parts)
    counts = balanced_split(sizes, pp * stages_per_rank, embedding, head)
    indices = [mesh.pp_rank + k * pp for k in range(stages_per_rank)]
    stages = split_model(parts, counts, indices, return_hidden=loss_chunk_size is not None)
    return PipelineParallel(
        mesh,
        stages,
        schedule=schedule,
        microbatches=microbatches,
        layers_per_stage=counts,
        tied=parts.tied,
        loss=(loss_fn, loss_chunk_size),
        dtype=parts.head.weight.dtype,
    )
