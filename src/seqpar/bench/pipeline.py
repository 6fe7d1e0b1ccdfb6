"""The pipeline on this machine: each schedule's step time and each stage's memory at pp 2, beside the planner.

    seqpar bench pipeline                         # 4-layer Llama, hidden 256, seq 1024, 4 micro-batches of 1 row
    seqpar bench pipeline --microbatches 8 --seq 2048 --schedules 1f1b --json pipeline.json

Two gloo ranks, one thread each, one pipeline stage per rank (two for "interleaved"), spawned twice: once for
time, once for memory (``seqpar.runtime.measure``: under ``MEMORY_RUN_ENV`` glibc maps every large
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
import tempfile
import time

import torch
import torch.distributed as dist
import transformers

import seqpar
from seqpar.bench.llama_step import llama_config
from seqpar.memory.estimate import estimate_stage_memory
from seqpar.memory.pipeline import bubble_fraction, held_logits_bytes, p2p_bytes, stage_views
from seqpar.runtime.measure import MEMORY_RUN_ENV
from seqpar.runtime.memory import reset_resident_peak, resident_mb
from seqpar.runtime.spawn import spawn_ranks

__all__ = ["main"]

_MB = 2**20
TIME_TOLERANCE = 0.25
"""The planner's step time counts as right within this fraction of the measured step."""
MEMORY_TOLERANCE = 0.15
"""A stage's estimated memory counts as right within this fraction of the measured."""


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


def _pipeline(cfg: dict, mesh: seqpar.SequenceParallelMesh, schedule: str) -> seqpar.PipelineParallel:
    """The bench's Llama (seed 0) split over pp 2; the whole model is dropped, the stages keep their parts."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**llama_config(cfg, cfg["seq"])))
    seqpar.prepare_model(model, mesh)
    return seqpar.apply_pipeline_parallel(
        model,
        mesh,
        schedule=schedule,
        microbatches=cfg["microbatches"],
        stages_per_rank=2 if schedule == "interleaved" else 1,
    )


def _shard(cfg: dict, mesh: seqpar.SequenceParallelMesh) -> dict:
    rows = cfg["rows"] * cfg["microbatches"]
    ids = torch.randint(0, cfg["vocab"], (rows, cfg["seq"]), generator=torch.Generator().manual_seed(1))
    return seqpar.shard_batch({"input_ids": ids}, mesh)


def _time_worker(_rank: int, _world_size: int, cfg: dict, out_path: str) -> None:
    mesh = seqpar.make_mesh(pp_size=2)
    rows, seq, m = cfg["rows"], cfg["seq"], cfg["microbatches"]
    shard = _shard(cfg, mesh)
    activation = torch.randn(rows, seq, cfg["hidden"])
    peer = 1 - dist.get_rank()

    def exchange() -> None:  # one activation each way, as a stage boundary carries per micro-batch
        for sender in (0, 1):
            dist.send(activation, peer) if dist.get_rank() == sender else dist.recv(activation, peer)

    link = _time(exchange, cfg["repeats"])  # seconds for 2 activations' bytes
    records = []
    for schedule in cfg["schedules"]:
        pipe = _pipeline(cfg, mesh, schedule)
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


def _held_at_backward(pipe: seqpar.PipelineParallel, before: list[float], seen: list[float]) -> None:
    """Read the resident set whenever the backward of a stage's last decoder layer starts (into ``seen``)."""

    def on_output(_module: torch.nn.Module, _args: object, output: object) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        if torch.is_tensor(hidden) and hidden.requires_grad:
            hidden.register_hook(lambda _grad: seen.append(resident_mb() - before[0]))

    for stage in pipe.stages:
        stage.model.layers[-1].register_forward_hook(on_output)


def _recv_buffer_bytes(pipe: seqpar.PipelineParallel) -> int:
    """Bytes of the receive buffers torch's stages keep between steps (read from the stage objects)."""
    schedule = pipe._built[1]  # built by the warm-up step
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    buffers = {}
    for stage in stages:
        for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
            for info in infos:
                buffer = getattr(info, "buffer", None)
                if torch.is_tensor(buffer):
                    buffers[buffer.data_ptr()] = buffer.numel() * buffer.element_size()
    return sum(buffers.values())


def _memory_worker(_rank: int, _world_size: int, cfg: dict, out_path: str) -> None:
    mesh = seqpar.make_mesh(pp_size=2)
    shard = _shard(cfg, mesh)
    records = []
    for schedule in cfg["schedules"]:
        pipe = _pipeline(cfg, mesh, schedule)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
        before, seen = [0.0], []
        _held_at_backward(pipe, before, seen)

        def step(pipe: seqpar.PipelineParallel = pipe, opt: torch.optim.Optimizer = opt) -> None:
            pipe.step(shard)
            pipe.reduce_gradients()
            pipe.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad(set_to_none=False)  # kept between steps, as DDP's and FSDP's buffers are

        step()  # warm-up: gradients, AdamW state, the schedule's receive buffers
        state = sum(t.numel() * t.element_size() for p in pipe.parameters() for t in (p, p.grad))
        state += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim())
        state += _recv_buffer_bytes(pipe)
        seen.clear()
        dist.barrier()
        before[0] = resident_mb()
        reset_resident_peak()
        step()
        growth = resident_mb("VmHWM") - before[0]
        mine = torch.tensor([state / _MB, max(seen, default=0.0), growth], dtype=torch.float64)
        ranks = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(ranks, mine)
        records.append(
            {
                "schedule": schedule,
                "ranks": [
                    {"state_mb": float(r[0]), "in_flight_mb": float(r[1]), "growth_mb": float(r[2])} for r in ranks
                ],
            }
        )
        del pipe, opt, step
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(records, f)


def _estimates(cfg: dict, schedule: str) -> list[dict]:
    """``estimate_stage_memory`` of the bench's step for the first and the last rank, in MiB."""
    views = stage_views(cfg["layers"], 2, schedule, cfg["microbatches"])
    tokens = cfg["rows"] * cfg["seq"]
    found = estimate_stage_memory(
        llama_config(cfg, cfg["seq"]),
        cfg["seq"],
        sp_size=1,
        micro_batch=cfg["rows"],
        optimizer="adamw",
        keep_gradients=True,
        pp_size=2,
        pp_schedule=schedule,
        pp_microbatches=cfg["microbatches"],
    )
    return [
        {
            "state_mb": e.between_steps / _MB,
            # with gradients kept, both activation moments hold every in-flight activation (Note [memory
            # estimate]); the hook reads the resident set when a layer's backward starts, after the loss's
            # gradients are gone, so the last rank's held logits are what it sees of the logits
            "in_flight_mb": (e.checkpointed_activations + held_logits_bytes(view, tokens, cfg["vocab"], 4)) / _MB,
            "growth_mb": e.step_peak / _MB,
            "peak_mb": e.peak / _MB,
            "moment": e.moment,
        }
        for e, view in zip(found, views)
    ]


def _memory_rows(records: list[dict], cfg: dict) -> tuple[list[str], list[dict]]:
    """The memory table's rows and the JSON records: each rank measured beside its estimate."""
    lines, out = [], []
    for record in records:
        for rank, (got, est) in enumerate(zip(record["ranks"], _estimates(cfg, record["schedule"]))):
            got = {**got, "peak_mb": got["state_mb"] + got["growth_mb"]}
            ratios = {
                k: est[k] / got[k] if got[k] else float("nan")
                for k in ("state_mb", "in_flight_mb", "growth_mb", "peak_mb")
            }
            within = all(abs(ratios[k] - 1) <= MEMORY_TOLERANCE for k in ("peak_mb", "growth_mb"))
            where = "first" if rank == 0 else "last"
            lines.append(
                f"| {record['schedule']} | {cfg['microbatches']} | {rank} ({where}) | "
                + " | ".join(f"{got[k]:.0f} / {est[k]:.0f} ({ratios[k]:.2f})" for k in ratios)
                + f" | {est['moment']} | {'yes' if within else 'NO'} |"
            )
            out.append(
                {
                    "schedule": record["schedule"],
                    "microbatches": cfg["microbatches"],
                    "rank": rank,
                    "measured": got,
                    "estimated": est,
                    "estimated_vs_measured": ratios,
                    "memory_within_15pct": within,
                }
            )
    return lines, out


def main(argv: list[str] | None = None) -> int:
    """``seqpar bench pipeline``: time each schedule and measure each stage's memory at pp 2, beside the estimates.

    Args:
        argv: the command-line options (default: ``sys.argv``).

    Returns:
        0 (the exit code).
    """
    parser = argparse.ArgumentParser(
        prog="seqpar bench pipeline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
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
            spawn_ranks(_memory_worker, 2, cfg, out, env=MEMORY_RUN_ENV)
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
    memory_lines, memory_records = _memory_rows(measured, cfg)
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
            json.dump({"settings": cfg, "time": timed, "memory": memory_records}, f, indent=1)
    return 0
