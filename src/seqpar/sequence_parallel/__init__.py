"""The sequence axis: tokens split over a group of ranks, and every token-mixing layer made to work across it.

``attention`` (Ulysses, ring, all-gather, hybrid), ``prepare_model`` for transformers models and
``context_parallel`` for SDPA code. Inside: ``strategies/`` (one algorithm a file and their registry),
``layouts/`` (how a row is cut), ``plans/`` (tiling and cost), ``masks/``, ``kernels/`` (local attention),
``comm/`` (collectives), ``checks/``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from seqpar.lazy import module_getattr

if TYPE_CHECKING:
    from seqpar.sequence_parallel.api import AttentionChoice, attention, choose_attention
    from seqpar.sequence_parallel.context_parallel import context_parallel, context_parallel_unshard
    from seqpar.sequence_parallel.masks import SequenceMask, sequence_mask
    from seqpar.sequence_parallel.prepare import attention_choice, prepare_model
    from seqpar.sequence_parallel.selection import select_strategy
    from seqpar.sequence_parallel.strategies.registry import STRATEGIES

_NAMES = {
    "AttentionChoice": "seqpar.sequence_parallel.api",
    "attention": "seqpar.sequence_parallel.api",
    "choose_attention": "seqpar.sequence_parallel.api",
    "context_parallel": "seqpar.sequence_parallel.context_parallel",
    "context_parallel_unshard": "seqpar.sequence_parallel.context_parallel",
    "SequenceMask": "seqpar.sequence_parallel.masks",
    "sequence_mask": "seqpar.sequence_parallel.masks",
    "attention_choice": "seqpar.sequence_parallel.prepare",
    "prepare_model": "seqpar.sequence_parallel.prepare",
    "STRATEGIES": "seqpar.sequence_parallel.strategies.registry",
    "select_strategy": "seqpar.sequence_parallel.selection",
}
__all__ = [
    "STRATEGIES",
    "AttentionChoice",
    "SequenceMask",
    "attention",
    "attention_choice",
    "choose_attention",
    "context_parallel",
    "context_parallel_unshard",
    "prepare_model",
    "select_strategy",
    "sequence_mask",
]
__getattr__ = module_getattr(__name__, _NAMES, globals())
