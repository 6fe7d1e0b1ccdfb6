"""Attention strategies across a sequence-parallel group: one algorithm per file, and the registry of their rows.

Every strategy takes validated local shards and the same keywords: ``mesh, layout, causal, scale, kernel, mask``.
"""

from seqpar.lazy import module_getattr
from seqpar.sequence_parallel.strategies.allgather import allgather_attention
from seqpar.sequence_parallel.strategies.hybrid import hybrid_attention
from seqpar.sequence_parallel.strategies.local import local_attention
from seqpar.sequence_parallel.strategies.registry import (
    STRATEGIES,
    STRATEGY_ROWS,
    StrategyRow,
    strategy_row,
    ulysses_degrees,
)
from seqpar.sequence_parallel.strategies.ring import ring_attention
from seqpar.sequence_parallel.strategies.ulysses import ulysses_attention

__all__ = [
    "STRATEGIES",
    "STRATEGY_FUNCTIONS",
    "STRATEGY_ROWS",
    "StrategyRow",
    "allgather_attention",
    "hybrid_attention",
    "local_attention",
    "resolve_strategy",
    "ring_attention",
    "strategy_row",
    "ulysses_attention",
    "ulysses_degrees",
]

STRATEGY_FUNCTIONS = {name: row.function for name, row in STRATEGY_ROWS.items()}
"""Name -> strategy function, all with one signature; "local" serves a sequence-parallel size of 1."""

# resolve_strategy lives with select_strategy (seqpar.sequence_parallel.selection, which imports this package)
__getattr__ = module_getattr(__name__, {"resolve_strategy": "seqpar.sequence_parallel.selection"}, globals())
