"""accelerate's documented loop (train, then evaluate with a metric reduced over every process), over 2 epochs.

``reference`` is the loop as accelerate documents it on one process, batches of dp x B rows; ``run`` is the same
loop with seqpar's additions from the README's accelerate recipe (a mesh, the prepared model, batches per
replica from ``seqpar.hf.replica_loader``, ``shard_step`` and ``seqpar.cross_entropy``). Both train 2 epochs of
gradient-accumulation steps (2 micro-batches; the last step of an epoch may have one) without dropping the
short last batch, clip at 0.5, and after each epoch measure the held-out token accuracy and loss, summed over
the processes with ``accelerator.reduce``. The rows do not fill the last batch, at dp 2 a replica runs a last
micro-batch with no row (Note [epoch ends]).
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from accelerate import Accelerator
from torch.utils.data import DataLoader

from tests.hf_scripts.common import documents, model, save

ACCUMULATION, BATCH, EVAL_BATCH, EPOCHS = 2, 2, 3, 2
TRAIN_ROWS, EVAL_ROWS = 21, 10


def _steps(loader) -> list[list[dict]]:
    batches = list(loader)
    return [batches[i : i + ACCUMULATION] for i in range(0, len(batches), ACCUMULATION)]


def reference(out: str, dp: int) -> None:
    """One process, no seqpar: batches of dp x B rows, losses summed over a step's tokens.

    ``use_cache=False``: without a cache transformers reads packed documents from restarting position ids.
    """
    accelerator = Accelerator(cpu=True)
    net = model("llama")
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    net, optimizer = accelerator.prepare(net, optimizer)
    collate = transformers.DataCollatorWithFlattening()
    loader = DataLoader(documents(TRAIN_ROWS, 7), batch_size=BATCH * dp, shuffle=False, collate_fn=collate)
    held_out = DataLoader(documents(EVAL_ROWS, 8), batch_size=EVAL_BATCH * dp, collate_fn=collate)
    logs, metrics = [], []
    for _ in range(EPOCHS):
        for micro_batches in _steps(loader):
            tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro_batches)
            step_loss = 0.0
            for batch in micro_batches:
                logits = net(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
                loss = F.cross_entropy(logits[0, :-1], batch["labels"][0, 1:], reduction="sum") / tokens
                accelerator.backward(loss)
                step_loss += float(loss.detach())
            grad_norm = accelerator.clip_grad_norm_(net.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
            logs.append((len(logs) + 1, step_loss, float(grad_norm)))
        sums = torch.zeros(3, dtype=torch.float64)
        with torch.no_grad():
            for batch in held_out:
                logits, labels = (
                    net(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[
                        0, :-1
                    ],
                    batch["labels"][0, 1:],
                )
                valid = labels != -100
                sums += torch.tensor(
                    [
                        (logits.argmax(-1) == labels)[valid].sum(),
                        valid.sum(),
                        F.cross_entropy(logits, labels, reduction="sum"),
                    ],
                    dtype=torch.float64,
                )
        sums = accelerator.reduce(sums, "sum")
        metrics.append((float(sums[0] / sums[1]), float(sums[2] / sums[1])))
    params = {n: p.detach().clone() for n, p in accelerator.unwrap_model(net).named_parameters()}
    save(os.path.join(out, "reference", f"accelerate_dp{dp}.pt"), {"log": logs, "metrics": metrics, "params": params})


def run(out: str, dp: int) -> None:
    """The same loop under seqpar, sp = world / dp."""
    import seqpar
    import seqpar.hf

    accelerator = Accelerator(cpu=True)
    mesh = seqpar.make_mesh(sp_size=dist.get_world_size() // dp)
    net = seqpar.prepare_model(model("llama"), mesh)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    net, optimizer = accelerator.prepare(net, optimizer)  # DDP over every process
    collate = transformers.DataCollatorWithFlattening()
    loader = seqpar.hf.replica_loader(
        documents(TRAIN_ROWS, 7), mesh, batch_size=BATCH, collate_fn=collate, shuffle=False
    )
    held_out = seqpar.hf.replica_loader(
        documents(EVAL_ROWS, 8), mesh, batch_size=EVAL_BATCH, collate_fn=collate, shuffle=False
    )
    logs, metrics = [], []
    for _ in range(EPOCHS):
        for micro_batches in _steps(loader):
            step = seqpar.hf.shard_step(micro_batches, mesh, group=dist.group.WORLD)
            step_loss = torch.zeros(())
            for i, shard in enumerate(step.shards):
                with accelerator.no_sync(net) if i < len(step.shards) - 1 else contextlib.nullcontext():
                    logits = net(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
                    loss = seqpar.cross_entropy(logits, shard["shift_labels"], num_valid_tokens=step.num_valid_tokens)
                    accelerator.backward(loss * accelerator.num_processes)  # DDP averages: scaled, it sums
                step_loss += loss.detach()
            grad_norm = accelerator.clip_grad_norm_(net.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
            logs.append((len(logs) + 1, float(accelerator.reduce(step_loss, "sum")), float(grad_norm)))
        sums = torch.zeros(3, dtype=torch.float64)
        with torch.no_grad():
            for batch in held_out:
                shard = seqpar.hf.shard_step([batch], mesh, group=dist.group.WORLD).shards[0]
                logits, labels = (
                    net(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits,
                    shard["shift_labels"],
                )
                valid = labels != -100
                sums += torch.tensor(
                    [
                        (logits.argmax(-1) == labels)[valid].sum(),
                        valid.sum(),
                        F.cross_entropy(logits[valid], labels[valid], reduction="sum"),
                    ],
                    dtype=torch.float64,
                )
        sums = accelerator.reduce(sums, "sum")  # every token once: sp ranks hold different tokens, replicas rows
        metrics.append((float(sums[0] / sums[1]), float(sums[2] / sums[1])))
    params = {n: p.detach().clone() for n, p in accelerator.unwrap_model(net).named_parameters()}
    if dist.get_rank() == 0:
        save(os.path.join(out, f"accelerate_dp{dp}.pt"), {"log": logs, "metrics": metrics, "params": params})


if __name__ == "__main__":
    import sys

    for dp in map(int, sys.argv[2:]):
        reference(sys.argv[1], dp)
