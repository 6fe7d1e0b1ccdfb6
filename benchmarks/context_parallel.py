"""What ``seqpar.context_parallel`` costs: the SDPA drop-in against ``seqpar.attention``, and memory per rank.

    python -m benchmarks.context_parallel   # 2 ranks: attention at 8192 tokens; a video block at 2048, 4096 tokens
    python -m benchmarks.context_parallel --ranks 2 --seq 4096 --tokens 1024 2048 --repeats 3 --strategy ring
    python -m benchmarks.context_parallel --json context_parallel.json   # also save both tables' rows

(a) Overhead. On the same ranks, with the same shapes (causal, fp32, fwd+bwd), three ways timed in turn
within each repeat: ``seqpar.attention`` on local shards (direct); ``F.scaled_dot_product_attention``
inside ``context_parallel`` on the same shards (the TorchFunctionMode and its agreement all-gather); and
torch's snippet as written, where ``context_parallel`` shards full leaf q/k/v on entry and restores them
on exit, all-gathering their gradients. Then a video block (non-causal, fwd+bwd, width heads x head_dim)
that calls ``seqpar.attention`` on its shard against the same block, calling SDPA, under
``context_parallel``: the mode sees every torch call of the block, so this is where its per-call cost
shows. Times are the slowest rank's median; ratios are against the direct call.

(b) Memory. A DiT-style video block (non-causal attention over N patch tokens, fwd+bwd) in one process on
all N tokens, and on the ranks under ``context_parallel`` (the batch replicated, as with torch's). The
peak resident-set growth of one step per rank against the single process, measured in separate
processes whose large allocations are served by mmap (as ``seqpar bench attention`` does); step times
come from runs with the normal allocator.
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
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import seqpar
from benchmarks import save_records
from seqpar.bench.measure import time_and_memory, write_slowest
from seqpar.runtime.memory import reset_resident_peak, resident_mb
from seqpar.runtime.spawn import spawn_ranks


def _leaves(shape: tuple[int, ...], seeds: tuple[int, ...]) -> list[torch.Tensor]:
    return [torch.randn(shape, generator=torch.Generator().manual_seed(s)).requires_grad_() for s in seeds]


def _timed(variants: dict, leaves: list[torch.Tensor], repeats: int) -> list[float]:
    """Each variant's median step time (slowest rank), the variants taking turns within each repeat."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(repeats + 1):  # the first round warms up
        for name, fn in variants.items():
            for t in leaves:
                t.grad = None
            dist.barrier()
            start = time.perf_counter()
            fn()
            if i:
                times[name].append(time.perf_counter() - start)
    medians = torch.tensor([statistics.median(t) for t in times.values()], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return medians.tolist()


def _overhead(rank: int, world: int, args: argparse.Namespace, out_path: str) -> None:
    """(a): attention direct / mode on shards / full snippet, then a video block direct / drop-in."""
    mesh = init_device_mesh("cpu", (world,))
    shape = (1, args.heads, args.seq, args.head_dim)
    full = _leaves(shape, (1, 2, 3))
    shards = [seqpar.shard_sequence(t.detach(), mesh, dim=2).requires_grad_() for t in full]
    dout = seqpar.shard_sequence(torch.randn(shape, generator=torch.Generator().manual_seed(4)), mesh, dim=2)
    kw = dict(strategy=args.strategy)

    def snippet() -> None:
        q, k, v = full
        with seqpar.context_parallel(mesh, buffers=(q, k, v), buffer_seq_dims=(2, 2, 2), **kw):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout)

    def mode_only() -> None:
        with seqpar.context_parallel(mesh, **kw):
            F.scaled_dot_product_attention(*shards, is_causal=True).backward(dout)

    attention = {
        "seqpar.attention": lambda: seqpar.attention(*shards, mesh=mesh, causal=True, **kw).backward(dout),
        "context_parallel, shards in hand": mode_only,
        "torch snippet (shards full leaves)": snippet,
    }
    block = _VideoBlock(args.heads * args.head_dim, args.heads)
    x = torch.randn(1, args.seq, args.heads * args.head_dim, generator=torch.Generator().manual_seed(5))
    x_local = seqpar.shard_sequence(x, mesh, dim=1)

    def block_direct() -> None:
        block.attend = lambda q, k, v: seqpar.attention(q, k, v, mesh=mesh, causal=False, **kw)
        block(x_local).square().mean().backward()
        block.attend = F.scaled_dot_product_attention

    def block_drop_in() -> None:
        with seqpar.context_parallel(mesh, buffers=(x,), buffer_seq_dims=(1,), **kw):
            block(x).square().mean().backward()

    rows = _timed(attention, [*full, *shards], args.repeats)
    blocks = _timed({"direct": block_direct, "drop-in": block_drop_in}, list(block.parameters()), args.repeats)
    if rank == 0:
        print(f"\n(a) {world} ranks, seq {args.seq}, heads {args.heads}, head_dim {args.head_dim}, fp32, fwd+bwd")
        print(f"| way ({args.strategy}) | step (s) | vs direct |")
        print("|---|---|---|")
        for name, seconds in zip(attention, rows):
            print(f"| causal attention: {name} | {seconds:.4f} | {seconds / rows[0]:.3f} |")
        block_ways = ("seqpar.attention in the block", "block under context_parallel")
        for name, seconds in zip(block_ways, blocks):
            print(f"| video block (non-causal): {name} | {seconds:.4f} | {seconds / blocks[0]:.3f} |")
        records = [
            {"part": part, "way": name, "step_s": seconds, "vs_direct": seconds / times[0]}
            for part, names, times in (("causal attention", attention, rows), ("video block", block_ways, blocks))
            for name, seconds in zip(names, times)
        ]
        with open(out_path, "w") as f:
            json.dump(records, f)


class _VideoBlock(nn.Module):
    """Pre-norm transformer block with full (non-causal) attention over ``[B, N, dim]`` patch tokens."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.attend = F.scaled_dot_product_attention  # the overhead run swaps in seqpar.attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(self.attend(q, k, v).transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.norm2(x))


def _video_step(cfg: dict, world: int) -> tuple[float, float]:
    """One warm-up step, then the measured steps: (median seconds, peak growth of the first in MiB)."""
    torch.manual_seed(0)
    block = _VideoBlock(cfg["dim"], cfg["heads"])
    x = torch.randn(1, cfg["tokens"], cfg["dim"], generator=torch.Generator().manual_seed(1))
    mesh = init_device_mesh("cpu", (world,)) if world > 1 else None

    def step() -> None:
        if mesh is None:
            block(x).square().mean().backward()
            return
        with seqpar.context_parallel(mesh, buffers=(x,), buffer_seq_dims=(1,), strategy=cfg["strategy"]):
            block(x).square().mean().backward()

    step()
    times, growth = [], 0.0
    for i in range(1 if cfg["memory"] else cfg["repeats"]):
        block.zero_grad(set_to_none=True)  # the step's own gradients count as growth
        if mesh is not None:
            dist.barrier()
        before = resident_mb("VmRSS")
        reset_resident_peak()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        if i == 0:
            growth = resident_mb("VmHWM") - before
    return statistics.median(times), growth


def _video_single(_rank: int, _world: int, cfg: dict, path: str) -> None:
    seconds, growth = _video_step(cfg, 1)
    with open(path, "w") as f:
        json.dump({"seconds": seconds, "growth_mb": growth}, f)


def _video_ranks(_rank: int, world: int, cfg: dict, path: str) -> None:
    seconds, growth = _video_step(cfg, world)
    write_slowest(path, seconds, growth)


def _memory_table(args: argparse.Namespace) -> list[dict]:
    """(b): one process against the ranks, for each token count; returns one record per count."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        for tokens in args.tokens:
            base = {"tokens": tokens, "dim": args.dim, "heads": args.heads, "strategy": args.strategy}
            base["repeats"] = args.repeats

            def args_for(memory: bool, base: dict = base) -> tuple:
                return ({**base, "memory": memory}, path)

            single = time_and_memory(_video_single, args_for, 1, path, backend=None)
            ranks = time_and_memory(_video_ranks, args_for, args.ranks, path)
            rows.append((tokens, single, ranks))
    print(f"\n(b) video block, dim {args.dim}, heads {args.heads}, fp32, non-causal, fwd+bwd, {args.strategy}")
    print(f"| tokens | 1 process (s) | {args.ranks} ranks (s) | 1 process peak growth (MB) | per-rank (MB) | ratio |")
    print("|---|---|---|---|---|---|")
    records = []
    for tokens, single, ranks in rows:
        ratio = ranks["growth_mb"] / single["growth_mb"] if single["growth_mb"] > 0 else float("nan")
        print(
            f"| {tokens} | {single['seconds']:.3f} | {ranks['seconds']:.3f} | {single['growth_mb']:.0f} | "
            f"{ranks['growth_mb']:.0f} | {ratio:.2f} |"
        )
        records.append(
            {"part": "memory", "tokens": tokens, "single_s": single["seconds"], "ranks_s": ranks["seconds"]}
            | {"single_growth_mb": single["growth_mb"], "rank_growth_mb": ranks["growth_mb"]}
        )
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.context_parallel",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--ranks", type=int, default=2, help="sequence-parallel ranks (one thread each)")
    parser.add_argument("--strategy", default="auto", choices=seqpar.STRATEGIES)
    parser.add_argument("--seq", type=int, default=8192, help="(a) attention's total sequence length")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64, help="(a) attention's head dim")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096], help="(b) patch tokens per clip")
    parser.add_argument("--dim", type=int, default=256, help="(b) the video block's width")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps (median)")
    parser.add_argument("--skip", choices=("overhead", "memory"), help="leave one part out")
    parser.add_argument("--json", metavar="FILE", help="write one record per row of both tables here")
    args = parser.parse_args(argv)
    records = []
    if args.skip != "overhead":
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "overhead.json")
            spawn_ranks(_overhead, args.ranks, args, path)
            with open(path) as f:
                records += json.load(f)
    if args.skip != "memory":
        records += _memory_table(args)
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k not in ("json", "skip")}
        save_records(args.json, "context_parallel", argv, [{**settings, **r} for r in records])
    return 0


if __name__ == "__main__":
    sys.exit(main())
