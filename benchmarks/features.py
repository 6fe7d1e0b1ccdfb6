"""Throughput cost of each memory feature: tokens/s of one training step per rung of the maxlen ladder, side by side.

One model per rung (same weights) lives in the same ranks and their steps take turns, so machine load hits all
alike:

    python -m benchmarks.features                                  # seq 4096, sp 1, every rung the CPU has
    python -m benchmarks.features --seq 8192 --sp 2 --repeats 4 --loss-chunk 32
    python -m benchmarks.features --ladder checkpointing tiled_mlp  # only these rungs (features still cumulative)
    python -m benchmarks.features --json features.json             # also save one record per rung, with provenance

Rungs and the step are those of ``seqpar bench maxlen`` (``feature_model``, ``feature_step``): none;
checkpointing; + chunked_loss; + tiled_mlp; + offload (GPU). The first step's losses of all rungs must agree
(rel 1e-5) before anything is timed. Each rung's time is reported as the median over repeats of its ratio to
the first rung's step in the same repeat, steadier on a loaded machine than a ratio of medians, both for
wall-clock time and for the rank processes' CPU time (one thread each), which waiting for a busy core does
not inflate. Checkpointing runs each layer's forward twice; the tiled MLP a third time for its own backward.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import seqpar
from benchmarks import save_records
from seqpar.bench.maxlen import LADDER, add_model_arguments, feature_model, feature_step, rung_features
from seqpar.runtime.spawn import spawn_ranks

__all__ = ["main"]


def _worker(_rank: int, _world_size: int, cfg: dict, out_path: str) -> None:
    torch.set_num_threads(1)
    device = torch.device("cuda", _rank) if cfg["device"] == "cuda" else torch.device("cpu")
    mesh = seqpar.make_mesh()
    ids = torch.randint(0, cfg["vocab"], (1, cfg["seq"]), generator=torch.Generator().manual_seed(1))
    shard = {k: v.to(device) for k, v in seqpar.shard_batch({"input_ids": ids}, mesh).items()}
    runs = {}
    for rung in cfg["ladder"]:
        run = {**cfg, "features": rung_features(rung)}
        model = feature_model(run, mesh, device)
        runs[rung] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4), run)

    def step(rung: str) -> float:
        model, opt, run = runs[rung]
        return float(seqpar.sum_over(feature_step(model, opt, shard, mesh, run), mesh))

    first = {rung: step(rung) for rung in runs}  # warm-up: gradients, optimizer state
    base = first[cfg["ladder"][0]]
    for rung, loss in first.items():
        if abs(loss - base) > 1e-5 * abs(base):
            raise SystemExit(f"{rung}: first loss {loss} differs from {cfg['ladder'][0]}'s {base}")
    times = {rung: [] for rung in runs}
    cpu = {rung: [] for rung in runs}
    for repeat in range(cfg["repeats"]):
        for rung in list(runs)[:: 1 if repeat % 2 == 0 else -1]:  # alternate the order
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            step(rung)
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = torch.tensor([time.perf_counter() - start, time.process_time() - start_cpu], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[rung].append(float(elapsed[0]))
            cpu[rung].append(float(elapsed[1]))
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"times": times, "cpu": cpu, "first_loss": first}, f)


def _ratio(series: dict, rung: str, against: str) -> float:
    """Throughput of ``rung`` relative to ``against``: the median over repeats of their per-repeat ratio."""
    return statistics.median(a / b for a, b in zip(series[against], series[rung]))


def _records(result: dict, ladder: list[str], seq: int) -> list[dict]:
    """One record per rung: its median step, tokens/s, and throughput against the first rung and the rung below."""
    times, cpu, first = result["times"], result["cpu"], ladder[0]
    records = []
    for i, rung in enumerate(ladder):
        median = statistics.median(times[rung])
        records.append(
            {
                "features": rung,
                "step_s": median,
                "tokens_per_s": seq / median,
                "vs_first_wall": _ratio(times, rung, first),
                "vs_first_cpu": _ratio(cpu, rung, first),
                "vs_below_wall": _ratio(times, rung, ladder[i - 1]) if i else None,
                "times_s": times[rung],
                "cpu_s": cpu[rung],
            }
        )
    return records


def _table(records: list[dict]) -> str:
    lines = [
        "| features | step (s) | tokens/s | vs none (wall) | vs none (CPU time) | vs rung below (wall) |",
        "|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(records):
        below = f"{r['vs_below_wall']:.3f}x" if i else "-"
        lines.append(
            f"| {r['features'] if i == 0 else '+ ' + r['features']} | {r['step_s']:.2f} | {r['tokens_per_s']:.0f} | "
            f"{r['vs_first_wall']:.3f}x | {r['vs_first_cpu']:.3f}x | {below} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.features", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, default=4096, help="total sequence length")
    parser.add_argument("--sp", type=int, default=1, help="sequence-parallel degree (spawned ranks)")
    parser.add_argument("--ladder", nargs="+", choices=LADDER, default=None, help="rungs (default: all there are)")
    add_model_arguments(parser)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps of each rung")
    parser.add_argument("--json", metavar="FILE", help="write one record per rung here")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ladder = args.ladder or [r for r in LADDER if r != "offload" or device == "cuda"]
    cfg = {**vars(args), "ladder": ladder, "model": None, "device": device}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        spawn_ranks(_worker, args.sp, cfg, out, backend="nccl" if device == "cuda" else "gloo")
        with open(out) as f:
            result = json.load(f)
    print(
        f"\nLlama {args.layers}x{args.hidden} (MLP {3 * args.hidden}), vocab {args.vocab}, seq {args.seq}, "
        f"sp {args.sp}, fp32, strategy {args.strategy}, loss chunk {args.loss_chunk}, MLP chunk {args.mlp_chunk}, "
        f"1 thread/rank ({device}); {args.repeats} steps per rung, taking turns; medians"
    )
    records = _records(result, ladder, args.seq)
    print(_table(records))
    if args.json:
        settings = {k: v for k, v in cfg.items() if k not in ("ladder", "model", "json")}
        save_records(args.json, "features", argv, [{**settings, **r} for r in records])
    return 0


if __name__ == "__main__":
    sys.exit(main())
