"""Bad settings and batches under seqpar.hf: each must raise SeqparInputError on every rank, not hang.

Called from tests.hf_scripts.parallel; every rank records the messages it got.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import transformers

import seqpar.hf
from seqpar.errors import SeqparInputError
from tests._models import VOCAB
from tests.hf_scripts.common import CASES, build_trainer, save, zero


class _ByProcess(seqpar.hf.SequenceParallelTrainer):
    """Loads batches per process, as the plain Trainer does: the ranks of a group get different rows."""

    def get_train_dataloader(self):
        return transformers.Trainer.get_train_dataloader(self)


def _attention_dropout():
    """A tiny Gemma 2 with attention dropout, which seqpar's attention does not implement."""
    config = transformers.Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        attention_dropout=0.1,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def _accelerate(**sizes):
    from accelerate import ParallelismConfig

    return ParallelismConfig(**sizes)


def _fixed_width(world: int):
    """Ulysses over every rank with batches 64 tokens wide, as accelerate's sp_seq_length_is_variable=False says."""
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    fixed = DeepSpeedSequenceParallelConfig(sp_seq_length=64, sp_seq_length_is_variable=False)
    return _accelerate(sp_backend="deepspeed", sp_size=world, sp_handler=fixed)


def _per_batch_metrics(prediction, compute_result: bool = False) -> dict:
    """A ``compute_metrics`` for ``batch_eval_metrics=True`` (the Trainer checks for ``compute_result``)."""
    return {}


def _deepspeed_ulysses() -> dict:
    """A ZeRO-2 config that also asks DeepSpeed for its own sequence parallel over 2 ranks."""
    config = dict(zero(2)[0][1])
    config["sequence_parallel_size"] = 2
    return config


def _expect_refusal(what: str, make) -> str:
    try:
        make()
    except SeqparInputError as error:
        return str(error)
    raise AssertionError(f"{what}: no SeqparInputError")


def _grpo_checks(out: str, world: int) -> dict:
    """SequenceParallelGRPOTrainer's refusals: vLLM generation, generation batches that split a prompt's group."""
    from tests.hf_scripts.grpo import GRPO_CASES, build

    case, cls = GRPO_CASES["grpo_sp2"], seqpar.hf.SequenceParallelGRPOTrainer
    sp = seqpar.hf.SequenceParallelConfig(sp_size=world)

    def grpo(sequence_parallel=sp, dataset=None, **args):
        where = os.path.join(out, "x")
        extra = {} if dataset is None else {"train_dataset": dataset}
        return build(case, out, where, cls, False, args=args, sequence_parallel=sequence_parallel, **extra)

    return {
        "grpo vllm": lambda: grpo(use_vllm=True, vllm_mode="colocate"),
        "grpo vllm server": lambda: grpo(use_vllm=True, vllm_mode="server"),
        # 3 completions per replica and step: TRL's check passed with 2 processes x 3, one replica's 3 does not
        "grpo generation batch": lambda: grpo(
            per_device_train_batch_size=3, gradient_accumulation_steps=1, num_generations=2
        ),
        "grpo placed layout": lambda: grpo(seqpar.hf.SequenceParallelConfig(sp_size=world, layout="placed")),
        "grpo vision dataset": lambda: grpo(dataset=_vision_prompts()),
    }


def _vision_prompts():
    """Prompts with images, as TRL's vision GRPO datasets hold them."""
    from datasets import Dataset
    from PIL import Image

    image = Image.new("RGB", (16, 16))
    return Dataset.from_list([{"prompt": "t5 t6 t7", "image": image} for _ in range(8)])


def refusals(out: str) -> None:
    """Bad settings and batches raise SeqparInputError on every rank (each rank records its messages)."""
    case, world = CASES["sp2"], dist.get_world_size()

    def trainer(collator=None, sp=None, args=None, cls=seqpar.hf.SequenceParallelTrainer, mutate=None, **extra):
        config = sp or seqpar.hf.SequenceParallelConfig(sp_size=world)
        c = CASES["sft_packing"] if cls is seqpar.hf.SequenceParallelSFTTrainer else case
        extra.update({} if collator is None else {"data_collator": collator})
        return build_trainer(
            "x",
            c,
            os.path.join(out, "x"),
            cls,
            reference=False,
            sequence_parallel=config,
            args=args or {},
            mutate=mutate,
            **extra,
        )

    def accelerate_trainer(parallelism_config):  # the settings in TrainingArguments only, no sequence_parallel=
        where = os.path.join(out, "x")
        args = {"parallelism_config": parallelism_config}
        return build_trainer("x", case, where, seqpar.hf.SequenceParallelTrainer, reference=False, args=args)

    def train_on(batch_fn):
        t = trainer(collator=batch_fn)
        t.train()

    def left_padded(features):
        batch = transformers.DataCollatorWithFlattening(return_position_ids=True)(features)
        if dist.get_rank() == world - 1:  # one rank only: the others must raise too
            n = batch["input_ids"].shape[1]
            batch = {
                "input_ids": batch["input_ids"],
                "labels": batch["labels"],
                "attention_mask": (torch.arange(n) >= 2).long()[None],
            }
        return batch

    def short(features):
        return {"input_ids": torch.tensor([[3]]), "labels": torch.tensor([[3]])}

    checks = {
        "flattening without position ids": lambda: trainer(
            collator=transformers.DataCollatorWithFlattening(return_position_ids=False)
        ),
        "varlen keys without position ids": lambda: train_on(
            transformers.DataCollatorWithFlattening(return_position_ids=False, return_flash_attn_kwargs=True).__call__
        ),
        "left padding on one rank": lambda: train_on(left_padded),
        "sp larger than the sequence": lambda: train_on(short),
        "world not divisible by sp": lambda: trainer(sp=seqpar.hf.SequenceParallelConfig(sp_size=world + 1)),
        # Note [NEFTune over shards]: one process's noise spans every replica's rows
        "neftune over replicas": lambda: trainer(
            sp=seqpar.hf.SequenceParallelConfig(sp_size=1), args={"neftune_noise_alpha": 5.0}
        ),
        "per-batch metrics": lambda: trainer(args={"batch_eval_metrics": True}, compute_metrics=_per_batch_metrics),
        "sft neftune with label smoothing": lambda: trainer(
            cls=seqpar.hf.SequenceParallelSFTTrainer, args={"neftune_noise_alpha": 5.0, "label_smoothing_factor": 0.1}
        ),
        "sft liger": lambda: trainer(cls=seqpar.hf.SequenceParallelSFTTrainer, args={"use_liger_kernel": True}),
        "sft dft loss": lambda: trainer(cls=seqpar.hf.SequenceParallelSFTTrainer, args={"loss_type": "dft"}),
        "unknown strategy": lambda: seqpar.hf.SequenceParallelConfig(strategy="zigzag"),
        "parallelism sizes": lambda: accelerate_trainer(_accelerate(sp_size=world, dp_shard_size=2)),
        "parallelism disagrees": lambda: trainer(args={"parallelism_config": _accelerate(sp_size=world)}),
        "parallelism tp": lambda: accelerate_trainer(_accelerate(tp_size=world)),
        "parallelism fixed width": lambda: accelerate_trainer(_fixed_width(world)).train(),
        "loader by process": lambda: trainer(cls=_ByProcess).train(),
        # accelerate keeps DDP on the CPU whatever fsdp says: refused rather than silently replicated
        "fsdp plugin on the cpu": lambda: trainer(args={"fsdp": True, "fsdp_config": {"version": 2}}),
        "model seqpar cannot serve": lambda: build_trainer(
            "x",
            case,
            os.path.join(out, "x"),
            seqpar.hf.SequenceParallelTrainer,
            reference=False,
            sequence_parallel=seqpar.hf.SequenceParallelConfig(sp_size=world),
            model=_attention_dropout(),
        ),
    }
    checks.update(_grpo_checks(out, world))
    messages = {what: _expect_refusal(what, make) for what, make in checks.items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, messages)
    if dist.get_rank() == 0:
        save(os.path.join(out, "refusals.pt"), gathered)


def deepspeed_refusal(out: str) -> None:
    """DeepSpeed's own sequence parallel is refused on every rank (after every other run: DeepSpeed's settings
    stay in the process once a DeepSpeed Trainer was built)."""
    case, where = CASES["sp2"], os.path.join(out, "x")
    config = seqpar.hf.SequenceParallelConfig(sp_size=dist.get_world_size())

    def make():
        args = {"deepspeed": _deepspeed_ulysses()}
        cls = seqpar.hf.SequenceParallelTrainer
        return build_trainer("x", case, where, cls, False, sequence_parallel=config, args=args)

    message = _expect_refusal("deepspeed sequence parallel", make)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, message)
    if dist.get_rank() == 0:
        save(os.path.join(out, "deepspeed_refusal.pt"), gathered)
