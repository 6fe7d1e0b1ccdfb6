"""The planner's predictions against measured steps: step time and per-rank peak growth of a small Llama on CPU.

    python -m benchmarks.plan_check                              # llama_step's configurations: seq 8192, sp 1 2 4, ring
    python -m benchmarks.plan_check --calibration cal.json       # rates from `seqpar plan --calibrate cal.json`

First it times planning Llama-8B at 16M tokens on 1,024 devices (the planner's own speed).

The measured side is ``python -m benchmarks.llama_step``'s step (forward, backward, gradient sum, AdamW; fp32; one
thread per rank), run with no memory features and with checkpointing + chunked loss. The predicted side is
``seqpar.planning.step_time`` on the calibrated rates, and the memory estimator's growth above what lives between
steps (``MemoryEstimate.step_peak``), which is what the benchmark measures (resident-set peak growth). The
matmul and attention rates are probed inside each rank just before and after each timed step, on the wall
clock and on the process's CPU time: on a shared machine the wall clock says how much of a core a rank got,
CPU time what the step costs on a core of its own. The link rate comes from the calibration.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import transformers

import seqpar
from benchmarks.llama_step import llama_config
from seqpar.bench.maxlen import train_step
from seqpar.bench.measure import time_and_memory, write_slowest
from seqpar.models import ModelSizes
from seqpar.planning.calibrate import calibrate, probe_compute
from seqpar.planning.cluster import Calibration, Cluster, load_calibration
from seqpar.planning.memory import estimate_layout
from seqpar.planning.search import plan
from seqpar.planning.timing import Layout, step_time
from seqpar.runtime.memory import reset_resident_peak, resident_mb
from seqpar.sequence_parallel.strategies.registry import strategy_row

FEATURE_SETS = {"none": (), "ckpt+chunked": ("checkpointing", "chunked_loss")}
LOSS_CHUNK = 1024  # the estimator's default piece of the chunked loss


def _worker(_rank: int, _world_size: int, cfg: dict, out_path: str) -> None:
    torch.manual_seed(0)
    mesh = seqpar.make_mesh()
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**llama_config(cfg, cfg["seq"])))
    if "checkpointing" in cfg["features"]:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model = seqpar.prepare_model(model, mesh, strategy=cfg["strategy"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, cfg["vocab"], (1, cfg["seq"]), generator=torch.Generator().manual_seed(1))
    shard = seqpar.shard_batch({"input_ids": ids}, mesh)
    loss_chunk = LOSS_CHUNK if "chunked_loss" in cfg["features"] else 0

    def step() -> None:
        train_step(model, opt, shard, mesh, loss_chunk)

    model.train()
    step()  # warm-up: allocates the optimizer state
    if cfg["memory"]:
        dist.barrier()
        before = resident_mb("VmRSS")
        reset_resident_peak()
        step()
        write_slowest(out_path, 0.0, resident_mb("VmHWM") - before)
        return
    walls, cpus, rates = [], [], []

    def probe() -> None:
        # this rank's rates under the load of the moment, on the wall clock and on this process's CPU time
        # (what the step would take on cores of its own), both read around the same probe runs
        rates.append(dict(zip(("wall", "cpu"), probe_compute(2, 1024, (time.perf_counter, time.process_time)))))

    for _ in range(cfg["repeats"]):
        probe()  # before and after the step they predict
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        probe()
    extra = {
        f"{name}_{kind}": statistics.mean(r[name][i] for r in rates)
        for name in ("wall", "cpu")
        for i, kind in enumerate(("matmul", "attention"))
    }
    write_slowest(out_path, statistics.median(walls), 0.0, cpu_seconds=statistics.median(cpus), **extra)


def _predict(
    cfg: dict, sp: int, features: tuple[str, ...], cluster: Cluster, calibration: Calibration, rates: tuple
) -> float:
    """Predicted step seconds of one configuration at the (matmul, attention) FLOP/s its ranks measured."""
    matmul, attention = rates
    measured = replace(calibration, matmul_tflops=matmul / 1e12, attention_tflops=attention / 1e12)
    rated = cluster.with_calibration(measured)
    return step_time(_shape(cfg), cfg["seq"], _layout(cfg, sp, features), rated, dtype_bytes=4).total


def _shape(cfg: dict):
    return ModelSizes.from_config(llama_config(cfg, cfg["seq"]), source="plan_check")


def _layout(cfg: dict, sp: int, features: tuple[str, ...]) -> Layout:
    ulysses = strategy_row(cfg["strategy"]).degree(sp, 1)  # flat mesh: sp for ulysses, 1 for ring and allgather
    return Layout(1, sp, ulysses, 1, cfg["strategy"], features, "replicate")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.plan_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--strategy", default="ring", choices=("ring", "ulysses", "allgather"))
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--features", nargs="+", default=list(FEATURE_SETS), choices=list(FEATURE_SETS))
    parser.add_argument("--calibration", help="a file from `seqpar plan --calibrate`; default: calibrate now")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    big = plan("llama-8b", 16 * 2**20, Cluster(gpus=1024, gpus_per_node=8))
    print(
        f"planning llama-8b, 16M tokens, 1,024 devices: {time.perf_counter() - start:.2f} s "
        f"({big.considered} layouts estimated, {len(big.candidates)} fit)",
        flush=True,
    )
    calibration = load_calibration(args.calibration) if args.calibration else calibrate()
    print(f"calibration: {calibration}", flush=True)
    cluster = Cluster(gpus=max(args.sp), gpus_per_node=max(args.sp))
    cfg = {k: getattr(args, k) for k in ("seq", "strategy", "hidden", "layers", "heads", "vocab", "repeats")}
    cfg["cores"] = os.cpu_count() or 1  # for the record: the rates are measured inside the (sharing) ranks
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.features:
            for sp in args.sp:
                out = os.path.join(tmp, f"{name}-{sp}.json")
                run = {**cfg, "features": FEATURE_SETS[name]}

                def args_for(memory, run=run, out=out):
                    return ({**run, "memory": memory}, out)

                m = time_and_memory(_worker, args_for, sp, out)
                wall, cpu = (
                    _predict(cfg, sp, FEATURE_SETS[name], cluster, calibration, (m[f"{c}_matmul"], m[f"{c}_attention"]))
                    for c in ("wall", "cpu")
                )
                memory = estimate_layout(_shape(cfg), cfg["seq"], _layout(cfg, sp, FEATURE_SETS[name]), dtype="fp32")
                rows.append(
                    (name, sp, m["seconds"], wall, m["cpu_seconds"], cpu, m["growth_mb"], memory.step_peak / 2**20)
                )
                print(f"{name} sp {sp}: measured {m}, predicted wall {wall:.2f} s, cpu {cpu:.2f} s", flush=True)
    print(
        f"\nLlama {args.layers}x{args.hidden}, {args.heads}/{args.heads // 2} heads, vocab {args.vocab}, seq "
        f"{args.seq}, {args.strategy}, fp32, 1 thread/rank on {cfg['cores']} cores"
    )
    print(
        "| features | sp | step wall (s) | predicted | ratio | step CPU time (s) | predicted | ratio "
        "| peak growth (MiB) | predicted | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, sp, wall, wall_p, cpu, cpu_p, mem, mem_p in rows:
        print(
            f"| {name} | {sp} | {wall:.2f} | {wall_p:.2f} | {wall_p / wall:.2f} | {cpu:.2f} | {cpu_p:.2f} | "
            f"{cpu_p / cpu:.2f} | {mem:.0f} | {mem_p:.0f} | {mem_p / mem:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
