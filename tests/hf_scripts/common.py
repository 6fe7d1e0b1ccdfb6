"""The runs that tests/test_hf.py compares: tiny models, documents, collators and Trainer settings by case name.

Imports no seqpar module, so that the one-process reference runs without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import numpy as np
import torch
import transformers

from seqpar.models.zoo import tiny_config as zoo_config
from tests._models import VOCAB, tiny_config

__all__ = [
    "CASES",
    "DEEPSPEED_CASES",
    "METRICS",
    "RUN_FIELDS",
    "Case",
    "documents",
    "padded_collator",
    "parallelism_config",
    "results",
    "tokenizer",
    "training_args",
    "zero",
]

STEPS = 4  # the evaluating cases evaluate at step 3; the resume case saves at 3 and resumes to 4


@dataclasses.dataclass(frozen=True)
class Case:
    """One training run: the same settings for the one-process reference and the sequence-parallel run."""

    world: int
    kind: str = "llama"
    sp_size: int = 2
    ulysses_size: int = 1
    strategy: str = "auto"
    batch: int = 2  # sequences per data-parallel replica per micro-batch
    # "flatten" (packed documents), "padded" (right padding), "sft" (TRL's SFTTrainer on token rows), "vlm" (a
    # multimodal collator's images) or "sft_vlm" (TRL's SFTTrainer on a vision dataset with a local processor)
    collator: str = "flatten"
    optim: str = "sgd"
    extra: tuple = ()  # more TrainingArguments / SFTConfig fields
    eval_batch: int = 0  # 0: no evaluation
    reference: str = ""  # compare with another case's reference (same data and settings)
    fsdp: bool = False  # the seqpar run loads its model FSDP2-sharded over every process (DistributedConfig)
    layout: str = "zigzag"  # SequenceParallelConfig(layout=...) of the seqpar run (the reference has none)
    parallelism: str = ""  # the seqpar run takes parallelism_config(name) in TrainingArguments, no sequence_parallel=
    metrics: bool = False  # evaluate with compute_metrics=token_metrics, preprocess_logits_for_metrics=argmax
    rows: int = 96  # training documents (the steps take 16: 8 make 2 epochs)

    @property
    def sft(self) -> bool:
        """Whether the case trains with TRL's SFTTrainer (SFTConfig, its own collator)."""
        return self.collator.startswith("sft")

    @property
    def dp(self) -> int:
        return self.world // self.sp_size


RANDOM_ORDER = (("train_sampling_strategy", "random"),)
ONE_MICRO_BATCH = (("gradient_accumulation_steps", 1),)


def zero(stage: int) -> tuple:
    """TrainingArguments(deepspeed=...) with DeepSpeed's ZeRO ``stage``, "auto" sizes filled in by transformers.

    The torch SGD optimizer is not one DeepSpeed has tested with ZeRO: ``zero_allow_untested_optimizer``.
    """
    config = {
        "zero_optimization": {"stage": stage},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True,
    }
    return (("deepspeed", config),)


SFT_PACKING = (("packing", True), ("max_length", 40), ("activation_checkpointing", False))
SFT_MOE = (("max_length", 40), ("activation_checkpointing", False), ("router_aux_loss_coef", 0.1))
CASES = {
    "sp2": Case(2, eval_batch=4),
    "sp2_adamw": Case(2, kind="qwen2", optim="adamw_torch"),
    "sp2_padded": Case(2, kind="mistral", strategy="ring", collator="padded"),
    # packed documents of uneven lengths: each micro-batch's own layout, not zigzag's (the test checks)
    "sp2_balanced": Case(2, eval_batch=4, layout="balanced", reference="sp2"),
    "sp2_placed": Case(2, eval_batch=4, layout="placed", reference="sp2"),  # rows reordered and padded per batch
    "sp2_checkpointing": Case(2, extra=(("gradient_checkpointing", True),), reference="sp2"),
    "sp2_bf16": Case(2, extra=(("bf16", True),), reference="sp2"),
    "sft_packing": Case(2, collator="sft", extra=SFT_PACKING, eval_batch=2),
    "sft_padding_free": Case(
        2, collator="sft", extra=(("padding_free", True), ("max_length", None), ("activation_checkpointing", False))
    ),
    "sp2_fsdp2": Case(2, eval_batch=4, fsdp=True, reference="sp2"),
    "gemma3_sp2": Case(2, kind="gemma3", eval_batch=2),
    "gemma2_sp2": Case(2, kind="gemma2", strategy="ring"),  # attention logits soft-capped at 1 (and final logits)
    # one KV head, degree 2: ulysses with the KV head copied (named: on these packed rows "auto" takes the ring)
    "kv1_sp2": Case(2, kind="llama_kv1", strategy="ulysses"),
    # router loss (output_router_logits, weight 0.1): right-padded rows (attention_mask) and seqpar's layout padding
    "mixtral_sp2": Case(2, kind="mixtral", collator="padded", eval_batch=2),  # eval_loss adds the router loss
    # TRL's router loss (divided by the accumulation steps; aux_loss logged), learned sinks, sliding layers; right
    # padding, not packing: transformers' gpt-oss builds its masks without the position ids, so its packed rows
    # would attend across documents where seqpar keeps them apart
    "sft_gpt_oss": Case(2, kind="gpt_oss", collator="sft", extra=SFT_MOE, eval_batch=2),
    # a hybrid (gated DeltaNet, experts) through TRL's SFT: right padding, since transformers' one process carries
    # the recurrent state across packed documents, which seqpar keeps apart
    "sft_hybrid_qwen3_next": Case(2, kind="qwen3_next", collator="sft", extra=SFT_MOE[:2], eval_batch=2),
    "sp3_ring": Case(3, sp_size=3, strategy="ring"),
    # balanced: the replicas' layouts differ; the evaluation's short replica runs a padding batch
    "dp2_sp2": Case(4, batch=1, extra=(("train_sampling_strategy", "random"),), eval_batch=2, layout="balanced"),
    "mixtral_dp2_sp2": Case(4, kind="mixtral", batch=1, extra=RANDOM_ORDER),  # packed rows; one micro-batch: dp rows
    "ulysses2_ring2": Case(4, sp_size=4, ulysses_size=2, strategy="hybrid"),
    "dp2_sp2_fsdp2": Case(  # and activation checkpointing inside the FSDP2 units
        4,
        batch=1,
        extra=(("train_sampling_strategy", "random"), ("gradient_checkpointing", True)),
        eval_batch=2,
        fsdp=True,
        reference="dp2_sp2",
    ),
    "kv1_ulysses2_ring2": Case(4, kind="llama_kv1", sp_size=4, ulysses_size=2),  # auto: hybrid, KV head copied
    # the Trainer's LabelSmoother, normalised over the step's tokens; the evaluation loss is smoothed too
    "sp2_label_smoothing": Case(2, extra=(("label_smoothing_factor", 0.1),), eval_batch=4),
    # right-padded batches of different widths (3 rows, the last batch 1): the -100 padding across batches
    "sp2_metrics": Case(2, kind="mistral", strategy="ring", collator="padded", eval_batch=3, metrics=True),
    # replicas' batches interleaved back into the dataset's order; each batch gathered with its own layout
    "dp2_sp2_metrics": Case(4, batch=1, eval_batch=3, metrics=True, layout="balanced"),
    # every rank draws one process's [B, S, H] noise (S: the packed row, not a multiple of the layout)
    "sp2_neftune": Case(2, extra=(("neftune_noise_alpha", 5.0),)),
    # accelerate's ParallelismConfig as its guides build it, in TrainingArguments(parallelism_config=...)
    "pc_sp2": Case(2, parallelism="sp2", reference="sp2"),
    "pc_cp2_alltoall": Case(2, parallelism="cp2_alltoall", reference="sp2"),
    "pc_dp2_sp2": Case(4, batch=1, extra=RANDOM_ORDER, parallelism="dp2_sp2", reference="dp2_sp2"),
    "pc_dp2_cp2": Case(4, batch=1, extra=RANDOM_ORDER, eval_batch=2, parallelism="dp2_cp2", reference="dp2_sp2"),
    # DeepSpeed as the data-parallel engine (Note [DeepSpeed under the Trainer]); ZeRO-3 also evaluates
    "sp2_zero1": Case(2, extra=zero(1), reference="sp2"),
    "sp2_zero2": Case(2, extra=zero(2), reference="sp2"),
    "sp2_zero3": Case(2, extra=zero(3), eval_batch=4, reference="sp2"),
    # hybrids (Note [mixer adapters]): right-padded rows, not packed ones, since transformers' one process carries
    # a convolution or a recurrence across packed documents; a short convolution (LFM2), gated DeltaNet (Qwen3-Next)
    # and Mamba2 (GraniteMoeHybrid), each at sp 2 and at sp 3 with the ring
    **{
        f"{kind}_sp{sp}": Case(sp, kind=kind, sp_size=sp, strategy="auto" if sp == 2 else "ring", collator="padded")
        for kind in ("lfm2", "qwen3_next", "granitemoehybrid")
        for sp in (2, 3)
    },
    "qwen3_next_dp2_sp2": Case(4, kind="qwen3_next", batch=1, collator="padded"),  # DDP over dp x sp
    # families without an entry (READ_KINDS): OLMo 3's sliding windows and StarCoder2 on packed rows, GLM-4.5-style
    # experts on padded ones
    "olmo3_sp2": Case(2, kind="olmo3", eval_batch=2),
    "starcoder2_sp2": Case(2, kind="starcoder2", strategy="ring"),
    "glm4_moe_sp2": Case(2, kind="glm4_moe", collator="padded"),
    # Llama 4: chunked layers and a NoPE layer whose query temperature counts the row's tokens, on packed rows over 2
    # epochs
    "llama4_sp2": Case(2, kind="llama4_text", eval_batch=2, rows=8),
    # DeepSeek-V3.2: every layer's indexer keeps 8 keys (Note [indexed attention]) of rows the layout pads, its
    # experts routed per token
    "deepseek_v32_sp2": Case(2, kind="deepseek_v32", rows=8),
    # the same model FSDP2-sharded over the 2 ranks: the adapted mixers live inside the sharded decoder blocks
    "qwen3_next_sp2_fsdp2": Case(2, kind="qwen3_next", collator="padded", fsdp=True, reference="qwen3_next_sp2"),
    # vision-language models on whole rows (Note [whole-row calls]): 4 samples with 1-2 images of different sizes,
    # 2 epochs; Qwen2.5-VL's mRoPE from the grids with 2 right-padded rows per batch, Gemma 3's image blocks; one
    # micro-batch a step (Qwen2.5-VL under the placed layout: its whole rows placed at the text decoder,
    # seqpar_placement)
    "vlm_sp2": Case(2, kind="qwen2_5_vl", collator="vlm", eval_batch=2, extra=ONE_MICRO_BATCH, layout="placed"),
    "vlm_gemma3_dp2_sp2": Case(4, kind="gemma3", collator="vlm", batch=1, extra=ONE_MICRO_BATCH),
    # Gemma 4: 70 soft tokens an image, bidirectional on its sliding layers only, per-layer inputs of the whole row
    "vlm_gemma4_sp2": Case(2, kind="gemma4", collator="vlm", extra=ONE_MICRO_BATCH),
    # two micro-batches a step (of 23 and 18 valid tokens): Qwen2.5-VL takes no num_items_in_batch, so one process
    # averages the micro-batches' own means, which seqpar then does too (Note [micro-batch means]); patch 2, mRoPE
    # sections [1, 1, 2], grids [1, 4, 4] and [1, 4, 8], rows of two images and of one, markers' labels ignored
    "vlm_qwen_patch2_sp2": Case(2, kind="qwen2_5_vl_patch2", collator="vlm", eval_batch=2),
    "vlm_qwen_patch2_sp3_ring": Case(3, kind="qwen2_5_vl_patch2", sp_size=3, strategy="ring", collator="vlm"),
    # one row per replica: a micro-batch's mean is over both replicas' rows, as one process loads them together
    "vlm_qwen_patch2_dp2_sp2": Case(4, kind="qwen2_5_vl_patch2", batch=1, collator="vlm"),
    # TRL's VLM SFT as documented: messages + images, the processor as processing_class (TRL's vision collator),
    # its defaults otherwise (gradient checkpointing on, max_length 1024); at sp 2 two rows a batch, right-padded
    # by TRL's collator, their images at other tokens (per-row image blocks)
    "sft_vlm_sp2": Case(2, kind="gemma3", collator="sft_vlm", batch=2, eval_batch=2, extra=ONE_MICRO_BATCH),
    "sft_vlm_dp2_sp2": Case(4, kind="gemma3", collator="sft_vlm", batch=1, extra=ONE_MICRO_BATCH),
}
METRICS = ("accuracy", "rows", "width", "label_checksum", "pred_checksum", "padded_preds")


DEEPSPEED_CASES = [n for n, c in CASES.items() if any(k == "deepspeed" for k, _ in c.extra)]


def parallelism_config(name: str):
    """accelerate's ``ParallelismConfig`` of a case, written as accelerate's guides write it."""
    from accelerate import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig, TorchContextParallelConfig

    ulysses = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
    return {
        "sp2": lambda: ParallelismConfig(sp_backend="deepspeed", sp_size=2, dp_shard_size=1, sp_handler=ulysses),
        "cp2_alltoall": lambda: ParallelismConfig(
            cp_size=2, cp_handler=TorchContextParallelConfig(cp_comm_strategy="alltoall")
        ),
        "dp2_sp2": lambda: ParallelismConfig(
            dp_replicate_size=2, dp_shard_size=1, sp_size=2, sp_backend="deepspeed", sp_handler=ulysses
        ),
        "dp2_cp2": lambda: ParallelismConfig(
            dp_shard_size=2, cp_size=2, cp_handler=TorchContextParallelConfig(cp_comm_strategy="alltoall")
        ),
    }[name]()


def documents(count: int, seed: int, low: int = 5, high: int = 21) -> list[dict[str, list[int]]]:
    """``count`` token documents of random lengths in [low, high)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=g).tolist()
    return [{"input_ids": torch.randint(2, VOCAB, (n,), generator=g).tolist()} for n in lengths]


def padded_collator(features: list[dict]) -> dict[str, torch.Tensor]:
    """Right-padded rows with an attention mask; labels are the inputs with padding ignored."""
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, f in enumerate(features):
        ids[i, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[i, : len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def argmax_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``preprocess_logits_for_metrics``: the predicted token of every position."""
    return logits.argmax(-1)


def token_metrics(prediction) -> dict[str, float]:
    """``compute_metrics``: next-token accuracy, and checksums of the arrays' shapes, order and -100 padding."""
    preds, labels = prediction.predictions, prediction.label_ids  # [rows, widest], padded with -100
    weights = np.arange(labels.size).reshape(labels.shape) % 9973 + 1  # position-dependent: order matters
    mask = labels[:, 1:] != -100  # the label each position predicts
    hits = preds[:, :-1][mask] == labels[:, 1:][mask]
    return {
        "accuracy": float(hits.mean()),
        "rows": labels.shape[0],
        "width": labels.shape[1],
        "label_checksum": float((labels * weights).sum()),
        "pred_checksum": float((np.where(mask, preds[:, :-1], 0) * weights[:, 1:]).sum()),
        "padded_preds": int((preds == -100).sum()),
    }


def tokenizer():
    """A word-level tokenizer over the tiny vocabulary (TRL needs one for its pad token)."""
    from tokenizers import Tokenizer, models

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")), pad_token="<pad>", eos_token="<eos>"
    )
    return tok


READ_KINDS = ("olmo3", "glm4_moe", "starcoder2", "llama4_text", "deepseek_v32")
"""Families seqpar has no entry for, served by the anatomy read from the model (Note [read anatomy]); their tiny
configs are the zoo's (``seqpar.models.zoo.tiny_config``)."""


def model(kind: str, attn: str = "sdpa"):
    """A tiny model of ``kind`` (as ``tests._models.tiny_config``, or the zoo's for ``READ_KINDS``; ``*_kv1``: one
    key/value head), seed 0."""
    torch.manual_seed(0)
    config = zoo_config(kind) if kind in READ_KINDS else tiny_config(kind.removesuffix("_kv1"))
    if kind.endswith("_kv1"):
        config.num_key_value_heads = 1
    if kind in ("gpt_oss", "gemma2"):  # no SDPA path in transformers (sinks, soft-capping): eager is the reference
        attn = "eager"
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)


# The settings every compared run shares (Trainer, SFT, DPO, GRPO; one process or torchrun): fp32, SGD at a
# constant rate (a gradient off by any factor moves the parameters by that factor), a log line per step.
RUN_FIELDS = dict(
    use_cpu=True,
    report_to="none",
    disable_tqdm=True,
    save_strategy="no",
    logging_steps=1,
    lr_scheduler_type="constant",
    optim="sgd",
    seed=0,
    bf16=False,
)


def training_args(case: Case, out: str, reference: bool, **overrides):
    """TrainingArguments (or SFTConfig) for ``case``; the reference's batch is the whole step's rows."""
    batch = case.batch * (case.dp if reference else 1)
    fields = {
        **RUN_FIELDS,
        "output_dir": out,
        "max_steps": STEPS,
        "per_device_train_batch_size": batch,
        "per_device_eval_batch_size": case.eval_batch or 1,
        "gradient_accumulation_steps": 2,
        "learning_rate": 0.5 if case.optim == "sgd" else 3e-3,
        "optim": case.optim,
        "max_grad_norm": 0.5,  # below the gradient norms here: clipping is active
        "train_sampling_strategy": "sequential",
    }
    if case.eval_batch:
        fields.update(eval_strategy="steps", eval_steps=3)
    fields.update(dict(case.extra), **overrides)
    if case.sft:
        from trl import SFTConfig

        return SFTConfig(**fields)
    return transformers.TrainingArguments(**fields)


def build_trainer(name: str, case: Case, out: str, trainer_cls, reference: bool, **kwargs):
    """The Trainer (class given) for ``case`` with its model, data and collator."""
    train, held_out = documents(case.rows, 1), documents(10, 2)
    if case.collator == "vlm":
        from tests import _vlm_models

        train, held_out = _vlm_models.examples(case.kind, 4, 1), _vlm_models.examples(case.kind, 4, 2)
        kwargs.setdefault("model", _vlm_models.build(case.kind))
        kwargs.setdefault("data_collator", _vlm_models.collator(case.kind))
    if case.collator == "sft_vlm":
        from tests import _vlm_models

        train, held_out = _vlm_models.conversations(4, 1), _vlm_models.conversations(4, 2)
        kwargs.setdefault("model", _vlm_models.build(case.kind))
        kwargs.setdefault("processing_class", _vlm_models.processor(case.kind))
    # before the arguments: under a ZeRO-3 DeepSpeed config transformers would build it partitioned (zero.Init),
    # initialised from another random stream than the one-process reference's
    net = kwargs.pop("model", None) or model(case.kind)
    args = training_args(case, out, reference, **kwargs.pop("args", {}))
    mutate = kwargs.pop("mutate", None)
    if mutate is not None:
        mutate(args)
    common = dict(model=net, args=args, train_dataset=train, **kwargs)
    if case.eval_batch:
        common["eval_dataset"] = held_out
    if case.metrics:
        common.update(compute_metrics=token_metrics, preprocess_logits_for_metrics=argmax_logits)
    if case.sft:
        from datasets import Dataset

        common.update(
            train_dataset=Dataset.from_list(train),
            eval_dataset=Dataset.from_list(held_out) if case.eval_batch else None,
        )
        common.setdefault("processing_class", tokenizer())
    elif case.collator == "padded":
        common.setdefault("data_collator", padded_collator)
    else:
        common.setdefault("data_collator", transformers.DataCollatorWithFlattening(return_position_ids=True))
    return trainer_cls(**common)


def results(trainer) -> dict:
    """Per-step loss and grad_norm, evaluation losses and final parameters (collective under FSDP2)."""
    logs = [(h["step"], h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    evals = [(h["step"], h["eval_loss"]) for h in trainer.state.log_history if "eval_loss" in h]
    metrics = {
        key: [(h["step"], h[key]) for h in trainer.state.log_history if key in h]
        for key in (
            "entropy",
            "mean_token_accuracy",
            "num_tokens",
            "eval_entropy",
            "eval_mean_token_accuracy",
            "aux_loss",
            "eval_aux_loss",
            *(f"eval_{m}" for m in METRICS),
        )
    }
    params = {}
    gathered = contextlib.nullcontext()
    if getattr(trainer, "is_deepspeed_enabled", False):  # ZeRO-3 holds each rank's partition only
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(list(trainer.model.parameters()))
    with gathered:
        for n, p in trainer.model.named_parameters():
            p = p.full_tensor() if hasattr(p, "full_tensor") else p
            params[n] = p.detach().float().cpu().clone()
    wrapped = trainer.model_wrapped
    setup = {
        "wrapper": type(wrapped).__name__,
        "fsdp2": any(hasattr(p, "full_tensor") for p in trainer.model.parameters()),
        "checkpointing": bool(getattr(trainer.model, "is_gradient_checkpointing", False)),
        "mixed_precision": str(trainer.accelerator.mixed_precision),
    }
    return {"log": logs, "eval": evals, "params": params, "setup": setup, "metrics": metrics}


def save(path: str, value: object) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(value, path)
