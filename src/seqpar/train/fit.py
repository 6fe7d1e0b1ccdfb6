"""Whether a training run fits in memory: ``seqpar.estimate_memory`` for a ``TrainConfig``, before ranks start.

``seqpar train`` prints the estimate and, with ``--max-memory-mb``, refuses a run predicted not to fit.
"""

from __future__ import annotations

import dataclasses

import torch

from seqpar.errors import SeqparInputError
from seqpar.memory import MemoryEstimate, estimate_memory
from seqpar.train.config import TrainConfig

_MB = 2**20
_FLAGS = {
    "checkpointing": "--activation-checkpointing",
    "chunked_loss": "--loss-chunk 1024",
    "tiled_mlp": "--tiled-mlp",
    "offload": "--offload-activations",
}


def memory_features(config: TrainConfig) -> tuple[str, ...]:
    """The memory features ``config`` switches on, as ``seqpar.estimate_memory`` names them."""
    chosen = {
        "checkpointing": config.activation_checkpointing,
        "chunked_loss": config.loss_chunk > 0,
        "tiled_mlp": config.tiled_mlp,
        "offload": config.offload_activations,
    }
    return tuple(name for name, on in chosen.items() if on)


def train_estimate(
    config: TrainConfig,
    model_config: object,
    *,
    sp: int | None = None,
    features: tuple[str, ...] | None = None,
    keep_gradients: bool = False,
) -> MemoryEstimate:
    """The per-rank estimate of one optimizer step of ``config`` (a micro-batch's activations).

    Under ``--pp`` a micro-batch is one of the pipeline's pieces of an accumulated batch, and the estimate is
    the busier of the pipeline's end ranks (Note [pipeline memory and time]).

    Under ``--precision bf16`` activations are estimated in bfloat16 and parameters too, although autocast
    keeps them in float32: a lower bound there.

    Args:
        config: the run's settings.
        model_config: the transformers config of the run's model.
        sp: another sequence-parallel degree to estimate instead of ``config.sp``.
        features: another feature set instead of the one ``config`` switches on.
        keep_gradients: gradients live between steps (``estimate_memory``'s option of that name).

    Returns:
        The ``MemoryEstimate``.

    Raises:
        SeqparInputError: settings the estimate cannot take (e.g. heads that ulysses cannot split).
    """
    sp = sp or config.sp
    padded = -(-config.seq_len // (2 * sp)) * 2 * sp  # shard_batch pads rows to a multiple of 2 x sp
    return estimate_memory(
        model_config,
        padded,
        config.dims(sp),
        dtype=torch.float32 if config.precision == "fp32" else torch.bfloat16,
        micro_batch=config.batch_size // config.grad_accum // (config.pp_microbatches or config.pp),
        features=memory_features(config) if features is None else features,
        strategy=config.strategy,
        dp_mode=config.dp_mode,
        loss_chunk=config.loss_chunk or 1024,
        mlp_chunk=config.tiled_mlp_chunk,
        keep_gradients=keep_gradients,
        offload_optimizer=config.offload_optimizer,
        pp_schedule=config.pp_schedule,
        pp_microbatches=config.pp_microbatches,
    )


def _fits(
    config: TrainConfig, model_config: object, budget: int, settings: dict | None = None, **change: object
) -> int | None:
    """The predicted peak with ``change`` (and ``settings`` changed in ``config``) when within ``budget``, else None."""
    if settings:
        config = dataclasses.replace(config, **settings)
    try:
        peak = train_estimate(config, model_config, **change).peak
    except SeqparInputError:
        return None
    return peak if peak <= budget else None


def check_memory(config: TrainConfig, model_config: object) -> str:
    """The compact estimate line; raises when ``config.max_memory_mb`` is set and the run would not fit.

    Args:
        config: the run's settings.
        model_config: the transformers config of the run's model.

    Returns:
        One line for rank 0 to print: the predicted per-rank peak and its largest parts.

    Raises:
        SeqparInputError: the predicted peak exceeds ``max_memory_mb`` (the message names the smallest sp
            that would fit at this sequence length, and the features, optimizer offload among them, that
            alone would make it fit), or
            ``max_memory_mb`` is set and the model cannot be estimated.
    """
    try:
        estimate = train_estimate(config, model_config)
    except SeqparInputError as error:
        if config.max_memory_mb:
            raise SeqparInputError(f"--max-memory-mb cannot be checked: {error}") from error
        return f"memory estimate per rank: not available ({str(error).splitlines()[-1].strip(' -')})"
    parts = (
        f"parameters {estimate.parameters / _MB:.0f}, optimizer {estimate.optimizer_state / _MB:.0f}, "
        f"activations {(estimate.checkpointed_activations + estimate.layer_transient) / _MB:.0f}, "
        f"logits {estimate.logits_loss / _MB:.0f}, communication {estimate.communication / _MB:.0f}"
    )
    line = f"memory estimate per rank: peak {estimate.peak / _MB:.0f} MiB ({parts} MiB; at the {estimate.moment})"
    if estimate.host:
        line += f"; host memory {estimate.host / _MB:.0f} MiB (offloaded)"
    limit = config.max_memory_mb
    if not limit or estimate.peak <= limit * _MB:
        return line
    budget = int(limit * _MB)
    ways = []
    sp = config.sp * 2
    while sp <= config.seq_len // 2 and sp <= 4096:
        if config.seq_len % (2 * sp) == 0 and (peak := _fits(config, model_config, budget, sp=sp)):
            ways.append(f"--sp {sp} ({peak / _MB:.0f} MiB)")
            break
        sp *= 2
    have = memory_features(config)
    for name in (f for f in _FLAGS if f not in have and (f != "offload" or torch.cuda.is_available())):
        if peak := _fits(config, model_config, budget, features=(*have, name)):
            ways.append(f"{_FLAGS[name]} ({peak / _MB:.0f} MiB)")
    offload = {"dp_mode": "fsdp", "offload_optimizer": True}
    possible = not (config.offload_optimizer or config.loss_chunk or config.tp > 1)  # fsdp takes neither
    if possible and (peak := _fits(config, model_config, budget, offload)):
        flags = "--offload-optimizer" if config.dp_mode == "fsdp" else "--dp-mode fsdp --offload-optimizer"
        ways.append(f"{flags} ({peak / _MB:.0f} MiB)")
    instead = "; would fit: " + ", or ".join(ways) if ways else "; no larger sp or single feature fits either"
    raise SeqparInputError(
        f"predicted peak {estimate.peak / _MB:.0f} MiB per rank exceeds --max-memory-mb {limit:g} "
        f"(sp {config.sp}, seq_len {config.seq_len}, features: {', '.join(have) or 'none'}){instead}"
    )
