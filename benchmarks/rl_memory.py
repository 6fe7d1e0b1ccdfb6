"""Per-rank peak memory of one DPO and one GRPO optimizer step of seqpar.hf's trainers, by sp and completion length.

    python -m benchmarks.rl_memory --json rl_memory.json                 # sp 1 2 4, completions of 2K, 4K, 8K tokens
    python -m benchmarks.rl_memory --trainers dpo --sp 1 2 --lengths 1024 # small, quick

Each (trainer, sp) is one torchrun job of ``SequenceParallelDPOTrainer`` or ``SequenceParallelGRPOTrainer`` on a
Llama built from its config (fp32, AdamW, TRL's default activation checkpointing, 1 thread per rank) whose
large allocations are served by mmap (``seqpar.bench.measure.MEMORY_RUN_ENV``), so that the resident set
tracks live tensors. A warm-up step on short rows allocates AdamW's state; then one optimizer step per
completion length, shortest first, each holding one preference pair (DPO) or one group of two completions
(GRPO) of that many tokens after a 16-token prompt. A step's figure is the growth of the resident-set peak
(VmHWM) during it, above the resident set before it, on the rank where it is largest. GRPO's completions are
fixed tokens replayed through TRL's ``rollout_func`` (no sampling), so its step is the scoring (reference
log-probabilities) and training pass. Beside each: ``seqpar.estimate_memory``'s ``step_peak`` (Note [RL steps
in the estimate]).

Note [RL steps in the estimate]
    A DPO step runs its pair as one micro-batch of two rows (chosen, rejected) of prompt + completion tokens:
    the policy's forward, the reference model's forward without gradient (while the policy's checkpointed layer
    inputs are held), the policy's backward, clipping and AdamW. A GRPO step with ``beta > 0`` runs the
    reference forward without gradient on the group's rows, then the policy's forward and backward on them (two
    rows: ``per_device_train_batch_size=2``, one micro-batch). Both map onto ``estimate_memory(config, width,
    ParallelDims(sp_size=sp), micro_batch=2, features=("checkpointing", "chunked_loss"), loss_chunk=4096,
    dp_mode="ddp", keep_gradients=False)``: ``width`` is the padded row the trainer split (measured in the run),
    checkpointing is TRL's default, and TRL's fused LM head scores 4096 positions at a time without whole
    logits, which the estimator's chunked loss stands for; the Trainer frees gradients between steps
    (``zero_grad(set_to_none=True)``); the reference model's and DDP's buffers live between steps, so they are
    in neither figure. Not in the estimate: the reference forward (no gradient: one layer's tensors at a time,
    below the backward's recomputed layer); TRL's per-token tensors (a few floats per token of the whole row, on
    every rank). Where it misses: TRL's fused head on the CPU (the torch fallback of its Triton kernel) holds
    more fp32 ``min(N, 4096) x vocab`` blocks (N: positions on the rank) than the three the chunked loss counts
    (the probe's figures: docs/guides/preference-and-rl.md, "Memory per rank"). Above the layers' backward they
    set the peak, and do not shrink with sp while N > 4096: see the record's vocab-512 run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import transformers

import seqpar
from benchmarks import provenance, python_path
from seqpar.bench.measure import MEMORY_RUN_ENV, write_slowest
from seqpar.runtime.memory import reset_resident_peak, resident_mb

__all__ = ["main", "table"]

TRAINERS = ("dpo", "grpo")
PROMPT = 16  # prompt tokens of every row
WARMUP = 64  # completion tokens of the warm-up step
LOSS_CHUNK = 4096  # positions TRL's fused LM head projects at a time (trl.kernels.chunked_logprob)
_MB = 2**20


def _llama(cfg: dict) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=cfg["hidden"],
        intermediate_size=3 * cfg["hidden"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["heads"] // 2,
        vocab_size=cfg["vocab"],
        max_position_embeddings=PROMPT + 2 * max(cfg["lengths"]) + 64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )


def _tokenizer(vocab: int) -> transformers.PreTrainedTokenizerFast:
    """Whitespace-separated words w2..w{vocab-1}, <pad> (0) and <eos> (1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _text(n: int, vocab: int, seed: int) -> str:  # the words of _ids
    return " ".join(f"w{i}" for i in _ids(n, vocab, seed))


class _StepPeaks(transformers.TrainerCallback):
    """Each optimizer step's resident-set peak growth above the resident set before it, in MiB."""

    def __init__(self) -> None:
        self.growth: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.before = resident_mb("VmRSS")
        reset_resident_peak()

    def on_step_end(self, args, state, control, **kwargs):
        self.growth.append(resident_mb("VmHWM") - self.before)


def _common_args(cfg: dict, out: str, steps: int) -> dict:
    return dict(
        output_dir=out, use_cpu=True, report_to="none", disable_tqdm=True, save_strategy="no", logging_steps=1,
        max_steps=steps, gradient_accumulation_steps=1, learning_rate=1e-5, optim="adamw_torch",
        lr_scheduler_type="constant", seed=0, bf16=False,
    )  # fmt: skip


def _dpo(cfg: dict, out: str, meter: _StepPeaks, config) -> object:
    from datasets import Dataset
    from trl import DPOConfig

    lengths = [WARMUP, *cfg["lengths"]]
    rows = [
        {"prompt": _text(PROMPT, cfg["vocab"], k), "chosen": _text(n, cfg["vocab"], 100 + k),
         "rejected": _text(n, cfg["vocab"], 200 + k)}
        for k, n in enumerate(lengths)
    ]  # fmt: skip
    args = DPOConfig(
        **_common_args(cfg, out, len(lengths)), per_device_train_batch_size=1, max_length=None,
        train_sampling_strategy="sequential", beta=0.1,
    )  # fmt: skip
    models = []
    for _ in range(2):  # the policy and its reference, the same initial weights
        torch.manual_seed(0)
        models.append(transformers.AutoModelForCausalLM.from_config(_llama(cfg), attn_implementation="sdpa"))
    return seqpar.hf.SequenceParallelDPOTrainer(
        model=models[0], ref_model=models[1], args=args, train_dataset=Dataset.from_list(rows),
        processing_class=_tokenizer(cfg["vocab"]), sequence_parallel=config, callbacks=[meter],
    )  # fmt: skip


def _reward(completion_ids, **kwargs) -> list[float]:
    return [float(sum(c) % 7) for c in completion_ids]


def _grpo(cfg: dict, out: str, meter: _StepPeaks, config) -> object:
    from datasets import Dataset
    from trl import GRPOConfig

    lengths = [WARMUP, *cfg["lengths"]]
    where = os.path.join(out, "model")  # TRL builds the reference model from the policy's path
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(_llama(cfg)).save_pretrained(where)
    dist.barrier()
    served = []

    def rollout(prompts: list, trainer) -> dict:  # fixed completions: the k-th step gets lengths[k] tokens
        n = lengths[len(served)]
        served.append(n)
        ids = trainer.processing_class(text=prompts)["input_ids"]
        return {"prompt_ids": ids, "completion_ids": [_ids(n, cfg["vocab"], 300 + i) for i in range(len(ids))],
                "logprobs": None}  # fmt: skip

    args = GRPOConfig(
        **_common_args(cfg, out, len(lengths)), per_device_train_batch_size=2, num_generations=2,
        max_completion_length=max(lengths), beta=0.04, shuffle_dataset=False,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(where, attn_implementation="sdpa")
    return seqpar.hf.SequenceParallelGRPOTrainer(
        model=model, reward_funcs=_reward, args=args, rollout_func=rollout,
        train_dataset=Dataset.from_dict({"prompt": [_text(PROMPT, cfg["vocab"], k) for k in range(8)]}),
        processing_class=_tokenizer(cfg["vocab"]), sequence_parallel=config, callbacks=[meter],
    )  # fmt: skip


def _row_width(inputs: dict) -> int:
    """The widest row of a micro-batch as the trainer splits it (DPO: padded pairs; GRPO: prompt + completion)."""
    if "prompt_mask" in inputs:
        return int((inputs["prompt_mask"].sum(1) + inputs["completion_mask"].sum(1)).max())
    return int(inputs["input_ids"].shape[1])


def _worker(trainer_name: str, cfg: dict, out: str) -> None:
    import seqpar.hf

    dist.init_process_group("gloo")
    config = seqpar.hf.SequenceParallelConfig(sp_size=dist.get_world_size(), strategy=cfg["strategy"])
    meter = _StepPeaks()
    build = _dpo if trainer_name == "dpo" else _grpo
    trainer = build(cfg, os.path.join(os.path.dirname(out), trainer_name), meter, config)
    widths, compute_loss = [], trainer.compute_loss

    def recorded(model, inputs, *args, **kwargs):
        widths.append(_row_width(inputs))
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = recorded
    trainer.train()
    strategy = seqpar.last_attention_choice(trainer.model).strategy
    for k, growth in enumerate(meter.growth[1:], start=1):  # the largest rank's growth, step by step
        extra = {"width": widths[k], "strategy": strategy, "completion": cfg["lengths"][k - 1]}
        write_slowest(f"{out}.{k}", 0.0, growth, **extra)
    dist.destroy_process_group()


def _launch(trainer_name: str, sp: int, cfg: dict, tmp: str) -> list[dict]:
    out = os.path.join(tmp, f"{trainer_name}_sp{sp}.json")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(sp)]
    command += ["-m", "benchmarks.rl_memory", "--worker", trainer_name, "--out", out, "--cfg", json.dumps(cfg)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path(), **MEMORY_RUN_ENV}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{trainer_name} at sp {sp} failed:\n{(done.stdout + done.stderr)[-4000:]}")
    found = []
    for k in range(1, len(cfg["lengths"]) + 1):
        with open(f"{out}.{k}") as f:
            found.append(json.load(f))
    return found


def _estimate(cfg: dict, sp: int, width: int, strategy: str) -> seqpar.MemoryEstimate:
    """Note [RL steps in the estimate]: two rows of the padded width, checkpointing and the fused head's chunks."""
    padded = -(-width // (2 * sp)) * 2 * sp  # the zigzag layout pads rows to a multiple of 2 sp
    strategy = "auto" if sp == 1 else strategy  # one rank: "local" attention, no exchange
    return seqpar.estimate_memory(
        _llama(cfg), padded, seqpar.ParallelDims(sp_size=sp), micro_batch=2,
        features=("checkpointing", "chunked_loss"),
        loss_chunk=LOSS_CHUNK, strategy=strategy, dp_mode="ddp", keep_gradients=False,
    )  # fmt: skip


def table(records: list[dict]) -> str:
    """The Markdown table of ``benchmarks.rl_memory`` records: measured and estimated growth, ratios to sp 1."""
    low = {(r["trainer"], r["completion"]): r for r in records if r["sp"] == min(x["sp"] for x in records)}
    lines = ["| trainer | completion | sp | tokens/rank | measured (MB) | vs sp 1 | estimate (MB) | est / measured |"]
    lines.append("|---|---|---|---|---|---|---|---|")
    for r in records:
        base = low.get((r["trainer"], r["completion"]))
        ratio = f"{r['peak_mb'] / base['peak_mb']:.2f}" if base else "-"
        lines.append(
            f"| {r['trainer']} | {r['completion']} | {r['sp']} | {r['tokens_per_rank']} | {r['peak_mb']} | {ratio} "
            f"| {r['estimate_mb']} | {r['estimate_mb'] / r['peak_mb']:.2f} |"
        )
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.rl_memory", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS))
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4], help="sequence-parallel degrees")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192], help="completion tokens")
    parser.add_argument("--hidden", type=int, default=128, help="Llama hidden size (intermediate 3x)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4, help="attention heads (key/value heads: half)")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--strategy", default="auto", help="attention strategy")
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--worker", choices=TRAINERS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--cfg", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.worker:
        torch.set_num_threads(1)
        _worker(args.worker, json.loads(args.cfg), args.out)
        return 0
    cfg = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "vocab", "strategy")}
    cfg["lengths"] = sorted(args.lengths)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.trainers:
            for sp in args.sp:
                for got in _launch(name, sp, cfg, tmp):
                    estimate = _estimate(cfg, sp, got["width"], got["strategy"])
                    records.append({
                        "trainer": name, "sp": sp, "completion": got["completion"], "width": got["width"],
                        "tokens_per_rank": estimate.tokens_per_rank, "strategy": got["strategy"],
                        "peak_mb": round(got["growth_mb"], 1), "estimate_mb": round(estimate.step_peak / _MB, 1),
                        "moment": estimate.moment, **provenance("rl_memory", argv),
                    })  # fmt: skip
                print(f"  {name} sp {sp}: {[r['peak_mb'] for r in records[-len(cfg['lengths']) :]]} MB", flush=True)
                if args.json:  # after every job, so an interrupted run keeps what it measured
                    with open(args.json, "w") as f:
                        json.dump(records, f, indent=1)
    print(
        f"\nLlama {args.layers}x{args.hidden}, {args.heads} heads, vocab {args.vocab}, fp32, AdamW, checkpointing; "
        f"per-rank peak growth of one optimizer step (CPU resident set)"
    )
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
