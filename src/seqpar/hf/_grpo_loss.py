"""GRPO's clipped policy loss, KL term and metrics over sequence shards, with each loss type's normalisation.

Used by ``SequenceParallelGRPOTrainer.compute_loss`` in ``seqpar.hf.grpo`` (Note [GRPO over shards]).

Note [GRPO over shards]
    TRL's GRPO loss is built from per-token terms (importance ratio, clipping, KL to the reference) and then
    normalised per loss type: per sequence ("grpo", "sapo": the mean over rows of each row's token mean;
    "luspo": the mean of row sums), per micro-batch ("bnpo": the micro-batch's tokens; "dr_grpo": rows x
    ``max_completion_length``) or over the whole generation batch of every process ("dapo", "cispo", "vespo":
    ``num_items_in_batch`` over the processes). Each rank holds the completion tokens its shard predicts. The
    per-token terms are computed there; the denominators are whole-row or whole-batch token counts, which every
    rank of the group knows from the completion mask (the same on every rank), so no collective is needed for
    them; the rank returns its share (its tokens' sum over the denominator) and the shares of a group add up to
    the loss one process computes on the group's rows. Sequence-level quantities (the "sequence" importance
    ratio, VESPO's gamma weights, the off-policy mask) need the whole row: its per-row sums are added up over
    the group, through an all-reduce whose backward is an all-reduce (``sum_rows``), so the gradient reaches
    every shard's tokens. TRL's process is the group here (Note [one process per group]): its normalisers use
    the replica count, and the loss is multiplied by ``sp_size`` because DDP averages gradients over every
    rank, not over the replicas. Metrics: token means are sums and counts over every rank (the shards
    partition the tokens of all replicas); per-row means are summed over the group, then gathered over the
    replicas; per-row values ``[B, 1]`` are counted once per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from seqpar.sequence_parallel.comm.collectives import all_gather_first_dim, collective_device


@dataclass(frozen=True)
class ShardGroups:
    """The groups a GRPO loss reduces over (None: a single rank)."""

    sp: dist.ProcessGroup | None
    sp_size: int
    sp_rank: int
    dp: dist.ProcessGroup | None
    dp_size: int
    world: dist.ProcessGroup | None


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is None:
        return x
    home = x.device
    x = x.to(collective_device(group))
    dist.all_reduce(x, group=group)
    return x.to(home)


class _SumRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # each rank's loss used the group's sum: a shard's gradient is the sum of every rank's upstream gradient
        return _all_reduce(grad.contiguous().clone(), ctx.group), None


def sum_rows(x: torch.Tensor, groups: ShardGroups) -> torch.Tensor:
    """Per-row partial sums added up over the SP group (differentiable: the backward is an all-reduce too).

    Args:
        x: ``[B, ...]`` this rank's partial sums.
        groups: the loss's groups.

    Returns:
        The sums over the group, the same on every rank.
    """
    return x if groups.sp is None else _SumRows.apply(x, groups.sp)


def _per_token_loss(t, coef_1, log_ratio, logps, adv, mask, groups):
    """TRL's per-token policy term for ``t.loss_type``; also the ratio its metrics read and VESPO's weights."""
    kind, phi = t.loss_type, None
    if kind == "cispo":
        return -torch.clamp(coef_1, max=t.epsilon_high).detach() * adv * logps, coef_1, phi
    if kind in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        coef_2 = torch.clamp(coef_1, 1 - t.epsilon_low, 1 + t.epsilon_high)
        if t.args.delta is not None:  # two-sided clipping; TRL's clip metrics read this ratio
            coef_1 = torch.clamp(coef_1, max=t.args.delta)
        return -torch.min(coef_1 * adv, coef_2 * adv), coef_1, phi
    if kind == "sapo":
        temps = torch.where(adv > 0, t.args.sapo_temperature_pos, t.args.sapo_temperature_neg)
        return -(torch.sigmoid(temps * (coef_1 - 1)) * 4 / temps) * adv, coef_1, phi
    if kind == "vespo":
        # the row's summed (clamped) log-ratio, then TRL's own weights of it (clamping a sum again is a no-op)
        row = sum_rows((torch.clamp(log_ratio.detach(), -20.0, 20.0) * mask).sum(-1, keepdim=True), groups)
        phi = type(t).get_gamma_weights(
            adv, row, torch.ones_like(row), None, t.args.vespo_k_pos, t.args.vespo_lambda_pos,
            t.args.vespo_k_neg, t.args.vespo_lambda_neg,
        )  # fmt: skip
        return -phi * adv * logps, coef_1, phi
    raise ValueError(f"Unknown loss type: {kind}")


def _normalise(t, per_token_loss, mask, row_tokens, num_items, groups, training: bool):
    """This rank's share of TRL's loss for the micro-batch (before DDP's scaling), and the share before GA."""
    accumulation = t.current_gradient_accumulation_steps if training else 1.0
    total, rows = per_token_loss * mask, mask.shape[0]
    if t.loss_type in ("grpo", "sapo"):
        loss = (total.sum(-1) / row_tokens.clamp(min=1.0)).sum() / rows
    elif t.loss_type == "bnpo":
        loss = total.sum() / row_tokens.sum().clamp(min=1.0)
    elif t.loss_type == "dr_grpo":
        loss = total.sum() / (rows * t.max_completion_length)
    elif t.loss_type in ("cispo", "dapo", "vespo"):
        normaliser = num_items.clamp(min=1.0) / groups.dp_size  # TRL's processes are the replicas
        if training:
            normaliser = normaliser * accumulation / t.args.steps_per_generation
        loss = total.sum() / normaliser
        return loss, loss.detach()
    else:  # luspo
        loss = total.sum(-1).sum() / rows
    return loss / accumulation, loss.detach()


def policy_loss(t, tensors: dict, groups: ShardGroups, training: bool) -> tuple[torch.Tensor, dict]:
    """This rank's share of TRL's GRPO loss for one micro-batch (Note [GRPO over shards]).

    Args:
        t: the trainer (its loss settings: ``loss_type``, ``beta``, ``epsilon_*``, ``args`` ...).
        tensors: the shard's ``logps``, ``old``, ``ref`` (or None), ``mask`` ``[B, L]``; ``adv`` ``[B, 1]`` or
            ``[B, L]``; ``row_tokens`` ``[B]`` (every row's scored tokens) and ``num_items`` (the generation
            batch's scored tokens over every replica).
        groups: the groups to reduce over.
        training: whether the Trainer is training (accumulation applies) or evaluating.

    Returns:
        ``(loss, parts)``: the share (summed over the group: the micro-batch's loss as TRL computes it,
        accumulation included) and the per-token tensors the metrics read.
    """
    logps, mask, adv, row_tokens = tensors["logps"], tensors["mask"], tensors["adv"], tensors["row_tokens"]
    old = tensors["old"] if tensors.get("old") is not None else logps.detach()
    log_ratio = logps - old
    if t.importance_sampling_level == "sequence":
        weights = sum_rows((log_ratio * mask).sum(-1), groups) / row_tokens.clamp(min=1.0)
        weights = weights.unsqueeze(-1)
    else:
        weights = log_ratio
    coef_1 = torch.exp(weights)
    if t.off_policy_mask_threshold is not None:  # TRL's: keep a row with A >= 0 or a small mean KL to old
        kl = torch.nan_to_num(old - logps.detach(), nan=0.0)
        mean_kl = sum_rows((kl * mask).sum(-1, keepdim=True), groups) / row_tokens.unsqueeze(-1).clamp(min=1.0)
        keep = ((adv >= 0) | (mean_kl <= t.off_policy_mask_threshold)).to(mask.dtype)
    per_token_kl = None
    if t.beta != 0.0:
        diff = tensors["ref"] - logps
        per_token_kl = torch.exp(diff) - diff - 1
        if t.args.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
    per_token, coef_1, phi = _per_token_loss(t, coef_1, log_ratio, logps, adv, mask, groups)
    if t.off_policy_mask_threshold is not None:
        per_token = per_token * keep
    if tensors.get("entropy_mask") is not None:
        per_token = per_token * tensors["entropy_mask"]
    if per_token_kl is not None:
        per_token = per_token + t.beta * per_token_kl
    loss, _ = _normalise(t, per_token, mask, row_tokens, tensors["num_items"], groups, training)
    return loss, {"kl": per_token_kl, "coef_1": coef_1, "phi": phi}


def _token_mean(x: torch.Tensor, mask: torch.Tensor, groups: ShardGroups) -> float:
    """TRL's global masked mean over every rank's shard (a ``[B, 1]`` per-row value counts once per group)."""
    if x.shape[1] == 1:
        mine = groups.sp_rank == 0
        sums = torch.stack([x.sum() * mine, torch.tensor(float(x.shape[0] * mine), device=x.device)])
    else:
        sums = torch.stack([(x * mask).sum(), mask.sum().float()])
    sums = _all_reduce(sums.detach().double(), groups.world)
    return float(sums[0] / sums[1].clamp(min=1.0))


def _row_means(x: torch.Tensor, mask: torch.Tensor, row_tokens: torch.Tensor, groups: ShardGroups) -> torch.Tensor:
    """Every replica's per-row means of ``x`` (TRL's ``masked_seq_mean`` gathered over its processes)."""
    if x.shape[1] == 1:
        rows = x.squeeze(1).detach()
    else:
        rows = _all_reduce((x * mask).sum(-1).detach(), groups.sp) / row_tokens
    if groups.dp is None:
        return rows
    home = rows.device
    return all_gather_first_dim(rows.contiguous().to(collective_device(groups.dp)), groups.dp).to(home)


def record_metrics(t, mode: str, parts: dict, tensors: dict, groups: ShardGroups) -> None:
    """TRL's per-micro-batch loss metrics (``kl``, ``entropy``, ``clip_ratio/*`` ...) over every shard (collective).

    Args:
        t: the trainer (its ``_metrics``, ``loss_type``, ``epsilon_*``).
        mode: "train" or "eval".
        parts: the per-token tensors of ``policy_loss``.
        tensors: the shard's tensors given to ``policy_loss`` plus ``entropies``.
        groups: the groups to reduce over.
    """
    from trl.trainer.utils import nanmax, nanmin

    mask, adv, coef_1, metrics = tensors["mask"], tensors["adv"], parts["coef_1"], t._metrics[mode]
    if parts["kl"] is not None:
        metrics["kl"].append(_token_mean(parts["kl"], mask, groups))
    metrics["entropy"].append(_token_mean(tensors["entropies"], mask, groups))
    if t.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        low = ((coef_1 < 1 - t.epsilon_low) & (adv < 0)).float()
        high = ((coef_1 > 1 + t.epsilon_high) & (adv > 0)).float()
        metrics["clip_ratio/low_mean"].append(_token_mean(low, mask, groups))
        metrics["clip_ratio/high_mean"].append(_token_mean(high, mask, groups))
        metrics["clip_ratio/region_mean"].append(_token_mean(torch.maximum(low, high), mask, groups))
        metrics["clip_ratio/low_min"].append(nanmin(_row_means(low, mask, tensors["row_tokens"], groups)).item())
        metrics["clip_ratio/high_max"].append(nanmax(_row_means(high, mask, tensors["row_tokens"], groups)).item())
    elif t.loss_type == "cispo":
        clipped = ((coef_1 > t.epsilon_high) & (adv > 0)).float()
        metrics["cispo_clip_ratio"].append(_token_mean(clipped, mask, groups))
    elif t.loss_type == "vespo":
        metrics["vespo/phi_seq_mean"].append(_token_mean(parts["phi"], mask, groups))
