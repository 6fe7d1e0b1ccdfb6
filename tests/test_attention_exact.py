"""Every strategy's outputs and gradients equal single-device SDPA on the full sequence (gloo ranks, CPU).

World sizes 1-4; causal and not; both layouts; batch 1 and 2; MHA and GQA; head_dim 64 and 80.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch
import torch.nn.functional as F

import seqpar
from tests._dist import run_ranks, shard_index

# fp32 tolerances against single-device fp32 SDPA (both are exact up to summation order).
ATOL, RTOL = 2e-5, 1e-4


def head_configs(world_size: int, strategy: str) -> list[tuple[int, int]]:
    if strategy != "ulysses":
        return [(8, 8), (8, 2)] if world_size != 3 else [(6, 6), (6, 2)]
    if world_size == 3:
        return [(6, 6), (6, 3), (6, 1)]  # (6, 1): one KV head replicated over 3 ranks
    return [(8, 8), (8, 2)]  # at 4 ranks (8, 2) replicates each KV head twice


def reference(q, k, v, causal, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def check_case(rank, world_size, mesh, strategy, layout, causal, batch, heads, kv_heads, head_dim, seq_len):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((strategy, layout, causal, batch, heads, kv_heads)).encode()))
    q = torch.randn(batch, heads, seq_len, head_dim, generator=gen)
    k = torch.randn(batch, kv_heads, seq_len, head_dim, generator=gen)
    v = torch.randn(batch, kv_heads, seq_len, head_dim, generator=gen)
    dout = torch.randn(batch, heads, seq_len, head_dim, generator=gen)
    ref = reference(q, k, v, causal, dout)
    idx = shard_index(layout, world_size, rank, seq_len)
    ql, kl, vl = (t[:, :, idx].clone().requires_grad_() for t in (q, k, v))
    out = seqpar.attention(ql, kl, vl, mesh=mesh, strategy=strategy, causal=causal, layout=layout)
    out.backward(dout[:, :, idx])
    what = f"{strategy} {layout} causal={causal} B={batch} H={heads}/{kv_heads} D={head_dim} P={world_size}"
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, ql.grad, kl.grad, vl.grad), ref, strict=True):
        torch.testing.assert_close(got, want[:, :, idx], atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{what} {n}: {m}")


def qkv_case(heads, kv_heads, local_seq, head_dim=16):
    """Small random local inputs for checks that need no reference."""
    return (
        torch.randn(1, heads, local_seq, head_dim),
        torch.randn(1, kv_heads, local_seq, head_dim),
        torch.randn(1, kv_heads, local_seq, head_dim),
    )


def _auto_cases(rank, world_size, mesh):
    """ "auto" serves any head count: ulysses where the heads divide, ring where they do not."""
    for heads in (1, 3, 6, 8, 12):
        chosen = seqpar.resolve_strategy("auto", heads, heads, mesh)
        assert world_size == 1 or chosen == ("ulysses" if heads % world_size == 0 else "ring"), (heads, chosen)
        for causal in (True, False):
            check_case(rank, world_size, mesh, "auto", "zigzag", causal, 1, heads, heads, 32, 8 * world_size)


def _exact_worker(rank, world_size):
    mesh = seqpar.make_mesh()
    seq_len = 24 * world_size  # 12-token zigzag chunks
    for strategy in ("ring", "allgather", "ulysses"):
        for (heads, kv_heads), layout, causal, batch, head_dim in itertools.product(
            head_configs(world_size, strategy), ("zigzag", "contiguous"), (True, False), (1, 2), (64, 80)
        ):
            check_case(rank, world_size, mesh, strategy, layout, causal, batch, heads, kv_heads, head_dim, seq_len)
    _auto_cases(rank, world_size, mesh)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_strategy_matches_single_device(world_size):
    run_ranks(world_size, _exact_worker)


def _long_ring_worker(rank, world_size):
    """Sequences long enough for the ring backward to cut K/V into pieces (Note [ring backward])."""
    from seqpar.strategies.ring import _pieces_per_chunk
    from tests.test_masking import _check, packed_positions

    mesh = seqpar.make_mesh()
    for layout, causal, chunk in (("zigzag", True, 2048), ("contiguous", False, 512), ("zigzag", True, 512)):
        chunks = 2 if layout == "zigzag" else 1
        assert _pieces_per_chunk(chunk, "cpu") == (8 if chunk == 2048 else 2)
        seq_len = chunk * chunks * world_size
        check_case(rank, world_size, mesh, "ring", layout, causal, 1, 4, 2, 16, seq_len)
    positions = packed_positions(1024 * world_size, (700, 90, 1500, 37))[None]  # 512-token chunks: 2 pieces
    for window in (None, 300):
        _check(rank, world_size, mesh, "ring", "zigzag", 1, 4, 2, positions, window, prebuilt=False)
    if world_size == 4:  # hybrid 2 x 2: the ring carries 4 chunks of 1024 per rank, in 2 pieces
        check_case(rank, world_size, seqpar.make_mesh(ulysses_size=2), "hybrid", "zigzag", True, 1, 4, 2, 16, 8192)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_backward_in_pieces_matches_single_device(world_size):
    run_ranks(world_size, _long_ring_worker)
