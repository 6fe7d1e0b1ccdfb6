"""PyTorch's fused CUDA attention ops (cuDNN, flash, memory-efficient) behind the seqpar kernel contract.

All return the log-sum-exp and have a backward that accepts the caller's out and lse, so blocks merge exactly.
"""

from __future__ import annotations

import torch

from seqpar.sequence_parallel.kernels.base import AttentionKernel, additive_mask, mark_empty_rows, unmark_empty_rows

_LSE_ALIGN = 32  # the memory-efficient op pads its log-sum-exp rows to a multiple of this
_BIAS_ALIGN = 16  # and wants the additive mask's row stride to be a multiple of this


def _cuda_reason(q: torch.Tensor, op: str) -> str | None:
    if not hasattr(torch.ops.aten, op):
        return f"this PyTorch build has no {op}"
    if q.device.type != "cuda":
        return f"it runs on CUDA only (inputs are on {q.device.type})"
    return None


def _half_unmasked_reason(
    q: torch.Tensor, mask: torch.Tensor | None, max_head_dim: int, min_capability: tuple[int, int]
) -> str | None:
    """The checks shared by the fp16/bf16-only, mask-free ops (cuDNN, flash)."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"it supports float16 and bfloat16, not {q.dtype}"
    if q.shape[-1] % 8 or q.shape[-1] > max_head_dim:
        return f"head_dim must be a multiple of 8 up to {max_head_dim}, not {q.shape[-1]}"
    if mask is not None:
        return "it takes no mask"
    if torch.cuda.get_device_capability(q.device) < min_capability:
        return f"it is used on GPUs of compute capability {min_capability[0]}.{min_capability[1]} or newer"
    return None


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, Hkv, S, D]`` -> ``[B, H, S, D]``, query head h reading KV head ``h // (H // Hkv)``."""
    b, kv_heads, s, d = t.shape
    if kv_heads == heads:
        return t
    return t[:, :, None].expand(b, kv_heads, heads // kv_heads, s, d).reshape(b, heads, s, d)


def _reduce_kv(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum a ``[B, H, S, D]`` key/value gradient over each KV head's query group."""
    b, heads, s, d = grad.shape
    if kv_heads == heads:
        return grad
    return grad.view(b, kv_heads, heads // kv_heads, s, d).sum(2)


class TorchCUDAFlashKernel(AttentionKernel):
    """``aten._scaled_dot_product_flash_attention`` (FlashAttention-2 inside PyTorch) and its backward.

    fp16/bf16 only, head_dim a multiple of 8 up to 256, no masks (masked tiles go to a kernel that takes them).
    """

    name = "torch_cuda_flash"
    takes_masks = False

    def unsupported_reason(self, q, k, v, mask):
        reason = _cuda_reason(q, "_scaled_dot_product_flash_attention_backward")
        return reason or _half_unmasked_reason(q, mask, max_head_dim=256, min_capability=(8, 0))

    def forward(self, q, k, v, *, causal, scale, mask=None):
        heads = q.shape[1]
        result = torch.ops.aten._scaled_dot_product_flash_attention(
            q, _expand_kv(k, heads), _expand_kv(v, heads), 0.0, causal, False, scale=scale
        )
        return result[0], result[1]

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, mask=None):
        heads, kv_heads = q.shape[1], k.shape[1]
        # no dropout: the random-state tensors are never read, and there are no variable-length offsets
        unused = torch.empty(0, dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout.contiguous(),
            q,
            _expand_kv(k, heads),
            _expand_kv(v, heads),
            out.to(q.dtype).contiguous(),
            lse.contiguous(),
            None,
            None,
            q.shape[2],
            k.shape[2],
            0.0,
            causal,
            unused,
            unused,
            scale=scale,
        )
        return dq, _reduce_kv(dk, kv_heads), _reduce_kv(dv, kv_heads)


class TorchCuDNNKernel(AttentionKernel):
    """``aten._scaled_dot_product_cudnn_attention`` (cuDNN's fused attention) and its backward.

    Preferred on Hopper and newer, where it is the fastest of PyTorch's ops; fp16/bf16, head_dim a multiple of
    8 up to 128, no masks.
    """

    name = "torch_cudnn"
    takes_masks = False

    def unsupported_reason(self, q, k, v, mask):
        reason = _cuda_reason(q, "_scaled_dot_product_cudnn_attention_backward")
        if reason is None and not torch.backends.cudnn.is_available():
            reason = "cuDNN is not available"
        # on older GPUs cuDNN runs too, but flash is the better choice there
        return reason or _half_unmasked_reason(q, mask, max_head_dim=128, min_capability=(9, 0))

    def forward(self, q, k, v, *, causal, scale, mask=None):
        heads = q.shape[1]
        result = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, _expand_kv(k, heads), _expand_kv(v, heads), None, True, 0.0, causal, False, scale=scale
        )
        return result[0], result[1].reshape(q.shape[:3])  # cuDNN's statistics come as [B, H, Sq, 1]

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, mask=None):
        heads, kv_heads = q.shape[1], k.shape[1]
        unused = torch.zeros((), dtype=torch.int64, device=q.device)
        # every operand [B, H, S, D]-contiguous, the layout of the op's own output (a [B, S, H, D] out/dout
        # gave wrong dq in one case on an H200 with PyTorch 2.11)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout.to(q.dtype).contiguous(),
            q.contiguous(),
            _expand_kv(k, heads).contiguous(),
            _expand_kv(v, heads).contiguous(),
            out.to(q.dtype).contiguous(),
            lse.reshape(*lse.shape, 1).contiguous(),
            unused,
            unused,
            None,
            None,
            None,
            q.shape[2],
            k.shape[2],
            0.0,
            causal,
            scale=scale,
        )
        return dq, _reduce_kv(dk, kv_heads), _reduce_kv(dv, kv_heads)


class TorchCUDAEfficientKernel(AttentionKernel):
    """``aten._scaled_dot_product_efficient_attention`` (memory-efficient attention) and its backward.

    fp32/fp16/bf16 and boolean tile masks (as an additive mask); rows that see no key give out 0, lse -inf.
    """

    name = "torch_cuda_efficient"
    takes_masks = True

    def unsupported_reason(self, q, k, v, mask):
        reason = _cuda_reason(q, "_scaled_dot_product_efficient_attention_backward")
        if reason is not None:
            return reason
        if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return f"it supports float32, float16 and bfloat16, not {q.dtype}"
        align = 4 if q.dtype == torch.float32 else 8
        if q.shape[-1] % align:
            return f"head_dim must be a multiple of {align} for {q.dtype}, not {q.shape[-1]}"
        if mask is not None and mask.dim() != 4:
            return "it takes a [B or 1, H or 1, Sq, Sk] mask only"
        return None

    def forward(self, q, k, v, *, causal, scale, mask=None):
        heads = q.shape[1]
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, _expand_kv(k, heads), _expand_kv(v, heads), _bias(mask, q, k), True, 0.0, causal, scale=scale
        )
        lse = lse[:, :, : q.shape[2]]
        if mask is not None:
            out, lse = mark_empty_rows(out, lse, mask)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, mask=None):
        heads, kv_heads = q.shape[1], k.shape[1]
        rows = q.shape[2]
        padded = lse.new_zeros((*lse.shape[:2], -(-rows // _LSE_ALIGN) * _LSE_ALIGN))
        padded[:, :, :rows] = unmark_empty_rows(lse) if mask is not None else lse
        unused = torch.empty(0, dtype=torch.int64, device=q.device)
        bias = _bias(mask, q, k)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout.contiguous(),
            q,
            _expand_kv(k, heads),
            _expand_kv(v, heads),
            bias,
            _heads_inner(out.to(q.dtype)),
            padded,
            unused,
            unused,
            0.0,
            [True, True, True, False],
            causal,
            scale=scale,
        )
        return dq, _reduce_kv(dk, kv_heads), _reduce_kv(dv, kv_heads)


def _heads_inner(out: torch.Tensor) -> torch.Tensor:
    """``out`` ``[B, H, S, D]`` stored as ``[B, S, H, D]``, the layout the op's forward returns.

    The backward's half-precision path assumes that layout for ``out`` (given a ``[B, H, S, D]``-contiguous
    ``out`` it returned wrong dq and dk on an H200 with PyTorch 2.11, while dv and float32 were right).
    """
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def _bias(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """The additive ``[B, H, Sq, Sk]`` mask, its rows padded in memory to the op's alignment."""
    if mask is None:
        return None
    b, h, sq, _ = q.shape
    sk = k.shape[2]
    storage = q.new_empty((b, h, sq, -(-sk // _BIAS_ALIGN) * _BIAS_ALIGN))
    bias = storage[..., :sk]
    bias.copy_(additive_mask(mask, q.dtype).expand(b, h, sq, sk))
    return bias
