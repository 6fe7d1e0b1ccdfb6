"""One optimizer step of the trainer: micro-batches, exact loss, backward, gradient sum, clipping, update.

Every rank runs the same collectives in the same order: the valid-token counts, the attention and data-parallel
traffic of each micro-batch's forward and backward, the gradient all-reduce (replicate mode) and the global
gradient norm. Nothing here depends on the rank except which slice of the global batch it reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import seqpar
from seqpar.data import IGNORE_INDEX, BatchShard
from seqpar.integrations.moe import model_router_loss
from seqpar.sequence_parallel.call_checks import WIDTH_KEYWORD
from seqpar.sequence_parallel.layouts.chunks import PER_BATCH_LAYOUTS
from seqpar.sequence_parallel.prepare import LAYOUT_KEYWORD
from seqpar.train.pipeline import pipeline_gradients
from seqpar.train.state import RunState


@dataclass
class StepResult:
    """What one optimizer step leaves for logging."""

    loss_sum: torch.Tensor
    """This rank's share of the step's mean loss (the shares of the loss group sum to the loss)."""
    answer_sum: torch.Tensor
    """This rank's share of the mean loss on the scored passkey answers (0 for data files)."""
    has_answers: bool
    """Whether the batches carried passkey answers."""
    grad_norm: torch.Tensor
    """Global gradient norm before clipping."""
    lr: float
    """The learning rate this step used."""
    layouts: tuple[str, ...] = ()
    """Under a per-batch layout: the layout each of this rank's micro-batches was cut with ("placed" where
    "auto" placed it, Note [placed layout]); empty under a fixed one."""


@torch.no_grad()
def _answer_loss(outputs: torch.Tensor, labels: torch.Tensor, total: int, head: torch.nn.Module | None) -> torch.Tensor:
    """This rank's share of the mean loss on the answers, from logits or (``head`` given) hidden states."""
    if head is None:
        return seqpar.cross_entropy(outputs, labels, num_valid_tokens=total)
    keep = labels != IGNORE_INDEX
    logits = head(outputs[keep]).float()  # [answer tokens here, V]: only these rows get logits
    return torch.nn.functional.cross_entropy(logits, labels[keep], reduction="sum") / max(total, 1)


def _micro_batches(run: RunState, step: int) -> tuple[list[BatchShard], list[torch.Tensor | None]]:
    """This rank's shards of the step's micro-batches, and of their passkey answer labels (None for data files)."""
    config = run.config
    micro = config.batch_size // config.grad_accum
    # each dp replica reads its own batch_size examples of the step; the sp ranks of a replica read the same ones
    first = (step * config.dp + run.dp_rank) * config.batch_size
    batches = [
        run.source.batch(list(range(first + m * micro, first + (m + 1) * micro))) for m in range(config.grad_accum)
    ]
    shards = [seqpar.shard_batch(b, run.mesh, layout=config.layout) for b, _ in batches]
    # the answers follow their batch's tokens: the layout each shard was cut with ("balanced": its own); a placed
    # shard's layout cuts the reordered row, so its answers are placed again (the same solve: the same ids)
    answers = [
        seqpar.shard_batch(
            {**b, "shift_labels": a}, run.mesh, layout="placed" if shard.placement is not None else shard.layout
        )["shift_labels"]
        if a is not None
        else None
        for (b, a), shard in zip(batches, shards)
    ]
    return shards, answers


def shard_inputs(run: RunState, shard: BatchShard) -> dict:
    """The prepared model's keyword arguments for one shard, on the run's device.

    Args:
        run: the run's state (its device and settings).
        shard: a ``seqpar.shard_batch`` result.

    Returns:
        ``input_ids`` and ``position_ids``, under --layout balanced the batch's own layout as ``seqpar_layout``, and
        where the layout padded the rows their width before it as ``seqpar_width``.
    """
    inputs = {"input_ids": shard["input_ids"].to(run.device), "position_ids": shard["position_ids"].to(run.device)}
    if run.config.layout in PER_BATCH_LAYOUTS:
        inputs[LAYOUT_KEYWORD] = shard.layout
    if shard.width is not None:
        inputs[WIDTH_KEYWORD] = shard.width
    return inputs


def _forward_loss(run: RunState, shard: BatchShard, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward one micro-batch shard; returns its loss share and its outputs (logits, or hidden states when chunked).

    A mixture-of-experts model with ``output_router_logits`` adds its router loss share over the loss group, as
    its own forward adds ``router_aux_loss_coef x`` the micro-batch's load-balancing loss (Note [exact router loss]).
    """
    config = run.config
    inputs = shard_inputs(run, shard)
    labels = shard["shift_labels"].to(run.device)
    token_mask = shard["token_mask"]  # read (and moved to the logits' device) only for a model with a router
    with run.autocast:
        if config.loss_chunk:
            # the output projection runs inside the loss, a chunk of tokens at a time
            out = run.model.get_decoder()(**inputs)
            loss = seqpar.lm_head_cross_entropy(
                out.last_hidden_state, run.head, labels, chunk_size=config.loss_chunk, num_valid_tokens=total
            )
            return loss + model_router_loss(run.model, out, token_mask, run.loss_group), out.last_hidden_state
        out = run.forward(**inputs)
        loss = seqpar.cross_entropy(out.logits, labels, num_valid_tokens=total)
        return loss + model_router_loss(run.model, out, token_mask, run.loss_group), out.logits


def optimizer_step(run: RunState, step: int) -> StepResult:
    """Accumulate the gradients of the step's micro-batches, sum them over ranks, clip and update (collective).

    The loss of every micro-batch is divided by the valid tokens of the whole step over the loss group, so the
    summed gradients are those of the step's mean token loss.

    Args:
        run: the run's state; its model, optimizer and schedule advance by one step.
        step: the 0-based optimizer step (selects the examples).

    Returns:
        The loss shares, gradient norm and learning rate of the step.
    """
    config = run.config
    shards, answers = _micro_batches(run, step)
    has_answers = answers[0] is not None and run.pipeline is None  # Note [pipeline in seqpar train]
    total = seqpar.count_valid_tokens([s["shift_labels"] for s in shards], run.loss_group)
    answer_total = (
        seqpar.count_valid_tokens([a for a in answers if a is not None], run.loss_group) if has_answers else 0
    )
    if run.pipeline is not None:
        loss_sum = pipeline_gradients(run, shards, total)
        grad_norm = run.pipeline.clip_grad_norm_(config.grad_clip or float("inf"))
        return _update(run, StepResult(loss_sum, torch.zeros_like(loss_sum), False, grad_norm, 0.0))
    loss_sum = torch.zeros((), device=run.device)
    answer_sum = torch.zeros((), device=run.device)
    for shard, answer in zip(shards, answers):
        loss, outputs = _forward_loss(run, shard, total)
        if answer is not None:
            answer_sum += _answer_loss(
                outputs.detach(), answer.to(run.device), answer_total, run.head if config.loss_chunk else None
            )
        del outputs  # no logits of this micro-batch stay alive into the next one's forward
        loss.backward()
        loss_sum += loss.detach()
    if config.dp_mode == "replicate":
        seqpar.reduce_gradients(run.model.parameters(), run.loss_group)
    grad_norm = seqpar.clip_grad_norm_(run.model.parameters(), config.grad_clip or float("inf"))
    layouts = tuple(s.layout.name for s in shards) if config.layout in PER_BATCH_LAYOUTS else ()
    return _update(run, StepResult(loss_sum, answer_sum, has_answers, grad_norm, 0.0, layouts))


def _update(run: RunState, result: StepResult) -> StepResult:
    """The optimizer and schedule step after the gradients are summed and clipped; ``result`` with its lr."""
    result.lr = run.scheduler.get_last_lr()[0]
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return result
