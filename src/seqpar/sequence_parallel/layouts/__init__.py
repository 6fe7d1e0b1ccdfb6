"""How a row of tokens is cut over P ranks: contiguous, zigzag, balanced and placed, and the registry naming them.

``shard_sequence`` / ``gather_sequence`` move tensors along a layout; ``balanced_layout`` and ``placed_layout``
build a per-batch ``ChunkLayout`` from a packed row's position ids; ``NAMED_LAYOUTS`` / ``layout_names`` /
``named_layout`` are the one registry of layout names (Note [layout registry]).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from seqpar.lazy import module_getattr

if TYPE_CHECKING:
    from seqpar.sequence_parallel.layouts.balanced import LayoutBalance, balanced_layout, layout_balance
    from seqpar.sequence_parallel.layouts.chunks import (
        LAYOUTS,
        NAMED_LAYOUTS,
        PER_BATCH_LAYOUTS,
        ChunkLayout,
        FixedLayout,
        PerBatchLayout,
        SequenceLayout,
        gather_sequence,
        layout_names,
        named_layout,
        position_ids,
        shard_sequence,
    )
    from seqpar.sequence_parallel.layouts.placed import Placement, placed_layout

_NAMES = {
    "LayoutBalance": "seqpar.sequence_parallel.layouts.balanced",
    "balanced_layout": "seqpar.sequence_parallel.layouts.balanced",
    "layout_balance": "seqpar.sequence_parallel.layouts.balanced",
    "LAYOUTS": "seqpar.sequence_parallel.layouts.chunks",
    "NAMED_LAYOUTS": "seqpar.sequence_parallel.layouts.chunks",
    "PER_BATCH_LAYOUTS": "seqpar.sequence_parallel.layouts.chunks",
    "ChunkLayout": "seqpar.sequence_parallel.layouts.chunks",
    "FixedLayout": "seqpar.sequence_parallel.layouts.chunks",
    "PerBatchLayout": "seqpar.sequence_parallel.layouts.chunks",
    "SequenceLayout": "seqpar.sequence_parallel.layouts.chunks",
    "gather_sequence": "seqpar.sequence_parallel.layouts.chunks",
    "layout_names": "seqpar.sequence_parallel.layouts.chunks",
    "named_layout": "seqpar.sequence_parallel.layouts.chunks",
    "position_ids": "seqpar.sequence_parallel.layouts.chunks",
    "shard_sequence": "seqpar.sequence_parallel.layouts.chunks",
    "Placement": "seqpar.sequence_parallel.layouts.placed",
    "placed_layout": "seqpar.sequence_parallel.layouts.placed",
}
__all__ = [
    "LAYOUTS",
    "NAMED_LAYOUTS",
    "PER_BATCH_LAYOUTS",
    "ChunkLayout",
    "FixedLayout",
    "LayoutBalance",
    "PerBatchLayout",
    "Placement",
    "SequenceLayout",
    "balanced_layout",
    "gather_sequence",
    "layout_balance",
    "layout_names",
    "named_layout",
    "placed_layout",
    "position_ids",
    "shard_sequence",
]
__getattr__ = module_getattr(__name__, _NAMES, globals())
