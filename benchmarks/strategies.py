"""Ring vs Ulysses vs hybrid vs all-gather on the same ranks: step time and bytes each rank sends.

    python -m benchmarks.strategies                    # 4 ranks, causal fwd+bwd, seq 8192, 8/2 heads, fp32
    python -m benchmarks.strategies --ranks 4 --ulysses 2 --seq 16384 --kv-heads 8
    python -m benchmarks.strategies --kv-heads 8 --json strategies.json   # also save the rows, with provenance
    python -m benchmarks.strategies --heads 6 --kv-heads 2             # uneven heads: 2, 2, 1, 1 per rank

All strategies run in one set of spawned gloo ranks (one thread each), so their times are comparable with
each other; with more ranks than cores the absolute times are not meaningful, only the ratios. Bytes sent
are read from the kernel's count of bytes this process wrote to its sockets (/proc/self/io, wchar) across
one step, and compared with each strategy's analytical volume (``expected_bytes``); gloo's message headers
are the only difference. Bytes are the busiest rank's: under an uneven head split (Note [uneven heads]) the
ranks with ceil(H/P) heads; each row records the query heads each all-to-all rank attends.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import seqpar
from benchmarks import provenance
from seqpar.runtime.memory import written_bytes
from seqpar.runtime.spawn import spawn_ranks
from seqpar.sequence_parallel.checks import SIGNATURE_LENGTH
from seqpar.sequence_parallel.strategies.registry import strategy_row

_SIGNATURE_BYTES = SIGNATURE_LENGTH * 8  # the input check's all-gathered int64 signature


def expected_bytes(strategy: str, cfg: dict) -> float:
    """Bytes one rank sends in one forward+backward step (fp32): the registry row's bytes model (Note [strategy
    bytes]) plus the input check's signature exchange."""
    row = strategy_row(strategy)
    p, u = cfg["ranks"], cfg["ulysses"] if row.two_d else 1
    sent = row.bytes_sent(cfg["heads"], cfg["kv_heads"], p, u, cfg["seq"] // p, cfg["head_dim"], 4)
    return (p - 1) * _SIGNATURE_BYTES + sent


def heads_per_rank(strategy: str, cfg: dict) -> list[int] | None:
    """Query heads each rank of the strategy's all-to-all attends (Note [uneven heads]); None without one.

    Args:
        strategy: a registry name.
        cfg: the bench's settings (ranks, ulysses, heads, kv_heads).

    Returns:
        One count per all-to-all rank, or None.
    """
    row = strategy_row(strategy)
    if row.all_to_all is None:
        return None
    split = row.split(cfg["heads"], cfg["kv_heads"], cfg["ranks"], cfg["ulysses"])
    return None if split is None else [b - a for a, b in split.q_ranges]


def _rank(rank: int, _world_size: int, cfg: dict, results: str) -> None:
    flat = seqpar.make_mesh()
    two_d = seqpar.make_mesh(ulysses_size=cfg["ulysses"])
    gen = torch.Generator().manual_seed(rank)
    s = cfg["seq"] // cfg["ranks"]
    q = torch.randn(1, cfg["heads"], s, cfg["head_dim"], generator=gen).requires_grad_()
    k, v = (torch.randn(1, cfg["kv_heads"], s, cfg["head_dim"], generator=gen).requires_grad_() for _ in "kv")
    dout = torch.randn(1, cfg["heads"], s, cfg["head_dim"], generator=gen)
    lines = []
    for strategy in cfg["strategies"]:
        mesh = two_d if strategy_row(strategy).two_d else flat

        def step(mesh=mesh, strategy=strategy) -> None:
            seqpar.attention(q, k, v, mesh=mesh, strategy=strategy, causal=True, layout="zigzag").backward(dout)

        step()  # warm-up
        dist.barrier()
        before = written_bytes()
        step()
        sent = written_bytes() - before
        times = []
        for _ in range(cfg["repeats"]):
            dist.barrier()
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        stats = torch.tensor([statistics.median(times), float(sent)], dtype=torch.float64)
        table = [torch.empty_like(stats) for _ in range(cfg["ranks"])]
        dist.all_gather(table, stats)
        seconds = max(float(t[0]) for t in table)
        sent_max = max(float(t[1]) for t in table)
        lines.append((strategy, seconds, sent_max, expected_bytes(strategy, cfg)))
    if rank == 0:
        with open(results, "w") as f:
            for line in lines:
                f.write(" ".join(map(str, line)) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.strategies",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--ulysses", type=int, default=2, help="ulysses degree of the hybrid mesh")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--strategies", nargs="+", default=["ring", "ulysses", "hybrid", "allgather"])
    parser.add_argument("--json", metavar="FILE", help="write one record per strategy here")
    args = parser.parse_args(argv)
    cfg = {**vars(args), "kv_heads": args.kv_heads, "head_dim": args.head_dim}
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "results")
        spawn_ranks(_rank, args.ranks, cfg, results, timeout=timedelta(minutes=20))
        with open(results) as f:
            rows = [line.split() for line in f]
    ring_time = next((float(r[1]) for r in rows if r[0] == "ring"), None)
    print(
        f"{args.ranks} ranks (hybrid {args.ranks // args.ulysses} ring x {args.ulysses} ulysses), causal zigzag "
        f"fwd+bwd, seq {args.seq}, heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}, fp32\n"
    )
    print(
        "| strategy | heads per rank | step (s) | time vs ring | bytes sent per rank (busiest) | analytical "
        "| measured / analytical |"
    )
    print("|---|---|---|---|---|---|---|")
    for strategy, seconds, sent, expected in rows:
        seconds, sent, expected = float(seconds), float(sent), float(expected)
        vs_ring = f"{seconds / ring_time:.2f}x" if ring_time else "-"
        split = heads_per_rank(strategy, cfg)
        shares = "-" if split is None else ", ".join(map(str, split))
        print(
            f"| {strategy} | {shares} | {seconds:.2f} | {vs_ring} | {sent / 2**20:.2f} MiB | "
            f"{expected / 2**20:.2f} MiB | {sent / expected:.4f} |"
        )
    if args.json:
        keys = ("ranks", "ulysses", "seq", "heads", "kv_heads", "head_dim", "repeats")
        records = [
            {"strategy": strategy, **{k: cfg[k] for k in keys}, "step_s": float(seconds)}
            | {"sent_bytes_per_rank": float(sent), "analytical_bytes": float(expected)}
            | {"heads_per_rank": heads_per_rank(strategy, cfg)}
            | provenance("strategies", argv)
            for strategy, seconds, sent, expected in rows
        ]
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
