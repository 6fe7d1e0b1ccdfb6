"""PyTorch's fused CPU flash-attention op, which returns the log-sum-exp and has a matching backward.

It runs grouped-query attention natively and takes boolean tile masks (as an additive -inf mask).
"""

from __future__ import annotations

import torch

from seqpar.kernels.base import AttentionKernel

__all__ = ["TorchCPUFlashKernel"]

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
        bias = _additive(mask, q.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale
        )
        if mask is not None:
            # the op reports lse 0 for a row that sees no key; the merge needs -inf there
            lse = lse.masked_fill(~mask.any(-1).expand(lse.shape), float("-inf"))
        return out, lse

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, mask=None):
        if mask is not None:
            # exp(score - inf) = 0: a row that sees no key gets no gradient (instead of NaN from -inf)
            lse = lse.masked_fill(lse == float("-inf"), float("inf"))
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=_additive(mask, q.dtype), scale=scale
        )
        return dq, dk, dv


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean keep-mask as the additive mask the op takes (0 where kept, -inf elsewhere)."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
