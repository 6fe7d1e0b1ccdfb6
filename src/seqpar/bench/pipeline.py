"""The pipeline bubble on this machine: each schedule's measured step at pp 2 beside the planner's prediction.

    seqpar bench pipeline                         # 4-layer Llama, hidden 256, seq 1024, 4 micro-batches of 1 row
    seqpar bench pipeline --microbatches 8 --seq 2048 --schedules 1f1b

Two gloo ranks, one thread each, one pipeline stage per rank (two for "interleaved"). Calibrated in the same
run: each rank times the forward + backward of its own stages on one micro-batch, outside the pipeline (the
slower rank's time is t, the busiest stage's micro-batch), and one send + receive of a micro-batch's
activation between the ranks (the link rate). Predicted step (Note [pipeline memory and time], as the
planner's time model adds it): m t / (1 - bubble) + m x p2p bytes / link rate, bubble (p - 1) / (m + p - 1)
(gpipe, 1f1b) or (p - 1) / (2 m + p - 1) (interleaved). Measured: the median of the timed pipeline steps;
measured bubble: 1 - m t / step. On a machine with fewer free cores than ranks the ranks share cores and the
bubble is partly filled by the other rank's work: compare on an idle machine.
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
import transformers

import seqpar
from seqpar.bench.llama_step import llama_config
from seqpar.memory.pipeline import bubble_fraction, p2p_bytes
from seqpar.runtime.spawn import spawn_ranks

__all__ = ["main"]


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


def _stage_alone(pipe: seqpar.PipelineParallel, rows: int, seq: int, vocab: int) -> None:
    """Forward and backward of this rank's stages on one micro-batch, outside the pipeline."""
    positions = torch.arange(seq).expand(rows, seq)
    for stage in pipe.stages:
        if stage.first:
            x = torch.randint(0, vocab, (rows, seq))
        else:
            x = torch.randn(rows, seq, stage.model.config.hidden_size, requires_grad=True)
        stage(x, positions).float().square().mean().backward()


def _worker(_rank: int, _world_size: int, cfg: dict, out_path: str) -> None:
    torch.manual_seed(0)
    mesh = seqpar.make_mesh(pp_size=2)
    config = transformers.LlamaConfig(**llama_config(cfg, cfg["seq"]))
    rows, seq, m = cfg["rows"], cfg["seq"], cfg["microbatches"]
    ids = torch.randint(0, cfg["vocab"], (rows * m, seq), generator=torch.Generator().manual_seed(1))
    shard = seqpar.shard_batch({"input_ids": ids}, mesh)
    activation = torch.randn(rows, seq, cfg["hidden"])
    peer = 1 - dist.get_rank()

    def exchange() -> None:  # one activation each way, as a stage boundary carries per micro-batch
        for sender in (0, 1):
            dist.send(activation, peer) if dist.get_rank() == sender else dist.recv(activation, peer)

    link = _time(exchange, cfg["repeats"])  # seconds for 2 activations' bytes
    lines = []
    for schedule in cfg["schedules"]:
        model = transformers.AutoModelForCausalLM.from_config(config)
        seqpar.prepare_model(model, mesh)
        pipe = seqpar.apply_pipeline_parallel(
            model, mesh, schedule=schedule, microbatches=m, stages_per_rank=2 if schedule == "interleaved" else 1
        )
        alone = _time(lambda pipe=pipe: _stage_alone(pipe, rows, seq, cfg["vocab"]), cfg["repeats"])
        step = _time(lambda pipe=pipe: pipe.step(shard), cfg["repeats"])
        bubble = bubble_fraction(2, schedule, m)
        sent = p2p_bytes(rows * seq, cfg["hidden"], 4, schedule)
        predicted = m * alone / (1 - bubble) + m * sent / (2 * activation.numel() * 4 / link)
        lines.append(
            f"| {schedule} | {m} | {step * 1e3:.0f} | {predicted * 1e3:.0f} | {predicted / step - 1:+.0%} | "
            f"{1 - m * alone / step:.0%} | {bubble:.0%} | {alone * 1e3:.0f} |"
        )
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    """``seqpar bench pipeline``: time each schedule at pp 2 and print it beside the prediction.

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
    args = parser.parse_args(argv)
    cfg = vars(args)
    print(
        f"pp 2 on {os.cpu_count()} cores: Llama {args.layers} layers x {args.hidden}, seq {args.seq}, "
        f"{args.microbatches} micro-batches of {args.rows} row(s), fp32, gloo",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.txt")
        spawn_ranks(_worker, 2, cfg, out)
        with open(out) as f:
            rows = f.read()
    print(
        "| schedule | m | measured step (ms) | predicted (ms) | predicted / measured - 1 | measured bubble "
        "| predicted bubble | stage micro-batch alone (ms) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    sys.stdout.write(rows)
    return 0
