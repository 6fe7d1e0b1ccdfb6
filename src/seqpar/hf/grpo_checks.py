"""The ``GRPOConfig`` options and trainer arguments ``SequenceParallelGRPOTrainer`` refuses, and its generation batch.

Every check reads settings that are the same on every rank, so all ranks raise the same error at the same point.
"""

from __future__ import annotations

import torch.distributed as dist

from seqpar.errors import SeqparInputError

__all__ = ["check_grpo_arguments", "check_grpo_trainer", "replica_generation_batch"]


def _strategy(value: object) -> str:
    return str(getattr(value, "value", value))


def check_grpo_arguments(args: object, kwargs: dict) -> None:
    """Refuse what the sequence-parallel GRPO trainer cannot serve, before TRL sets anything up.

    Args:
        args: the ``GRPOConfig``.
        kwargs: the trainer's other keyword arguments (``tools``, ``environment_factory`` ...).

    Raises:
        SeqparInputError: no ``args``; vLLM or continuous-batching generation; tools and environments;
            evaluation; the entropy bonus; FSDP or DeepSpeed.
    """
    if args is None:
        raise SeqparInputError(
            "SequenceParallelGRPOTrainer needs args=GRPOConfig(...) (its batch sizes count replicas)"
        )
    problems = []
    if getattr(args, "use_vllm", False):
        problems.append(
            f"use_vllm=True (vllm_mode={getattr(args, 'vllm_mode', None)!r}) is not supported under sequence "
            "parallelism: vLLM's engines and weight syncs are placed per process. Generate with transformers "
            "(use_vllm=False: each sequence-parallel group samples once with the whole model), or pass rollout_func= "
            "to call your own vLLM server: it runs once per group and its completions are shared by the group"
        )
    if getattr(args, "use_transformers_continuous_batching", False):
        problems.append(
            "use_transformers_continuous_batching has not been verified under sequence parallelism; leave it off "
            "(generation with model.generate, once per sequence-parallel group)"
        )
    if kwargs.get("tools") or kwargs.get("environment_factory") is not None:
        problems.append("tools and environment_factory are not supported: multi-turn rollouts are not implemented")
    if _strategy(getattr(args, "eval_strategy", "no")) != "no" or kwargs.get("eval_dataset") is not None:
        problems.append(
            "evaluation is not implemented for SequenceParallelGRPOTrainer: set eval_strategy='no' and no eval_dataset"
        )
    if getattr(args, "entropy_coef", 0.0) or getattr(args, "use_adaptive_entropy", False):
        problems.append(
            "the entropy bonus (entropy_coef, use_adaptive_entropy) is not implemented under sequence parallelism"
        )
    if getattr(args, "fsdp", None) or getattr(args, "deepspeed", None):
        problems.append(
            "FSDP and DeepSpeed are not supported: one rank per group samples with the whole model, which sharded "
            "parameters would need every rank for; train with DDP (the default)"
        )
    if problems:
        raise SeqparInputError("SequenceParallelGRPOTrainer cannot honour: " + " | ".join(problems))


def replica_generation_batch(args: object, sequence_parallel: object) -> None:
    """Size TRL's generation batch by replicas: ``per_device x (world / sp_size) x steps_per_generation``.

    TRL's ``GRPOConfig`` multiplies by every process; under sequence parallelism the ``sp_size`` ranks of a
    group share each completion, so the prompts of one generation batch are those of the replicas.

    Args:
        args: the ``GRPOConfig`` (its ``generation_batch_size`` is set).
        sequence_parallel: the ``SequenceParallelConfig`` or None (every rank shares each sequence).

    Raises:
        SeqparInputError: a generation batch that does not hold whole groups of ``num_generations``.
    """
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else args.world_size
    sp_size = getattr(sequence_parallel, "sp_size", None) or world
    replicas = max(world // sp_size, 1)  # a world sp_size does not divide is refused by the mixin
    args.generation_batch_size = args.per_device_train_batch_size * replicas * args.steps_per_generation
    if args.generation_batch_size % args.num_generations:
        raise SeqparInputError(
            f"the generation batch per_device_train_batch_size ({args.per_device_train_batch_size}) x replicas "
            f"({replicas}) x steps_per_generation ({args.steps_per_generation}) = {args.generation_batch_size} is not "
            f"divisible by num_generations ({args.num_generations}): every prompt's completions must be in one batch"
        )


def check_grpo_trainer(trainer: object) -> None:
    """Refuse what TRL's constructor decided and seqpar cannot serve (read from the built trainer).

    Args:
        trainer: the constructed trainer.

    Raises:
        SeqparInputError: a mixture-of-experts router loss; a multimodal processor; the placed layout.
    """
    problems = []
    layout = getattr(getattr(trainer, "sequence_parallel", None), "layout", None)
    if layout == "placed":  # the same on every rank: one config
        problems.append(
            "layout='placed' reorders packed documents, and each prompt + completion row is one document: use "
            "'balanced', 'auto' (balanced for such rows) or 'zigzag'"
        )
    if getattr(trainer, "aux_loss_enabled", False):
        problems.append("the router load-balancing loss (router_aux_loss_coef) is not implemented: set it to 0.0")
    if getattr(trainer, "_is_vlm", False):
        problems.append("vision-language models are not supported: seqpar shards token ids only")
    if problems:
        raise SeqparInputError("SequenceParallelGRPOTrainer cannot honour: " + " | ".join(problems))
