"""The balanced layout's solver and cost model, in one process: tiles and visible areas against dense masks
written out here, balance on log-normal documents against zigzag, and the layout through ``shard_batch``.
"""

from __future__ import annotations

import math

import pytest
import torch

import seqpar
from seqpar.errors import SeqparInputError
from seqpar.sequence_parallel.layouts.balanced import planned_work, visible_area
from seqpar.sequence_parallel.tiling.planner import plan
from seqpar.sequence_parallel.tiling.tiles import CAUSAL, FULL, SKIP, SQUARE_BLOCK, tile_kinds, tile_size
from tests._cases import packed_positions
from tests.test_mask_kinds import kind_mask


def log_normal_documents(seq_len: int, seed: int) -> torch.Tensor:
    """Position ids of documents with log-normal lengths (median 2,000, clipped to 100..64K) filling a row."""
    gen = torch.Generator().manual_seed(seed)
    pieces, used = [], 0
    while used < seq_len:
        n = int(min(65536, max(100, math.exp(math.log(2000) + 1.5 * torch.randn(1, generator=gen).item()))))
        n = min(n, seq_len - used)
        pieces.append(torch.arange(n))
        used += n
    return torch.cat(pieces)


MASKS = [  # (positions [B, S] of 96 tokens, causal, window, blocks)
    (packed_positions(96)[None], True, None, None),
    (torch.stack([packed_positions(96), packed_positions(96, (9, 4, 23))]), True, 7, None),
    (torch.arange(96)[None], True, None, 10),
    (packed_positions(96)[None], True, 12, [(3, 20), (30, 31), (40, 47)]),
    (packed_positions(96)[None], False, None, None),
]


@pytest.mark.parametrize("case", range(len(MASKS)))
def test_tiles_and_visible_area_follow_the_dense_mask(case):
    positions, causal, window, blocks = MASKS[case]
    mask = seqpar.sequence_mask(positions, None, layout="contiguous", window=window, blocks=blocks)
    dense = kind_mask(positions, causal, window, blocks)[:, 0]  # [B, S, S]
    torch.testing.assert_close(visible_area(mask, 96, causal), dense.sum(2).sum(0).double(), atol=0, rtol=0)
    token_causal = causal and blocks is None
    for chunk in (12, 24, 48):
        tile = tile_size(chunk, mask)
        lo = (torch.arange(96 // chunk)[:, None] * chunk + torch.arange(0, chunk, tile)).flatten()  # tiles of a chunk
        hi = torch.minimum(lo + tile, (lo // chunk + 1) * chunk) - 1
        kinds = tile_kinds(lo, hi, lo, hi, token_causal, mask)
        for a in range(len(lo)):
            for b in range(len(lo)):
                seen = dense[:, lo[a] : hi[a] + 1, lo[b] : hi[b] + 1]
                if kinds[a, b] == SKIP:
                    assert not seen.any(), (chunk, a, b)
                elif kinds[a, b] == FULL:
                    assert seen.all(), (chunk, a, b)
                elif kinds[a, b] == CAUSAL:
                    assert torch.equal(seen, torch.ones_like(seen[0]).tril().expand_as(seen)), (chunk, a, b)
        # planned work covers every visible pair, and counts whole tiles
        per_chunk = visible_area(mask, 96, causal).view(-1, chunk).sum(1)
        assert bool((planned_work(mask, 96, chunk, causal).sum(1) >= per_chunk).all())


def test_planned_work_is_the_work_of_the_ring_plans():
    """``layout_balance(...).planned`` against the blocks ``plan`` returns, one rank's queries against every rank's
    keys, each block's rectangle at its kind's cost (a causal square as its diagonal key blocks and the blocks
    below them): every mask kind, runs of chunks and scattered chunks, squares under and over a key block."""
    costs = (1.0, 0.7, 1.3)

    def cost(block) -> float:
        side, area = block.q.stop - block.q.start, (block.q.stop - block.q.start) * (block.kv.stop - block.kv.start)
        if block.mask is not None:
            return costs[2] * area
        if not block.causal:
            return costs[0] * area
        whole, rest = divmod(side, SQUARE_BLOCK)
        diagonal = whole * SQUARE_BLOCK**2 + rest**2
        return costs[1] * diagonal + costs[0] * (area - diagonal) / 2

    layouts = [((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)), ((0, 5, 6, 11), (1, 2, 9, 10), (3, 4, 7, 8))]
    long_rows = [  # 12 chunks of 300 tokens: a rank's run of 4 chunks is a square over two key blocks
        (torch.arange(3600)[None], True, None, None),
        (torch.cat([torch.arange(1500), torch.arange(1300), torch.arange(800)])[None], True, None, None),
        (torch.cat([torch.arange(2000), torch.arange(1600)])[None], True, 700, None),
    ]
    for positions, causal, window, blocks in MASKS + long_rows:
        chunk = positions.shape[-1] // 12
        mask = seqpar.sequence_mask(positions, None, layout="contiguous", window=window, blocks=blocks)
        for ids in layouts:
            rule = causal and blocks is None
            expected = [sum(cost(b) for kv in ids for b in plan(q, kv, chunk, rule, mask)) for q in ids]
            got = seqpar.layout_balance(positions, seqpar.ChunkLayout(ids), 3, causal=causal, window=window,
                                        blocks=blocks, tile_costs=costs)  # fmt: skip
            assert list(got.planned) == pytest.approx(expected, rel=1e-12), (window, blocks, ids)
            assert min(expected) > 0


@pytest.mark.parametrize("world_size", [3, 4])
def test_balanced_layout_evens_out_uneven_documents(world_size):
    seq_len = 32768 * world_size
    for seed in range(3):
        positions = log_normal_documents(seq_len, seed)
        layout = seqpar.balanced_layout(positions, world_size)
        assert layout == seqpar.balanced_layout(positions.clone(), world_size)  # deterministic
        assert layout.world_size == world_size and len({len(ids) for ids in layout.chunk_ids}) == 1
        balanced = seqpar.layout_balance(positions, layout, world_size)
        zigzag = seqpar.layout_balance(positions, "zigzag", world_size)
        assert balanced.visible_max_over_mean <= 1.05, (seed, balanced)
        assert balanced.planned_max_over_mean <= 1.05, (seed, balanced)
        assert zigzag.visible_max_over_mean > 1.1, (seed, zigzag)  # the case needs balancing at all
    # a sliding window changes each chunk's work: balanced for the window it is asked for
    windowed = seqpar.balanced_layout(positions, world_size, window=4096)
    assert seqpar.layout_balance(positions, windowed, world_size, window=4096).planned_max_over_mean <= 1.05


def test_chunk_layouts_are_checked():
    with pytest.raises(SeqparInputError, match="ascending"):
        seqpar.ChunkLayout(((1, 0), (2, 3)))
    with pytest.raises(SeqparInputError, match="permutation"):
        seqpar.ChunkLayout(((0, 1), (1, 3)))
    with pytest.raises(SeqparInputError, match="same number of chunks"):
        seqpar.ChunkLayout(((0, 1, 2), (3,)))
    with pytest.raises(SeqparInputError, match="pad it to a multiple of 6"):
        seqpar.balanced_layout(torch.arange(10), 3)
    with pytest.raises(SeqparInputError, match="restart at 0"):
        seqpar.balanced_layout(torch.tensor([0, 1, 3, 4]), 2)
