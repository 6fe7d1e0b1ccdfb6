"""Tokens/s and peak memory per rank of one training step of a small Llama at several SP degrees.

Fixed total sequence; every degree runs in fresh processes (one thread per rank) in one invocation:

    python -m benchmarks.llama_step                       # seq 8192, sp 1 2 4, ring
    python -m benchmarks.llama_step --seq 4096 --sp 1 2 --strategy ulysses --repeats 3
    python -m benchmarks.llama_step --vocab 32768 --sp 2 --loss-chunk 1024   # logits in pieces
    python -m benchmarks.llama_step --json llama_step.json                   # also save the rows, with provenance

Each step is forward + backward + AdamW on ``seqpar.shard_batch`` shards with ``seqpar.cross_entropy``.
Before timing, the sharded loss of the first step is checked against the sp=1 loss. Memory = growth of the
resident-set peak (VmHWM) during a step, above the resident set after the warm-up step (weights, optimizer
state and inputs already allocated), measured in separate processes from the timing (``seqpar.bench.measure``).
With more ranks than cores, compare the ratios, not the times.
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
from benchmarks import save_records
from seqpar.bench.maxlen import train_step
from seqpar.bench.measure import time_and_memory, write_slowest
from seqpar.runtime.memory import reset_resident_peak, resident_mb


def llama_config(cfg: dict, max_positions: int) -> dict:
    """The benchmarks' Llama (MLP 3x hidden, half as many KV heads) as config.json fields, from ``cfg``."""
    return {
        "model_type": "llama",
        "vocab_size": cfg["vocab"],
        "hidden_size": cfg["hidden"],
        "intermediate_size": cfg["hidden"] * 3,
        "num_hidden_layers": cfg["layers"],
        "num_attention_heads": cfg["heads"],
        "num_key_value_heads": cfg["heads"] // 2,
        "max_position_embeddings": max_positions,
    }


def _model(cfg: dict):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**llama_config(cfg, cfg["seq"]))
    return transformers.AutoModelForCausalLM.from_config(config)


def _worker(_rank: int, _world_size: int, cfg: dict, out_path: str) -> None:
    mesh = seqpar.make_mesh()
    model = seqpar.prepare_model(_model(cfg), mesh, strategy=cfg["strategy"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, cfg["vocab"], (1, cfg["seq"]), generator=torch.Generator().manual_seed(1))
    shard = seqpar.shard_batch({"input_ids": ids}, mesh)

    def step() -> float:
        return float(seqpar.sum_over(train_step(model, opt, shard, mesh, cfg["loss_chunk"]), mesh))

    first_loss = step()  # warm-up: allocates optimizer state
    times, growth = [], 0.0
    for i in range(1 if cfg["memory"] else cfg["repeats"]):
        dist.barrier()
        before = resident_mb("VmRSS")
        reset_resident_peak()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        if i == 0:
            growth = resident_mb("VmHWM") - before
    write_slowest(out_path, statistics.median(times), growth, first_loss=first_loss)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.llama_step",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seq", type=int, default=8192, help="total sequence length (fixed across degrees)")
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4], help="sequence-parallel degrees")
    parser.add_argument("--strategy", default="ring")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--loss-chunk", type=int, default=0, help="lm_head_cross_entropy pieces (0: whole logits)")
    parser.add_argument("--json", metavar="FILE", help="write one record per sp degree here")
    args = parser.parse_args(argv)
    keys = ("seq", "strategy", "hidden", "layers", "heads", "vocab", "repeats", "loss_chunk")
    cfg = {k: getattr(args, k) for k in keys}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for sp in args.sp:
            out = os.path.join(tmp, f"{sp}.json")

            def args_for(memory, sp=sp, out=out):
                return ({**cfg, "sp": sp, "memory": memory}, out)

            rows.append({"sp": sp, **time_and_memory(_worker, args_for, sp, out)})
            print(f"sp {sp}: {rows[-1]}", flush=True)
    base = rows[0]
    for r in rows:
        if abs(r["first_loss"] - base["first_loss"]) > 1e-4 * abs(base["first_loss"]):
            raise SystemExit(f"sp {r['sp']} loss {r['first_loss']} differs from sp {base['sp']} {base['first_loss']}")
    print(
        f"\nLlama {args.layers}x{args.hidden}, {args.heads} heads, seq {args.seq}, {args.strategy}, fp32, 1 thread/rank"
    )
    print("| sp | step (s) | tokens/s | tokens/s vs sp 1 | per-rank peak growth (MB) | memory vs sp 1 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        tps = args.seq / r["seconds"]
        print(
            f"| {r['sp']} | {r['seconds']:.2f} | {tps:.0f} | {tps / (args.seq / base['seconds']):.2f}x | "
            f"{r['growth_mb']:.0f} | {r['growth_mb'] / base['growth_mb']:.2f} |"
        )
    if args.json:
        records = [{"sp": r["sp"], **cfg, "step_s": r["seconds"], "growth_mb": r["growth_mb"]} for r in rows]
        save_records(args.json, "llama_step", argv, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
