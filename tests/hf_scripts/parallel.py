"""The sequence-parallel side of tests/test_hf.py, one torchrun launch for many runs.

``torchrun --nproc-per-node W -m tests.hf_scripts.parallel OUT NAME...``: each NAME is a case of
``common.CASES`` (trained with seqpar.hf, results in OUT/NAME.pt) or one of the checks below.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import transformers

import seqpar
import seqpar.hf
from seqpar.sequence_parallel.prepare import LAYOUT_KEYWORD
from tests.hf_scripts.common import CASES, build_trainer, model, parallelism_config, results, save


def _config(case) -> seqpar.hf.SequenceParallelConfig:
    return seqpar.hf.SequenceParallelConfig(
        sp_size=case.sp_size, ulysses_size=case.ulysses_size, strategy=case.strategy, layout=case.layout
    )


def _trainer_class(case):
    return seqpar.hf.SequenceParallelSFTTrainer if case.sft else seqpar.hf.SequenceParallelTrainer


def _sharded_model(case, where: str):
    """The case's model, FSDP2-sharded over every process as it loads (transformers' DistributedConfig)."""
    from transformers.distributed import DistributedConfig

    if dist.get_rank() == 0:
        model(case.kind).save_pretrained(where)
    dist.barrier()
    config = DistributedConfig(fsdp_size=dist.get_world_size())
    return transformers.AutoModelForCausalLM.from_pretrained(
        where, attn_implementation="sdpa", distributed_config=config, device_map="cpu"
    )


def _record_layouts(trainer) -> list:
    """The chunk ids of the layout each training shard carried to the model (None: a fixed layout), as trained."""
    seen = []
    shard_batches = trainer.shard_batches

    def recording(batches):
        step = shard_batches(batches)
        for shard in step.shards:
            layout = shard.get(LAYOUT_KEYWORD)
            seen.append(layout.chunk_ids if layout is not None else None)
        return step

    trainer.shard_batches = recording
    return seen


def run_case(out: str, name: str) -> None:
    case = CASES[name]
    where = os.path.join(out, name)
    extra = {"model": _sharded_model(case, os.path.join(where, "initial"))} if case.fsdp else {}
    if case.parallelism:  # accelerate's config in the TrainingArguments, no sequence_parallel=
        extra["args"] = {"parallelism_config": parallelism_config(case.parallelism)}
    else:
        extra["sequence_parallel"] = _config(case)
    trainer = build_trainer(name, case, where, _trainer_class(case), reference=False, **extra)
    layouts = _record_layouts(trainer)
    trainer.train()
    found = results(trainer)
    engine = trainer.model_wrapped
    found["setup"]["deepspeed"] = engine.zero_optimization_stage() if trainer.is_deepspeed_enabled else None
    if trainer.is_deepspeed_enabled:  # the next cases build their models without ZeRO-3's partitioning
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    found["setup"]["strategy"] = seqpar.last_attention_choice(trainer.model).strategy
    found["setup"]["layouts"] = layouts
    found["setup"]["sp_size"] = trainer.sp_mesh.sp_size
    found["setup"]["ulysses_size"] = trainer.sp_mesh.ulysses_size
    found["setup"]["accelerate_parallelism"] = trainer.accelerator.parallelism_config
    if dist.get_rank() == 0:
        save(os.path.join(out, f"{name}.pt"), found)


class _Unscaled(seqpar.hf.SequenceParallelMixin, transformers.Trainer):
    """A user's own Trainer subclass with seqpar's mixin, whose loss forgets DDP's average (a control)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return loss / self.accelerator.num_processes


def control_unscaled(out: str) -> None:
    case = CASES["sp2"]
    trainer = build_trainer(
        "sp2",
        case,
        os.path.join(out, "control"),
        _Unscaled,
        reference=False,
        sequence_parallel=_config(case),
        args={"eval_strategy": "no"},
    )
    trainer.train()
    found = results(trainer)
    if dist.get_rank() == 0:
        save(os.path.join(out, "control_unscaled.pt"), found)


def resume(out: str) -> None:
    """sp2 with a checkpoint at step 3, resumed from it by a new trainer; then save_model."""
    case = CASES["sp2"]
    where = os.path.join(out, "resume")
    first = build_trainer(
        "sp2",
        case,
        where,
        seqpar.hf.SequenceParallelTrainer,
        reference=False,
        sequence_parallel=_config(case),
        args={"save_strategy": "steps", "save_steps": 3, "max_steps": 3, "eval_strategy": "no"},
    )
    first.train()
    second = build_trainer(
        "sp2",
        case,
        where,
        seqpar.hf.SequenceParallelTrainer,
        reference=False,
        sequence_parallel=_config(case),
        args={"eval_strategy": "no"},
    )
    second.train(resume_from_checkpoint=os.path.join(where, "checkpoint-3"))
    second.save_model(os.path.join(out, "saved_model"))
    found = results(second)
    if dist.get_rank() == 0:
        save(os.path.join(out, "resume.pt"), found)


def upstream(out: str, name: str) -> None:
    """A documented upstream example with seqpar's trainer in place of upstream's (tests.hf_scripts.upstream)."""
    import functools

    from tests.hf_scripts.upstream import SELF_CONFIGURED, UPSTREAM, run

    example, _, dp = UPSTREAM[name]
    cls = seqpar.hf.SequenceParallelSFTTrainer if example.startswith("trl_") else seqpar.hf.SequenceParallelTrainer
    if dp > 1 and name not in SELF_CONFIGURED:  # the one argument a dp x sp job adds: how many ranks share a sequence
        cls = functools.partial(
            cls, sequence_parallel=seqpar.hf.SequenceParallelConfig(sp_size=dist.get_world_size() // dp)
        )
    found = run(name, cls, out, reference=False)
    if dist.get_rank() == 0:
        save(os.path.join(out, f"{name}.pt"), found)


def main(out: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":  # a DeepSpeed YAML: DeepSpeed's own group
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")  # accelerate leaves it to the script on the CPU
    if not dist.is_initialized():  # accelerate adopts this group
        dist.init_process_group("gloo")
    from tests.hf_scripts.refusals import deepspeed_refusal, refusals

    special = {
        "resume": resume,
        "refusals": refusals,
        "control_unscaled": control_unscaled,
        "deepspeed_refusal": deepspeed_refusal,
    }
    for name in names:
        if name in special:
            special[name](out)
        elif name == "grpo_loss_types":
            from tests.hf_scripts.grpo_losses import parallel as run_losses

            run_losses(out)
        elif name.startswith("grpo_"):
            from tests.hf_scripts.grpo import parallel as run_grpo

            run_grpo(out, name)
        elif name.startswith(("trl_", "flattening", "alst_")):
            upstream(out, name)
        elif name.startswith("guide_"):  # accelerate's SP/CP guides with seqpar.hf.Accelerator
            from tests.hf_scripts.accelerate_guides import run as run_guide

            run_guide(out, name)
        elif name.startswith("dpo_"):  # TRL's DPOTrainer (tests.hf_scripts.dpo)
            from tests.hf_scripts import dpo

            dpo.refusals(out) if name == "dpo_refusals" else dpo.parallel(out, name)
        elif name.startswith("accelerate_dp"):
            from tests.hf_scripts.accelerate_loop import run

            run(out, int(name.removeprefix("accelerate_dp")))
        else:
            run_case(out, name)
        dist.barrier()
    dist.destroy_process_group()  # before exit: gloo's threads have aborted processes torn down later


if __name__ == "__main__":
    from tests.hf_scripts import import_stacks

    import_stacks()  # Note [frozen imports]
    main(sys.argv[1], sys.argv[2:])
