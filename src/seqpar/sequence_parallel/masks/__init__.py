"""Masks beyond causal over a sharded sequence: packed documents, sliding windows and block-causal ranges.

``sequence_mask`` reads them from global position ids; every strategy, plan and layout takes a ``SequenceMask``.
"""

from seqpar.sequence_parallel.masks.block_ranges import BlockCausal, block_causal
from seqpar.sequence_parallel.masks.blockwise import BlockwiseMask, key_mask
from seqpar.sequence_parallel.masks.sequence_mask import SequenceMask, check_packed_positions, sequence_mask

__all__ = [
    "BlockCausal",
    "BlockwiseMask",
    "SequenceMask",
    "block_causal",
    "check_packed_positions",
    "key_mask",
    "sequence_mask",
]
