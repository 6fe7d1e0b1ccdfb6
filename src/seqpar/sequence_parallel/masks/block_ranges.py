"""Block-causal masks as ranges: a token sees every token of its own block and of every earlier block.

Video frames (equal blocks) or images inside a text stream (a few ranges, every other token its own block).

Note [block-causal ranges]
    A block-causal mask is given as ranges of global token indices, never as an ``[S, S]`` tensor: either
    one block size (blocks ``[0, n), [n, 2n), ...``) or sorted, disjoint ``(start, stop)`` ranges, where a
    token in no range is a block of its own (so text around the images stays plainly causal). Write
    ``bs(i)`` for the first token of i's block. Query i sees key j exactly when ``bs(j) <= bs(i)``: a key
    of an earlier block starts before i's block, a key of i's own block shares its start, and a key of a
    later block starts after i. ``bs`` never decreases along the sequence and ``bs(i) <= i``, so, like
    document starts (Note [documents from position ids]), a tile's corners decide it: every pair is
    visible when ``bs(last key) <= bs(first query)``, none when ``bs(first key) > bs(last query)``. With
    blocks the chunk-level causal rule no longer holds (a key after its query may be visible), so
    ``seqpar.attention`` hands the strategies ``causal=False`` and the mask carries the block rule; a
    window (``query - key < window``) and documents still combine with it by AND.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from seqpar.errors import SeqparInputError

__all__ = ["BlockCausal", "block_causal"]


@dataclass(frozen=True)
class BlockCausal:
    """The blocks of a block-causal mask (Note [block-causal ranges]): one size, or explicit ranges."""

    size: int | None = None
    """Tokens per block when all blocks are equal, else None."""
    ranges: tuple[tuple[int, int], ...] = ()
    """Sorted, disjoint global ``(start, stop)`` ranges; tokens outside them are blocks of one token."""

    def starts(self, index: torch.Tensor) -> torch.Tensor:
        """First token of the block of each global token index in ``index`` (any shape, int64)."""
        if self.size is not None:
            return index - index % self.size
        if not self.ranges:
            return index
        table = torch.tensor(self.ranges, dtype=torch.long)  # [R, 2]
        j = torch.searchsorted(table[:, 0].contiguous(), index, right=True) - 1
        inside = (j >= 0) & (index < table[j.clamp(min=0), 1])
        return torch.where(inside, table[j.clamp(min=0), 0], index)

    def start(self, i: int) -> int:
        """``starts`` of one index."""
        return int(self.starts(torch.tensor([i]))[0])

    @property
    def end(self) -> int:
        """One past the last token the ranges name (0 for a block size)."""
        return self.ranges[-1][1] if self.ranges else 0


def block_causal(blocks: int | Sequence[tuple[int, int]]) -> BlockCausal:
    """Check and normalise the ``blocks=`` argument of ``seqpar.sequence_mask`` / ``seqpar.attention``.

    Args:
        blocks: a block size (equal blocks from token 0), or global ``(start, stop)`` token ranges.

    Returns:
        The ``BlockCausal`` description.

    Raises:
        SeqparInputError: a size below 1, ranges that are empty, negative, unsorted or overlapping.
    """
    if isinstance(blocks, bool):
        raise SeqparInputError(f"blocks must be a block size or (start, stop) ranges, got {blocks!r}")
    if isinstance(blocks, int):
        if blocks < 1:
            raise SeqparInputError(f"block size must be a positive integer, got {blocks}")
        return BlockCausal(size=blocks)
    try:
        ranges = tuple((int(a), int(b)) for a, b in blocks)
    except (TypeError, ValueError) as err:
        raise SeqparInputError(f"blocks must be a block size or (start, stop) ranges, got {blocks!r}") from err
    previous = 0
    for a, b in ranges:
        if not previous <= a < b:
            raise SeqparInputError(
                f"block ranges must be non-empty, sorted and disjoint global (start, stop) pairs; got ({a}, {b}) "
                f"after a range ending at {previous}"
            )
        previous = b
    return BlockCausal(ranges=ranges)
