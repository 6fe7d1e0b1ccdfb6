"""Upstream's documented usage, as written but for the import, for the one-process reference and for seqpar.

Each function below is a documented example with the trainer class passed in: the reference passes
``trl.SFTTrainer`` / ``transformers.Trainer``, the seqpar run ``seqpar.hf.SequenceParallelSFTTrainer`` /
``SequenceParallelTrainer`` (with ``sequence_parallel=`` bound when dp > 1), which is what changing the import
does. What the documents leave to the reader is filled in the same way for both: a tiny model built from a
config and documents made here (no hub), a CPU run without reporting, and SGD with a learning rate large
enough that a wrongly scaled gradient shows in the parameters, plus one log line per step. Everything else
keeps its default: several epochs (TRL 3, the Trainer example 2), no ``dataloader_drop_last``, the default
sampling order, clipping at 1.0, the linear schedule. The datasets do not fill the last batch of an epoch
(the tests check that they do not), so epoch ends are exercised; see Note [epoch ends].

Run as ``python -m tests.hf_scripts.upstream OUT NAME...`` for the references (batch = dp x the per-replica
batch; ``accelerate_dpN`` names the accelerate loop's); ``tests.hf_scripts.parallel`` runs the seqpar side.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import datasets
import transformers

from tests.hf_scripts.common import RUN_FIELDS, documents, model, save, tokenizer

# name: (example, per-replica batch, dp)
UPSTREAM = {
    "trl_packing_dp1": ("trl_packing", 2, 1),
    "trl_packing_dp2": ("trl_packing", 2, 2),
    "flattening_dp1": ("flattening_trainer", 8, 1),
    "flattening_dp2": ("flattening_trainer", 8, 2),
    # TRL's distributed-training page: its SFTConfig snippets, launched with its accelerate YAMLs
    "trl_cp_yaml": ("trl_context_parallel", 1, 1),
    "trl_alst_yaml": ("trl_ulysses", 1, 2),
    # transformers' Ulysses page: TrainingArguments(deepspeed=..., parallelism_config=...), sp 2, dp 1 and 2
    "alst_trainer_dp1": ("alst_trainer", 1, 1),
    "alst_trainer_dp2": ("alst_trainer", 1, 2),
}
# the seqpar side of these runs under `accelerate launch --config_file tests/accelerate_configs/<yaml>`
YAML_LAUNCHED = {"trl_cp_yaml": "trl_context_parallel_2gpu.yaml", "trl_alst_yaml": "trl_alst_ulysses_4gpu.yaml"}
CP_DOCUMENTS, ALST_DOCUMENTS = 20, 13
# examples whose own settings say how the ranks split the work (no sequence_parallel= added at dp > 1)
SELF_CONFIGURED = {*YAML_LAUNCHED, "alst_trainer_dp1", "alst_trainer_dp2"}
# examples that run DeepSpeed under torchrun: last in their launch (its settings stay in the process)
DEEPSPEED_EXAMPLES = ("alst_trainer_dp1", "alst_trainer_dp2")
TRL_DOCUMENTS, TRAINER_DOCUMENTS = 150, 75


def _filled_in(out: str, batch: int) -> dict:
    """What the documented examples leave to the reader, the same for the reference and for seqpar."""
    shared = {k: v for k, v in RUN_FIELDS.items() if k != "lr_scheduler_type"}  # the examples' schedule stays
    return dict(output_dir=out, per_device_train_batch_size=batch, learning_rate=0.1, **shared)


def trl_packing(SFTTrainer, out: str, batch: int) -> dict:
    """TRL's SFT quick start with packing on (``SFTConfig(packing=True)``, best-fit decreasing, padding-free)."""
    from trl import SFTConfig

    dataset = datasets.Dataset.from_list(documents(TRL_DOCUMENTS, 5, low=5, high=60))
    training_args = SFTConfig(packing=True, **_filled_in(out, batch))
    trainer = SFTTrainer(model=model("llama"), args=training_args, train_dataset=dataset, processing_class=tokenizer())
    trainer.train()
    return results(trainer, ("entropy", "mean_token_accuracy", "num_tokens"))


def _trl_page_inputs(out: str, batch: int) -> tuple:
    """The documents and the filled-in settings of TRL's distributed-training snippets (which set the batch)."""
    filled_in = _filled_in(out, batch)
    filled_in.pop("per_device_train_batch_size")
    return datasets.Dataset.from_list(documents(CP_DOCUMENTS, 9, low=5, high=60)), filled_in


def trl_context_parallel(SFTTrainer, out: str, batch: int) -> dict:
    """TRL's context-parallel training configuration (``use_liger_kernel=True`` left out: Liger is not installed)."""
    from trl import SFTConfig

    dataset, filled_in = _trl_page_inputs(out, batch)
    training_args = SFTConfig(
        # required
        pad_to_multiple_of=4,  # ensures divisibility by cp_size * 2
        # to get the most out of CP
        max_length=64,  # long sequence length (16384 in TRL's page)
        packing=True,  # use packing to reduce padding
        gradient_checkpointing=False,  # The activation_checkpointing in FSDP config and ... can't both be True
        per_device_train_batch_size=batch,  # 1 in TRL's page: one row per replica
        **filled_in,
    )
    trainer = SFTTrainer(model=model("llama"), args=training_args, train_dataset=dataset, processing_class=tokenizer())
    trainer.train()
    return results(trainer, ("entropy", "mean_token_accuracy", "num_tokens"))


def trl_ulysses(SFTTrainer, out: str, batch: int) -> dict:
    """TRL's ALST/Ulysses training configuration (its ``attn_implementation=`` is no SFTConfig field in TRL 1.16)."""
    from trl import SFTConfig

    dataset, filled_in = _trl_page_inputs(out, batch)
    training_args = SFTConfig(
        # required
        pad_to_multiple_of=2,  # Must equal sp_size
        # to get the most out of SP
        max_length=64,  # 4096 in TRL's page
        packing=True,
        per_device_train_batch_size=batch,  # 1 in TRL's page: one row per replica
        **filled_in,
    )
    # TRL's page loads a pretrained model (--model_name_or_path); so does this, from the one-process run's copy:
    # under the YAML's ZeRO-3 (zero3_init_flag) transformers loads it partitioned, with the same weights
    trainer = SFTTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(_saved_model(out), attn_implementation="sdpa"),
        args=training_args,
        train_dataset=dataset,
        processing_class=tokenizer(),
    )
    trainer.train()
    return results(trainer, ("entropy", "mean_token_accuracy", "num_tokens"))


def alst_trainer(Trainer, out: str, batch: int, dp: int = 1, reference: bool = False) -> dict:
    """transformers' Ulysses page: ``TrainingArguments(deepspeed=..., parallelism_config=ParallelismConfig(...))``
    with ``DataCollatorForLanguageModeling(mlm=False, pad_to_multiple_of=sp_size)``; sp_size 4 -> 2 for 2-4 CPU
    ranks, ``dp_replicate_size`` as its data-parallel example. The one-process run leaves out what distributes."""
    from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig
    from transformers import DataCollatorForLanguageModeling, TrainingArguments

    sp_size = 2
    parallelism_config = ParallelismConfig(
        sp_backend="deepspeed",
        sp_size=sp_size,
        dp_replicate_size=dp,
        sp_handler=DeepSpeedSequenceParallelConfig(
            sp_seq_length_is_variable=True,
            sp_attn_implementation="flash_attention_2",
        ),
    )
    deepspeed_config = _zero2_file(out)
    training_args = TrainingArguments(
        deepspeed=None if reference else deepspeed_config,
        parallelism_config=None if reference else parallelism_config,
        gradient_accumulation_steps=1,
        **_filled_in(out, batch),  # --per_device_train_batch_size 1 (dp x 1 in one process)
    )
    data_collator = DataCollatorForLanguageModeling(tokenizer=tokenizer(), mlm=False, pad_to_multiple_of=sp_size)
    dataset = datasets.Dataset.from_list(documents(ALST_DOCUMENTS, 11, low=5, high=40))
    trainer = Trainer(model=model("llama"), args=training_args, train_dataset=dataset, data_collator=data_collator)
    trainer.train()
    return results(trainer)


def _zero2_file(out: str) -> str:
    """``path/to/deepspeed_config.json``: ZeRO-2 with transformers' "auto" sizes (SGD needs DeepSpeed's leave)."""
    path = f"{out}_ds_config.json"
    config = {
        "zero_optimization": {"stage": 2},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True,
    }
    if not os.path.exists(path):
        with open(path, "w") as f:
            json.dump(config, f)
    return path


def _saved_model(out: str) -> str:
    """A directory holding ``model("llama")``, written by the first (the one-process) run."""
    where = f"{out}_initial"
    if not os.path.isdir(where):
        model("llama").save_pretrained(where)
    return where


def flattening_trainer(Trainer, out: str, batch: int) -> dict:
    """transformers' padding-free packing: ``Trainer(..., data_collator=DataCollatorWithFlattening())``."""
    from transformers import DataCollatorWithFlattening, TrainingArguments

    train_dataset = datasets.Dataset.from_list(documents(TRAINER_DOCUMENTS, 6))
    training_args = TrainingArguments(num_train_epochs=2, gradient_accumulation_steps=2, **_filled_in(out, batch))
    trainer = Trainer(
        model=model("llama"),
        args=training_args,
        train_dataset=train_dataset,
        data_collator=DataCollatorWithFlattening(),
    )
    trainer.train()
    return results(trainer)


def results(trainer, metrics: tuple[str, ...] = ()) -> dict:
    """Per-step loss, grad_norm and ``metrics``, the epoch of each step, the training rows, final parameters."""
    keys = ("loss", "grad_norm", *metrics)
    log = [(h["step"], h["epoch"], *(h[k] for k in keys)) for h in trainer.state.log_history if "loss" in h]
    gathered = contextlib.nullcontext()
    if getattr(trainer, "is_deepspeed_enabled", False):  # ZeRO-3 holds each rank's partition only
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(list(trainer.model.parameters()))
    with gathered:
        params = {n: p.detach().float().cpu().clone() for n, p in trainer.model.named_parameters()}
    mesh, settings = getattr(trainer, "sp_mesh", None), getattr(trainer, "sequence_parallel", None)
    sequence = (mesh.sp_size, mesh.ulysses_size, settings.strategy) if mesh is not None else None
    engine = type(trainer.model_wrapped).__name__  # DDP, or DeepSpeed's engine under a DeepSpeed YAML
    if hasattr(trainer.model_wrapped, "zero_optimization_stage"):
        engine += f" ZeRO-{trainer.model_wrapped.zero_optimization_stage()}"
    return {"keys": keys, "log": log, "params": params, "rows": len(trainer.train_dataset), "sequence": sequence} | {
        "engine": engine
    }


def run(name: str, trainer_class, out: str, reference: bool) -> dict:
    example, batch, dp = UPSTREAM[name]
    options = {"dp": dp, "reference": reference} if example == "alst_trainer" else {}
    return globals()[example](trainer_class, os.path.join(out, name), batch * dp if reference else batch, **options)


def main(out: str, names: list[str]) -> None:
    for name in names:
        if name.startswith("guide_"):  # accelerate's SP/CP guides, one process
            from tests.hf_scripts.accelerate_references import reference as guide_reference

            guide_reference(out, name)
            continue
        if name.startswith("accelerate_dp"):  # the accelerate loop's reference, in the same interpreter
            from tests.hf_scripts.accelerate_loop import reference

            reference(out, int(name.removeprefix("accelerate_dp")))
            continue
        example = UPSTREAM[name][0]
        if example.startswith("trl_"):
            from trl import SFTTrainer as cls
        else:
            cls = transformers.Trainer
        save(os.path.join(out, "reference", f"{name}.pt"), run(name, cls, out, reference=True))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
