"""A Hugging Face Trainer step under seqpar against seqpar's own training step, and its memory against one process.

    python -m benchmarks.hf_trainer --steps 8                 # Llama 4x256, one packed row of 8192 tokens, sp 2, ring
    python -m benchmarks.hf_trainer --seq 2048 --steps 3      # small, quick
    python -m benchmarks.hf_trainer --json hf_trainer.json    # also save the rows and the pairs' ratios

Time: one torchrun job at sp 2 trains ``SequenceParallelTrainer`` and, at every Trainer step end, runs one
step of seqpar's own loop on its own copy of the model (``prepare_model`` + ``shard_batch`` +
``cross_entropy`` over the step's tokens + DDP + clipping + AdamW, as ``seqpar train`` runs it), so that
each Trainer step (step end to step end: data, token exchange, forward, backward, clipping, optimizer,
logging) and the own step after it see the same load; the ratio is the median over these pairs of the
slowest rank's times, after a warm-up step of each. The plain ``transformers.Trainer`` in one process on
the whole row is timed separately. Memory: the growth of the resident-set peak during the second step
above the resident set before it, from separate processes (Trainer at sp 2, own step at sp 2, one
process) whose large allocations are served by mmap (``seqpar.bench.measure``), so freed memory leaves
the resident set.
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
from benchmarks import python_path, save_records
from benchmarks.llama_step import llama_config
from seqpar.bench.measure import MEMORY_RUN_ENV, write_slowest
from seqpar.runtime.memory import reset_resident_peak, resident_mb

MODES = ("pair", "trainer_sp", "loop_sp", "trainer_one")


def _model(cfg: dict):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**llama_config(cfg, cfg["doc"]))
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
    """Peak growth of the second step (the first allocates the optimizer state); with ``own``, the pairing.

    Interleaving: at every step end the Trainer's time since the previous step end (data, exchange, forward,
    backward, clipping, optimizer, logging) is recorded, then one step of ``own`` runs and is timed, so both
    see the same load on the machine.
    """

    def __init__(self, own: _OwnStep | None = None) -> None:
        self.own, self.growth, self.last = own, 0.0, None
        self.times: list[float] = []
        self.own_times: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.before = resident_mb("VmRSS")
            reset_resident_peak()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        if state.global_step == 2:
            self.growth = resident_mb("VmHWM") - self.before
        if self.last is not None:
            self.times.append(now - self.last)
        if self.own is not None:
            start = time.perf_counter()
            self.own.step()
            self.own_times.append(time.perf_counter() - start)
        self.last = time.perf_counter()


class _OwnStep:
    """seqpar's own exact step (as ``seqpar train`` runs it) on the same model, row and optimizer."""

    def __init__(self, cfg: dict) -> None:
        self.mesh = seqpar.make_mesh(sp_size=cfg["sp"])
        self.model = seqpar.prepare_model(_model(cfg), self.mesh, strategy=cfg["strategy"])
        self.ddp = seqpar.apply_data_parallel(self.model, self.mesh, "ddp")
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.0)  # the Trainer's
        self.row, self.first_loss = _row(cfg), None

    def step(self) -> None:
        batch = {k: torch.tensor(v)[None] for k, v in self.row.items()}
        shard = seqpar.shard_batch(batch, self.mesh)
        total = seqpar.count_valid_tokens(shard["shift_labels"], dist.group.WORLD)
        logits = self.ddp(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
        loss = seqpar.cross_entropy(logits, shard["shift_labels"], num_valid_tokens=total)
        loss.backward()
        seqpar.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.first_loss is None:
            self.first_loss = float(seqpar.sum_over(loss.detach(), dist.group.WORLD))


def _slowest_steps(times: list[float]) -> list[float]:
    """Each step's time on the slowest rank."""
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _trainer_worker(cfg: dict, out: str, mode: str) -> None:
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
    if mode != "trainer_one" and not dist.is_initialized():  # TrainingArguments' accelerate state may have
        dist.init_process_group("gloo")
    meter = _StepMeter(_OwnStep(cfg) if mode in ("pair", "loop_sp") else None)
    data = [_row(cfg)] * (cfg["steps"] + 1)
    kwargs = dict(model=_model(cfg), args=args, train_dataset=data, callbacks=[meter])
    if mode == "trainer_one":
        trainer = transformers.Trainer(**kwargs)
        trainer.train()
        first_loss = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
    elif mode == "loop_sp":  # the own step alone, for its memory
        meter.own.step()  # allocates the optimizer state
        before = resident_mb("VmRSS")
        reset_resident_peak()
        meter.own.step()
        meter.growth, first_loss = resident_mb("VmHWM") - before, meter.own.first_loss
    else:
        config = seqpar.hf.SequenceParallelConfig(sp_size=cfg["sp"], strategy=cfg["strategy"])
        trainer = seqpar.hf.SequenceParallelTrainer(**kwargs, sequence_parallel=config)
        trainer.train()
        first_loss = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
    seconds = statistics.median(meter.times) if meter.times else 0.0
    if not dist.is_initialized():  # the one-process Trainer
        with open(out, "w") as f:
            json.dump({"growth_mb": meter.growth, "first_loss": first_loss, "seconds": seconds}, f)
        return
    extra = {"first_loss": first_loss}
    if mode == "pair":
        extra.update(trainer_s=_slowest_steps(meter.times), own_s=_slowest_steps(meter.own_times[1:]))
        extra["own_first_loss"] = meter.own.first_loss
    write_slowest(out, seconds, meter.growth, **extra)  # the slowest rank's time, the largest growth
    dist.destroy_process_group()


def _launch(mode: str, cfg: dict, out: str, memory: bool) -> dict:
    ranks = 1 if mode == "trainer_one" else cfg["sp"]
    worker = [
        sys.executable,
        "-m",
        "benchmarks.hf_trainer",
        "--worker",
        mode,
        "--out",
        out,
        "--cfg",
        json.dumps(cfg),
    ]
    if ranks > 1:
        worker = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
        worker += ["-m", "benchmarks.hf_trainer", "--worker", mode, "--out", out, "--cfg", json.dumps(cfg)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path(), **(MEMORY_RUN_ENV if memory else {})}
    done = subprocess.run(worker, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{mode} failed:\n{(done.stdout + done.stderr)[-4000:]}")
    with open(out) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.hf_trainer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    parser.add_argument("--json", metavar="FILE", help="write one record per run here")
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--cfg", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        torch.set_num_threads(1)
        _trainer_worker(json.loads(args.cfg), args.out, args.worker)
        return 0
    keys = ("seq", "doc", "sp", "strategy", "hidden", "layers", "heads", "vocab", "steps")
    cfg = {k: getattr(args, k) for k in keys}
    with tempfile.TemporaryDirectory() as tmp:
        pair = _launch("pair", cfg, os.path.join(tmp, "pair.json"), memory=False)
        one = _launch("trainer_one", cfg, os.path.join(tmp, "one.json"), memory=False)
        two_steps = {**cfg, "steps": 1}  # memory: the growth of the second step
        memory = {m: _launch(m, two_steps, os.path.join(tmp, f"{m}.json"), memory=True) for m in MODES[1:]}
    records = _report(cfg, pair, one, memory)
    if args.json:
        save_records(args.json, "hf_trainer", argv, [{**cfg, **r} for r in records])
    return 0


def _report(cfg: dict, pair: dict, one: dict, memory: dict) -> list[dict]:
    """Print the table after checking the first losses; return one record per run (the Trainer's with the pairs)."""
    base = one["first_loss"]
    for what, loss in (("Trainer at sp", pair["first_loss"]), ("own step", pair["own_first_loss"])):
        if abs(loss - base) > 1e-4 * abs(base):
            raise SystemExit(f"{what}: first loss {loss} differs from one process {base}")
    ratios = [t / o for t, o in zip(pair["trainer_s"], pair["own_s"])]
    print(
        f"Llama {cfg['layers']}x{cfg['hidden']}, {cfg['heads']} heads, vocab {cfg['vocab']}, one row of "
        f"{cfg['seq']} tokens ({cfg['doc']}-token documents), sp {cfg['sp']} {cfg['strategy']}, fp32, 1 thread/rank"
    )
    print(
        f"Trainer step / own step, median of {len(ratios)} interleaved pairs: {statistics.median(ratios):.3f}x "
        f"(each pair: {', '.join(f'{r:.3f}' for r in ratios)})"
    )
    print("| run | step (s) | per-rank peak growth (MB) | memory vs one process |")
    print("|---|---|---|---|")
    rows = (
        ("SequenceParallelTrainer", statistics.median(pair["trainer_s"]), memory["trainer_sp"]),
        ("seqpar's own step", statistics.median(pair["own_s"]), memory["loop_sp"]),
        ("Trainer, 1 process", one["seconds"], memory["trainer_one"]),
    )
    records = []
    for (name, seconds, mem), ranks in zip(rows, (cfg["sp"], cfg["sp"], 1)):
        growth = mem["growth_mb"]
        print(f"| {name} | {seconds:.2f} | {growth:.0f} | {growth / memory['trainer_one']['growth_mb']:.2f} |")
        records.append({"run": name, "ranks": ranks, "step_s": seconds, "growth_mb": growth})
    records[0]["vs_own_step_pairs"] = ratios
    return records


if __name__ == "__main__":
    raise SystemExit(main())
