"""What a sequence-parallel Hugging Face run is configured with, and the Trainer / SFTConfig options it refuses.

Every check here reads only settings that are the same on every rank, so all ranks raise the same error.
"""

from __future__ import annotations

from dataclasses import dataclass

from seqpar.errors import SeqparInputError
from seqpar.mesh import ParallelDims
from seqpar.parallel import ParallelizeOptions
from seqpar.sequence_parallel.layouts.chunks import layout_names
from seqpar.sequence_parallel.strategies import STRATEGIES

TRAINER_LAYOUTS = layout_names()
"""The layouts a ``SequenceParallelConfig`` takes: every name of the layout registry (Note [layout registry])."""


@dataclass(frozen=True)
class SequenceParallelConfig:
    """How the ranks of a ``torchrun`` / ``accelerate launch`` job split each sequence.

    The world is dp x sp: ``sp_size`` ranks share every sequence and the data-parallel degree is derived
    (world size / ``sp_size``). ``per_device_train_batch_size`` counts the sequences of one *data-parallel
    replica*: the ``sp_size`` ranks of a group all hold the same rows, each a ``1/sp_size`` shard of the tokens.

    Attributes:
        sp_size: ranks that share one sequence; None: every rank of the job (no data parallel).
        ulysses_size: how many of them exchange heads by all-to-all (the rest form a ring); divides ``sp_size``.
        strategy: "auto", "ulysses", "ring", "allgather" or "hybrid" (as in ``seqpar.attention``).
        layout: "zigzag" (even causal work on unpacked rows), "contiguous", or "balanced": each batch's own
            layout, solved from its packed documents so every rank gets equal attention work (Note [balanced
            layout]); "placed" (the row reordered so short documents stay whole, Note [placed layout]); or "auto"
            ("placed" on packed rows, else "balanced", per batch); the shards carry it to the model call.
        kernel: the local attention kernel, as in ``seqpar.attention`` ("auto" picks the fastest available).
        seq_length: the width every batch must have (checked on every rank), or None for any width; accelerate's
            ``sp_seq_length`` with ``sp_seq_length_is_variable=False``.
        split_vision: a vision-language model's images encoded about 1/P on each rank of a group and the
            features all-gathered (Note [vision split]); False: every rank encodes every image.
    """

    sp_size: int | None = None
    ulysses_size: int = 1
    strategy: str = "auto"
    layout: str = "zigzag"
    kernel: str = "auto"
    seq_length: int | None = None
    split_vision: bool = True

    def __post_init__(self) -> None:
        if self.sp_size is not None and (not isinstance(self.sp_size, int) or self.sp_size < 1):
            raise SeqparInputError(f"sp_size must be a positive integer or None, got {self.sp_size!r}")
        if not isinstance(self.ulysses_size, int) or self.ulysses_size < 1:
            raise SeqparInputError(f"ulysses_size must be a positive integer, got {self.ulysses_size!r}")
        if self.sp_size is not None:
            ParallelDims(sp_size=self.sp_size, ulysses_size=self.ulysses_size)  # ulysses divides sp
        if self.strategy not in STRATEGIES:
            raise SeqparInputError(f"unknown strategy {self.strategy!r}; choose one of {STRATEGIES}")
        if self.layout not in TRAINER_LAYOUTS:
            raise SeqparInputError(f"unknown layout {self.layout!r}; choose one of {TRAINER_LAYOUTS}")
        if self.seq_length is not None and (not isinstance(self.seq_length, int) or self.seq_length < 1):
            raise SeqparInputError(f"seq_length must be a positive integer or None, got {self.seq_length!r}")
        if not isinstance(self.split_vision, bool):
            raise SeqparInputError(f"split_vision must be True or False, got {self.split_vision!r}")

    def dims(self, world_size: int) -> ParallelDims:
        """The degrees of a job of ``world_size`` processes: ``sp_size`` (None: all of them) x the replicas left.

        Args:
            world_size: processes in the job.

        Returns:
            ``ParallelDims`` with ``dp_replicate_size = world_size / sp_size`` (the door's DDP or FSDP2 wraps them).

        Raises:
            SeqparInputError: ``sp_size > 1`` on one process; a world size that ``sp_size`` does not divide.
        """
        sp_size = self.sp_size or world_size
        if world_size == 1 and sp_size > 1:
            raise SeqparInputError(
                f"sp_size={sp_size} needs several processes: launch with torchrun or accelerate launch"
            )
        if world_size % sp_size:
            valid = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise SeqparInputError(
                f"the world size {world_size} is not divisible by sp_size {sp_size}: the job runs world / sp_size "
                f"data-parallel replicas; valid sp sizes here: {valid}"
            )
        return ParallelDims(dp_replicate_size=world_size // sp_size, sp_size=sp_size, ulysses_size=self.ulysses_size)

    def parallelize_options(self) -> ParallelizeOptions:
        """What ``seqpar.parallelize`` applies to a door's models: the strategy, layout and kernel (the door's
        own DDP / FSDP2 / DeepSpeed engine does data parallel)."""
        return ParallelizeOptions(
            strategy=self.strategy, layout=self.layout, kernel=self.kernel, split_vision=self.split_vision
        )


def check_training_arguments(args: object) -> None:
    """Refuse ``TrainingArguments`` that seqpar cannot honour, before the Trainer sets anything up.

    Args:
        args: the ``TrainingArguments`` (or ``SFTConfig``) given to the Trainer, or None (defaults).

    Raises:
        SeqparInputError: FSDP version 1, per-device token averaging, the batch-rebalance sampler.
    """
    if args is None:
        return
    problems = []
    if getattr(args, "fsdp", None) and int((getattr(args, "fsdp_config", None) or {}).get("version", 2)) != 2:
        problems.append("FSDP version 1 is not supported with seqpar; use FSDP2 (fsdp_config={'version': 2})")
    if getattr(args, "average_tokens_across_devices", True) is False:
        problems.append(
            "average_tokens_across_devices=False asks for a per-device token mean; seqpar always normalises by "
            "the valid tokens of the whole optimizer step over every rank (the one-process loss): set it to True"
        )
    if getattr(args, "train_sampling_strategy", None) == "batch_rebalance":
        problems.append(
            "train_sampling_strategy='batch_rebalance' assigns batches to every process; seqpar gives the same "
            "rows to all ranks of a sequence-parallel group (use 'random', 'sequential' or 'group_by_length')"
        )
    if problems:
        raise SeqparInputError("seqpar.hf cannot honour these training arguments: " + " | ".join(problems))


def check_trainer_options(trainer: object) -> None:
    """Refuse Trainer features that need whole-sequence logits or another loss.

    Args:
        trainer: the constructed Trainer (reads ``compute_loss_func``, ``compute_metrics`` with ``args``'
            ``batch_eval_metrics`` and ``include_for_metrics`` and ``model_init``). A
            model with ``output_router_logits`` is served: its router loss is exact (Note [router loss under the
            Trainer]).

    Raises:
        SeqparInputError: naming each feature and why.
    """
    problems = []
    if getattr(trainer, "compute_loss_func", None) is not None:
        problems.append(
            "compute_loss_func would receive one rank's shard of the logits; seqpar computes the exact token "
            "cross-entropy itself (override compute_loss in a subclass to change it)"
        )
    args = getattr(trainer, "args", None)
    if getattr(trainer, "compute_metrics", None) is not None and getattr(args, "batch_eval_metrics", False):
        problems.append(
            "batch_eval_metrics: seqpar gathers every replica's predictions once, after the last batch (Note "
            "[metrics over shards]); per-batch metrics are not implemented: leave batch_eval_metrics=False"
        )
    if getattr(trainer, "compute_metrics", None) is not None and getattr(args, "include_for_metrics", None):
        problems.append(
            f"include_for_metrics={args.include_for_metrics}: compute_metrics receives predictions and labels "
            "under seqpar; inputs and per-example losses are not gathered (leave include_for_metrics empty)"
        )
    if getattr(trainer, "model_init", None) is not None:
        problems.append("model_init builds new models that seqpar has not prepared; pass model= instead")
    if problems:
        raise SeqparInputError("seqpar.hf cannot honour these Trainer options: " + " | ".join(problems))


def check_neftune(alpha: float | None, dp_size: int) -> float | None:
    """NEFTune's alpha, if seqpar can add exactly one process's noise (Note [NEFTune over shards]).

    Args:
        alpha: ``TrainingArguments.neftune_noise_alpha``.
        dp_size: the number of data-parallel replicas.

    Returns:
        ``alpha`` (None or 0: no NEFTune).

    Raises:
        SeqparInputError: NEFTune with more than one data-parallel replica.
    """
    if alpha and dp_size > 1:
        raise SeqparInputError(
            f"seqpar.hf cannot honour neftune_noise_alpha={alpha} with {dp_size} data-parallel replicas: one process "
            "draws one noise tensor over the whole batch of every replica, of its width (the widest row, or the whole "
            "packed row) and scaled by 1/sqrt(width x hidden size), which no replica knows, so no replica can add its "
            "part of it; NEFTune is exact with sequence parallelism alone (sp_size = world size)"
        )
    return alpha


def check_sft_arguments(args: object) -> None:
    """Refuse ``SFTConfig`` options that seqpar cannot honour, with the reason for each.

    Args:
        args: the ``SFTConfig``.

    Raises:
        SeqparInputError: ``use_liger_kernel`` (a fused loss on unsharded labels), ``loss_type`` other than
            "nll" (seqpar's loss is token cross-entropy), ``activation_offloading`` (not tried with seqpar),
            NEFTune with label smoothing (two noisy forwards per micro-batch in TRL).
    """
    problems = []
    if getattr(args, "use_liger_kernel", False):
        problems.append(
            "use_liger_kernel: Liger fuses the loss into the model's forward on labels it shifts itself; "
            "under sequence parallelism the labels must be shifted before sharding (seqpar's loss does that)"
        )
    if getattr(args, "loss_type", "nll") != "nll":
        problems.append(
            f"loss_type={args.loss_type!r}: seqpar computes the plain token negative log-likelihood ('nll') "
            "normalised over the whole step; other SFT losses are not implemented"
        )
    if getattr(args, "activation_offloading", False):
        problems.append("activation_offloading has not been verified with seqpar's attention; leave it off")
    if getattr(args, "neftune_noise_alpha", None) and getattr(args, "label_smoothing_factor", 0.0):
        problems.append(
            "neftune_noise_alpha with label_smoothing_factor: SFTTrainer then runs two training forwards per "
            "micro-batch, each drawing NEFTune noise, and seqpar one: the noise would not be one process's"
        )
    if problems:
        raise SeqparInputError("seqpar.hf cannot honour these SFTConfig options: " + " | ".join(problems))


def check_data_parallel_engine(trainer: object, world_size: int) -> None:
    """Refuse data-parallel set-ups whose gradients would not be averaged over all ``world_size`` processes.

    Note [FSDP2 under the Trainer]: accelerate (1.15) applies an FSDP plugin only on accelerator backends
    (``AcceleratorState`` sets ``DistributedType.FSDP`` in its multi-GPU/XPU/NPU... branch, not for
    ``MULTI_CPU``), so on the CPU ``fsdp=...`` is dropped without a word and the Trainer wraps the model in
    DDP; a model sharded by hand is refused by ``Accelerator.prepare_model`` ("DTensor parameters ... DDP").
    FSDP2 on any device: load the model sharded, ``from_pretrained(..., distributed_config=
    DistributedConfig(fsdp_size=world))``; the Trainer then leaves the reduction to FSDP2 (an average over
    the fsdp x replicate ranks, which must be every process for the loss scaling to sum the gradients).

    Args:
        trainer: the constructed Trainer (reads ``args``, ``is_fsdp_enabled``, ``model``).
        world_size: processes in the job.

    Raises:
        SeqparInputError: an FSDP request that accelerate dropped; a model sharded at load time with tensor,
            pipeline or expert parallelism, or whose data-parallel ranks are not the whole job.
    """
    args = getattr(trainer, "args", None)
    if getattr(args, "fsdp", None) and world_size > 1 and not getattr(trainer, "is_fsdp_enabled", False):
        raise SeqparInputError(
            "FSDP was requested (TrainingArguments fsdp=...) but accelerate did not enable it: accelerate "
            "applies its FSDP plugin only on GPU-class devices, and on the CPU the Trainer would silently train with "
            "DDP. For FSDP2 on any device load the model sharded: from_pretrained(..., distributed_config="
            f"DistributedConfig(fsdp_size={world_size})) and leave fsdp unset; or drop fsdp to train with DDP"
        )
    model = getattr(trainer, "model", None)
    if not getattr(model, "is_distributed_loading_by_transformers", False):
        return
    dc = getattr(model.config, "distributed_config", None)
    sizes = {k: getattr(dc, k, None) or 1 for k in ("tp_size", "pp_size", "ep_size")}
    dp = (getattr(dc, "fsdp_size", None) or 1) * (getattr(dc, "dp_replicate_size", None) or 1)
    if any(v > 1 for v in sizes.values()) or dp != world_size:
        raise SeqparInputError(
            f"the model was sharded at load time with {sizes} and fsdp_size x dp_replicate_size = {dp}; seqpar.hf "
            f"supports FSDP2 alone over every process: DistributedConfig(fsdp_size={world_size}) (sequence "
            "parallelism splits the sequence over the same ranks; tensor/pipeline/expert parallelism are not supported"
            "; for pipeline parallel use seqpar train --pp or seqpar.apply_pipeline_parallel outside the Trainer)"
        )


def check_deepspeed(trainer: object) -> None:
    """Refuse DeepSpeed settings under which its gradient average would not run over every process.

    Note [DeepSpeed under the Trainer]: ZeRO stages 1-3 average gradients over DeepSpeed's data-parallel group,
    which is every process unless DeepSpeed's own sequence or tensor parallel carve groups out of it; the
    Trainer passes the loss to ``engine.backward`` unscaled for accumulation (``loss_is_scaled_for_ga``). So
    the loss of Note [exact loss under the Trainer] (the step's token sum over N, times the W processes)
    gives the exact step gradient under ZeRO as under DDP. DeepSpeed's ``train_batch_size`` ("auto":
    micro-batch x accumulation x every process) counts each row once per sequence-parallel rank: it names
    sp x the rows of a step; only DeepSpeed's own sample counters read it.

    Args:
        trainer: the constructed Trainer (reads ``is_deepspeed_enabled`` and accelerate's DeepSpeed plugin).

    Raises:
        SeqparInputError: DeepSpeed's ``sequence_parallel_size`` or AutoTP ``tensor_parallel.autotp_size`` > 1.
    """
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    config = getattr(plugin, "deepspeed_config", None) or {}
    problems = []
    if int(config.get("sequence_parallel_size", 1) or 1) > 1:
        problems.append(
            f"sequence_parallel_size={config['sequence_parallel_size']}: seqpar splits the sequence itself (its "
            "degree comes from sequence_parallel= or parallelism_config); leave DeepSpeed's at 1"
        )
    tensor_parallel = config.get("tensor_parallel") or {}
    if int(tensor_parallel.get("autotp_size", 1) or 1) > 1:
        problems.append("tensor_parallel.autotp_size > 1: DeepSpeed's tensor parallel is not combined with seqpar")
    if problems:
        raise SeqparInputError("seqpar.hf cannot honour this DeepSpeed config: " + " | ".join(problems))
