"""The training loop one rank runs: data shards, forward/backward, gradient sync, logging, checkpoints, eval.

``train_rank`` expects an initialised default process group (``seqpar.train.launch`` sets it up).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import seqpar
from seqpar.comm import collective_device
from seqpar.data import IGNORE_INDEX
from seqpar.runtime.memory import PeakMemory
from seqpar.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from seqpar.train.config import TrainConfig
from seqpar.train.data import FileRows, load_tokenizer
from seqpar.train.metrics import MetricsWriter, plot_metrics
from seqpar.train.model import build_model
from seqpar.train.passkey import DIGITS, PasskeyTask

__all__ = ["train_rank"]


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


def _answer_shift_labels(input_ids: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """Shifted labels that keep only the passkey digits: position p-1 predicts the digit at p."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    rows = torch.arange(input_ids.shape[0])[:, None]
    labels[rows, answers - 1] = input_ids[rows, answers]
    return labels


@torch.no_grad()
def _answer_loss(outputs: torch.Tensor, labels: torch.Tensor, total: int, head: torch.nn.Module | None) -> torch.Tensor:
    """This rank's share of the mean loss on the answer digits, from logits or (``head`` given) hidden states."""
    if head is None:
        return seqpar.cross_entropy(outputs, labels, num_valid_tokens=total)
    keep = labels != IGNORE_INDEX
    logits = head(outputs[keep]).float()  # [answer tokens here, V]: only these rows get logits
    return torch.nn.functional.cross_entropy(logits, labels[keep], reduction="sum") / max(total, 1)


class _Source:
    """Global training/eval batches: the passkey task or packed rows of data files."""

    def __init__(self, config: TrainConfig, tokenizer, cache_dir: str) -> None:
        self.config = config
        self.passkey = None if config.data else PasskeyTask(tokenizer, config.seed)
        self.rows = (
            FileRows(config.data, tokenizer, config.seq_len, config.text_field, config.seed, cache_dir)
            if config.data
            else None
        )

    def batch(self, indices: list[int]) -> tuple[dict, torch.Tensor | None]:
        if self.passkey is not None:
            ids, answers = self.passkey.batch(self.config.seq_len, indices)
            return {"input_ids": ids}, _answer_shift_labels(ids, answers)
        return self.rows.batch(indices), None


def train_rank(config: TrainConfig, run_dir: str) -> None:
    """Train on this rank (collective: every rank of the default group calls it with the same arguments)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    device = collective_device()
    mesh = seqpar.make_mesh(sp_size=config.sp, ulysses_size=config.ulysses, dp_size=config.dp, tp_size=config.tp)
    dp_rank = mesh.device_mesh.get_local_rank("dp")
    tokenizer = load_tokenizer(config.tokenizer_path())
    vocab = getattr(tokenizer, "vocab_size", None) or len(tokenizer)
    model = build_model(config, vocab).to(device)
    if config.tp > 1:
        seqpar.apply_tensor_parallel(model, mesh)
    seqpar.prepare_model(model, mesh, strategy=config.strategy)
    if rank == 0:
        heads = model.config.num_attention_heads // config.tp
        kv_heads = (getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads) // config.tp
        chosen = seqpar.resolve_strategy(config.strategy, heads, kv_heads, mesh) if mesh.sp_size > 1 else "local"
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = torch.bfloat16 if config.precision == "bf16" else torch.float32  # what autocast gives attention
        probe = torch.empty(1, heads, 2, head_dim, device=device, dtype=dtype)
        print(
            f"mesh: dp {config.dp} x sp {mesh.sp_size} (ring axis {mesh.ring_size} x ulysses axis "
            f"{mesh.ulysses_size}) x tp {config.tp}; "
            f"attention: {chosen} ({config.strategy}), kernel {seqpar.select_kernel(probe, probe, probe).name}, "
            f"{heads} heads / {kv_heads} KV heads per rank",
            flush=True,
        )
    # "replicate": every rank holds the parameters, gradients summed by one all-reduce after the backward
    forward = model if config.dp_mode == "replicate" else seqpar.apply_data_parallel(model, mesh, config.dp_mode)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay, eps=1e-8
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(config, s))
    source = _Source(config, tokenizer, os.path.join(run_dir, "data"))
    head = model.get_output_embeddings()
    # the loss and gradients are normalised and summed over dp x sp (tp ranks share their tokens)
    everyone = seqpar.data_parallel_group(mesh) if config.tp > 1 else dist.group.WORLD
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16) if config.precision == "bf16" else contextlib.nullcontext()
    )

    ckpt_dir = os.path.join(run_dir, "checkpoints")
    start = 0
    resume = latest_checkpoint(ckpt_dir) if config.resume == "auto" else config.resume
    if config.resume == "auto" and resume is None and rank == 0:
        print(f"no complete checkpoint in {ckpt_dir}; starting from step 0", flush=True)
    if resume is not None:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state, "scheduler": scheduler.state_dict()}
        start = load_checkpoint(resume, state)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if rank == 0:
            print(f"resumed from {resume} at step {start}", flush=True)

    writer = MetricsWriter(run_dir, start) if rank == 0 else None
    bar = None
    if rank == 0 and config.progress:
        import threading

        from tqdm import tqdm

        tqdm.set_lock(threading.RLock())  # tqdm's default multiprocessing lock would leak a semaphore at exit
        bar = tqdm(
            total=config.steps, initial=start, desc="seqpar train", unit="step", dynamic_ncols=True, disable=None
        )
    memory = PeakMemory(device)
    micro = config.batch_size // config.grad_accum
    end = config.stop_at or config.steps
    model.train()
    for step in range(start, end):
        memory.reset()
        began = time.perf_counter()
        first = (step * config.dp + dp_rank) * config.batch_size
        batches = [
            source.batch(list(range(first + m * micro, first + (m + 1) * micro))) for m in range(config.grad_accum)
        ]
        shards = [seqpar.shard_batch(b, mesh) for b, _ in batches]
        answers = [
            seqpar.shard_batch({**b, "shift_labels": a}, mesh)["shift_labels"] if a is not None else None
            for b, a in batches
        ]
        total = seqpar.count_valid_tokens([s["shift_labels"] for s in shards], everyone)
        answer_total = (
            seqpar.count_valid_tokens([a for a in answers if a is not None], everyone) if answers[0] is not None else 0
        )
        loss_sum = torch.zeros((), device=device)
        answer_sum = torch.zeros((), device=device)
        for shard, answer in zip(shards, answers):
            inputs = {"input_ids": shard["input_ids"].to(device), "position_ids": shard["position_ids"].to(device)}
            labels = shard["shift_labels"].to(device)
            with autocast:
                if config.loss_chunk:
                    hidden = model.get_decoder()(**inputs).last_hidden_state
                    loss = seqpar.lm_head_cross_entropy(
                        hidden, head, labels, chunk_size=config.loss_chunk, num_valid_tokens=total
                    )
                    outputs = hidden
                else:
                    outputs = forward(**inputs).logits
                    loss = seqpar.cross_entropy(outputs, labels, num_valid_tokens=total)
            if answer is not None:
                answer_sum += _answer_loss(
                    outputs.detach(), answer.to(device), answer_total, head if config.loss_chunk else None
                )
            del outputs
            loss.backward()
            loss_sum += loss.detach()
        if config.dp_mode == "replicate":
            seqpar.reduce_gradients(model.parameters(), everyone)
        grad_norm = seqpar.clip_grad_norm_(model.parameters(), config.grad_clip or float("inf"))
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - began
        stats = torch.tensor([memory.peak_mb(), seconds], dtype=torch.float64, device=device)
        gathered = [torch.empty_like(stats) for _ in range(world)]
        dist.all_gather(gathered, stats)
        sums = seqpar.sum_over(torch.stack([loss_sum, answer_sum]), everyone)
        if rank == 0:
            step_time = max(float(g[1]) for g in gathered)
            record = {
                "kind": "train",
                "step": step + 1,
                "loss": float(sums[0]),
                "lr": lr,
                "grad_norm": float(grad_norm),
                "tokens_per_s": config.batch_size * config.dp * config.seq_len / step_time,
                "step_s": step_time,
                "peak_memory_mb": [round(float(g[0]), 1) for g in gathered],
            }
            if answers[0] is not None:
                record["answer_loss"] = float(sums[1])
            writer.write(record)
            if bar is not None:
                bar.set_postfix(
                    loss=f"{record['loss']:.3f}",
                    tok_s=f"{record['tokens_per_s']:.0f}",
                    mem_mb="/".join(f"{m:.0f}" for m in record["peak_memory_mb"]),
                )
                bar.update(1)
            if (step + 1) % config.log_every == 0 or step + 1 == end:
                line = (
                    f"step {step + 1}/{config.steps} loss {record['loss']:.4f} lr {lr:.2e} "
                    f"grad_norm {record['grad_norm']:.3f} tokens/s {record['tokens_per_s']:.0f} "
                    f"peak MB/rank {record['peak_memory_mb']}"
                )
                (bar.write if bar is not None else print)(line)
        if (config.save_every and (step + 1) % config.save_every == 0) or step + 1 == end:
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optim_state, "scheduler": scheduler.state_dict()}
            path = save_checkpoint(ckpt_dir, step + 1, state)
            if rank == 0:
                (bar.write if bar is not None else print)(f"checkpoint: {path}")
    if bar is not None:
        bar.close()
    if end == config.steps and source.passkey is not None:
        _evaluate(config, model, mesh, source.passkey, device, autocast, writer, dp_rank)
    if writer is not None:
        writer.close()
        for path in plot_metrics(run_dir):
            print(f"plot: {path}", flush=True)


@torch.no_grad()
def _evaluate(config, model, mesh, task: PasskeyTask, device, autocast, writer, dp_rank) -> None:
    """Teacher-forced passkey accuracy on held-out examples at each evaluation length (Note [passkey task])."""
    model.eval()
    lengths = config.eval_lengths or [config.seq_len, 2 * config.seq_len]
    results = {}
    for length in lengths:
        correct = torch.zeros(2, dtype=torch.float64)  # documents with every digit right, digits right
        count = 0
        for first in range(dp_rank * config.eval_examples, (dp_rank + 1) * config.eval_examples, 4):
            indices = list(range(first, min(first + 4, (dp_rank + 1) * config.eval_examples)))
            ids, answers = task.batch(length, indices, split="eval")
            shard = seqpar.shard_batch({"input_ids": ids, "shift_labels": _answer_shift_labels(ids, answers)}, mesh)
            with autocast:
                logits = model(
                    input_ids=shard["input_ids"].to(device), position_ids=shard["position_ids"].to(device)
                ).logits
            labels = shard["shift_labels"].to(device)
            hits = ((logits.argmax(-1) == labels) & (labels != IGNORE_INDEX)).sum(-1).double()  # [B] digits right here
            hits = seqpar.sum_over(hits, mesh)  # digits right over the whole sequence
            correct += torch.stack([(hits == DIGITS).sum(), hits.sum()]).cpu()
            count += len(indices)
        correct = seqpar.sum_over(correct, dist.group.WORLD) / (mesh.sp_size * config.tp)  # each SP/TP rank counted
        results[length] = (float(correct[0]) / (count * config.dp), float(correct[1]) / (count * config.dp * DIGITS))
    if writer is not None:
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
    model.train()
