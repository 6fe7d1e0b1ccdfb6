"""seqpar: sequence parallelism for long-context transformer training (Ulysses, ring, all-gather attention).

Attention: ``make_mesh``, ``shard_sequence``, ``attention``.
Models: ``parallelize`` (tp -> sp -> memory features -> dp on a ``ParallelDims`` mesh), ``prepare_model``,
``shard_batch``, ``cross_entropy``, ``router_aux_loss``; diffusers DiTs: ``prepare_diffusers``; SDPA and
FlexAttention code: ``context_parallel``, ``flex_attention``.
Why a sharded run differs from one process: ``doctor``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from seqpar.lazy import module_getattr

if TYPE_CHECKING:
    from seqpar.data import IGNORE_INDEX, BatchShard, pack_documents, shard_batch
    from seqpar.data_parallel import apply_data_parallel, data_parallel_group
    from seqpar.diagnosis import DoctorReport, doctor
    from seqpar.errors import SeqparInputError
    from seqpar.gradients import clip_grad_norm_, reduce_gradients
    from seqpar.integrations.diffusion import check_replicated, prepare_diffusers
    from seqpar.integrations.moe import router_aux_loss
    from seqpar.loss import count_valid_tokens, cross_entropy, lm_head_cross_entropy, sum_over
    from seqpar.memory import MemoryEstimate, apply_activation_offload, apply_tiled_mlp, estimate_memory
    from seqpar.mesh import ParallelDims, SequenceParallelMesh, as_sp_mesh, make_mesh
    from seqpar.parallel import ParallelizeOptions, parallelize
    from seqpar.pipeline_parallel import PipelineParallel, apply_pipeline_parallel
    from seqpar.planning import Cluster, Plan, plan
    from seqpar.sequence_parallel.api import AttentionChoice, attention, choose_attention
    from seqpar.sequence_parallel.context_parallel.context_manager import context_parallel, context_parallel_unshard
    from seqpar.sequence_parallel.context_parallel.flex_mode import flex_attention
    from seqpar.sequence_parallel.kernels import select_kernel
    from seqpar.sequence_parallel.layouts.balanced import LayoutBalance, balanced_layout, layout_balance
    from seqpar.sequence_parallel.layouts.chunks import (
        LAYOUTS,
        ChunkLayout,
        gather_sequence,
        position_ids,
        shard_sequence,
    )
    from seqpar.sequence_parallel.layouts.placed import Placement, placed_layout
    from seqpar.sequence_parallel.masks.sequence_mask import SequenceMask, sequence_mask
    from seqpar.sequence_parallel.prepare import last_attention_choice, prepare_model
    from seqpar.sequence_parallel.selection import select_strategy
    from seqpar.sequence_parallel.strategies.registry import STRATEGIES
    from seqpar.tensor_parallel import apply_tensor_parallel

_NAMES = {
    "IGNORE_INDEX": "seqpar.data",
    "BatchShard": "seqpar.data",
    "pack_documents": "seqpar.data",
    "shard_batch": "seqpar.data",
    "apply_data_parallel": "seqpar.data_parallel",
    "data_parallel_group": "seqpar.data_parallel",
    "DoctorReport": "seqpar.diagnosis",
    "doctor": "seqpar.diagnosis",
    "SeqparInputError": "seqpar.errors",
    "clip_grad_norm_": "seqpar.gradients",
    "reduce_gradients": "seqpar.gradients",
    "check_replicated": "seqpar.integrations.diffusion",
    "prepare_diffusers": "seqpar.integrations.diffusion",
    "router_aux_loss": "seqpar.integrations.moe",
    "LayoutBalance": "seqpar.sequence_parallel.layouts.balanced",
    "balanced_layout": "seqpar.sequence_parallel.layouts.balanced",
    "layout_balance": "seqpar.sequence_parallel.layouts.balanced",
    "LAYOUTS": "seqpar.sequence_parallel.layouts.chunks",
    "ChunkLayout": "seqpar.sequence_parallel.layouts.chunks",
    "gather_sequence": "seqpar.sequence_parallel.layouts.chunks",
    "position_ids": "seqpar.sequence_parallel.layouts.chunks",
    "shard_sequence": "seqpar.sequence_parallel.layouts.chunks",
    "Placement": "seqpar.sequence_parallel.layouts.placed",
    "placed_layout": "seqpar.sequence_parallel.layouts.placed",
    "count_valid_tokens": "seqpar.loss",
    "cross_entropy": "seqpar.loss",
    "lm_head_cross_entropy": "seqpar.loss",
    "sum_over": "seqpar.loss",
    "MemoryEstimate": "seqpar.memory",
    "apply_activation_offload": "seqpar.memory",
    "apply_tiled_mlp": "seqpar.memory",
    "estimate_memory": "seqpar.memory",
    "ParallelDims": "seqpar.mesh",
    "SequenceParallelMesh": "seqpar.mesh",
    "as_sp_mesh": "seqpar.mesh",
    "make_mesh": "seqpar.mesh",
    "ParallelizeOptions": "seqpar.parallel",
    "parallelize": "seqpar.parallel",
    "PipelineParallel": "seqpar.pipeline_parallel",
    "apply_pipeline_parallel": "seqpar.pipeline_parallel",
    "Cluster": "seqpar.planning",
    "Plan": "seqpar.planning",
    "plan": "seqpar.planning",
    "AttentionChoice": "seqpar.sequence_parallel.api",
    "attention": "seqpar.sequence_parallel.api",
    "choose_attention": "seqpar.sequence_parallel.api",
    "context_parallel": "seqpar.sequence_parallel.context_parallel.context_manager",
    "context_parallel_unshard": "seqpar.sequence_parallel.context_parallel.context_manager",
    "flex_attention": "seqpar.sequence_parallel.context_parallel.flex_mode",
    "select_kernel": "seqpar.sequence_parallel.kernels",
    "SequenceMask": "seqpar.sequence_parallel.masks.sequence_mask",
    "sequence_mask": "seqpar.sequence_parallel.masks.sequence_mask",
    "last_attention_choice": "seqpar.sequence_parallel.prepare",
    "prepare_model": "seqpar.sequence_parallel.prepare",
    "STRATEGIES": "seqpar.sequence_parallel.strategies.registry",
    "select_strategy": "seqpar.sequence_parallel.selection",
    "apply_tensor_parallel": "seqpar.tensor_parallel",
}

__all__ = [
    "IGNORE_INDEX",
    "LAYOUTS",
    "STRATEGIES",
    "AttentionChoice",
    "BatchShard",
    "ChunkLayout",
    "Cluster",
    "DoctorReport",
    "LayoutBalance",
    "MemoryEstimate",
    "ParallelDims",
    "ParallelizeOptions",
    "PipelineParallel",
    "Placement",
    "Plan",
    "SeqparInputError",
    "SequenceMask",
    "SequenceParallelMesh",
    "apply_activation_offload",
    "apply_data_parallel",
    "apply_pipeline_parallel",
    "apply_tensor_parallel",
    "apply_tiled_mlp",
    "as_sp_mesh",
    "attention",
    "balanced_layout",
    "check_replicated",
    "choose_attention",
    "clip_grad_norm_",
    "context_parallel",
    "context_parallel_unshard",
    "count_valid_tokens",
    "cross_entropy",
    "data_parallel_group",
    "doctor",
    "estimate_memory",
    "flex_attention",
    "gather_sequence",
    "last_attention_choice",
    "layout_balance",
    "lm_head_cross_entropy",
    "make_mesh",
    "pack_documents",
    "parallelize",
    "placed_layout",
    "plan",
    "position_ids",
    "prepare_diffusers",
    "prepare_model",
    "reduce_gradients",
    "router_aux_loss",
    "select_kernel",
    "select_strategy",
    "sequence_mask",
    "shard_batch",
    "shard_sequence",
    "sum_over",
]

__version__ = "0.1.0"
__getattr__ = module_getattr(__name__, _NAMES, globals())
