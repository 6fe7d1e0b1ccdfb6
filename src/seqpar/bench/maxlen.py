"""The longest sequence whose whole training step fits a per-rank memory budget, per SP degree and feature set.

    seqpar bench maxlen --budget-mb 600 --sp 1 2 4 --json maxlen.json --png maxlen.png
    seqpar bench maxlen --model ./config.json --budget-mb 2000 --ladder none checkpointing

A step is forward, backward, gradient sum over the sp ranks and AdamW update of a model built as
``seqpar train`` builds it (``seqpar.train.model``), on ``seqpar.shard_batch`` shards. Feature sets form a
ladder, each rung adding one: none; checkpointing; + chunked_loss; + tiled_mlp; + offload (GPU only: on the
CPU the offload is a no-op). Every probe is one fresh spawn of sp ranks; on the CPU a step "fits" when the
growth of the resident-set peak (VmHWM) during the step, above the resident set after a warm-up step
(parameters, gradients and AdamW state allocated: gradients are zeroed in place between steps, as DDP's and
FSDP's buffers are, so the budget is what grows with the sequence), stays within the budget on every rank;
glibc serves large
allocations by mmap (``seqpar.bench.measure.MEMORY_RUN_ENV``) so the peak tracks live tensors. On CUDA it is
the growth of the allocator peak. The search starts at the length ``seqpar.estimate_memory`` predicts, steps
out until it brackets the answer, then bisects to the granularity (a multiple of ``--unit`` x sp tokens).
Prints a Markdown table with the measured peak growth and the estimate (``MemoryEstimate.step_peak``)
side by side, and writes the PNG and JSON records ``{"sp", "features", "max_seq", "peak_mb", "estimate_mb"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist

import seqpar
from seqpar.bench import provenance
from seqpar.bench.measure import MEMORY_RUN_ENV, write_slowest
from seqpar.memory import FEATURES
from seqpar.runtime.memory import reset_resident_peak, resident_mb
from seqpar.runtime.spawn import spawn_ranks
from seqpar.train.config import TrainConfig
from seqpar.train.fit import train_estimate
from seqpar.train.model import build_model, model_config

_MB = 2**20

LADDER = ("none", *FEATURES)
"""Rungs of the ladder: none, then each memory feature added to the ones before it."""


def train_step(
    model,
    opt: torch.optim.Optimizer,
    shard: dict,
    mesh,
    loss_chunk: int,
    *,
    set_to_none: bool = True,
    after_forward: Callable[[], None] | None = None,
) -> torch.Tensor:
    """One AdamW step of a prepared model on a sharded batch; returns this rank's share of the loss.

    Args:
        model, opt: the prepared model and its optimizer.
        shard: this rank's ``seqpar.shard_batch`` shard.
        mesh: the SP mesh (the loss normaliser and the gradient sum run over its SP group).
        loss_chunk: tokens per piece of ``lm_head_cross_entropy``; 0: whole logits.
        set_to_none: free the gradients after the update (True) or zero them in place, as DDP and FSDP keep
            their gradient buffers (False).
        after_forward: called between the forward and the backward (a memory reading).
    """
    inputs = {"input_ids": shard["input_ids"], "position_ids": shard["position_ids"]}
    if loss_chunk:  # logits made and dropped piece by piece
        hidden = model.get_decoder()(**inputs).last_hidden_state
        loss = seqpar.lm_head_cross_entropy(hidden, model.lm_head, shard["shift_labels"], mesh, chunk_size=loss_chunk)
        del hidden
    else:
        logits = model(**inputs).logits
        loss = seqpar.cross_entropy(logits, shard["shift_labels"], mesh)
        del logits
    if after_forward is not None:
        after_forward()
    loss.backward()
    seqpar.reduce_gradients(model.parameters(), mesh)
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)
    return loss.detach()


def table(records: list[dict]) -> str:
    """The Markdown table of ``seqpar bench maxlen`` records: max length, ratios, measured and estimated peaks."""
    lines = [
        "| features | sp | max seq | vs sp 1 | vs rung below | measured peak (MB) | estimate (MB) | est / measured |",
        "|---|---|---|---|---|---|---|---|",
    ]
    first = {r["features"]: r["max_seq"] for r in records if r["sp"] == min(x["sp"] for x in records)}
    by_key = {(r["features"], r["sp"]): r["max_seq"] for r in records}
    for r in records:
        rung = LADDER.index(r["features"])
        prev = by_key.get((LADDER[rung - 1], r["sp"])) if rung else None
        ratio = f"{r['max_seq'] / first[r['features']]:.2f}x" if first.get(r["features"]) else "-"
        step = f"{r['max_seq'] / prev:.2f}x" if prev else "-"
        est = f"{r['estimate_mb'] / r['peak_mb']:.2f}" if r["peak_mb"] else "-"
        more = "" if r["bracketed"] else " (not bracketed)"
        lines.append(
            f"| {r['features']} | {r['sp']} | {r['max_seq']}{more} | {ratio} | {step} | {r['peak_mb']} | "
            f"{r['estimate_mb']} | {est} |"
        )
    return "\n".join(lines)


def plot(records: list[dict], path: str, title: str) -> None:
    """Draw the longest sequence against the SP degree, one line per rung, into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for rung in dict.fromkeys(r["features"] for r in records):
        points = [(r["sp"], r["max_seq"]) for r in records if r["features"] == rung]
        ax.plot(*zip(*points), marker="o", label=rung if rung == "none" else f"+ {rung}")
    ax.set_xlabel("sequence-parallel degree (ranks)")
    ax.set_ylabel("longest sequence within the budget (tokens)")
    ax.set_xticks(sorted({r["sp"] for r in records}))
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def rung_features(rung: str) -> tuple[str, ...]:
    """The cumulative feature set of a rung of the ladder ("none" -> (); "chunked_loss" -> checkpointing too)."""
    return tuple(LADDER[1 : LADDER.index(rung) + 1])


def _train_config(cfg: dict, seq: int) -> TrainConfig:
    """The bench's model and features as ``seqpar train`` settings (one sequence per micro-batch)."""
    features = cfg["features"]
    return TrainConfig(
        model=cfg["model"],
        hidden_size=cfg["hidden"],
        layers=cfg["layers"],
        heads=cfg["heads"],
        seq_len=seq,
        eval_lengths=[seq],
        batch_size=1,
        grad_accum=1,
        strategy=cfg["strategy"],
        activation_checkpointing="checkpointing" in features,
        loss_chunk=cfg["loss_chunk"] if "chunked_loss" in features else 0,
        tiled_mlp="tiled_mlp" in features,
        tiled_mlp_chunk=cfg["mlp_chunk"],
        offload_activations="offload" in features,
    )


def feature_step(model, opt, shard: dict, mesh, cfg: dict, after_forward=None) -> torch.Tensor:
    """``train_step`` with ``cfg["features"]``' loss, gradients zeroed in place (they live between
    steps, as DDP's and FSDP's buffers do); ``after_forward`` as there. Returns this rank's loss share."""
    chunk = cfg["loss_chunk"] if "chunked_loss" in cfg["features"] else 0
    return train_step(model, opt, shard, mesh, chunk, set_to_none=False, after_forward=after_forward)


def _held(device: str) -> float:
    return torch.cuda.memory_allocated() / _MB if device == "cuda" else resident_mb("VmRSS")


def feature_model(cfg: dict, mesh, device: torch.device) -> torch.nn.Module:
    """The bench's model as ``seqpar train`` builds it (seed 0, ``cfg["features"]`` applied), prepared on ``mesh``.

    Args:
        cfg: the bench configuration (model sizes, ``seq``, ``features``, ``loss_chunk``, ``mlp_chunk``,
            ``strategy``).
        mesh: the SP mesh.
        device: where the model lives.

    Returns:
        The prepared model.
    """
    config = _train_config(cfg, cfg["seq"])
    model = build_model(config, cfg["vocab"]).to(device)
    return seqpar.parallelize(model, mesh, options=config.parallelize_options())  # sp, then the features


def _worker(rank: int, world_size: int, cfg: dict, out_path: str) -> None:
    device = torch.device(f"cuda:{rank}" if cfg["device"] == "cuda" else "cpu")
    mesh = seqpar.make_mesh()
    model = feature_model(cfg, mesh, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def shard_of(seq: int) -> dict:
        ids = torch.randint(0, cfg["vocab"], (1, seq), generator=torch.Generator().manual_seed(seq))
        return {k: v.to(device) for k, v in seqpar.shard_batch({"input_ids": ids}, mesh).items()}

    feature_step(model, opt, shard_of(64 * world_size), mesh, cfg)  # warm-up: gradients, AdamW state
    shard = shard_of(cfg["seq"])
    dist.barrier()
    sizes = {}
    before = _held(cfg["device"])
    if cfg["device"] == "cuda":
        torch.cuda.reset_peak_memory_stats()
    else:
        reset_resident_peak()
    feature_step(model, opt, shard, mesh, cfg, lambda: sizes.update(forward=_held(cfg["device"])))
    peak = torch.cuda.max_memory_allocated() / _MB if cfg["device"] == "cuda" else resident_mb("VmHWM")
    write_slowest(out_path, 0.0, peak - before, forward_mb=sizes["forward"] - before)


def _probe(cfg: dict, sp_size: int, seq: int, tmp: str) -> dict:
    """Peak growth of one step at ``seq`` tokens on ``sp`` fresh ranks (the largest rank's), in MiB."""
    out = os.path.join(tmp, "probe.json")
    backend = "nccl" if cfg["device"] == "cuda" else "gloo"
    env = MEMORY_RUN_ENV if cfg["device"] == "cpu" else None
    spawn_ranks(_worker, sp_size, {**cfg, "seq": seq}, out, backend=backend, env=env)
    with open(out) as f:
        result = json.load(f)
    return {"seq": seq, "peak_mb": result["growth_mb"], "forward_mb": result["forward_mb"]}


def _estimate_mb(cfg: dict, sp_size: int, seq: int, features: tuple[str, ...]) -> float:
    """``seqpar train``'s estimate of this step's growth above what lives between steps, in MiB."""
    settings = _train_config({**cfg, "features": features}, seq)
    estimate = train_estimate(settings, model_config(settings, cfg["vocab"]), sp=sp_size, keep_gradients=True)
    return estimate.step_peak / _MB


def _predicted(cfg: dict, sp_size: int, features: tuple[str, ...], unit: int) -> int:
    """The longest multiple of ``unit`` tokens the estimate puts within the budget (at least ``unit``)."""
    cap = max(unit, cfg["max_seq"] // unit * unit)
    lo, hi = unit, unit
    while _estimate_mb(cfg, sp_size, hi, features) <= cfg["budget_mb"]:
        lo = hi
        if hi == cap:
            return hi
        hi = min(2 * hi, cap)
    while hi - lo > unit:
        mid = lo + (hi - lo) // unit // 2 * unit
        lo, hi = (mid, hi) if _estimate_mb(cfg, sp_size, mid, features) <= cfg["budget_mb"] else (lo, mid)
    return lo


def _search(cfg: dict, sp_size: int, rung: str, tmp: str) -> dict:
    """Probe from the estimate's guess outwards until the answer is bracketed, then bisect to ``unit x sp``."""
    features = rung_features(rung)
    run = {**cfg, "features": features}
    unit = cfg["unit"] * sp_size
    seq, best, fail, probes = _predicted(run, sp_size, features, unit), None, None, []
    while len(probes) < cfg["max_probes"]:
        result = _probe(run, sp_size, seq, tmp)
        probes.append(result)
        print(f"  sp {sp_size} {rung}: {seq} tokens -> {result['peak_mb']:.0f} MB", flush=True)
        if result["peak_mb"] <= cfg["budget_mb"]:
            best = result if best is None or seq > best["seq"] else best
        else:
            fail = seq if fail is None else min(fail, seq)
        if fail is None:
            seq = max(seq + unit, int(seq * 1.25) // unit * unit)
            if seq > cfg["max_seq"]:
                break
        elif best is None:
            seq = min(seq - unit, int(seq * 0.8) // unit * unit)
            if seq < unit:
                break
        elif fail - best["seq"] <= unit:
            break
        else:
            seq = best["seq"] + (fail - best["seq"]) // unit // 2 * unit
    max_seq = best["seq"] if best else 0
    return {
        "sp": sp_size,
        "features": rung,
        "max_seq": max_seq,
        "peak_mb": round(best["peak_mb"], 1) if best else None,
        "estimate_mb": round(_estimate_mb(run, sp_size, max_seq, features), 1) if best else None,
        "forward_mb": round(best["forward_mb"], 1) if best else None,
        "bracketed": fail is not None and best is not None and fail - max_seq <= unit,
        "probes": probes,
    }


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The embedded Llama's sizes, the attention strategy and the feature chunk sizes, as command-line options.

    Args:
        parser: gets ``--hidden --layers --heads --vocab --strategy --loss-chunk --mlp-chunk``.
    """
    parser.add_argument("--hidden", type=int, default=256, help="embedded Llama: hidden size (intermediate 3x)")
    parser.add_argument("--layers", type=int, default=4, help="embedded Llama: layers")
    parser.add_argument("--heads", type=int, default=8, help="embedded Llama: heads (key/value heads: half)")
    parser.add_argument("--vocab", type=int, default=32768, help="embedded Llama: vocabulary")
    parser.add_argument("--strategy", default="auto", help="attention strategy")
    parser.add_argument("--loss-chunk", type=int, default=256, help="tokens per piece of the chunked loss")
    parser.add_argument("--mlp-chunk", type=int, default=1024, help="tokens per chunk of the tiled MLP")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="seqpar bench maxlen", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budget-mb", type=float, required=True, help="per-rank peak growth of one step (MiB)")
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4], help="sequence-parallel degrees")
    parser.add_argument("--ladder", nargs="+", choices=LADDER, default=None, help="rungs (default: all there are)")
    parser.add_argument("--model", default="default", help="config.json or model directory; default: embedded Llama")
    add_model_arguments(parser)
    parser.add_argument("--unit", type=int, default=256, help="granularity: lengths are multiples of unit x sp")
    parser.add_argument("--max-seq", type=int, default=131072, help="longest length probed")
    parser.add_argument("--max-probes", type=int, default=12, help="probes per (sp, rung) at most")
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--png", help="draw max length vs sp here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ladder = args.ladder or [r for r in LADDER if r != "offload" or device == "cuda"]
    if device == "cpu" and "offload" in ladder:
        print("offload moves activations from the GPU to host memory; on the CPU it changes nothing", flush=True)
    cfg = {
        "model": None if args.model == "default" else args.model,
        **{k: getattr(args, k) for k in ("hidden", "layers", "heads", "vocab", "strategy", "loss_chunk")},
        **{k: getattr(args, k) for k in ("mlp_chunk", "unit", "max_seq", "max_probes", "budget_mb")},
        "device": device,
    }
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for rung in ladder:
            for sp in args.sp:
                records.append({**_search(cfg, sp, rung, tmp), **provenance("maxlen", argv)})
                if args.json:  # after every point, so an interrupted run keeps what it found
                    with open(args.json, "w") as f:
                        json.dump(records, f, indent=1)
    what = "embedded Llama" if cfg["model"] is None else cfg["model"]
    if cfg["model"] is None:
        what += f" {args.layers}x{args.hidden}, {args.heads} heads, vocab {args.vocab}"
    title = f"{what}, fp32, AdamW, budget {args.budget_mb:.0f} MB/rank ({device})"
    print(f"\n{title}; loss chunk {args.loss_chunk}, MLP chunk {args.mlp_chunk}, strategy {args.strategy}")
    print(table(records))
    if args.png:
        plot(records, args.png, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
