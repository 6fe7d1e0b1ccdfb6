"""The process groups a sequence-parallel job runs on: one DeviceMesh ("dp", "ring", "ulysses") and its SP group.

``make_mesh`` builds it over an initialised default group; ``as_sp_mesh`` accepts simpler stand-ins.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from seqpar.errors import SeqparInputError

__all__ = ["SequenceParallelMesh", "as_sp_mesh", "make_mesh"]


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


@dataclass(frozen=True)
class SequenceParallelMesh:
    """The groups one rank uses for sequence parallelism.

    The sequence-parallel (SP) group is ring x ulysses; SP rank ``= ring_rank * ulysses_size + ulysses_rank``,
    and shard ``i`` of the sequence lives on SP rank ``i``.
    """

    sp_group: dist.ProcessGroup | None
    """All ranks that share one sequence (None: a single process, no communication)."""
    ring_group: dist.ProcessGroup | None = None
    """The ranks a key/value block travels around (defaults to the SP group)."""
    ulysses_group: dist.ProcessGroup | None = None
    """The ranks that exchange heads by all-to-all (None: size 1)."""
    device_mesh: DeviceMesh | None = None
    """The full mesh, when built by ``make_mesh``."""

    @property
    def sp_size(self) -> int:
        return _size(self.sp_group)

    @property
    def sp_rank(self) -> int:
        return _rank(self.sp_group)

    @property
    def ring_size(self) -> int:
        return _size(self.ring_group if self.ring_group is not None else self.sp_group)

    @property
    def ulysses_size(self) -> int:
        return _size(self.ulysses_group)


def make_mesh(
    sp_size: int | None = None,
    *,
    ulysses_size: int = 1,
    dp_size: int | None = None,
    device_type: str | None = None,
) -> SequenceParallelMesh:
    """Build the sequence-parallel mesh over all ranks of the initialised default process group.

    The DeviceMesh has axes ("dp", "ring", "ulysses"), ring size ``sp_size // ulysses_size``; consecutive
    ranks share a sequence, so ulysses (the most communication-hungry axis) spans the closest ranks.

    Args:
        sp_size: ranks that share one sequence; defaults to ``world_size // dp_size`` (all ranks).
        ulysses_size: how many of them exchange heads by all-to-all; must divide ``sp_size``.
        dp_size: data-parallel replicas; defaults to ``world_size // sp_size``.
        device_type: "cpu" or "cuda"; defaults to "cuda" under NCCL and "cpu" otherwise.

    Returns:
        A ``SequenceParallelMesh`` for this rank.

    Raises:
        SeqparInputError: no initialised process group, or degrees that do not multiply to the world size.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise SeqparInputError(
            "make_mesh needs an initialised default process group (torchrun, or dist.init_process_group)"
        )
    world = dist.get_world_size()
    if sp_size is None:
        sp_size = world // (dp_size or 1)
    if dp_size is None:
        dp_size = world // sp_size if sp_size > 0 else 0
    if sp_size < 1 or ulysses_size < 1 or dp_size < 1 or sp_size * dp_size != world:
        raise SeqparInputError(
            f"dp_size ({dp_size}) x sp_size ({sp_size}) must equal the world size ({world}); "
            f"valid sp sizes here: {[d for d in range(1, world + 1) if world % d == 0]}"
        )
    if sp_size % ulysses_size:
        raise SeqparInputError(
            f"ulysses_size {ulysses_size} must divide sp_size {sp_size}; "
            f"valid: {[d for d in range(1, sp_size + 1) if sp_size % d == 0]}"
        )
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    ring_size = sp_size // ulysses_size
    device_mesh = init_device_mesh(
        device_type, (dp_size, ring_size, ulysses_size), mesh_dim_names=("dp", "ring", "ulysses")
    )
    if dp_size == 1:
        sp_group = dist.group.WORLD
    else:
        # Every rank must create every SP group, in the same order.
        sp_group = None
        for row in device_mesh.mesh.reshape(dp_size, sp_size).tolist():
            group = dist.new_group(row)
            if dist.get_rank() in row:
                sp_group = group
    return SequenceParallelMesh(
        sp_group=sp_group,
        ring_group=device_mesh.get_group("ring"),
        ulysses_group=device_mesh.get_group("ulysses") if ulysses_size > 1 else None,
        device_mesh=device_mesh,
    )


def as_sp_mesh(mesh: object) -> SequenceParallelMesh:
    """Accept a ``SequenceParallelMesh``, a ProcessGroup (the SP group), a 1-D DeviceMesh, or None (one process).

    Raises:
        SeqparInputError: anything else, or a DeviceMesh with more than one dimension.
    """
    if isinstance(mesh, SequenceParallelMesh):
        return mesh
    if mesh is None:
        return SequenceParallelMesh(sp_group=None)
    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 1:
            raise SeqparInputError(
                f"a DeviceMesh with {mesh.ndim} dimensions is ambiguous; use seqpar.make_mesh or pass its SP sub-mesh"
            )
        return SequenceParallelMesh(sp_group=mesh.get_group())
    if isinstance(mesh, dist.ProcessGroup):
        return SequenceParallelMesh(sp_group=mesh)
    raise SeqparInputError(
        f"mesh must be a SequenceParallelMesh, ProcessGroup, 1-D DeviceMesh or None, not {type(mesh).__name__}"
    )
