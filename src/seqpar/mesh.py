"""The parallel degrees of a job (``ParallelDims``) and the process groups it runs on: one DeviceMesh
("pp", "dp", "ring", "ulysses", "tp") and its SP group; ``make_mesh`` builds it, ``as_sp_mesh`` takes stand-ins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from seqpar.errors import SeqparInputError

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

# torch.distributed is imported where a group is touched, not here: ParallelDims serves the planner, which loads
# no torch (Note [torch-free planning], seqpar.planning)


def _size(group: dist.ProcessGroup | None) -> int:
    import torch.distributed as dist

    return 1 if group is None else dist.get_world_size(group)


def _rank(group: dist.ProcessGroup | None) -> int:
    import torch.distributed as dist

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
    pp_group: dist.ProcessGroup | None = None
    """The ranks that hold the pipeline stages of one model replica and sequence shard (None: no "pp" axis)."""

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

    @property
    def pp_size(self) -> int:
        return _size(self.pp_group)

    @property
    def pp_rank(self) -> int:
        return _rank(self.pp_group)

    @property
    def dims(self) -> ParallelDims:
        """The degrees of this mesh: read from its DeviceMesh's axes, else from its groups (no dp, no tp)."""
        names = list(self.device_mesh.mesh_dim_names or ()) if self.device_mesh is not None else []

        def size(name: str) -> int:
            return self.device_mesh.size(names.index(name)) if name in names else 1

        return ParallelDims(
            dp_replicate_size=size("dp"),
            sp_size=self.sp_size,
            ulysses_size=self.ulysses_size,
            tp_size=size("tp"),
            pp_size=self.pp_size,
        )


def flattened_group(device_mesh: DeviceMesh, axes: list[str]) -> dist.ProcessGroup:
    """This rank's process group over the mesh axes ``axes`` taken together, ranks in ``axes`` order.

    Collective: every rank creates every such group, in the same order, so call it on every rank.

    Args:
        device_mesh: a DeviceMesh with named axes (``make_mesh`` builds one).
        axes: the axis names to flatten, outermost first (e.g. ``["ring", "ulysses"]``).

    Returns:
        The group of the ranks that share this rank's coordinates on every other axis (the default group
        when ``axes`` cover the whole world).
    """
    import torch.distributed as dist

    names = list(device_mesh.mesh_dim_names)
    others = [n for n in names if n not in axes]
    order = [names.index(n) for n in others + axes]
    size = 1
    for n in axes:
        size *= device_mesh.size(names.index(n))
    rows = device_mesh.mesh.permute(order).reshape(-1, size).tolist()
    if len(rows) == 1 and size == dist.get_world_size():
        return dist.group.WORLD
    mine = None
    for row in rows:
        group = dist.new_group(row)
        if dist.get_rank() in row:
            mine = group
    return mine


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


_DEGREES = ("dp_replicate_size", "dp_shard_size", "sp_size", "ulysses_size", "tp_size", "pp_size")


@dataclass(frozen=True)
class ParallelDims:
    """The parallel degrees of one job, in one place (torchtitan's ``ParallelDims`` is the model).

    The world is pp x dp x sp x tp ranks, with dp = dp_replicate x dp_shard and sp = ring x ulysses. The mesh
    (``build_mesh``) orders its axes pp -> dp -> ring -> ulysses -> tp, outermost first: consecutive ranks share
    tensor-parallel shards, then heads, so the most communication-hungry axes span the closest ranks, and
    pipeline stages the farthest (as Megatron and torchtitan order them: a stage boundary sends one activation
    per micro-batch, the least traffic of all).

    Raises:
        SeqparInputError: a degree that is not a positive integer, or ``ulysses_size`` not dividing ``sp_size``.
    """

    dp_replicate_size: int = 1
    """Data-parallel replicas that keep whole parameters (DDP, or the replicate part of HSDP)."""
    dp_shard_size: int = 1
    """Data-parallel replicas whose parameters FSDP2 may shard. The mesh has one "dp" axis of
    dp_replicate x dp_shard ranks; seqpar's FSDP2 shards over all dp x sp ranks of a tp coordinate."""
    sp_size: int = 1
    """Ranks that share one sequence: the sequence-parallel group, ring x ulysses ranks."""
    ulysses_size: int = 1
    """Ranks of the SP group that exchange heads by all-to-all (the "ulysses" axis); divides ``sp_size``."""
    tp_size: int = 1
    """Tensor-parallel degree: heads and MLP split over the innermost "tp" axis, before ulysses splits heads."""
    pp_size: int = 1
    """Pipeline-parallel degree: the stages on the outermost "pp" axis."""

    def __post_init__(self) -> None:
        for name in _DEGREES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SeqparInputError(f"{name} must be a positive integer, got {value!r}")
        if self.sp_size % self.ulysses_size:
            raise SeqparInputError(
                f"ulysses_size {self.ulysses_size} must divide sp_size {self.sp_size}; valid: {_divisors(self.sp_size)}"
            )

    @property
    def ring_size(self) -> int:
        """Ranks a key/value block travels around: ``sp_size / ulysses_size``."""
        return self.sp_size // self.ulysses_size

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas, each with its own rows: ``dp_replicate_size x dp_shard_size``."""
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def world_size(self) -> int:
        """Ranks in all: ``pp_size x dp_size x sp_size x tp_size``."""
        return self.pp_size * self.dp_size * self.sp_size * self.tp_size

    @property
    def mesh_axes(self) -> tuple[tuple[str, int], ...]:
        """``(name, size)`` of each mesh axis, outermost first: "pp" (when above 1), "dp", "ring", "ulysses",
        "tp" (when above 1)."""
        axes = (("dp", self.dp_size), ("ring", self.ring_size), ("ulysses", self.ulysses_size))
        if self.pp_size > 1:
            axes = (("pp", self.pp_size), *axes)
        if self.tp_size > 1:
            axes = (*axes, ("tp", self.tp_size))
        return axes

    @classmethod
    def for_world(
        cls,
        world_size: int,
        *,
        sp_size: int | None = None,
        dp_size: int | None = None,
        ulysses_size: int = 1,
        tp_size: int = 1,
        pp_size: int = 1,
        shard_dp: bool = False,
    ) -> ParallelDims:
        """The degrees of a world of ``world_size`` ranks; sp or dp, when not given, fill what the others leave.

        Args:
            world_size: ranks in the job.
            sp_size: ranks that share one sequence; default ``world_size // (pp_size * dp_size * tp_size)``.
            dp_size: data-parallel replicas; default ``world_size // (pp_size * sp_size * tp_size)``.
            ulysses_size: the all-to-all part of sp; must divide it.
            tp_size: tensor-parallel degree.
            pp_size: pipeline-parallel degree.
            shard_dp: count the replicas as ``dp_shard_size`` (FSDP2) instead of ``dp_replicate_size``.

        Returns:
            The degrees, multiplying to ``world_size``.

        Raises:
            SeqparInputError: degrees that do not divide or multiply to ``world_size``, or ulysses not dividing sp.
        """
        world = world_size
        if tp_size < 1 or world % tp_size:
            raise SeqparInputError(f"tp_size {tp_size} must divide the world size {world}")
        if pp_size < 1 or world % (pp_size * tp_size):
            raise SeqparInputError(f"pp_size {pp_size} x tp_size {tp_size} must divide the world size {world}")
        per_tp = world // (tp_size * pp_size)
        if sp_size is None:
            sp_size = per_tp // (dp_size or 1)
        if dp_size is None:
            dp_size = per_tp // sp_size if sp_size > 0 else 0
        if sp_size < 1 or ulysses_size < 1 or dp_size < 1 or pp_size * sp_size * dp_size * tp_size != world:
            pp_text = f"pp_size ({pp_size}) x " if pp_size > 1 else ""
            tp_text = f" x tp_size ({tp_size})" if tp_size > 1 else ""
            raise SeqparInputError(
                f"{pp_text}dp_size ({dp_size}) x sp_size ({sp_size}){tp_text} must equal the world size ({world}); "
                f"valid sp sizes here: {_divisors(per_tp)}"
            )
        dp = {"dp_shard_size": dp_size} if shard_dp else {"dp_replicate_size": dp_size}
        return cls(**dp, sp_size=sp_size, ulysses_size=ulysses_size, tp_size=tp_size, pp_size=pp_size)

    def check_world(self, world_size: int) -> None:
        """Raise ``SeqparInputError`` unless the degrees multiply to ``world_size``."""
        if self.world_size != world_size:
            raise SeqparInputError(
                f"pp_size ({self.pp_size}) x dp_replicate_size ({self.dp_replicate_size}) x dp_shard_size "
                f"({self.dp_shard_size}) x sp_size ({self.sp_size}) x tp_size ({self.tp_size}) = {self.world_size} "
                f"ranks, but the world size is {world_size}"
            )

    def build_mesh(self, device_type: str | None = None) -> SequenceParallelMesh:
        """This rank's mesh over the initialised default group, axes as ``mesh_axes`` (collective).

        Args:
            device_type: "cpu" or "cuda"; defaults to "cuda" under NCCL and "cpu" otherwise.

        Returns:
            A ``SequenceParallelMesh`` whose SP group is this rank's ring x ulysses ranks.

        Raises:
            SeqparInputError: no initialised process group, or degrees that do not multiply to its world size.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        _check_initialised()
        self.check_world(dist.get_world_size())
        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        names, shape = zip(*self.mesh_axes)
        return _from_device_mesh(init_device_mesh(device_type, shape, mesh_dim_names=names))


def _check_initialised() -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise SeqparInputError(
            "make_mesh needs an initialised default process group (torchrun, or dist.init_process_group)"
        )


def make_mesh(
    sp_size: int | None = None,
    *,
    ulysses_size: int = 1,
    dp_size: int | None = None,
    tp_size: int = 1,
    pp_size: int = 1,
    device_type: str | None = None,
    device_mesh: DeviceMesh | None = None,
) -> SequenceParallelMesh:
    """Build the sequence-parallel mesh over all ranks of the initialised default group, or over ``device_mesh``.

    The degrees become a ``ParallelDims`` (``ParallelDims.for_world``) and its ``build_mesh`` lays out the
    DeviceMesh: axes ("dp", "ring", "ulysses"), with "pp" first when ``pp_size > 1`` and "tp" last when
    ``tp_size > 1`` (the order of ``ParallelDims``). The SP group of a rank is the ring x ulysses ranks with its
    pp, dp and tp coordinates.

    Args:
        sp_size: ranks that share one sequence; defaults to ``world_size // (pp_size * dp_size * tp_size)``.
        ulysses_size: how many of them exchange heads by all-to-all; must divide ``sp_size``.
        dp_size: data-parallel replicas; defaults to ``world_size // (pp_size * sp_size * tp_size)``.
        tp_size: tensor-parallel degree ("tp" axis; heads are split over it before ulysses splits them).
        pp_size: pipeline-parallel degree ("pp" axis; ``seqpar.apply_pipeline_parallel`` puts the stages on it).
        device_type: "cpu" or "cuda"; defaults to "cuda" under NCCL and "cpu" otherwise.
        device_mesh: an existing DeviceMesh whose dimension names are among "pp", "dp", "ring", "ulysses", "sp"
            (a flat SP axis) and "tp"; the other arguments are then read from it.

    Returns:
        A ``SequenceParallelMesh`` for this rank.

    Raises:
        SeqparInputError: no initialised process group, degrees that do not multiply to the world size, or a
            DeviceMesh with unknown dimension names.
    """
    import torch.distributed as dist

    _check_initialised()
    if device_mesh is not None:
        return _from_device_mesh(device_mesh)
    dims = ParallelDims.for_world(
        dist.get_world_size(),
        sp_size=sp_size,
        dp_size=dp_size,
        ulysses_size=ulysses_size,
        tp_size=tp_size,
        pp_size=pp_size,
    )
    return dims.build_mesh(device_type)


_KNOWN_DIMS = ("pp", "dp", "ring", "ulysses", "sp", "tp")


def _from_device_mesh(device_mesh: DeviceMesh) -> SequenceParallelMesh:
    names = list(device_mesh.mesh_dim_names or ())
    if len(names) != device_mesh.ndim or any(n not in _KNOWN_DIMS for n in names):
        raise SeqparInputError(f"DeviceMesh dimension names must be among {_KNOWN_DIMS}; got {names}")
    if "sp" in names and ("ring" in names or "ulysses" in names):
        raise SeqparInputError("a DeviceMesh has either an 'sp' axis or 'ring'/'ulysses' axes, not both")
    sp_dims = ["sp"] if "sp" in names else [n for n in ("ring", "ulysses") if n in names]
    if not sp_dims:
        raise SeqparInputError(f"the DeviceMesh has no sequence-parallel axis ('sp', 'ring' or 'ulysses'): {names}")
    has_ulysses = "ulysses" in names and device_mesh.size(names.index("ulysses")) > 1
    ring_dim = "sp" if "sp" in names else ("ring" if "ring" in names else None)
    return SequenceParallelMesh(
        sp_group=flattened_group(device_mesh, sp_dims),
        ring_group=device_mesh.get_group(ring_dim) if ring_dim is not None else None,
        ulysses_group=device_mesh.get_group("ulysses") if has_ulysses else None,
        device_mesh=device_mesh,
        pp_group=device_mesh.get_group("pp") if "pp" in names and device_mesh.size(names.index("pp")) > 1 else None,
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
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

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
