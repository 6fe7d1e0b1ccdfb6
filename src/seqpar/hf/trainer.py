"""``transformers.Trainer`` with the sequence split over ranks: a mixin (training and evaluation over shards)
and the ready-made Trainer subclass.

Launch with ``torchrun`` or ``accelerate launch``; the world is dp x sp and the Trainer's DDP/FSDP2 wrap it.

Note [exact loss under the Trainer]
    The Trainer wraps the model in DDP over *every* process (or the model arrives FSDP2-sharded over every
    process: Note [FSDP2 under the Trainer]; or DeepSpeed's ZeRO engine holds it: Note [DeepSpeed under the
    Trainer]), and that wrapper averages gradients over all dp x sp of them. Each rank's loss is ``(sum of its
    token losses) / N x W``: N is the number of valid tokens of the whole optimizer step (every replica, every
    micro-batch: Note [one exchange per step]) and W the number of processes the wrapper averages over. The
    wrapper's average of W-scaled gradients is their sum, which is the exact gradient of the step's token-mean
    loss (Note [summed gradients]); under gradient accumulation each micro-batch adds its exact share, with or
    without ``no_sync``. The loss is already normalised for the whole step, so the Trainer must not divide it
    by the accumulation steps again (``loss_is_scaled_for_ga = True``). The Trainer logs the mean over
    processes of the summed micro-batch losses, i.e. their sum over processes / W: the step's token-mean loss,
    as one process computes it.

Note [micro-batch means]
    A model that takes no ``num_items_in_batch`` (``accepts_loss_kwargs = False``: Qwen2.5-VL, Qwen3-VL, GLM-4V ...;
    or a forward without ``**kwargs``) is trained differently by one process's Trainer: it computes each
    micro-batch's own token-mean loss and divides it by the step's micro-batches, so a step's loss is the mean of
    its micro-batches' means, not the token mean of the step (the two differ as soon as the micro-batches hold
    different numbers of valid tokens). The mixin reads that from the Trainer (``model_accepts_loss_kwargs`` as the
    Trainer set it for the model) before it overrides it, and then normalises each micro-batch by its own valid
    tokens over every rank (every replica's rows of that micro-batch: one process loads them all as one micro-batch,
    Note [epoch ends]), counted in the step's one exchange (``shard_step(..., per_micro_batch=True)``), and divides
    by the step's micro-batches, its router loss included, as one process divides the model's whole loss. With one
    micro-batch a step the two rules give the same number.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from transformers import DataCollatorWithFlattening, Trainer
from transformers.trainer_utils import EvalLoopOutput

from seqpar.errors import SeqparInputError
from seqpar.hf.batches import SequenceShard, StepShards, model_inputs, replica_of, shard_step
from seqpar.hf.config import (
    SequenceParallelConfig,
    check_data_parallel_engine,
    check_deepspeed,
    check_neftune,
    check_trainer_options,
    check_training_arguments,
)
from seqpar.hf.evaluation import evaluation_loss
from seqpar.hf.loaders import shard_by_replica
from seqpar.hf.metrics import BatchPredictions, computed_metrics, in_dataset_order, metric_arrays
from seqpar.hf.neftune import noisy_embeddings
from seqpar.hf.parallelism import hidden_parallelism_environment, parallelism_from_environment, plan_parallelism
from seqpar.integrations.moe import model_router_loss
from seqpar.loss import cross_entropy
from seqpar.mesh import SequenceParallelMesh, as_sp_mesh
from seqpar.parallel import parallelize
from seqpar.sequence_parallel.call_checks import WIDTH_KEYWORD
from seqpar.sequence_parallel.prepare import LAYOUT_KEYWORD

_log = logging.getLogger("seqpar")

MICRO_BATCH_TOKENS = "seqpar_micro_batch_tokens"
"""Key of a training ``SequenceShard``: its micro-batch's valid tokens over every rank, the normaliser of its loss
for a model that takes no ``num_items_in_batch`` (Note [micro-batch means])."""


def build_mesh(config: SequenceParallelConfig) -> SequenceParallelMesh:
    """The mesh for ``config`` over the initialised default group (or a one-process mesh).

    Collective when a process group is initialised (it builds a DeviceMesh): call it on every rank.

    Args:
        config: the sequence-parallel settings (``sp_size`` None: every rank shares each sequence).

    Returns:
        A ``SequenceParallelMesh`` with axes ("dp", "ring", "ulysses"); dp = world size / ``sp_size``.

    Raises:
        SeqparInputError: ``sp_size > 1`` without a process group; a world size that ``sp_size`` does not divide.
    """
    if not dist.is_available() or not dist.is_initialized():
        if (config.sp_size or 1) > 1:
            raise SeqparInputError(
                f"sp_size={config.sp_size} needs several processes: launch with torchrun or accelerate launch"
            )
        return as_sp_mesh(None)
    return config.dims(dist.get_world_size()).build_mesh()


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


class SequenceParallelMixin(EvaluationMixin):
    """Adds sequence parallelism to a ``transformers.Trainer`` subclass: put it first among the bases.

    The constructor takes the Trainer's arguments plus ``sequence_parallel=SequenceParallelConfig(...)``.
    ``per_device_train_batch_size`` (and ``per_device_eval_batch_size``) count sequences per *data-parallel
    replica*: the ``sp_size`` ranks of a group load the same rows and each keeps a shard of their tokens.
    The logged loss and gradient norm, the gradients and the evaluation loss are those of one process
    training on the whole batch (Note [exact loss under the Trainer], Note [evaluation loss]). Data
    parallel is the Trainer's DDP, or FSDP2 for a model loaded with ``from_pretrained(...,
    distributed_config=DistributedConfig(fsdp_size=world))`` (Note [FSDP2 under the Trainer]).

    Raises:
        SeqparInputError: on every rank, for settings and batches seqpar cannot serve (see
            ``check_training_arguments``, ``check_trainer_options``, ``shard_step``).
    """

    loss_is_scaled_for_ga = True  # compute_loss normalises over the whole step (Note [exact loss under the Trainer])

    def __init__(self, *args, sequence_parallel: SequenceParallelConfig | None = None, **kwargs) -> None:
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        check_training_arguments(training_args)
        # accelerate's degrees, from the arguments or from what `accelerate launch` exported for a YAML's
        # parallelism_config section (Note [accelerate's ParallelismConfig])
        parallelism_config = getattr(training_args, "parallelism_config", None) or parallelism_from_environment()
        super().__init__(*args, **kwargs)
        self.parallelism_plan = plan_parallelism(sequence_parallel, parallelism_config, self.accelerator.num_processes)
        config = self.parallelism_plan.sequence_parallel
        check_deepspeed(self)  # ZeRO 1-3 average over every process, as DDP does (Note [DeepSpeed under the Trainer])
        fsdp_plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        if fsdp_plugin is not None and getattr(fsdp_plugin, "fsdp_version", 1) != 2:
            raise SeqparInputError("FSDP version 1 (from the accelerate config) is not supported; use fsdp_version 2")
        check_data_parallel_engine(self, self.accelerator.num_processes)
        sharded = self.is_fsdp_enabled or getattr(self.model, "is_distributed_loading_by_transformers", False)
        if self.parallelism_plan.dp_shard_size > 1 and not sharded:
            _log.warning(
                "parallelism_config.dp_shard_size=%d: FSDP2 is not enabled for this launch (accelerate applies its "
                "FSDP plugin on GPUs with distributed_type: FSDP), replicas keep whole parameters under DDP: the "
                "same numbers, more memory",
                self.parallelism_plan.dp_shard_size,
            )
        check_trainer_options(self)
        collator = self.data_collator
        if isinstance(collator, DataCollatorWithFlattening) and (
            not collator.return_position_ids or getattr(collator, "position_ids_start", 0) != 0
        ):
            raise SeqparInputError(
                "DataCollatorWithFlattening packs documents; seqpar finds their boundaries from position ids that "
                "restart at 0: pass return_position_ids=True (and keep position_ids_start=0)"
            )
        self.sequence_parallel = config
        # Note [micro-batch means]: what the Trainer decided for this model (compute_loss_func is refused above)
        self.sp_micro_batch_means = not self.model_accepts_loss_kwargs
        # transformers versions without loss_is_scaled_for_ga read this to leave the loss undivided
        self.model_accepts_loss_kwargs = True
        self.sp_mesh = build_mesh(config)
        self.dp_size, self.dp_rank = replica_of(self.sp_mesh)
        # Note [NEFTune over shards]: seqpar adds the noise itself (compute_loss), not transformers' hook
        self.sp_neftune_alpha, self.neftune_noise_alpha = check_neftune(self.neftune_noise_alpha, self.dp_size), None
        # the door's DDP / FSDP2 / DeepSpeed engine does data parallel: seqpar applies the sequence split only
        parallelize(self.model, self.sp_mesh, options=config.parallelize_options())

    def _build_accelerator_args(self, **kwargs) -> dict:
        """The Trainer's Accelerator arguments, ``parallelism_config`` left out (seqpar has planned with it)."""
        accelerator_args = super()._build_accelerator_args(**kwargs)
        accelerator_args.pop("parallelism_config", None)
        return accelerator_args

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's Accelerator, built without the parallelism config it would read from the environment."""
        with hidden_parallelism_environment():
            super().create_accelerator_and_postprocess()

    # ---- data: rows per data-parallel replica (Note [loaders by replica]) ----

    def _world_group(self) -> dist.ProcessGroup | None:
        return dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None

    def get_train_dataloader(self):
        """The Trainer's training dataloader, yielding this rank's data-parallel replica's batches."""
        loader = super().get_train_dataloader()
        return shard_by_replica(loader, self.dp_size, self.dp_rank, world_size=self.accelerator.num_processes)

    def get_total_train_batch_size(self, args) -> int:
        """Sequences per optimizer step: per-replica batch x accumulation steps x data-parallel replicas."""
        return self._train_batch_size * args.gradient_accumulation_steps * self.dp_size

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """The step's micro-batches as this rank's shards, and the step's valid-token count over every rank.

        Collective (Note [one exchange per step]); bad input raises ``SeqparInputError`` on every rank.
        """
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        step = self.shard_batches(batches)
        if step.micro_batch_tokens is not None:  # each micro-batch its own mean (Note [micro-batch means])
            for shard, tokens in zip(step.shards, step.micro_batch_tokens, strict=True):
                shard[MICRO_BATCH_TOKENS] = tokens
        return step.shards, step.num_valid_tokens

    def shard_batches(self, batches: list) -> StepShards:
        """This rank's shards of one step's collator outputs and the step's valid tokens (collective).

        Args:
            batches: this replica's micro-batches of one optimizer step.

        Returns:
            The ``StepShards`` of ``seqpar.hf.shard_step`` over every process of the job.

        Raises:
            SeqparInputError: on every rank, when any rank's batch is bad.
        """
        config = self.sequence_parallel
        step = shard_step(
            batches,
            self.sp_mesh,
            group=self._world_group(),
            layout=config.layout,
            seq_length=config.seq_length,
            per_micro_batch=self.sp_micro_batch_means,
        )
        for shard, batch in zip(step.shards, batches):
            # the width before the layout's padding: NEFTune's noise (Note [NEFTune over shards]) and a sparse-attention
            # indexer's row (Note [indexed attention]) take it
            shard[WIDTH_KEYWORD] = int(batch["input_ids"].shape[1])
        return step

    # ---- loss (Note [exact loss under the Trainer]) ----

    def as_shard(self, inputs, num_items_in_batch=None) -> tuple[SequenceShard, int | None]:
        """``inputs`` as this rank's shard, with the valid tokens to normalise by (collective for a whole batch).

        Args:
            inputs: a ``SequenceShard`` from ``get_batch_samples``, or a whole collator batch.
            num_items_in_batch: the step's valid tokens over every rank, if known.

        Returns:
            ``(shard, num_items_in_batch)``; a whole batch is normalised by its own valid tokens over every rank.
        """
        if isinstance(inputs, SequenceShard):
            return inputs, num_items_in_batch
        step = self.shard_batches([inputs])
        return step.shards[0], step.num_valid_tokens if num_items_in_batch is None else num_items_in_batch

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """This rank's share of the step's loss (Note [router loss under the Trainer]), scaled for DDP's average.

        Args:
            model: the (wrapped) prepared model.
            inputs: a ``SequenceShard`` from ``get_batch_samples``, or a whole collator batch (sharded here).
            return_outputs: also return the model outputs (this rank's logits shard).
            num_items_in_batch: valid tokens of the whole step over every rank.

        Returns:
            The loss, or ``(loss, outputs)``.
        """
        inputs, num_items_in_batch = self.as_shard(inputs, num_items_in_batch)
        sharded = self.is_fsdp_enabled or isinstance(model, FSDPModule)
        if model.training and self.accelerator.num_processes > 1 and model is self.model and not sharded:
            raise SeqparInputError(
                "the model is not wrapped in DDP/FSDP: gradients would not be summed over ranks; train through "
                "trainer.train() (which wraps it)"
            )
        with self.embedding_noise(model, inputs):
            outputs = model(**model_inputs(inputs))  # with the batch's own layout under "balanced"
        total = int(num_items_in_batch) if num_items_in_batch is not None else None
        own = inputs.get(MICRO_BATCH_TOKENS)
        if own is not None:  # the micro-batch's mean over the step's micro-batches (Note [micro-batch means])
            total, num_items_in_batch = int(own), None
        smoothing = self.label_smoother.epsilon if self.label_smoother is not None else 0.0
        loss = cross_entropy(  # Note [label smoothing per token]
            outputs.logits, inputs["shift_labels"], num_valid_tokens=total, label_smoothing=smoothing
        )
        # without num_items_in_batch a router loss is the micro-batch's whole one, divided by the steps below
        loss = loss + self.router_loss(outputs, inputs, num_items_in_batch)
        if own is not None:
            loss = loss / self.current_gradient_accumulation_steps
        loss = loss * self.accelerator.num_processes  # DDP / FSDP2 average over every process
        return (loss, outputs) if return_outputs else loss

    def router_loss(
        self, outputs, shard: SequenceShard, num_items_in_batch=None, coefficient: float | None = None
    ) -> torch.Tensor | float:
        """This rank's weighted share of the micro-batch's router loss over every process (collective when the
        model outputs router logits; Note [router loss under the Trainer]); 0.0 without router logits. The
        weight is the model's ``router_aux_loss_coef`` unless ``coefficient`` is given."""
        group = self._world_group()
        return model_router_loss(self.model, outputs, shard.get("token_mask"), group, coefficient)

    def embedding_noise(self, model, shard: SequenceShard) -> contextlib.AbstractContextManager:
        """NEFTune's noise for one training forward on ``shard`` (Note [NEFTune over shards]); else no-op."""
        if not self.sp_neftune_alpha or not model.training:
            return contextlib.nullcontext()
        embeddings = self.accelerator.unwrap_model(model).get_input_embeddings()
        layout = shard.get(LAYOUT_KEYWORD) or self.sequence_parallel.layout
        return noisy_embeddings(embeddings, self.sp_neftune_alpha, shard.get(WIDTH_KEYWORD), self.sp_mesh, layout)


class SequenceParallelTrainer(SequenceParallelMixin, Trainer):
    """``transformers.Trainer`` with sequence parallelism; the same constructor plus ``sequence_parallel=``.

    ``per_device_train_batch_size`` counts sequences per data-parallel replica (the SP ranks of a group share
    them). Example, under ``torchrun --nproc-per-node 4``::

        trainer = SequenceParallelTrainer(
            model=model, args=training_args, train_dataset=ds, data_collator=collator,
            sequence_parallel=SequenceParallelConfig(sp_size=2),  # 2 replicas x 2 ranks per sequence
        )
        trainer.train()
    """
