"""The evaluation half of the sequence-parallel Trainer mixin: one process's eval loss and metrics over shards.

``SequenceParallelMixin`` inherits it; it reads the mixin's ``sp_mesh``, ``dp_size``, ``sequence_parallel``.
"""

from __future__ import annotations

import torch
from transformers.trainer_utils import EvalLoopOutput

from seqpar.hf.evaluation import evaluation_loss
from seqpar.hf.loaders import shard_by_replica
from seqpar.hf.metrics import BatchPredictions, computed_metrics, in_dataset_order, metric_arrays

__all__ = ["EvaluationMixin"]


class EvaluationMixin:
    """Evaluation and prediction loops of ``SequenceParallelMixin`` (Note [evaluation loss], [metrics over shards])."""

    def get_eval_dataloader(self, eval_dataset=None):
        """The evaluation dataloader for this replica, without batches repeated to even out the replicas."""
        loader = super().get_eval_dataloader(eval_dataset)
        world = self.accelerator.num_processes
        return shard_by_replica(loader, self.dp_size, self.dp_rank, world_size=world, even_batches=False)

    def get_test_dataloader(self, test_dataset):
        """The prediction dataloader for this replica (``predict`` reports the loss only)."""
        loader = super().get_test_dataloader(test_dataset)
        world = self.accelerator.num_processes
        return shard_by_replica(loader, self.dp_size, self.dp_rank, world_size=world, even_batches=False)

    # ---- evaluation (Note [evaluation loss]) ----

    # (logits, shift_labels) -> sums over this rank's shard that evaluation adds up per batch; None: none
    eval_statistics = None

    def record_eval_statistics(self, per_batch: list[torch.Tensor]) -> None:
        """Receives ``eval_statistics``' sequence-group sums of each of this replica's evaluation batches."""

    def eval_router_weight(self) -> float | None:
        """The weight of each batch's router loss in its evaluation loss; None: the model's own coefficient."""
        return None

    def record_eval_router_losses(self, per_batch: list[float]) -> None:
        """Receives the router loss of each of this replica's evaluation batches (unweighted; 0.0: no router)."""

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ) -> EvalLoopOutput:
        """The evaluation loss of one process, computed on sharded sequences; with ``compute_metrics``, its
        metrics on the whole-sequence predictions of every replica (Note [metrics over shards])."""
        self.callback_handler.eval_dataloader = dataloader
        collected: list[torch.Tensor] = []
        router_losses: list[float] = []
        skip = self.args.prediction_loss_only if prediction_loss_only is None else prediction_loss_only
        wanted = self.compute_metrics is not None and not skip
        layout = self.sequence_parallel.layout
        predictions = BatchPredictions(self.sp_mesh, layout, self.preprocess_logits_for_metrics) if wanted else None

        def on_batch() -> None:
            self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)

        loss, count = evaluation_loss(
            self.model,
            dataloader,
            self.sp_mesh,
            group=self._world_group(),
            batch_size=self.args.eval_batch_size,
            layout=layout,
            autocast=self.accelerator.autocast,
            on_batch=on_batch,
            statistics=self.eval_statistics,
            collected=collected,
            label_smoothing=self.label_smoother.epsilon if self.label_smoother is not None else 0.0,
            on_logits=predictions,
            router_losses=router_losses,
            router_weight=self.eval_router_weight(),
        )
        if self.eval_statistics is not None:
            self.record_eval_statistics(collected)
        self.record_eval_router_losses(router_losses)
        metrics, preds, label_ids = {}, None, None
        if predictions is not None:
            batches = in_dataset_order(predictions.batches, self.sp_mesh, self._world_group(), self.dp_size)
            preds, label_ids = metric_arrays(batches, self.args.eval_do_concat_batches)
            metrics = computed_metrics(self.compute_metrics, preds, label_ids, metric_key_prefix)
        metrics[f"{metric_key_prefix}_loss"] = loss
        return EvalLoopOutput(predictions=preds, label_ids=label_ids, metrics=metrics, num_samples=count)
