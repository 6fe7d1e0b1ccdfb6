"""Packed documents and sliding windows: every strategy equals single-device SDPA with the explicit mask.

Documents cross shard boundaries; tiles wholly outside a document or window are never computed.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import seqpar
from seqpar.errors import SeqparInputError
from seqpar.strategies.masking import SequenceMask
from seqpar.strategies.planner import plan
from tests._cases import check_mask_case, packed_positions
from tests._dist import run_ranks


def _masking_worker(rank, world_size):
    seq_len = 24 * world_size
    packed = packed_positions(seq_len)
    two_rows = torch.stack([packed, packed_positions(seq_len, (9, 4, 23))])
    one_doc = torch.arange(seq_len)[None]
    strategies = ["ring", "allgather", "ulysses"] + (["hybrid"] if world_size == 4 else [])
    for strategy in strategies:
        mesh = seqpar.make_mesh(ulysses_size=2 if strategy == "hybrid" else 1)
        heads = (6, 3) if world_size == 3 else (4, 2)
        for layout, (positions, window), prebuilt in itertools.product(
            ("zigzag", "contiguous"),
            ((packed[None], None), (two_rows, None), (one_doc, 7), (two_rows, 5)),
            (False, True),
        ):
            batch = positions.shape[0]
            check_mask_case(rank, world_size, mesh, strategy, layout, batch, *heads, positions, window, prebuilt)
    mesh = seqpar.make_mesh()
    ids = torch.arange(seq_len // world_size)
    bad = ids.clone()
    bad[3] = 7  # neither +1 nor a restart at 0, on one rank only: every rank raises
    with pytest.raises(SeqparInputError, match="count up by 1 inside a document"):
        seqpar.sequence_mask(bad if rank == 0 else ids, mesh, layout="contiguous")
    q = torch.randn(1, 2, seq_len // world_size, 8)
    if world_size > 1:  # position ids on one rank only: every rank raises instead of one waiting in an all-gather
        with pytest.raises(SeqparInputError, match=r"inputs differ across ranks.*documents=position_ids"):
            seqpar.attention(q, q, q, mesh=mesh, position_ids=ids if rank == 0 else None)
    with pytest.raises(SeqparInputError, match="sliding window needs causal=True"):
        q = torch.randn(1, 2, seq_len // world_size, 8)
        seqpar.attention(q, q, q, mesh=mesh, causal=False, window=4)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_packed_documents_and_windows_match_single_device(world_size):
    run_ranks(world_size, _masking_worker)


def test_planner_skips_tiles_outside_window_and_documents():
    chunks, chunk_len = 8, 16
    ids = range(chunks)
    window = SequenceMask(None, window=chunk_len)
    blocks = plan(ids, ids, chunk_len, True, window)
    # each query chunk: its causal square plus a masked tile of the chunk before; nothing further back
    assert sum(b.causal for b in blocks) == chunks
    assert sum(b.mask is not None for b in blocks) == chunks - 1
    assert len(blocks) == 2 * chunks - 1
    for b in blocks:
        assert b.mask is None or (b.mask.any() and not b.mask.all())
    assert plan(ids, ids, chunk_len, True, window) is blocks  # made once, shared by every layer
    # two documents split at a chunk edge: no tile crosses from one to the other
    positions = torch.cat([torch.arange(3 * chunk_len), torch.arange(5 * chunk_len)])[None]
    docs = SequenceMask(torch.arange(8 * chunk_len) - positions)
    blocks = plan(ids, ids, chunk_len, True, docs)
    assert len(blocks) == 3 * 4 // 2 + 5 * 6 // 2  # causal chunk pairs inside each document only
    assert all(b.mask is None for b in blocks)
    # documents and a window together: a tile on the window's edge but across documents is skipped too
    both = docs.with_window(chunk_len)
    blocks = plan(ids, ids, chunk_len, True, both)
    assert all(b.mask is None or b.mask.any() for b in blocks)
    assert sum(b.causal for b in blocks) == chunks and sum(b.mask is not None for b in blocks) == chunks - 2
