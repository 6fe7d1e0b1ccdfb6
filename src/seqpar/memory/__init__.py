"""Memory of long-sequence training: predicting a rank's peak, and features that lower it.

``estimate_memory`` predicts the per-rank bytes of one training step from a model config.
``apply_tiled_mlp`` runs decoder MLPs over chunks of tokens; ``apply_activation_offload`` moves checkpointed
hidden states to host memory.
"""

from seqpar.memory.estimate import FEATURES, MemoryEstimate, estimate_memory
from seqpar.memory.offload import CheckpointOffload, apply_activation_offload, offload_layer_inputs
from seqpar.memory.tiled_mlp import apply_tiled_mlp, is_tiled, tiled_mlp

__all__ = [
    "FEATURES",
    "CheckpointOffload",
    "MemoryEstimate",
    "apply_activation_offload",
    "apply_tiled_mlp",
    "estimate_memory",
    "is_tiled",
    "offload_layer_inputs",
    "tiled_mlp",
]
