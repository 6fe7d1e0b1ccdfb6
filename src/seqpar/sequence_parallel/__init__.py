"""The sequence axis: tokens split over a group of ranks, and every token-mixing layer made to work across it.

``attention`` (Ulysses, ring, all-gather, hybrid), ``prepare_model`` for transformers models and
``context_parallel`` for SDPA code. Inside: ``strategies/`` (one algorithm a file and their registry),
``layouts/`` (how a row is cut), ``tiling/`` (tiling and cost), ``masks/``, ``kernels/`` (local attention),
``comm/`` (collectives), ``checks/``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from seqpar.lazy import module_getattr

if TYPE_CHECKING:
    from seqpar.sequence_parallel.api import attention
    from seqpar.sequence_parallel.context_parallel import context_parallel
    from seqpar.sequence_parallel.prepare import prepare_model

_NAMES = {
    "attention": "seqpar.sequence_parallel.api",
    "context_parallel": "seqpar.sequence_parallel.context_parallel",
    "prepare_model": "seqpar.sequence_parallel.prepare",
}
__all__ = ["attention", "context_parallel", "prepare_model"]
__getattr__ = module_getattr(__name__, _NAMES, globals())
