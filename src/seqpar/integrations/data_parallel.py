"""Data parallel over the dp x sp ranks: FSDP2 (``fully_shard``) or DDP, with gradients summed, not averaged.

With ``seqpar.cross_entropy``'s global normalisation, summed gradients are exactly the global batch's gradient.

Note [summed gradients]
    Sequence-parallel ranks hold replicas of the same parameters and see different tokens of the same
    rows; data-parallel ranks see different rows. Each rank's loss is its token-loss sum over the global
    valid-token count (Note [global token normalisation]), so the exact gradient is the *sum* of the
    ranks' gradients over the flattened dp x sp group. FSDP2 and DDP average by default (divide by the
    group size), which would scale the gradient by 1 / (dp x sp); seqpar sets FSDP2's divide factor to 1
    with sum-only collectives. DDP keeps its own average, and seqpar scales what it averages instead: a
    hook on every parameter multiplies this rank's new gradient by the group size G before autograd adds it
    to ``.grad``, so the average of the scaled gradients is their sum.

    Why not a summing comm hook: under gradient accumulation without ``no_sync``, DDP all-reduces the whole
    ``.grad`` at every backward, and from the second micro-batch on that buffer already holds the earlier
    micro-batches' *reduced* gradient R (the same on every rank). An average gives R + mean(new), which is
    right; a sum gives G·R + sum(new): every earlier micro-batch counted G times. Scaling the new part only
    gives R + mean(G·new) = R + sum(new) at every backward, with or without ``no_sync`` (under ``no_sync``
    the scaled local gradients pile up unreduced and the final average sums them once). Rule: a gradient
    is summed over ranks exactly once, and whatever may already hold a reduced value is averaged, never
    summed again.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from seqpar.errors import SeqparInputError
from seqpar.gradients import SUMMED_BY_WRAPPER
from seqpar.mesh import SequenceParallelMesh, flattened_group

__all__ = ["apply_data_parallel", "data_parallel_group", "decoder_blocks"]


def data_parallel_group(mesh: SequenceParallelMesh) -> dist.ProcessGroup:
    """The flattened dp x sp group of ``mesh``: the ranks with this rank's tensor-parallel coordinate.

    Collective (it may create the group): call it on every rank.

    Raises:
        SeqparInputError: a mesh without a DeviceMesh (build it with ``seqpar.make_mesh``).
    """
    if mesh.device_mesh is None:
        raise SeqparInputError("apply_data_parallel needs a mesh from seqpar.make_mesh (with a DeviceMesh)")
    dm = mesh.device_mesh
    names = [n for n in ("dp", "ring", "ulysses", "sp") if n in (dm.mesh_dim_names or ())]
    return flattened_group(dm, names)


def _scale_new_gradients(model: torch.nn.Module, factor: int) -> list:
    """Multiply every parameter's incoming gradient by ``factor`` before it is added to ``.grad``."""

    def scale(grad: torch.Tensor) -> torch.Tensor:
        return grad * factor

    return [p.register_hook(scale) for p in model.parameters() if p.requires_grad]


def _mark_summed(model: torch.nn.Module, wrapper: str) -> None:
    """Tag the parameters so that ``reduce_gradients`` and a second wrap refuse them."""
    for p in model.parameters():
        setattr(p, SUMMED_BY_WRAPPER, wrapper)


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks of a transformers model (``model.model.layers`` and the like)."""
    for name in ("model.layers", "layers", "transformer.h", "model.decoder.layers"):
        module = model
        for part in name.split("."):
            module = getattr(module, part, None)
            if module is None:
                break
        if isinstance(module, torch.nn.ModuleList):
            return list(module)
    return []


def apply_data_parallel(model: torch.nn.Module, mesh: SequenceParallelMesh, mode: str = "auto") -> torch.nn.Module:
    """Wrap ``model`` for data parallel over dp x sp with summed gradients (Note [summed gradients]).

    Args:
        model: the (already ``prepare_model``-ed) model, on its device.
        mesh: the mesh from ``seqpar.make_mesh``.
        mode: "fsdp" (FSDP2: parameters sharded over dp x sp, one unit per transformer block), "ddp", or
            "auto" (FSDP2 on CUDA, DDP on the CPU).

    Returns:
        The FSDP2 module (the same object, now sharded) or the DDP wrapper. Call it with the same keywords.
        Under DDP, train through the wrapper only: the parameters' gradients are scaled by dp x sp on their
        way in (Note [summed gradients]), and only the wrapper's all-reduce averages that factor away.
        Gradient accumulation works with or without ``no_sync``.

    Raises:
        SeqparInputError: an unknown mode; a model already wrapped by this function.
    """
    if mode == "auto":
        mode = "fsdp" if next(model.parameters()).is_cuda else "ddp"
    wrapped = {getattr(p, SUMMED_BY_WRAPPER) for p in model.parameters() if hasattr(p, SUMMED_BY_WRAPPER)}
    if wrapped:
        raise SeqparInputError(f"this model is already wrapped by apply_data_parallel ({wrapped.pop()}); wrap it once")
    group = data_parallel_group(mesh)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, process_group=group)  # averages over the group
        _scale_new_gradients(model, dist.get_world_size(group))
        _mark_summed(model, "DDP")
        return ddp
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        device_type = next(model.parameters()).device.type
        dp_mesh = DeviceMesh.from_group(group, device_type)
        units = [*decoder_blocks(model), model]
        for unit in units:
            fully_shard(unit, mesh=dp_mesh)
        for unit in units:
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
        _mark_summed(model, "FSDP2")
        return model
    raise SeqparInputError(f"unknown data-parallel mode {mode!r}; choose fsdp, ddp or auto")
