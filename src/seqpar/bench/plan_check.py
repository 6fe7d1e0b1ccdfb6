"""The planner's predictions against measured steps: step time and per-rank peak growth of a small Llama on CPU.

    seqpar bench plan_check                              # llama_step's configurations: seq 8192, sp 1 2 4, ring
    seqpar bench plan_check --calibration cal.json       # rates from `seqpar plan --calibrate cal.json`

First it times planning Llama-8B at 16M tokens on 1,024 devices (the planner's own speed).

The measured side is ``seqpar bench llama_step``'s step (forward, backward, gradient sum, AdamW; fp32; one
thread per rank), run with no memory features and with checkpointing + chunked loss. The predicted side is
``seqpar.plan.step_time`` on the calibrated rates, and the memory estimator's growth above what lives between
steps (``MemoryEstimate.step_peak``), which is what the benchmark measures (resident-set peak growth). The
matmul and attention rates are probed inside each rank just before each timed step (the machine's load, and
ranks sharing cores, change them); the link rate comes from the calibration.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import transformers

import seqpar
from seqpar.plan.calibrate import calibrate, probe_compute
from seqpar.plan.cluster import Cluster, load_calibration
from seqpar.plan.memory import estimate_layout
from seqpar.plan.models import shape_from_config
from seqpar.plan.search import plan
from seqpar.plan.timing import Layout, step_time
from seqpar.runtime.measure import time_and_memory, write_slowest
from seqpar.runtime.memory import reset_resident_peak, resident_mb

FEATURE_SETS = {"none": (), "ckpt+chunked": ("checkpointing", "chunked_loss")}
LOSS_CHUNK = 1024  # the estimator's default piece of the chunked loss


def _config(cfg: dict) -> dict:
    return {
        "model_type": "llama",
        "vocab_size": cfg["vocab"],
        "hidden_size": cfg["hidden"],
        "intermediate_size": cfg["hidden"] * 3,
        "num_hidden_layers": cfg["layers"],
        "num_attention_heads": cfg["heads"],
        "num_key_value_heads": cfg["heads"] // 2,
        "max_position_embeddings": cfg["seq"],
    }


def _worker(_rank: int, _world_size: int, cfg: dict, out_path: str) -> None:
    torch.manual_seed(0)
    mesh = seqpar.make_mesh()
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**_config(cfg)))
    if "checkpointing" in cfg["features"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = seqpar.prepare_model(model, mesh, strategy=cfg["strategy"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, cfg["vocab"], (1, cfg["seq"]), generator=torch.Generator().manual_seed(1))
    shard = seqpar.shard_batch({"input_ids": ids}, mesh)
    inputs = {"input_ids": shard["input_ids"], "position_ids": shard["position_ids"]}

    def step() -> None:
        if "chunked_loss" in cfg["features"]:
            hidden = model.get_decoder()(**inputs).last_hidden_state
            loss = seqpar.lm_head_cross_entropy(
                hidden, model.lm_head, shard["shift_labels"], mesh, chunk_size=LOSS_CHUNK
            )
            del hidden
        else:
            logits = model(**inputs).logits
            loss = seqpar.cross_entropy(logits, shard["shift_labels"], mesh)
            del logits
        loss.backward()
        seqpar.reduce_gradients(model.parameters(), mesh)
        opt.step()
        opt.zero_grad(set_to_none=True)

    model.train()
    step()  # warm-up: allocates the optimizer state
    times, growth, rates = [], 0.0, []
    for i in range(1 if cfg["memory"] else cfg["repeats"]):
        if not cfg["memory"]:  # this rank's rates under the load of this moment, next to the step they predict
            rates.append(probe_compute(repeats=2, attention_seq=1024))
        dist.barrier()
        before = resident_mb("VmRSS")
        reset_resident_peak()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        if i == 0:
            growth = resident_mb("VmHWM") - before
    matmul = statistics.median(r[0] for r in rates) if rates else 0.0
    attention = statistics.median(r[1] for r in rates) if rates else 0.0
    write_slowest(out_path, statistics.median(times), growth, matmul_flops=matmul, attention_flops=attention)


def _predict(cfg: dict, sp: int, features: tuple[str, ...], cluster: Cluster, measured: dict) -> tuple[float, float]:
    """Predicted (step seconds, peak growth MiB) of one configuration, on the rates its ranks measured."""
    shape = shape_from_config(_config(cfg), "plan_check")
    layout = Layout(1, sp, sp if cfg["strategy"] == "ulysses" else 1, 1, cfg["strategy"], features, "replicate")
    matmul, attention = measured["matmul_flops"], measured["attention_flops"]
    rated = replace(cluster, gpu_tflops=matmul / 1e12, attention_efficiency=min(1.0, attention / matmul))
    seconds = step_time(shape, cfg["seq"], layout, rated, dtype_bytes=4).total
    estimate = estimate_layout(shape, cfg["seq"], layout, dtype="fp32")
    return seconds, estimate.step_peak / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="seqpar bench plan_check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--strategy", default="ring", choices=("ring", "ulysses", "allgather"))
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--features", nargs="+", default=list(FEATURE_SETS), choices=list(FEATURE_SETS))
    parser.add_argument("--calibration", help="a file from `seqpar plan --calibrate`; default: calibrate now")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    big = plan("llama-8b", 16 * 2**20, Cluster(gpus=1024, gpus_per_node=8))
    print(
        f"planning llama-8b, 16M tokens, 1,024 devices: {time.perf_counter() - start:.2f} s "
        f"({big.considered} layouts estimated, {len(big.candidates)} fit)",
        flush=True,
    )
    calibration = load_calibration(args.calibration) if args.calibration else calibrate()
    print(f"calibration: {calibration}", flush=True)
    cluster = Cluster(gpus=max(args.sp), gpus_per_node=max(args.sp)).with_calibration(calibration)
    cfg = {k: getattr(args, k) for k in ("seq", "strategy", "hidden", "layers", "heads", "vocab", "repeats")}
    cfg["cores"] = os.cpu_count() or 1  # for the record: the rates are measured inside the (sharing) ranks
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.features:
            for sp in args.sp:
                out = os.path.join(tmp, f"{name}-{sp}.json")
                run = {**cfg, "features": FEATURE_SETS[name]}

                def args_for(memory, run=run, out=out):
                    return ({**run, "memory": memory}, out)

                measured = time_and_memory(_worker, args_for, sp, out)
                predicted = _predict(cfg, sp, FEATURE_SETS[name], cluster, measured)
                rows.append((name, sp, measured["seconds"], predicted[0], measured["growth_mb"], predicted[1]))
                print(f"{name} sp {sp}: measured {measured}, predicted {predicted}", flush=True)
    print(
        f"\nLlama {args.layers}x{args.hidden}, {args.heads}/{args.heads // 2} heads, vocab {args.vocab}, seq "
        f"{args.seq}, {args.strategy}, fp32, 1 thread/rank on {cfg['cores']} cores"
    )
    print("| features | sp | step measured (s) | predicted | ratio | peak growth measured (MiB) | predicted | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for name, sp, t_meas, t_pred, m_meas, m_pred in rows:
        print(
            f"| {name} | {sp} | {t_meas:.2f} | {t_pred:.2f} | {t_pred / t_meas:.2f} | {m_meas:.0f} | {m_pred:.0f} | "
            f"{m_pred / m_meas:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
