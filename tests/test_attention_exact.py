"""Every strategy's outputs and gradients equal single-device SDPA on the full sequence (gloo ranks, CPU).

World sizes 1-4; causal and not; both layouts; batch 1 and 2; MHA and GQA; head_dim 64 and 80; values of another
head size (MLA); attention sinks and logit soft-capping (tests._sink_cases); each case its own test on the shared
pool of ranks.
"""

from __future__ import annotations

import itertools

import pytest

import seqpar
from tests._cases import check_case, check_mask_case, packed_positions
from tests._dist import run_ranks
from tests._sink_cases import check_sink_case, sink_cases


def head_configs(world_size: int, strategy: str) -> list[tuple[int, int]]:
    if strategy != "ulysses":
        return [(8, 8), (8, 2)] if world_size != 3 else [(6, 6), (6, 2)]
    if world_size == 3:
        return [(6, 6), (6, 3), (6, 1)]  # (6, 1): one KV head replicated over 3 ranks
    return [(8, 8), (8, 2)]  # at 4 ranks (8, 2) replicates each KV head twice


def _flag(causal: bool) -> str:
    return "causal" if causal else "full"


BATCH_AND_HEAD_DIM = (((1, 64), (2, 80)), ((1, 80), (2, 64)))
"""The two complementary halves of (batch, head_dim) x (1, 2) x (64, 80): each half holds both batches and both
head dims."""


def _exact_cases() -> list:
    """One pytest case per (world size, strategy, heads, layout, causal) and half of the (batch, head_dim) pairs,
    "auto" and sink case.

    The half (``BATCH_AND_HEAD_DIM``) alternates with the world size and the other factors: at every world size each
    (strategy, heads, layout, causal) runs batch 1 and 2 and head_dim 64 and 80, and world sizes 2 and 3 together
    run the whole product (so do 1 and 2, and 3 and 4). "auto" alternates causal and not with the head count, MLA
    the value head size with the strategy and causal flag, in the same way.
    """
    cases = []
    for world_size in (1, 2, 3, 4):
        seq_len = 24 * world_size  # 12-token zigzag chunks
        for s, strategy in enumerate(("ring", "allgather", "ulysses")):
            for (h, (heads, kv_heads)), (lay, layout), (c, causal) in itertools.product(
                enumerate(head_configs(world_size, strategy)),
                enumerate(("zigzag", "contiguous")),
                enumerate((True, False)),
            ):
                for batch, head_dim in BATCH_AND_HEAD_DIM[(world_size + s + h + lay + c) % 2]:
                    case = (strategy, layout, causal, batch, heads, kv_heads, head_dim, seq_len)
                    name = (
                        f"P{world_size}-{strategy}-{layout}-{_flag(causal)}-B{batch}-H{heads}kv{kv_heads}-D{head_dim}"
                    )
                    cases.append(pytest.param(world_size, "exact", case, id=name))
        # "auto" serves any head count: ulysses where the heads split about evenly, ring where they do not
        for h, heads in enumerate((1, 3, 6, 8, 12)):
            causal = (world_size + h) % 2 == 0
            name = f"P{world_size}-auto-H{heads}-{_flag(causal)}"
            cases.append(pytest.param(world_size, "auto", (heads, causal), id=name))
        for name, case in sink_cases(world_size):
            cases.append(pytest.param(world_size, "sinks", case, id=f"P{world_size}-{name}"))
        # MLA: values of another head size than queries and keys (Note [value head size]), either way round
        heads = (6, 3) if world_size == 3 else (8, 2)
        for (s, strategy), (c, causal) in itertools.product(
            enumerate(("ring", "allgather", "ulysses")), enumerate((True, False))
        ):
            qk, v = ((24, 16), (16, 24))[(world_size + s + c) % 2]
            case = (strategy, "zigzag", causal, 1, *heads, qk, seq_len, v)
            name = f"P{world_size}-mla-{strategy}-{_flag(causal)}-D{qk}v{v}"
            cases.append(pytest.param(world_size, "exact", case, id=name))
    return cases


def _exact_worker(rank, world_size, kind, case):
    mesh = seqpar.make_mesh()
    if kind == "exact":
        check_case(rank, world_size, mesh, *case)
    elif kind == "auto":
        heads, causal = case
        chosen = seqpar.select_strategy("auto", heads, heads, mesh.sp_size, mesh.ulysses_size)
        # ulysses where the slowest rank attends at most 1.25x the mean heads (even or not), else ring
        balanced = heads >= world_size and -(-heads // world_size) * world_size <= 1.25 * heads
        assert world_size == 1 or chosen == ("ulysses" if balanced else "ring"), (heads, chosen)
        check_case(rank, world_size, mesh, "auto", "zigzag", causal, 1, heads, heads, 32, 8 * world_size)
    else:
        check_sink_case(rank, world_size, case)


@pytest.mark.fast
@pytest.mark.parametrize(("world_size", "kind", "case"), _exact_cases())
def test_every_strategy_matches_single_device(world_size, kind, case):
    run_ranks(world_size, _exact_worker, kind, case)


def _long_ring_worker(rank, world_size):
    """Sequences long enough for the ring backward to cut K/V into pieces (Note [ring backward])."""
    from seqpar.sequence_parallel.tiling.pieces import pieces_per_chunk

    mesh = seqpar.make_mesh()
    # 8 pieces of 256 tokens per chunk; at 4 ranks in the contiguous layout (half the tokens of zigzag's)
    eight = ("contiguous" if world_size == 4 else "zigzag", True, 2048)
    for layout, causal, chunk in (eight, ("contiguous", False, 512), ("zigzag", True, 512)):
        chunks = 2 if layout == "zigzag" else 1
        assert pieces_per_chunk(chunk, "cpu") == (8 if chunk == 2048 else 2)
        seq_len = chunk * chunks * world_size
        check_case(rank, world_size, mesh, "ring", layout, causal, 1, 4, 2, 16, seq_len)
    positions = packed_positions(1024 * world_size, (700, 90, 1500, 37))[None]  # 512-token chunks: 2 pieces
    for window in (None, 300):
        check_mask_case(rank, world_size, mesh, "ring", "zigzag", 1, 4, 2, positions, window, prebuilt=False)
    if world_size == 4:  # hybrid 2 x 2: the ring carries 4 chunks of 1024 per rank, in 2 pieces
        check_case(rank, world_size, seqpar.make_mesh(ulysses_size=2), "hybrid", "zigzag", True, 1, 4, 2, 16, 8192)


@pytest.mark.parametrize("world_size", [3, 4])  # 2 ranks: the same code, fewer hops
def test_ring_backward_in_pieces_matches_single_device(world_size):
    run_ranks(world_size, _long_ring_worker)
