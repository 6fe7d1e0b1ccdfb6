"""accelerate's ``ParallelismConfig`` read as seqpar settings: the degrees users already write, as one mesh.

Accepted from ``TrainingArguments(parallelism_config=...)``, ``Accelerator(parallelism_config=...)`` or the
environment ``accelerate launch`` exports for a YAML's ``parallelism_config:`` section.

Note [accelerate's ParallelismConfig]
    accelerate (1.15) describes a job by degrees whose product is the world size:
    ``dp_replicate_size x dp_shard_size x cp_size x sp_size x tp_size``. Upstream runs ``sp_size`` on
    DeepSpeed's Ulysses (``sp_backend="deepspeed"``, the only one) and ``cp_size`` on torch's
    ``context_parallel`` (``cp_backend="torch"``). seqpar reads the same degrees and splits the sequence
    itself, on CPUs and GPUs, with neither engine:

    - ``sp_size``: the Ulysses degree (heads exchanged by all-to-all); strategy "ulysses".
    - ``cp_size``: the ring degree. ``cp_handler.cp_comm_strategy`` "allgather" (the default) gathers the
      keys and values once (strategy "allgather"); "alltoall" is torch's rotation of key/value shards from
      rank to rank, which is seqpar's "ring".
    - both above 1 (accelerate's own class refuses that; a config that allows it is read as): Ulysses inside
      ``sp_size`` ranks x a ring of ``cp_size`` (strategy "hybrid").
    - ``dp_replicate_size`` x ``dp_shard_size``: the data-parallel replicas, each with its own rows. The
      gradient reduction is the door's: DDP, or FSDP2 where the launch enables it (a YAML's
      ``distributed_type: FSDP`` on GPUs, or a model loaded with ``DistributedConfig(fsdp_size=world)``);
      both reduce over every process, which the exact loss accounts for (Note [exact loss under the
      Trainer]). Sharding changes memory only, never the numbers.
    - ``tp_size`` > 1: refused in the Hugging Face doors (``seqpar train --tp`` and
      ``seqpar.apply_tensor_parallel`` take tensor parallel).
    - ``sp_handler.sp_attn_implementation``: seqpar's attention replaces the model's; "sdpa", "eager",
      "flash_attention_2" and "flash_attention_3" all run seqpar's attention with the fastest local kernel
      available (``kernel="auto"``); another value (a hub kernel) is refused.
    - ``sp_handler.sp_seq_length_is_variable=False`` with ``sp_seq_length=N``: every batch must be N tokens
      wide, checked on every rank; True (the default): any width.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from seqpar.errors import SeqparInputError
from seqpar.hf.config import SequenceParallelConfig
from seqpar.mesh import ParallelDims

ENVIRONMENT_SWITCH = "ACCELERATE_USE_PARALLELISM_CONFIG"
"""The variable ``accelerate launch`` sets to "true" when the YAML has a ``parallelism_config:`` section."""

LOCAL_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
"""``sp_attn_implementation`` values that seqpar's own attention stands in for."""


@dataclasses.dataclass(frozen=True)
class ParallelismPlan:
    """What a job's settings mean for seqpar: the sequence split, the replicas, and what each batch must be.

    Attributes:
        sequence_parallel: the sequence-parallel settings (degree, Ulysses part, strategy, layout, kernel).
        dims: the job's degrees (replicas x sequence split; no tp or pp in the Hugging Face doors).
        parallelism_config: the accelerate config it was read from, or None (``sequence_parallel=`` alone).
    """

    sequence_parallel: SequenceParallelConfig
    dims: ParallelDims = dataclasses.field(default_factory=ParallelDims)
    parallelism_config: object | None = None

    @property
    def dp_replicate_size(self) -> int:
        """Data-parallel replicas that keep whole parameters (accelerate's name)."""
        return self.dims.dp_replicate_size

    @property
    def dp_shard_size(self) -> int:
        """Data-parallel replicas whose parameters FSDP2 may shard (accelerate's name)."""
        return self.dims.dp_shard_size

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: ``dp_replicate_size x dp_shard_size``."""
        return self.dims.dp_size


def parallelism_from_environment() -> object | None:
    """accelerate's ``ParallelismConfig`` from the environment ``accelerate launch`` exported, if it did.

    Returns:
        ``ParallelismConfig()`` (which reads the ``PARALLELISM_CONFIG_*`` variables) when
        ``ACCELERATE_USE_PARALLELISM_CONFIG`` is "true", else None.
    """
    if os.environ.get(ENVIRONMENT_SWITCH, "false").lower() != "true":
        return None
    from accelerate import ParallelismConfig

    return ParallelismConfig()


@contextlib.contextmanager
def hidden_parallelism_environment() -> Iterator[None]:
    """Hide ``ACCELERATE_USE_PARALLELISM_CONFIG`` while an ``accelerate.Accelerator`` is built.

    accelerate builds its own ``ParallelismConfig`` from the environment when that variable is "true" and would
    then set up DeepSpeed's Ulysses or torch's context parallel over the same ranks; seqpar has read the degrees
    already (``plan_parallelism``) and splits the sequence itself. The variable is restored on exit.
    """
    saved = os.environ.pop(ENVIRONMENT_SWITCH, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[ENVIRONMENT_SWITCH] = saved


def _size(config: object, name: str) -> int:
    value = getattr(config, name, None)
    value = 1 if value is None else value
    if not isinstance(value, int) or value < 1:
        raise SeqparInputError(f"parallelism_config.{name} must be a positive integer, got {value!r}")
    return value


def _from_accelerate(config: object) -> tuple[SequenceParallelConfig, ParallelDims]:
    """The sequence-parallel settings and the degrees of one accelerate config (Note above)."""
    sizes = {n: _size(config, n) for n in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")}
    problems = []
    if sizes["tp_size"] > 1:
        problems.append(
            f"tp_size={sizes['tp_size']}: tensor parallel is not part of the Hugging Face doors; use seqpar train --tp "
            "or seqpar.apply_tensor_parallel in your own loop, or set tp_size=1"
        )
    cp_handler, sp_handler = getattr(config, "cp_handler", None), getattr(config, "sp_handler", None)
    comm = getattr(cp_handler, "cp_comm_strategy", None) or "allgather"
    if sizes["cp_size"] > 1 and comm not in ("allgather", "alltoall"):
        problems.append(f"cp_comm_strategy={comm!r}: choose 'allgather' or 'alltoall'")
    attn = getattr(sp_handler, "sp_attn_implementation", None)
    if sizes["sp_size"] > 1 and attn is not None and attn not in LOCAL_ATTENTION:
        problems.append(
            f"sp_attn_implementation={attn!r}: seqpar's attention replaces the model's and runs its own local kernels "
            f"(it stands in for {', '.join(LOCAL_ATTENTION)}); hub kernels are not loaded"
        )
    seq_length = None
    if sizes["sp_size"] > 1 and getattr(sp_handler, "sp_seq_length_is_variable", True) is False:
        raw = getattr(sp_handler, "sp_seq_length", None)
        try:
            seq_length = int(raw)
        except (TypeError, ValueError):
            problems.append(f"sp_seq_length_is_variable=False needs sp_seq_length, got {raw!r}")
    if problems:
        raise SeqparInputError("seqpar cannot honour this parallelism_config: " + " | ".join(problems))
    ulysses, ring = sizes["sp_size"], sizes["cp_size"]
    if ulysses > 1 and ring > 1:
        strategy = "hybrid"
    elif ring > 1:
        strategy = "allgather" if comm == "allgather" else "ring"
    elif ulysses > 1:
        strategy = "ulysses"
    else:
        strategy = "auto"
    sequence = SequenceParallelConfig(
        sp_size=ulysses * ring, ulysses_size=ulysses, strategy=strategy, seq_length=seq_length
    )
    dims = ParallelDims(
        dp_replicate_size=sizes["dp_replicate_size"],
        dp_shard_size=sizes["dp_shard_size"],
        sp_size=ulysses * ring,
        ulysses_size=ulysses,
    )
    return sequence, dims


def _fewer_processes_hint(world_size: int) -> str:
    """How to fix a job of ``world_size`` processes that a launcher started with more (torchrun's WORLD_SIZE).

    accelerate on a machine without GPUs runs torchrun's processes as separate one-process jobs unless it is
    told to use the CPU; the launcher's count says so, and every rank reads the same.
    """
    launched = os.environ.get("WORLD_SIZE", "")
    if launched.isdigit() and int(launched) > world_size:
        return (
            f"the launcher started {launched} processes, but accelerate runs them as jobs of {world_size}: on a "
            "machine without GPUs it joins them only when told to use the CPU, Accelerator(cpu=True) (or "
            "`accelerate launch --cpu`)"
        )
    return "make the degrees multiply to the number of processes"


def plan_parallelism(
    sequence_parallel: SequenceParallelConfig | None,
    parallelism_config: object | None,
    world_size: int,
) -> ParallelismPlan:
    """Combine ``sequence_parallel=`` and accelerate's ``parallelism_config`` into one plan for ``world_size``.

    Reads only settings that every rank holds alike, so every rank raises the same error.

    Args:
        sequence_parallel: seqpar's own settings, or None.
        parallelism_config: an ``accelerate.ParallelismConfig`` (from the arguments or the environment), or None.
        world_size: processes in the job.

    Returns:
        The plan. With ``parallelism_config`` alone its degrees set the sequence split and the replicas; with
        both, ``sequence_parallel`` supplies the strategy, layout and kernel for the same degrees.

    Raises:
        SeqparInputError: degrees that do not multiply to ``world_size``; both given with different degrees;
            settings seqpar cannot honour (tensor parallel, hub attention kernels, a fixed width without one).
    """
    if parallelism_config is None:
        sequence = sequence_parallel if sequence_parallel is not None else SequenceParallelConfig()
        return ParallelismPlan(sequence, sequence.dims(world_size))
    derived, dims = _from_accelerate(parallelism_config)
    if dims.world_size != world_size:
        raise SeqparInputError(
            f"parallelism_config asks for dp_replicate_size ({dims.dp_replicate_size}) x dp_shard_size "
            f"({dims.dp_shard_size}) x cp_size x sp_size ({dims.sp_size}) = {dims.world_size} processes, but the job "
            f"has {world_size}; {_fewer_processes_hint(world_size)}"
        )
    if sequence_parallel is not None:
        mine = (sequence_parallel.sp_size or world_size, sequence_parallel.ulysses_size)
        theirs = (derived.sp_size, derived.ulysses_size)
        if mine != theirs:
            raise SeqparInputError(
                f"sequence_parallel=SequenceParallelConfig(sp_size={mine[0]}, ulysses_size={mine[1]}) and "
                f"parallelism_config (sequence split over {theirs[0]} ranks, Ulysses over {theirs[1]}) disagree; "
                "give one of them, or the same degrees in both"
            )
        if derived.seq_length is not None and sequence_parallel.seq_length is None:
            sequence_parallel = dataclasses.replace(sequence_parallel, seq_length=derived.seq_length)
        derived = sequence_parallel
    return ParallelismPlan(derived, dims, parallelism_config)


def accelerate_device_mesh(config: object, device_type: str) -> DeviceMesh:
    """A DeviceMesh with accelerate's dimension names for ``config`` (``ParallelismConfig.build_device_mesh``).

    Args:
        config: accelerate's ``ParallelismConfig`` (with sp or cp above 1).
        device_type: "cpu" or "cuda".

    Returns:
        The mesh over ``dp_replicate``, ``dp_shard``, ``cp``, ``sp`` (those above 1), with accelerate's flattened
        ``dp``, ``dp_shard_cp`` and ``dp_cp``.
    """
    sizes = {n: getattr(config, f"{n}_size") for n in ("dp_replicate", "dp_shard", "cp", "sp")}
    names = tuple(n for n, s in sizes.items() if s > 1)
    mesh = init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=names)
    # DeviceMesh._flatten is how accelerate itself makes these joint axes
    joint = {"dp": config.dp_dim_names, "dp_shard_cp": config.dp_shard_cp_dim_names, "dp_cp": config.dp_cp_dim_names}
    for flat, dims in joint.items():
        if dims:
            mesh[tuple(dims)]._flatten(flat)
    return mesh
