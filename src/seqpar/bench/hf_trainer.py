"""A Hugging Face Trainer step under seqpar against seqpar's own training step, and its memory against one process.

    seqpar bench hf_trainer                           # Llama 4x256, one packed row of 8192 tokens, sp 2, ring
    seqpar bench hf_trainer --seq 2048 --steps 3      # small, quick

Every configuration runs in fresh torchrun processes (one thread per rank) in one invocation:
``SequenceParallelTrainer`` at sp 2, seqpar's own step at sp 2 for the same model, row and optimizer
(``prepare_model`` + ``shard_batch`` + ``cross_entropy`` over the step's tokens + DDP + clipping + AdamW, as
``seqpar train`` runs it), and the plain ``transformers.Trainer`` in one process on the whole row. Time is
the median step (data loading included) of the slowest rank after a warm-up step; memory is the growth of
the resident-set peak during one step above the resident set before it, from separate processes whose
large allocations are served by mmap (``seqpar.runtime.measure``), so freed memory leaves the resident set.
With more ranks than cores, compare the ratios, not the times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import transformers

import seqpar
import seqpar.hf
from seqpar.runtime.measure import MEMORY_RUN_ENV, write_slowest
from seqpar.runtime.memory import reset_resident_peak, resident_mb

MODES = ("trainer_sp", "loop_sp", "trainer_one")


def _model(cfg: dict):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=cfg["vocab"],
        hidden_size=cfg["hidden"],
        intermediate_size=cfg["hidden"] * 3,
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["heads"] // 2,
        max_position_embeddings=cfg["doc"],
    )
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def _row(cfg: dict) -> dict[str, list[int]]:
    """One packed row of ``seq`` tokens: documents of ``doc`` tokens whose position ids restart at 0."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["vocab"], (cfg["seq"],), generator=g).tolist()
    positions = [i % cfg["doc"] for i in range(cfg["seq"])]
    # a document's first token is nobody's target (as DataCollatorWithFlattening marks it)
    labels = [-100 if p == 0 else t for t, p in zip(ids, positions)]
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


class _StepMeter(transformers.TrainerCallback):
    """Step times and the peak growth of the second step (the first allocates the optimizer state)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.growth = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.before = resident_mb("VmRSS")
        reset_resident_peak()
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.start)
        if state.global_step == 2:
            self.growth = resident_mb("VmHWM") - self.before


def _trainer_worker(cfg: dict, out: str, parallel: bool) -> None:
    args = transformers.TrainingArguments(
        output_dir=os.path.join(os.path.dirname(out), "trainer"),
        use_cpu=True,
        per_device_train_batch_size=1,
        max_steps=cfg["steps"] + 1,
        learning_rate=1e-4,
        optim="adamw_torch",
        lr_scheduler_type="constant",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        logging_steps=1,
        train_sampling_strategy="sequential",
    )
    meter = _StepMeter()
    kwargs = dict(model=_model(cfg), args=args, train_dataset=[_row(cfg)] * (cfg["steps"] + 1), callbacks=[meter])
    if parallel:
        config = seqpar.hf.SequenceParallelConfig(sp_size=cfg["sp"], strategy=cfg["strategy"])
        trainer = seqpar.hf.SequenceParallelTrainer(**kwargs, sequence_parallel=config)
    else:
        trainer = transformers.Trainer(**kwargs)
    trainer.train()
    first_loss = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
    seconds = statistics.median(meter.times[1:])
    if dist.is_initialized():
        write_slowest(out, seconds, meter.growth, first_loss=first_loss)
        dist.destroy_process_group()
    else:
        with open(out, "w") as f:
            json.dump({"seconds": seconds, "growth_mb": meter.growth, "first_loss": first_loss}, f)


def _loop_worker(cfg: dict, out: str) -> None:
    """seqpar's own exact step (as ``seqpar train`` runs it) on the same model, row and optimizer."""
    dist.init_process_group("gloo")
    mesh = seqpar.make_mesh(sp_size=cfg["sp"])
    model = seqpar.prepare_model(_model(cfg), mesh, strategy=cfg["strategy"])
    ddp = seqpar.apply_data_parallel(model, mesh, "ddp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)  # the Trainer's defaults
    row = _row(cfg)
    times, growth, first_loss = [], 0.0, None
    for step in range(cfg["steps"] + 1):
        before = resident_mb("VmRSS")
        reset_resident_peak()
        start = time.perf_counter()
        batch = {k: torch.tensor(v)[None] for k, v in row.items()}
        shard = seqpar.shard_batch(batch, mesh)
        total = seqpar.count_valid_tokens(shard["shift_labels"], dist.group.WORLD)
        logits = ddp(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
        loss = seqpar.cross_entropy(logits, shard["shift_labels"], num_valid_tokens=total)
        loss.backward()
        seqpar.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        first_loss = first_loss if first_loss is not None else float(seqpar.sum_over(loss, dist.group.WORLD))
        times.append(time.perf_counter() - start)
        if step == 1:
            growth = resident_mb("VmHWM") - before
    write_slowest(out, statistics.median(times[1:]), growth, first_loss=first_loss)
    dist.destroy_process_group()


def _launch(mode: str, cfg: dict, out: str, memory: bool) -> dict:
    ranks = 1 if mode == "trainer_one" else cfg["sp"]
    worker = [
        sys.executable,
        "-m",
        "seqpar.bench.hf_trainer",
        "--worker",
        mode,
        "--json",
        out,
        "--cfg",
        json.dumps(cfg),
    ]
    if ranks > 1:
        worker = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
        worker += ["-m", "seqpar.bench.hf_trainer", "--worker", mode, "--json", out, "--cfg", json.dumps(cfg)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(MEMORY_RUN_ENV if memory else {})}
    done = subprocess.run(worker, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{mode} failed:\n{(done.stdout + done.stderr)[-4000:]}")
    with open(out) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="seqpar bench hf_trainer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, default=8192, help="tokens in the packed row")
    parser.add_argument("--doc", type=int, default=2048, help="tokens per packed document")
    parser.add_argument("--sp", type=int, default=2)
    parser.add_argument("--strategy", default="ring")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.add_argument("--cfg", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        torch.set_num_threads(1)
        cfg = json.loads(args.cfg)
        if args.worker == "loop_sp":
            _loop_worker(cfg, args.json)
        else:
            _trainer_worker(cfg, args.json, parallel=args.worker == "trainer_sp")
        return 0
    keys = ("seq", "doc", "sp", "strategy", "hidden", "layers", "heads", "vocab", "steps")
    cfg = {k: getattr(args, k) for k in keys}
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            timed = _launch(mode, cfg, os.path.join(tmp, f"{mode}.json"), memory=False)
            measured = _launch(mode, cfg, os.path.join(tmp, f"{mode}_memory.json"), memory=True)
            rows[mode] = {**timed, "growth_mb": measured["growth_mb"]}
            print(f"{mode}: {rows[mode]}", flush=True)
    return _report(cfg, rows)


def _report(cfg: dict, rows: dict) -> int:
    base = rows["trainer_one"]["first_loss"]
    for mode, r in rows.items():
        if abs(r["first_loss"] - base) > 1e-4 * abs(base):
            raise SystemExit(f"{mode}: first loss {r['first_loss']} differs from one process {base}")
    print(
        f"\nLlama {cfg['layers']}x{cfg['hidden']}, {cfg['heads']} heads, vocab {cfg['vocab']}, one row of "
        f"{cfg['seq']} tokens ({cfg['doc']}-token documents), sp {cfg['sp']} {cfg['strategy']}, fp32, 1 thread/rank"
    )
    print("| run | step (s) | vs seqpar's own step | per-rank peak growth (MB) | memory vs one process |")
    print("|---|---|---|---|---|")
    own, one = rows["loop_sp"], rows["trainer_one"]
    names = {
        "trainer_sp": "SequenceParallelTrainer",
        "loop_sp": "seqpar's own step",
        "trainer_one": "Trainer, 1 process",
    }
    for mode, r in rows.items():
        print(
            f"| {names[mode]} | {r['seconds']:.2f} | {r['seconds'] / own['seconds']:.3f}x | {r['growth_mb']:.0f} | "
            f"{r['growth_mb'] / one['growth_mb']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
