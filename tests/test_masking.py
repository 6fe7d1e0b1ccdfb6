"""Packed documents and sliding windows: every strategy equals single-device SDPA with the explicit mask.

Documents cross shard boundaries; tiles wholly outside a document or window are never computed.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch
import torch.nn.functional as F

import seqpar
from seqpar.errors import SeqparInputError
from seqpar.strategies._blocks import plan
from seqpar.strategies.masking import SequenceMask
from tests._dist import run_ranks, shard_index
from tests.test_attention_exact import ATOL, RTOL

DOC_LENGTHS = (5, 17, 1, 30, 11)  # uneven, so documents straddle every shard and chunk edge


def packed_positions(seq_len: int, lengths=DOC_LENGTHS) -> torch.Tensor:
    """Position ids of documents of ``lengths`` packed into ``seq_len`` tokens (the last one filled up)."""
    pieces, used = [], 0
    for n in itertools.cycle(lengths):
        n = min(n, seq_len - used)
        pieces.append(torch.arange(n))
        used += n
        if used == seq_len:
            return torch.cat(pieces)


def dense_mask(positions: torch.Tensor, causal: bool, window: int | None) -> torch.Tensor:
    """``[B, 1, S, S]`` visibility written out directly from the position ids."""
    s = positions.shape[-1]
    starts = torch.arange(s) - positions  # [B, S]
    keep = starts[:, :, None] == starts[:, None, :]
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= i - j < window
    return keep[:, None]


def _check(rank, world_size, mesh, strategy, layout, batch, heads, kv_heads, positions, window, prebuilt):
    seq_len = positions.shape[-1]
    gen = torch.Generator().manual_seed(zlib.crc32(repr((strategy, layout, batch, heads, window)).encode()))
    q = torch.randn(batch, heads, seq_len, 32, generator=gen)
    k = torch.randn(batch, kv_heads, seq_len, 32, generator=gen)
    v = torch.randn(batch, kv_heads, seq_len, 32, generator=gen)
    dout = torch.randn(batch, heads, seq_len, 32, generator=gen)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    want = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=dense_mask(positions, True, window), enable_gqa=True)
    want.backward(dout)
    idx = shard_index(layout, world_size, rank, seq_len)
    ql, kl, vl = (t[:, :, idx].clone().requires_grad_() for t in (q, k, v))
    local_pos = positions[:, idx]
    if prebuilt:
        mask = seqpar.sequence_mask(local_pos, mesh, layout=layout, window=window)
        out = seqpar.attention(ql, kl, vl, mesh=mesh, strategy=strategy, layout=layout, mask=mask)
    else:
        out = seqpar.attention(
            ql, kl, vl, mesh=mesh, strategy=strategy, layout=layout, position_ids=local_pos, window=window
        )
    out.backward(dout[:, :, idx])
    what = f"{strategy} {layout} B={batch} H={heads}/{kv_heads} window={window} P={world_size}"
    refs = (want, qr.grad, kr.grad, vr.grad)
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, ql.grad, kl.grad, vl.grad), refs, strict=True):
        torch.testing.assert_close(got, ref[:, :, idx], atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{what} {n}: {m}")


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
            _check(rank, world_size, mesh, strategy, layout, batch, *heads, positions, window, prebuilt)
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
