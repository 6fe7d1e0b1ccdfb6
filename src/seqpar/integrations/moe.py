"""Mixture-of-experts router losses under sequence parallelism: the load-balancing loss of the whole batch.

``router_aux_loss``: transformers' ``load_balancing_loss_func`` (Mixtral, Qwen3-MoE, gpt-oss) split over ranks.

Note [exact router loss]
    transformers' load-balancing loss over the router logits of L layers and the T counted tokens of a batch
    (``attention_mask`` 1, or every token without a mask) is ``E x sum_e F_e x P_e`` with
    ``F_e = C_e / (L T)``, ``C_e`` the number of (layer, token) pairs whose top-k experts include e, and
    ``P_e = S_e / (L T)``, ``S_e`` the sum over layers and tokens of the router probability of e. Top-k
    selection carries no gradient, so F is a constant of the backward and the loss is linear in the
    probability sums: with the sums split over ranks, ``S_e = sum_r S_e^r``, rank r's share
    ``E x sum_e F_e x S_e^r / (L T)`` (F and T all-reduced over the ranks, detached) sums over the ranks to
    the whole batch's loss, and its gradients sum to the whole batch's gradient. One all-reduce of E + 1
    numbers per call. The ranks are every rank holding tokens of what one process sees as one batch: the
    sequence-parallel group for an own loop, dp x sp under the Trainer (one process's micro-batch holds
    every replica's rows). Tokens seqpar adds to fit the layout are not counted (``shard["token_mask"]``).

Note [router loss under the Trainer]
    A mixture-of-experts model with ``output_router_logits`` adds ``router_aux_loss_coef x`` its
    load-balancing loss to each micro-batch's loss in one process, over the micro-batch's tokens (every
    replica's rows: one process loads them all) that its attention mask counts; the Trainer does not
    divide it by the accumulation steps (the model takes ``num_items_in_batch``), so a step's loss is its
    token-mean cross-entropy plus the coefficient times the *sum* of its micro-batches' router losses (a
    model that takes no ``num_items_in_batch`` has its whole loss divided instead: Note [micro-batch means]).
    ``SequenceParallelMixin.compute_loss`` adds each rank's exact share over every process (Note [exact
    router loss]) to its cross-entropy share before the x W scaling: the wrapper's average sums both, and
    the logged loss is one process's. TRL's SFTTrainer divides each micro-batch's router loss by the
    accumulation steps instead (its loss is the steps' mean): ``SequenceParallelSFTTrainer`` does the same
    and logs TRL's ``aux_loss`` (the whole micro-batch's, summed over the ranks). Evaluation adds each
    batch's router loss to the batch's loss, as the model's forward does given labels (Note [evaluation loss]).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from seqpar.errors import SeqparInputError
from seqpar.loss import sum_over


@dataclass(frozen=True)
class RouterLossSettings:
    """What a mixture-of-experts model adds to its loss: ``coefficient x`` its load-balancing loss.

    Attributes:
        num_experts: experts per layer.
        top_k: experts each token is routed to.
        coefficient: the model's ``router_aux_loss_coef``.
    """

    num_experts: int
    top_k: int
    coefficient: float


def router_loss_settings(model: torch.nn.Module) -> RouterLossSettings | None:
    """What a transformers mixture-of-experts model adds to its loss when it outputs router logits.

    Args:
        model: a transformers causal LM (Mixtral, Qwen3-MoE, gpt-oss, ...), prepared or not.

    Returns:
        The settings when ``config.output_router_logits`` is on (the loss then adds ``coefficient x`` the
        load-balancing loss), else None.

    Raises:
        SeqparInputError: router logits are on, but the model does not say its experts, top-k or coefficient.
    """
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "output_router_logits", False):
        return None
    values = [getattr(model, name, None) for name in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")]
    if any(v is None for v in values):
        raise SeqparInputError(
            f"{type(model).__name__} outputs router logits but has no num_experts / num_experts_per_tok / "
            "router_aux_loss_coef: seqpar cannot tell its load-balancing loss"
        )
    return RouterLossSettings(int(values[0]), int(values[1]), float(values[2]))


def router_aux_loss(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    token_mask: torch.Tensor | None = None,
    group: object = None,
) -> torch.Tensor:
    """This rank's share of the load-balancing loss of the whole batch (Note [exact router loss]).

    Summed over ``group`` it equals transformers' ``load_balancing_loss_func`` on the unsharded batch,
    gradients included. Collective over ``group`` (one all-reduce); a batch with no counted token gives 0.

    Args:
        router_logits: the model output's ``router_logits``: one ``[tokens, num_experts]`` tensor per layer
            (this rank's ``B x S/P`` tokens, row-major as the shard).
        num_experts: experts per layer (``model.num_experts``).
        top_k: experts each token is routed to (``model.num_experts_per_tok``).
        token_mask: ``[B, S/P]`` tokens to count (``shard["token_mask"]`` of ``seqpar.shard_batch``: the
            batch's attention mask, without the layout's padding), or None for every token.
        group: the ranks whose tokens form one batch: a ProcessGroup (dp x sp under the Trainer), a mesh (its
            SP group), or None for one process.

    Returns:
        A float32 scalar: this rank's share (without the model's ``router_aux_loss_coef``).

    Raises:
        SeqparInputError: no router logits, logits that are not ``[tokens, num_experts]``, or a mask of another
            token count.
    """
    layers = list(router_logits or ())
    if not layers or any(t.dim() != 2 or t.shape[-1] != num_experts for t in layers):
        shapes = [tuple(t.shape) for t in layers]
        raise SeqparInputError(f"router_logits must be [tokens, {num_experts}] tensors, one per layer; got {shapes}")
    device = layers[0].device
    tokens = layers[0].shape[0]
    weight = torch.ones(tokens, device=device)
    if token_mask is not None:
        if token_mask.numel() != tokens:
            raise SeqparInputError(f"token_mask has {token_mask.numel()} tokens, the router logits {tokens}")
        weight = token_mask.reshape(-1).to(device=device, dtype=torch.float32)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_sums = torch.zeros(num_experts, dtype=torch.float32, device=device)
    for logits in layers:
        probs = torch.softmax(logits.to(device), dim=-1)  # in the logits' dtype, as transformers does
        chosen = torch.topk(probs, top_k, dim=-1).indices  # [tokens, top_k]
        counts = counts.scatter_add(0, chosen.reshape(-1), weight.repeat_interleave(top_k))
        prob_sums = prob_sums + (probs.float() * weight[:, None]).sum(dim=0)
    # [E + 1]: every rank's assignment counts and counted tokens (no gradient: top-k is piecewise constant)
    totals = sum_over(torch.cat([counts, weight.sum()[None]]), group)
    # L x T; with no counted token every count and probability sum is 0 and so is the share (no host sync)
    rows = (totals[-1] * len(layers)).clamp(min=1.0)
    return num_experts * (totals[:num_experts] / rows * prob_sums / rows).sum()


def model_router_loss(
    model: torch.nn.Module,
    outputs: object,
    token_mask: torch.Tensor | None = None,
    group: object = None,
    coefficient: float | None = None,
) -> torch.Tensor | float:
    """What one rank adds to its loss for a model's router: ``router_aux_loss_coef x`` its ``router_aux_loss`` share.

    Collective over ``group`` when the model outputs router logits (every rank must call it).

    Args:
        model: the (unwrapped) transformers model that produced ``outputs``.
        outputs: its forward's output (``router_logits`` read when ``config.output_router_logits`` is on).
        token_mask: as in ``router_aux_loss`` (``shard["token_mask"]``).
        group: as in ``router_aux_loss``.
        coefficient: the weight, if not the model's own ``router_aux_loss_coef`` (TRL's SFTTrainer weighs
            with ``SFTConfig.router_aux_loss_coef``).

    Returns:
        The weighted share, or 0.0 for a model without router logits (nothing to add).

    Raises:
        SeqparInputError: as ``router_loss_settings`` and ``router_aux_loss``.
    """
    settings = router_loss_settings(model)
    logits = getattr(outputs, "router_logits", None)
    if settings is None or logits is None:
        return 0.0
    share = router_aux_loss(logits, settings.num_experts, settings.top_k, token_mask, group)
    return (settings.coefficient if coefficient is None else coefficient) * share
