"""GRPO runs that tests/test_hf.py compares: TRL's one-process GRPOTrainer and seqpar's under torchrun.

The reference side imports no seqpar module. ``reference(out, names)`` trains TRL's own trainer on the whole
batch of every replica and records, through the reward function, the completions it sampled; ``parallel(out,
name)`` trains ``seqpar.hf.SequenceParallelGRPOTrainer``. At one replica the group samples itself (it must
draw what the reference drew); with several replicas each replica's sampler differs from the one process's,
so the run replays the reference's completions through TRL's generation hook ``rollout_func``.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import transformers

from tests.hf_scripts.common import RUN_FIELDS, model, save, tokenizer

GRPO_STEPS = 3
PROMPTS = 24


@dataclasses.dataclass(frozen=True)
class GrpoCase:
    """One GRPO run: the same settings for the one-process reference and the sequence-parallel run."""

    world: int
    sp_size: int
    loss_type: str
    strategy: str = "auto"
    extra: tuple = ()  # more GRPOConfig fields

    @property
    def dp(self) -> int:
        return self.world // self.sp_size

    @property
    def replay(self) -> bool:  # several replicas: the reference's completions are replayed (rollout_func)
        return self.dp > 1


GRPO_CASES = {
    # num_iterations 2: the second pass reuses the completions with old log-probabilities, ratios leave 1 and clip
    "grpo_sp2": GrpoCase(2, 2, "grpo", extra=(("num_iterations", 2),)),
    # the sequence-level ratio (a per-row sum over the ring) and dr_grpo's fixed normaliser
    "grpo_sp3_ring": GrpoCase(
        3, 3, "dr_grpo", strategy="ring", extra=(("num_iterations", 2), ("importance_sampling_level", "sequence"))
    ),
    # dapo: the generation batch's tokens over every replica; completions replayed (several replicas). One
    # micro-batch per step, so that per-micro-batch metrics cover the same rows as the one process's
    "grpo_dp2_sp2": GrpoCase(4, 2, "dapo", extra=(("gradient_accumulation_steps", 1), ("num_iterations", 2))),
}
COMPARED = (
    "reward",
    "reward_std",
    "rewards/reward/mean",
    "kl",
    "entropy",
    "num_tokens",
    "completions/mean_length",
    "completions/max_length",
    "completions/min_length",
    "completions/clipped_ratio",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
)


class Recorder:
    """The reward function: deterministic in the completion's tokens; it keeps every call's prompts and tokens."""

    __name__ = "reward"

    def __init__(self) -> None:
        self.calls: list[tuple[list, list]] = []

    def __call__(self, prompts, completions, completion_ids, **kwargs) -> list[float]:
        self.calls.append((list(prompts), [list(c) for c in completion_ids]))
        return [(sum(c) % 11) / 11 + 0.05 * len(c) for c in completion_ids]


def prompts() -> list[str]:
    """Prompts of 2 to 9 words over the tiny vocabulary (so rows are left-padded differently)."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(2, 10, (PROMPTS,), generator=g).tolist()
    return [" ".join(f"t{int(t)}" for t in torch.randint(2, 90, (n,), generator=g)) for n in lengths]


def grpo_args(case: GrpoCase, out: str, reference: bool, **overrides):
    from trl import GRPOConfig

    fields = dict(
        **RUN_FIELDS,
        output_dir=out,
        max_steps=GRPO_STEPS,
        per_device_train_batch_size=4 * (case.dp if reference else 1),
        gradient_accumulation_steps=2,
        num_generations=2,
        max_completion_length=12,
        learning_rate=0.5,
        max_grad_norm=1.0,
        beta=0.05,
        epsilon=0.1,
        loss_type=case.loss_type,
    )
    fields.update(dict(case.extra), **overrides)
    return GRPOConfig(**fields)


def initial_model(out: str) -> str:
    """The tiny Llama saved once under ``out`` (TRL loads its reference model from the policy's path)."""
    where = os.path.join(out, "grpo_model")
    if not os.path.exists(os.path.join(where, "config.json")):
        model("llama").save_pretrained(where)
    return where


def build(case: GrpoCase, out: str, where: str, cls, reference: bool, args: dict | None = None, **kwargs):
    from datasets import Dataset

    dataset = kwargs.pop("train_dataset", None) or Dataset.from_dict({"prompt": prompts()})
    net = transformers.AutoModelForCausalLM.from_pretrained(initial_model(out), attn_implementation="sdpa")
    recorder = Recorder()
    trainer = cls(
        model=net,
        reward_funcs=recorder,
        args=grpo_args(case, where, reference, **(args or {})),
        train_dataset=dataset,
        processing_class=tokenizer(),
        **kwargs,
    )
    return trainer, recorder


def results(trainer, recorder: Recorder) -> dict:
    logs = [h for h in trainer.state.log_history if "loss" in h]
    params = {n: p.detach().float().cpu().clone() for n, p in trainer.model.named_parameters()}
    return {"log": logs, "params": params, "calls": recorder.calls}


def reference(out: str, names: list[str]) -> None:
    """TRL's one-process GRPOTrainer on every replica's rows; writes OUT/reference/NAME.pt."""
    from trl import GRPOTrainer

    for name in names:
        case = GRPO_CASES[name]
        trainer, recorder = build(case, out, os.path.join(out, "reference", name), GRPOTrainer, reference=True)
        trainer.train()
        save(os.path.join(out, "reference", f"{name}.pt"), results(trainer, recorder))


def replay(calls: list) -> object:
    """TRL's ``rollout_func`` giving each replica its rows of the reference's completions, call by call."""
    served = []

    def rollout(batch_prompts: list, trainer) -> dict:
        recorded_prompts, recorded_ids = calls[len(served)]
        n, r = len(batch_prompts), trainer.dp_rank  # replica r holds rows [r n, (r + 1) n) of the batch
        if recorded_prompts[r * n : (r + 1) * n] != list(batch_prompts):
            raise AssertionError(f"replica {r} got other prompts than the reference's generation {len(served)}")
        served.append(n)
        prompt_ids = trainer.processing_class(text=batch_prompts)["input_ids"]
        return {"prompt_ids": prompt_ids, "completion_ids": recorded_ids[r * n : (r + 1) * n], "logprobs": None}

    return rollout


def parallel(out: str, name: str) -> None:
    """seqpar's SequenceParallelGRPOTrainer for case ``name``; rank 0 writes OUT/NAME.pt (collective)."""
    import torch.distributed as dist

    import seqpar.hf

    case = GRPO_CASES[name]
    config = seqpar.hf.SequenceParallelConfig(sp_size=case.sp_size, strategy=case.strategy)
    extra = {}
    if case.replay:
        extra["rollout_func"] = replay(torch.load(os.path.join(out, "reference", f"{name}.pt"))["calls"])
    trainer, recorder = build(
        case,
        out,
        os.path.join(out, name),
        seqpar.hf.SequenceParallelGRPOTrainer,
        False,
        sequence_parallel=config,
        **extra,
    )
    trainer.train()
    found = results(trainer, recorder)
    found["strategy"] = seqpar.last_attention_choice(trainer.model).strategy
    found["sp_size"], found["dp_size"] = trainer.sp_mesh.sp_size, trainer.dp_size
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, recorder.calls)  # every rank of a group must have scored the same completions
    found["calls_per_rank"] = every
    if dist.get_rank() == 0:
        save(os.path.join(out, f"{name}.pt"), found)
