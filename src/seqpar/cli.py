"""The ``seqpar`` command line: ``seqpar train`` trains a model with the sequence split over ranks.

seqpar train                                   # embedded demo: passkey retrieval, 2 CPU ranks, a few minutes
seqpar train --model ./my-llama --data a.jsonl --seq-len 32768 --sp 8    # under torchrun on GPUs
seqpar demo                                    # every attention strategy on 2 CPU ranks vs one device
seqpar bench attention                         # benchmarks: attention, strategies, masks, llama_step, cuda
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import seqpar
from seqpar.bench import BENCHMARKS
from seqpar.errors import SeqparInputError
from seqpar.train.config import build_parser, config_from_args
from seqpar.train.launch import launch


def _demo_rank(rank: int, args: argparse.Namespace, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=args.ranks, init_method=f"file://{store}", timeout=timedelta(minutes=5)
    )
    mesh = seqpar.make_mesh()
    gen = torch.Generator().manual_seed(0)
    shape = (1, args.heads, args.seq, args.head_dim)
    kv_shape = (1, args.kv_heads, args.seq, args.head_dim)
    q, k, v, dout = (torch.randn(s, generator=gen) for s in (shape, kv_shape, kv_shape, shape))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    start = time.perf_counter()
    ref = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
    ref.backward(dout)
    single_s = time.perf_counter() - start
    if rank == 0:
        print(
            f"{args.ranks} ranks, causal attention, seq {args.seq}, heads {args.heads}/{args.kv_heads}, "
            f"head_dim {args.head_dim}; one process took {single_s:.2f}s fwd+bwd"
        )
    for strategy in ("ring", "ulysses", "allgather"):
        try:
            local = [seqpar.shard_sequence(t.detach(), mesh, dim=2).requires_grad_() for t in (q, k, v)]
            start = time.perf_counter()
            out = seqpar.attention(*local, mesh=mesh, strategy=strategy, causal=True)
            out.backward(seqpar.shard_sequence(dout, mesh, dim=2))
            seconds = time.perf_counter() - start
        except seqpar.SeqparInputError as error:
            if rank == 0:
                print(f"  {strategy:>9}: not applicable here ({error})")
            continue
        worst = max(
            float((got - seqpar.shard_sequence(want, mesh, dim=2)).abs().max())
            for got, want in zip((out.detach(), *(t.grad for t in local)), (ref.detach(), *(t.grad for t in full)))
        )
        worst_all = torch.tensor([worst, seconds])
        dist.all_reduce(worst_all, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(
                f"  {strategy:>9}: max |difference| vs one device {worst_all[0]:.1e}, slowest rank {worst_all[1]:.2f}s"
            )
    dist.barrier()
    dist.destroy_process_group()


def _demo(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_demo_rank, args=(args, os.path.join(tmp, "store")), nprocs=args.ranks, start_method="spawn")
    return 0


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
        "embedded demo: a small Llama trained on passkey retrieval with each sequence split over 2 spawned CPU "
        "ranks. Under torchrun it uses the ranks torchrun started (NCCL on GPUs). Settings come from the "
        "defaults, then --config, then the flags.",
    )
    build_parser(train)
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
    if args.command == "demo":
        return _demo(args)
    if args.command == "train":
        try:
            return launch(config_from_args(args))
        except SeqparInputError as error:
            print(f"seqpar train: {error}", file=sys.stderr)
            return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
