"""Attention strategies across a sequence-parallel group: one algorithm per file, and the registry of their rows.

Every strategy takes validated local shards and the same keywords: ``mesh, layout, causal, scale, kernel, mask``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from seqpar.lazy import module_getattr
from seqpar.sequence_parallel.strategies.heads import HeadSplit, head_split, ulysses_degrees
from seqpar.sequence_parallel.strategies.registry import (
    STRATEGIES,
    STRATEGY_ROWS,
    StrategyRow,
    strategy_row,
)

if TYPE_CHECKING:
    from seqpar.sequence_parallel.strategies.allgather import allgather_attention
    from seqpar.sequence_parallel.strategies.hybrid import hybrid_attention
    from seqpar.sequence_parallel.strategies.local import local_attention
    from seqpar.sequence_parallel.strategies.ring import ring_attention
    from seqpar.sequence_parallel.strategies.ulysses import ulysses_attention

__all__ = [
    "STRATEGIES",
    "STRATEGY_FUNCTIONS",
    "STRATEGY_ROWS",
    "HeadSplit",
    "StrategyRow",
    "allgather_attention",
    "head_split",
    "hybrid_attention",
    "local_attention",
    "ring_attention",
    "strategy_row",
    "ulysses_attention",
    "ulysses_degrees",
]

# the algorithms (torch) load on first use, so the registry's rows serve the planner without them
_NAMES = {f"{name}_attention": f"{__name__}.{name}" for name in STRATEGY_ROWS}
_names = module_getattr(__name__, _NAMES, globals())


def __getattr__(name: str) -> Any:
    """``STRATEGY_FUNCTIONS`` (name -> strategy function, all with one signature; "local" serves a
    sequence-parallel size of 1), built on first use; the strategy functions."""
    if name == "STRATEGY_FUNCTIONS":
        functions = {row_name: row.function for row_name, row in STRATEGY_ROWS.items()}
        globals()[name] = functions
        return functions
    return _names(name)
