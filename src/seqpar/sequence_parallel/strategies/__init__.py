"""Attention strategies across a sequence-parallel group: one algorithm per file, and the rules that choose one.

Every strategy takes validated local shards and the same keywords: ``mesh, layout, causal, scale, kernel, mask``.
"""

from seqpar.sequence_parallel.strategies.allgather import allgather_attention
from seqpar.sequence_parallel.strategies.hybrid import hybrid_attention
from seqpar.sequence_parallel.strategies.local import local_attention
from seqpar.sequence_parallel.strategies.registry import STRATEGIES, resolve_strategy, ulysses_degrees
from seqpar.sequence_parallel.strategies.ring import ring_attention
from seqpar.sequence_parallel.strategies.ulysses import ulysses_attention

__all__ = [
    "STRATEGIES",
    "STRATEGY_FUNCTIONS",
    "allgather_attention",
    "hybrid_attention",
    "local_attention",
    "resolve_strategy",
    "ring_attention",
    "ulysses_attention",
    "ulysses_degrees",
]

# Name -> strategy function, all with one signature; "local" serves a sequence-parallel size of 1.
STRATEGY_FUNCTIONS = {
    "local": local_attention,
    "ring": ring_attention,
    "ulysses": ulysses_attention,
    "allgather": allgather_attention,
    "hybrid": hybrid_attention,
}
