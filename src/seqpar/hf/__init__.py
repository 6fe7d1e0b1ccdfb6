"""Hugging Face ``Trainer``, TRL ``SFTTrainer`` / ``DPOTrainer`` and accelerate loops, the sequence split over ranks.

``SequenceParallelTrainer`` / ``SequenceParallelSFTTrainer`` / ``SequenceParallelDPOTrainer`` take
``sequence_parallel=SequenceParallelConfig(...)`` or accelerate's ``ParallelismConfig``
(``TrainingArguments(parallelism_config=...)`` or an accelerate YAML);
``Accelerator`` is accelerate's, with the sequence split as its ``parallelism_config`` says.
``SequenceParallelGRPOTrainer`` is TRL's GRPO trainer with ``sequence_parallel=``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from seqpar.lazy import module_getattr

if TYPE_CHECKING:
    from seqpar.hf.accelerator import Accelerator
    from seqpar.hf.batches import SequenceShard, StepShards, model_inputs, replica_of, shard_step, to_shard
    from seqpar.hf.config import SequenceParallelConfig
    from seqpar.hf.dpo import SequenceParallelDPOTrainer
    from seqpar.hf.grpo import SequenceParallelGRPOTrainer
    from seqpar.hf.loaders import replica_loader, replica_sampler
    from seqpar.hf.parallelism import ParallelismPlan, plan_parallelism
    from seqpar.hf.sft import SequenceParallelSFTTrainer
    from seqpar.hf.trainer import SequenceParallelMixin, SequenceParallelTrainer, build_mesh

# transformers, accelerate, trl and datasets load with the first name that needs them, not with `import seqpar.hf`
_NAMES = {
    "Accelerator": "seqpar.hf.accelerator",
    "SequenceShard": "seqpar.hf.batches",
    "StepShards": "seqpar.hf.batches",
    "model_inputs": "seqpar.hf.batches",
    "replica_of": "seqpar.hf.batches",
    "shard_step": "seqpar.hf.batches",
    "to_shard": "seqpar.hf.batches",
    "SequenceParallelConfig": "seqpar.hf.config",
    "SequenceParallelDPOTrainer": "seqpar.hf.dpo",
    "SequenceParallelGRPOTrainer": "seqpar.hf.grpo",
    "replica_loader": "seqpar.hf.loaders",
    "replica_sampler": "seqpar.hf.loaders",
    "ParallelismPlan": "seqpar.hf.parallelism",
    "plan_parallelism": "seqpar.hf.parallelism",
    "SequenceParallelSFTTrainer": "seqpar.hf.sft",
    "SequenceParallelMixin": "seqpar.hf.trainer",
    "SequenceParallelTrainer": "seqpar.hf.trainer",
    "build_mesh": "seqpar.hf.trainer",
}

__all__ = [
    "Accelerator",
    "ParallelismPlan",
    "SequenceParallelConfig",
    "SequenceParallelDPOTrainer",
    "SequenceParallelGRPOTrainer",
    "SequenceParallelMixin",
    "SequenceParallelSFTTrainer",
    "SequenceParallelTrainer",
    "SequenceShard",
    "StepShards",
    "build_mesh",
    "model_inputs",
    "plan_parallelism",
    "replica_loader",
    "replica_of",
    "replica_sampler",
    "shard_step",
    "to_shard",
]

__getattr__ = module_getattr(__name__, _NAMES, globals())
