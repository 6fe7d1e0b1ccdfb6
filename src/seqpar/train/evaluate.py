"""End-of-run evaluation: teacher-forced retrieval accuracy at each evaluation length (Note [passkey task]).

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
from seqpar.train.passkey import CHANCE, TASK
from seqpar.train.pipeline import gather_stages
from seqpar.train.state import RunState, answer_shift_labels
from seqpar.train.step import shard_inputs


def _accuracy_at(run: RunState, length: int) -> tuple[float, int]:
    """Fraction of the scored answers of held-out examples of ``length`` tokens predicted right (collective).

    Returns:
        The accuracy over every data-parallel replica's examples, and the number of answers it counts.
    """
    config, mesh, task = run.config, run.mesh, run.source.passkey
    counts = torch.zeros(2, dtype=torch.float64)  # answers right, answers
    last = (run.dp_rank + 1) * config.eval_examples
    for first in range(run.dp_rank * config.eval_examples, last, 4):
        indices = list(range(first, min(first + 4, last)))
        ids, answers = task.batch(length, indices, split="eval")
        batch = {"input_ids": ids, "shift_labels": answer_shift_labels(ids, answers)}
        shard = seqpar.shard_batch(batch, mesh, layout=config.layout)
        with run.autocast:
            logits = run.model(**shard_inputs(run, shard)).logits
        labels = shard["shift_labels"].to(run.device)
        scored = labels != IGNORE_INDEX
        counts += torch.stack([((logits.argmax(-1) == labels) & scored).sum(), scored.sum()]).double().cpu()
    # each sequence is split over the sp ranks and seen whole by each tp and pp rank: sum the sp shards, count
    # tp and pp once
    counts = seqpar.sum_over(counts, dist.group.WORLD) / (config.tp * config.pp)
    return float(counts[0] / counts[1]), int(counts[1])


def _report(config: TrainConfig, results: dict[int, tuple[float, int]], writer: MetricsWriter) -> None:
    """Write the eval record and eval.json next to metrics.jsonl, and print one line per length."""
    record = {"kind": "eval", "step": config.steps}
    record.update({f"accuracy_{n}": accuracy for n, (accuracy, _) in results.items()})
    writer.write(record)
    with open(os.path.join(os.path.dirname(writer.path), "eval.json"), "w") as f:
        json.dump(
            {
                "task": TASK,
                "accuracy": {str(n): accuracy for n, (accuracy, _) in results.items()},
                "chance": CHANCE,
                "answers": {str(n): count for n, (_, count) in results.items()},
                "examples_per_length": config.eval_examples * config.dp,
            },
            f,
            indent=2,
        )
    for n, (accuracy, count) in results.items():
        note = "the trained length" if n == config.seq_len else "never trained on"
        print(
            f"{TASK} at {n} tokens ({note}): {accuracy:.1%} of {count} answers right "
            f"({config.eval_examples * config.dp} examples; chance {CHANCE:.1%})",
            flush=True,
        )


@torch.no_grad()
def evaluate_passkey(run: RunState, writer: MetricsWriter | None) -> None:
    """Measure retrieval accuracy at ``config.eval_lengths`` (default: seq_len and twice it) (collective).

    Args:
        run: the run's state; its source must be the passkey task.
        writer: rank 0's metrics writer (None on the other ranks, which only compute).
    """
    config = run.config
    gather_stages(run)  # under --pp: the unsplit model of every pp rank (Note [pipeline in seqpar train])
    run.model.eval()
    lengths = config.eval_lengths or [config.seq_len, 2 * config.seq_len]
    results = {length: _accuracy_at(run, length) for length in lengths}
    if writer is not None:
        _report(config, results, writer)
    run.model.train()
