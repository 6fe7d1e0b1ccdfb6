"""Every GRPO ``loss_type`` (and the loss options) on one fixed micro-batch: TRL's one process against seqpar's.

The reference builds TRL's inputs once (completions, advantages, reference log-probabilities) and makes the
old log-probabilities differ from the policy's, so ratios leave 1 and every clipping branch is taken; both
sides then compute the loss and its gradient for each variant on exactly those inputs.
"""

from __future__ import annotations

import math
import os

import torch

from tests.hf_scripts.common import save
from tests.hf_scripts.grpo import GrpoCase, build, prompts

CASE = GrpoCase(2, 2, "grpo")
ACCUMULATION = 2  # the loss is divided by it (as within a step of two micro-batches)
VARIANTS = {
    **{kind: {} for kind in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")},
    # the sequence-level ratio with two-sided clipping, TRL's off-policy mask and KL bias correction
    "grpo_sequence": {
        "loss_type": "grpo",
        "importance_sampling_level": "sequence",
        "delta": 1.2,
        "use_bias_correction_kl": True,
    },
    "bnpo_off_policy": {"loss_type": "bnpo", "off_policy_mask_threshold": 0.0},
    # the top-entropy token mask: a quantile over every rank's tokens
    "dapo_entropy_mask": {"loss_type": "dapo", "top_entropy_quantile": 0.5},
}
METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
METRICS += ("clip_ratio/low_min", "clip_ratio/high_max", "cispo_clip_ratio", "vespo/phi_seq_mean")


def _configure(trainer, name: str) -> None:
    settings = {"loss_type": name, "importance_sampling_level": "token", "delta": None}
    settings.update(use_bias_correction_kl=False, off_policy_mask_threshold=None, top_entropy_quantile=1.0)
    settings.update(VARIANTS[name])
    for key in ("loss_type", "importance_sampling_level", "off_policy_mask_threshold", "top_entropy_quantile"):
        setattr(trainer, key, settings[key])
    trainer.args.delta, trainer.args.use_bias_correction_kl = settings["delta"], settings["use_bias_correction_kl"]
    trainer.current_gradient_accumulation_steps = ACCUMULATION


def _inputs(trainer) -> dict:
    """TRL's scored micro-batch of 4 prompts x 2 completions, old log-probabilities moved off the policy's."""
    trainer.model.train()
    batch = [{"prompt": p} for p in prompts()[:4] for _ in range(2)]
    inputs = trainer._generate_and_score_completions(batch)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        width = inputs["completion_ids"].shape[1]
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, width)
    wiggle = 0.15 * torch.sin(torch.arange(logps.numel(), dtype=logps.dtype)).reshape(logps.shape)
    inputs["old_per_token_logps"] = (logps + wiggle) * inputs["completion_mask"]
    return inputs


def _evaluate(trainer, inputs: dict, gradients) -> dict:
    """Loss, gradient and metrics of every variant; ``gradients(loss)`` gives the whole gradient vector."""
    found = {}
    for name in VARIANTS:
        _configure(trainer, name)
        trainer._metrics["train"].clear()
        trainer.model.zero_grad(set_to_none=False)
        loss, grad = gradients(trainer.compute_loss(trainer.model, inputs))
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k in METRICS}
        found[name] = {"loss": loss, "grad": grad, "metrics": metrics}
    return found


def reference(out: str) -> None:
    """TRL's GRPOTrainer on one process; writes OUT/reference/grpo_loss_types.pt (with the inputs)."""
    from trl import GRPOTrainer

    trainer, _ = build(CASE, out, os.path.join(out, "reference", "grpo_loss_types"), GRPOTrainer, reference=True)
    inputs = _inputs(trainer)

    def gradients(loss):
        loss.backward()
        return float(loss), torch.cat([p.grad.flatten() for p in trainer.model.parameters()])

    found = _evaluate(trainer, inputs, gradients)
    save(os.path.join(out, "reference", "grpo_loss_types.pt"), {"inputs": inputs, "variants": found})


def parallel(out: str) -> None:
    """seqpar's trainer on the reference's inputs, 2 ranks sharing each row; rank 0 writes OUT/grpo_loss_types.pt."""
    import torch.distributed as dist

    import seqpar.hf

    config = seqpar.hf.SequenceParallelConfig(sp_size=CASE.sp_size)
    where = os.path.join(out, "grpo_loss_types")
    trainer, _ = build(CASE, out, where, seqpar.hf.SequenceParallelGRPOTrainer, False, sequence_parallel=config)
    inputs = torch.load(os.path.join(out, "reference", "grpo_loss_types.pt"))["inputs"]
    trainer.model.train()

    def gradients(loss):  # each rank's loss is sp x its share: the group's sums, divided by sp, are the whole
        loss.backward()
        grad = torch.cat([p.grad.flatten() for p in trainer.model.parameters()])
        both = torch.cat([loss.detach().reshape(1), grad])
        dist.all_reduce(both)
        both = both / dist.get_world_size()
        return float(both[0]), both[1:]

    found = _evaluate(trainer, inputs, gradients)
    if dist.get_rank() == 0:
        save(os.path.join(out, "grpo_loss_types.pt"), {"variants": found})
    assert all(math.isfinite(v["loss"]) for v in found.values())
