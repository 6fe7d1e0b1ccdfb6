"""What one rank's training run carries from step to step, and how it is set up.

``set_up_run`` builds the mesh, the model (tensor-parallel, sequence-parallel and data-parallel as configured),
the optimizer and learning-rate schedule and the batch source, then resumes from a checkpoint when asked.
It is collective: the mesh groups, the data-parallel wrapper, the data-file cache and the checkpoint load all
talk to other ranks, so every rank calls it with the same arguments and meets them in the same order.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import seqpar
from seqpar.data import IGNORE_INDEX
from seqpar.errors import SeqparInputError
from seqpar.integrations.moe import router_loss_settings
from seqpar.sequence_parallel.layouts.chunks import PER_BATCH_LAYOUTS
from seqpar.train.checkpoint import checkpoint_layout, latest_checkpoint, load_checkpoint
from seqpar.train.config import TrainConfig
from seqpar.train.data import FileRows, load_tokenizer
from seqpar.train.model import build_model
from seqpar.train.passkey import PasskeyTask
from seqpar.train.pipeline import build_pipeline, owned_model_state


def answer_shift_labels(input_ids: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """Shifted labels that keep only the passkey answers: position p-1 predicts the answer token at p.

    Args:
        input_ids: ``[B, S]`` token ids of whole passkey examples.
        answers: ``[B, A]`` positions of each example's scored answers.

    Returns:
        ``[B, S]`` labels, ``IGNORE_INDEX`` everywhere but the positions just before the answers.
    """
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    rows = torch.arange(input_ids.shape[0])[:, None]
    labels[rows, answers - 1] = input_ids[rows, answers]
    return labels


class TrainSource:
    """Global training batches: the passkey task or packed rows of data files.

    Building it is collective when data files are given (rank 0 packs them once and tells the others).
    """

    def __init__(self, config: TrainConfig, tokenizer: object, cache_dir: str) -> None:
        self.config = config
        self.passkey = None if config.data else PasskeyTask(tokenizer, config.seed)
        self.rows = (
            FileRows(config.data, tokenizer, config.seq_len, config.text_field, config.seed, cache_dir)
            if config.data
            else None
        )

    def batch(self, indices: list[int]) -> tuple[dict, torch.Tensor | None]:
        """The whole (unsharded) sequences numbered ``indices``.

        Args:
            indices: global example numbers, the same on every rank of one sequence-parallel group.

        Returns:
            The batch dict for ``seqpar.shard_batch``, and the passkey answer labels (None for data files).
        """
        if self.passkey is not None:
            ids, answers = self.passkey.batch(self.config.seq_len, indices)
            return {"input_ids": ids}, answer_shift_labels(ids, answers)
        return self.rows.batch(indices), None


@dataclass
class RunState:
    """Everything the steps of one rank's run share; built once by ``set_up_run``."""

    config: TrainConfig
    run_dir: str
    rank: int
    """This rank in the default group (rank 0 logs, prints and writes files)."""
    world: int
    device: torch.device
    mesh: seqpar.SequenceParallelMesh
    dp_rank: int
    """This rank's data-parallel replica: which slice of every global batch it reads."""
    model: torch.nn.Module
    forward: torch.nn.Module
    """What the training forward calls: the model, or its DDP/FSDP wrapper."""
    head: torch.nn.Module
    """The output projection (used directly by the chunked loss and the passkey answer loss)."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    source: TrainSource
    loss_group: dist.ProcessGroup
    """The dp x sp ranks over which the loss is normalised and gradients are summed (tp ranks share tokens)."""
    autocast: contextlib.AbstractContextManager
    checkpoint_dir: str
    pipeline: object | None = None
    """This rank's pipeline stages (``seqpar.PipelineParallel``) with --pp > 1, else None."""
    start: int = 0
    """The optimizer step to continue from (0, or the step of the resumed checkpoint)."""


def _lr_factor(config: TrainConfig, step: int) -> float:
    """Multiplier of the peak learning rate before optimizer step ``step`` (0-based)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.lr_schedule == "constant":
        return 1.0
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    floor = config.min_lr_ratio
    if config.lr_schedule == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def _rank_device(mesh: seqpar.SequenceParallelMesh) -> torch.device:
    """Where this rank's model and batches live: where the mesh's collectives run (the current GPU, or the CPU)."""
    if mesh.device_mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def banner(config: TrainConfig, model: torch.nn.Module, mesh: seqpar.SequenceParallelMesh) -> str:
    """The run's layout in one line: the mesh, the attention strategy and kernel the model's first step ran, and
    the sequence layout.

    Args:
        config: the run's settings.
        model: the prepared model, after at least one forward (its config gives the head counts).
        mesh: the run's mesh.

    Returns:
        The line, without a newline.
    """
    heads = model.config.num_attention_heads // config.tp
    kv_heads = (getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads) // config.tp
    choice = seqpar.last_attention_choice(model)
    ran = f"{choice.strategy} ({config.strategy}), kernel {choice.kernel.name}" if choice else "not run yet"
    pipe = f"pp {config.pp} ({config.pp_schedule}, {config.pp_microbatches or config.pp} micro-batches) x "
    return (
        f"mesh: {pipe if config.pp > 1 else ''}dp {config.dp} x sp {mesh.sp_size} (ring axis {mesh.ring_size} x "
        f"ulysses axis {mesh.ulysses_size}) x tp {config.tp}; attention: {ran}, {heads} heads / {kv_heads} KV heads "
        f"per rank; {config.layout} layout{' (solved per batch)' if config.layout in PER_BATCH_LAYOUTS else ''}"
    )


def set_up_run(config: TrainConfig, run_dir: str) -> RunState:
    """Build this rank's mesh, model, optimizer, schedule and batch source, and resume if asked (collective).

    Args:
        config: the run's settings, the same on every rank.
        run_dir: the run directory (data cache and checkpoints live under it).

    Returns:
        The run's state, positioned at the step to train next.

    Raises:
        SeqparInputError: settings or files that turn out not to work on the ranks (raised on every rank).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = config.dims().build_mesh()
    device = _rank_device(mesh)
    tokenizer = load_tokenizer(config.tokenizer_path())
    vocab = getattr(tokenizer, "vocab_size", None) or len(tokenizer)
    model = build_model(config, vocab)
    if not config.offload_optimizer:  # offloaded: FSDP2 moves each unit to the device as it shards it
        model = model.to(device)
    if config.pp > 1 and router_loss_settings(model) is not None:  # the same model, so every rank raises
        raise SeqparInputError(
            "--pp with a mixture-of-experts router loss (output_router_logits) is not implemented: the pipeline's "
            "stages return hidden states only; set output_router_logits false in the config, or train without --pp"
        )
    # tp -> sp -> memory features -> dp (Note [parallelize order]); "balanced": each batch's layout comes with
    # its shard (step.py, evaluate.py pass it as seqpar_layout=); "replicate": no wrapper, every rank holds the
    # parameters, gradients summed by one all-reduce after the backward
    forward = seqpar.parallelize(model, mesh, options=config.parallelize_options())
    # --pp takes --dp-mode replicate only, so the stages are cut from the unwrapped model
    pipeline = build_pipeline(config, model, mesh) if config.pp > 1 else None
    optimizer = torch.optim.AdamW(
        pipeline.parameters() if pipeline else model.parameters(),
        lr=config.lr,
        betas=(0.9, 0.95),
        weight_decay=config.weight_decay,
        eps=1e-8,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(config, s))
    source = TrainSource(config, tokenizer, os.path.join(run_dir, "data"))
    run = RunState(
        config=config,
        run_dir=run_dir,
        rank=rank,
        world=world,
        device=device,
        mesh=mesh,
        dp_rank=mesh.device_mesh.get_local_rank("dp"),
        model=model,
        forward=forward,
        head=model.get_output_embeddings(),
        optimizer=optimizer,
        scheduler=scheduler,
        source=source,
        loss_group=seqpar.data_parallel_group(mesh) if config.tp > 1 or pipeline else dist.group.WORLD,
        autocast=(
            torch.autocast(device.type, dtype=torch.bfloat16)
            if config.precision == "bf16"
            else contextlib.nullcontext()
        ),
        checkpoint_dir=os.path.join(run_dir, "checkpoints"),
        pipeline=pipeline,
    )
    run.start = _resume(run)
    return run


def checkpoint_state(run: RunState, *, whole_model: bool = False) -> dict:
    """What a checkpoint holds: model, optimizer and schedule state, in the form distributed checkpointing shards.

    Args:
        run: the run whose state to collect.
        whole_model: every parameter of the model, also those of other ranks' pipeline stages (to load
            into); by default, under --pp, only this rank's stages' (to save: Note [pipeline in seqpar train]).

    Returns:
        ``{"model", "optimizer", "scheduler"}`` state dicts, to save or to load into.
    """
    model_state, optim_state = get_state_dict(run.model, run.optimizer)
    # under --pp each parameter once, from the rank whose stage holds it (Note [pipeline in seqpar train])
    return {
        "model": model_state if whole_model else owned_model_state(run, model_state),
        "optimizer": optim_state,
        "scheduler": run.scheduler.state_dict(),
    }


def _resume(run: RunState) -> int:
    """Load the checkpoint ``config.resume`` names (or the latest one, for "auto"); returns the step to start at."""
    config = run.config
    resume = latest_checkpoint(run.checkpoint_dir) if config.resume == "auto" else config.resume
    if config.resume == "auto" and resume is None and run.rank == 0:
        print(f"no complete checkpoint in {run.checkpoint_dir}; starting from step 0", flush=True)
    if resume is None:
        return 0
    state = checkpoint_state(run, whole_model=True)
    start = load_checkpoint(resume, state)
    set_state_dict(run.model, run.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    for group, lr in zip(run.optimizer.param_groups, run.scheduler.get_last_lr()):
        group["lr"] = lr  # what the schedule set, whichever layout wrote the optimizer's groups
    if run.rank == 0:
        print(f"resumed from {resume} at step {start}{_resharding(run, checkpoint_layout(resume))}", flush=True)
    return start


def run_layout(config: TrainConfig) -> dict:
    """The parallel layout a checkpoint records, so that a resume elsewhere can say what it resharded from."""
    return {"pp": config.pp, "dp": config.dp, "sp": config.sp, "tp": config.tp, "dp_mode": config.dp_mode}


def _resharding(run: RunState, written: dict) -> str:
    """ " (written at ...; resharded to ...)" when the checkpoint's layout differs from this run's, else ""."""
    config = run.config

    now = run_layout(config)
    if not written or all(written.get(key, 1 if key == "pp" else None) == value for key, value in now.items()):
        return ""
    piped = max(written.get("pp", 1), now["pp"]) > 1  # pp named only when either side has a pipeline

    def describe(layout: dict) -> str:
        pp = f"pp {layout.get('pp', 1)} x " if piped else ""
        return f"{pp}dp {layout['dp']} x sp {layout['sp']} x tp {layout['tp']}, {layout['dp_mode']}"

    return f" (written at {describe(written)}; resharded to {describe(now)})"
