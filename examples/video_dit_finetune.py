"""Fine-tune a Wan-shaped video transformer from diffusers with the flow-matching loss, each clip's tokens split.

    torchrun --nproc-per-node 2 examples/video_dit_finetune.py                   # 2 CPU ranks, about a minute
    torchrun --nproc-per-node 2 examples/video_dit_finetune.py --strategy ulysses --per-token-timesteps

The model is diffusers' ``WanTransformer3DModel`` (a small config, random weights, nothing downloaded), called
as in one process on the whole latent clip. The seqpar lines: ``seqpar.prepare_diffusers(model, mesh)``
cuts the video tokens after patchify (and the RoPE tables of the frame x height x width grid), runs the
self-attention across the ranks, keeps the cross-attention to the text local and gathers the prediction
before it is unpatchified; ``seqpar.check_replicated`` checks that every rank drew the same noise and
latents (the model itself checks its arguments); ``seqpar.reduce_gradients`` sums the gradients over the
ranks, which gives one process's gradients (averaging them would halve them at 2 ranks).

The task: latent clips of a bright blob moving across 4 latent channels, a fixed random "text" embedding
per direction of motion; rectified flow (``x_t = (1 - t) x_0 + t noise``, the model predicts
``noise - x_0``), timesteps drawn uniformly, one per clip or (Wan 2.2 style) one per latent frame.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import WanTransformer3DModel

import seqpar

CHANNELS, TEXT_LEN, TEXT_DIM = 4, 16, 32


def latent_clips(batch: int, frames: int, size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, C, F, H, W]`` latents of a Gaussian blob moving left or right, and each clip's direction (0 or 1)."""
    direction = torch.randint(0, 2, (batch,), generator=gen)
    start = torch.rand(batch, generator=gen) * size
    t = torch.arange(frames, dtype=torch.float32)
    centre = (start[:, None] + (2 * direction[:, None] - 1) * t) % size  # [B, F]
    grid = torch.arange(size, dtype=torch.float32)
    blob = torch.exp(-((grid[None, None] - centre[..., None]) ** 2) / 4)  # [B, F, W]
    rows = torch.exp(-((grid - size / 2) ** 2) / 8)  # [H]
    clip = blob[:, :, None, :] * rows[None, None, :, None]  # [B, F, H, W]
    scales = torch.linspace(1.0, -1.0, CHANNELS)
    return clip[:, None] * scales[None, :, None, None, None], direction


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--frames", type=int, default=8, help="latent frames")
    parser.add_argument("--size", type=int, default=16, help="latent height and width")
    parser.add_argument("--strategy", default="ring", choices=seqpar.STRATEGIES)
    parser.add_argument("--layout", default="zigzag", choices=("zigzag", "contiguous"))
    parser.add_argument("--per-token-timesteps", action="store_true", help="one timestep per latent frame")
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = seqpar.make_mesh()  # all ranks in one sequence-parallel group
    torch.manual_seed(0)  # the same initial weights on every rank
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=16,
        in_channels=CHANNELS,
        out_channels=CHANNELS,
        text_dim=TEXT_DIM,
        freq_dim=32,
        ffn_dim=128,
        num_layers=2,
        rope_max_seq_len=64,
    )
    seqpar.prepare_diffusers(model, mesh, strategy=args.strategy, layout=args.layout)
    model.enable_gradient_checkpointing()
    prompts = torch.randn(2, TEXT_LEN, TEXT_DIM, generator=torch.Generator().manual_seed(2))  # one per direction
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1)  # every rank draws the same batch: the clip is replicated, then cut
    tokens = args.frames * (args.size // 2) ** 2
    losses, start = [], time.perf_counter()
    for _ in range(args.steps):
        x0, direction = latent_clips(args.batch, args.frames, args.size, gen)
        noise = torch.randn(x0.shape, generator=gen)
        shape = (args.batch, args.frames) if args.per_token_timesteps else (args.batch,)
        t = torch.rand(shape, generator=gen)
        t_b = t[:, None, :, None, None] if args.per_token_timesteps else t[:, None, None, None, None]
        noisy = (1 - t_b) * x0 + t_b * noise
        # per-token timesteps are per latent token: each frame's value repeated over its (H/2) x (W/2) patches
        timestep = t.repeat_interleave((args.size // 2) ** 2, dim=1) if args.per_token_timesteps else t
        seqpar.check_replicated(mesh, noise=noise, latents=x0)
        pred = model(noisy, timestep * 1000, prompts[direction], return_dict=False)[0]
        loss = F.mse_loss(pred, noise - x0)  # the same whole-clip loss on every rank (Note [replicated output])
        loss.backward()
        seqpar.reduce_gradients(model.parameters(), mesh)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if rank == 0:
        k = max(1, len(losses) // 5)
        print(
            f"{tokens} latent tokens per clip, {tokens // world} per rank ({args.strategy}, {args.layout}); "
            f"flow-matching loss {sum(losses[:k]) / k:.4f} (first {k} steps) -> {sum(losses[-k:]) / k:.4f} "
            f"(last {k}); {time.perf_counter() - start:.1f} s"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
