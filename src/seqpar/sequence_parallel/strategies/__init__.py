"""Attention strategies across a sequence-parallel group: one algorithm per file, and the registry of their rows.

Every strategy takes validated local shards and the same keywords: ``mesh, layout, causal, scale, kernel, mask``.
"""

from __future__ import annotations

from typing import Any

from seqpar.sequence_parallel.strategies.registry import STRATEGIES, STRATEGY_ROWS

__all__ = ["STRATEGIES", "STRATEGY_FUNCTIONS", "STRATEGY_ROWS"]


def __getattr__(name: str) -> Any:
    """``STRATEGY_FUNCTIONS`` (name -> strategy function, all with one signature; "local" serves a
    sequence-parallel size of 1), built on first use: the algorithms (torch) load then, so the registry's rows
    serve the planner without them."""
    if name != "STRATEGY_FUNCTIONS":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    functions = {row_name: row.function for row_name, row in STRATEGY_ROWS.items()}
    globals()[name] = functions
    return functions
