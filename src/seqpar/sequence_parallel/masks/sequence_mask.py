"""Masks beyond causal: packed documents (read from global position ids), sliding windows, block-causal ranges.

``SequenceMask`` describes the global sequence; the block planner turns it into skipped, plain and masked tiles.

Note [documents from position ids]
    Packed rows restart their position ids at 0 at every document start, and count up by one inside a
    document. The global index of a token minus its position id is then the global index of the first
    token of its document, and two tokens share a document exactly when those starts are equal. Every
    rank learns the starts of the whole sequence from one all-gather of the (small, integer) position ids,
    so every strategy can decide any (query, key) pair locally, and every rank checks the same table (an
    invalid table raises the same error everywhere). The starts never decrease along the sequence, so
    whether a tile is wholly inside one document, wholly across documents, or mixed, follows from the
    starts at its corners.

Note [chunked attention]
    Llama 4's chunked layers let a query see the keys of its own chunk of ``C`` tokens only, chunks counted
    from each document's first token (transformers remaps the chunk rule onto the position ids of packed
    rows). A token at position ``p`` then starts its chunk at global index ``index - p % C``; two tokens
    share a chunk exactly when those starts are equal, and the starts never decrease along the sequence. So
    a chunked layer is the same sequence cut into more documents: ``with_chunks`` makes that mask, and
    every strategy, tile plan and layout serves it as packed documents, with no exchange of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from seqpar.errors import SeqparInputError
from seqpar.mesh import as_sp_mesh
from seqpar.sequence_parallel.comm.collectives import all_gather_first_dim, collective_device
from seqpar.sequence_parallel.layouts.chunks import Layout, chunks_per_rank, natural_order_index, reorder_chunks
from seqpar.sequence_parallel.masks.block_ranges import BlockCausal, block_causal
from seqpar.sequence_parallel.masks.blockwise import BlockwiseMask


@dataclass(frozen=True)
class SequenceMask:
    """What a token may see besides the causal rule, over the global sequence.

    ``starts``, ``window`` and ``blocks`` combine: a query sees a key when both are in one document, with a
    window when ``query_position - key_position < window`` (the Mistral convention: ``window`` keys,
    itself included), and with blocks when the key's block is not after the query's (Note [block-causal
    ranges]; the blocks then replace the token-level causal rule).
    """

    starts: torch.Tensor | None = None
    """``[B, S]`` int64 on the CPU: global index of the first token of each token's document (natural
    order), or None for one document per row."""
    window: int | None = None
    """Sliding-window size in tokens, or None for no window."""
    max_position: int = 0
    """Largest position id in the sequence (0 when built without position ids)."""
    blocks: BlockCausal | None = None
    """Block-causal ranges (Note [block-causal ranges]), or None for the plain causal rule."""
    predicate: BlockwiseMask | None = None
    """Any other head-independent mask over the global sequence (Note [blockwise masks]), or None."""
    plans: dict = field(default_factory=dict, compare=False, repr=False)
    """Tile plans already made with this mask (Note [masked tiles]): every layer of one forward asks for
    the same ones, so they are made once per batch."""
    windowed: dict = field(default_factory=dict, compare=False, repr=False)
    """The same documents under other windows, cut into chunks or without the blocks, one object each (keyed by the
    window, ``("chunks", size, length)`` or ``"no blocks"``), so that their plans are shared too."""

    def with_window(self, window: int | None) -> SequenceMask:
        """The same documents with another window."""
        if window == self.window:
            return self
        if window not in self.windowed:
            self.windowed[window] = SequenceMask(self.starts, window, self.max_position, self.blocks, self.predicate)
        return self.windowed[window]

    def without_blocks(self) -> SequenceMask:
        """The same documents and window under the plain causal rule (a layer that does not take the blocks)."""
        if self.blocks is None:
            return self
        if "no blocks" not in self.windowed:
            self.windowed["no blocks"] = SequenceMask(self.starts, self.window, self.max_position, None, self.predicate)
        return self.windowed["no blocks"]

    def with_chunks(self, size: int | None, seq_len: int) -> SequenceMask:
        """The same documents cut into chunks of ``size`` tokens from each document's start (Note [chunked
        attention]); ``seq_len`` is the global length (the starts' when the rows are packed)."""
        if size is None:
            return self
        key = ("chunks", size, seq_len)
        if key not in self.windowed:
            index = torch.arange(seq_len)
            positions = index[None] if self.starts is None else index - self.starts
            starts = index - positions % size
            cut = starts if seq_len > size or self.starts is not None else None
            self.windowed[key] = SequenceMask(cut, self.window, self.max_position, self.blocks, self.predicate)
        return self.windowed[key]

    @property
    def trivial(self) -> bool:
        """True when the mask adds nothing to the causal rule."""
        return self.starts is None and self.window is None and self.blocks is None and self.predicate is None


def _gather_positions(local: torch.Tensor, mesh: object, layout: Layout) -> torch.Tensor:
    """``[B, S]`` global position ids in natural order from every rank's ``[B, S/P]`` shard."""
    sp = as_sp_mesh(mesh)
    if sp.sp_size == 1:
        return local
    device = collective_device(sp.sp_group)
    gathered = all_gather_first_dim(local.movedim(1, 0).contiguous().to(device), sp.sp_group)  # [S, B]
    gathered = reorder_chunks(gathered, 0, natural_order_index(layout, sp.sp_size, gathered.device))
    return gathered.movedim(0, 1).cpu()


def check_packed_positions(positions: torch.Tensor) -> None:
    """Check global ``[B, S]`` position ids of packed rows: never negative, +1 inside a document, 0 at a start.

    Raises:
        SeqparInputError: naming the first row and token that break the rule.
    """
    if (positions < 0).any():
        raise SeqparInputError("position_ids must not be negative")
    bad = ~((positions[:, 1:] - positions[:, :-1] == 1) | (positions[:, 1:] == 0))
    if bad.any():
        b, i = (int(x) for x in bad.nonzero()[0])
        raise SeqparInputError(
            f"position_ids must count up by 1 inside a document and restart at 0 at a document start (global "
            f"position ids from seqpar.shard_batch); row {b} goes {int(positions[b, i])} -> "
            f"{int(positions[b, i + 1])} at global token {i + 1}"
        )


def sequence_mask(
    position_ids: torch.Tensor | None,
    mesh: object = None,
    *,
    layout: Layout = "zigzag",
    window: int | None = None,
    batch_size: int | None = None,
    blocks: int | Sequence[tuple[int, int]] | Sequence[Sequence[tuple[int, int]]] | None = None,
) -> SequenceMask:
    """Build the mask of packed documents (Note [documents from position ids]), an optional window and blocks.

    Collective over the SP group when ``position_ids`` is given (one all-gather of the ids): call it on
    every rank, once per batch, and hand the result to every attention call of the model.

    Args:
        position_ids: this rank's shard of the global position ids, ``[B, S/P]`` or ``[S/P]``, sharded with
            ``layout`` (``seqpar.shard_batch`` makes them); None for one unpacked document per row.
        mesh: the sequence-parallel mesh, group, or None for one process.
        layout: the layout the ids were sharded with ("contiguous", "zigzag" or the batch's ``ChunkLayout``).
        window: sliding-window size, or None.
        batch_size: expected batch size of the ids (checked when given).
        blocks: block-causal blocks (Note [block-causal ranges]): a block size, global ``(start, stop)``
            token ranges (tokens outside them are causal), or one such sequence of ranges per batch row; the
            same on every rank. None: plain causal.

    Returns:
        A ``SequenceMask``; its ``starts`` is None when no row holds more than one document.

    Raises:
        SeqparInputError: ids that are not integers, negative ids, ids that neither count up by one nor
            restart at 0, a window below 1, bad block ranges (the same error on every rank).
    """
    if window is not None and (not isinstance(window, int) or window < 1):
        raise SeqparInputError(f"sliding window must be a positive integer or None, got {window!r}")
    spec = None if blocks is None else block_causal(blocks)
    if spec is not None and spec.per_row and batch_size is not None and len(spec.rows) != batch_size:
        raise SeqparInputError(f"blocks are given for {len(spec.rows)} rows but the batch has {batch_size}")
    if position_ids is None:
        return SequenceMask(None, window, blocks=spec)
    if position_ids.is_floating_point() or position_ids.dtype == torch.bool:
        raise SeqparInputError(f"position_ids must be integers, got {position_ids.dtype}")
    local = position_ids.long()
    if local.dim() == 1:
        local = local[None]
    if local.dim() != 2:
        raise SeqparInputError(f"position_ids must be [batch, seq] or [seq], got shape {tuple(position_ids.shape)}")
    if local.shape[1] % chunks_per_rank(layout):
        raise SeqparInputError(f"position_ids length {local.shape[1]} does not divide into the {layout} layout")
    full = _gather_positions(local, mesh, layout).cpu()  # [B, S], the same on every rank
    if batch_size is not None and full.shape[0] not in (1, batch_size):
        raise SeqparInputError(f"position_ids batch {full.shape[0]} does not match the batch {batch_size}")
    check_packed_positions(full)
    index = torch.arange(full.shape[1])
    starts = index - full
    packed = bool((full[:, 1:] == 0).any())
    return SequenceMask(starts if packed else None, window, int(full.max()), spec)
