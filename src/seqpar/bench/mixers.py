"""``seqpar bench mixers``: one gated DeltaNet layer's exchange under sequence parallelism, its bytes and its time.

Run::

    seqpar bench mixers                           # Qwen3-Next-shaped layer, 8192 tokens, sp 2 and 4
    seqpar bench mixers --seq 16384 --sp 2 --json mixers_cpu.json

Each degree runs in fresh spawned ranks (one thread each). On every rank the layer (Qwen3-Next's
``Qwen3NextGatedDeltaNet`` built from a config) runs forward and backward on its zigzag shard twice, taking turns:
adapted (the halo convolution and the state passing, Note [state passing]: exact) and as the model's own layer
on the shard alone (what a rank computes when nothing is exchanged: wrong, the local cost only). Bytes are what
the rank wrote to its sockets during the adapted step (``/proc/self/io``), beside the analytical volume of the
two all-gathers and their reduce-scatters (on gloo, which runs a reduce-scatter as an all-reduce, and on NCCL),
and beside what a head-parallel all-to-all (q, k, v, gates and decays
in, outputs back, forward and backward) would move for the same layer. Times are medians; read the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from seqpar.bench import save_records

__all__ = ["main"]


def _layer(cfg: dict) -> torch.nn.Module:
    import transformers

    config = transformers.Qwen3NextConfig(
        vocab_size=256,
        hidden_size=cfg["hidden"],
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["linear_attention"],
        linear_num_key_heads=cfg["key_heads"],
        linear_num_value_heads=cfg["value_heads"],
        linear_key_head_dim=cfg["head_dim"],
        linear_value_head_dim=cfg["head_dim"],
        linear_conv_kernel_dim=4,
        num_experts=2,
        num_experts_per_tok=1,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).model.layers[0].linear_attn.float()


def _volumes(cfg: dict, sp: int) -> dict:
    """Analytical bytes one rank sends per forward + backward (fp32)."""
    chunks, dk, dv = 2, cfg["head_dim"], cfg["head_dim"]  # zigzag: two chunks a rank
    conv_channels = 2 * cfg["key_heads"] * dk + cfg["value_heads"] * dv
    local = (3 * conv_channels + cfg["value_heads"] * (dk + dv) * dk) * chunks * 4  # tails (K - 1 = 3), summaries
    per_token = 2 * cfg["key_heads"] * dk + 2 * cfg["value_heads"] * dv + 2 * cfg["value_heads"]  # in and out
    all_to_all = 2 * per_token * 4 * (cfg["seq"] // sp) * (sp - 1) / sp  # forward and backward
    # an all-gather sends (P - 1) x its piece, as does a reduce-scatter; gloo runs the reduce-scatter as an
    # all-reduce of the gathered size, 2 (P - 1) x the piece
    return {
        "exchange_bytes": 2 * (sp - 1) * local,
        "exchange_bytes_gloo": 3 * (sp - 1) * local,
        "all_to_all_bytes": all_to_all,
    }


def _worker(rank: int, world_size: int, cfg: dict, out: str) -> None:
    import seqpar
    from seqpar.runtime.memory import written_bytes
    from seqpar.sequence_parallel.call_context import CONTEXT_KEY, CallContext
    from seqpar.sequence_parallel.masks import sequence_mask
    from seqpar.sequence_parallel.mixers import adapt

    mesh = seqpar.make_mesh()
    own, adapted = _layer(cfg), _layer(cfg)
    adapt((adapted,))
    ctx = CallContext(mesh, "ring", "zigzag", "auto", sequence_mask(None, mesh, batch_size=1), {})
    g = torch.Generator().manual_seed(1)
    whole = torch.randn(1, cfg["seq"], cfg["hidden"], generator=g)
    shard = seqpar.shard_sequence(whole, mesh).requires_grad_()
    times: dict[str, list[float]] = {"adapted": [], "local": []}
    sent = 0
    for round_ in range(cfg["rounds"] + 1):  # round 0 warms up
        for name, layer in (("adapted", adapted), ("local", own)):
            dist.barrier()
            before, start = written_bytes(), time.perf_counter()
            kwargs = {CONTEXT_KEY: ctx} if name == "adapted" else {}
            layer(shard, **kwargs).square().mean().backward()
            elapsed = time.perf_counter() - start
            if round_:
                times[name].append(elapsed)
                if name == "adapted":
                    sent = written_bytes() - before
            shard.grad = None
    stats = torch.tensor(
        [statistics.median(times["adapted"]), statistics.median(times["local"]), sent], dtype=torch.float64
    )
    table = [torch.empty_like(stats) for _ in range(world_size)]
    dist.all_gather(table, stats)
    if rank == 0:
        slowest = torch.stack(table).max(0).values.tolist()
        with open(out, "w") as f:
            json.dump({"adapted_s": slowest[0], "local_s": slowest[1], "sent_bytes": slowest[2]}, f)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="seqpar bench mixers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, default=8192, help="tokens of the whole sequence")
    parser.add_argument("--sp", type=int, nargs="+", default=[2, 4], help="sequence-parallel degrees")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--key-heads", type=int, default=4)
    parser.add_argument("--value-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", metavar="FILE", help="write one record per degree here")
    args = parser.parse_args(argv)
    from seqpar.runtime.spawn import spawn_ranks

    cfg = {k: getattr(args, k) for k in ("seq", "hidden", "key_heads", "value_heads", "head_dim", "rounds")}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for sp in args.sp:
            out = os.path.join(tmp, f"{sp}.json")
            spawn_ranks(_worker, sp, cfg, out)
            with open(out) as f:
                rows.append({"sp": sp, **json.load(f), **_volumes(cfg, sp)})
    print(
        f"gated DeltaNet layer (Qwen3-Next-shaped: hidden {args.hidden}, {args.key_heads} key / {args.value_heads} "
        f"value heads of {args.head_dim}), {args.seq} tokens, zigzag, fp32, fwd+bwd, medians of {args.rounds}"
    )
    print("| sp | bytes sent (measured, gloo) | analytical on gloo | analytical (NCCL) | head-parallel all-to-all |"
          " all-to-all / exchange | adapted step (s) | shard alone (s) | adapted / alone |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['sp']} | {r['sent_bytes'] / 2**10:.0f} KiB | {r['exchange_bytes_gloo'] / 2**10:.0f} KiB | "
            f"{r['exchange_bytes'] / 2**10:.0f} KiB | "
            f"{r['all_to_all_bytes'] / 2**10:.0f} KiB | {r['all_to_all_bytes'] / r['exchange_bytes']:.0f}x | "
            f"{r['adapted_s']:.3f} | {r['local_s']:.3f} | {r['adapted_s'] / r['local_s']:.2f} |"
        )
    if args.json:
        save_records(args.json, "mixers", argv, [{**cfg, **r} for r in rows])
    return 0
