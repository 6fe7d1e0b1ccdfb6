"""bf16 accuracy does not degrade with world size: error vs an fp64 reference <= 1.5x single-device bf16 SDPA.

Error = ||x - x_fp64|| / ||x_fp64|| over the whole gathered tensor, for the output and each gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import seqpar
from tests._dist import run_ranks

RATIO = 1.5


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm())


def _grads(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _bf16_worker(rank, world_size, causal, layout):
    mesh = seqpar.make_mesh()
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, h, 512, 64, generator=gen).bfloat16() for h in (8, 2, 2))
    dout = torch.randn(1, 8, 512, 64, generator=gen).bfloat16()
    exact = _grads(
        lambda a, b, c, causal=causal: F.scaled_dot_product_attention(a, b, c, is_causal=causal, enable_gqa=True),
        *(t.double() for t in (q, k, v, dout)),
    )
    single = _grads(
        lambda a, b, c, causal=causal: F.scaled_dot_product_attention(a, b, c, is_causal=causal, enable_gqa=True),
        q,
        k,
        v,
        dout,
    )
    for sp_mesh, size in ((None, 1), (mesh, world_size)):
        strategies = ("ring",) if size == 1 else ("ring", "ulysses", "allgather")
        for strategy in strategies:
            local = (seqpar.shard_sequence(t, sp_mesh, dim=2, layout=layout) for t in (q, k, v, dout))

            def fn(a, b, c, strategy=strategy, sp_mesh=sp_mesh, causal=causal, layout=layout):
                return seqpar.attention(a, b, c, mesh=sp_mesh, strategy=strategy, causal=causal, layout=layout)

            ours = [seqpar.gather_sequence(t, sp_mesh, dim=2, layout=layout) for t in _grads(fn, *local)]
            for name, got, base, ref in zip(("out", "dq", "dk", "dv"), ours, single, exact, strict=True):
                assert got.dtype == torch.bfloat16
                err, base_err = _rel_err(got, ref), _rel_err(base, ref)
                assert err <= RATIO * base_err, (
                    f"{strategy} P={size} causal={causal} {layout} {name}: error {err:.2e} > {RATIO} x {base_err:.2e}"
                )


@pytest.mark.parametrize(
    ("causal", "layout"),
    [(True, "zigzag"), (False, "contiguous"), (True, "contiguous")],
    ids=["causal-zigzag", "full-contiguous", "causal-contiguous"],
)
def test_bf16_error_does_not_grow_with_world_size(causal, layout):
    run_ranks(4, _bf16_worker, causal, layout)
