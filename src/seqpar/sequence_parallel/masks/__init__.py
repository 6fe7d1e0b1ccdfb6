"""Masks beyond causal over a sharded sequence: packed documents, sliding windows and block-causal ranges.

``sequence_mask`` reads them from global position ids; every strategy, plan and layout takes a ``SequenceMask``.
"""

from seqpar.sequence_parallel.masks.blockwise import BlockwiseMask, key_mask
from seqpar.sequence_parallel.masks.sequence_mask import SequenceMask, sequence_mask

__all__ = [
    "BlockwiseMask",
    "SequenceMask",
    "key_mask",
    "sequence_mask",
]
