"""The pipeline on this machine: each schedule's step time and each stage's memory at pp 2, beside the planner.

    python -m benchmarks.pipeline         # 4-layer Llama, hidden 256, seq 1024, 4 micro-batches of 1 row
    python -m benchmarks.pipeline --microbatches 8 --seq 2048 --schedules 1f1b --json pipeline.json

Two gloo ranks, one thread each, one pipeline stage per rank (two for "interleaved"), spawned twice: once for
time, once for memory (``seqpar.bench.measure``: under ``MEMORY_RUN_ENV`` glibc maps every large
allocation and unmaps it on free, so the resident-set peak tracks live tensors, while its page faults would
slow the timed steps).

Time. Calibrated in the same run: each rank times the forward + backward of its own stages on one
micro-batch, outside the pipeline (the slower rank's time is t, the busiest stage's micro-batch), and one
send + receive of a micro-batch's activation between the ranks (the link rate). Predicted step (Note
[pipeline memory and time], as the planner's time model adds it): m t / (1 - bubble) + m x p2p bytes / link
rate, bubble (p - 1) / (m + p - 1) (gpipe, 1f1b) or (p - 1) / (2 m + p - 1) (interleaved). Measured: the
median of the timed pipeline steps (alternating with the calibration's, so that both see the same load);
measured bubble: 1 - m t / step; the verdict: the prediction within 25% of the measured step. On a machine
with fewer free cores than ranks the ranks share cores and the bubble is partly filled by the other rank's
work: compare on an idle machine.

Memory, per rank (rank 0 holds the first stage, rank 1 the last), AdamW, gradients kept between steps
(zeroed in place, as DDP's and FSDP's buffers are), after one warm-up step:
  * state: parameters, gradients and AdamW state of the rank's stages and the receive buffers torch's stages
    keep, counted from the tensors; estimate: ``MemoryEstimate.between_steps``;
  * in flight: the resident set above what lived before the step, read each time the backward of a stage's
    last decoder layer starts (a hook on that layer's output gradient), the largest over the step: the
    activations of the micro-batches the schedule holds, with, on the last rank, the logits still held;
    estimate: ``checkpointed_activations`` (per-micro-batch activations x the in-flight micro-batches) plus,
    on the last rank, ``held_logits_bytes`` (Note [pipeline memory and time]);
  * growth: the resident-set peak (VmHWM) of the whole step (pipeline, gradient sum, clipping, AdamW) above
    the resident set before it; estimate: ``MemoryEstimate.step_peak``;
  * peak: state + growth; estimate: ``MemoryEstimate.peak``.
Each estimate is ``seqpar.memory.estimate_stage_memory`` for that end of the pipeline (``estimate_memory``
reports the larger); the verdict: the peak and the growth both within 15% of the estimate.
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
from benchmarks import provenance
from benchmarks.pipeline_memory import bench_pipeline, bench_shard, memory_rows, memory_worker
from seqpar.bench.measure import MEMORY_RUN_ENV
from seqpar.memory.pipeline import bubble_fraction, p2p_bytes
from seqpar.runtime.spawn import spawn_ranks

__all__ = ["main"]

TIME_TOLERANCE = 0.25
"""The planner's step time counts as right within this fraction of the measured step."""


def _time(fn: object, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after one warm-up, the slower rank's (collective)."""
    fn()
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    slowest = torch.tensor(statistics.median(seconds), dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest)


def _time_alternating(first: object, second: object, repeats: int) -> tuple[float, float]:
    """``_time`` of two functions, their calls alternating, so that both see the same load on a shared machine."""
    first()
    second()
    seconds: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in zip((first, second), seconds):
            dist.barrier()
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(out) for out in seconds], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest[0]), float(slowest[1])


def _stage_alone(pipe: seqpar.PipelineParallel, rows: int, seq: int, vocab: int) -> None:
    """Forward and backward of this rank's stages on one micro-batch, outside the pipeline."""
    positions = torch.arange(seq).expand(rows, seq)
    for stage in pipe.stages:
        if stage.first:
            x = torch.randint(0, vocab, (rows, seq))
        else:
            x = torch.randn(rows, seq, stage.model.config.hidden_size, requires_grad=True)
        stage(x, positions).float().square().mean().backward()


def _time_worker(_rank: int, _world_size: int, cfg: dict, out_path: str) -> None:
    mesh = seqpar.make_mesh(pp_size=2)
    rows, seq, m = cfg["rows"], cfg["seq"], cfg["microbatches"]
    shard = bench_shard(cfg, mesh)
    activation = torch.randn(rows, seq, cfg["hidden"])
    peer = 1 - dist.get_rank()

    def exchange() -> None:  # one activation each way, as a stage boundary carries per micro-batch
        for sender in (0, 1):
            dist.send(activation, peer) if dist.get_rank() == sender else dist.recv(activation, peer)

    link = _time(exchange, cfg["repeats"])  # seconds for 2 activations' bytes
    records = []
    for schedule in cfg["schedules"]:
        pipe = bench_pipeline(cfg, mesh, schedule)
        alone, step = _time_alternating(
            lambda pipe=pipe: _stage_alone(pipe, rows, seq, cfg["vocab"]),
            lambda pipe=pipe: pipe.step(shard),
            cfg["repeats"],
        )
        bubble = bubble_fraction(2, schedule, m)
        sent = p2p_bytes(rows * seq, cfg["hidden"], 4, schedule)
        predicted = m * alone / (1 - bubble) + m * sent / (2 * activation.numel() * 4 / link)
        records.append(
            {
                "schedule": schedule,
                "microbatches": m,
                "step_s": step,
                "predicted_s": predicted,
                "predicted_vs_measured": predicted / step - 1,
                "time_within_25pct": abs(predicted / step - 1) <= TIME_TOLERANCE,
                "measured_bubble": 1 - m * alone / step,
                "predicted_bubble": bubble,
                "stage_alone_s": alone,
            }
        )
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(records, f)


def main(argv: list[str] | None = None) -> int:
    """``benchmarks.pipeline``: time each schedule and measure each stage's memory at pp 2, beside the estimates.

    Args:
        argv: the command-line options (default: ``sys.argv``).

    Returns:
        0 (the exit code).
    """
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.pipeline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved"])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true", help="time only (no memory run)")
    parser.add_argument("--json", help="write the time and memory records to this file")
    args = parser.parse_args(argv)
    cfg = vars(args)
    print(
        f"pp 2 on {os.cpu_count()} cores: Llama {args.layers} layers x {args.hidden}, seq {args.seq}, "
        f"{args.microbatches} micro-batches of {args.rows} row(s), fp32, gloo",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "records.json")
        spawn_ranks(_time_worker, 2, cfg, out)
        with open(out) as f:
            timed = json.load(f)
        measured = []
        if not args.no_memory:
            spawn_ranks(memory_worker, 2, cfg, out, env=MEMORY_RUN_ENV)
            with open(out) as f:
                measured = json.load(f)
    print(
        "| schedule | m | measured step (ms) | predicted (ms) | predicted / measured - 1 | within 25% "
        "| measured bubble | predicted bubble | stage micro-batch alone (ms) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in timed:
        print(
            f"| {r['schedule']} | {r['microbatches']} | {r['step_s'] * 1e3:.0f} | {r['predicted_s'] * 1e3:.0f} | "
            f"{r['predicted_vs_measured']:+.0%} | {'yes' if r['time_within_25pct'] else 'NO'} | "
            f"{r['measured_bubble']:.0%} | {r['predicted_bubble']:.0%} | {r['stage_alone_s'] * 1e3:.0f} |"
        )
    memory_lines, memory_records = memory_rows(measured, cfg)
    if memory_lines:
        print(
            "\nMemory per rank, MiB, measured / estimated (estimated / measured):\n"
            "| schedule | m | rank | params + grads + AdamW + receive buffers | activations in flight | step growth "
            "| peak | estimate's peak moment | peak and growth within 15% |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        print("\n".join(memory_lines))
    if args.json:
        with open(args.json, "w") as f:
            record = {"settings": cfg, "time": timed, "memory": memory_records, **provenance("pipeline", argv)}
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
