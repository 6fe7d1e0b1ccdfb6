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

Note [FSDP2 units]
    ``apply_data_parallel(..., "fsdp")`` shards the input embedding, every decoder block and the output head as
    units of their own, then the model (the root: the final norm and whatever else is left), as torchtitan
    does. A unit's parameters are gathered only while it runs: the embedding for the first moment of the
    forward (and again at the very end of the backward), each block for its forward and again for its
    backward, and the head from its forward through its backward (``reshard_after_forward=False``: the
    backward starts with it), its gradient reduce-scattered as soon as the head's backward ends. In the root,
    FSDP2 would keep the embedding and the head gathered from the forward until the end of the backward (a
    root is not resharded after its forward), with the head's gradient waiting there too: for Llama-3.1-8B
    in bf16 3 GB that every layer's backward would carry. A model whose embedding and head share a weight
    keeps both in the root.

Note [optimizer offload]
    ``apply_data_parallel(..., "fsdp", offload_optimizer=True)`` shards every unit with FSDP2's
    ``CPUOffloadPolicy``: the sharded parameters (the master copy the optimizer updates), their sharded
    gradients and therefore the optimizer state live in host memory, and ``optimizer.step()`` runs on the
    CPU. This is ZeRO-3 with ``offload_optimizer`` and ``offload_param`` to the CPU, what Arctic Long
    Sequence Training (arXiv:2506.13996) runs Llama-3.1-8B at 500K tokens on one H100 with. What stays on
    the device during a step: each unit's unsharded parameters while it runs (FSDP2 copies the unit's
    shard host-to-device, all-gathers it, frees it after the unit's forward and gathers it again for its
    backward; the next unit is prefetched, so about two decoder blocks at a time; Note [FSDP2 units]), the
    output head from its forward through its backward, the root's (final norm; embedding and head too when
    tied) from its forward until the end of the backward, and each unit's unsharded gradients until its
    reduce-scatter, whose sharded output is copied device-to-host. Nothing of the model stays on the device
    between steps. ``seqpar.estimate_memory(..., offload_optimizer=True)``
    counts exactly these (Note [memory estimate]).
    - It is FSDP2 only (DDP keeps whole replicas on the device); it works at any dp x sp size, 1 included
      (FSDP2 over a group of one still keeps the shard on the host and gathers a unit at a time).
    - Placement: FSDP2 moves a unit's parameters to the device of the mesh before sharding them, and the
      shards to the host; the model may stay on the CPU until then, so an 8B model never sits whole on the
      GPU. Host buffers are pinned (``pin_memory``) only when the mesh is on CUDA, where the copies overlap
      compute; pinning needs CUDA.
    - On the CPU (gloo) the shards are host tensors already: the same code path (the policy applied, the
      optimizer stepping on host DTensors, ``seqpar.clip_grad_norm_``, distributed checkpoints) runs, and
      training is exactly that of FSDP2 without offload (tests/test_composition.py).
    - Global gradient norms of host-resident shards are reduced on the mesh's device, so a NCCL-only
      group works (``seqpar.clip_grad_norm_``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from seqpar.errors import SeqparInputError
from seqpar.gradients import SUMMED_BY_WRAPPER
from seqpar.mesh import SequenceParallelMesh, flattened_group
from seqpar.models import find_anatomy


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
    """The decoder layers of a model of a registered family (``seqpar.models.anatomy``).

    Args:
        model: any module.

    Returns:
        The layers, in order; empty for a module whose family ``seqpar.models`` does not know.
    """
    found = find_anatomy(model)
    return [] if isinstance(found, str) else list(found.layers)


def _embedding_and_head(model: torch.nn.Module) -> tuple[list[torch.nn.Module], list[torch.nn.Module]]:
    """The input embedding and the output head as FSDP2 units of their own, or none when they share a weight."""
    found = find_anatomy(model)
    if isinstance(found, str) or found.head is None:
        return [], []
    embedding, head = found.embedding, found.head
    if any(p is q for p in embedding.parameters() for q in head.parameters()):  # tied: both stay in the root
        return [], []
    return [embedding], [head]


def apply_data_parallel(
    model: torch.nn.Module, mesh: SequenceParallelMesh, mode: str = "auto", *, offload_optimizer: bool = False
) -> torch.nn.Module:
    """Wrap ``model`` for data parallel over dp x sp with summed gradients (Note [summed gradients]).

    Args:
        model: the (already ``prepare_model``-ed) model, on its device (with ``offload_optimizer`` it may stay
            on the CPU: FSDP2 moves each unit to the mesh's device as it shards it).
        mesh: the mesh from ``seqpar.make_mesh``.
        mode: "fsdp" (FSDP2: parameters sharded over dp x sp; units: the input embedding, each transformer
            block, the output head, and the rest in the root; Note [FSDP2 units]), "ddp", or
            "auto" (FSDP2 on CUDA or with ``offload_optimizer``, DDP on the CPU otherwise).
        offload_optimizer: FSDP2 only: keep the sharded parameters, their gradients and the optimizer state
            in host memory and step the optimizer on the CPU (FSDP2's ``CPUOffloadPolicy``, pinned buffers
            on CUDA; Note [optimizer offload]). Build the optimizer after this call, from
            ``model.parameters()``.

    Returns:
        The FSDP2 module (the same object, now sharded) or the DDP wrapper. Call it with the same keywords.
        Under DDP, train through the wrapper only: the parameters' gradients are scaled by dp x sp on their
        way in (Note [summed gradients]), and only the wrapper's all-reduce averages that factor away.
        Gradient accumulation works with or without ``no_sync``.

    Raises:
        SeqparInputError: an unknown mode; a model already wrapped by this function; ``offload_optimizer``
            with DDP.
    """
    if mode == "auto":
        mode = "fsdp" if offload_optimizer or next(model.parameters()).is_cuda else "ddp"
    if offload_optimizer and mode != "fsdp":
        raise SeqparInputError(
            f"offload_optimizer needs mode 'fsdp' (FSDP2's CPUOffloadPolicy), not {mode!r}: DDP keeps whole "
            "parameters, gradients and optimizer state on the device"
        )
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
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        # with offload the model may still be on the CPU: compute where the mesh's collectives run
        device_type = mesh.device_mesh.device_type if offload_optimizer else next(model.parameters()).device.type
        dp_mesh = DeviceMesh.from_group(group, device_type)
        policy = CPUOffloadPolicy(pin_memory=device_type == "cuda") if offload_optimizer else OffloadPolicy()
        embedding, head = _embedding_and_head(model)
        units = [*embedding, *decoder_blocks(model), *head, model]
        for unit in units:
            # the head's backward follows its forward at once: keep it gathered in between (Note [FSDP2 units])
            keep = False if unit in head else None
            fully_shard(unit, mesh=dp_mesh, offload_policy=policy, reshard_after_forward=keep)
        for unit in units:
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
        _mark_summed(model, "FSDP2")
        return model
    raise SeqparInputError(f"unknown data-parallel mode {mode!r}; choose fsdp, ddp or auto")
