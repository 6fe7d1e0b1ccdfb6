"""Bytes one rank sends for a sparse or compressed attention layer under seqpar, measured against their model.

    python -m benchmarks.indexed                      # 4 ranks, seq 4096, DeepSeek-V3.2's layer at hidden 256, fp32
    python -m benchmarks.indexed --ranks 2 --seq 8192
    python -m benchmarks.indexed --layer csa          # DeepSeek-V4's compressed sparse attention layer (hca: heavily)
    python -m benchmarks.indexed --layer qsa          # Qwen4-Exp's QSA layer, its n-gram halo and gated DeltaNet

One layer runs forward and backward on spawned gloo ranks; the bytes each rank writes to its sockets
(/proc/self/io) during one step are compared with the model of its exchanges. ``dsa``: a DeepSeek-V3.2 layer
(MLA with its indexer, a dense MLP), Note [indexed attention]: the indexer keys all-gathered (``index_head_dim``
values a token, forward only, under no_grad), the expanded keys and values all-gathered (padded to one head
width, Note [value head size]) and their gradients reduce-scattered (gloo's ring: 2 (P-1)/P of the whole row's).
``csa`` / ``hca``: a DeepSeek-V4 layer (hyper-connections, routed experts, which exchange nothing), Note
[compressed attention]: the compressor's projections all-gathered (CSA ``4 x head_dim`` values a token, HCA
``2 x head_dim``) and their gradients reduce-scattered, the CSA indexer's (``4 x index_head_dim``, forward only),
the sliding keys (key = value, ``head_dim``) gathered and reduce-scattered. ``qsa``: Qwen4-Exp's QSA layer beside
the gated DeltaNet layer its n-gram embedding sits on (Qwen4-Exp allows it there only): the QSA keys and values
gathered and reduce-scattered, its indexer keys and the rotary table (cos and sin) gathered, forward only (Note
[indexed attention]); the n-gram ids' halo (``ngram_size - 1`` int64 ids a chunk) and the dilated convolution's
(Note [n-gram halo]); the DeltaNet's convolution halo and state summaries (Note [state passing]). Every run adds
what every call sends (the position ids' all-gather for the mask, the call check's signature).
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

V4_LAYERS = {"csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention"}
"""The DeepSeek-V4 layers the bench runs, by its ``--layer`` name."""


def model_config(args: argparse.Namespace) -> object:
    """The benchmark's config: one DeepSeek-V3.2 layer (``dsa``), one DeepSeek-V4 layer (``csa``, ``hca``), or
    Qwen4-Exp's gated DeltaNet layer holding its n-gram embedding and a QSA layer (``qsa``)."""
    import transformers

    shared = dict(vocab_size=512, hidden_size=args.hidden, max_position_embeddings=2 * args.seq)
    dsa_indexer = dict(index_n_heads=4, index_head_dim=args.index_dim, index_topk=args.topk)  # V3.2's and V4's
    if args.layer == "qsa":
        return transformers.Qwen4ExpTextConfig(
            **shared,
            moe_intermediate_size=args.hidden,
            shared_expert_intermediate_size=args.hidden,
            num_hidden_layers=2,
            layer_types=["linear_attention", "indexed_attention"],  # its n-gram embedding sits on a DeltaNet layer
            **dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32),
            num_attention_heads=args.heads,
            num_key_value_heads=2,
            head_dim=args.head_dim,
            num_experts=4,
            num_experts_per_tok=2,
            **dict(indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=args.index_dim, indexer_budget=args.topk),
            indexer_compress_ratio=4,
            **dict(ple_layer_ids=[1], ple_embed_dim=64, ngram_size=3, ple_conv_kernel_size=4, hc_count=4),
            **dict(heads_per_ngram=2, ngram_vocab_size_base=1000, eos_token_id=2),
        )
    if args.layer in V4_LAYERS:
        return transformers.DeepseekV4Config(
            **shared,
            moe_intermediate_size=args.hidden,
            num_hidden_layers=1,
            layer_types=[V4_LAYERS[args.layer]],
            mlp_layer_types=["moe"],  # routed by score: hash routing reads the ids, which needs no exchange either
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
            num_attention_heads=args.heads,
            head_dim=args.head_dim,
            q_lora_rank=64,
            o_groups=2,
            o_lora_rank=64,
            n_routed_experts=4,
            num_experts_per_tok=2,
            sliding_window=128,
            **dsa_indexer,
        )
    return transformers.DeepseekV32Config(
        **shared,
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
        **dsa_indexer,
    )


def modelled(cfg: object, ranks: int, seq: int, itemsize: int = 4) -> dict[str, float]:
    """Bytes one rank sends in one forward + backward of the one-layer model, by part (Note [indexed attention],
    Note [compressed attention])."""
    n, peers = seq // ranks, ranks - 1
    call = peers * n * 8 + peers * CallSignature.width() * 8  # position ids (int64), the call's signature
    if cfg.model_type == "qwen4_exp_text":
        return _qwen4_modelled(cfg, ranks, n, itemsize) | {"call": call}
    if cfg.model_type == "deepseek_v4":
        # an all-gather sends the rank's part to each peer; gloo's reduce-scatter of its gradient 2 (P-1)/P of the row's
        trained = 3 * peers * n * itemsize
        compressed = cfg.layer_types[0] == V4_LAYERS["csa"]
        parts = {"projections": (4 if compressed else 2) * cfg.head_dim * trained}
        if compressed:
            parts["indexer_projections"] = peers * n * 4 * cfg.index_head_dim * itemsize
        return parts | {"sliding_keys": cfg.head_dim * trained, "call": call}
    width = max(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim)  # one head width (Note [value head size])
    local_kv = 2 * cfg.num_attention_heads * n * width  # K and V elements of one rank, after the MLA expansion
    return {
        "indexer_keys": peers * n * cfg.index_head_dim * itemsize,
        "keys_values": peers * local_kv * itemsize + 2 * peers / ranks * ranks * local_kv * itemsize,
        "call": call,
    }


def _qwen4_modelled(cfg: object, ranks: int, n: int, itemsize: int) -> dict[str, float]:
    """A Qwen4-Exp layer's own exchanges: its QSA attention's (Note [indexed attention]) and its n-gram halo's (Note
    [n-gram halo]), under the zigzag layout's two chunks a rank."""
    peers, chunks = ranks - 1, 2
    rotary = int(cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor", 1.0))
    conv_halo = (cfg.ple_conv_kernel_size - 1) * cfg.ngram_size  # the dilated kernel's reach, in tokens
    dk, dv, keys = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_key_heads
    return {
        "deltanet_conv_halo": 3 * peers * chunks * (cfg.linear_conv_kernel_dim - 1) * 2 * keys * dk * itemsize
        + 3 * peers * chunks * (cfg.linear_conv_kernel_dim - 1) * cfg.linear_num_value_heads * dv * itemsize,
        "deltanet_state": 3 * peers * chunks * cfg.linear_num_value_heads * dk * (dk + dv) * 4,  # Note [state passing]
        "keys_values": 3 * peers * n * 2 * cfg.num_key_value_heads * cfg.head_dim * itemsize,
        "indexer_keys": peers * n * cfg.indexer_kv_heads * cfg.indexer_head_dim * itemsize,
        "rotary_table": peers * n * 2 * rotary * itemsize,  # cos and sin, no gradient
        "ngram_ids": peers * chunks * (cfg.ngram_size - 1) * 8,
        "ngram_conv_halo": 3 * peers * chunks * conv_halo * cfg.hc_count * cfg.hidden_size * itemsize,
    }


def _rank(rank: int, world: int, args: argparse.Namespace, out: str) -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = model_config(args)
    kernel = "eager" if args.layer in V4_LAYERS else "sdpa"  # transformers runs DeepSeek-V4's sinks eagerly only
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=kernel)
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
    parser.add_argument("--layer", choices=("dsa", *V4_LAYERS, "qsa"), default="dsa", help="the layer run (above)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64, help="DeepSeek-V4's and Qwen4-Exp's head_dim")
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
        "layer": args.layer,
        "ranks": args.ranks,
        "seq": args.seq,
        "hidden": args.hidden,
        "heads": args.heads,
        **({"head_dim": args.head_dim} if args.layer != "dsa" else {}),
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
