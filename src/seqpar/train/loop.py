"""The training loop one rank runs: set-up, then per step an optimizer step, a log record and maybe a checkpoint,
then the evaluation.

``train_rank`` expects an initialised default process group (``seqpar.train.launch`` sets it up). The steps it
calls live in ``state`` (set-up), ``step`` (one optimizer step) and ``evaluate`` (passkey accuracy).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

import seqpar
from seqpar.runtime.memory import PeakMemory
from seqpar.train.checkpoint import save_checkpoint
from seqpar.train.config import TrainConfig
from seqpar.train.evaluate import evaluate_passkey
from seqpar.train.metrics import MetricsWriter, plot_metrics
from seqpar.train.state import RunState, banner, checkpoint_state, set_up_run
from seqpar.train.step import StepResult, optimizer_step

if TYPE_CHECKING:
    from tqdm import tqdm

__all__ = ["train_rank"]


def _progress_bar(config: TrainConfig, start: int) -> tqdm:
    """Rank 0's tqdm bar over the optimizer steps, starting at ``start``."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())  # tqdm's default multiprocessing lock would leak a semaphore at exit
    return tqdm(total=config.steps, initial=start, desc="seqpar train", unit="step", dynamic_ncols=True, disable=None)


def _say(bar: tqdm | None, line: str) -> None:
    """Print ``line`` above the progress bar, or plainly when there is none."""
    (bar.write if bar is not None else print)(line)


def _step_record(run: RunState, step: int, result: StepResult, peak_mb: float, seconds: float) -> dict | None:
    """Gather the step's per-rank memory and time and its summed losses (collective); rank 0 gets the record.

    Returns:
        The metrics.jsonl record on rank 0, None on the other ranks.
    """
    config = run.config
    stats = torch.tensor([peak_mb, seconds], dtype=torch.float64, device=run.device)
    gathered = [torch.empty_like(stats) for _ in range(run.world)]
    dist.all_gather(gathered, stats)
    sums = seqpar.sum_over(torch.stack([result.loss_sum, result.answer_sum]), run.loss_group)
    if run.rank != 0:
        return None
    step_time = max(float(g[1]) for g in gathered)  # the slowest rank sets the pace
    record = {
        "kind": "train",
        "step": step + 1,
        "loss": float(sums[0]),
        "lr": result.lr,
        "grad_norm": float(result.grad_norm),
        "tokens_per_s": config.batch_size * config.dp * config.seq_len / step_time,
        "step_s": step_time,
        "peak_memory_mb": [round(float(g[0]), 1) for g in gathered],
    }
    if result.has_answers:
        record["answer_loss"] = float(sums[1])
    return record


def _log_step(config: TrainConfig, record: dict, writer: MetricsWriter, bar: tqdm | None, end: int) -> None:
    """Rank 0: write the record, move the progress bar, and print the step line every ``log_every`` steps."""
    writer.write(record)
    if bar is not None:
        bar.set_postfix(
            loss=f"{record['loss']:.3f}",
            tok_s=f"{record['tokens_per_s']:.0f}",
            mem_mb="/".join(f"{m:.0f}" for m in record["peak_memory_mb"]),
        )
        bar.update(1)
    step = record["step"]
    if step % config.log_every == 0 or step == end:
        _say(
            bar,
            f"step {step}/{config.steps} loss {record['loss']:.4f} lr {record['lr']:.2e} "
            f"grad_norm {record['grad_norm']:.3f} tokens/s {record['tokens_per_s']:.0f} "
            f"peak MB/rank {record['peak_memory_mb']}",
        )


def _save(run: RunState, steps_done: int, bar: tqdm | None) -> None:
    """Checkpoint the model, optimizer and schedule after ``steps_done`` steps (collective)."""
    path = save_checkpoint(run.checkpoint_dir, steps_done, checkpoint_state(run))
    if run.rank == 0:
        _say(bar, f"checkpoint: {path}")


def train_rank(config: TrainConfig, run_dir: str) -> None:
    """Train on this rank, then evaluate (collective: every rank of the default group calls it alike).

    Args:
        config: the run's settings, the same on every rank.
        run_dir: the run directory; rank 0 writes metrics, plots and eval results there, all ranks checkpoints.

    Raises:
        SeqparInputError: settings or files that turn out not to work on the ranks (raised on every rank).
    """
    run = set_up_run(config, run_dir)
    writer = MetricsWriter(run_dir, run.start) if run.rank == 0 else None
    bar = _progress_bar(config, run.start) if run.rank == 0 and config.progress else None
    memory = PeakMemory(run.device)
    end = config.stop_at or config.steps
    run.model.train()
    for step in range(run.start, end):
        memory.reset()
        began = time.perf_counter()
        result = optimizer_step(run, step)
        seconds = time.perf_counter() - began
        if step == run.start and run.rank == 0:  # what attention ran, now that it has run
            _say(bar, banner(config, run.model, run.mesh))
        record = _step_record(run, step, result, memory.peak_mb(), seconds)
        if record is not None:
            _log_step(config, record, writer, bar, end)
        if (config.save_every and (step + 1) % config.save_every == 0) or step + 1 == end:
            _save(run, step + 1, bar)
    if bar is not None:
        bar.close()
    if end == config.steps and run.source.passkey is not None:
        evaluate_passkey(run, writer)
    if writer is not None:
        writer.close()
        for path in plot_metrics(run_dir):
            print(f"plot: {path}", flush=True)
