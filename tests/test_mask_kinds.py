"""Block-causal masks (a block size or token ranges), bidirectional documents and chunked attention (Note [chunked
attention]), alone and combined with documents and windows: every strategy and layout (zigzag, contiguous, the
balanced and placed layouts of each case) equals single-device SDPA with the dense mask written out here, outputs
and gradients, at P = 2, 3, 4 (each kind, strategy and layout together at one of them, every two of them at each:
``_kinds_cases``; the chunked kinds with every other strategy); so does strategy "auto", which picks the ring
for a placed row of short documents.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

import seqpar
from seqpar.errors import SeqparInputError
from seqpar.sequence_parallel.masks.block_ranges import block_causal
from seqpar.sequence_parallel.masks.sequence_mask import SequenceMask
from seqpar.sequence_parallel.tiling.kv_needs import kv_needs
from seqpar.sequence_parallel.tiling.planner import plan
from tests._cases import ATOL, RTOL, packed_positions
from tests._dist import run_ranks, shard_index


def block_of(seq_len: int, blocks) -> torch.Tensor:
    """``[S]`` block number of each token, written out directly: a size, or ranges with singletons between."""
    if isinstance(blocks, int):
        return torch.arange(seq_len) // blocks
    label, ids, i = 0, [], 0
    for a, b in [*blocks, (seq_len, seq_len)]:
        while i < a:
            ids.append(label)
            label, i = label + 1, i + 1
        if i < b:
            ids += [label] * (b - i)
            label, i = label + 1, b
    return torch.tensor(ids[:seq_len])


def kind_mask(
    positions: torch.Tensor, causal: bool, window: int | None, blocks, chunk: int | None = None
) -> torch.Tensor:
    """``[B, 1, S, S]`` visibility: same document, same chunk of it, and the causal, block-causal and window rules."""
    s = positions.shape[-1]
    starts = torch.arange(s) - positions  # [B, S]
    keep = starts[:, :, None] == starts[:, None, :]
    if chunk is not None:  # the chunk's number within its document (transformers' rule on a packed row)
        keep &= (positions[:, :, None] // chunk) == (positions[:, None, :] // chunk)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    if blocks is not None:
        per_row = not isinstance(blocks, int) and all(isinstance(r, list) for r in blocks)
        label = torch.stack([block_of(s, r) for r in blocks]) if per_row else block_of(s, blocks)[None]  # [B, S]
        keep &= label[:, None, :] <= label[:, :, None]
    elif causal:
        keep &= j <= i
    if window is not None:
        keep &= i - j < window
    return keep[:, None]


def check_kind(rank, world_size, mesh, strategy, layout, positions, causal, window, blocks, prebuilt, chunk):
    """This rank's shard of ``strategy`` under the mask equals masked single-device SDPA (out, dq, dk, dv)."""
    batch, seq_len = positions.shape
    heads, kv_heads = (6, 3) if world_size == 3 else (4, 2)
    gen = torch.Generator().manual_seed(zlib.crc32(repr((strategy, layout, causal, window, blocks, chunk)).encode()))
    q = torch.randn(batch, heads, seq_len, 16, generator=gen)
    k, v = (torch.randn(batch, kv_heads, seq_len, 16, generator=gen) for _ in "kv")
    dout = torch.randn(batch, heads, seq_len, 16, generator=gen)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    dense = kind_mask(positions, causal, window, blocks, chunk)
    want = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=dense, enable_gqa=True)
    want.backward(dout)
    idx = shard_index(layout, world_size, rank, seq_len)
    ql, kl, vl = (t[:, :, idx].clone().requires_grad_() for t in (q, k, v))
    local_pos = positions[:, idx]
    options = dict(mesh=mesh, strategy=strategy, layout=layout, causal=causal, chunk=chunk)
    if prebuilt:
        mask = seqpar.sequence_mask(local_pos, mesh, layout=layout, window=window, blocks=blocks)
        out = seqpar.attention(ql, kl, vl, mask=mask, **options)
    else:
        out = seqpar.attention(ql, kl, vl, position_ids=local_pos, window=window, blocks=blocks, **options)
    out.backward(dout[:, :, idx])
    what = f"{strategy} {layout} causal={causal} window={window} blocks={blocks} chunk={chunk} P={world_size}"
    refs = (want, qr.grad, kr.grad, vr.grad)
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, ql.grad, kl.grad, vl.grad), refs, strict=True):
        torch.testing.assert_close(got, ref[:, :, idx], atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{what} {n}: {m}")


def one_doc(seq_len: int) -> torch.Tensor:
    """``[1, S]`` position ids of one unpacked document."""
    return torch.arange(seq_len)[None]


def kind_cases(seq_len: int) -> list[tuple]:
    """(positions, causal, window, blocks, prebuilt, chunk) for every mask kind and some combinations."""
    packed = packed_positions(seq_len)[None]
    two_rows = torch.stack([packed[0], packed_positions(seq_len, (9, 4, 23))])
    one_doc = torch.arange(seq_len)[None]
    images = [(3, 20), (30, 31), (40, 47)] + ([(seq_len - 9, seq_len - 2)] if seq_len > 56 else [])
    return [
        (one_doc, True, None, 8, False, None),  # video frames: equal blocks, cut across chunk edges
        (one_doc, True, None, seq_len, True, None),  # one block: bidirectional, nothing spared (plain ring, tile plan)
        (one_doc, True, None, images, True, None),  # images in a text stream
        (packed, True, None, images, False, None),  # ... and packed documents
        (two_rows, True, 7, 10, True, None),  # blocks, window and documents of two rows together
        (two_rows, True, None, [images, [(0, 6), (26, 40)]], False, None),  # each row its own images (per-row blocks)
        (packed, False, None, None, False, None),  # bidirectional documents
        (two_rows, False, None, None, True, None),
        (one_doc, True, None, None, True, 10),  # chunked attention (Llama 4), chunk edges inside shards
        (two_rows, True, 5, None, False, 7),  # ... counted from each document's start, with a window
    ]


KIND_NAMES = (
    "frames",
    "one-block",
    "images",
    "images-packed",
    "blocks-window-rows",
    "images-per-row",
    "bidir-packed",
    "bidir-rows",
    "chunked",
    "chunked-packed-window",
)
"""Names of ``kind_cases``'s cases, in order."""


def _alone_cases(seq_len: int) -> list[tuple[torch.Tensor, int | None]]:
    """Causal documents, with and without a window, and a window alone (zigzag and contiguous run them in
    test_masking.py); the placed layout reorders the documents and pads the row."""
    return [(packed_positions(seq_len, (5, 31, 2, 17))[None], None), (one_doc(seq_len), 9)]


LAYOUTS = ("zigzag", "contiguous", "balanced")
"""The layouts every mask kind runs under (and the placed one where it applies)."""


def _kinds_cases() -> list:
    """Each mask kind under one of ``LAYOUTS`` per strategy, turning with the kind, strategy and world size: at
    every world size each kind meets every strategy and every layout, and each strategy every layout; over
    P = 2, 3, 4 each (ring, allgather or ulysses, kind, layout) runs once. The placed row and the causal cases
    alone run for every strategy at every world size."""
    cases = []
    for world_size in (2, 3, 4):
        for s, strategy in enumerate(["ring", "allgather", "ulysses"] + (["hybrid"] if world_size == 4 else [])):
            for i, (positions, _, _, blocks, _, chunk) in enumerate(kind_cases(24 * world_size)):
                if chunk is not None and (i + s + world_size) % 2:  # each chunked kind with every other strategy
                    continue
                layouts = [LAYOUTS[(world_size + s + i) % len(LAYOUTS)]]
                if (
                    positions.shape[0] == 1 and blocks is None and chunk is None
                ):  # the placed row (Note [placed layout])
                    layouts.append("placed")
                for layout in layouts:
                    name = f"P{world_size}-{strategy}-{KIND_NAMES[i]}-{layout}"
                    cases.append(pytest.param(world_size, strategy, "kind", i, layout, id=name))
            for i, layout in [(0, "balanced"), (1, "balanced"), (0, "placed"), (1, "placed"), (2, "placed")]:
                name = f"P{world_size}-{strategy}-causal-alone{i}-{layout}"
                cases.append(pytest.param(world_size, strategy, "alone", i, layout, id=name))
    return cases


def _kinds_worker(rank, world_size, strategy, kind, i, layout):
    seq_len = 24 * world_size
    mesh = seqpar.make_mesh(ulysses_size=2 if strategy == "hybrid" else 1)
    if kind == "kind":
        case = kind_cases(seq_len)[i]
        positions, causal, window, blocks, _, _ = case
    else:
        alone = [*_alone_cases(seq_len), (packed_positions(seq_len, (3, 11, 2, 30))[None], 6)]
        positions, window = alone[i]
        case = (positions, True, window, None, False, None)
        causal, blocks = True, None
    if layout == "balanced":
        layout = seqpar.balanced_layout(positions, world_size, causal=causal, window=window, blocks=blocks)
    elif layout == "placed":
        placed = seqpar.placed_layout(
            positions, world_size, **({"causal": causal} if kind == "kind" else {}), window=window
        )
        layout, case = placed.layout, (placed.position_ids, *case[1:])
    check_kind(rank, world_size, mesh, strategy, layout, *case)


@pytest.mark.fast
@pytest.mark.parametrize(("world_size", "strategy", "kind", "i", "layout"), _kinds_cases())
def test_mask_kinds_match_single_device(world_size, strategy, kind, i, layout):
    run_ranks(world_size, _kinds_worker, strategy, kind, i, layout)


def _auto_and_bad_kinds_worker(rank, world_size):
    seq_len = 24 * world_size
    q = torch.randn(1, 2, seq_len // world_size, 8)
    mesh = seqpar.make_mesh()
    # strategy "auto" on a placed row of short documents: the mask-aware ring (Note [auto strategy]), exact
    placed = seqpar.placed_layout(packed_positions(seq_len, (5, 3, 7, 4))[None], world_size)
    local = placed.position_ids[:, shard_index(placed.layout, world_size, rank, placed.position_ids.shape[1])]
    mask = seqpar.sequence_mask(local, mesh, layout=placed.layout)
    heads, kv_heads = (6, 3) if world_size == 3 else (4, 2)  # as check_kind's
    qs, ks = torch.zeros(1, heads, local.shape[1], 16), torch.zeros(1, kv_heads, local.shape[1], 16)
    assert seqpar.choose_attention(qs, ks, ks, mesh=mesh, mask=mask, layout=placed.layout).strategy == "ring"
    check_kind(rank, world_size, mesh, "auto", placed.layout, placed.position_ids, True, None, None, True, None)
    with pytest.raises(SeqparInputError, match="block-causal blocks need causal=True"):
        seqpar.attention(q, q, q, mesh=mesh, causal=False, blocks=4)
    with pytest.raises(SeqparInputError, match="block ranges reach token"):
        seqpar.attention(q, q, q, mesh=mesh, blocks=[(0, seq_len + 1)])


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_auto_picks_the_ring_for_a_placed_row_and_bad_blocks_raise(world_size):
    run_ranks(world_size, _auto_and_bad_kinds_worker)  # the same local checks on every rank


def test_block_ranges_are_checked_and_planned_from_corners():
    with pytest.raises(SeqparInputError, match="sorted and disjoint"):
        block_causal([(4, 8), (6, 10)])
    with pytest.raises(SeqparInputError, match="positive integer"):
        block_causal(0)
    spec = block_causal([(2, 5), (9, 12)])
    assert spec.starts(torch.arange(13)).tolist() == [0, 1, 2, 2, 2, 5, 6, 7, 8, 9, 9, 9, 12]
    # equal blocks of two chunks: one tile per block, and a query block sees itself and earlier blocks whole
    chunks, chunk_len = 8, 128
    blocks = plan(range(chunks), range(chunks), chunk_len, False, SequenceMask(blocks=block_causal(2 * chunk_len)))
    assert all(b.mask is None and not b.causal for b in blocks)
    assert all(b.q.stop - b.q.start == b.kv.stop - b.kv.start == 2 * chunk_len for b in blocks)
    seen = {(b.q.start // (2 * chunk_len), b.kv.start // (2 * chunk_len)) for b in blocks}
    assert seen == {(g, c) for g in range(chunks // 2) for c in range(chunks // 2) if c <= g}
    # frames of half a chunk: tiles are cut to whole frames, so no tile needs a mask
    frames = plan(range(4), range(4), 256, False, SequenceMask(blocks=block_causal(128)))
    assert frames and all(b.mask is None for b in frames)


def test_kv_needs_names_the_seen_tokens_only():
    # two contiguous ranks of 8 tokens, window 4: rank 1's first queries see rank 0's last 3 keys; rank 0 sees
    # nothing of rank 1 (causal)
    needs = kv_needs(SequenceMask(window=4), ((0,), (1,)), 8, True)
    assert needs[1][0].tolist() == [5, 6, 7] and needs[0][1].tolist() == []
    # documents [0, 6), [6, 16): rank 1 sees rank 0's tokens 6, 7; under blocks of 4, rank 0's queries
    # 4..7 see rank 1's nothing (the block [8, 12) is later), rank 1 sees all of rank 0
    docs = SequenceMask(torch.tensor([[0] * 6 + [6] * 10]))
    assert kv_needs(docs, ((0,), (1,)), 8, True)[1][0].tolist() == [6, 7]
    frames = SequenceMask(blocks=block_causal(4))
    assert kv_needs(frames, ((0,), (1,)), 8, False)[1][0].tolist() == list(range(8))
    assert kv_needs(frames, ((0,), (1,)), 8, False)[0][1].tolist() == []
    assert kv_needs(SequenceMask(blocks=block_causal(16)), ((0,), (1,)), 8, False) is None  # nothing spared
