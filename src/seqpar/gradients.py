"""Gradients of parameters replicated over sequence-parallel ranks: summing them, and clipping their norm.

Both accept a mix of plain tensors and DTensors (tensor-parallel blocks, FSDP2 shards).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from seqpar.errors import SeqparInputError
from seqpar.mesh import as_sp_mesh

if TYPE_CHECKING:
    import torch

# torch is imported in the functions that touch tensors: the memory estimate reads BUCKET_MB, and the planner
# behind it loads no torch (Note [torch-free planning], seqpar.planning)

# Set on parameters whose gradients a wrapper (DDP, FSDP2) already sums over ranks (Note [summed gradients]).
SUMMED_BY_WRAPPER = "_seqpar_summed_by"

BUCKET_MB = 16.0
"""Default bucket of ``reduce_gradients``: the most memory its reduction adds to the gradients, in MiB."""


def reduce_gradients(parameters: Iterable[torch.nn.Parameter], group: object, *, bucket_mb: float = BUCKET_MB) -> None:
    """Sum the gradients of replicated parameters over ``group`` in place, in buckets of ``bucket_mb``.

    Use it over the SP group (or dp x sp) when the model is not wrapped in DDP/FSDP; with the losses of
    Note [global token normalisation] the result is the exact gradient of the global batch. Every rank
    must pass the same parameters (collective); one that has a gradient on some ranks only (an expert
    that only some ranks' tokens chose) gets zeros on the others first. Gradients of at least ``bucket_mb`` are
    summed where they are; smaller ones of one dtype are copied into a flat bucket of at most ``bucket_mb``
    and summed together, so the reduction holds at most one bucket beyond the gradients (a single flat
    buffer would double the gradient memory at the end of every step).

    Args:
        parameters: the model's parameters; those without a gradient are skipped.
        group: a ProcessGroup, a mesh (its SP group), or None (nothing to do).
        bucket_mb: the largest bucket of coalesced small gradients, in MiB (``math.inf``: one per dtype).

    Raises:
        SeqparInputError: parameters of a model wrapped by ``apply_data_parallel`` (DDP or FSDP2 already
            summed their gradients; summing again would count every rank's part once per rank), or a
            ``bucket_mb`` that is not positive.
    """
    import torch
    import torch.distributed as dist

    parameters = list(parameters)
    wrapped = {getattr(p, SUMMED_BY_WRAPPER) for p in parameters if hasattr(p, SUMMED_BY_WRAPPER)}
    if wrapped:
        raise SeqparInputError(
            f"these parameters' gradients are already summed over ranks by {wrapped.pop()} "
            "(apply_data_parallel); do not call reduce_gradients on them"
        )
    if not bucket_mb > 0:  # also NaN
        raise SeqparInputError(f"bucket_mb must be positive, not {bucket_mb!r}")
    group = as_sp_mesh(group).sp_group
    if group is None or dist.get_world_size(group) == 1:
        return
    _agree_on_gradients(parameters, group)
    # a DTensor gradient (tensor parallel, FSDP) is reduced through its local shard; a gradient reached
    # twice (a parameter listed twice, a shared .grad) is summed once
    grads = list(
        {id(g): g for g in (getattr(p.grad, "_local_tensor", p.grad) for p in parameters) if g is not None}.values()
    )
    for bucket in _buckets(grads, bucket_mb * 2**20):
        if len(bucket) == 1 and bucket[0].is_contiguous():
            dist.all_reduce(bucket[0], group=group)
            continue
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _agree_on_gradients(parameters: list[torch.nn.Parameter], group: object) -> None:
    """Give a zero gradient to each parameter that has none here but has one on another rank.

    A mixture of experts routes each rank's tokens to its own experts, so an expert can have a gradient on one
    rank and none on another; the buckets would then differ between ranks and the sums mismatch. One small
    all-reduce of which parameters have gradients settles it; a parameter no rank used keeps no gradient, as
    in one process (an optimizer skips it).
    """
    import torch
    import torch.distributed as dist

    from seqpar.sequence_parallel.comm.collectives import collective_device

    trainable = [p for p in parameters if p.requires_grad]
    if not trainable:
        return
    has = torch.tensor([p.grad is not None for p in trainable], dtype=torch.int32, device=collective_device(group))
    dist.all_reduce(has, group=group)
    for p, any_rank in zip(trainable, has.tolist(), strict=True):
        if any_rank and p.grad is None:
            p.grad = torch.zeros_like(p)


def _buckets(grads: list[torch.Tensor], limit: float) -> list[list[torch.Tensor]]:
    """Gradients grouped in order: one dtype per bucket, at most ``limit`` bytes unless a tensor alone is larger."""
    buckets: list[list[torch.Tensor]] = []
    filled: list[int] = []  # bytes in each bucket
    open_bucket: dict[torch.dtype, int] = {}  # the bucket still taking gradients of each dtype
    for g in grads:
        size = g.numel() * g.element_size()
        if size >= limit:
            buckets.append([g])
            filled.append(size)
            continue
        i = open_bucket.get(g.dtype)
        if i is None or filled[i] + size > limit:
            i = open_bucket[g.dtype] = len(buckets)
            buckets.append([])
            filled.append(0)
        buckets[i].append(g)
        filled[i] += size
    return buckets


def clip_grad_norm_(parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale gradients so that their global norm is at most ``max_norm``; returns the norm before clipping.

    Like ``torch.nn.utils.clip_grad_norm_``, but the parameters may mix plain tensors and DTensors (each
    DTensor's norm is reduced over its own mesh), as after ``apply_tensor_parallel``. Every rank of a
    DTensor's mesh must call it. A DTensor gradient held in host memory on a CUDA mesh (FSDP2's CPU
    offload, Note [optimizer offload]) is measured on the host and its norm reduced on the device.

    Args:
        parameters: the model's parameters; those without a gradient are skipped.
        max_norm: the largest allowed global norm (``inf``: measure only).
        norm_type: the p of the p-norm.

    Returns:
        The global norm before clipping, a plain tensor, the same on every rank.
    """
    import torch

    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norms = []
    for g in grads:
        n = torch.linalg.vector_norm(g, norm_type)
        if hasattr(n, "full_tensor"):
            n = _on_mesh_device(n).full_tensor()
        norms.append(n)
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
    scale = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    if scale < 1.0:
        for g in grads:
            g.mul_(scale)
    return total


def _on_mesh_device(n: torch.Tensor) -> torch.Tensor:
    """A DTensor norm whose local part sits where its mesh's collectives run (host shards on a CUDA mesh)."""
    import torch
    from torch.distributed.tensor import DTensor

    mesh = n.device_mesh
    if n.device.type == mesh.device_type:
        return n

    device = torch.device(mesh.device_type, torch.accelerator.current_device_index())
    return DTensor.from_local(n.to_local().to(device), mesh, n.placements, run_check=False)
