"""How a row of tokens is cut over P ranks: contiguous, zigzag, balanced and placed, and the registry naming them.

``NAMED_LAYOUTS`` is the one registry of layout names (Note [layout registry]); what users call (``shard_sequence``,
``gather_sequence``, ``balanced_layout``, ``placed_layout``, ``ChunkLayout``) is on ``seqpar``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from seqpar.lazy import module_getattr

if TYPE_CHECKING:
    from seqpar.sequence_parallel.layouts.chunks import NAMED_LAYOUTS

_NAMES = {
    "NAMED_LAYOUTS": "seqpar.sequence_parallel.layouts.chunks",
}
__all__ = [
    "NAMED_LAYOUTS",
]
__getattr__ = module_getattr(__name__, _NAMES, globals())
