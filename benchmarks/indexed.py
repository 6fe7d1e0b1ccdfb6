"""Bytes one rank sends for a DeepSeek Sparse Attention layer under seqpar, measured against their model.

    python -m benchmarks.indexed                      # 4 ranks, seq 4096, DeepSeek-V3.2's layer at hidden 256, fp32
    python -m benchmarks.indexed --ranks 2 --seq 8192

One DeepSeek-V3.2 layer (MLA with its indexer, a dense MLP) runs forward and backward on spawned gloo ranks;
the bytes each rank writes to its sockets (/proc/self/io) during one step are compared with the model of Note
[indexed attention]: the indexer keys all-gathered (``index_head_dim`` values a token, forward only, under
no_grad), the expanded keys and values all-gathered (padded to one head width, Note [value head size]) and
their gradients reduce-scattered (gloo's ring: 2 (P-1)/P of the whole row's), plus what every call sends (the
position ids' all-gather for the mask, the call check's signature).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

import seqpar
from benchmarks import save_records
from seqpar.runtime.memory import written_bytes
from seqpar.runtime.spawn import spawn_ranks
from seqpar.sequence_parallel.call_checks import CallSignature


def model_config(args: argparse.Namespace) -> object:
    """The benchmark's one-layer DeepSeek-V3.2 config."""
    import transformers

    return transformers.DeepseekV32Config(
        vocab_size=512,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=1,
        first_k_dense_replace=1,  # a dense MLP: the layer's only exchanges are its attention's
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        index_n_heads=4,
        index_head_dim=args.index_dim,
        index_topk=args.topk,
        max_position_embeddings=2 * args.seq,
    )


def modelled(cfg: object, ranks: int, seq: int, itemsize: int = 4) -> dict[str, float]:
    """Bytes one rank sends in one forward + backward of the one-layer model, by part (Note [indexed attention])."""
    n, peers = seq // ranks, ranks - 1
    width = max(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim)  # one head width (Note [value head size])
    local_kv = 2 * cfg.num_attention_heads * n * width  # K and V elements of one rank, after the MLA expansion
    return {
        "indexer_keys": peers * n * cfg.index_head_dim * itemsize,
        "keys_values": peers * local_kv * itemsize + 2 * peers / ranks * ranks * local_kv * itemsize,
        "call": peers * n * 8 + peers * CallSignature.width() * 8,  # position ids (int64), the call's signature
    }


def _rank(rank: int, world: int, args: argparse.Namespace, out: str) -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = model_config(args)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    mesh = seqpar.make_mesh(sp_size=world)
    model = seqpar.prepare_model(model, mesh)
    ids = torch.randint(3, cfg.vocab_size, (1, args.seq), generator=torch.Generator().manual_seed(1))
    shard = seqpar.shard_batch({"input_ids": ids}, mesh)

    def step() -> None:
        logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
        seqpar.cross_entropy(logits.float(), shard["shift_labels"], mesh).backward()

    step()  # warm-up
    dist.barrier()
    before = written_bytes()
    step()
    sent = torch.tensor([float(written_bytes() - before)], dtype=torch.float64)
    table = [torch.empty_like(sent) for _ in range(world)]
    dist.all_gather(table, sent)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"sent_bytes_per_rank": max(float(t) for t in table)}, f)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.indexed", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--index-dim", type=int, default=64, help="index_head_dim: the indexer key's width")
    parser.add_argument("--topk", type=int, default=256, help="index_topk: the keys each query keeps")
    parser.add_argument("--json", metavar="FILE", help="write the record here (a JSON list)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "sent.json")
        spawn_ranks(_rank, args.ranks, args, out, timeout=timedelta(minutes=20))
        with open(out) as f:
            sent = json.load(f)["sent_bytes_per_rank"]
    parts = modelled(model_config(args), args.ranks, args.seq)
    total = sum(parts.values())
    record = {
        "ranks": args.ranks,
        "seq": args.seq,
        "hidden": args.hidden,
        "heads": args.heads,
        "index_head_dim": args.index_dim,
        "index_topk": args.topk,
        "modelled_bytes": parts,
        "analytical_bytes": total,
        "sent_bytes_per_rank": sent,
    }
    mib = 2**20
    print(" | ".join(f"{k} {v / mib:.2f} MiB" for k, v in parts.items()))
    print(f"sent {sent / mib:.2f} MiB per rank, modelled {total / mib:.2f} MiB: {sent / total:.4f}")
    if args.json:
        save_records(args.json, "indexed", argv, [record])
    return 0


if __name__ == "__main__":
    sys.exit(main())
