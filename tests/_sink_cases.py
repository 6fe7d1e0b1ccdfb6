"""Attention sinks and logit soft-capping under every strategy: one rank's output and gradients (and the summed
sink gradient) against a float64 eager reference on the whole sequence.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

import seqpar
from tests._cases import dense_mask, packed_positions
from tests._dist import shard_index

__all__ = ["SINK_ATOL", "SINK_RTOL", "check_sink_case", "check_sinks_softcap", "eager_attention", "sink_cases"]

# fp32 seqpar against a float64 reference: the rounding of one fp32 pass, as in tests._cases
SINK_ATOL, SINK_RTOL = 2e-5, 1e-4
SOFTCAP = 1.5  # well inside the range of the scores below (|s| up to ~6), so tanh bends them


def eager_attention(q, k, v, keep, sinks, softcap, scale):
    """Attention written out: capped scores, keep-mask, a sink column of value 0 (as transformers' eager)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale  # [B, H, S, S]
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    if sinks is None:
        return s.softmax(-1) @ v
    column = sinks.view(1, -1, 1, 1).expand(*s.shape[:3], 1)
    return torch.cat([s, column], -1).softmax(-1)[..., :-1] @ v


def check_sinks_softcap(
    rank, world_size, mesh, strategy, layout, causal, heads, kv_heads, *, sinks, softcap, window=None, packed=False
):
    """This rank's shard of seqpar.attention with sinks and/or softcap equals the eager float64 reference.

    With sinks, their gradient summed over the SP ranks equals the reference's (a replicated parameter).
    """
    seq_len, head_dim = 16 * world_size, 16
    what = f"{strategy} {layout} causal={causal} H={heads}/{kv_heads} sinks={sinks} softcap={softcap} "
    what += f"window={window} packed={packed} P={world_size}"
    gen = torch.Generator().manual_seed(zlib.crc32(what.encode()))
    q = 2 * torch.randn(1, heads, seq_len, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(1, kv_heads, seq_len, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(1, kv_heads, seq_len, head_dim, generator=gen, dtype=torch.float64)
    z = torch.randn(heads, generator=gen, dtype=torch.float64) + 2  # p_sink of order 0.1
    dout = torch.randn(1, heads, seq_len, head_dim, generator=gen, dtype=torch.float64)
    positions = packed_positions(seq_len)[None] if packed else torch.arange(seq_len)[None]
    keep = dense_mask(positions, causal, window) if (causal or packed) else None
    ins = [t.clone().requires_grad_() for t in (q, k, v, z)]
    want = eager_attention(*ins[:3], keep, ins[3] if sinks else None, softcap, head_dim**-0.5)
    want.backward(dout)
    idx = shard_index(layout, world_size, rank, seq_len)
    ql, kl, vl = (t[:, :, idx].float().requires_grad_() for t in (q, k, v))
    zl = z.float().requires_grad_()
    out = seqpar.attention(
        ql,
        kl,
        vl,
        mesh=mesh,
        strategy=strategy,
        causal=causal,
        layout=layout,
        window=window,
        position_ids=positions[:, idx] if packed else None,
        sinks=zl if sinks else None,
        softcap=softcap,
    )
    out.backward(dout[:, :, idx].float())
    errors = {}
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, ql.grad, kl.grad, vl.grad), (want, *ins[:3])):
        ref = ref if name == "out" else ref.grad
        errors[name] = float((got.detach().double() - ref[:, :, idx].detach()).abs().max())
        torch.testing.assert_close(
            got.double(),
            ref[:, :, idx].detach(),
            atol=SINK_ATOL,
            rtol=SINK_RTOL,
            msg=lambda m, n=name: f"{what} {n}: {m}",
        )
    if sinks:
        dz = zl.grad.clone()
        if world_size > 1:
            dist.all_reduce(dz, group=mesh.sp_group)  # summed like every replicated parameter's gradient
        errors["dsinks"] = float((dz.double() - ins[3].grad).abs().max())
        torch.testing.assert_close(
            dz.double(), ins[3].grad, atol=SINK_ATOL, rtol=SINK_RTOL, msg=lambda m: f"{what} dsinks: {m}"
        )
    else:
        assert zl.grad is None
    return errors


def sink_cases(world_size: int) -> list[tuple[str, dict]]:
    """(id, case) for every strategy that applies at this world size: sinks, softcap, both, packed documents + window.

    Each case runs by ``check_sink_case``.
    """
    heads = (6, 2) if world_size == 3 else (8, 2)
    ulysses_heads = {1: (8, 2), 2: (8, 4), 3: (6, 3), 4: (8, 2)}[world_size]  # P=2: grouped; P=4: KV repeated
    runs = [("ring", 1, heads), ("allgather", 1, heads), ("ulysses", 1, ulysses_heads)]
    if world_size == 4:
        runs.append(("hybrid", 2, (8, 2)))
    variants = [
        ("sinks", dict(layout="zigzag", causal=True, sinks=True, softcap=None)),
        ("sinks-softcap-full", dict(layout="contiguous", causal=False, sinks=True, softcap=SOFTCAP)),
        ("softcap", dict(layout="zigzag", causal=True, sinks=False, softcap=SOFTCAP)),
        (
            "sinks-softcap-packed-window",
            dict(layout="zigzag", causal=True, sinks=True, softcap=SOFTCAP, window=5, packed=True),
        ),
    ]
    return [
        (f"{strategy}-{name}", dict(strategy=strategy, ulysses_size=u, heads=h, kv_heads=kv, **case))
        for strategy, u, (h, kv) in runs
        for name, case in variants
    ]


def check_sink_case(rank: int, world_size: int, case: dict) -> dict[str, float]:
    """Run one case of ``sink_cases`` on this rank; returns its largest error of each quantity."""
    case = dict(case)
    mesh = seqpar.make_mesh(ulysses_size=case.pop("ulysses_size"))
    return check_sinks_softcap(rank, world_size, mesh, case.pop("strategy"), **case)
