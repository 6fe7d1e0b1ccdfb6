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


@dataclass(frozen=True)
class BlockCausal:
    """The blocks of a block-causal mask (Note [block-causal ranges]): one size, or explicit ranges."""

    size: int | None = None
    """Tokens per block when all blocks are equal, else None."""
    ranges: tuple[tuple[int, int], ...] = ()
    """Sorted, disjoint global ``(start, stop)`` ranges; tokens outside them are blocks of one token."""
    rows: tuple[tuple[tuple[int, int], ...], ...] = ()
    """When the batch rows' blocks differ: each row's ranges (as ``ranges``, which is then empty), else ()."""

    @property
    def per_row(self) -> bool:
        """Whether the rows hold different blocks (``starts`` then has a leading row dimension)."""
        return bool(self.rows)

    def starts(self, index: torch.Tensor) -> torch.Tensor:
        """First token of the block of each global token index in ``index`` (any shape, int64); per row, with
        a leading row dimension, when ``per_row``."""
        if self.size is not None:
            return index - index % self.size
        if self.rows:
            return torch.stack([_range_starts(row, index) for row in self.rows])
        return _range_starts(self.ranges, index)

    @property
    def end(self) -> int:
        """One past the last token the ranges name, in any row (0 for a block size)."""
        return max((row[-1][1] for row in (self.ranges, *self.rows) if row), default=0)

    @property
    def edges(self) -> tuple[int, ...]:
        """Every range's start and stop, of every row, sorted (none for a block size)."""
        return tuple(sorted({x for row in (self.ranges, *self.rows) for pair in row for x in pair}))


def _range_starts(ranges: tuple[tuple[int, int], ...], index: torch.Tensor) -> torch.Tensor:
    """``BlockCausal.starts`` of one set of ranges."""
    if not ranges:
        return index
    table = torch.tensor(ranges, dtype=torch.long)  # [R, 2]
    j = torch.searchsorted(table[:, 0].contiguous(), index, right=True) - 1
    inside = (j >= 0) & (index < table[j.clamp(min=0), 1])
    return torch.where(inside, table[j.clamp(min=0), 0], index)


def _is_pair(item: object) -> bool:
    return isinstance(item, Sequence | torch.Tensor) and len(item) == 2 and not isinstance(item[0], Sequence)


def block_causal(
    blocks: int | Sequence[tuple[int, int]] | Sequence[Sequence[tuple[int, int]]],
) -> BlockCausal:
    """Check and normalise the ``blocks=`` argument of ``seqpar.sequence_mask`` / ``seqpar.attention``.

    Args:
        blocks: a block size (equal blocks from token 0), global ``(start, stop)`` token ranges, or one
            sequence of such ranges per batch row (rows whose blocks differ; a row may have none).

    Returns:
        The ``BlockCausal`` description (per-row ranges that are all equal become plain ranges).

    Raises:
        SeqparInputError: a size below 1, ranges that are empty, negative, unsorted or overlapping.
    """
    if isinstance(blocks, bool):
        raise SeqparInputError(f"blocks must be a block size or (start, stop) ranges, got {blocks!r}")
    if isinstance(blocks, int):
        if blocks < 1:
            raise SeqparInputError(f"block size must be a positive integer, got {blocks}")
        return BlockCausal(size=blocks)
    if isinstance(blocks, Sequence) and blocks and all(isinstance(r, Sequence) and not _is_pair(r) for r in blocks):
        rows = tuple(_ranges(row) for row in blocks)  # one set of ranges per row
        return BlockCausal(ranges=rows[0]) if all(r == rows[0] for r in rows) else BlockCausal(rows=rows)
    return BlockCausal(ranges=_ranges(blocks))


def _ranges(blocks: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Checked sorted, disjoint ``(start, stop)`` ranges."""
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
    return ranges


def image_runs(token_types: torch.Tensor) -> list[tuple[tuple[int, int], ...]]:
    """Each row's runs of image tokens (non-zero ``token_types``: Gemma 3's ``token_type_ids``, Gemma 4's
    ``mm_token_type_ids`` of images and videos) as ``(start, stop)``.

    Args:
        token_types: ``[B, S]`` token types.

    Returns:
        One tuple of sorted, disjoint ranges per row (empty for a row without images).
    """
    runs = []
    for row in (torch.as_tensor(token_types) != 0).long().cpu():
        edges = torch.diff(torch.nn.functional.pad(row, (1, 1))).nonzero().flatten().tolist()
        runs.append(tuple(zip(edges[0::2], edges[1::2], strict=True)))
    return runs
