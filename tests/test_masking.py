"""Packed documents and sliding windows: every strategy equals single-device SDPA with the explicit mask.

Documents cross shard boundaries; tiles wholly outside a document or window are never computed.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import seqpar
from seqpar.errors import SeqparInputError
from seqpar.sequence_parallel.masks.sequence_mask import SequenceMask
from seqpar.sequence_parallel.tiling.kv_needs import global_tokens
from seqpar.sequence_parallel.tiling.planner import plan
from tests._cases import check_mask_case, packed_positions
from tests._dist import run_ranks
from tests.test_mask_kinds import kind_mask

MASKS = ("packed", "two-rows", "window", "two-rows-window")  # (position ids, window) of _mask_case


def _mask_case(name: str, seq_len: int) -> tuple[torch.Tensor, int | None]:
    packed = packed_positions(seq_len)
    two_rows = torch.stack([packed, packed_positions(seq_len, (9, 4, 23))])
    one_doc = torch.arange(seq_len)[None]
    return {"packed": (packed[None], None), "two-rows": (two_rows, None), "window": (one_doc, 7)}.get(
        name, (two_rows, 5)
    )


def _masking_cases() -> list:
    """Every (world size, strategy, layout, mask), the mask prebuilt (``seqpar.sequence_mask``) or made from the
    position ids by turns: at every world size each strategy, layout and mask runs both ways, and consecutive world
    sizes together run every combination both ways."""
    cases = []
    for world_size in (1, 2, 3, 4):
        for s, strategy in enumerate(["ring", "allgather", "ulysses"] + (["hybrid"] if world_size == 4 else [])):
            for (lay, layout), (m, mask) in itertools.product(enumerate(("zigzag", "contiguous")), enumerate(MASKS)):
                prebuilt = (world_size + s + lay + m) % 2 == 1
                name = f"P{world_size}-{strategy}-{layout}-{mask}-{'prebuilt' if prebuilt else 'position_ids'}"
                cases.append(pytest.param(world_size, strategy, layout, mask, prebuilt, id=name))
    return cases


def _masking_worker(rank, world_size, strategy, layout, mask, prebuilt):
    positions, window = _mask_case(mask, 24 * world_size)
    mesh = seqpar.make_mesh(ulysses_size=2 if strategy == "hybrid" else 1)
    heads = (6, 3) if world_size == 3 else (4, 2)
    batch = positions.shape[0]
    check_mask_case(rank, world_size, mesh, strategy, layout, batch, *heads, positions, window, prebuilt)


@pytest.mark.fast
@pytest.mark.parametrize(("world_size", "strategy", "layout", "mask", "prebuilt"), _masking_cases())
def test_packed_documents_and_windows_match_single_device(world_size, strategy, layout, mask, prebuilt):
    run_ranks(world_size, _masking_worker, strategy, layout, mask, prebuilt)


def _bad_masks_worker(rank, world_size):
    seq_len = 24 * world_size
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
def test_bad_masks_raise_on_every_rank(world_size):
    # bad input across ranks: a hang must not reach the pool (one rank has no peer to wait for: the pool's)
    run_ranks(world_size, _bad_masks_worker, fresh=world_size > 1)


def _check_covers_exactly(q_ids, kv_ids, chunk_len: int, positions, causal: bool, window, blocks) -> None:
    """Every visible pair lies in exactly one tile, plain tiles hold visible pairs only, and masks are exact."""
    mask = seqpar.sequence_mask(positions, None, layout="contiguous", window=window, blocks=blocks)
    q, k = (global_tokens(ids, chunk_len) for ids in (q_ids, kv_ids))
    visible = kind_mask(positions, causal, window, blocks)[:, 0][:, q][:, :, k]  # [B, q, k] in local order
    covered = torch.zeros(visible.shape[1:], dtype=torch.int32)
    for b in plan(q_ids, kv_ids, chunk_len, causal, mask):
        here = visible[:, b.q, b.kv]
        assert here.any(), "a tile with nothing visible is computed"
        if b.mask is not None:
            assert torch.equal(b.mask[:, 0].expand_as(here), here), "a tile's mask is not the visibility"
        elif b.causal:
            assert b.q.stop - b.q.start == b.kv.stop - b.kv.start and q[b.q.start] == k[b.kv.start]
            assert torch.equal(here, torch.ones_like(here[0]).tril().expand_as(here)), "a causal tile is not causal"
        else:
            assert here.all(), "a plain tile holds a hidden pair"
        covered[b.q, b.kv] += here.any(0).int()  # the pairs this tile computes: it computes no hidden one
    assert covered.max() <= 1, "a pair is computed twice"
    assert torch.equal(covered.bool(), visible.any(0)), "a visible pair is in no tile"


def test_planner_tiles_cover_exactly_the_visible_pairs():
    chunks, chunk_len = 16, 128
    seq = chunks * chunk_len
    uneven = torch.cat([torch.arange(n) for n in (300, 45, 1100, 211, 64, 328)])[None]  # 2048 tokens
    other_row = torch.cat([torch.arange(n) for n in (300, 700, 1048)])[None]
    one = torch.arange(seq)[None]
    masks = {  # (position ids, causal, window, blocks)
        "window": (one, True, 300, None),
        "documents": (uneven, True, None, None),
        "documents and window": (uneven, True, 200, None),
        "rows that differ": (torch.cat([uneven, other_row]), True, None, None),
        "frames": (one, False, None, 96),
        "images in text": (one, False, None, [(100, 400), (1000, 1500)]),
    }
    shuffled = torch.randperm(chunks, generator=torch.Generator().manual_seed(0)).tolist()
    orders = {
        "one run": (range(chunks), range(chunks)),
        "zigzag rank 1 of 8": ([1, 14], range(chunks)),
        "a home run against a peer's": ([3, 4, 5, 6, 7, 11], [0, 1, 2, 8, 9, 10]),
        "shuffled": (shuffled[:6], shuffled[6:]),
        "shuffled, own keys": (shuffled[:6], shuffled[:6]),
    }
    for (name, case), (order, (q_ids, kv_ids)) in itertools.product(masks.items(), orders.items()):
        try:
            _check_covers_exactly(q_ids, kv_ids, chunk_len, *case)
        except AssertionError as err:
            raise AssertionError(f"{name}, {order}: {err}") from err
    # one run of packed documents: tiles end at every document start, so nothing is masked; per document a
    # causal square per tile (the 1100-token one is two tiles of 550) and plain tiles below
    documents = SequenceMask(torch.arange(seq) - uneven)
    blocks = plan(range(chunks), range(chunks), chunk_len, True, documents)
    assert all(b.mask is None for b in blocks)
    assert sum(b.causal for b in blocks) == 7 and len(blocks) == 8
    assert plan(range(chunks), range(chunks), chunk_len, True, documents) is blocks  # made once, shared by layers
    # a window of 256 over 128-token tiles: per query tile its causal square, the tile before (all within the
    # window) plain, the one before that masked, nothing further back
    blocks = plan(range(chunks), range(chunks), chunk_len, True, SequenceMask(window=256))
    assert sum(b.causal for b in blocks) == chunks
    assert sum(b.mask is None and not b.causal for b in blocks) == chunks - 1
    assert sum(b.mask is not None for b in blocks) == chunks - 2
