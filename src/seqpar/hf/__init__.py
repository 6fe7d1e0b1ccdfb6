"""Hugging Face ``Trainer``, TRL ``SFTTrainer`` / ``DPOTrainer`` and accelerate loops, the sequence split over ranks.

``SequenceParallelTrainer`` / ``SequenceParallelSFTTrainer`` / ``SequenceParallelDPOTrainer`` take
``sequence_parallel=SequenceParallelConfig(...)`` or accelerate's ``ParallelismConfig``
(``TrainingArguments(parallelism_config=...)`` or an accelerate YAML);
``Accelerator`` is accelerate's, with the sequence split as its ``parallelism_config`` says.
``SequenceParallelGRPOTrainer`` is TRL's GRPO trainer with ``sequence_parallel=``.
"""

from __future__ import annotations

from seqpar.hf.batches import (
    SequenceShard,
    StepShards,
    model_inputs,
    replica_of,
    shard_step,
    to_shard,
)
from seqpar.hf.config import SequenceParallelConfig
from seqpar.hf.loaders import replica_loader, replica_sampler
from seqpar.hf.parallelism import ParallelismPlan, plan_parallelism
from seqpar.hf.trainer import SequenceParallelMixin, SequenceParallelTrainer, build_mesh

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


def __getattr__(name: str) -> object:
    if name == "Accelerator":  # accelerate's Accelerator module is loaded only when asked for
        from seqpar.hf.accelerator import Accelerator

        return Accelerator
    # trl is optional and slow to import: load the SFT trainer only when it is asked for
    if name == "SequenceParallelSFTTrainer":
        from seqpar.hf.sft import SequenceParallelSFTTrainer

        return SequenceParallelSFTTrainer
    if name == "SequenceParallelGRPOTrainer":
        from seqpar.hf.grpo import SequenceParallelGRPOTrainer

        return SequenceParallelGRPOTrainer
    if name == "SequenceParallelDPOTrainer":
        from seqpar.hf.dpo import SequenceParallelDPOTrainer

        return SequenceParallelDPOTrainer
    raise AttributeError(f"module 'seqpar.hf' has no attribute {name!r}")
