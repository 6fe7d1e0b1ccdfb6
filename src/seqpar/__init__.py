"""seqpar: sequence parallelism for long-context transformer training (Ulysses, ring, all-gather attention).

Attention: ``make_mesh``, ``shard_sequence``, ``attention``.
Models: ``prepare_model``, ``shard_batch``, ``cross_entropy``, ``router_aux_loss``; SDPA code: ``context_parallel``.
Why a sharded run differs from one process: ``doctor``.
"""

from seqpar.api import AttentionChoice, attention, choose_attention
from seqpar.balanced import LayoutBalance, balanced_layout, layout_balance
from seqpar.data import IGNORE_INDEX, BatchShard, pack_documents, shard_batch
from seqpar.data_parallel import apply_data_parallel, data_parallel_group
from seqpar.diagnosis import DoctorReport, doctor
from seqpar.errors import SeqparInputError
from seqpar.gradients import clip_grad_norm_, reduce_gradients
from seqpar.integrations.context_parallel import context_parallel, context_parallel_unshard
from seqpar.integrations.moe import router_aux_loss
from seqpar.integrations.transformers import attention_choice, prepare_model
from seqpar.kernels import select_kernel
from seqpar.layout import LAYOUTS, ChunkLayout, gather_sequence, position_ids, shard_sequence
from seqpar.loss import count_valid_tokens, cross_entropy, lm_head_cross_entropy, sum_over
from seqpar.memory import MemoryEstimate, apply_activation_offload, apply_tiled_mlp, estimate_memory
from seqpar.mesh import SequenceParallelMesh, as_sp_mesh, make_mesh
from seqpar.pipeline_parallel import PipelineParallel, apply_pipeline_parallel
from seqpar.placement import Placement, placed_layout
from seqpar.planning import Cluster, Plan, plan
from seqpar.strategies.masking import SequenceMask, sequence_mask
from seqpar.strategies.policy import STRATEGIES, resolve_strategy
from seqpar.tensor_parallel import apply_tensor_parallel

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
    "attention_choice",
    "balanced_layout",
    "choose_attention",
    "clip_grad_norm_",
    "context_parallel",
    "context_parallel_unshard",
    "count_valid_tokens",
    "cross_entropy",
    "data_parallel_group",
    "doctor",
    "estimate_memory",
    "gather_sequence",
    "layout_balance",
    "lm_head_cross_entropy",
    "make_mesh",
    "pack_documents",
    "placed_layout",
    "plan",
    "position_ids",
    "prepare_model",
    "reduce_gradients",
    "resolve_strategy",
    "router_aux_loss",
    "select_kernel",
    "sequence_mask",
    "shard_batch",
    "shard_sequence",
    "sum_over",
]

__version__ = "0.1.0"
