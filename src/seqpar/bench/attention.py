"""Speed-up and memory of sequence-parallel attention against one process on the whole sequence.

Run it on an otherwise idle machine (each rank gets one thread; the single process gets one thread):

    seqpar bench attention                 # causal fwd+bwd, 8 heads, head_dim 64, fp32, 8K and 16K
    seqpar bench attention --seq 4096 --ranks 2 --strategies ring ulysses allgather --repeats 3

Each configuration runs in fresh processes: first one process on the whole sequence (the reference, whose
outputs and gradients are saved), then the sequence-parallel ranks, which check their outputs and
gradients against the reference before they are timed. Speed-up = single step time / slowest rank's step
time. Memory = growth of the resident-set peak (VmHWM) during one step, inputs already allocated.

Time and memory come from separate processes. For memory, glibc serves every large allocation by mmap
(MALLOC_MMAP_THRESHOLD_), so that freed memory leaves the resident set at once and the peak tracks live
tensors; that makes each new tensor pay for its page faults, which the normal allocator (reusing freed
heap) does not, so the timing processes run with the normal allocator.
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

import seqpar
from seqpar.bench import save_records
from seqpar.bench.measure import time_and_memory, write_slowest
from seqpar.runtime.memory import reset_resident_peak, resident_mb


def _chunked_randn(seed: int, shape: tuple[int, int, int, int], chunk_ids, n_chunks: int) -> torch.Tensor:
    """The given chunks of a seeded [B, H, S, D] tensor, generated chunk by chunk (no full copy needed)."""
    b, h, s, d = shape
    c = s // n_chunks
    parts = [torch.randn(b, h, c, d, generator=torch.Generator().manual_seed(seed * 100003 + i)) for i in chunk_ids]
    return torch.cat(parts, dim=2)


def _inputs(cfg: dict, chunk_ids, n_chunks: int):
    shape = (1, cfg["heads"], cfg["seq"], cfg["head_dim"])
    q, k, v, dout = (_chunked_randn(seed, shape, chunk_ids, n_chunks) for seed in (1, 2, 3, 4))
    return [t.requires_grad_() for t in (q, k, v)], dout


def _step(fn, q, k, v, dout) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    out = fn(q, k, v)
    out.backward(dout)
    return out, time.perf_counter() - start


def _measure(fn, q, k, v, dout, repeats: int, sync) -> tuple[float, float]:
    times = []
    growth = 0.0
    for i in range(repeats):
        for t in (q, k, v):
            t.grad = None  # before the baseline reading: the step's own gradients count as growth
        sync()
        before = resident_mb("VmRSS")
        reset_resident_peak()
        out, seconds = _step(fn, q, k, v, dout)
        if i == 0:
            growth = resident_mb("VmHWM") - before
        times.append(seconds)
        del out
    return statistics.median(times), growth


def _single(_rank: int, _world_size: int, cfg: dict, ref_path: str, result_path: str) -> None:
    """One process on the whole sequence: saves the reference (time run) and writes seconds or growth."""
    n_chunks = 2 * cfg["ranks"]
    (q, k, v), dout = _inputs(cfg, range(n_chunks), n_chunks)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    out, _ = _step(fn, q, k, v, dout)  # warm-up; its results are the reference
    if not cfg["memory"]:
        torch.save({"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}, ref_path)
    del out
    seconds, growth = _measure(fn, q, k, v, dout, 1 if cfg["memory"] else cfg["repeats"], lambda: None)
    with open(result_path, "w") as f:
        json.dump({"seconds": seconds, "growth_mb": growth}, f)


def _parallel(rank: int, size: int, cfg: dict, ref_path: str, result_path: str) -> None:
    mesh = seqpar.make_mesh()
    chunk_ids = seqpar.sequence_parallel.layouts.chunks.rank_chunk_ids("zigzag", size, rank)
    (q, k, v), dout = _inputs(cfg, chunk_ids, 2 * size)

    def fn(q, k, v):
        return seqpar.attention(q, k, v, mesh=mesh, strategy=cfg["strategy"], causal=True, layout="zigzag")

    out, _ = _step(fn, q, k, v, dout)  # warm-up, checked against the single-process reference
    ref = torch.load(ref_path, mmap=True)
    idx = torch.cat(
        [torch.arange(c * (cfg["seq"] // (2 * size)), (c + 1) * (cfg["seq"] // (2 * size))) for c in chunk_ids]
    )
    for name, got in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        torch.testing.assert_close(
            got,
            ref[name][:, :, idx],
            atol=1e-4,
            rtol=1e-3,
            msg=lambda m, n=name: f"{cfg['strategy']} rank {rank} {n}: {m}",
        )
    del ref, out
    seconds, growth = _measure(fn, q, k, v, dout, 1 if cfg["memory"] else cfg["repeats"], dist.barrier)
    write_slowest(result_path, seconds, growth)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="seqpar bench attention", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 16384], help="total sequence lengths")
    parser.add_argument("--ranks", type=int, default=2, help="sequence-parallel ranks (one thread each)")
    parser.add_argument("--strategies", nargs="+", default=["ring", "ulysses"], help="strategies to compare")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="timed steps per configuration (median)")
    parser.add_argument("--json", help="also write the table as JSON here")
    args = parser.parse_args(argv)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seq in args.seq:
            base = {
                "seq": seq,
                "heads": args.heads,
                "head_dim": args.head_dim,
                "ranks": args.ranks,
                "repeats": args.repeats,
            }
            ref_path, single_path = os.path.join(tmp, "ref.pt"), os.path.join(tmp, "single.json")

            def single_args(memory, base=base, ref_path=ref_path, single_path=single_path):
                return ({**base, "memory": memory}, ref_path, single_path)

            single = time_and_memory(_single, single_args, 1, single_path, backend=None)
            for strategy in args.strategies:
                par_path = os.path.join(tmp, "par.json")

                def par_args(memory, strategy=strategy, base=base, ref_path=ref_path, par_path=par_path):
                    return ({**base, "strategy": strategy, "memory": memory}, ref_path, par_path)

                par = time_and_memory(_parallel, par_args, args.ranks, par_path)
                rows.append(
                    {
                        "seq": seq,
                        "strategy": strategy,
                        "ranks": args.ranks,
                        "single_s": single["seconds"],
                        "parallel_s": par["seconds"],
                        "speedup": single["seconds"] / par["seconds"],
                        "single_growth_mb": single["growth_mb"],
                        "rank_growth_mb": par["growth_mb"],
                        "memory_ratio": par["growth_mb"] / single["growth_mb"],
                    }
                )
                r = rows[-1]
                print(
                    f"seq {seq:>6} {strategy:>9} x{args.ranks}: {r['single_s']:.2f}s -> {r['parallel_s']:.2f}s "
                    f"speed-up {r['speedup']:.2f}x | peak growth {r['single_growth_mb']:.0f} MB -> "
                    f"{r['rank_growth_mb']:.0f} MB per rank ({r['memory_ratio']:.2f}x)",
                    flush=True,
                )
    print(
        "\n| seq | strategy | ranks | 1 proc (s) | per step (s) | speed-up | 1 proc peak growth (MB) "
        "| per-rank peak growth (MB) | memory ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['seq']} | {r['strategy']} | {r['ranks']} | {r['single_s']:.2f} | {r['parallel_s']:.2f} | "
            f"{r['speedup']:.2f}x | {r['single_growth_mb']:.0f} | {r['rank_growth_mb']:.0f} | "
            f"{r['memory_ratio']:.2f} |"
        )
    if args.json:
        save_records(args.json, "attention", argv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
