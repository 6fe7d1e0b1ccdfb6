"""``python -m benchmarks.vlm_memory``: per-rank peak memory of one Qwen2.5-VL-shaped training step on a long video.

Run::

    python -m benchmarks.vlm_memory                            # a 128-frame 224x224 video, sp 1 2 4, split on and off
    python -m benchmarks.vlm_memory --frames 64 --sp 1 2 --json vlm_memory_cpu.json

Every degree (and, above sp 1, the vision split on and off: Note [vision split]) runs in fresh processes, one
thread a rank: a warm-up step, then one measured step (forward, backward, gradient sum, SGD update) of the
whole model on whole rows (``seqpar.prepare_model``), the text decoder sharded. Memory = growth of the
resident-set peak (VmHWM) during the step above the resident set before it, in a second run under
``MEMORY_RUN_ENV`` (``seqpar.bench.measure``); beside it the ``seqpar.estimate_memory`` prediction of the same
step with the vision tower counted (``vision_patches``, Note [vision tower memory]). The first step's loss of
every run is checked against sp 1's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from benchmarks import save_records
from benchmarks.vision_split import qwen_vl_model, video_batch

__all__ = ["main"]


def _worker(_rank: int, _world_size: int, cfg: dict, out: str) -> None:
    import seqpar
    from seqpar.bench.measure import write_slowest
    from seqpar.runtime.memory import reset_resident_peak, resident_mb

    mesh = seqpar.make_mesh()
    model = seqpar.prepare_model(qwen_vl_model(cfg), mesh, strategy=cfg["strategy"], split_vision=cfg["split"])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = video_batch(cfg)
    shard = seqpar.shard_batch({"input_ids": batch["input_ids"]}, mesh)

    def step() -> float:
        logits = model(**batch, seqpar_layout=shard.layout).logits
        loss = seqpar.cross_entropy(logits, shard["shift_labels"], mesh)
        del logits
        loss.backward()
        seqpar.reduce_gradients(model.parameters(), mesh)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(seqpar.sum_over(loss.detach(), mesh))

    first_loss = step()  # warm-up
    times, growth = [], 0.0
    for i in range(1 if cfg["memory"] else cfg["repeats"]):
        dist.barrier()
        before = resident_mb("VmRSS")
        reset_resident_peak()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        if i == 0:
            growth = resident_mb("VmHWM") - before
    write_slowest(out, statistics.median(times), growth, first_loss=first_loss)


def _predicted_mb(cfg: dict, sp: int, split: bool) -> float:
    """``estimate_memory``'s step growth (MiB) of the step ``_worker`` measures."""
    import seqpar

    batch = video_batch(cfg)
    seq = batch["input_ids"].shape[1]
    padded = seq + (-seq % (2 * sp))  # the zigzag layout pads the row to 2 x sp chunks
    estimate = seqpar.estimate_memory(
        _config(cfg),
        padded,
        seqpar.ParallelDims(sp_size=sp),
        strategy=cfg["strategy"],
        optimizer="sgd",
        vision_patches=int(batch["video_grid_thw"].prod(-1).sum()),
        split_vision=split,
    )
    return estimate.step_peak / 2**20


def _config(cfg: dict) -> object:
    """The bench model's config (the model built on the meta device: nothing allocated)."""
    with torch.device("meta"):
        return qwen_vl_model(cfg).config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.vlm_memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4], help="sequence-parallel degrees")
    parser.add_argument("--frames", type=int, default=128, help="video frames (2 a temporal patch)")
    parser.add_argument("--side", type=int, default=224, help="frame height and width in pixels (14-pixel patches)")
    parser.add_argument("--vision", type=int, default=128, help="vision tower width")
    parser.add_argument("--vision-depth", type=int, default=4, help="vision tower blocks")
    parser.add_argument("--hidden", type=int, default=256, help="text decoder width")
    parser.add_argument("--layers", type=int, default=4, help="text decoder layers")
    parser.add_argument("--strategy", default="ring")
    parser.add_argument("--repeats", type=int, default=1, help="timed steps after the warm-up")
    parser.add_argument("--json", metavar="FILE", help="write one record per run here")
    args = parser.parse_args(argv)
    from seqpar.bench.measure import time_and_memory

    keys = ("frames", "side", "vision", "vision_depth", "hidden", "layers", "strategy", "repeats")
    cfg = {k: getattr(args, k) for k in keys}
    runs = [(sp, split) for sp in args.sp for split in ((False,) if sp == 1 else (True, False))]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for sp, split in runs:
            out = os.path.join(tmp, f"{sp}-{split}.json")

            def args_for(memory, sp=sp, split=split, out=out):
                return ({**cfg, "split": split, "memory": memory}, out)

            result = time_and_memory(_worker, args_for, sp, out)
            rows.append({"sp": sp, "split_vision": split, **result, "predicted_mb": _predicted_mb(cfg, sp, split)})
            print(f"sp {sp} split {split}: {rows[-1]}", flush=True)
    base = rows[0]
    for r in rows:
        if abs(r["first_loss"] - base["first_loss"]) > 1e-4 * abs(base["first_loss"]):
            raise SystemExit(f"sp {r['sp']} loss {r['first_loss']} differs from sp {base['sp']} {base['first_loss']}")
    batch = video_batch(cfg)
    patches = int(batch["video_grid_thw"].prod(-1).sum())
    print(
        f"\nQwen2.5-VL-shaped (vision {args.vision_depth}x{args.vision}, text {args.layers}x{args.hidden}), one "
        f"{args.frames}-frame {args.side}x{args.side} video: {patches} patches, {batch['input_ids'].shape[1]} tokens"
    )
    print(
        "| sp | vision split | per-rank peak growth (MB) | vs sp 1 | predicted (MB) | measured / predicted | step (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['sp']} | {'on' if r['split_vision'] else 'off'} | {r['growth_mb']:.0f} | "
            f"{r['growth_mb'] / base['growth_mb']:.2f} | {r['predicted_mb']:.0f} | "
            f"{r['growth_mb'] / r['predicted_mb']:.2f} | {r['seconds']:.2f} |"
        )
    if args.json:
        records = [
            {
                **cfg,
                "sp": r["sp"],
                "split_vision": r["split_vision"],
                "patches": patches,
                "growth_mb": r["growth_mb"],
                "predicted_mb": r["predicted_mb"],
                "step_s": r["seconds"],
            }
            for r in rows
        ]
        save_records(args.json, "vlm_memory", argv, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
