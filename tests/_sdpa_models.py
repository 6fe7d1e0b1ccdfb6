"""Plain-PyTorch models that call ``F.scaled_dot_product_attention`` directly, as context-parallel code does.

A GPT (token ids, RoPE table as a module buffer, grouped-query attention, a custom scale, optional
activation checkpointing) and a
DiT-style video block (non-causal attention over frames x patches, a fixed sin-cos position buffer).
Neither knows about seqpar; the tests run them under ``seqpar.context_parallel``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["GPT", "VideoBlock", "rope_table", "sincos_table"]


def rope_table(seq: int, head_dim: int) -> torch.Tensor:
    """``[seq, head_dim // 2, 2]``: cos and sin of each position's rotation angles (sequence dim 0)."""
    freqs = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq).float(), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, H, S, D]`` by the table rows of its positions (``table`` holds exactly those rows)."""
    pairs = x.unflatten(-1, (-1, 2))  # [B, H, S, D/2, 2]
    cos, sin = table[..., 0], table[..., 1]  # [S, D/2]
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, scale: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.scale = heads, kv_heads, dim // heads, scale
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class GPT(nn.Module):
    """Token ids ``[B, S]`` -> logits ``[B, S, vocab]``; ``self.rope`` is a ``[S, head_dim / 2, 2]`` buffer."""

    def __init__(self, vocab: int, dim: int, heads: int, kv_heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = nn.ModuleList(CausalSelfAttention(dim, heads, kv_heads, scale=0.3) for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(2 * layers + 1))
        self.mlps = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)) for _ in range(layers)
        )
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("rope", rope_table(seq, dim // heads))
        self.checkpointing = False  # recompute attention in the backward (activation checkpointing)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for i, (attn, mlp) in enumerate(zip(self.attn, self.mlps)):
            h = self.norms[2 * i](x)
            x = x + (checkpoint(attn, h, self.rope, use_reentrant=False) if self.checkpointing else attn(h, self.rope))
            x = x + mlp(self.norms[2 * i + 1](x))
        return self.head(self.norms[-1](x))


def sincos_table(seq: int, dim: int) -> torch.Tensor:
    """``[seq, dim]`` fixed sin-cos position embeddings (sequence dim 0)."""
    freqs = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2).float() / dim)
    angles = torch.outer(torch.arange(seq).float(), freqs)
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class VideoBlock(nn.Module):
    """DiT-style block over ``[B, frames * patches, channels]`` latents, conditioned on a timestep (adaLN).

    Attention is full (non-causal) across every patch of every frame; ``self.pos`` is a buffer.
    """

    def __init__(self, channels: int, dim: int, heads: int, tokens: int) -> None:
        super().__init__()
        self.heads = heads
        self.patch_in = nn.Linear(channels, dim)
        self.time = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, 4 * dim))
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.patch_out = nn.Linear(dim, channels)
        self.register_buffer("pos", sincos_table(tokens, dim))

    def forward(self, latents: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x = self.patch_in(latents) + self.pos
        shift1, scale1, shift2, scale2 = self.time(t[:, None]).unsqueeze(1).chunk(4, dim=-1)
        h = self.norm1(x) * (1 + scale1) + shift1
        b, s, d = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        x = x + self.mlp(self.norm2(x) * (1 + scale2) + shift2)
        return self.patch_out(x)
