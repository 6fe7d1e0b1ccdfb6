"""Hugging Face ``Trainer``, TRL ``SFTTrainer`` and accelerate loops with the sequence split over ranks.

``SequenceParallelTrainer`` / ``SequenceParallelSFTTrainer`` take ``sequence_parallel=SequenceParallelConfig(...)`` or
accelerate's ``ParallelismConfig`` (``TrainingArguments(parallelism_config=...)`` or an accelerate YAML).
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
    "ParallelismPlan",
    "SequenceParallelConfig",
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
    # trl is optional and slow to import: load the SFT trainer only when it is asked for
    if name == "SequenceParallelSFTTrainer":
        from seqpar.hf.sft import SequenceParallelSFTTrainer

        return SequenceParallelSFTTrainer
    raise AttributeError(f"module 'seqpar.hf' has no attribute {name!r}")
