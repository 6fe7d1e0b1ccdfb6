"""PyTorch's fused CPU flash-attention op, which returns the log-sum-exp and has a matching backward.

It runs grouped-query attention natively and never materialises the [Sq, Sk] score matrix.
"""

from __future__ import annotations

import torch

from seqpar.kernels.base import AttentionKernel

__all__ = ["TorchCPUFlashKernel"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class TorchCPUFlashKernel(AttentionKernel):
    """``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward."""

    name = "torch_cpu_flash"

    def unsupported_reason(self, q, k, v, mask):
        if not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
            return "this PyTorch build has no fused CPU flash attention"
        if q.device.type != "cpu":
            return f"it runs on CPU only (inputs are on {q.device.type})"
        if q.dtype not in _DTYPES:
            return f"it supports {_DTYPES}, not {q.dtype}"
        if mask is not None:
            return "it takes no custom boolean mask (use the reference kernel)"
        return None

    def forward(self, q, k, v, *, causal, scale, mask=None):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, mask=None):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
        return dq, dk, dv
