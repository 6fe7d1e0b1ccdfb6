"""TRL's ``GRPOTrainer`` with the sequence split over ranks (needs ``trl``: ``pip install "seqpar[hf]"``), and
the ``GRPOConfig`` options it refuses; completions are sampled once per group, scoring and the loss run sharded.

Note [GRPO generation per group]
    Each data-parallel replica is one process of TRL's view (Note [one process per group]): its ``sp_size``
    ranks load the same prompts, and the group's first rank samples their completions with the whole model and
    its own attention (``seqpar.integrations.unsharded``: seqpar's hooks stand aside, so no collective runs
    while one rank generates). It then broadcasts the completions to the group together with its random
    number generator state, so every rank of the group continues with one stream: the one a single process
    seeded with ``seed + replica`` draws (TRL seeds ``seed + process index``). At one replica the group thus
    samples exactly what one process with the same seed samples. A ``rollout_func`` (TRL's generation hook)
    runs the same way, once per group. vLLM is refused: its engines are placed per process.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from accelerate.utils import set_seed
from trl import GRPOTrainer

from seqpar.errors import SeqparInputError
from seqpar.hf._grpo_loss import ShardGroups, policy_loss, record_metrics
from seqpar.hf.completions import completion_shard, from_completions, to_completions
from seqpar.hf.replica_view import ReplicaAccelerator, replica_collectives
from seqpar.hf.trainer import SequenceParallelMixin
from seqpar.integrations.unsharded import unsharded
from seqpar.parallel import parallelize
from seqpar.sequence_parallel.layouts.chunks import ChunkLayout, named_layout
from seqpar.sequence_parallel.prepare import LAYOUT_KEYWORD


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


# ---- the settings it refuses, and its generation batch (every rank reads the same, so all raise alike) ----


def _strategy(value: object) -> str:
    return str(getattr(value, "value", value))


def check_grpo_arguments(args: object, kwargs: dict) -> None:
    """Refuse what the sequence-parallel GRPO trainer cannot serve, before TRL sets anything up.

    Args:
        args: the ``GRPOConfig``.
        kwargs: the trainer's other keyword arguments (``tools``, ``environment_factory`` ...).

    Raises:
        SeqparInputError: no ``args``; vLLM or continuous-batching generation; tools and environments;
            evaluation; the entropy bonus; FSDP or DeepSpeed; a vision dataset.
    """
    if args is None:
        raise SeqparInputError(
            "SequenceParallelGRPOTrainer needs args=GRPOConfig(...) (its batch sizes count replicas)"
        )
    problems = []
    if getattr(args, "use_vllm", False):
        problems.append(
            f"use_vllm=True (vllm_mode={getattr(args, 'vllm_mode', None)!r}) is not supported under sequence "
            "parallelism: vLLM's engines and weight syncs are placed per process. Generate with transformers "
            "(use_vllm=False: each sequence-parallel group samples once with the whole model), or pass rollout_func= "
            "to call your own vLLM server: it runs once per group and its completions are shared by the group"
        )
    if getattr(args, "use_transformers_continuous_batching", False):
        problems.append(
            "use_transformers_continuous_batching has not been verified under sequence parallelism; leave it off "
            "(generation with model.generate, once per sequence-parallel group)"
        )
    if kwargs.get("tools") or kwargs.get("environment_factory") is not None:
        problems.append("tools and environment_factory are not supported: multi-turn rollouts are not implemented")
    if _strategy(getattr(args, "eval_strategy", "no")) != "no" or kwargs.get("eval_dataset") is not None:
        problems.append(
            "evaluation is not implemented for SequenceParallelGRPOTrainer: set eval_strategy='no' and no eval_dataset"
        )
    if getattr(args, "entropy_coef", 0.0) or getattr(args, "use_adaptive_entropy", False):
        problems.append(
            "the entropy bonus (entropy_coef, use_adaptive_entropy) is not implemented under sequence parallelism"
        )
    if getattr(args, "fsdp", None) or getattr(args, "deepspeed", None):
        problems.append(
            "FSDP and DeepSpeed are not supported: one rank per group samples with the whole model, which sharded "
            "parameters would need every rank for; train with DDP (the default)"
        )
    dataset = kwargs.get("train_dataset")
    first = next(iter(dataset), None) if dataset is not None else None  # its first row tells a vision dataset
    if isinstance(first, dict) and ("image" in first or "images" in first):
        problems.append("vision datasets (images): seqpar's GRPO samples and scores text token rows only")
    if problems:
        raise SeqparInputError("SequenceParallelGRPOTrainer cannot honour: " + " | ".join(problems))


def replica_generation_batch(args: object, sequence_parallel: object) -> None:
    """Size TRL's generation batch by replicas: ``per_device x (world / sp_size) x steps_per_generation``.

    TRL's ``GRPOConfig`` multiplies by every process; under sequence parallelism the ``sp_size`` ranks of a
    group share each completion, so the prompts of one generation batch are those of the replicas.

    Args:
        args: the ``GRPOConfig`` (its ``generation_batch_size`` is set).
        sequence_parallel: the ``SequenceParallelConfig`` or None (every rank shares each sequence).

    Raises:
        SeqparInputError: a generation batch that does not hold whole groups of ``num_generations``.
    """
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else args.world_size
    sp_size = getattr(sequence_parallel, "sp_size", None) or world
    replicas = max(world // sp_size, 1)  # a world sp_size does not divide is refused by the mixin
    args.generation_batch_size = args.per_device_train_batch_size * replicas * args.steps_per_generation
    if args.generation_batch_size % args.num_generations:
        raise SeqparInputError(
            f"the generation batch per_device_train_batch_size ({args.per_device_train_batch_size}) x replicas "
            f"({replicas}) x steps_per_generation ({args.steps_per_generation}) = {args.generation_batch_size} is not "
            f"divisible by num_generations ({args.num_generations}): every prompt's completions must be in one batch"
        )


def check_grpo_trainer(trainer: object) -> None:
    """Refuse what TRL's constructor decided and seqpar cannot serve (read from the built trainer).

    Args:
        trainer: the constructed trainer.

    Raises:
        SeqparInputError: a mixture-of-experts router loss; a multimodal processor; the placed layout.
    """
    problems = []
    layout = getattr(getattr(trainer, "sequence_parallel", None), "layout", None)
    if layout is not None and named_layout(layout).reorders_row:  # the same on every rank: one config
        problems.append(
            f"layout={layout!r} reorders packed documents, and each prompt + completion row is one document: use "
            "'balanced', 'auto' (balanced for such rows) or 'zigzag'"
        )
    if getattr(trainer, "aux_loss_enabled", False):
        problems.append("the router load-balancing loss (router_aux_loss_coef) is not implemented: set it to 0.0")
    if getattr(trainer, "_is_vlm", False):
        problems.append("vision-language models are not supported: seqpar shards token ids only")
    if problems:
        raise SeqparInputError("SequenceParallelGRPOTrainer cannot honour: " + " | ".join(problems))


class SequenceParallelGRPOTrainer(SequenceParallelMixin, GRPOTrainer):
    """``trl.GRPOTrainer`` with sequence parallelism; the same constructor plus ``sequence_parallel=``.

    ``per_device_train_batch_size`` counts completions per data-parallel replica (the ``sp_size`` ranks of
    a group share them) and the generation batch is ``per_device_train_batch_size x replicas x
    steps_per_generation``. Completions are sampled once per group with the whole model (Note [GRPO
    generation per group]); rewards and advantages are TRL's, over every replica; log-probabilities, the
    clipped loss of every ``loss_type``, the KL term and the metrics are computed on the shards with TRL's
    normalisations (Note [GRPO over shards]). The logged loss, grad_norm and metrics equal TRL's with one
    process per replica (and one process overall where TRL's normalisation spans every process).

    Raises:
        SeqparInputError: on every rank, for settings seqpar cannot serve (``check_grpo_arguments``: vLLM,
            tools, evaluation, entropy bonus ...) and those of the plain Trainer.
    """

    def __init__(self, *args, sequence_parallel=None, **kwargs) -> None:
        names = list(inspect.signature(GRPOTrainer.__init__).parameters)[1:]
        kwargs.update(zip(names, args))  # by keyword: the mixin finds the arguments under "args"
        check_grpo_arguments(kwargs.get("args"), kwargs)  # before TRL starts vLLM or anything collective
        replica_generation_batch(kwargs.get("args"), sequence_parallel)
        super().__init__(sequence_parallel=sequence_parallel, **kwargs)
        check_grpo_trainer(self)
        config = self.sequence_parallel
        if self.ref_model is not None:
            reference = self.accelerator.unwrap_model(self.ref_model)
            parallelize(reference, self.sp_mesh, options=config.parallelize_options())
        mesh = self.sp_mesh.device_mesh
        dp_group = mesh.get_group("dp") if self.dp_size > 1 else None
        self.shard_groups = ShardGroups(
            self.sp_mesh.sp_group,
            self.sp_mesh.sp_size,
            self.sp_mesh.sp_rank,
            dp_group,
            self.dp_size,
            self._world_group(),
        )
        self.replica_accelerator = ReplicaAccelerator(self.accelerator, dp_group, self.dp_size, self.dp_rank)
        if self.rollout_func is not None:
            user_rollout = self.rollout_func
            self.rollout_func = lambda prompts, trainer: self.once_per_group(lambda: user_rollout(prompts, trainer))
        set_seed(self.args.seed + self.dp_rank)  # TRL's device-specific seed, one per replica (Note [GRPO ...])

    # ---- generation (Note [GRPO generation per group], Note [one process per group]) ----

    def once_per_group(self, sample):
        """``sample()`` on the group's first rank with the model's own attention; its result on every rank.

        Args:
            sample: a function of no argument returning something picklable (completions).

        Returns:
            What ``sample()`` returned on the group's first rank; every rank continues with its RNG state.

        Raises:
            SeqparInputError: on the other ranks of the group when ``sample`` raised on the first.
        """
        mesh = self.sp_mesh
        if mesh.sp_size == 1:
            with unsharded(self.model):
                return sample()
        payload: list = [None]
        if mesh.sp_rank == 0:
            try:
                with unsharded(self.model):
                    payload = [(sample(), _rng_state(), None)]
            except Exception as error:  # the group must hear of it, or it would wait in the broadcast
                dist.broadcast_object_list([(None, None, repr(error))], src=dist.get_rank(), group=mesh.sp_group)
                raise
        leader = dist.get_process_group_ranks(mesh.sp_group)[0]
        dist.broadcast_object_list(payload, src=leader, group=mesh.sp_group)
        result, state, error = payload[0]
        if error is not None:
            raise SeqparInputError(f"sampling completions failed on rank {leader} of this group: {error}")
        if mesh.sp_rank != 0:
            _set_rng_state(state)
        return result

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's sampling, run once per sequence-parallel group (Note [GRPO generation per group])."""
        parent = super()._generate_single_turn
        return self.once_per_group(lambda: parent(prompt_ids, images, multimodal_fields, num_generations))

    def _generate_and_score_completions(self, inputs):
        """TRL's generation, rewards and advantages, each group acting as one process (Note [one process ...])."""
        with replica_collectives(self, self.replica_accelerator, GRPOTrainer.__module__):
            return super()._generate_and_score_completions(inputs)

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """The Trainer's own: GRPO's batches are prompts, sharded only once completions exist."""
        return GRPOTrainer.get_batch_samples(self, epoch_iterator, num_batches, device)

    # ---- log-probabilities on shards (Note [completion rows]) ----

    def _shard_logps(self, model, shard, compute_entropy: bool):
        """Per-position log-probabilities (and entropies) of the completion tokens this rank's shard predicts."""
        call = {k: shard[k] for k in ("input_ids", "position_ids", "shift_labels")}
        if isinstance(shard.layout, ChunkLayout):
            call[LAYOUT_KEYWORD] = shard.layout
        with self.accelerator.autocast():
            out = model(**call, fused_lm_head=True)
        return out.log_probs, (out.entropy if compute_entropy else None)

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **others
    ):
        """TRL's ``[B, C]`` log-probabilities of the completions, computed on shards (collective; no gradient)."""
        if torch.is_grad_enabled():
            raise SeqparInputError("whole-row log-probabilities are gathered without gradient; use compute_loss")
        prompt = input_ids.shape[1] - logits_to_keep
        shard = completion_shard(
            input_ids[:, :prompt], attention_mask[:, :prompt], input_ids[:, prompt:], attention_mask[:, prompt:],
            self.sp_mesh, layout=self.sequence_parallel.layout, pad_id=self._tokenizer.pad_token_id,
        )  # fmt: skip
        logps, entropies = self._shard_logps(model, shard, compute_entropy)
        full = [
            to_completions(x, shard["column"], logits_to_keep, self.sp_mesh)
            for x in (logps, entropies)
            if x is not None
        ]
        return full[0], (full[1] if compute_entropy else None), None

    # ---- loss (Note [GRPO over shards]) ----

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """This rank's share of TRL's GRPO loss, scaled for DDP's average over every rank (collective).

        Args:
            model: the (wrapped) prepared model.
            inputs: one micro-batch of TRL's scored completions (the same on every rank of the group).
            return_outputs: not supported (as in TRL).
            num_items_in_batch: unused (TRL's normaliser travels in ``inputs``).

        Returns:
            The loss tensor.
        """
        if return_outputs:
            raise ValueError("The GRPOTrainer does not support returning outputs")
        training = self.model.training
        shard = completion_shard(
            inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"], inputs["completion_mask"],
            self.sp_mesh, layout=self.sequence_parallel.layout, pad_id=self._tokenizer.pad_token_id,
        )  # fmt: skip
        logps, entropies = self._shard_logps(model, shard, compute_entropy=True)
        column = shard["column"]
        mask = (column >= 0).to(logps.dtype)
        adv = inputs["advantages"]
        adv = adv.unsqueeze(1) if adv.dim() == 1 else from_completions(adv, column)
        tensors = {
            "logps": logps,
            "entropies": entropies,
            "mask": mask,
            "adv": adv,
            "row_tokens": inputs["completion_mask"].sum(-1).to(logps.dtype),
            "num_items": inputs["num_items_in_batch"],
            "old": from_completions(inputs["old_per_token_logps"], column) if "old_per_token_logps" in inputs else None,
            "ref": from_completions(inputs["ref_per_token_logps"], column) if self.beta != 0.0 else None,
        }
        if self.top_entropy_quantile < 1.0:  # TRL's quantile over every rank's tokens: the shards partition them
            tensors["entropy_mask"] = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
        loss, parts = policy_loss(self, tensors, self.shard_groups, training)
        record_metrics(self, "train" if training else "eval", parts, tensors, self.shard_groups)
        return loss * self.sp_mesh.sp_size  # DDP averages over every rank; TRL's processes are the replicas
