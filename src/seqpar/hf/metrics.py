"""``compute_metrics`` under sequence parallelism: whole-sequence logits and labels of every batch, in dataset order.

The Trainer mixin's evaluation hands them to ``preprocess_logits_for_metrics`` and ``compute_metrics`` as one process.

Note [metrics over shards]
    The one-process Trainer runs ``preprocess_logits_for_metrics(logits, labels)`` on each evaluation
    batch's whole ``[B, S, V]`` logits and the collator's (unshifted) labels, adds the results batch after
    batch to containers that pad every batch to the widest with -100, and calls ``compute_metrics`` once
    with the concatenation. Here each rank of a sequence-parallel group holds its shard of the logits: the
    group gathers them (``gather_sequence`` with the batch's layout), cuts the layout's padding off the end
    (the rows were padded to the layout on the right), and runs ``preprocess_logits_for_metrics`` on the whole
    sequence. After the last batch, the first rank of each group sends its replica's results to every rank
    (one object all-gather), and every rank puts them in the one process's order, batch ``j = k x dp +
    replica`` (Note [evaluation loss]), into the Trainer's own containers: the same padding, the same
    arrays, on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from seqpar.hf.batches import replica_of
from seqpar.mesh import SequenceParallelMesh
from seqpar.sequence_parallel.layouts.chunks import Layout, gather_sequence
from seqpar.sequence_parallel.prepare import LAYOUT_KEYWORD

Preprocess = Callable[[torch.Tensor, torch.Tensor], object]


class BatchPredictions:
    """Collects one replica's per-batch (predictions, labels) from sharded logits, as ``evaluation_loss``'s
    ``on_logits`` (Note [metrics over shards]).

    Attributes:
        batches: ``(predictions, labels)`` per real batch, in this replica's order, on the CPU.
    """

    def __init__(self, mesh: SequenceParallelMesh, layout: Layout, preprocess: Preprocess | None = None) -> None:
        self.mesh, self.layout, self.preprocess = mesh, layout, preprocess
        self.batches: list[tuple[object, object]] = []

    def __call__(self, logits: torch.Tensor, shard: Mapping, batch: Mapping) -> None:
        """Gather one batch's logits over the sequence-parallel group (collective) and keep its predictions.

        Args:
            logits: ``[B, S'/P, V]`` this rank's shard of the batch's logits.
            shard: the batch's ``SequenceShard`` (its own layout under "balanced").
            batch: the collator's output: ``input_ids`` ``[B, S]`` and, if any, ``labels``.
        """
        layout = shard.get(LAYOUT_KEYWORD) or self.layout
        width = batch["input_ids"].shape[1]
        with torch.no_grad():
            whole = gather_sequence(logits.contiguous(), self.mesh, dim=1, layout=layout)[:, :width]  # [B, S, V]
            labels = batch.get("labels")
            labels = labels.to(whole.device) if isinstance(labels, torch.Tensor) else None
            predictions = self.preprocess(whole, labels) if self.preprocess is not None else whole
        self.batches.append((_to_cpu(predictions), _to_cpu(labels)))


def _to_cpu(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (tuple, list)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def in_dataset_order(
    batches: list[tuple[object, object]], mesh: SequenceParallelMesh, group: dist.ProcessGroup | None, dp_size: int
) -> list[tuple[object, object]]:
    """Every replica's batches in the one-process order (collective over ``group``).

    Args:
        batches: this replica's ``BatchPredictions.batches``.
        mesh: the sequence-parallel mesh (its group's first rank sends the replica's batches).
        group: every rank of the job, or None for one process.
        dp_size: the number of data-parallel replicas.

    Returns:
        ``(predictions, labels)`` of every batch of the dataset, batch ``j = k x dp_size + replica`` at ``j``.
    """
    if group is None:
        return batches
    _, dp_rank = replica_of(mesh)
    first = mesh.sp_rank == 0
    gathered: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (dp_rank, batches if first else None), group=group)
    by_replica = {replica: sent for replica, sent in gathered if sent is not None}
    rounds = max((len(b) for b in by_replica.values()), default=0)
    return [by_replica[r][k] for k in range(rounds) for r in range(dp_size) if k < len(by_replica.get(r, ()))]


def metric_arrays(batches: list[tuple[object, object]], concatenate: bool = True) -> tuple[object, object]:
    """The predictions and labels ``compute_metrics`` receives, built as the one-process Trainer builds them.

    Args:
        batches: ``(predictions, labels)`` of every batch in dataset order (``in_dataset_order``).
        concatenate: ``TrainingArguments.eval_do_concat_batches``.

    Returns:
        ``(predictions, label_ids)``: numpy arrays (or lists of them), each batch padded to the widest with
        -100 by the Trainer's own ``EvalLoopContainer``; None where no batch had any.
    """
    from transformers.trainer_pt_utils import EvalLoopContainer

    predictions = EvalLoopContainer(concatenate, padding_index=-100)
    labels = EvalLoopContainer(concatenate, padding_index=-100)
    for batch_predictions, batch_labels in batches:
        predictions.add(batch_predictions)
        if batch_labels is not None:
            labels.add(batch_labels)
    return predictions.get_arrays(), labels.get_arrays()


def computed_metrics(
    compute_metrics: Callable[[object], dict], predictions: object, label_ids: object, prefix: str
) -> dict[str, object]:
    """``compute_metrics``' result as the Trainer reports it: plain numbers, keys prefixed with ``prefix_``.

    Args:
        compute_metrics: the Trainer's ``compute_metrics``.
        predictions: from ``metric_arrays``.
        label_ids: from ``metric_arrays``; None: no labels, no metrics (as the Trainer).
        prefix: ``metric_key_prefix`` ("eval", "test").

    Returns:
        The metrics, keys starting with ``prefix_``.
    """
    from transformers.trainer_utils import EvalPrediction, denumpify_detensorize

    if predictions is None or label_ids is None:
        return {}
    metrics = denumpify_detensorize(compute_metrics(EvalPrediction(predictions=predictions, label_ids=label_ids)))
    return {k if k.startswith(f"{prefix}_") else f"{prefix}_{k}": v for k, v in metrics.items()}
