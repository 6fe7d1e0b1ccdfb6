"""Blockwise attention in plain PyTorch: any device, any boolean mask, logit soft-capping, fp32 inside.

It is the portable fallback, the kernel of soft-capped models, and the yardstick of the fused kernels.

Note [logit soft-capping]
    Gemma 2 caps every score before the softmax: s = c * tanh(r / c) with r = scale * q.k (masking after).
    The cap is elementwise and inside the softmax, so the log-sum-exp merge of Note [LSE merge] is unchanged:
    a block's (out, lse) are those of the capped scores. Backward: dr = ds * (1 - tanh(r / c)^2), with ds the
    ordinary softmax backward of the capped scores (p (dO.v - rowsum(dO * O))). PyTorch's fused attention
    ops take no score modification, so the soft-capped path runs this kernel on every device (on CUDA too:
    fp32 matmuls over key blocks of ``block_size`` columns); ``select_kernel`` picks it for ``softcap``.
"""

from __future__ import annotations

import torch

from seqpar.sequence_parallel.kernels.base import AttentionKernel
from seqpar.sequence_parallel.kernels.merge import merge_into


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, s, d = q.shape
    return q.reshape(b, kv_heads, h // kv_heads, s, d)  # [B, Hkv, G, Sq, D]


def _block_mask(
    causal: bool, mask: torch.Tensor | None, rows: int, cols: slice, device: torch.device
) -> torch.Tensor | None:
    """Boolean keep-mask for key columns ``cols``, shaped to broadcast against [B, Hkv, G, Sq, kb]."""
    keep = None
    if causal:
        r = torch.arange(rows, device=device)[:, None]
        c = torch.arange(cols.start, cols.stop, device=device)[None, :]
        keep = c <= r
    if mask is not None:
        m = mask[..., cols]
        keep = m if keep is None else keep & m
    return keep


def _scores(
    qg: torch.Tensor, kb: torch.Tensor, scale: float, softcap: float | None, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scores ``[B, Hkv, G, Sq, kb]`` of one key block, ALiBi-biased (Note [ALiBi]) and soft-capped (Note [logit
    soft-capping]), and the tanh."""
    s = torch.matmul(qg, kb.transpose(-1, -2)).mul_(scale)
    if bias is not None:
        s = s.add_(bias)
    if softcap is None:
        return s, None
    t = torch.tanh(s / softcap)
    return t * softcap, t


def _mask_heads(mask: torch.Tensor | None, kv_heads: int, heads: int) -> torch.Tensor | None:
    """Put a [.., H or 1, Sq, Sk] mask into the grouped [.., Hkv, G, Sq, Sk] head layout."""
    if mask is None or mask.dim() < 3:
        return mask
    if mask.dim() == 3:
        mask = mask.unsqueeze(0)
    if mask.shape[1] == 1:
        return mask.unsqueeze(2)  # [B, 1, 1, Sq, Sk]
    return mask.reshape(mask.shape[0], kv_heads, heads // kv_heads, *mask.shape[-2:])


class ReferenceKernel(AttentionKernel):
    """Pure-PyTorch attention over key blocks of ``block_size`` columns (memory O(Sq * block_size)).

    With ``softcap`` every score is capped to ``softcap * tanh(score / softcap)`` (Note [logit soft-capping]);
    ``forward`` and ``backward`` take an ``AlibiBias`` (Note [ALiBi]) as ``alibi=``.
    """

    name = "reference"
    takes_masks = True

    def __init__(self, block_size: int = 1024, softcap: float | None = None) -> None:
        self.block_size = block_size
        self.softcap = softcap

    def __repr__(self) -> str:
        cap = "" if self.softcap is None else f" softcap={self.softcap}"
        return f"<seqpar kernel {self.name}{cap}>"

    def unsupported_reason(self, q, k, v, mask):
        return None

    def _blocks(self, sk: int):
        for start in range(0, sk, self.block_size):
            yield slice(start, min(start + self.block_size, sk))

    def forward(self, q, k, v, *, causal, scale, mask=None, alibi=None):
        b, h, sq, d = q.shape
        hkv = k.shape[1]
        qg = _grouped(q.float(), hkv)
        mask = _mask_heads(mask, hkv, h)
        out = q.new_zeros((b, hkv, h // hkv, sq, d), dtype=torch.float32)
        lse = torch.full((b, hkv, h // hkv, sq), float("-inf"), device=q.device)
        for cols in self._blocks(k.shape[2]):
            kb = k[:, :, None, cols].float()  # [B, Hkv, 1, kb, D]
            vb = v[:, :, None, cols].float()
            bias = None if alibi is None else alibi.scores(hkv, cols)  # Note [ALiBi]
            s, _ = _scores(qg, kb, scale, self.softcap, bias)  # [B, Hkv, G, Sq, kb]
            keep = _block_mask(causal, mask, sq, cols, q.device)
            if keep is not None:
                s = s.masked_fill(~keep, float("-inf"))
            lse_b = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - lse_b.masked_fill(lse_b == float("-inf"), 0).unsqueeze(-1))
            merge_into(out, lse, torch.matmul(p, vb), lse_b)
        return out.reshape(b, h, sq, d).to(q.dtype), lse.reshape(b, h, sq)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, mask=None, alibi=None):
        b, h, sq, d = q.shape
        hkv = k.shape[1]
        qg = _grouped(q.float(), hkv)
        dog = _grouped(dout.float(), hkv)
        mask = _mask_heads(mask, hkv, h)
        lse_g = lse.reshape(b, hkv, h // hkv, sq, 1)
        lse_g = lse_g.masked_fill(lse_g == float("-inf"), float("inf"))  # exp(s - inf) = 0: unseen rows
        delta = (dog * _grouped(out.float(), hkv)).sum(-1, keepdim=True)  # [B, Hkv, G, Sq, 1]
        dq = torch.zeros_like(qg)
        dk = torch.empty(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        for cols in self._blocks(k.shape[2]):
            kb = k[:, :, None, cols].float()
            vb = v[:, :, None, cols].float()
            s, t = _scores(qg, kb, scale, self.softcap, None if alibi is None else alibi.scores(hkv, cols))
            keep = _block_mask(causal, mask, sq, cols, q.device)
            if keep is not None:
                s = s.masked_fill(~keep, float("-inf"))
            p = torch.exp(s - lse_g)  # [B, Hkv, G, Sq, kb]
            dv[:, :, cols] = torch.matmul(p.transpose(-1, -2), dog).sum(2)
            ds = p * (torch.matmul(dog, vb.transpose(-1, -2)) - delta)
            if t is not None:
                ds = ds * (1 - t * t)  # through the cap (Note [logit soft-capping])
            dq += torch.matmul(ds, kb) * scale
            dk[:, :, cols] = (torch.matmul(ds.transpose(-1, -2), qg) * scale).sum(2)
        return dq.reshape(b, h, sq, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
