"""Memory of long-sequence training: predicting a rank's peak, and features that lower it.

``estimate_memory`` predicts the per-rank bytes of one training step from a model config; ``estimate_dit_memory``
does so for a diffusers transformer from a traced profile (``profile_dit_memory``).
``apply_tiled_mlp`` runs decoder MLPs over chunks of tokens; ``apply_activation_offload`` moves checkpointed
hidden states to host memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from seqpar.lazy import module_getattr

if TYPE_CHECKING:
    from seqpar.memory.dit import DitMemoryEstimate, DitMemoryProfile, estimate_dit_memory, profile_dit_memory
    from seqpar.memory.estimate import FEATURES, MemoryEstimate, estimate_memory
    from seqpar.memory.offload import CheckpointOffload, apply_activation_offload, offload_layer_inputs
    from seqpar.memory.tiled import apply_tiled_mlp, is_tiled, tiled_mlp

__all__ = [
    "FEATURES",
    "CheckpointOffload",
    "DitMemoryEstimate",
    "DitMemoryProfile",
    "MemoryEstimate",
    "apply_activation_offload",
    "apply_tiled_mlp",
    "estimate_dit_memory",
    "estimate_memory",
    "is_tiled",
    "offload_layer_inputs",
    "profile_dit_memory",
    "tiled_mlp",
]

# the estimate needs no torch, the features do: each name loads its module on first use (Note [torch-free
# planning] in seqpar.planning)
_TILED = "seqpar.memory.tiled"
_DIT = "seqpar.memory.dit"
_NAMES = {
    "DitMemoryEstimate": _DIT,
    "DitMemoryProfile": _DIT,
    "estimate_dit_memory": _DIT,
    "profile_dit_memory": _DIT,
    "FEATURES": "seqpar.memory.estimate",
    "MemoryEstimate": "seqpar.memory.estimate",
    "estimate_memory": "seqpar.memory.estimate",
    "CheckpointOffload": "seqpar.memory.offload",
    "apply_activation_offload": "seqpar.memory.offload",
    "offload_layer_inputs": "seqpar.memory.offload",
    "apply_tiled_mlp": _TILED,
    "is_tiled": _TILED,
    "tiled_mlp": _TILED,
}
__getattr__ = module_getattr(__name__, _NAMES, globals())
