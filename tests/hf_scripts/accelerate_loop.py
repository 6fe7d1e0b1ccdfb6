"""The accelerate recipe of the README, run on the test's data and compared with the one-process Trainer.

An ``Accelerator`` wraps the prepared model in DDP; batches come per data-parallel replica; the loss is exact.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
import transformers
from accelerate import Accelerator
from torch.utils.data import DataLoader

import seqpar
import seqpar.hf
from tests.hf_scripts.common import STEPS, model, save


def run(out: str, docs: list[dict]) -> None:
    """6 SGD steps of 2 micro-batches at sp 2, clipping at 0.5: the settings of the "sp2" case."""
    accelerator = Accelerator(cpu=True)
    mesh = seqpar.make_mesh(sp_size=2)  # dp = world / 2
    net = seqpar.prepare_model(model("llama"), mesh)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    net, optimizer = accelerator.prepare(net, optimizer)  # DDP over every process
    # not accelerator.prepare-d: accelerate would give each process different rows
    loader = DataLoader(
        docs,
        batch_size=2,
        sampler=seqpar.hf.replica_sampler(docs, mesh, shuffle=False),
        collate_fn=transformers.DataCollatorWithFlattening(return_position_ids=True),
    )
    batches, logs = iter(loader), []
    for step in range(STEPS):
        micro = [next(batches) for _ in range(2)]
        sharded = seqpar.hf.shard_step(micro, mesh, group=dist.group.WORLD)
        step_loss = torch.zeros(())
        for i, shard in enumerate(sharded.shards):
            last = i == len(sharded.shards) - 1
            with contextlib.nullcontext() if last else accelerator.no_sync(net):
                shard = {k: v.to(accelerator.device) for k, v in shard.items()}
                logits = net(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
                loss = seqpar.cross_entropy(logits, shard["shift_labels"], num_valid_tokens=sharded.num_valid_tokens)
                accelerator.backward(loss * accelerator.num_processes)  # DDP averages: scaled, it sums
            step_loss += loss.detach()
        grad_norm = accelerator.clip_grad_norm_(net.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        logs.append((step + 1, float(seqpar.sum_over(step_loss, dist.group.WORLD)), float(grad_norm)))
    params = {n: p.detach().clone() for n, p in accelerator.unwrap_model(net).named_parameters()}
    if dist.get_rank() == 0:
        save(os.path.join(out, "accelerate_loop.pt"), {"log": logs, "eval": [], "params": params})
