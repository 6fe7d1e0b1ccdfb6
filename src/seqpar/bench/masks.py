"""What packed documents and sliding windows cost: causal attention with and without them, per strategy.

    seqpar bench masks                # 2 ranks, seq 8192, 8/2 heads, 8 documents, window 1024
    seqpar bench masks --ranks 2 --seq 16384 --docs 16 --window 2048

Each strategy runs fwd+bwd on the same spawned gloo ranks (one thread each) for: plain causal, causal with
packed documents of equal length (tiles across documents are skipped, tiles on a boundary masked), and a
causal sliding window (tiles beyond the window skipped). Work falls with the visible area, so the ratios
against plain causal show how much of the skipping turns into time. Results are not checked here; the
tests check every mask against SDPA.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

import seqpar
from seqpar.runtime.spawn import spawn_ranks


def _visible_fraction(seq: int, docs: int | None, window: int | None) -> float:
    i = torch.arange(seq)[:, None]
    j = torch.arange(seq)[None, :]
    keep = j <= i
    if docs:
        keep &= (i // (seq // docs)) == (j // (seq // docs))
    if window:
        keep &= i - j < window
    return float(keep.float().mean()) * 2  # relative to the causal half


def _worker(rank: int, _world_size: int, args: argparse.Namespace) -> None:
    mesh = seqpar.make_mesh()
    local = args.seq // args.ranks
    gen = torch.Generator().manual_seed(rank)
    q = torch.randn(1, args.heads, local, 64, generator=gen, requires_grad=True)
    k = torch.randn(1, args.kv_heads, local, 64, generator=gen, requires_grad=True)
    v = torch.randn(1, args.kv_heads, local, 64, generator=gen, requires_grad=True)
    dout = torch.randn(1, args.heads, local, 64, generator=gen)
    doc_len = args.seq // args.docs
    packed = seqpar.shard_sequence((torch.arange(args.seq) % doc_len)[None], mesh, dim=1)
    cases = {
        "causal": seqpar.sequence_mask(None, mesh),
        f"{args.docs} documents": seqpar.sequence_mask(packed, mesh),
        f"window {args.window}": seqpar.sequence_mask(None, mesh, window=args.window),
    }
    fractions = [1.0, _visible_fraction(args.seq, args.docs, None), _visible_fraction(args.seq, None, args.window)]
    rows = []
    for strategy in args.strategies:
        base = None
        for (name, mask), fraction in zip(cases.items(), fractions):
            times = []
            for _ in range(args.repeats + 1):
                dist.barrier()
                start = time.perf_counter()
                out = seqpar.attention(q, k, v, mesh=mesh, strategy=strategy, mask=mask)
                out.backward(dout)
                times.append(time.perf_counter() - start)
            seconds = torch.tensor(statistics.median(times[1:]))
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            base = base or float(seconds)
            rows.append((strategy, name, float(seconds), float(seconds) / base, fraction))
    if rank == 0:
        print(f"\n{args.ranks} ranks, seq {args.seq}, heads {args.heads}/{args.kv_heads}, head_dim 64, fp32, fwd+bwd")
        print("| strategy | mask | step (s) | time vs causal | visible area vs causal |")
        print("|---|---|---|---|---|")
        for strategy, name, seconds, ratio, fraction in rows:
            print(f"| {strategy} | {name} | {seconds:.2f} | {ratio:.2f} | {fraction:.2f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="seqpar bench masks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--docs", type=int, default=8, help="equal-length documents packed into the sequence")
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--strategies", nargs="+", default=["ring", "ulysses", "allgather"])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    spawn_ranks(_worker, args.ranks, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
