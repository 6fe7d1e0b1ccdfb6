"""accelerate's sequence- and context-parallel guides run with ``seqpar.hf.Accelerator``; one-process references.

``run(out, name)`` (under torchrun) runs a guide's loop as upstream writes it, only the import changed and the
snippet's undefined names (model, optimizer, dl, rank, move_to_device ...) filled in around it;
``accelerate_references`` (one process, no seqpar) trains the same rows. Both record every step's loss and
gradient norm (the optimizer records it), the final parameters, and for sp a held-out loss summed with
``gather_for_metrics``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from accelerate.tracking import GeneralTracker
from accelerate.utils import send_to_device
from torch.utils.data import DataLoader
from transformers import DataCollatorWithFlattening

from tests.hf_scripts.accelerate_references import (
    EPOCHS,
    GUIDES,
    LR,
    RecordingSGD,
    cp_rows,
    create_collate_fn,
    packed_collate,
    sp_rows,
)
from tests.hf_scripts.common import documents, save
from tests.hf_scripts.common import model as tiny_model


class Recorder(GeneralTracker):
    """An accelerate tracker that keeps what ``accelerator.log`` was given (the guide logs its loss)."""

    name, requires_logging_directory, main_process_only = "recorder", False, True

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[float] = []

    @property
    def tracker(self) -> list[float]:
        return self.rows

    def store_init_configuration(self, values: dict) -> None:
        pass

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        self.rows.append(float(values["train_loss"]))


# accelerate's examples/torch_native_parallelism/nd_parallel.py, as written
def forward(model, batch, optimizer, accelerator):
    batch["position_ids"] = torch.arange(0, batch["input_ids"].size(1), device=batch["input_ids"].device).unsqueeze(0)
    # We need both labels and shift_labels, as the loss computation in the model is hidden behind `if labels is not None`, but the loss computation  # noqa: E501
    # itself prioritzes shift_labels (if provided) which are the correct ones (due to labels being wrong if cp enabled)
    buffers = [batch["input_ids"], batch["shift_labels"], batch["labels"], batch["position_ids"]]
    with accelerator.maybe_context_parallel(
        buffers=buffers, buffer_seq_dims=[1, 1, 1, 1], no_restore_buffers=set(buffers)
    ):
        # To get the proper loss value, we need to average across devices that are participating in data parallel/context parallel training  # noqa: E501
        # As for DP we have a different batch on each device and for CP we essentially have a different part of sequences on each device  # noqa: E501
        # I.e. with causal modelling and seq_len 1024, this dimension becomes another batch dimension of sorts
        loss_reduce_grp = (
            accelerator.torch_device_mesh["dp_cp"].get_group()
            if accelerator.parallelism_config.dp_cp_dim_names
            else None
        )
        outputs = model(**batch)
        loss = outputs.loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=loss_reduce_grp)

    return loss


class _GatherOnGloo(torch.autograd.Function):
    """``torch.distributed.nn.functional.all_gather`` with a backward that works on any gloo subgroup.

    torch's own backward on gloo emulates a reduce-scatter by ``dist.scatter(..., src=i, group=group)`` with ``i``
    a group rank read as a global one, so it raises "Global rank 0 is not part of group" for an SP group such as
    ranks {2, 3} (dp 2 x sp 2); NCCL takes another path. The gradient is the same: the sum over the group of each
    rank's gradient for this rank's slot.
    """

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return tuple(parts)

    @staticmethod
    def backward(ctx, *grads):
        summed = torch.stack(grads).contiguous()
        dist.all_reduce(summed, group=ctx.group)
        return summed[dist.get_rank(ctx.group)], None


def sp_guide(dp: int) -> dict:
    """accelerate's sequence-parallelism guide (Ulysses), sp 2 x dp replicas, over EPOCHS epochs.

    At dp > 1 on gloo, torch's differentiable all_gather cannot run its backward (``_GatherOnGloo``): the guide's
    call is served by the replacement for this run, the loop's text unchanged.
    """
    if dp > 1 and dist.get_backend() == "gloo":
        from unittest import mock

        with mock.patch.object(
            torch.distributed.nn.functional, "all_gather", lambda t, group: _GatherOnGloo.apply(t, group)
        ):
            return _sp_guide(dp)
    return _sp_guide(dp)


def _sp_guide(dp: int) -> dict:
    from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig

    from seqpar.hf import Accelerator

    parallelism_config = ParallelismConfig(
        dp_replicate_size=dp,
        dp_shard_size=1,  # Explicit: no sharding within replicas
        sp_size=2,
        sp_backend="deepspeed",
        sp_handler=DeepSpeedSequenceParallelConfig(
            sp_seq_length=256, sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"
        ),
    )
    recorder = Recorder()
    accelerator = Accelerator(cpu=True, log_with=[recorder], parallelism_config=parallelism_config)
    accelerator.init_trackers("guide")
    model_ = tiny_model("llama")
    optimizer = RecordingSGD(model_.parameters(), lr=LR)
    dl = DataLoader(sp_rows(), batch_size=2, collate_fn=DataCollatorWithFlattening(), shuffle=False)
    held_out = DataLoader(sp_rows()[:5], batch_size=2, collate_fn=DataCollatorWithFlattening(), shuffle=False)
    model, optimizer, dl, held_out = accelerator.prepare(model_, optimizer, dl, held_out)
    rank, move_to_device, batches = torch.distributed.get_rank(), send_to_device, len(dl)
    empty = []  # valid tokens of each shard, to check that a shard had none
    # --- the guide, as written ---
    sp_size = parallelism_config.sp_size if parallelism_config is not None else 1
    if sp_size > 1:
        sp_group = accelerator.torch_device_mesh["sp"].get_group()
        sp_world_size = parallelism_config.sp_size

    for _epoch in range(EPOCHS):  # filled in: several epochs
        # Normal training loop
        for iter, batch in enumerate(dl):
            optimizer.zero_grad()

            batch = move_to_device(batch, model.device)

            # The model automatically receives shift_labels via **kwargs and uses it for loss computation.
            # Both standard transformers models and Liger-patched models handle this correctly.
            outputs = model(**batch)
            loss = outputs.loss
            shift_labels = batch["shift_labels"]

            if sp_size > 1:
                # differentiable weighted per-shard-loss aggregation across ranks
                losses_per_rank = torch.distributed.nn.functional.all_gather(loss, group=sp_group)
                # special dealing with SFT that has prompt tokens that aren't used in loss computation
                good_tokens = (shift_labels != -100).view(-1).sum()
                good_tokens_per_rank = torch.distributed.nn.functional.all_gather(good_tokens, group=sp_group)
                # Skip ranks with zero valid tokens to avoid NaN contamination (NaN * 0 = NaN)
                total_loss = sum(
                    losses_per_rank[rank] * good_tokens_per_rank[rank]
                    for rank in range(sp_world_size)
                    if good_tokens_per_rank[rank] > 0
                )
                total_good_tokens = sum(good_tokens_per_rank)
                loss = total_loss / max(total_good_tokens, 1)

            if rank == 0:
                accelerator.print(f"{iter}: {loss=}")
            accelerator.log(dict(train_loss=loss, step=iter))

            accelerator.backward(loss)
            optimizer.step()
            # --- end of the guide ---
            empty.append(min(int(n) for n in good_tokens_per_rank))
    sums = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():  # held-out loss: every token once, summed over the replicas by gather_for_metrics
        for batch in held_out:
            count = (batch["shift_labels"] != -100).sum()
            pair = torch.stack([model(**batch).loss.double() * count, count.double()])
            dist.all_reduce(pair, group=sp_group)
            sums += accelerator.gather_for_metrics(pair[None]).sum(0)
    params = {n: p.detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters()}
    shards_empty = sum(n == 0 for n in empty)
    return {"loss": recorder.rows, "norm": optimizer.optimizer.norms, "params": params, "batches": batches,
            "held_out": sums.tolist(), "empty_shards": shards_empty}  # fmt: skip


def cp_guide(comm: str) -> dict:
    """nd_parallel.py's forward (cp 2, ``cp_comm_strategy`` comm) for "allgather"; for "alltoall", packed documents
    with a padding mask under ``accelerator.accumulate`` (gradient_accumulation_steps=2) with the guide's block."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import TorchContextParallelConfig

    from seqpar.hf import Accelerator

    cp_config = TorchContextParallelConfig(cp_comm_strategy=comm)
    parallelism_config = ParallelismConfig(cp_size=2, cp_handler=cp_config)
    packed = comm == "alltoall"
    accelerator = Accelerator(
        cpu=True, parallelism_config=parallelism_config, gradient_accumulation_steps=2 if packed else 1
    )
    model = model_ = tiny_model("llama")
    optimizer = RecordingSGD(model_.parameters(), lr=LR)
    if packed:
        dataloader = DataLoader(documents(12, 12), batch_size=4, collate_fn=packed_collate)
    else:
        dataloader = DataLoader(cp_rows(), batch_size=1, collate_fn=create_collate_fn())
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    losses = []
    for batch in dataloader:
        if not packed:
            losses.append(forward(model, batch, optimizer, accelerator).item())
            continue
        with accelerator.accumulate(model):
            keys = ("input_ids", "position_ids", "attention_mask", "shift_labels")
            buffers = [batch[k] for k in keys]
            with accelerator.maybe_context_parallel(
                buffers=buffers, buffer_seq_dims=[1] * 4, no_restore_buffers=set(buffers)
            ):
                outputs = model(**batch)
                loss = outputs.loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=accelerator.torch_device_mesh["dp_cp"].get_group())
            losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters()}
    return {"loss": losses, "norm": optimizer.optimizer.norms, "params": params}


def run(out: str, name: str) -> None:
    _, kind, option = GUIDES[name]
    found = sp_guide(option) if kind == "sp" else cp_guide(option)
    if dist.get_rank() == 0:
        save(os.path.join(out, f"{name}.pt"), found)
