"""Local CPU kernels: out, log-sum-exp and gradients against SDPA, including masks and rows that see no key."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from seqpar.errors import SeqparInputError
from seqpar.sequence_parallel.kernels import ReferenceKernel, TorchCPUFlashKernel, select_kernel


def sdpa_with_lse(q, k, v, mask):
    """fp64 ground truth: out, lse and the scores' log-sum-exp per row (mask True = attend)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0).unsqueeze(-1))
    return p @ v, lse


CPU_KERNELS = [TorchCPUFlashKernel(), ReferenceKernel()]  # the CUDA kernels: tests/test_cuda.py


@pytest.mark.parametrize("kernel", CPU_KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 1)])
def test_kernel_forward_backward_match_sdpa(kernel, causal, heads):
    torch.manual_seed(0)
    q = torch.randn(2, heads[0], 40, 80, dtype=torch.float64)
    k = torch.randn(2, heads[1], 40, 80, dtype=torch.float64)
    v = torch.randn(2, heads[1], 40, 80, dtype=torch.float64)
    dout = torch.randn(2, heads[0], 40, 80, dtype=torch.float64)
    mask = torch.ones(40, 40, dtype=torch.bool).tril() if causal else None
    want_out, want_lse = sdpa_with_lse(q, k, v, mask)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal, enable_gqa=True).backward(dout)
    qf, kf, vf, df = (t.float() for t in (q, k, v, dout))
    out, lse = kernel.forward(qf, kf, vf, causal=causal, scale=80**-0.5)
    torch.testing.assert_close(out.double(), want_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-5, rtol=1e-4)
    grads = kernel.backward(df, qf, kf, vf, out, lse, causal=causal, scale=80**-0.5)
    for got, want in zip(grads, (qr.grad, kr.grad, vr.grad), strict=True):
        torch.testing.assert_close(got.double(), want, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("kernel", [ReferenceKernel(block_size=7), TorchCPUFlashKernel()], ids=lambda k: k.name)
def test_masked_kernels_any_mask_and_empty_rows(kernel):
    # block_size 7: several key blocks for the reference kernel, the last one partial
    torch.manual_seed(1)
    q, k, v, dout = (torch.randn(1, 2, 30, 16, dtype=torch.float64) for _ in range(4))
    mask = torch.rand(1, 2, 30, 30) > 0.6
    mask[:, :, 3] = False  # a row that sees no key: out 0, lse -inf, no gradient
    want_out, want_lse = sdpa_with_lse(q, k, v, mask)
    out, lse = kernel.forward(q.float(), k.float(), v.float(), causal=False, scale=0.25, mask=mask)
    assert torch.isneginf(lse[:, :, 3]).all() and (out[:, :, 3] == 0).all()
    torch.testing.assert_close(out.double(), want_out, atol=2e-6, rtol=1e-5)
    finite = ~torch.isneginf(want_lse)
    torch.testing.assert_close(lse.double()[finite], want_lse[finite], atol=2e-6, rtol=1e-5)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, _ = sdpa_with_lse(qr, kr, vr, mask)
    ref_out.backward(dout)
    grads = kernel.backward(
        dout.float(), q.float(), k.float(), v.float(), out, lse, causal=False, scale=0.25, mask=mask
    )
    assert all(torch.isfinite(g).all() for g in grads)
    for got, want in zip(grads, (qr.grad, kr.grad, vr.grad), strict=True):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)


def test_selection_is_visible_and_overridable():
    q = torch.randn(1, 2, 8, 16)
    assert select_kernel(q, q, q).name == "torch_cpu_flash"
    assert select_kernel(q, q, q, "reference").name == "reference"
    assert select_kernel(q, q, q, mask=torch.ones(8, 8, dtype=torch.bool)).name == "reference"
    with pytest.raises(SeqparInputError, match="unknown attention kernel 'nope'"):
        select_kernel(q, q, q, "nope")
    with pytest.raises(SeqparInputError, match="torch_cpu_flash: it supports"):
        select_kernel(q.double(), q.double(), q.double(), TorchCPUFlashKernel())


@pytest.mark.parametrize("causal", [True, False])
def test_reference_kernel_soft_caps_logits(causal):
    """Scores capped to c * tanh(s / c) before the softmax (Gemma 2), forward and backward, against float64."""
    torch.manual_seed(2)
    q, k, v, dout = (torch.randn(1, 4, 24, 16, dtype=torch.float64) for _ in range(4))
    k = k[:, :2]
    v = v[:, :2]
    q = 3 * q  # scores of several units: the cap bends them
    mask = torch.ones(24, 24, dtype=torch.bool).tril() if causal else None
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    g = 2
    s = (qr @ kr.repeat_interleave(g, 1).transpose(-1, -2)) * 0.25
    s = 2.0 * torch.tanh(s / 2.0)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    want = s.softmax(-1) @ vr.repeat_interleave(g, 1)
    want.backward(dout)
    kernel = select_kernel(q.float(), k.float(), v.float(), softcap=2.0)
    assert isinstance(kernel, ReferenceKernel) and kernel.softcap == 2.0
    kernel.block_size = 7  # several key blocks
    out, lse = kernel.forward(q.float(), k.float(), v.float(), causal=causal, scale=0.25)
    torch.testing.assert_close(out.double(), want.detach(), atol=2e-6, rtol=1e-5)
    grads = kernel.backward(dout.float(), q.float(), k.float(), v.float(), out, lse, causal=causal, scale=0.25)
    for got, ref in zip(grads, (qr.grad, kr.grad, vr.grad), strict=True):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-4)
    # the fused ops take no score modification: asking for one with a cap is refused, naming what works
    with pytest.raises(SeqparInputError, match="torch_cpu_flash has no logit soft-capping"):
        select_kernel(q.float(), k.float(), v.float(), "torch_cpu_flash", softcap=2.0)


def test_sinks_merge_last_without_nan():
    """A sink is one more (out 0, lse z) term; rows that saw no key keep out 0, and -inf sinks change nothing."""
    from seqpar.sequence_parallel.kernels.sinks import add_sinks, sink_grad

    out = torch.randn(1, 2, 3, 4)
    lse = torch.tensor([[[0.5, float("-inf"), 1.0], [2.0, float("-inf"), 0.0]]])
    for z in (torch.tensor([0.3, -1.0]), torch.tensor([float("-inf"), float("-inf")])):
        got, new = add_sinks(out.masked_fill(torch.isinf(lse)[..., None], 0), lse, z)
        assert torch.isfinite(got).all() and (got[:, :, 1] == 0).all()
        want = torch.logaddexp(lse, z.view(1, -1, 1))
        torch.testing.assert_close(new, want)
        assert torch.isfinite(sink_grad(torch.randn_like(out), got, new, z)).all()
