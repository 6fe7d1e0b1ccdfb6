"""``python -m benchmarks.video_dit``: per-rank peak memory and step time of one Wan-shaped training step at sp 1 2 4.

Run::

    python -m benchmarks.video_dit                                  # 8K latent tokens, sp 1 2 4, ring
    python -m benchmarks.video_dit --tokens 8192 16384 --sp 1 2 4 --json video_dit_cpu.json

Every degree runs in fresh processes, one thread a rank: diffusers' ``WanTransformer3DModel`` (a small config,
random weights) through ``seqpar.prepare_diffusers``, a warm-up step, then one measured step (forward on the
whole latent clip, flow-matching loss, backward, gradient sum, SGD update). Memory = growth of the resident-set
peak (VmHWM) during the step above the resident set before it, in a second run under ``MEMORY_RUN_ENV``
(``seqpar.bench.measure``). The first step's loss of every run is checked against sp 1's. Beside it,
``seqpar.memory.estimate_dit_memory``'s step growth from a profile traced on the same model at two small clips
(Note [DiT memory]). Several ``--tokens`` run one after another, each with every degree.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks import save_records

__all__ = ["estimate_mb", "main", "wan_model"]

TEXT_LEN, TEXT_DIM, CHANNELS = 64, 64, 16


def wan_model(cfg: dict) -> torch.nn.Module:
    """A Wan 2.x transformer of width ``dim`` (head size 32), ``layers`` blocks, FFN 2x; seed 0."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=cfg["dim"] // 32,
        attention_head_dim=32,
        in_channels=CHANNELS,
        out_channels=CHANNELS,
        text_dim=TEXT_DIM,
        freq_dim=64,
        ffn_dim=2 * cfg["dim"],
        num_layers=cfg["layers"],
        rope_max_seq_len=1024,
    )


def _grid(tokens: int, frames: int) -> tuple[int, int, int]:
    """Latent (frames, height, width) with ``frames * (height / 2) * (width / 2) == tokens`` after the 1 x 2 x 2
    patchify, the patch grid as square as the count allows."""
    if tokens % frames:
        raise SystemExit(f"--tokens {tokens} is not a multiple of {frames} frames")
    per_frame = tokens // frames
    rows = max(d for d in range(1, math.isqrt(per_frame) + 1) if per_frame % d == 0)
    return frames, 2 * rows, 2 * (per_frame // rows)


def _clip(tokens: int, frames: int) -> tuple[dict, torch.Tensor]:
    """The model's arguments for a clip of ``tokens`` latent tokens and its flow-matching target (seed 1)."""
    frames, height, width = _grid(tokens, frames)
    gen = torch.Generator().manual_seed(1)
    latents = torch.randn(1, CHANNELS, frames, height, width, generator=gen)
    noise = torch.randn(latents.shape, generator=gen)
    text = torch.randn(1, TEXT_LEN, TEXT_DIM, generator=gen)
    t = torch.tensor([0.6])
    inputs = dict(hidden_states=(1 - t) * latents + t * noise, timestep=t * 1000, encoder_hidden_states=text)
    return inputs, noise - latents


def estimate_mb(cfg: dict, tokens: int, sp: int) -> float:
    """``estimate_dit_memory``'s step growth (MiB) of the step ``_worker`` measures, from a traced profile."""
    from seqpar.memory import estimate_dit_memory, profile_dit_memory

    frames = cfg["frames"]
    profile = profile_dit_memory(wan_model(cfg), lambda n: _clip(n, frames), (frames * 64, frames * 256))
    return estimate_dit_memory(profile, tokens, sp, cfg["strategy"]).step_growth / 2**20


def _worker(_rank: int, _world_size: int, cfg: dict, out: str) -> None:
    import seqpar
    from seqpar.bench.measure import write_slowest
    from seqpar.runtime.memory import reset_resident_peak, resident_mb

    mesh = seqpar.make_mesh()
    model = seqpar.prepare_diffusers(wan_model(cfg), mesh, strategy=cfg["strategy"])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    inputs, target = _clip(cfg["tokens"], cfg["frames"])

    def step() -> float:
        pred = model(**inputs, return_dict=False)[0]
        loss = F.mse_loss(pred, target)
        del pred
        loss.backward()
        seqpar.reduce_gradients(model.parameters(), mesh)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    first_loss = step()  # warm-up
    dist.barrier()
    before = resident_mb("VmRSS")
    reset_resident_peak()
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    write_slowest(out, seconds, resident_mb("VmHWM") - before, first_loss=first_loss)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.video_dit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4], help="sequence-parallel degrees")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192], help="latent tokens after patchify")
    parser.add_argument("--frames", type=int, default=8, help="latent frames")
    parser.add_argument("--dim", type=int, default=128, help="model width (head size 32)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--strategy", default="ring")
    parser.add_argument("--json", metavar="FILE", help="write one record per clip size and degree here")
    args = parser.parse_args(argv)
    for tokens in args.tokens:
        _grid(tokens, args.frames)
    records = []
    for tokens in args.tokens:
        records += _run_size(args, tokens)
    if args.json:
        save_records(args.json, "video_dit", argv, records)
    return 0


def _run_size(args: argparse.Namespace, tokens: int) -> list[dict]:
    """Every degree at one clip size: measured, checked against sp 1's loss, printed with the estimate."""
    from seqpar.bench.measure import time_and_memory

    cfg = {"tokens": tokens, **{k: getattr(args, k) for k in ("frames", "dim", "layers", "strategy")}}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for sp in args.sp:
            out = os.path.join(tmp, f"{sp}.json")
            result = time_and_memory(_worker, lambda memory, out=out: (cfg, out), sp, out)
            rows.append({"sp": sp, **result, "estimate_mb": estimate_mb(cfg, tokens, sp)})
            print(f"sp {sp}: {rows[-1]}", flush=True)
    base = rows[0]
    for r in rows:
        if abs(r["first_loss"] - base["first_loss"]) > 1e-5 * abs(base["first_loss"]):
            raise SystemExit(f"sp {r['sp']} loss {r['first_loss']} differs from sp {base['sp']} {base['first_loss']}")
    print(f"\nWan-shaped ({args.layers} blocks of width {args.dim}), {tokens} latent tokens, {args.strategy}")
    print("| sp | tokens per rank | per-rank peak growth (MB) | vs sp 1 | estimate (MB) | est / measured | step (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['sp']} | {tokens // r['sp']} | {r['growth_mb']:.0f} | {r['growth_mb'] / base['growth_mb']:.2f} "
            f"| {r['estimate_mb']:.0f} | {r['estimate_mb'] / r['growth_mb']:.2f} | {r['seconds']:.2f} |"
        )
    keys = ("growth_mb", "estimate_mb", "first_loss")
    return [{**cfg, "sp": r["sp"], **{k: r[k] for k in keys}, "step_s": r["seconds"]} for r in rows]


if __name__ == "__main__":
    sys.exit(main())
