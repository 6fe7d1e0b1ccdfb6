"""Attention strategies across a sequence-parallel group: one algorithm per file.

Each takes validated local shards and an explicit process group.
"""

from seqpar.strategies.allgather import allgather_attention
from seqpar.strategies.hybrid import hybrid_attention
from seqpar.strategies.local import local_attention
from seqpar.strategies.ring import ring_attention
from seqpar.strategies.ulysses import ulysses_attention

__all__ = ["allgather_attention", "hybrid_attention", "local_attention", "ring_attention", "ulysses_attention"]
