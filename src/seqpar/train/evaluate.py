"""End-of-run evaluation: teacher-forced passkey accuracy at each evaluation length (Note [passkey task]).

Every rank evaluates its data-parallel slice of the held-out examples with the sequence split as in training;
rank 0 writes the results (metrics.jsonl, eval.json) and prints one line per length.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

import seqpar
from seqpar.data import IGNORE_INDEX
from seqpar.train.config import TrainConfig
from seqpar.train.metrics import MetricsWriter
from seqpar.train.passkey import DIGITS
from seqpar.train.state import RunState, answer_shift_labels

__all__ = ["evaluate_passkey"]


def _accuracy_at(run: RunState, length: int) -> tuple[float, float]:
    """Fractions of held-out examples of ``length`` tokens with every digit right, and of digits right (collective)."""
    config, mesh, task = run.config, run.mesh, run.source.passkey
    correct = torch.zeros(2, dtype=torch.float64)  # documents with every digit right, digits right
    count = 0
    last = (run.dp_rank + 1) * config.eval_examples
    for first in range(run.dp_rank * config.eval_examples, last, 4):
        indices = list(range(first, min(first + 4, last)))
        ids, answers = task.batch(length, indices, split="eval")
        shard = seqpar.shard_batch({"input_ids": ids, "shift_labels": answer_shift_labels(ids, answers)}, mesh)
        with run.autocast:
            logits = run.model(
                input_ids=shard["input_ids"].to(run.device), position_ids=shard["position_ids"].to(run.device)
            ).logits
        labels = shard["shift_labels"].to(run.device)
        hits = ((logits.argmax(-1) == labels) & (labels != IGNORE_INDEX)).sum(-1).double()  # [B] digits right here
        hits = seqpar.sum_over(hits, mesh)  # digits right over the whole sequence
        correct += torch.stack([(hits == DIGITS).sum(), hits.sum()]).cpu()
        count += len(indices)
    correct = seqpar.sum_over(correct, dist.group.WORLD) / (mesh.sp_size * config.tp)  # each SP/TP rank counted
    return float(correct[0]) / (count * config.dp), float(correct[1]) / (count * config.dp * DIGITS)


def _report(config: TrainConfig, results: dict[int, tuple[float, float]], writer: MetricsWriter) -> None:
    """Write the eval record and eval.json next to metrics.jsonl, and print one line per length."""
    record = {"kind": "eval", "step": config.steps}
    for n, (exact, digits) in results.items():
        record[f"passkey_accuracy_{n}"] = exact
        record[f"passkey_digit_accuracy_{n}"] = digits
    writer.write(record)
    with open(os.path.join(os.path.dirname(writer.path), "eval.json"), "w") as f:
        json.dump(
            {
                "passkey_accuracy": {n: r[0] for n, r in results.items()},
                "passkey_digit_accuracy": {n: r[1] for n, r in results.items()},
                "examples_per_length": config.eval_examples * config.dp,
                "chance_digit_accuracy": 0.1,
            },
            f,
            indent=2,
        )
    for n, (exact, digits) in results.items():
        note = "the trained length" if n == config.seq_len else "never trained on"
        print(
            f"passkey at {n} tokens ({note}): {exact:.1%} of {config.eval_examples * config.dp} keys fully "
            f"retrieved, {digits:.1%} of digits (chance 10%)",
            flush=True,
        )


@torch.no_grad()
def evaluate_passkey(run: RunState, writer: MetricsWriter | None) -> None:
    """Measure passkey accuracy at ``config.eval_lengths`` (default: seq_len and twice it) (collective).

    Args:
        run: the run's state; its source must be the passkey task.
        writer: rank 0's metrics writer (None on the other ranks, which only compute).
    """
    config = run.config
    run.model.eval()
    lengths = config.eval_lengths or [config.seq_len, 2 * config.seq_len]
    results = {length: _accuracy_at(run, length) for length in lengths}
    if writer is not None:
        _report(config, results, writer)
    run.model.train()
