"""Run-directory outputs of ``seqpar train``: metrics.jsonl, TensorBoard events and PNG plots.

Only rank 0 writes; per-rank values (peak memory) arrive already gathered.
"""

from __future__ import annotations

import json
import math
import os

from seqpar.train.passkey import CHANCE


class MetricsWriter:
    """Appends one JSON line per record to ``metrics.jsonl`` and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: str, resume_step: int = 0) -> None:
        self.path = os.path.join(run_dir, "metrics.jsonl")
        if resume_step and os.path.exists(self.path):
            # drop records after the checkpoint we resume from: they will be produced again
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            with open(self.path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
        from torch.utils.tensorboard import SummaryWriter

        self.tensorboard = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=resume_step or None)

    def write(self, record: dict) -> None:
        """Log ``record`` (must hold "step"); lists of numbers become one TensorBoard scalar per element, text
        (a string or a list of them, e.g. the micro-batches' layouts) goes to metrics.jsonl only."""
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        step = record["step"]
        for key, value in record.items():
            if key == "step" or isinstance(value, str) or (isinstance(value, list) and str in map(type, value)):
                continue
            if isinstance(value, list):
                for i, v in enumerate(value):
                    self.tensorboard.add_scalar(f"{key}/rank{i}", v, step)
            else:
                self.tensorboard.add_scalar(key, value, step)

    def close(self) -> None:
        """Flush TensorBoard."""
        self.tensorboard.close()


def read_metrics(path: str) -> list[dict]:
    """Records of a metrics.jsonl file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _loss_figure(plt, run_dir: str, records: list[dict]) -> object:
    """The loss plot: training loss, loss on the answers against chance, and the evaluation's accuracy if any."""
    steps = [r["step"] for r in records]
    path = os.path.join(run_dir, "eval.json")
    evaluation = None
    if os.path.exists(path) and any("answer_loss" in r for r in records):
        with open(path) as f:
            evaluation = json.load(f)
    fig, axes = plt.subplots(1, 2 if evaluation else 1, figsize=(11 if evaluation else 7, 4), squeeze=False)
    ax = axes[0][0]
    ax.plot(steps, [r["loss"] for r in records], label="training loss (every token; keys are random)")
    if any("answer_loss" in r for r in records):
        pts = [(r["step"], r["answer_loss"]) for r in records if "answer_loss" in r]
        ax.plot(*zip(*pts), label="loss on the scored answers")
        ax.axhline(-math.log(CHANCE), color="gray", linestyle="--", linewidth=1, label="chance on an answer")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("Training loss")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    if evaluation:
        ax = axes[0][1]
        lengths = list(evaluation["accuracy"])
        bars = ax.bar(lengths, [100 * evaluation["accuracy"][n] for n in lengths], color="tab:orange")
        ax.bar_label(bars, fmt="%.1f%%")
        ax.axhline(100 * evaluation["chance"], color="gray", linestyle="--", linewidth=1, label="chance")
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("answers right (%)")
        ax.set_title(f"After training: {evaluation['task']}")
        ax.set_ylim(0, 110)
        ax.grid(alpha=0.3, axis="y")
        ax.legend()
    return fig


def plot_metrics(run_dir: str) -> list[str]:
    """Write loss.png (with the evaluation, when there is one), tokens_per_s.png and memory.png; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if r.get("kind") == "train"]
    if not records:
        return []
    steps = [r["step"] for r in records]
    made = []

    def save(fig, name: str) -> None:
        path = os.path.join(run_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)

    save(_loss_figure(plt, run_dir, records), "loss.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["tokens_per_s"] for r in records])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("tokens / s (all ranks)")
    ax.set_title("Training throughput")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    save(fig, "tokens_per_s.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    ranks = max(len(r["peak_memory_mb"]) for r in records)  # a resume may run on another number of ranks
    for rank in range(ranks):
        points = [(r["step"], r["peak_memory_mb"][rank]) for r in records if rank < len(r["peak_memory_mb"])]
        ax.plot(*zip(*points), label=f"rank {rank}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("peak memory (MB)")
    ax.set_title("Peak memory per rank (resident set on CPU, allocator peak on GPU)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, "memory.png")
    return made
