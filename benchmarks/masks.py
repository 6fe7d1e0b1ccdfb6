"""What masks cost and save: causal attention with and without packed documents, windows and blocks, per strategy.

    python -m benchmarks.masks                # 4 ranks, seq 8192, 8/2 heads, 16 uneven documents, window S/8, frames
    python -m benchmarks.masks --ranks 2 --seq 16384 --docs 16 --window 2048 --layouts zigzag contiguous
    python -m benchmarks.masks --layouts zigzag balanced --strategies ring --json masks.json

Each strategy runs fwd+bwd on the same spawned gloo ranks (one thread each) for: plain causal, causal with
packed documents of uneven lengths (tiles across documents are skipped, tiles on a boundary masked), the
same with log-normal document lengths (median S/16, 100 to 64K tokens: an SFT-like mix), RL-like groups (8
completions of similar length after one prompt each), log-normal documents all shorter than S/(2P), a causal
sliding window, and block-causal frames (a token sees its own frame and earlier ones). Work falls with the
visible area; with a mask, ring, allgather and hybrid's ring axis also move only the K/V some peer query
sees (Note [mask-aware ring]). Layouts "balanced" and "placed" are solved per mask (Notes [balanced layout],
[placed layout]; the placed row is reordered and padded: ``tokens_per_rank`` counts each rank's real tokens,
``tokens_max_over_mean`` its local length, padding included, over S/P, ``layout_solve_s`` the solver's
seconds); "auto" is either, per mask, as ``shard_batch(layout="auto")`` picks (``resolved_layout`` says which;
the table writes "auto (placed)"). Per (strategy, mask, layout) it
measures the bytes each rank writes to its sockets (/proc/self/io) against the bytes the mask makes
necessary (``masks_bytes``), the step time (slowest rank, wall), and each rank's attention compute time:
the thread CPU time of its kernel calls (``TimedKernel``), which a rank waiting for a peer does not
accrue, so ``rank_time_max_over_mean`` (the slowest rank's compute over the mean) measures load balance
even where ranks share cores. ``--json FILE`` writes one record per (strategy, mask, layout) with
``bytes_sent_per_rank``, ``bytes_needed_per_rank``, ``rank_compute_s``, ``rank_time_max_over_mean``,
``visible_max_over_mean`` (the layout's visible-area balance), ``step_s`` and ``floor_bytes``: for packed
documents without a window or blocks, the least the busiest rank can need under ring or all-gather with
any placement even within 1.05 (``placement.traffic_floor``, the input check included; None otherwise).
Results are not checked here; the tests check every mask against SDPA, the bytes against the need and the
solver's balance.
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
from benchmarks.kernel_time import TimedKernel
from benchmarks.masks_bytes import floor_bytes, needed_bytes, visible_fraction
from benchmarks.rows import log_normal_documents, rl_groups, short_documents, uneven_documents
from seqpar.runtime.memory import written_bytes
from seqpar.runtime.spawn import spawn_ranks
from seqpar.sequence_parallel.layouts.chunks import layout_names, rank_chunk_ids
from seqpar.sequence_parallel.layouts.placed import resolve_auto_layout
from seqpar.sequence_parallel.strategies.registry import strategy_row

__all__ = ["log_normal_documents", "main"]


def _cases(args: argparse.Namespace) -> dict[str, tuple]:
    """Mask name -> (global position ids or None, window, block size)."""
    return {
        "causal": (None, None, None),
        f"{args.docs} documents": (uneven_documents(args.seq, args.docs), None, None),
        "log-normal documents": (log_normal_documents(args.seq, args.seed, args.median), None, None),
        "RL groups": (rl_groups(args.seq, args.seed), None, None),
        "short documents": (short_documents(args.seq, args.ranks, args.seed), None, None),
        f"window {args.window}": (None, args.window, None),
        f"frames {args.frame}": (None, None, args.frame),
    }


def _measure(step, repeats: int, kernel: TimedKernel) -> tuple[int, float, float]:
    """Bytes written in one step, and the median wall seconds and kernel CPU seconds of a step."""
    step()  # warm-up: plans and the K/V table are made once per mask
    dist.barrier()
    before = written_bytes()
    step()
    sent = written_bytes() - before
    times, computes = [], []
    for _ in range(repeats):
        dist.barrier()
        kernel.seconds = 0.0
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        computes.append(kernel.seconds)
    return sent, statistics.median(times), statistics.median(computes)


def _layout_for(name: str, positions: torch.Tensor | None, window, frame, args) -> tuple:
    """(layout, the layout it resolved to, global position ids of the row it cuts, real tokens per rank, solve
    seconds); "auto" resolves as ``shard_batch(layout="auto")`` does: placed on packed rows, else balanced."""
    ids = positions if positions is not None else torch.arange(args.seq)
    start = time.perf_counter()
    if name == "auto":
        name = resolve_auto_layout(ids, blocks=frame)
    if name == "balanced":
        layout = seqpar.balanced_layout(ids, args.ranks, window=window, blocks=frame)
    elif name == "placed":  # the row reordered and padded (Note [placed layout])
        placement = seqpar.placed_layout(ids, args.ranks, window=window, blocks=frame)
        seconds = time.perf_counter() - start
        return placement.layout, name, placement.position_ids[0], placement.tokens_per_rank(), seconds
    else:
        layout = name
    return layout, name, ids, (args.seq // args.ranks,) * args.ranks, time.perf_counter() - start


def _worker(rank: int, world_size: int, args: argparse.Namespace, results: str) -> None:
    meshes = {"flat": seqpar.make_mesh(), "two_d": seqpar.make_mesh(ulysses_size=args.ulysses)}
    probe = torch.zeros(1, args.heads, 8, 64), torch.zeros(1, args.kv_heads, 8, 64)
    kernel, records = TimedKernel(seqpar.select_kernel(probe[0], probe[1], probe[1])), []
    for layout_name in args.layouts:
        for name, (positions, window, frame) in _cases(args).items():
            if not any(m in name for m in args.masks):
                continue
            layout, resolved, ids, tokens, solve_s = _layout_for(layout_name, positions, window, frame, args)
            cfg = {**vars(args), "head_dim": 64, "seq": len(ids)}
            local = len(ids) // world_size
            gen = torch.Generator().manual_seed(rank)
            q = torch.randn(1, args.heads, local, 64, generator=gen, requires_grad=True)
            k, v = (torch.randn(1, args.kv_heads, local, 64, generator=gen, requires_grad=True) for _ in "kv")
            dout = torch.randn(1, args.heads, local, 64, generator=gen)
            packed = positions is not None or resolved == "placed"
            shard = seqpar.shard_sequence(ids[None], meshes["flat"], layout=layout) if packed else None
            mask = seqpar.sequence_mask(shard, meshes["flat"], layout=layout, window=window, blocks=frame)
            balance = seqpar.layout_balance(ids, layout, world_size, window=window, blocks=frame)
            documents = positions is not None and window is None and frame is None  # Note [traffic floor]
            floor = floor_bytes(positions, world_size, args.kv_heads, 64) if documents else None
            for strategy in args.strategies:
                mesh = meshes["two_d" if strategy_row(strategy).two_d else "flat"]

                def step(mesh=mesh, strategy=strategy, mask=mask, layout=layout, q=q, k=k, v=v, dout=dout) -> None:
                    options = dict(mesh=mesh, strategy=strategy, layout=layout, mask=mask, kernel=kernel)
                    seqpar.attention(q, k, v, **options).backward(dout)

                sent, seconds, compute = _measure(step, args.repeats, kernel)
                need = needed_bytes(strategy, cfg, mask, layout, rank)
                mine = torch.tensor([float(sent), need, seconds, compute], dtype=torch.float64)
                table = [torch.empty_like(mine) for _ in range(world_size)]
                dist.all_gather(table, mine)
                computes = [float(t[3]) for t in table]
                records.append({
                    "strategy": strategy, "mask": name, "layout": layout_name, "resolved_layout": resolved,
                    "ranks": world_size, "seq": args.seq,
                    "chunks_per_rank": len(rank_chunk_ids(layout, world_size, 0)),
                    "bytes_sent_per_rank": [int(t[0]) for t in table],
                    "bytes_needed_per_rank": [int(t[1]) for t in table],
                    "rank_compute_s": computes,
                    "rank_time_max_over_mean": max(computes) / statistics.mean(computes),
                    "visible_max_over_mean": balance.visible_max_over_mean,
                    "planned_max_over_mean": balance.planned_max_over_mean,
                    "step_s": max(float(t[2]) for t in table),
                    "visible_vs_causal": visible_fraction(
                        positions if positions is not None else torch.arange(args.seq), window, frame
                    ),
                    "tokens_per_rank": list(tokens), "local_tokens": local,
                    "tokens_max_over_mean": local * world_size / args.seq, "layout_solve_s": solve_s,
                    "floor_bytes": floor,
                })  # fmt: skip
    if rank == 0:
        with open(results, "w") as f:
            json.dump(records, f)


def _print(records: list[dict], args: argparse.Namespace) -> None:
    print(f"\n{args.ranks} ranks, seq {args.seq}, heads {args.heads}/{args.kv_heads}, head_dim 64, fp32, fwd+bwd")
    print(
        "| strategy | layout | mask | step (s) | vs causal | visible vs causal | sent / needed "
        "| rank compute max/mean | visible area max/mean |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    base = {(r["strategy"], r["layout"]): r["step_s"] for r in records if r["mask"] == "causal"}
    for r in records:
        ratio = sum(r["bytes_sent_per_rank"]) / sum(r["bytes_needed_per_rank"])  # all ranks: headers cost little
        vs = r["step_s"] / base.get((r["strategy"], r["layout"]), r["step_s"])
        layout = r["layout"] if r["resolved_layout"] == r["layout"] else f"{r['layout']} ({r['resolved_layout']})"
        print(
            f"| {r['strategy']} | {layout} | {r['mask']} | {r['step_s']:.2f} | {vs:.2f} | "
            f"{r['visible_vs_causal']:.2f} | {ratio:.2f} | {r['rank_time_max_over_mean']:.3f} | "
            f"{r['visible_max_over_mean']:.3f} |"
        )


def _time_solver(args: argparse.Namespace) -> int:
    """Print the placed solver's median and slowest seconds over 5 log-normal rows (median 2K tokens), one thread:
    its thread's CPU time (what one core spends, whatever else the machine runs) and wall time."""
    torch.set_num_threads(1)
    cpu, wall = [], []
    for seed in range(5):
        ids = log_normal_documents(args.seq, seed, 2000)
        seqpar.placed_layout(ids, args.ranks)  # warm-up: the first call pays imports and allocations
        start, start_cpu = time.perf_counter(), time.thread_time()
        seqpar.placed_layout(ids, args.ranks)
        cpu.append(time.thread_time() - start_cpu)
        wall.append(time.perf_counter() - start)
    median, slowest = statistics.median, max
    print(f"placed_layout, {args.seq} tokens, {args.ranks} ranks, one thread: CPU median {median(cpu):.4f} s, "
          f"slowest {slowest(cpu):.4f} s; wall median {median(wall):.4f} s, slowest {slowest(wall):.4f} s")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.masks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--ulysses", type=int, default=2, help="ulysses degree of the hybrid mesh")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--docs", type=int, default=16, help="uneven documents packed into the sequence")
    parser.add_argument("--window", type=int, default=None, help="sliding window (default: seq / 8)")
    parser.add_argument("--frame", type=int, default=None, help="block-causal block size (default: seq / 16)")
    parser.add_argument("--strategies", nargs="+", default=["ring", "allgather", "hybrid", "ulysses"])
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=["zigzag", "balanced", "placed"],
        choices=layout_names(),
        help="auto: per mask, as shard_batch(layout='auto') resolves it (placed on packed rows, else balanced)",
    )
    parser.add_argument(
        "--masks", nargs="+", default=["causal", "documents", "log-normal", "RL", "window", "frames"],
        help="which masks to run (parts of their names)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the log-normal document lengths")
    parser.add_argument("--median", type=int, default=None, help="median log-normal document (default: seq / 16)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", metavar="FILE", help="write one record per (strategy, mask, layout) here")
    parser.add_argument(
        "--solve-only", action="store_true",
        help="only time the placed layout's solver (one thread, SFT-like rows of --seq tokens over --ranks)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.solve_only:
        return _time_solver(args)
    args.window = args.window or args.seq // 8
    args.frame = args.frame or args.seq // 16
    args.median = args.median or max(100, args.seq // 16)
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "results.json")
        spawn_ranks(_worker, args.ranks, args, results)
        with open(results) as f:
            records = json.load(f)
    _print(records, args)
    if args.json:
        save_records(args.json, "masks", argv, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
