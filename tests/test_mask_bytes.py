"""Under masks, ring, allgather and hybrid's ring axis send only the K/V that peers' queries see (and its dK/dV);
strategy "auto" weighs those bytes against Ulysses' (Note [auto strategy]).

Bytes are read from /proc/self/io as in test_bytes_sent; the needed volume is worked out here from a dense
``[S, S]`` mask, independently of the code under test: for each pair of ranks, the keys of one that any
query of the other sees.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.distributed as dist

import seqpar
from seqpar.runtime.memory import written_bytes
from seqpar.sequence_parallel.masks.sequence_mask import SequenceMask
from seqpar.sequence_parallel.selection import masked_ring_bytes, select_strategy
from seqpar.sequence_parallel.strategies.volumes import ulysses_bytes
from seqpar.sequence_parallel.tiling.kv_needs import kv_needs
from tests._cases import ATOL, RTOL
from tests._dist import run_ranks, shard_index
from tests.test_bytes_sent import FLOAT32, SIGNATURE_INTS, _analytical_bytes
from tests.test_mask_kinds import kind_mask

RANKS, ULYSSES, SEQ, HEADS, KV_HEADS, HEAD_DIM = 4, 2, 2048, 8, 2, 64
DOCS = (37, 301, 12, 95, 180, 64, 250, 9, 141, 77, 210, 33, 156, 120, 88, 275)  # 16 uneven documents, 2048 tokens
SHORT_DOCS = (37, 120, 12, 95, 180, 64, 150, 9, 141, 77, 210, 33, 156, 120, 88, 75)  # all < S/(2P), placed whole
CASES = {"16 documents": (DOCS, None), "window S/8": (None, SEQ // 8)}
BOUND = 1.1  # the acceptance bound on sent / needed


def _positions(docs) -> torch.Tensor:
    if docs is None:
        return torch.arange(SEQ)[None]
    return torch.cat([torch.arange(n) for n in docs])[None]


def _needed_tokens(visible: torch.Tensor, holders: list[torch.Tensor]) -> list[list[int]]:
    """``n[r][s]``: tokens of holder s that some query of holder r sees (``visible`` ``[S, S]``)."""
    return [
        [int(visible[qs][:, ks].any(0).sum()) if r != s else 0 for s, ks in enumerate(holders)]
        for r, qs in enumerate(holders)
    ]


def needed_bytes(strategy: str, layout: str, docs, window, sp_rank: int) -> float:
    """Bytes SP rank ``sp_rank`` must send in one forward + backward step under the mask (fp32)."""
    visible = kind_mask(_positions(docs), True, window, None)[0, 0]  # [S, S]
    shards = [shard_index(layout, RANKS, r, SEQ) for r in range(RANKS)]
    check = (RANKS - 1) * SIGNATURE_INTS * 8
    if strategy == "hybrid":  # Ulysses inside pairs, then the ring over the pairs' tokens, one KV head each
        local = SEQ // RANKS
        q_bytes, kv_bytes = HEADS * local * HEAD_DIM * FLOAT32, KV_HEADS * local * HEAD_DIM * FLOAT32
        ulysses = (ULYSSES - 1) / ULYSSES * 4 * (q_bytes + kv_bytes)
        holders = [torch.cat(shards[j * ULYSSES : (j + 1) * ULYSSES]) for j in range(RANKS // ULYSSES)]
        me, token_bytes = sp_rank // ULYSSES, 2 * (KV_HEADS // ULYSSES) * HEAD_DIM * FLOAT32
    else:
        holders, me, ulysses = shards, sp_rank, 0.0
        token_bytes = 2 * KV_HEADS * HEAD_DIM * FLOAT32
    n = _needed_tokens(visible, holders)
    sent_kv = sum(n[r][me] for r in range(len(holders)))  # my K/V that peers see: forward and again backward
    returned = sum(n[me])  # dK/dV of the peers' tokens my queries saw, sent home
    return check + ulysses + token_bytes * (2 * sent_kv + returned)


def _mask_bytes_worker(rank, world_size, results):
    meshes = {"flat": seqpar.make_mesh(), "two_d": seqpar.make_mesh(ulysses_size=ULYSSES)}
    for name, (docs, window) in CASES.items():
        for layout in ("zigzag", "contiguous"):
            idx = shard_index(layout, world_size, rank, SEQ)
            mask = seqpar.sequence_mask(_positions(docs)[:, idx], meshes["flat"], layout=layout, window=window)
            q = torch.randn(1, HEADS, len(idx), HEAD_DIM, requires_grad=True)
            k, v = (torch.randn(1, KV_HEADS, len(idx), HEAD_DIM, requires_grad=True) for _ in "kv")
            for strategy in ("ring", "allgather", "hybrid"):
                mesh = meshes["two_d" if strategy == "hybrid" else "flat"]
                dist.barrier()
                before = written_bytes()
                seqpar.attention(q, k, v, mesh=mesh, strategy=strategy, layout=layout, mask=mask).sum().backward()
                sent = written_bytes() - before
                want = needed_bytes(strategy, layout, docs, window, rank)
                ratio = torch.tensor([sent / want])
                ratios = [torch.zeros(1) for _ in range(world_size)]
                dist.all_gather(ratios, ratio)
                if rank == 0:
                    results.append((name, layout, strategy, max(float(r) for r in ratios)))
                assert 0.99 < sent / want < BOUND, f"{name} {layout} {strategy}: sent {sent} bytes, needed {want}"


def _auto_worker(rank, world_size):
    """A placed row of short documents: "auto" runs the ring, sends no K/V, and equals SDPA; causal stays ulysses."""
    placed = seqpar.placed_layout(_positions(SHORT_DOCS), world_size)
    layout, row = placed.layout, placed.position_ids  # [1, S'], padded
    flat, two_d = seqpar.make_mesh(), seqpar.make_mesh(ulysses_size=ULYSSES)
    gen = torch.Generator().manual_seed(31)
    q = torch.randn(1, HEADS, row.shape[1], HEAD_DIM, generator=gen)
    k, v = (torch.randn(1, KV_HEADS, row.shape[1], HEAD_DIM, generator=gen) for _ in "kv")
    dout = torch.randn(q.shape, generator=gen)
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(
        *refs, attn_mask=kind_mask(row, True, None, None), enable_gqa=True
    )
    want.backward(dout)
    idx = shard_index(layout, world_size, rank, row.shape[1])
    mine = [t[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
    mask = seqpar.sequence_mask(row[:, idx], flat, layout=layout)
    assert seqpar.choose_attention(*mine, mesh=flat, mask=mask, layout=layout).strategy == "ring"
    assert seqpar.choose_attention(*mine, mesh=two_d, mask=mask, layout=layout).strategy == "hybrid"  # kept
    dist.barrier()
    before = written_bytes()
    out = seqpar.attention(*mine, mesh=flat, layout=layout, mask=mask)  # strategy="auto"
    out.backward(dout[:, :, idx])
    sent = written_bytes() - before
    assert sent < 4096, f"auto sent {sent} bytes: only the input check ({(RANKS - 1) * SIGNATURE_INTS * 8}) is needed"
    for name, got, ref in zip(
        ("out", "dq", "dk", "dv"), (out, *(t.grad for t in mine)), (want, *(t.grad for t in refs))
    ):
        torch.testing.assert_close(got, ref[:, :, idx], atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"auto {n}: {m}")
    causal = seqpar.sequence_mask(torch.arange(SEQ)[None, shard_index("zigzag", world_size, rank, SEQ)], flat)
    plain = [t[:, :, : SEQ // world_size] for t in (q, k, v)]
    for m in (None, causal):  # one document per row: the static rule, as before
        assert seqpar.choose_attention(*plain, mesh=flat, mask=m).strategy == "ulysses"


def _report_worker(rank, world_size):
    _auto_worker(rank, world_size)
    results = []
    _mask_bytes_worker(rank, world_size, results)
    if rank == 0:
        for row in results:
            print("mask bytes sent / needed:", *row)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/io")
def test_masked_bytes_sent_match_needed_kv():
    run_ranks(RANKS, _report_worker)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/io")
def test_bench_masks_writes_one_record_per_case(tmp_path, capsys):
    from benchmarks.masks import main

    out = tmp_path / "masks.json"
    # "auto": the placed layout on the packed rows (16 documents, short ones), the balanced one on the others
    args = ["--seq", "512", "--repeats", "1", "--strategies", "ring", "allgather", "--layouts", "zigzag", "auto"]
    args += ["--masks", "causal", "16 documents", "short", "window", "frames"]
    assert main([*args, "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    assert len(records) == 2 * 5 * 2  # strategies x masks x layouts
    packed = ("16 documents", "short documents")
    resolved = {(r["layout"], r["mask"]): r["resolved_layout"] for r in records}
    assert resolved == {
        **{("zigzag", m): "zigzag" for m in {r["mask"] for r in records}},
        **{("auto", m): "placed" if m in packed else "balanced" for m in {r["mask"] for r in records}},
    }
    table = capsys.readouterr().out
    for r in records:  # the printed table says what "auto" resolved to
        shown = "zigzag" if r["layout"] == "zigzag" else f"auto ({r['resolved_layout']})"
        assert f"| {r['strategy']} | {shown} | {r['mask']} |" in table, (shown, r["mask"])
        if r["resolved_layout"] == "placed":  # reordered and padded: real tokens per rank, not the layout's share
            assert sum(r["tokens_per_rank"]) == 512 and r["local_tokens"] * RANKS >= 512, r
        assert len(r["bytes_sent_per_rank"]) == len(r["bytes_needed_per_rank"]) == len(r["rank_compute_s"]) == RANKS
        assert r["step_s"] > 0 and r["rank_time_max_over_mean"] >= 1 and min(r["rank_compute_s"]) > 0
        assert r["visible_max_over_mean"] >= 1
        # mask-aware: every byte sent is needed, up to message headers (at 512 tokens the log-normal documents,
        # of 100 tokens and more, hide no peer's K/V from every query of a rank, so the plain ring runs there)
        if r["mask"] not in ("causal", "log-normal documents"):
            assert sum(r["bytes_sent_per_rank"]) < BOUND * sum(r["bytes_needed_per_rank"]) or (
                max(r["bytes_sent_per_rank"]) < 4096  # nothing needed but the input check: its headers weigh
            ), r  # (a placed row of short documents at 8192 tokens moves no K/V: test_placement.py)


def test_auto_strategy_weighs_ring_bytes_against_ulysses():
    """The rule of Note [auto strategy] on its inputs; its byte counts against this file's independent ones."""
    local = SEQ // RANKS
    opts = dict(layout="zigzag", causal=True, local_tokens=local, head_dim=HEAD_DIM, itemsize=FLOAT32)
    check = (RANKS - 1) * SIGNATURE_INTS * 8
    assert (
        ulysses_bytes(HEADS, KV_HEADS, RANKS, local, HEAD_DIM, FLOAT32)
        == _analytical_bytes("ulysses", KV_HEADS) - check
    )
    assert (
        masked_ring_bytes(None, [local] * RANKS, KV_HEADS, HEAD_DIM, FLOAT32)
        == _analytical_bytes("ring", KV_HEADS) - check
    )
    docs = SequenceMask(torch.arange(SEQ)[None] - _positions(DOCS), None, 301)
    chunk_ids = tuple(seqpar.sequence_parallel.layouts.chunks.rank_chunk_ids("zigzag", RANKS, r) for r in range(RANKS))
    ring = masked_ring_bytes(kv_needs(docs, chunk_ids, local // 2, True), [local] * RANKS, KV_HEADS, HEAD_DIM, FLOAT32)
    assert ring == max(needed_bytes("ring", "zigzag", DOCS, None, r) for r in range(RANKS)) - check

    def auto(mask, strategy="auto", heads=HEADS, kv_heads=KV_HEADS, ulysses=1):
        return select_strategy(strategy, heads, kv_heads, RANKS, ulysses, mask=mask, **opts)

    # 16 uneven documents: the ring sends 0.13 of ulysses' bytes; windows of S/16 and S/8: 0.17 and 0.33
    assert auto(docs) == auto(SequenceMask(None, SEQ // 16)) == "ring"
    assert auto(SequenceMask(None, SEQ // 8)) == auto(SequenceMask()) == auto(None) == "ulysses"
    assert auto(docs, ulysses=ULYSSES) == "hybrid" and auto(docs, heads=3, kv_heads=3) == "ring"  # static rule
    assert auto(docs, strategy="ulysses") == "ulysses" and auto(docs, strategy="allgather") == "allgather"
    assert any(key[0] == "auto strategy" for key in docs.plans) and any(key[0] == "kv_needs" for key in docs.plans)


def test_bench_placement_writes_one_record_per_row_with_the_layouts_needs(tmp_path, capsys):
    from benchmarks.masks_bytes import needed_bytes as layout_needed_bytes
    from benchmarks.placement import KINDS, kind_row, main
    from seqpar.sequence_parallel.checks import SIGNATURE_LENGTH
    from seqpar.sequence_parallel.masks.sequence_mask import SequenceMask

    out = tmp_path / "placement.json"
    assert main(["--ranks", "2", "3", "--seq", "1024", "--seeds", "1", "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [(r["ranks"], r["kind"], r["seed"]) for r in records] == [(p, k, 0) for p in (2, 3) for k in KINDS]
    assert {r["ranks"]: r["seq"] for r in records} == {2: 1024, 3: 1008}  # 1024 rounded down to 16 chunks x 3
    table = capsys.readouterr().out
    check = {p: (p - 1) * SIGNATURE_LENGTH * 8 for p in (2, 3)}  # the input check: all a row of whole documents sends
    for r in records:
        assert r["measured"]
        assert r["command"] == f"python -m benchmarks.placement --ranks 2 3 --seq 1024 --seeds 1 --json {out}"
        ids = kind_row(r["kind"], r["seq"], r["ranks"], r["seed"])
        assert r["documents"] == int((ids == 0).sum()) >= 1
        # the bytes recomputed here for the row as the record names it, under the layout each solver gives
        cfg = {"ranks": r["ranks"], "ulysses": 1, "seq": r["seq"], "heads": 8, "kv_heads": 2, "head_dim": 64}
        mask = SequenceMask((torch.arange(r["seq"]) - ids)[None], None, int(ids.max()))
        for name, layout in (("zigzag", "zigzag"), ("balanced", seqpar.balanced_layout(ids, r["ranks"]))):
            need = [layout_needed_bytes("ring", cfg, mask, layout, rank) for rank in range(r["ranks"])]
            assert r["needed_bytes_max"][name] == max(need), (r["kind"], name)
            planned = seqpar.layout_balance(ids, layout, r["ranks"]).planned_max_over_mean
            assert r["planned_max_over_mean"][name] == planned
        placed = seqpar.placed_layout(ids, r["ranks"])  # deterministic: the bench's own placement of the row
        row = placed.position_ids[0]
        mask = SequenceMask((torch.arange(len(row)) - row)[None], None, int(row.max()))
        need = [
            layout_needed_bytes("ring", {**cfg, "seq": len(row)}, mask, placed.layout, k) for k in range(r["ranks"])
        ]
        assert r["needed_bytes_max"]["placed"] == max(need) and r["placed_no_kv"] == (max(need) == check[r["ranks"]])
        assert set(r["needed_bytes_max"]) == set(r["planned_max_over_mean"]) == {"zigzag", "balanced", "placed"}
        assert 1.0 <= r["tokens_max_over_mean"] <= 1.05 and r["placed_solve_s"] > 0
        assert f"| {r['ranks']} | {r['seq']} | 1 | {r['kind']} |" in table
