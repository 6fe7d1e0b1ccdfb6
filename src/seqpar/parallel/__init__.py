"""All the axes on one model: ``parallelize`` applies tensor, sequence and data parallel and the memory features.

Each ``apply_*`` step runs on its own sub-mesh of the job's mesh; ``ParallelizeOptions`` says what to apply.
"""

from __future__ import annotations

from seqpar.parallel.compose import (
    ParallelizeOptions,
    parallelize,
)

__all__ = ["ParallelizeOptions", "parallelize"]
