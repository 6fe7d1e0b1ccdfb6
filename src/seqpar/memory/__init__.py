"""Memory of long-sequence training: predicting a rank's peak, and features that lower it.

``estimate_memory`` predicts the per-rank bytes of one training step from a model config.
"""

from seqpar.memory.estimate import FEATURES, MemoryEstimate, estimate_memory

__all__ = ["FEATURES", "MemoryEstimate", "estimate_memory"]
