"""TRL's ``DPOTrainer`` with the sequence split over ranks (needs ``trl``: ``pip install "seqpar[hf]"``).

The chosen and rejected rows of every pair, and the reference model's forward, run sequence-parallel.

Note [DPO over shards]
    ``DPOTrainer`` computes everything from the per-token fields of its fused LM head: per-sequence sums
    of the completion log-probabilities of the policy and of the reference, every ``loss_type`` (and
    ``ld_alpha``, WPO weighting, the f-divergences), and the metrics ``rewards/*``, ``logps/*``,
    ``logits/*``, ``entropy`` and ``mean_token_accuracy``. seqpar leaves that code as it is and changes
    what the model call returns: each rank runs the forward on its shard and the per-token fields are
    gathered back to the whole rows (Note [whole-width per-token outputs]); so the sums, the losses and
    the metrics are one process's. Every rank of a sequence-parallel group then holds the same loss,
    the replica's mean over its pairs. The gradient reaching each shard through the gather is ``sp``
    times one process's, and DDP's average over the ``dp x sp`` processes makes it the mean of the
    replicas' gradients: with every replica holding as many pairs, the gradient of the mean over all the
    pairs of the step, which one process training on ``dp x`` the batch computes (the trainer refuses a
    dataset that would leave the replicas uneven at an epoch's end). The Trainer divides by the
    accumulation steps as for TRL. TRL's metrics gather over every process, so each replica's rows come
    ``sp`` times: their means and ratios are unchanged; ``num_tokens`` is counted once per replica.
    The reference log-probabilities can be precomputed (``precompute_ref_log_probs``), sequence-parallel
    too, once seqpar has prepared the models; a PEFT model's reference is its base (adapters disabled).
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from transformers import Trainer
from trl import DPOTrainer

from seqpar.errors import SeqparInputError
from seqpar.hf.batches import shard_step
from seqpar.hf.config import SequenceParallelConfig
from seqpar.hf.loaders import replica_loader
from seqpar.hf.sharded_call import ShardedCalls, shift_completion_labels
from seqpar.hf.trainer import SequenceParallelMixin
from seqpar.parallel import parallelize
from seqpar.sequence_parallel.comm.collectives import collective_device

_PAIR_KEYS = ("completion_mask", "ref_chosen_logps", "ref_rejected_logps")


def check_dpo_arguments(args: object, model: object, compute_metrics: object, train_dataset: object) -> None:
    """Refuse ``DPOTrainer`` settings that seqpar cannot honour, with the reason for each (same on every rank).

    Args:
        args: the ``DPOConfig`` (or None).
        model: the model given to the trainer (a path is checked later, by the Trainer options).
        compute_metrics: the trainer's ``compute_metrics`` argument.
        train_dataset: the training dataset (its first row tells a vision dataset).

    Raises:
        SeqparInputError: vision datasets, ``compute_metrics``, the router loss, Liger kernels, activation
            offloading, NEFTune.
    """
    problems = []
    first = next(iter(train_dataset), None) if train_dataset is not None else None
    if isinstance(first, dict) and ("image" in first or "images" in first):
        problems.append("vision datasets (images): seqpar splits text token rows only")
    if compute_metrics is not None:
        problems.append(
            "compute_metrics: DPOTrainer builds whole-sequence logits for it with an extra forward that seqpar does "
            "not split; the DPO metrics (rewards/*, logps/*, logits/*) are logged without it"
        )
    config = getattr(getattr(model, "config", None), "get_text_config", lambda: None)()
    coef = getattr(args, "router_aux_loss_coef", None)
    coef = getattr(config, "router_aux_loss_coef", 0.0) if coef is None else coef
    if config is not None and hasattr(config, "output_router_logits") and coef:
        problems.append("the router loss of a mixture-of-experts model: set DPOConfig(router_aux_loss_coef=0.0)")
    if getattr(args, "use_liger_kernel", False):
        problems.append("use_liger_kernel has not been verified with seqpar's attention; leave it off")
    if getattr(args, "activation_offloading", False):
        problems.append("activation_offloading has not been verified with seqpar's attention; leave it off")
    if getattr(args, "neftune_noise_alpha", None):
        problems.append("neftune_noise_alpha: NEFTune is not implemented for the preference trainers")
    if problems:
        raise SeqparInputError("seqpar.hf cannot honour these DPOTrainer settings: " + " | ".join(problems))


def _check_even_replicas(dataset: object, batch: int, dp: int, drop_last: bool, what: str) -> None:
    if dp == 1 or drop_last or not hasattr(dataset, "__len__") or isinstance(dataset, dict):
        return
    rows = len(dataset)
    if rows % (batch * dp):
        raise SeqparInputError(
            f"the {what} dataset has {rows} pairs, not a multiple of {dp} data-parallel replicas x {batch} pairs: "
            "the replicas' last batches would hold different numbers of pairs, and DPO's per-pair mean could not be "
            "one process's; set dataloader_drop_last=True or give a multiple of the rows"
        )


class SequenceParallelDPOTrainer(SequenceParallelMixin, DPOTrainer):
    """``trl.DPOTrainer`` with sequence parallelism; the same constructor plus ``sequence_parallel=``.

    ``per_device_train_batch_size`` counts preference pairs per data-parallel replica: the ``sp_size`` ranks
    of a group share them, each holding a shard of every chosen and rejected row. The loss (every
    ``loss_type``), its gradient and TRL's metrics are one process's (Note [DPO over shards]); so are the
    precomputed reference log-probabilities and a PEFT model's reference (its adapters disabled).

    Raises:
        SeqparInputError: on every rank, for settings seqpar cannot honour (``check_dpo_arguments`` and the
            plain Trainer's), and, with several data-parallel replicas, datasets that leave them uneven.
    """

    loss_is_scaled_for_ga = False  # TRL's loss is a mean over the micro-batch's pairs: the Trainer divides it

    def __init__(self, *args, sequence_parallel: SequenceParallelConfig | None = None, **kwargs) -> None:
        # by name: the mixin reads the arguments from the keywords (DPOTrainer takes ref_model second)
        given = inspect.signature(DPOTrainer.__init__).bind(self, *args, **kwargs).arguments
        given.pop("self")
        check_dpo_arguments(
            given.get("args"), given.get("model"), given.get("compute_metrics"), given.get("train_dataset")
        )
        super().__init__(sequence_parallel=sequence_parallel, **given)
        config = self.sequence_parallel
        self.sharded_calls = ShardedCalls(self.sp_mesh, config.layout, config.seq_length)
        self.sharded_calls.install(self.model)
        if self.ref_model is not None:
            ref = self.accelerator.unwrap_model(self.ref_model)
            parallelize(ref, self.sp_mesh, options=config.parallelize_options())
            self.sharded_calls.install(ref)
        self.gather_function = self._gather_replicas  # evaluation losses: one copy per replica
        batch, drop_last = self.args.per_device_train_batch_size, self.args.dataloader_drop_last
        _check_even_replicas(self.train_dataset, batch, self.dp_size, drop_last, "training")
        evals = self.eval_dataset if isinstance(self.eval_dataset, dict) else {"eval": self.eval_dataset}
        for name, dataset in evals.items():
            _check_even_replicas(dataset, self.args.per_device_eval_batch_size, self.dp_size, drop_last, name)
        if self.precompute_ref_logps:  # deferred until the models were prepared (see _precompute_ref_logps)
            self.train_dataset = self._precompute_ref_logps(self.train_dataset, "train", self._precompute_batch())
            evals = {k: self._precompute_ref_logps(d, k, self._precompute_batch(True)) for k, d in evals.items()}
            if self.eval_dataset is not None:
                self.eval_dataset = evals if isinstance(self.eval_dataset, dict) else evals["eval"]

    def _precompute_batch(self, evaluation: bool = False) -> int:
        own = self.args.per_device_eval_batch_size if evaluation else self.args.per_device_train_batch_size
        return self.args.precompute_ref_batch_size or own

    # ---- data: whole pairs per replica; the model call shards them (Note [whole-width per-token outputs]) ----

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """The step's micro-batches as the collator made them (whole rows); the model call shards them."""
        return Trainer.get_batch_samples(self, epoch_iterator, num_batches, device)

    def check_batch(self, inputs: dict) -> None:
        """Check one micro-batch on every rank at once: bad rows, or a group whose ranks hold different rows.

        Raises:
            SeqparInputError: on every rank (collective: one all-gather of a few integers).
        """
        batch = {k: v for k, v in inputs.items() if k not in _PAIR_KEYS}
        ids, completion = inputs.get("input_ids"), inputs.get("completion_mask")
        if isinstance(ids, torch.Tensor) and isinstance(completion, torch.Tensor):
            batch["shift_labels"] = shift_completion_labels(ids, ids.masked_fill(completion == 0, -100))
        config = self.sequence_parallel
        shard_step([batch], self.sp_mesh, group=self._world_group(), layout=config.layout, seq_length=config.seq_length)

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """TRL's DPO loss and metrics, its model calls run on the shards (Note [DPO over shards]); collective."""
        self.check_batch(inputs)
        training = model.training and self.model.training
        if training and self.accelerator.num_processes > 1 and model is self.model and not self.is_fsdp_enabled:
            raise SeqparInputError(
                "the model is not wrapped in DDP/FSDP: gradients would not be summed over ranks; train through "
                "trainer.train() (which wraps it)"
            )
        tokens = self._total_train_tokens
        result = DPOTrainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
        if training:  # TRL counts every process's batch; each replica's comes sp times
            mine = torch.tensor([float(inputs["attention_mask"].sum())], dtype=torch.float64)
            group = self._world_group()
            if group is not None:
                mine = mine.to(collective_device(group))
                dist.all_reduce(mine, group=group)
            self._total_train_tokens = tokens + round(float(mine) / self.sp_mesh.sp_size)
            self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        return result

    def _gather_replicas(self, data):
        """Every replica's copy of ``data`` once, in replica order (the evaluation losses; collective)."""
        gathered = self.accelerator.gather(data)
        mesh = self.sp_mesh.device_mesh
        if self.sp_mesh.sp_size == 1 or mesh is None or not isinstance(gathered, torch.Tensor) or gathered.dim() == 0:
            return gathered
        per_rank = gathered.reshape(self.accelerator.num_processes, -1, *gathered.shape[1:])
        leaders = mesh.mesh.reshape(self.dp_size, -1)[:, 0].tolist()  # the first rank of each replica's group
        return per_rank[leaders].flatten(0, 1)

    def get_eval_dataloader(self, eval_dataset=None):
        """The evaluation dataloader of this replica; refuses a dataset that would leave the replicas uneven."""
        dataset = self.eval_dataset[eval_dataset] if isinstance(eval_dataset, str) else eval_dataset
        dataset = self.eval_dataset if dataset is None else dataset
        batch, drop_last = self.args.per_device_eval_batch_size, self.args.dataloader_drop_last
        _check_even_replicas(dataset, batch, self.dp_size, drop_last, "evaluation")
        return super().get_eval_dataloader(eval_dataset)

    def evaluation_loop(self, *args, **kwargs):
        """The Trainer's evaluation loop: DPO's loss per batch, its losses gathered once per replica."""
        return Trainer.evaluation_loop(self, *args, **kwargs)

    # ---- reference log-probabilities computed before training ----

    def _precompute_ref_logps(self, dataset, name: str, batch_size: int):
        """TRL's precomputed reference log-probabilities, computed sequence-parallel by every replica.

        Called by ``DPOTrainer.__init__`` before seqpar prepared the models: then it returns the dataset as it
        is and the constructor calls it again afterwards. Collective.
        """
        if getattr(self, "sharded_calls", None) is None or dataset is None:
            return dataset
        model = self.ref_model or self.model
        collate = self.data_collator
        loader = replica_loader(dataset, self.sp_mesh, batch_size=batch_size, collate_fn=collate, shuffle=False)
        rows = torch.zeros(2, len(dataset), dtype=torch.float64)
        leader = self.sp_mesh.sp_rank == 0
        for k, batch in enumerate(loader):  # every replica has as many batches (Note [epoch ends])
            self.check_batch(batch)  # bad rows raise on every rank, before the group's collectives
            if batch["input_ids"].shape[0] == 0:  # no rows left for this replica (its whole group skips alike)
                continue
            batch = self._prepare_inputs(batch)
            chosen, rejected = self.compute_ref_log_probs(model, batch)
            start = (k * self.dp_size + self.dp_rank) * batch_size
            if leader:
                rows[:, start : start + chosen.shape[0]] = torch.stack([chosen, rejected]).double().cpu()
        group = self._world_group()
        if group is not None:
            rows = rows.to(collective_device(group))
            dist.all_reduce(rows, group=group)
        chosen, rejected = rows.float().cpu().tolist()
        return dataset.add_column("ref_chosen_logps", chosen).add_column("ref_rejected_logps", rejected)
