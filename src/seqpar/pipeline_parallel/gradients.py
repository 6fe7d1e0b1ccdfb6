"""Gradients of a pipeline-parallel model: the tied embedding's sum over the pipeline's ends, and the global norm.

Used by ``PipelineParallel``; Note [pipeline loss] says why these two are all that pp adds to dp x sp reduction.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from seqpar.gradients import clip_grad_norm_
from seqpar.loss import sum_over
from seqpar.mesh import SequenceParallelMesh
from seqpar.sequence_parallel.comm.collectives import collective_device


def end_group(mesh: SequenceParallelMesh) -> dist.ProcessGroup | None:
    """This rank's group of the first and the last pp rank of its pipeline (Megatron's embedding group).

    Collective: every rank creates every such group, in the same order.

    Args:
        mesh: a mesh with a "pp" axis.

    Returns:
        The group, or None on the ranks in between.
    """
    dm = mesh.device_mesh
    names = list(dm.mesh_dim_names)
    pp_dim = names.index("pp")
    order = [i for i in range(len(names)) if i != pp_dim] + [pp_dim]
    mine = None
    for row in dm.mesh.permute(order).reshape(-1, dm.size(pp_dim)).tolist():
        ends = [row[0], row[-1]]
        group = dist.new_group(ends)
        if dist.get_rank() in ends:
            mine = group
    return mine


def sum_tied_gradient(weight: nn.Parameter, group: dist.ProcessGroup) -> None:
    """Sum the gradient of a tied weight (the embedding on the first stage, its copy on the last) in place.

    Both ends hold the weight with the same shape and sharding (a plain tensor, or FSDP2 shards over the same
    dp x sp group), so their local gradients line up element by element.

    Args:
        weight: this end's copy of the weight; a missing gradient counts as zeros.
        group: the ``end_group`` of this rank.
    """
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    grad = weight.grad.to_local() if hasattr(weight.grad, "to_local") else weight.grad
    home = grad
    if grad.device != collective_device(group):
        grad = grad.to(collective_device(group))
    dist.all_reduce(grad, group=group)
    if grad is not home:
        home.copy_(grad)


def pipeline_grad_norm_(
    parameters: list[nn.Parameter],
    counted: list[nn.Parameter],
    max_norm: float,
    norm_type: float,
    pp_group: dist.ProcessGroup,
) -> torch.Tensor:
    """Clip ``parameters``' gradients by the norm of ``counted``'s over every rank of the pipeline.

    Args:
        parameters: every parameter of this rank's stages (scaled).
        counted: those that count in the norm (a tied weight's second copy left out).
        max_norm: the largest allowed norm (``inf``: measure only).
        norm_type: the p of the p-norm.
        pp_group: the pipeline's ranks.

    Returns:
        The norm before clipping (float32, on the gradients' device), the same on every rank of the pipeline.
    """
    local = clip_grad_norm_(counted, float("inf"), norm_type).float()
    if norm_type == float("inf"):
        total = local.to(collective_device(pp_group))
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
        total = total.to(local.device)
    else:
        total = sum_over(local**norm_type, pp_group) ** (1.0 / norm_type)
    scale = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    if scale < 1.0:
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(scale)
    return total
