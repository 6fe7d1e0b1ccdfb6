"""Attention test cases shared by several test files: random inputs, packed-document masks, and checks of
one rank's shard of every strategy's output and gradients against single-device SDPA.
"""

from __future__ import annotations

import itertools
import zlib

import torch
import torch.nn.functional as F

import seqpar
from tests._dist import shard_index

__all__ = [
    "ATOL",
    "DOC_LENGTHS",
    "RTOL",
    "check_case",
    "check_mask_case",
    "dense_mask",
    "packed_positions",
    "qkv_case",
    "reference",
]

# fp32 tolerances against single-device fp32 SDPA (both are exact up to summation order).
ATOL, RTOL = 2e-5, 1e-4

DOC_LENGTHS = (5, 17, 1, 30, 11)  # uneven, so documents straddle every shard and chunk edge


def reference(q, k, v, causal, dout):
    """Single-device SDPA on the full sequence: output and the gradients of q, k, v."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def check_case(
    rank, world_size, mesh, strategy, layout, causal, batch, heads, kv_heads, head_dim, seq_len, v_head_dim=None
):
    """This rank's shard of ``strategy``'s output and gradients equals single-device SDPA (seeded per case);
    ``v_head_dim``: values of another head size than queries and keys (MLA)."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((strategy, layout, causal, batch, heads, kv_heads)).encode()))
    v_head_dim = v_head_dim or head_dim
    q = torch.randn(batch, heads, seq_len, head_dim, generator=gen)
    k = torch.randn(batch, kv_heads, seq_len, head_dim, generator=gen)
    v = torch.randn(batch, kv_heads, seq_len, v_head_dim, generator=gen)
    dout = torch.randn(batch, heads, seq_len, v_head_dim, generator=gen)
    ref = reference(q, k, v, causal, dout)
    idx = shard_index(layout, world_size, rank, seq_len)
    ql, kl, vl = (t[:, :, idx].clone().requires_grad_() for t in (q, k, v))
    out = seqpar.attention(ql, kl, vl, mesh=mesh, strategy=strategy, causal=causal, layout=layout)
    out.backward(dout[:, :, idx])
    what = f"{strategy} {layout} causal={causal} B={batch} H={heads}/{kv_heads} D={head_dim}/{v_head_dim}"
    what += f" P={world_size}"
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, ql.grad, kl.grad, vl.grad), ref, strict=True):
        torch.testing.assert_close(got, want[:, :, idx], atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{what} {n}: {m}")


def qkv_case(heads, kv_heads, local_seq, head_dim=16):
    """Small random local inputs for checks that need no reference."""
    return (
        torch.randn(1, heads, local_seq, head_dim),
        torch.randn(1, kv_heads, local_seq, head_dim),
        torch.randn(1, kv_heads, local_seq, head_dim),
    )


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


def check_mask_case(rank, world_size, mesh, strategy, layout, batch, heads, kv_heads, positions, window, prebuilt):
    """Causal attention over packed documents (and a window) on this rank's shard equals masked SDPA."""
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
