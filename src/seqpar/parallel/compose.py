"""``seqpar.parallelize``: one model made tensor-, sequence- and data-parallel, with its memory features, in order.

torchtitan's shape: ``parallelize`` composes ``apply_*`` steps, each on the sub-mesh of its own axis.

Note [parallelize order]
    1. Tensor parallel, on the "tp" sub-mesh (``seqpar.apply_tensor_parallel``): the block projections become
       DTensors over tp, so every later step sees this rank's heads and MLP columns only.
    2. Sequence parallel, on the SP group of this rank's tp coordinate (``seqpar.prepare_model``): attention
       over the tokens of the ring x ulysses ranks, for the tp-local heads (ulysses splits them further).
    3. Memory features, module by module: activation checkpointing (flags on the decoder layers), the tiled
       MLP (a forward over chunks of tokens), then activation offload (saved-tensor hooks that move what
       checkpointing keeps, so it comes after checkpointing). They wrap what tp and sp put in place, and
       come before data parallel, whose FSDP2 units and DDP hooks take the modules as they then are.
    4. Data parallel last, over the flattened dp x sp group of this tp coordinate
       (``seqpar.apply_data_parallel``): FSDP2 shards the parameters as the steps above left them, DDP hooks
       the final parameters; gradients are summed, never averaged (Note [summed gradients]). Without a
       dp mode nothing wraps the model: the caller sums the gradients (``seqpar.reduce_gradients`` over
       ``seqpar.data_parallel_group``) or hands it to a wrapper of its own (the Hugging Face Trainer's DDP).
    Pipeline parallel is not part of it: ``seqpar.apply_pipeline_parallel`` cuts the model this returns
    (before any data-parallel wrapper; seqpar train takes --pp with --dp-mode replicate only).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from seqpar.data_parallel import apply_data_parallel
from seqpar.errors import SeqparInputError
from seqpar.memory import apply_activation_offload, apply_tiled_mlp
from seqpar.mesh import SequenceParallelMesh
from seqpar.sequence_parallel.prepare import prepare_model
from seqpar.tensor_parallel import apply_tensor_parallel

DP_MODES = (None, "ddp", "fsdp", "auto")
"""``ParallelizeOptions.dp_mode`` values: None (no wrapper), DDP, FSDP2, or "auto" (as ``apply_data_parallel``)."""


@dataclass(frozen=True)
class ParallelizeOptions:
    """What ``seqpar.parallelize`` applies besides the mesh's degrees.

    Raises:
        SeqparInputError: an unknown dp mode, optimizer offload without FSDP2, activation offload without
            activation checkpointing, or a tiled-MLP chunk below one token.
    """

    strategy: str = "auto"
    """Attention strategy, as in ``seqpar.attention`` ("auto", "ulysses", "ring", "allgather", "hybrid")."""
    layout: object = "zigzag"
    """Sequence layout, as in ``seqpar.prepare_model`` (a name, or a ``ChunkLayout``)."""
    kernel: str = "auto"
    """Local attention kernel, as in ``seqpar.attention``."""
    split_vision: bool = True
    """A multimodal model's images encoded about 1/P a rank and gathered (Note [vision split]); False: all on each."""
    dp_mode: str | None = None
    """Data parallel over dp x sp: None (no wrapper: sum gradients yourself, or let a trainer wrap), "ddp",
    "fsdp" (FSDP2) or "auto" (FSDP2 on CUDA or with ``offload_optimizer``, else DDP)."""
    offload_optimizer: bool = False
    """FSDP2's CPU offload of the sharded parameters, gradients and optimizer state (Note [optimizer offload])."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward (non-reentrant checkpointing)."""
    tiled_mlp: bool = False
    """Run each decoder MLP over chunks of ``tiled_mlp_chunk`` tokens (Note [tiled MLP])."""
    tiled_mlp_chunk: int = 1024
    """Tokens per chunk of the tiled MLP (this rank's tokens, batch and sequence together)."""
    offload_activations: bool = False
    """Keep each checkpointed layer's input in host memory until its backward (Note [checkpoint offload])."""

    def __post_init__(self) -> None:
        problems = []
        if self.dp_mode not in DP_MODES:
            problems.append(f"dp_mode must be one of {DP_MODES}, not {self.dp_mode!r}")
        elif self.offload_optimizer and self.dp_mode not in ("fsdp", "auto"):
            problems.append(f"offload_optimizer needs dp_mode 'fsdp' (FSDP2's CPU offload), not {self.dp_mode!r}")
        if self.offload_activations and not self.activation_checkpointing:
            problems.append("offload_activations moves what activation checkpointing keeps: turn that on too")
        chunk = self.tiled_mlp_chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            problems.append(f"tiled_mlp_chunk must be a positive number of tokens, got {chunk!r}")
        if problems:
            raise SeqparInputError("invalid parallelize options: " + " | ".join(problems))


def apply_sequence_parallel(model: torch.nn.Module, mesh: object, options: ParallelizeOptions) -> torch.nn.Module:
    """Sequence parallel on ``mesh``'s SP group: ``seqpar.prepare_model`` with the options' settings.

    Args:
        model: a transformers model.
        mesh: a ``SequenceParallelMesh``, the SP ProcessGroup, a 1-D DeviceMesh, or None (one process).
        options: the strategy, layout, kernel and vision split.

    Returns:
        The same model.

    Raises:
        SeqparInputError: as ``seqpar.prepare_model``.
    """
    return prepare_model(
        model,
        mesh,
        strategy=options.strategy,
        layout=options.layout,
        kernel=options.kernel,
        split_vision=options.split_vision,
    )


def apply_memory_features(model: torch.nn.Module, options: ParallelizeOptions) -> torch.nn.Module:
    """Activation checkpointing, the tiled MLP and activation offload, as ``options`` switch them on.

    Args:
        model: a transformers model.
        options: which features, and the tiled MLP's chunk.

    Returns:
        The same model.

    Raises:
        SeqparInputError: an MLP that cannot be tiled, or no decoder layers to offload.
    """
    if options.activation_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if options.tiled_mlp:
        apply_tiled_mlp(model, chunk_tokens=options.tiled_mlp_chunk)
    if options.offload_activations:  # after checkpointing, whose saved layer inputs it moves
        apply_activation_offload(model)
    return model


def _tp_size(mesh: object) -> int:
    return mesh.dims.tp_size if isinstance(mesh, SequenceParallelMesh) else 1


def parallelize(
    model: torch.nn.Module, mesh: object, *, options: ParallelizeOptions | None = None, **settings: object
) -> torch.nn.Module:
    """Apply tensor parallel, sequence parallel, the memory features and data parallel to ``model``, in that
    order, each on its own part of ``mesh`` (Note [parallelize order]).

    Collective when ``mesh`` has tp or a dp mode is set (DTensors, process groups): call it on every rank.

    Args:
        model: a transformers decoder on this rank's device (with ``offload_optimizer`` it may stay on the CPU).
        mesh: a ``SequenceParallelMesh`` from ``seqpar.make_mesh`` or ``ParallelDims.build_mesh`` (its "tp"
            axis gets tensor parallel, its SP group sequence parallel, its dp x sp ranks data parallel); or the
            SP ProcessGroup, a 1-D DeviceMesh or None, for sequence parallel alone.
        options: what to apply; default ``ParallelizeOptions()``.
        **settings: fields of ``ParallelizeOptions`` that replace those of ``options``.

    Returns:
        What to call for the forward: ``model`` itself (also under FSDP2, sharded in place), or its DDP wrapper.

    Raises:
        SeqparInputError: unknown settings, invalid options, a dp mode without a mesh from ``seqpar.make_mesh``,
            and what each step refuses (heads that tp cannot split, attention seqpar cannot serve, ...).
    """
    options = options if options is not None else ParallelizeOptions()
    unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(ParallelizeOptions)})
    if unknown:
        raise SeqparInputError(f"parallelize got unknown settings {unknown}; see seqpar.ParallelizeOptions")
    options = dataclasses.replace(options, **settings) if settings else options
    if options.dp_mode is not None and not isinstance(mesh, SequenceParallelMesh):
        raise SeqparInputError(f"dp_mode {options.dp_mode!r} needs a mesh from seqpar.make_mesh, not {mesh!r}")
    if _tp_size(mesh) > 1:
        apply_tensor_parallel(model, mesh)
    apply_sequence_parallel(model, mesh, options)
    apply_memory_features(model, options)
    if options.dp_mode is None:
        return model
    return apply_data_parallel(model, mesh, options.dp_mode, offload_optimizer=options.offload_optimizer)
