"""The ``seqpar`` command line: ``seqpar train`` trains a model with the sequence split over ranks.

seqpar train                                   # embedded demo: pass-key recitation, 2 CPU ranks, ~2 minutes
seqpar train --model ./my-llama --data a.jsonl --seq-len 32768 --sp 8    # under torchrun on GPUs
seqpar demo                                    # every attention strategy on 2 CPU ranks vs one device
seqpar estimate --seq-len 65536 --sp 4         # predicted per-rank memory of a training step
seqpar plan --model llama-8b --seq-len 1M --gpus 64   # which degrees, strategy and memory features
seqpar doctor --model ./my-llama --sp 2        # does a sharded step differ from one process, and why
seqpar bench attention                         # benchmarks: attention, strategies, masks, placement, llama_step,
                                               # cuda, context_parallel
"""

from __future__ import annotations

import argparse
import importlib
import sys

from seqpar.bench import BENCHMARKS
from seqpar.cli.doctor import add_doctor_parser, run_doctor
from seqpar.cli.estimate import add_estimate_parser, run_estimate
from seqpar.errors import SeqparInputError
from seqpar.planning.cli import add_plan_flags, run_plan
from seqpar.train.config import build_parser, config_from_args
from seqpar.train.launch import launch


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``seqpar`` console script."""
    parser = argparse.ArgumentParser(prog="seqpar", description="Sequence parallelism for long-context training.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run every attention strategy on spawned CPU ranks and check it")
    demo.add_argument("--ranks", type=int, default=2, help="sequence-parallel ranks to spawn (gloo, 1 thread each)")
    demo.add_argument("--seq", type=int, default=4096, help="total sequence length")
    demo.add_argument("--heads", type=int, default=8, help="query heads")
    demo.add_argument("--kv-heads", type=int, default=2, help="key/value heads (grouped-query attention)")
    demo.add_argument("--head-dim", type=int, default=64, help="head dimension")
    train = sub.add_parser(
        "train",
        help="train a model with the sequence split over ranks (no arguments: the embedded CPU demo)",
        description="Train a causal language model with sequence parallelism. Without arguments it runs the "
        "embedded demo: a small Llama trained on pass-key recitation with each sequence split over 2 spawned CPU "
        "ranks. Under torchrun it uses the ranks torchrun started (NCCL on GPUs). Settings come from the "
        "defaults, then --config, then the flags.",
    )
    build_parser(train)
    plan = sub.add_parser(
        "plan",
        help="rank the dp/sp/ulysses/tp degrees, strategies and memory features for a model on a cluster",
        description="Predict per-rank peak memory, step time, tokens/s per device and MFU of every valid layout "
        "of --model at --seq-len on the described cluster, print the best and say why the rest were rejected.",
    )
    add_plan_flags(plan)
    add_estimate_parser(sub)
    add_doctor_parser(sub)
    bench = sub.add_parser(
        "bench",
        help="run a benchmark (ratios measured side by side in one run)",
        description="Benchmarks: " + ", ".join(BENCHMARKS) + ". `seqpar bench NAME --help` explains each.",
    )
    bench.add_argument("name", choices=BENCHMARKS, help="which benchmark")
    bench.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own options")
    args = parser.parse_args(argv)
    if args.command == "bench":
        return importlib.import_module(f"seqpar.bench.{args.name}").main(args.options)
    if args.command == "plan":
        return run_plan(args)
    checked = {"estimate": run_estimate, "doctor": run_doctor}  # bad input: a message and exit code 2
    if args.command in checked:
        try:
            return checked[args.command](args)
        except SeqparInputError as error:
            print(f"seqpar {args.command}: {error}", file=sys.stderr)
            return 2
    if args.command == "demo":
        from seqpar.cli.demo import run_demo

        return run_demo(args.ranks, args.seq, args.heads, args.kv_heads, args.head_dim)
    if args.command == "train":
        try:
            config = config_from_args(args)
            if config.plan:
                from seqpar.cli.plan import train_plan

                print(train_plan(config))
                return 0
            return launch(config)
        except SeqparInputError as error:
            print(f"seqpar train: {error}", file=sys.stderr)
            return 2
    return 2
