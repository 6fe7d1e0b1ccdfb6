"""How a row of tokens is cut over P ranks: contiguous, zigzag, balanced and placed, and the registry naming them.

``shard_sequence`` / ``gather_sequence`` move tensors along a layout; ``balanced_layout`` and ``placed_layout``
build a per-batch ``ChunkLayout`` from a packed row's position ids.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from seqpar.lazy import module_getattr

if TYPE_CHECKING:
    from seqpar.layouts.balanced import LayoutBalance, balanced_layout, layout_balance
    from seqpar.layouts.chunks import LAYOUTS, ChunkLayout, gather_sequence, position_ids, shard_sequence
    from seqpar.layouts.placed import Placement, placed_layout, traffic_floor

_NAMES = {
    "LayoutBalance": "seqpar.layouts.balanced",
    "balanced_layout": "seqpar.layouts.balanced",
    "layout_balance": "seqpar.layouts.balanced",
    "LAYOUTS": "seqpar.layouts.chunks",
    "ChunkLayout": "seqpar.layouts.chunks",
    "gather_sequence": "seqpar.layouts.chunks",
    "position_ids": "seqpar.layouts.chunks",
    "shard_sequence": "seqpar.layouts.chunks",
    "Placement": "seqpar.layouts.placed",
    "placed_layout": "seqpar.layouts.placed",
    "traffic_floor": "seqpar.layouts.placed",
}
__all__ = [
    "LAYOUTS",
    "ChunkLayout",
    "LayoutBalance",
    "Placement",
    "balanced_layout",
    "gather_sequence",
    "layout_balance",
    "placed_layout",
    "position_ids",
    "shard_sequence",
    "traffic_floor",
]
__getattr__ = module_getattr(__name__, _NAMES, globals())
