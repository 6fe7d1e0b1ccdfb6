"""The placed layout's solver in one process: the placed row is the batch's row reordered (every document whole
and in order, padding its own document), so dense masks agree; tokens per rank, short documents on one rank,
no K/V between ranks when every document is short, long documents over few ranks, determinism, ``shard_batch``.
"""

from __future__ import annotations

import pytest
import torch

import seqpar
from benchmarks.masks_bytes import needed_bytes
from benchmarks.rows import uneven_documents
from seqpar.errors import SeqparInputError
from seqpar.sequence_parallel.layouts.balanced import TILE_COSTS
from seqpar.sequence_parallel.layouts.placed import resolve_auto_layout
from seqpar.sequence_parallel.layouts.placed.chain import chain_segments, dense_documents
from seqpar.sequence_parallel.layouts.placed.refine import Refiner
from seqpar.sequence_parallel.layouts.placed.solver import BALANCE_SLACK, KEY_COST, TOKEN_SLACK
from seqpar.sequence_parallel.masks.sequence_mask import SequenceMask, check_packed_positions
from seqpar.sequence_parallel.tiling.kv_needs import kv_needs
from tests._cases import packed_positions
from tests.test_balanced import log_normal_documents
from tests.test_mask_kinds import kind_mask


def _documents(lengths) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])


def _owner(placement: seqpar.Placement) -> torch.Tensor:
    """``[S']`` rank of each placed token, written out from the chunk ids."""
    chunk = placement.seq_len // (placement.layout.world_size * placement.layout.chunks_per_rank)
    owner = torch.empty(placement.seq_len, dtype=torch.long)
    for r, ids in enumerate(placement.layout.chunk_ids):
        for c in ids:
            owner[c * chunk : (c + 1) * chunk] = r
    return owner


def _ranks_of_documents(placement: seqpar.Placement, positions: torch.Tensor) -> list[set[int]]:
    """For each document of the batch's row, the ranks that hold some of its tokens."""
    doc = (positions == 0).long().cumsum(0) - 1
    owner, order = _owner(placement), placement.order[0]
    held = [set() for _ in range(int(doc[-1]) + 1)]
    for i in (order >= 0).nonzero().flatten().tolist():
        held[int(doc[order[i]])].add(int(owner[i]))
    return held


CASES = [  # (row of position ids, world size, window, causal)
    (log_normal_documents(4096, 1), 4, None, True),
    (log_normal_documents(3000, 2), 3, 512, True),
    (_documents([300, 900, 41, 500, 700, 96, 1559]), 4, None, False),
    (packed_positions(96), 3, None, True),
    (uneven_documents(8192, 16), 4, None, True),  # two dense documents: the chain candidate
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_placed_row_is_the_row_reordered(case):
    positions, p, window, causal = CASES[case]
    placement = seqpar.placed_layout(positions, p, window=window, causal=causal)
    assert placement.layout == seqpar.placed_layout(positions.clone(), p, window=window, causal=causal).layout
    assert torch.equal(placement.order, seqpar.placed_layout(positions, p, window=window, causal=causal).order)
    order = placement.order[0]
    real = order >= 0
    assert sorted(order[real].tolist()) == list(range(len(positions)))  # every token once
    check_packed_positions(placement.position_ids)  # documents whole and in order, padding its own document
    assert torch.equal(placement.position_ids[0][real], positions[order[real]])
    # the placed row's mask over its real tokens is the row's mask, reordered: outputs cannot change
    dense, placed = (
        kind_mask(positions[None], causal, window, None)[0, 0],
        kind_mask(placement.position_ids, causal, window, None)[0, 0],
    )
    assert torch.equal(placed[real][:, real], dense[order[real]][:, order[real]])
    assert not placed[real][:, ~real].any()  # no real token sees padding
    # tokens: every rank holds S'/P, padding included, within TOKEN_SLACK of the mean
    assert placement.seq_len % p == 0 and placement.seq_len <= TOKEN_SLACK * len(positions) + p
    assert sum(placement.tokens_per_rank()) == len(positions)
    balance = seqpar.layout_balance(placement.position_ids, placement.layout, p, window=window, causal=causal)
    assert balance.planned_max_over_mean <= BALANCE_SLACK + 1e-9, balance
    # without a window the refining pass's loads are the work of the ring's plans, to float rounding
    if window is None:
        chunk = placement.seq_len // (p * placement.layout.chunks_per_rank)
        owner = _owner(placement)[::chunk].tolist()
        refiner = Refiner(placement.position_ids[0], chunk, owner, causal, window, KEY_COST, TILE_COSTS, BALANCE_SLACK)
        torch.testing.assert_close(refiner.load, list(balance.planned), rtol=1e-12, atol=0)


def test_short_documents_stay_whole_and_move_nothing():
    p, seq = 4, 8192
    gen = torch.Generator().manual_seed(3)
    lengths, used = [], 0
    while used < seq:  # every document shorter than S / (2P)
        n = min(int(torch.randint(40, seq // (2 * p), (1,), generator=gen)), seq - used)
        lengths.append(n)
        used += n
    positions = _documents(lengths)
    placement = seqpar.placed_layout(positions, p)
    assert all(len(ranks) == 1 for ranks in _ranks_of_documents(placement, positions))
    chunk = placement.seq_len // (p * placement.layout.chunks_per_rank)
    mask = SequenceMask(torch.arange(placement.seq_len)[None] - placement.position_ids)
    needs = kv_needs(mask, placement.layout.chunk_ids, chunk, True)
    assert needs is not None and all(len(needs[r][s]) == 0 for r in range(p) for s in range(p) if r != s)
    # under a window a cut costs at most a window of keys: a rank needs from its peers at most window - 1 keys
    # for each piece it holds that starts after its document's first token
    window = 256
    positions = _documents([5000, *lengths[:20]])
    placement = seqpar.placed_layout(positions, p, window=window)
    held = _ranks_of_documents(placement, positions)
    assert len(held[0]) >= -(-5000 * p // placement.seq_len), held
    chunk = placement.seq_len // (p * placement.layout.chunks_per_rank)
    mask = SequenceMask(torch.arange(placement.seq_len)[None] - placement.position_ids, window)
    needs = kv_needs(mask, placement.layout.chunk_ids, chunk, True)
    owner, row = _owner(placement), placement.position_ids[0]
    pieces = [0] * p  # pieces that start inside their document: where the rank changes within one
    for i in range(1, placement.seq_len):
        pieces[int(owner[i])] += int(row[i] > 0 and owner[i] != owner[i - 1] and placement.order[0, i] >= 0)
    need = [sum(len(needs[r][s]) for s in range(p) if s != r) for r in range(p)]
    assert all(need[r] <= (window - 1) * pieces[r] for r in range(p)), (need, pieces)
    assert sum(need) > 0  # the long document is cut: the bound is not met by moving nothing


def test_dense_documents_cross_one_run_end():
    """The chain candidate: documents no run can hold whole cross alternate run ends, head then tail; every
    other document stays whole; the solver keeps it where it moves fewer bytes than zigzag by far."""
    p, share = 4, 33 * 64
    positions = uneven_documents(8192, 16)  # 16 uneven documents; the two longest hold 1.17 and 1.04 of a mean
    starts = [*(positions == 0).nonzero().flatten().tolist(), len(positions)]
    docs = [(a, b - a) for a, b in zip(starts, starts[1:])]
    work = [n * (n + 1) / 2 for _, n in docs]
    lengths = [n for _, n in docs]
    dense = dense_documents(lengths, work, share, p * share - 8192, sum(work) / p)
    assert sorted(lengths[d] for d in dense) == [1315, 1397]
    total = torch.cat([torch.zeros(1, dtype=torch.float64), (positions + 1).double().cumsum(0)])
    segments = chain_segments(docs, work, total, p, share)
    assert segments is not None and sum(n for _, n, _ in segments) == p * share
    at, runs_of = 0, {}  # document start -> (run, first token, tokens) of its pieces
    for first, n, offset in segments:
        assert first < 0 or (at // share == (at + n - 1) // share), "a segment crosses a run end"
        if first >= 0:
            runs_of.setdefault(first - offset, []).append((at // share, offset, n))
        at += n
    for (start, n), d in zip(docs, range(len(docs))):
        pieces = runs_of[start]
        assert sum(x for _, _, x in pieces) == n and [o for _, o, _ in pieces] == sorted(o for _, o, _ in pieces)
        if d in dense:  # head at the end of run r, tail at the start of run r + 1, r even
            (r, _, h), (r2, _, _) = pieces
            assert r % 2 == 0 and r2 == r + 1 and 0 < h < n
    placement = seqpar.placed_layout(positions, p)
    cfg = {"ranks": p, "ulysses": 1, "heads": 8, "kv_heads": 2, "head_dim": 64}

    def busiest(row: torch.Tensor, layout) -> float:
        mask = SequenceMask((torch.arange(len(row)) - row)[None])
        return max(needed_bytes("ring", {**cfg, "seq": len(row)}, mask, layout, r) for r in range(p))

    assert busiest(placement.position_ids[0], placement.layout) <= 0.65 * busiest(positions, "zigzag")


def test_shard_batch_places_the_row():
    p = 3
    positions = log_normal_documents(3000, 4)
    batch = {"input_ids": torch.arange(3000)[None] + 7, "position_ids": positions[None]}
    shard = seqpar.shard_batch(batch, None, layout="placed")  # one process: P = 1, the row in order, padded
    real = shard["token_mask"][0].bool()
    assert shard.layout.name == "placed" and torch.equal(shard["input_ids"][0][real], torch.arange(3000) + 7)
    assert torch.equal(shard.placement.restore(shard["input_ids"], 3000), batch["input_ids"])
    placement = seqpar.placed_layout(positions, p)
    ids = placement.place(batch["input_ids"], -1)
    assert torch.equal(placement.restore(ids, 3000, -5), batch["input_ids"])
    with pytest.raises(SeqparInputError, match="made per batch"):
        seqpar.sequence_parallel.layouts.chunks.chunks_per_rank("placed")
    with pytest.raises(SeqparInputError, match="positive integer"):
        seqpar.placed_layout(positions, 0)


def test_auto_layout_resolves_from_the_position_ids():
    """layout="auto": placed on packed rows, balanced on a plain causal row and with blocks; the same every call."""
    packed = _documents([40, 7, 3, 11, 27])
    plain = torch.arange(88)
    assert resolve_auto_layout(packed) == "placed"
    assert resolve_auto_layout(torch.stack([plain, packed])) == "placed"  # one packed row will do
    assert resolve_auto_layout(plain[None].expand(2, -1)) == "balanced"
    assert resolve_auto_layout(packed, blocks=[(0, 40), (40, 88)]) == "balanced"
    assert resolve_auto_layout(torch.arange(5, 93)) == "balanced"  # a continued document
    with pytest.raises(SeqparInputError, match="integers"):
        resolve_auto_layout(packed.double())
    with pytest.raises(SeqparInputError, match=r"\[S\] or \[B, S\]"):
        resolve_auto_layout(packed[None, None])
    with pytest.raises(SeqparInputError, match=r"seqpar\.balanced_layout or seqpar\.placed_layout"):
        seqpar.sequence_parallel.layouts.chunks.chunks_per_rank("auto")
    # shard_batch (one process): the shard's layout is the resolved one's ChunkLayout, the same on every call
    batch = {"input_ids": torch.arange(88)[None] + 7, "position_ids": packed[None]}
    shards = [seqpar.shard_batch(batch, None, layout="auto") for _ in range(2)]
    placed = seqpar.shard_batch(batch, None, layout="placed")
    assert shards[0].layout == shards[1].layout == placed.layout and shards[0].layout.name == "placed"
    assert torch.equal(shards[0].placement.order, placed.placement.order)
    for key in placed:
        assert torch.equal(shards[0][key], placed[key]), key
    unpacked = seqpar.shard_batch({"input_ids": batch["input_ids"]}, None, layout="auto")
    balanced = seqpar.shard_batch({"input_ids": batch["input_ids"]}, None, layout="balanced")
    assert unpacked.layout == balanced.layout and unpacked.layout.name == "balanced" and unpacked.placement is None
    for key in balanced:
        assert torch.equal(unpacked[key], balanced[key]), key
    # on a plain causal row over 3 ranks the balanced layout it resolves to is zigzag's
    zigzag = tuple(seqpar.sequence_parallel.layouts.chunks.rank_chunk_ids("zigzag", 3, r) for r in range(3))
    assert seqpar.balanced_layout(torch.arange(96), 3).chunk_ids == zigzag
    # the doors that take a per-batch layout by name take "auto" too
    from seqpar.hf.config import SequenceParallelConfig
    from seqpar.train.config import TRAIN_LAYOUTS

    assert SequenceParallelConfig(layout="auto").layout == "auto" and "auto" in TRAIN_LAYOUTS
