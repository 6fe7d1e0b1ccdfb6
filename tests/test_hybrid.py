"""Hybrid (ulysses x ring) on 4 gloo ranks: 2x2 and the corners 4x1 and 1x4 equal single-device attention."""

from __future__ import annotations

import itertools

import pytest

import seqpar
from seqpar.errors import SeqparInputError
from tests._cases import check_case, qkv_case
from tests._dist import run_ranks


def _hybrid_cases() -> list:
    cases = []
    for ulysses_size in (2, 1, 4):
        heads = [(8, 8), (8, 2), (8, 1)] if ulysses_size > 1 else [(8, 2), (6, 3)]
        for (h, kv), layout, causal, batch in itertools.product(heads, ("zigzag", "contiguous"), (True, False), (1, 2)):
            name = f"u{ulysses_size}-H{h}kv{kv}-{layout}-{'causal' if causal else 'full'}-B{batch}"
            cases.append(pytest.param(ulysses_size, (h, kv, layout, causal, batch), id=name))
    return cases


def _hybrid_mesh(world_size: int, ulysses_size: int):
    mesh = seqpar.make_mesh(ulysses_size=ulysses_size)
    assert (mesh.ring_size, mesh.ulysses_size) == (world_size // ulysses_size, ulysses_size)
    picked = seqpar.select_strategy("auto", 8, 2, mesh.sp_size, mesh.ulysses_size)
    assert picked == ("hybrid" if ulysses_size == 2 else "ulysses")
    return mesh


def _hybrid_worker(rank, world_size, ulysses_size, case):
    h, kv, layout, causal, batch = case
    mesh = _hybrid_mesh(world_size, ulysses_size)
    check_case(rank, world_size, mesh, "hybrid", layout, causal, batch, h, kv, 64, 16 * world_size)


@pytest.mark.fast
@pytest.mark.parametrize(("ulysses_size", "case"), _hybrid_cases())
def test_hybrid_meshes_match_single_device(ulysses_size, case):
    run_ranks(4, _hybrid_worker, ulysses_size, case)


def _indivisible_heads_worker(rank, world_size):
    mesh = _hybrid_mesh(world_size, 2)
    # 1 head cannot be split over a ulysses axis of 2: a clear error on every rank, naming the alternatives
    with pytest.raises(SeqparInputError, match=r"hybrid's ulysses axis over 2 ranks needs at least 2 query heads"):
        seqpar.attention(*qkv_case(1, 1, 32), mesh=mesh, strategy="hybrid")
    # 3 heads split 2 + 1 (tests/test_uneven_heads.py), but auto takes the ring for them: 1.33x the mean heads
    assert seqpar.select_strategy("auto", 3, 3, mesh.sp_size, mesh.ulysses_size) == "ring"


def test_hybrid_refuses_fewer_heads_than_the_ulysses_axis():
    run_ranks(4, _indivisible_heads_worker)  # the same local check on every rank, before any communication
