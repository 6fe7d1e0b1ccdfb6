"""``python -m benchmarks.mixers``: one token-mixer layer's exchange under sequence parallelism, its bytes and its time.

Run::

    python -m benchmarks.mixers                           # six mixers, 8192 tokens, sp 2 and 4
    python -m benchmarks.mixers --mixers mamba1 --seq 4096 --sp 2
    python -m benchmarks.mixers --models --hidden 256 --sp 2 --json mixer_models_cpu.json  # vs a Llama as wide
    python -m benchmarks.mixers --mixers mamba2 --seq 16384 --sp 2 --json mixers_cpu.json

Each mixer and degree runs in fresh spawned ranks (one thread each). The layers are transformers' own, built from a
config: Qwen3-Next's gated DeltaNet, Mamba2's SSD mixer, Kimi Linear's KDA, LFM2's short convolution, Mamba's
Mamba1 mixer and MiniMax's lightning attention. On every
rank the layer runs forward and backward on its zigzag shard twice, taking turns: adapted (the halo convolution
and the state passing, Note [state passing]: exact) and as the model's own layer on the shard alone (what a rank
computes when nothing is exchanged: wrong, the local cost only). Bytes are what the rank wrote to its sockets
during the adapted step (``/proc/self/io``), beside the analytical volume of the all-gathers and their
reduce-scatters (``seqpar.memory.mixers.exchange_bytes``, Note [hybrid memory]; on gloo, which runs a
reduce-scatter as an all-reduce, and on NCCL), and beside what a head-parallel all-to-all (the scan's inputs in,
its outputs back, forward and backward) would move for the same layer. Times are medians; read the ratios.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from benchmarks import save_records
from seqpar.models.mixers import GatedDeltaNet, Kda, Lightning, Mamba1, Mamba2, ShortConv


def _common(cfg: dict) -> dict:
    return dict(vocab_size=256, hidden_size=cfg["hidden"], num_hidden_layers=1, tie_word_embeddings=False)


def _gated_deltanet(cfg: dict):
    import transformers

    return transformers.Qwen3NextConfig(
        **_common(cfg),
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


def _mamba2(cfg: dict):  # heads x head_dim = 2 x hidden, the Mamba2 default expansion
    import transformers

    hidden, dim = cfg["hidden"], cfg["head_dim"]
    return transformers.Mamba2Config(
        **_common(cfg), num_heads=2 * hidden // dim, head_dim=dim, state_size=cfg["state"], n_groups=1, expand=2
    )


def _kda(cfg: dict):
    import transformers

    return transformers.KimiLinearConfig(
        **_common(cfg),
        num_attention_heads=4,
        num_key_value_heads=4,
        layer_types=["linear_attention"],
        mlp_layer_types=["dense"],
        linear_num_heads=cfg["value_heads"],
        linear_head_dim=cfg["head_dim"],
        linear_conv_kernel_dim=4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _short_conv(cfg: dict):
    import transformers

    return transformers.Lfm2Config(
        **_common(cfg), num_attention_heads=4, num_key_value_heads=2, layer_types=["conv"], conv_L_cache=3
    )


def _lightning(cfg: dict):  # MiniMax's lightning attention: heads of head_dim, blocks of 256 tokens
    import transformers

    heads = cfg["value_heads"]
    return transformers.MiniMaxConfig(
        **_common(cfg),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=cfg["head_dim"],
        layer_types=["linear_attention"],
        block_size=256,
        num_local_experts=2,
        num_experts_per_tok=1,
    )


def _mamba1(cfg: dict):  # d_inner = 2 x hidden, Mamba's default expansion
    import transformers

    return transformers.MambaConfig(**_common(cfg), state_size=cfg["mamba1_state"], expand=2, conv_kernel=4)


_CONFIGS = {
    GatedDeltaNet.kind: _gated_deltanet,
    Mamba2.kind: _mamba2,
    Kda.kind: _kda,
    ShortConv.kind: _short_conv,
    Lightning.kind: _lightning,
    Mamba1.kind: _mamba1,
}
"""Mixer kind (``seqpar.models.MIXER_KINDS``) -> the one-layer transformers config whose layer is of that kind
(hidden width, heads of ``head_dim``)."""

MIXERS = tuple(_CONFIGS)
"""The mixers that can be benchmarked, by their kind."""


def _mamba1_unbind(layer: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """A Mamba layer's forward on the shard alone, transformers' torch path with its scan stepping over ``unbind``
    views: transformers' own loop indexes ``[B, D, L, N]`` tensors token by token, which makes its backward
    quadratic in the length (a zero tensor of the whole input per step), so it is no baseline at 4K tokens."""
    import torch.nn.functional as F

    x, gate = layer.in_proj(hidden_states).transpose(1, 2).chunk(2, dim=1)  # [B, D, L]
    u = layer.act(layer.conv1d(x)[..., : x.shape[-1]])
    n = layer.ssm_state_size
    step, b, c = torch.split(layer.x_proj(u.transpose(1, 2)), [layer.time_step_rank, n, n], dim=-1)
    dt = F.softplus(layer.dt_proj(step))  # [B, L, D]
    rate = -torch.exp(layer.A_log.float())
    decays = torch.exp(rate * dt[..., None]).unbind(1)  # [B, D, N] per token
    drives = (dt[..., None] * b[:, :, None, :].float() * u.transpose(1, 2)[..., None].float()).unbind(1)
    state, reads = torch.zeros_like(decays[0]), []
    for decay, drive, c_t in zip(decays, drives, c.unbind(1), strict=True):
        state = decay * state + drive
        reads.append(torch.matmul(state, c_t[..., None])[..., 0])
    y = (torch.stack(reads, dim=1) + u.transpose(1, 2) * layer.D) * F.silu(gate.transpose(1, 2))
    return layer.out_proj(y)


_ALONE = {Mamba1.kind: _mamba1_unbind}
"""Mixer kind -> the shard-alone baseline where the model's own layer is not one (else the layer's forward)."""


def _layer(mixer: str, cfg: dict) -> torch.nn.Module:
    """The mixer module of the one-layer model of ``_CONFIGS``."""
    import transformers

    from seqpar.models import anatomy

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_CONFIGS[mixer](cfg)).float()
    return anatomy(model).mixers[0]


def _required_nones(layer: torch.nn.Module) -> dict:
    """None for each argument after the hidden states that the layer's own forward requires (lightning
    attention's position embeddings and mask: it takes neither)."""
    params = list(inspect.signature(type(layer).forward).parameters.values())[2:]
    return {p.name: None for p in params if p.default is inspect.Parameter.empty and p.kind == p.POSITIONAL_OR_KEYWORD}


def _volumes(mixer: str, cfg: dict, sp_size: int) -> dict:
    """Analytical bytes one rank sends per forward + backward (fp32)."""
    from seqpar.memory.mixers import exchange_bytes
    from seqpar.models import ModelSizes

    d = ModelSizes.from_config(_CONFIGS[mixer](cfg))
    local = sum(exchange_bytes(d, d.layer_kinds[0], 1, 2, 4))  # zigzag: two chunks a rank
    # a head-parallel all-to-all: the scan's inputs in, its output back (the row's count), forward and backward
    all_to_all = 2 * d.mixer.head_parallel(d.hidden_size) * 4 * (cfg["seq"] // sp_size) * (sp_size - 1) / sp_size
    # an all-gather sends (P - 1) x its piece, as does a reduce-scatter; gloo runs the reduce-scatter as an
    # all-reduce of the gathered size, 2 (P - 1) x the piece
    return {
        "exchange_bytes": 2 * (sp_size - 1) * local,
        "exchange_bytes_gloo": 3 * (sp_size - 1) * local,
        "all_to_all_bytes": all_to_all,
    }


def _worker(rank: int, world_size: int, cfg: dict, out: str) -> None:
    import seqpar
    from seqpar.runtime.memory import written_bytes
    from seqpar.sequence_parallel.call_context import CONTEXT_KEY, CallContext
    from seqpar.sequence_parallel.masks import sequence_mask
    from seqpar.sequence_parallel.mixers import adapt

    mesh = seqpar.make_mesh()
    own, adapted = _layer(cfg["mixer"], cfg), _layer(cfg["mixer"], cfg)
    required = _required_nones(own)
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
            if name == "adapted":
                result = layer(shard, **{CONTEXT_KEY: ctx, **required})
            elif cfg["mixer"] in _ALONE:
                result = _ALONE[cfg["mixer"]](layer, shard)
            else:
                result = layer(shard, **required)  # lightning attention returns its state too
            (result[0] if isinstance(result, tuple) else result).square().mean().backward()
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


def _llama(cfg: dict):
    """A one-layer Llama of the mixers' width (heads of ``head_dim``, half as many KV heads, MLP 3x hidden)."""
    import transformers

    heads = cfg["hidden"] // cfg["head_dim"]
    return transformers.LlamaConfig(
        **_common(cfg),
        intermediate_size=3 * cfg["hidden"],
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=cfg["seq"],
    )


def _model_worker(rank: int, world_size: int, cfg: dict, out: str) -> None:
    """One AdamW step of the whole one-layer model of the mixer and of a Llama as wide, both under seqpar."""
    import transformers

    import seqpar
    from seqpar.bench.maxlen import train_step

    mesh = seqpar.make_mesh()
    ids = torch.randint(0, 256, (1, cfg["seq"]), generator=torch.Generator().manual_seed(1))
    shard = seqpar.shard_batch({"input_ids": ids}, mesh)
    times = {}
    for name, config in (("model", _CONFIGS[cfg["mixer"]](cfg)), ("llama", _llama(cfg))):
        torch.manual_seed(0)
        model = seqpar.prepare_model(transformers.AutoModelForCausalLM.from_config(config).float(), mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        runs = []
        for round_ in range(cfg["rounds"] + 1):  # round 0 warms up
            dist.barrier()
            start = time.perf_counter()
            train_step(model, opt, shard, mesh, 0)
            if round_:
                runs.append(time.perf_counter() - start)
        times[name] = statistics.median(runs)
    stats = torch.tensor([times["model"], times["llama"]], dtype=torch.float64)
    table = [torch.empty_like(stats) for _ in range(world_size)]
    dist.all_gather(table, stats)
    if rank == 0:
        slowest = torch.stack(table).max(0).values.tolist()
        with open(out, "w") as f:
            json.dump({"model_step_s": slowest[0], "llama_step_s": slowest[1]}, f)


def _runs(worker, args: argparse.Namespace, names: tuple[str, ...]):
    """``worker`` in fresh spawned ranks for each mixer and degree asked for: ``(cfg, sp, what rank 0 wrote)``."""
    from seqpar.runtime.spawn import spawn_ranks

    with tempfile.TemporaryDirectory() as tmp:
        for mixer in args.mixers:
            cfg = {"mixer": mixer, **{k: getattr(args, k) for k in names}}
            for sp in args.sp:
                out = os.path.join(tmp, f"{mixer}-{sp}.json")
                spawn_ranks(worker, sp, cfg, out)
                with open(out) as f:
                    yield cfg, sp, json.load(f)


def _models(args: argparse.Namespace, names: tuple[str, ...], argv: list[str] | None) -> None:
    """``--models``: each mixer's one-layer model against a one-layer Llama as wide, a training step each."""
    print(f"one-layer models, hidden {args.hidden}, {args.seq} tokens, zigzag, fp32, AdamW step, {args.rounds} rounds")
    print("| mixer | sp | model step (s) | Llama step (s) | model / Llama |\n|---|---|---|---|---|")
    rows = []
    for cfg, sp, r in _runs(_model_worker, args, names):
        ratio = r["model_step_s"] / r["llama_step_s"]
        print(f"| {cfg['mixer']} | {sp} | {r['model_step_s']:.3f} | {r['llama_step_s']:.3f} | {ratio:.2f} |")
        rows.append({**cfg, "sp": sp, **r})
    if args.json:
        save_records(args.json, "mixers", argv, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.mixers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--mixers", nargs="+", choices=MIXERS, default=list(MIXERS), help="the layers to run (default: all)"
    )
    parser.add_argument("--seq", type=int, default=8192, help="tokens of the whole sequence")
    parser.add_argument("--sp", type=int, nargs="+", default=[2, 4], help="sequence-parallel degrees")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--key-heads", type=int, default=4, help="gated DeltaNet's query/key heads")
    parser.add_argument("--value-heads", type=int, default=8, help="gated DeltaNet's value heads, KDA's heads")
    parser.add_argument("--head-dim", type=int, default=64, help="every mixer's head width")
    parser.add_argument("--state", type=int, default=64, help="Mamba2's state size")
    parser.add_argument("--mamba1-state", type=int, default=16, help="Mamba1's state size")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", metavar="FILE", help="write one record per mixer and degree here")
    parser.add_argument(
        "--models", action="store_true", help="instead: whole one-layer models against a Llama as wide, a step each"
    )
    args = parser.parse_args(argv)

    names = ("seq", "hidden", "key_heads", "value_heads", "head_dim", "state", "mamba1_state", "rounds")
    if args.models:
        _models(args, names, argv)
        return 0
    rows = [{**cfg, "sp": sp, **r, **_volumes(cfg["mixer"], cfg, sp)} for cfg, sp, r in _runs(_worker, args, names)]
    print(
        f"one mixer layer (hidden {args.hidden}; gated DeltaNet {args.key_heads} key / {args.value_heads} value heads, "
        f"KDA and lightning {args.value_heads} heads, Mamba2 {2 * args.hidden // args.head_dim} heads, all of "
        f"{args.head_dim}; Mamba2 state {args.state}; Mamba1 {2 * args.hidden} channels, state {args.mamba1_state}), "
        f"{args.seq} tokens, zigzag, fp32, fwd+bwd, medians of {args.rounds}"
    )
    print("| mixer | sp | bytes sent (measured, gloo) | analytical on gloo | analytical (NCCL) | head-parallel "
          "all-to-all | all-to-all / exchange | adapted step (s) | shard alone (s) | adapted / alone |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mixer']} | {r['sp']} | {r['sent_bytes'] / 2**10:.0f} KiB | "
            f"{r['exchange_bytes_gloo'] / 2**10:.0f} KiB | {r['exchange_bytes'] / 2**10:.0f} KiB | "
            f"{r['all_to_all_bytes'] / 2**10:.0f} KiB | {r['all_to_all_bytes'] / r['exchange_bytes']:.0f}x | "
            f"{r['adapted_s']:.3f} | {r['local_s']:.3f} | {r['adapted_s'] / r['local_s']:.2f} |"
        )
    if args.json:
        save_records(args.json, "mixers", argv, rows)
    return 0


if __name__ == "__main__":
    main()
