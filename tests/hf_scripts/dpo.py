"""DPO runs that tests/test_hf.py compares: TRL's one-process DPOTrainer against seqpar's, on the same pairs.

``reference(out, name)`` runs ``trl.DPOTrainer`` on ``dp x`` the per-replica batch (no seqpar imported);
``parallel(out, name)`` runs ``seqpar.hf.SequenceParallelDPOTrainer`` under torchrun. Both save OUT/[reference/]NAME.pt.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import torch
import transformers

from tests._models import VOCAB, tiny_config
from tests.hf_scripts.common import RUN_FIELDS, model, parallelism_config, save

__all__ = ["BETA", "DPO_CASES", "DPO_METRICS", "build", "parallel", "reference", "refusals"]

STEPS = 3
BETA = 0.5
PAIRS = 24  # 3 steps of dp 2 x 2 pairs x 2 micro-batches
PEFT = importlib.util.find_spec("peft") is not None
DPO_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
    "entropy",
    "mean_token_accuracy",
    "num_tokens",
)


@dataclasses.dataclass(frozen=True)
class DPOCase:
    """One DPO run: the same settings for TRL's one-process trainer and for seqpar's."""

    world: int
    sp_size: int = 2
    strategy: str = "auto"
    batch: int = 2  # pairs per data-parallel replica per micro-batch
    extra: tuple = ()  # more DPOConfig fields
    evaluate: bool = False
    peft: bool = False  # train a LoRA adapter; the reference is the base model (no ref_model)
    ref_model: bool = True  # pass a second model as the reference (else: precomputed or PEFT)
    reference: str = ""  # compare with another case's one-process run (same data and settings)
    parallelism: str = ""  # the seqpar run takes common.parallelism_config(name), no sequence_parallel=

    @property
    def dp(self) -> int:
        return self.world // self.sp_size


# several loss types at once (weighted sum), with the length-desensitised sums and WPO's weights (TRL 1.16
# weights in place, which its "sft" and "hinge" terms cannot take in backward; the sp 3 case has those)
MIXED = (
    ("loss_type", ["ipo", "sigmoid_norm", "robust"]),
    ("loss_weights", [1.0, 0.7, 0.2]),
    ("ld_alpha", 0.5),
    ("use_weighting", True),
    ("label_smoothing", 0.1),
)
DPO_CASES = {
    "dpo_sp2": DPOCase(2, evaluate=True),  # sigmoid, a reference model
    "dpo_mixed_sp2": DPOCase(2, extra=MIXED),
    # accelerate's ParallelismConfig(sp_size=2, sp_backend="deepspeed", ...) in DPOConfig, as its guides write it
    "dpo_pc_sp2": DPOCase(2, evaluate=True, reference="dpo_sp2", parallelism="sp2"),
    "dpo_peft_sp2": DPOCase(2, peft=True, ref_model=False),
    "dpo_sp3_ring": DPOCase(3, sp_size=3, strategy="ring", extra=(("loss_type", ["hinge", "bco_pair", "sft"]),)),
    # precomputed reference log-probs (the policy before training), random order, checkpointing, evaluation
    "dpo_dp2_sp2": DPOCase(
        4,
        ref_model=False,
        evaluate=True,
        extra=(
            ("precompute_ref_log_probs", True),
            ("train_sampling_strategy", "random"),
            ("gradient_checkpointing", True),
        ),
    ),
}


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Whitespace-separated words t2..t95 of the tiny vocabulary, <pad> and <eos>."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def pairs(count: int, seed: int):
    """Prompts of 4-23 words; chosen and rejected completions of 3-14 words (rows stay under 64 tokens)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)

    def words(low: int, high: int) -> str:
        n = int(torch.randint(low, high, (1,), generator=g))
        return "".join(f"t{int(t)} " for t in torch.randint(2, VOCAB, (n,), generator=g))

    return Dataset.from_list(
        [{"prompt": words(4, 24), "chosen": words(3, 15), "rejected": words(3, 15)} for _ in range(count)]
    )


def build(name: str, out: str, trainer_cls, reference: bool, args: dict | None = None, **kwargs):
    """The DPO trainer (class given) for case ``name``: a tiny Llama, its reference copy, the pairs."""
    from trl import DPOConfig

    case = DPO_CASES[name]
    batch = case.batch * (case.dp if reference else 1)
    fields = dict(
        **RUN_FIELDS,
        output_dir=out,
        max_steps=STEPS,
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=batch,
        gradient_accumulation_steps=2,
        learning_rate=0.5,
        max_grad_norm=0.5,
        train_sampling_strategy="sequential",
        gradient_checkpointing=False,
        beta=BETA,
    )
    if case.evaluate:
        fields.update(eval_strategy="steps", eval_steps=2)
    fields.update(dict(case.extra), **(args or {}))
    options = dict(
        model=model("llama"),
        args=DPOConfig(**fields),
        train_dataset=pairs(PAIRS, 1),
        eval_dataset=pairs(8, 2) if case.evaluate else None,
        processing_class=tokenizer(),
    )
    if case.ref_model:
        options["ref_model"] = model("llama")  # seed 0: the policy's initial weights
    if case.peft:
        from peft import LoraConfig

        options["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return trainer_cls(**{**options, **kwargs})


def results(trainer) -> dict:
    """Per-step loss, grad_norm and TRL's DPO metrics, evaluation rows, and the final (trainable) parameters."""
    history = trainer.state.log_history
    logs = [(h["step"], h["loss"], h["grad_norm"]) for h in history if "loss" in h]
    metrics = {key: [(h["step"], h[key]) for h in history if key in h] for key in DPO_METRICS}
    evals = {
        key: [(h["step"], h[key]) for h in history if key in h]
        for key in ("eval_loss", *(f"eval_{m}" for m in DPO_METRICS if m != "num_tokens"))
    }
    params = {n: p.detach().float().cpu().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return {"log": logs, "metrics": metrics, "eval": evals, "params": params}


def reference(out: str, name: str) -> None:
    """TRL's own DPOTrainer in one process on the whole step's pairs."""
    from trl import DPOTrainer

    trainer = build(name, os.path.join(out, "reference", name), DPOTrainer, reference=True)
    trainer.train()
    save(os.path.join(out, "reference", f"{name}.pt"), results(trainer))


def parallel(out: str, name: str) -> None:
    """seqpar's DPO trainer under torchrun (this process's part of the job)."""
    import torch.distributed as dist

    import seqpar
    import seqpar.hf

    case = DPO_CASES[name]
    if case.parallelism:
        options = {"args": {"parallelism_config": parallelism_config(case.parallelism)}}
    else:
        options = {"sequence_parallel": seqpar.hf.SequenceParallelConfig(sp_size=case.sp_size, strategy=case.strategy)}
    trainer = build(name, os.path.join(out, name), seqpar.hf.SequenceParallelDPOTrainer, False, **options)
    trainer.train()
    found = results(trainer)
    found["strategy"] = seqpar.last_attention_choice(trainer.model).strategy
    found["sp_size"] = trainer.sp_mesh.sp_size
    if dist.get_rank() == 0:
        save(os.path.join(out, f"{name}.pt"), found)


def refusals(out: str) -> None:
    """Settings and batches the DPO trainer refuses: SeqparInputError on every rank (each records its messages)."""
    import torch.distributed as dist
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    import seqpar.hf
    from seqpar.errors import SeqparInputError

    world, where = dist.get_world_size(), os.path.join(out, "dpo_x")
    cls = seqpar.hf.SequenceParallelDPOTrainer

    def trainer(sp: int = world, **kwargs):
        config = seqpar.hf.SequenceParallelConfig(sp_size=sp)
        return build("dpo_sp2", where, cls, False, sequence_parallel=config, **kwargs)

    def left_padded_on_one_rank(examples):
        batch = DataCollatorForPreference(pad_token_id=0)(examples)
        if dist.get_rank() == world - 1:  # one rank only: the others must raise too
            batch["attention_mask"][:, 0] = 0
        return batch

    def mixtral():
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(tiny_config("mixtral"))

    vision = pairs(4, 3).add_column("images", [[]] * 4)
    checks = {
        "compute_metrics": lambda: trainer(compute_metrics=lambda prediction: {}),
        "uneven replicas": lambda: trainer(sp=1, train_dataset=pairs(PAIRS - 1, 1)),
        "left padding on one rank": lambda: trainer(data_collator=left_padded_on_one_rank).train(),
        "router loss": lambda: trainer(model=mixtral(), ref_model=mixtral()),
        "vision dataset": lambda: trainer(train_dataset=vision),
    }
    messages = {}
    for what, make in checks.items():
        try:
            make()
            messages[what] = "no SeqparInputError"
        except SeqparInputError as error:
            messages[what] = str(error)
    gathered = [None] * world
    dist.all_gather_object(gathered, messages)
    if dist.get_rank() == 0:
        save(os.path.join(out, "dpo_refusals.pt"), gathered)
