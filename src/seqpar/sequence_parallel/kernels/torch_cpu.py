"""PyTorch's fused CPU flash-attention op, which returns the log-sum-exp and has a matching backward.

It runs grouped-query attention natively and takes boolean tile masks (as an additive -inf mask).
"""

from __future__ import annotations

import torch

from seqpar.sequence_parallel.kernels.base import AttentionKernel, additive_mask, mark_empty_rows, unmark_empty_rows

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class TorchCPUFlashKernel(AttentionKernel):
    """``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward."""

    name = "torch_cpu_flash"
    takes_masks = True

    def unsupported_reason(self, q, k, v, mask):
        if not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
            return "this PyTorch build has no fused CPU flash attention"
        if q.device.type != "cpu":
            return f"it runs on CPU only (inputs are on {q.device.type})"
        if q.dtype not in _DTYPES:
            return f"it supports {_DTYPES}, not {q.dtype}"
        if mask is not None and mask.dim() != 4:
            return "it takes a [B or 1, H or 1, Sq, Sk] mask only"
        return None

    def forward(self, q, k, v, *, causal, scale, mask=None):
        bias = None if mask is None else additive_mask(mask, q.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale
        )
        if mask is not None:
            # the op reports lse 0 for a row that sees no key; the merge needs -inf there
            out, lse = mark_empty_rows(out, lse, mask)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, mask=None):
        bias = None
        if mask is not None:
            lse, bias = unmark_empty_rows(lse), additive_mask(mask, q.dtype)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
        )
        return dq, dk, dv
