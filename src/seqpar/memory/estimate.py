"""Per-rank memory of one training step, predicted from a transformers config (Note [memory estimate]).

``seqpar estimate``, ``seqpar train --max-memory-mb`` and ``seqpar bench maxlen`` all ask ``estimate_memory``.

Note [memory estimate]
    Notation, per rank: T = micro_batch x seq_len / sp tokens, H hidden size, Hq = heads x head_dim,
    Hkv = kv_heads x head_dim (both divided by tp), I intermediate size (divided by tp), V vocab, L layers,
    b bytes of ``dtype``. A Llama-style decoder layer (RMSNorm, q/k/v/o projections, rotary embedding,
    seqpar attention, gated MLP) keeps for its backward, per token, besides its input (H): both norms'
    normalised and weighted outputs and the attention residual sum (4H, counting the sum once), rotated q,
    the attention output and its row-major copy for o_proj (3Hq), k and v (2Hkv), and in the MLP gate, up,
    silu(gate) and their product (4I): 4H + 3Hq + 2Hkv + 4I elements (counted with saved-tensor hooks on
    one layer; the check against a real layer is in docs/benchmarks.md, "Longest sequence in a memory budget").
    An expert layer keeps 2kH more, k the experts a token is routed to (Note [mixture-of-experts sizes]).
    MLA attention (DeepSeek-V2/V3, MiniCPM3; Note [MLA sizes]: Hq = heads x d_qk, the padded head size
    seqpar's attention runs, Hv = heads x d_v, r_q and r_kv the query and key/value latent ranks, d_rope the
    rotary columns) keeps, in place of the Llama attention's terms: 5H (the norms and the residual sum), 4Hq
    (the attention kernel's queries, expanded keys, padded values and padded output), Hv (o_proj's input)
    and 3 (r_q + r_kv + d_rope) (each latent projection's output, its normalised and weighted copies, the
    rotary key columns and their rotation): 5H + 4Hq + Hv + 3 (r_q + r_kv + d_rope) + 4I elements per token
    (counted with saved-tensor hooks on a dense-MLP DeepSeek-V3 layer under ``prepare_model`` on the CPU;
    ``tests/test_estimate.py`` checks it within 5% at two widths, with and without the query bottleneck;
    the log-sum-exp and the norms' statistics, a few elements, are left out). The attention's communication
    buffers are those of Hq-wide q, k and v (the values padded, Note [value head size]).
    * no checkpointing: every layer keeps input + saved tensors; the backward starts at the loss;
    * checkpointing: each layer keeps its input only; the backward of a layer recomputes its saved tensors
      and, while the MLP's gradients are formed, holds about one more I-sized and one H-sized tensor per
      token (calibrated once, with gradients kept between steps: the step's peak grows 31.3 KiB/token for
      4 x 256 / 768 between 4K and 8K tokens, 31.0 predicted);
    * tiled MLP: the 4I saved tensors and the extra I exist for one chunk of tokens at a time (5 x chunk
      x I), while the MLP's input gradient accumulates over chunks (H per token);
    * offload: the checkpointed inputs leave the device (two layers in flight); on the CPU it does nothing.
    Logits: whole logits keep the [T, V] float32 log-softmax, and the loss backward adds the loss's and the
    log-softmax's gradients (3 x T x V x 4 bytes at the start of the backward, before the output head's
    weight gradient exists). Chunked loss: the same for one chunk, plus the [T, H] hidden-state gradient
    and the output head's weight gradient, accumulated in one buffer from the first piece on. On a
    pipeline's last rank, whole logits of several micro-batches may be held (Note [pipeline memory and time]).
    Attention is a flash kernel (no [S, S] scores). Its communication buffers live during the attention's
    forward and backward, when the layer's MLP tensors are not alive, so a layer's transient is the larger of
    the MLP moment and the attention moment (its saved tensors plus these buffers). Per layer: ulysses sends
    contiguous copies of q, k, v and receives them head-sharded (Hq + 2Hkv per token, each way; under an
    uneven head split, Note [uneven heads], the busiest rank receives P ceil(H/P) query heads' worth, its
    shared KV heads, and their copies up to its query heads where they fall unevenly); ring keeps
    a receive buffer for k and v and, in the backward, for dk and dv (4 Hkv per token, double-buffered);
    allgather gathers the whole sequence's k and v (2 Hkv x sp per token, twice in the backward). The gradient
    all-reduce over dp x sp copies the small gradients into buckets of ``reduce_gradients``'s bucket size
    (the large ones are summed in place), so it adds at most one bucket.
    Parameters and gradients are in ``dtype``; AdamW keeps two states per parameter, and its update (tensor
    by tensor on the CPU) makes temporaries of the largest parameter. Gradients either exist only during
    the step (``zero_grad(set_to_none=True)``: they grow layer by layer in the backward) or live between
    steps (``keep_gradients``: zeroed in place, as DDP and FSDP keep their buffers). The peak is the largest of four
    moments: the start of the backward, one layer's backward (kept activations, the recomputed layer, the
    gradients so far), the gradient all-reduce, and the optimizer update.
    Only the extra I above is calibrated; nothing is fitted to the points of docs/guides/memory.md.
    Optimizer offload (``offload_optimizer``, FSDP2's CPU offload, Note [optimizer offload] in
    data_parallel/wrappers.py): the sharded parameters, their gradients and the optimizer state live in
    host memory (counted there as fp32 master parameters, fp32 gradients and fp32 states, 4 bytes each,
    divided over dp x sp, whatever ``dtype`` is) and the update runs on the CPU, so the "optimizer" moment
    leaves the device. On the device stay ``dtype`` working copies (units as Note [FSDP2 units]): two
    decoder blocks gathered at a time (the one running and the one prefetched) and their unsharded
    gradients (the one being formed, the one in its reduce-scatter and device-to-host copy), the root's
    parameters (the final norm) from the forward to the end of the backward, and the output head's from its
    forward through its backward (the "backward start" moment). A tied embedding and head stay in the root,
    gathered all step, their gradient waiting there until the backward ends. The embedding's gather at the
    very end of the backward meets no activations and is left out. Nothing of the model lives on the device
    between steps; kept gradients stay on the host.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import TYPE_CHECKING

from seqpar.errors import SeqparInputError
from seqpar.memory.dtypes import dtype_bytes
from seqpar.memory.pipeline import stage_views
from seqpar.memory.rank import OPTIMIZER_STATES, estimate_rank
from seqpar.memory.result import MemoryEstimate
from seqpar.memory.vision import VisionSizes
from seqpar.mesh import ParallelDims
from seqpar.models import ModelSizes
from seqpar.models.sizes import unmodelled_sizes
from seqpar.sequence_parallel.selection import select_strategy
from seqpar.sequence_parallel.strategies.registry import STRATEGIES

if TYPE_CHECKING:
    import torch

FEATURES = ("checkpointing", "chunked_loss", "tiled_mlp", "offload")
_RANK_SETTINGS = ("dp_mode", "loss_chunk", "mlp_chunk", "optimizer", "keep_gradients", "offload_optimizer")
"""``estimate_memory``'s settings that ``estimate_rank`` takes as they are."""


def _check(seq_len: int, s: SimpleNamespace, features: tuple[str, ...]) -> None:
    """Raise one ``SeqparInputError`` listing every setting of ``s`` (``estimate_memory``'s) that cannot work.

    The degrees come from a ``ParallelDims``, which has checked them (positive, ulysses dividing sp).
    """
    problems = [f"unknown feature {f!r}; choose from {', '.join(FEATURES)}" for f in features if f not in FEATURES]
    if s.micro_batch < 1 or seq_len < 1:
        problems.append("seq_len and micro_batch must be at least 1")
    elif not problems and seq_len % s.sp_size:
        problems.append(f"seq_len {seq_len} must be divisible by sp_size {s.sp_size}")
    if s.strategy not in STRATEGIES:
        problems.append(f"unknown strategy {s.strategy!r}; choose one of {', '.join(STRATEGIES)}")
    try:
        dtype_bytes(s.dtype)
    except SeqparInputError as error:
        problems.append(str(error))
    if s.optimizer not in OPTIMIZER_STATES:
        problems.append(f"unknown optimizer {s.optimizer!r}; choose from {', '.join(OPTIMIZER_STATES)}")
    if s.dp_mode not in ("replicate", "ddp", "fsdp"):
        problems.append(f"dp_mode must be replicate, ddp or fsdp, not {s.dp_mode!r}")
    elif s.offload_optimizer and s.dp_mode != "fsdp":
        problems.append(f"offload_optimizer needs dp_mode 'fsdp' (FSDP2's CPU offload), not {s.dp_mode!r}")
    if problems:
        raise SeqparInputError("cannot estimate memory:\n  - " + "\n  - ".join(problems))


def estimate_memory(
    model_config: object,
    seq_len: int,
    dims: ParallelDims,
    *,
    dtype: torch.dtype | str = "fp32",
    micro_batch: int = 1,
    features: tuple[str, ...] | list[str] = (),
    strategy: str = "auto",
    optimizer: str = "adamw",
    dp_mode: str = "replicate",
    loss_chunk: int = 1024,
    mlp_chunk: int = 1024,
    keep_gradients: bool = False,
    offload_optimizer: bool = False,
    pp_schedule: str = "1f1b",
    pp_microbatches: int | None = None,
    vision_patches: int = 0,
    split_vision: bool = True,
) -> MemoryEstimate:
    """Predict one rank's memory during one training step (forward, backward, gradient sum, optimizer).

    Analytic, from the config's sizes (Note [memory estimate]); nothing is allocated.

    Args:
        model_config: a transformers decoder config (LlamaConfig, Qwen2Config, ...) or a dict of its fields.
        seq_len: tokens of one whole sequence (before it is split over sp ranks).
        dims: the parallel degrees, a ``seqpar.ParallelDims``: ``sp_size`` (sequence parallel), ``ulysses_size``
            (the all-to-all part of sp, hybrid), ``dp_size`` (``dp_replicate_size x dp_shard_size``: the replicas
            the data-parallel group spans; ``dp_mode`` says whether they shard), ``tp_size`` (heads and MLP split)
            and ``pp_size`` (above 1, the estimate is the busier of the pipeline's first and last rank, Note
            [pipeline memory and time], and ``micro_batch`` is one pipeline micro-batch's rows).
        dtype: dtype of parameters, gradients and activations: a torch dtype, or its name ("bf16", "fp16",
            "fp32"; the estimate then loads no torch).
        micro_batch: sequences per micro-batch.
        features: any of "checkpointing", "chunked_loss", "tiled_mlp", "offload".
        strategy: attention strategy ("auto" resolved by ``select_strategy``, without a mask).
        optimizer: "adamw" (two states per parameter), "adam" or "sgd" (none).
        dp_mode: "replicate", "ddp" or "fsdp" (parameters, gradients and state sharded over dp x sp).
        loss_chunk: tokens per piece of the chunked loss.
        mlp_chunk: tokens per chunk of the tiled MLP.
        keep_gradients: gradients live between steps (zeroed in place, not freed): counted in
            ``between_steps`` and whole at every moment of the step.
        offload_optimizer: parameters, gradients and optimizer state in host memory, the update on the CPU
            (``apply_data_parallel(..., offload_optimizer=True)``; needs dp_mode "fsdp"): the device keeps
            working copies of the layers in flight, and ``host`` reports what moved.
        pp_schedule: "gpipe", "1f1b" or "interleaved" (how many micro-batches a stage holds in flight).
        pp_microbatches: micro-batches per pipeline step (default ``dims.pp_size``).
        vision_patches: a multimodal config's vision patches of one micro-batch (``sum(t x h x w)`` of its
            image and video grids): the vision tower's parameters and activations are then counted too
            (Note [vision tower memory]).
        split_vision: the tower runs on about 1/sp of the patches on each rank (Note [vision split]), as
            ``prepare_model(split_vision=True)`` does; False: on all of them.

    Returns:
        The ``MemoryEstimate``: bytes by category, the peak and the moment that sets it.

    Raises:
        SeqparInputError: ``dims`` not a ``ParallelDims``, an unknown dtype, feature, strategy, optimizer or
            dp_mode, seq_len or micro_batch below 1, a seq_len not divisible by ``dims.sp_size``, heads that the
            ulysses degree (or tp) cannot split, a config without sizes, ``offload_optimizer`` without dp_mode
            "fsdp", pipeline settings that cannot work (fewer layers than stages, fewer micro-batches than
            ``dims.pp_size``, an unknown schedule), ``vision_patches`` with a config whose vision tower seqpar
            does not count, or with pipeline parallel.
    """
    settings = {k: v for k, v in locals().items() if k not in ("model_config", "seq_len", "dims")}
    return max(_stage_estimates(model_config, seq_len, dims, settings), key=lambda e: e.peak)


def estimate_stage_memory(
    model_config: object, seq_len: int, dims: ParallelDims, **settings: object
) -> list[MemoryEstimate]:
    """``estimate_memory`` for each end of the pipeline: the first pp rank's estimate, then the last's.

    ``estimate_memory`` returns the larger of the two; ``python -m benchmarks.pipeline`` compares each with the rank
    it measures.

    Args:
        model_config: as ``estimate_memory``.
        seq_len: as ``estimate_memory``.
        dims: as ``estimate_memory``: the parallel degrees, a ``seqpar.ParallelDims``.
        **settings: ``estimate_memory``'s keyword arguments.

    Returns:
        Two ``MemoryEstimate``s (first rank, last rank), or one when ``dims.pp_size`` is 1.

    Raises:
        SeqparInputError: as ``estimate_memory``.
    """
    bound = inspect.signature(estimate_memory).bind(model_config, seq_len, dims, **settings)  # names checked
    bound.apply_defaults()
    given = {k: v for k, v in bound.arguments.items() if k not in ("model_config", "seq_len", "dims")}
    return _stage_estimates(model_config, seq_len, dims, given)


def _stage_estimates(model_config: object, seq_len: int, dims: ParallelDims, settings: dict) -> list[MemoryEstimate]:
    """The estimates of ``dims`` and ``estimate_memory``'s keyword ``settings`` (all given), one per pipeline end."""
    if not isinstance(dims, ParallelDims):
        raise SeqparInputError(
            f"cannot estimate memory: dims must be a seqpar.ParallelDims, not {type(dims).__name__} ({dims!r}); "
            "e.g. seqpar.ParallelDims(sp_size=4, ulysses_size=2, dp_replicate_size=2)"
        )
    sizes = {
        "sp_size": dims.sp_size,
        "ulysses_size": dims.ulysses_size,
        "dp_size": dims.dp_size,
        "tp_size": dims.tp_size,
    }
    s = SimpleNamespace(**settings, **sizes, pp_size=dims.pp_size)
    features = tuple(s.features)
    _check(seq_len, s, features)
    d = ModelSizes.from_config(model_config, s.tp_size)
    unmodelled = unmodelled_sizes(model_config)
    if unmodelled:
        raise SeqparInputError(f"cannot estimate memory: {unmodelled}")
    vision = _vision(model_config, s, dtype_bytes(s.dtype)) if s.vision_patches else (0, 0)
    rank = dict(
        chosen=select_strategy(s.strategy, d.num_attention_heads, d.num_key_value_heads, s.sp_size, s.ulysses_size),
        b=dtype_bytes(s.dtype),
        tokens=s.micro_batch * seq_len // s.sp_size,
        features=features,
        sizes=sizes,
        vision=vision,
        rows=s.micro_batch,
        **{k: settings[k] for k in _RANK_SETTINGS},
    )
    views = stage_views(d.num_hidden_layers, s.pp_size, s.pp_schedule, s.pp_microbatches)
    return [estimate_rank(d, view, s.pp_size > 1, **rank) for view in views]


def _vision(model_config: object, s: SimpleNamespace, b: int) -> tuple[int, int]:
    """(parameters, kept activation bytes) of the vision tower on one rank (Note [vision tower memory])."""
    if s.vision_patches < 0:
        raise SeqparInputError(f"cannot estimate memory: vision_patches must be >= 0, not {s.vision_patches}")
    if s.pp_size > 1:
        raise SeqparInputError("cannot estimate memory: vision_patches is counted without pipeline parallel only")
    vision = VisionSizes.from_config(model_config)
    patches = -(-s.vision_patches // s.sp_size) if s.split_vision else s.vision_patches
    return vision.num_params(), vision.kept_bytes(patches, b, "checkpointing" in s.features)
