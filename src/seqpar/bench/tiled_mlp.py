"""Throughput cost of the tiled MLP: tokens/s of a Llama training step with and without it, side by side.

Both models (same weights) live in the same ranks and their steps alternate, so machine load hits both alike:

    seqpar bench tiled_mlp                                  # seq 8192, sp 1, chunk 1024, checkpointing, chunked loss
    seqpar bench tiled_mlp --seq 16384 --sp 2 --chunk 2048 --repeats 4
    seqpar bench tiled_mlp --no-checkpointing               # tiled MLP without activation checkpointing

A step is forward + backward + AdamW on ``seqpar.shard_batch`` shards. The first step's losses of the two
models must agree (rel 1e-5) before anything is timed. The ratio is reported per pair of consecutive steps
and as the median over pairs, steadier than a ratio of medians on a loaded machine, both for wall-clock time
and for the rank processes' CPU time (one thread each), which waiting for a busy core does not inflate. With
checkpointing the tiled MLP runs its forward three times per step (forward, the layer's recomputation, its own
backward) against two without tiling.
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
import transformers

import seqpar
from seqpar.runtime.spawn import spawn_ranks


def _model(cfg: dict, tiled: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=cfg["vocab"],
        hidden_size=cfg["hidden"],
        intermediate_size=cfg["hidden"] * cfg["mlp_ratio"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["heads"] // 2,
        max_position_embeddings=cfg["seq"],
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    if cfg["checkpointing"]:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if tiled:
        seqpar.apply_tiled_mlp(model, chunk_tokens=cfg["chunk"])
    return model.train()


def _worker(_rank: int, _world_size: int, cfg: dict, out_path: str) -> None:
    torch.set_num_threads(1)
    mesh = seqpar.make_mesh()
    ids = torch.randint(0, cfg["vocab"], (1, cfg["seq"]), generator=torch.Generator().manual_seed(1))
    shard = seqpar.shard_batch({"input_ids": ids}, mesh)
    runs = {}
    for name, tiled in (("untiled", False), ("tiled", True)):
        model = seqpar.prepare_model(_model(cfg, tiled), mesh)
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))

    def step(name: str) -> float:
        model, opt = runs[name]
        hidden = model.get_decoder()(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
        loss = seqpar.lm_head_cross_entropy(
            hidden.last_hidden_state, model.lm_head, shard["shift_labels"], mesh, chunk_size=cfg["loss_chunk"]
        )
        del hidden
        loss.backward()
        seqpar.reduce_gradients(model.parameters(), mesh)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(seqpar.sum_over(loss.detach(), mesh))

    first = {name: step(name) for name in runs}  # warm-up; allocates optimizer state
    if abs(first["tiled"] - first["untiled"]) > 1e-5 * abs(first["untiled"]):
        raise SystemExit(f"tiled loss {first['tiled']} differs from untiled {first['untiled']}")
    times = {name: [] for name in runs}
    cpu = {name: [] for name in runs}
    for repeat in range(cfg["repeats"]):
        for name in list(runs)[:: 1 if repeat % 2 == 0 else -1]:  # alternate which goes first
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            step(name)
            elapsed = torch.tensor([time.perf_counter() - start, time.process_time() - start_cpu], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(float(elapsed[0]))
            cpu[name].append(float(elapsed[1]))
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"times": times, "cpu": cpu, "first_loss": first}, f)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="seqpar bench tiled_mlp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, default=8192, help="total sequence length")
    parser.add_argument("--sp", type=int, default=1, help="sequence-parallel degree (spawned gloo ranks)")
    parser.add_argument("--chunk", type=int, default=1024, help="tokens per tiled-MLP chunk")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--mlp-ratio", type=int, default=3, help="intermediate size / hidden size")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--loss-chunk", type=int, default=1024, help="lm_head_cross_entropy pieces")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps of each model")
    parser.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)
    cfg = {k: getattr(args, k) for k in vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        spawn_ranks(_worker, args.sp, cfg, out)
        with open(out) as f:
            result = json.load(f)
    median = {name: statistics.median(t) for name, t in result["times"].items()}
    print(
        f"\nLlama {args.layers}x{args.hidden} (MLP {args.hidden * args.mlp_ratio}), vocab {args.vocab}, "
        f"seq {args.seq}, sp {args.sp}, fp32, 1 thread/rank, checkpointing {'on' if args.checkpointing else 'off'}, "
        f"loss chunk {args.loss_chunk}; {args.repeats} alternating steps each, median"
    )
    print("| MLP | step (s) | tokens/s | vs untiled |")
    print("|---|---|---|---|")
    for name, label in (("untiled", "whole"), ("tiled", f"tiled, chunk {args.chunk}")):
        print(
            f"| {label} | {median[name]:.2f} | {args.seq / median[name]:.0f} | "
            f"{median['untiled'] / median[name]:.3f}x |"
        )
    for key, what in (("times", "wall-clock"), ("cpu", "CPU time (the process's, insensitive to waiting for a core)")):
        pairs = [u / t for u, t in zip(result[key]["untiled"], result[key]["tiled"])]
        print(f"tiled / untiled tokens per second of {what}, per pair of steps: {', '.join(f'{r:.3f}' for r in pairs)}")
        print(f"  median over pairs: {statistics.median(pairs):.3f}x; step times (s): {json.dumps(result[key])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
