"""Train a small video diffusion transformer on synthetic clips, each clip's tokens split over 2 CPU ranks.

    .venv/bin/python examples/video_context_parallel.py            # 2 gloo ranks, about a minute on 2 cores
    .venv/bin/python examples/video_context_parallel.py --ranks 3 --frames 12 --steps 100 --strategy ring

The model is plain PyTorch, written as for one device: a DiT whose attention is one non-causal
``F.scaled_dot_product_attention`` over every patch of every frame. The one seqpar line is
``seqpar.context_parallel(...)`` around the forward and backward, where torch's experimental
``context_parallel`` would stand: it shards the noisy clip tokens, the noise target and the model's
position table along the sequence (in place, restored on exit), and every SDPA call inside runs
``seqpar.attention`` across the ranks. Unlike torch's, it runs on CPU (gloo) and serves non-causal
attention with the balanced zigzag layout.

The task: each clip is a bright square moving at a random speed across dark frames; the model learns to
predict the noise added to the clip at a random level (epsilon prediction, cosine schedule). Each rank's
loss is the sum of its tokens' squared errors over the element count of the whole batch, so the losses
of the ranks add up to the batch mean and ``seqpar.reduce_gradients`` (a sum) gives its exact gradient.
"""

from __future__ import annotations

import argparse
import math
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import seqpar
from seqpar.runtime import spawn_ranks


def make_clips(batch: int, frames: int, size: int, gen: torch.Generator) -> torch.Tensor:
    """``[batch, frames, size, size]`` clips in [-1, 1]: a square of side size/4 moving in a straight line."""
    side = size // 4
    start = torch.rand(batch, 2, generator=gen) * (size - side)
    velocity = (torch.rand(batch, 2, generator=gen) - 0.5) * 2 * side / max(frames - 1, 1) * 2
    t = torch.arange(frames, dtype=torch.float32)[None, :, None]
    corner = (start[:, None] + velocity[:, None] * t).clamp(0, size - side)  # [B, T, 2]
    grid = torch.arange(size, dtype=torch.float32)
    inside_y = (grid[None, None] >= corner[..., :1]) & (grid[None, None] < corner[..., :1] + side)
    inside_x = (grid[None, None] >= corner[..., 1:]) & (grid[None, None] < corner[..., 1:] + side)
    return (inside_y[..., :, None] & inside_x[..., None, :]).float() * 2 - 1


def patchify(clips: torch.Tensor, patch: int) -> torch.Tensor:
    """``[B, T, H, W]`` -> ``[B, T * (H/p) * (W/p), p * p]`` tokens, frame-major (the sequence dim is 1)."""
    b, t, h, w = clips.shape
    x = clips.view(b, t, h // patch, patch, w // patch, patch).permute(0, 1, 2, 4, 3, 5)
    return x.reshape(b, t * (h // patch) * (w // patch), patch * patch)


def sincos(positions: torch.Tensor, dim: int) -> torch.Tensor:
    freqs = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2).float() / dim)
    angles = positions.float()[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class Block(nn.Module):
    """Pre-norm transformer block with adaLN modulation from the noise level; full attention."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.modulation = nn.Linear(dim, 6 * dim)
        nn.init.zeros_(self.modulation.weight)
        nn.init.zeros_(self.modulation.bias)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(cond)[:, None].chunk(6, dim=-1)
        h = self.norm1(x) * (1 + scale1) + shift1
        b, s, d = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)  # [B, H, S, D]: every patch of every frame
        x = x + gate1 * self.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + gate2 * self.mlp(self.norm2(x) * (1 + scale2) + shift2)


class VideoDiT(nn.Module):
    """Noisy tokens ``[B, S, p*p]`` and noise levels ``[B]`` -> predicted noise ``[B, S, p*p]``."""

    def __init__(self, token_dim: int, dim: int, heads: int, depth: int, frames: int, patches: int) -> None:
        super().__init__()
        self.dim = dim
        self.embed = nn.Linear(token_dim, dim)
        self.time = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.out = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, token_dim))
        # position of each token: half the channels say which frame, half which patch of the frame
        index = torch.arange(frames * patches)
        table = torch.cat([sincos(index // patches, dim // 2), sincos(index % patches, dim // 2)], dim=-1)
        self.register_buffer("pos", table)  # [S, dim], sequence dim 0

    def forward(self, x: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
        cond = self.time(sincos(level * 1000, self.dim))
        h = self.embed(x) + self.pos
        for block in self.blocks:
            h = block(h, cond)
        return self.out(h)


def noisy_batch(args: argparse.Namespace, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Clean tokens noised at a random level per clip: (noisy tokens, noise, level)."""
    x0 = patchify(make_clips(args.batch, args.frames, args.size, gen), args.patch)
    level = torch.rand(args.batch, generator=gen)
    noise = torch.randn(x0.shape, generator=gen)
    alpha, sigma = (torch.cos(level * math.pi / 2)[:, None, None], torch.sin(level * math.pi / 2)[:, None, None])
    return alpha * x0 + sigma * noise, noise, level


def train(rank: int, world: int, args: argparse.Namespace) -> None:
    mesh = init_device_mesh("cpu", (world,))  # what torch's context_parallel takes; seqpar meshes work too
    torch.manual_seed(0)  # same initial weights on every rank
    patches = (args.size // args.patch) ** 2
    model = VideoDiT(args.patch**2, args.dim, args.heads, args.depth, args.frames, patches)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1)  # every rank draws the same clips: the batch is replicated
    bar = None
    if rank == 0:
        from tqdm import tqdm

        tqdm.set_lock(threading.RLock())  # tqdm's default multiprocessing lock would leak a semaphore
        bar = tqdm(total=args.steps, desc=f"video DiT, {world} ranks", unit="step", disable=False)
    losses, start = [], time.perf_counter()
    tokens = args.frames * patches
    for _ in range(args.steps):
        noisy, noise, level = noisy_batch(args, gen)
        count = noise.numel()  # the whole batch's element count, taken before the block shards `noise`
        with seqpar.context_parallel(
            mesh, buffers=(noisy, noise, model.pos), buffer_seq_dims=(1, 1, 0), strategy=args.strategy
        ):
            loss = ((model(noisy, level) - noise) ** 2).sum() / count  # this rank's share of the batch mean
            loss.backward()
        seqpar.reduce_gradients(model.parameters(), mesh)  # summed: the exact gradient of the batch mean
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach()
        dist.all_reduce(total)
        losses.append(float(total))
        if bar is not None:
            rate = args.batch * tokens * len(losses) / (time.perf_counter() - start)
            bar.set_postfix(loss=f"{losses[-1]:.4f}", tokens_per_s=f"{rate:.0f}")
            bar.update()
    if bar is not None:
        bar.close()
        k = max(1, len(losses) // 10)
        print(
            f"{tokens} tokens per clip ({args.frames} frames x {patches} patches), {tokens // world} per rank; "
            f"loss {sum(losses[:k]) / k:.4f} (first {k} steps) -> {sum(losses[-k:]) / k:.4f} (last {k}); "
            f"{time.perf_counter() - start:.1f} s"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--frames", type=int, default=24)
    parser.add_argument("--size", type=int, default=16, help="frame height and width in pixels")
    parser.add_argument("--patch", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--strategy", default="auto", choices=seqpar.STRATEGIES)
    args = parser.parse_args(argv)
    spawn_ranks(train, args.ranks, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
