"""Communication primitives for sequence parallelism; they move tensors and know nothing of attention.

All take an explicit process group.
"""

from seqpar.sequence_parallel.comm.all_to_all import (
    head_group_to_seq,
    head_to_seq_shards,
    seq_to_head_group,
    seq_to_head_shards,
)
from seqpar.sequence_parallel.comm.collectives import all_gather_first_dim, reduce_scatter_first_dim
from seqpar.sequence_parallel.comm.ring import RingExchange
from seqpar.sequence_parallel.comm.sparse import SparseExchange
from seqpar.sequence_parallel.comm.uneven_all_to_all import head_to_seq_ranges, seq_to_head_ranges

__all__ = [
    "RingExchange",
    "SparseExchange",
    "all_gather_first_dim",
    "head_group_to_seq",
    "head_to_seq_ranges",
    "head_to_seq_shards",
    "reduce_scatter_first_dim",
    "seq_to_head_group",
    "seq_to_head_ranges",
    "seq_to_head_shards",
]
