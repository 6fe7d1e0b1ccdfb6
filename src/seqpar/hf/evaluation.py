"""The evaluation loss under sequence parallelism: the number the one-process Trainer reports, over sharded rows.

Note [evaluation loss]
    The one-process Trainer's ``eval_loss`` is the mean over batches of each batch's token-mean loss,
    each batch weighted by its number of examples (its loss is repeated ``eval_batch_size`` times and the
    last, partial batch is cut to the examples it holds). Here every data-parallel replica evaluates the
    batches ``j = k * dp + replica`` of the same sequential order, with the sequence split over its SP
    group: a batch's loss is the sum of the group's token losses over the group's valid-token count, its
    weight ``min(E, N - j * E)`` examples. Replicas may get one batch fewer than others; they run a
    forward on a tiny padding batch instead (weight 0), so that every rank makes the same collectives,
    which FSDP's parameter all-gathers and the per-batch input agreement need. A mixture-of-experts model
    with ``output_router_logits`` adds ``router_aux_loss_coef x`` each batch's load-balancing loss to the
    batch's loss, as its own forward does given labels: the loss of the batch's tokens over the group
    (Note [exact router loss]).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from seqpar.data import IGNORE_INDEX
from seqpar.hf.batches import model_inputs, padding_batch, replica_of, shard_step
from seqpar.integrations.moe import model_router_loss, router_loss_settings
from seqpar.loss import cross_entropy, sum_over
from seqpar.mesh import SequenceParallelMesh
from seqpar.sequence_parallel.comm.collectives import collective_device
from seqpar.sequence_parallel.layouts.chunks import Layout


def _max_over(value: int, group: dist.ProcessGroup | None) -> int:
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t)


def evaluation_loss(
    model: torch.nn.Module,
    dataloader: object,
    mesh: SequenceParallelMesh,
    *,
    group: dist.ProcessGroup | None,
    batch_size: int,
    layout: Layout = "zigzag",
    autocast: object = None,
    on_batch: object = None,
    statistics: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    collected: list[torch.Tensor] | None = None,
    label_smoothing: float = 0.0,
    on_logits: Callable[[torch.Tensor, Mapping, Mapping], None] | None = None,
    router_losses: list[float] | None = None,
    router_weight: float | None = None,
) -> tuple[float, int]:
    """The one-process Trainer's evaluation loss over a replica-sharded dataloader (Note [evaluation loss]).

    Collective over ``group``: every rank calls it with its own replica's dataloader.

    Args:
        model: the prepared model (not the DDP wrapper: no gradients flow here).
        dataloader: this replica's batches, in the shared sequential order, not topped up to equal counts.
        mesh: the sequence-parallel mesh.
        group: every rank of the job (None for one process).
        batch_size: the per-replica evaluation batch size ``E``.
        layout: the layout the prepared model was told ("balanced": each batch's own, passed to the model).
        autocast: a context-manager factory for mixed precision (e.g. ``accelerator.autocast``), or None.
        on_batch: called after every real batch (progress callbacks), or None.
        statistics: ``(logits, shift_labels) -> 1-D tensor`` of sums over this rank's shard, added up over the
            sequence-parallel group for every batch (in the loss's collective), or None.
        collected: receives, for each of this replica's real batches in order, its group sums of ``statistics``.
        label_smoothing: the loss's label smoothing (Note [label smoothing per token]), as the Trainer's.
        on_logits: called for each of this replica's real batches, in order, with this rank's logits shard, the
            shard and the collator's batch, on every rank of the sequence-parallel group (it may gather over
            it: Note [metrics over shards]), or None.
        router_losses: receives, for each of this replica's real batches in order, its load-balancing loss
            (unweighted; 0.0 for a model without router logits).
        router_weight: the weight of the router loss in each batch's loss, if not the model's own
            ``router_aux_loss_coef`` (TRL's SFTTrainer: its coefficient over the accumulation steps).

    Returns:
        ``(eval_loss, number of examples)``; the loss is NaN when no batch had a valid token.
    """
    total = len(dataloader.dataset)
    dp_size, dp_rank = replica_of(mesh)
    device = next(model.parameters()).device
    steps = _max_over(len(dataloader), group)
    batches = iter(dataloader)
    sums = torch.zeros(2, dtype=torch.float64)  # sum of weight x batch loss, sum of weights
    settings = router_loss_settings(model)
    if router_weight is None:
        router_weight = settings.coefficient if settings is not None else 0.0
    model.eval()
    for k in range(steps):
        batch = next(batches, None)
        weight = max(0, min(batch_size, total - (k * dp_size + dp_rank) * batch_size)) if batch is not None else 0
        real = batch if batch is not None else padding_batch(mesh, device)
        shard = shard_step([real], mesh, group=group, layout=layout).shards[0]
        # tensors to the device; the batch's own layout ("balanced") is not a tensor and stays as it is
        shard = {key: v.to(device) if isinstance(v, torch.Tensor) else v for key, v in shard.items()}
        with torch.no_grad(), autocast() if autocast is not None else torch.autocast(device.type, enabled=False):
            outputs = model(**model_inputs(shard))
            logits, labels = outputs.logits, shard["shift_labels"]
            loss_sum = cross_entropy(logits, labels, num_valid_tokens=1, label_smoothing=label_smoothing).double()
            router = model_router_loss(model, outputs, shard.get("token_mask"), mesh, coefficient=1.0)
            router = torch.as_tensor(router).double()
            extra = statistics(logits, shard["shift_labels"]) if statistics is not None else torch.zeros(0)
        count = (shard["shift_labels"] != IGNORE_INDEX).sum().double()
        own = torch.stack([loss_sum, count, router.to(loss_sum.device)])
        sums_of_group = sum_over(torch.cat([own, extra.double().to(loss_sum.device)]), mesh)
        group_sum, group_count, group_router = sums_of_group[:3].tolist()
        if batch is not None and collected is not None:
            collected.append(sums_of_group[3:].cpu())
        if batch is not None and router_losses is not None:
            router_losses.append(group_router)
        if weight and group_count:
            batch_loss = group_sum / group_count + router_weight * group_router
            sums += torch.tensor([weight * batch_loss, weight], dtype=torch.float64)
        if batch is not None and on_logits is not None:
            on_logits(logits, shard, batch)
        if batch is not None and on_batch is not None:
            on_batch()
    # every rank of an SP group holds the same sums: the ratio over the whole job is unchanged by that
    if group is not None:
        sums = sum_over(sums, group)
    return (float(sums[0] / sums[1]) if sums[1] > 0 else float("nan")), total
