"""The training loop one rank runs: set-up, then per step an optimizer step, a log record and maybe a checkpoint,
then the evaluation and the Hugging Face model directory.

``train_rank`` expects an initialised default process group (``seqpar.train.launch`` sets it up). The steps it
calls live in ``state`` (set-up), ``step`` (one optimizer step), ``evaluate`` (passkey accuracy) and ``export``
(``<run_dir>/hf``).

Note [stopping on a signal]
    SIGTERM or SIGINT on any rank only sets a flag there (``seqpar.runtime.StopSignals``). The flag rides
    in the per-step all-gather of memory and time that the metrics need anyway, so every rank learns of it
    after the same optimizer step without an extra collective; they then write one checkpoint at that step
    and return the signal. A rank blocked in a collective whose peer died gets an error from the backend
    instead, so a signal never turns a failure into a hang.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

import seqpar
from seqpar.runtime.memory import PeakMemory, resident_mb
from seqpar.runtime.progress import RankProgress, lost_peer
from seqpar.runtime.signals import StopSignals
from seqpar.train.checkpoint import save_checkpoint
from seqpar.train.config import TrainConfig
from seqpar.train.evaluate import evaluate_passkey
from seqpar.train.export import export_run
from seqpar.train.metrics import MetricsWriter, plot_metrics
from seqpar.train.state import RunState, banner, checkpoint_state, run_layout, set_up_run
from seqpar.train.step import StepResult, optimizer_step

if TYPE_CHECKING:
    from tqdm import tqdm


def _progress_bar(config: TrainConfig, start: int) -> tqdm:
    """Rank 0's tqdm bar over the optimizer steps, starting at ``start``."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())  # tqdm's default multiprocessing lock would leak a semaphore at exit
    return tqdm(total=config.steps, initial=start, desc="seqpar train", unit="step", dynamic_ncols=True, disable=None)


def _say(bar: tqdm | None, line: str) -> None:
    """Print ``line`` above the progress bar, or plainly when there is none."""
    (bar.write if bar is not None else print)(line)


@contextlib.contextmanager
def _doing(config: TrainConfig, progress: RankProgress, what: str) -> Iterator[None]:
    """Record ``what`` as this rank's phase, and re-raise a collective's failure (a timeout, a lost peer)
    saying which rank failed while doing what and which ranks are stalled or dead and where they were
    (``RankProgress.stalled``, which first waits up to five seconds for the other ranks to fail too, less
    when a signal says the run is ending)."""
    progress.mark(what)
    try:
        yield
    except RuntimeError as error:  # SeqparInputError is a ValueError: it passes through as it is
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        timed_out = "timed out" in first.lower()
        others = progress.stalled(min(5.0, config.timeout_s)) if timed_out or lost_peer(first) else ""
        why = f" ({others})" if others else ""
        if timed_out:
            why = f" (no answer from the other ranks within --timeout-s {config.timeout_s}" + (
                f"; {others})" if others else ": a rank is stalled or dead)"
            )
        raise RuntimeError(f"rank {progress.rank} failed while {what}{why}: {first}") from error


def _step_record(
    run: RunState, step: int, result: StepResult, peak_mb: float, seconds: float, stop: bool
) -> tuple[dict | None, bool]:
    """Gather the step's per-rank memory, time and stop flags and its summed losses (collective).

    Returns:
        The metrics.jsonl record on rank 0 (None on the other ranks), and whether any rank was asked to stop
        (the same on every rank: Note [stopping on a signal]).
    """
    config = run.config
    stats = torch.tensor(
        [peak_mb, seconds, resident_mb("VmRSS", default=0.0), float(stop)], dtype=torch.float64, device=run.device
    )
    gathered = [torch.empty_like(stats) for _ in range(run.world)]
    dist.all_gather(gathered, stats)
    table = torch.stack(gathered).cpu()  # one copy from the device, read row by row below
    stopping = bool((table[:, 3] > 0).any())
    sums = seqpar.sum_over(torch.stack([result.loss_sum, result.answer_sum]), run.loss_group)
    if run.rank != 0:
        return None, stopping
    step_time = float(table[:, 1].max())  # the slowest rank sets the pace
    record = {
        "kind": "train",
        "step": step + 1,
        "loss": float(sums[0]),
        "lr": result.lr,
        "grad_norm": float(result.grad_norm),
        "tokens_per_s": config.batch_size * config.dp * config.seq_len / step_time,
        "step_s": step_time,
        "peak_memory_mb": [round(float(mb), 1) for mb in table[:, 0]],
        "resident_mb": [round(float(mb), 1) for mb in table[:, 2]],
    }
    if result.has_answers:
        record["answer_loss"] = float(sums[1])
    if result.layouts:  # rank 0's micro-batches: what --layout balanced, placed or auto cut each with
        record["layouts"] = list(result.layouts)
    return record, stopping


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


def _save(run: RunState, progress: RankProgress, steps_done: int, bar: tqdm | None) -> str:
    """Checkpoint the model, optimizer and schedule after ``steps_done`` steps (collective); returns its path."""
    with _doing(run.config, progress, f"saving the checkpoint of step {steps_done}"):
        path = save_checkpoint(run.checkpoint_dir, steps_done, checkpoint_state(run), run_layout(run.config))
    if run.rank == 0:
        _say(bar, f"checkpoint: {path}")
    return path


def _train_steps(
    run: RunState, stop: StopSignals, progress: RankProgress, writer: MetricsWriter | None, bar: tqdm | None
) -> int | None:
    """The optimizer steps from ``run.start``; returns the step a signal stopped them after, or None.

    A stop leaves one checkpoint at that step (Note [stopping on a signal]).
    """
    config = run.config
    memory = PeakMemory(run.device)
    end = config.stop_at or config.steps
    run.model.train()
    for step in range(run.start, end):
        memory.reset()
        began = time.perf_counter()
        with _doing(run.config, progress, f"optimizer step {step + 1}"):
            result = optimizer_step(run, step)
        seconds = time.perf_counter() - began
        if step == run.start and run.rank == 0:  # what attention ran, now that it has run
            _say(bar, banner(config, run.model, run.mesh))
        with _doing(run.config, progress, f"gathering the metrics of step {step + 1}"):
            record, stopping = _step_record(run, step, result, memory.peak_mb(), seconds, stop.received is not None)
        if record is not None:
            _log_step(config, record, writer, bar, end)
        if stopping and run.rank == 0:
            _say(bar, f"stop requested: every rank finished step {step + 1}; saving one checkpoint there")
        if (config.save_every and (step + 1) % config.save_every == 0) or step + 1 == end or stopping:
            _save(run, progress, step + 1, bar)
        if stopping:
            return step + 1
    return None


def _stopped_line(run: RunState, received: signal.Signals | None, done: int) -> str:
    what = received.name if received is not None else "a signal to another rank"
    return (
        f"stopped by {what} after step {done} of {run.config.steps}; checkpoint "
        f"{run.checkpoint_dir}/step_{done:07d} is complete. To resume, run the same command with "
        f"--run-dir {run.run_dir} --resume auto"
    )


def train_rank(config: TrainConfig, run_dir: str) -> signal.Signals | None:
    """Train on this rank, then evaluate (collective: every rank of the default group calls it alike).

    SIGTERM and SIGINT stop the run cleanly after the current optimizer step (Note [stopping on a signal]):
    one checkpoint is written there, rank 0 prints how to resume, and the evaluation is skipped. A run that
    ends otherwise (``--stop-at`` included) writes ``<run_dir>/hf`` unless ``--no-export-hf`` (Note [hf export]).

    Args:
        config: the run's settings, the same on every rank.
        run_dir: the run directory; rank 0 writes metrics, plots and eval results there, all ranks checkpoints.

    Returns:
        The signal this rank received if the run was stopped by one (None if the stop came from a signal to
        another rank, or if the run finished).

    Raises:
        SeqparInputError: settings or files that turn out not to work on the ranks (raised on every rank).
        RuntimeError: a collective failed or timed out (``--timeout-s``); the message names the rank and the
            step or phase it was in.
    """
    with StopSignals() as stop:
        progress = RankProgress(interrupted=lambda: stop.received is not None)
        with _doing(config, progress, "setting up the run"):
            run = set_up_run(config, run_dir)
        writer = MetricsWriter(run_dir, run.start) if run.rank == 0 else None
        bar = _progress_bar(config, run.start) if run.rank == 0 and config.progress else None
        stopped = _train_steps(run, stop, progress, writer, bar)
        if bar is not None:
            bar.close()
        if stopped is None and (config.stop_at or config.steps) == config.steps and run.source.passkey is not None:
            with _doing(run.config, progress, "evaluating"):
                evaluate_passkey(run, writer)
        if stopped is None and config.export_hf:
            with _doing(run.config, progress, "writing the Hugging Face model"):
                exported = export_run(run)
            if exported is not None:
                print(f"hugging face model: {exported}", flush=True)
        if writer is not None:
            writer.close()
            for path in plot_metrics(run_dir):
                print(f"plot: {path}", flush=True)
            if stopped is not None:
                print(_stopped_line(run, stop.received, stopped), flush=True)
        return stop.received if stopped is not None else None
