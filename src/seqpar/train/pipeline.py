"""Pipeline parallel at run time in ``seqpar train``: the stages, one optimizer step's gradients through them,
the parameters a checkpoint takes from this rank, and the whole model again for evaluation.

Every function here is collective over the ranks named in its docstring (Note [pipeline in seqpar train]).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import seqpar
from seqpar.train.pipeline_config import microbatches, stages_per_rank


def build_pipeline(config: object, model: torch.nn.Module, mesh: seqpar.SequenceParallelMesh) -> object:
    """This rank's stages of the prepared ``model`` (collective over every rank).

    Args:
        config: the run's settings (``pp_schedule``, ``pp_microbatches``, ``loss_chunk``).
        model: the model after ``seqpar.prepare_model`` (and tensor parallel, if any).
        mesh: the run's mesh, with a "pp" axis.

    Returns:
        The ``seqpar.PipelineParallel``.

    Raises:
        SeqparInputError: on every rank, settings the pipeline cannot take (``apply_pipeline_parallel``).
    """
    return seqpar.apply_pipeline_parallel(
        model,
        mesh,
        schedule=config.pp_schedule,
        microbatches=microbatches(config),
        stages_per_rank=stages_per_rank(config),
        loss_chunk_size=config.loss_chunk or None,
    )


def pipeline_gradients(run: object, shards: list[dict], total: int) -> torch.Tensor:
    """Forward and backward of the step's batches through the pipeline, gradients summed (collective).

    Args:
        run: the run's state (``RunState`` with a ``pipeline``).
        shards: this rank's shard of each accumulated batch (``seqpar.shard_batch``).
        total: the valid tokens of the whole optimizer step over dp x sp.

    Returns:
        This rank's share of the step's mean loss: the whole loss on rank 0 of the loss group, 0 elsewhere,
        so that the loop's sum over that group gives the loss once.
    """
    loss = torch.zeros((), device=run.device)
    with run.autocast:
        for shard in shards:
            loss += run.pipeline.step(shard, num_valid_tokens=total)
    run.pipeline.reduce_gradients()
    return loss if dist.get_rank(run.loss_group) == 0 else torch.zeros_like(loss)


def owned_model_state(run: object, model_state: dict) -> dict:
    """The model state a checkpoint takes from this rank: its stages' parameters, and the buffers.

    Args:
        run: the run's state.
        model_state: the whole model's state dict (``get_state_dict``), keyed by the model's names.

    Returns:
        ``model_state`` without the parameters of stages other ranks hold (their copies here are stale).
    """
    if run.pipeline is None:
        return model_state
    owned = {name for name, _ in run.pipeline.named_parameters()}
    others = {name for name, _ in run.model.named_parameters()} - owned
    return {key: value for key, value in model_state.items() if key not in others}


def gather_stages(run: object) -> None:
    """Copy every stage's parameters into the unsplit model of each pp rank (collective over every rank).

    Each parameter is broadcast over the pp group from the rank whose stage holds it, in the model's order.

    Args:
        run: the run's state (nothing happens without a pipeline).
    """
    pipeline = run.pipeline
    if pipeline is None:
        return
    mine = [name for name, _ in pipeline.named_parameters()]
    owners: list[list[str] | None] = [None] * pipeline.mesh.pp_size
    dist.all_gather_object(owners, mine, group=pipeline.mesh.pp_group)
    owner_of = {name: rank for rank, names in enumerate(owners) for name in names}
    members = dist.get_process_group_ranks(pipeline.mesh.pp_group)
    with torch.no_grad():
        for name, p in run.model.named_parameters():
            data = p.to_local() if hasattr(p, "to_local") else p.data
            dist.broadcast(data, src=members[owner_of[name]], group=pipeline.mesh.pp_group)
