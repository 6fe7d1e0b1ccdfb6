"""TRL's SFTTrainer with packed sequences split over the ranks (seqpar.hf.SequenceParallelSFTTrainer).

    accelerate launch --multi_gpu --num_processes 2 examples/sft_trainer.py  # its torchrun launcher; CPU here
    torchrun --nproc-per-node 2 examples/sft_trainer.py
    torchrun --nproc-per-node 4 examples/sft_trainer.py --sp 2              # 2 data-parallel replicas x sp 2

Prompt-completion data: the prompt is a long "document" of words, the completion its summary (every 8th
word). SFTConfig(packing=True) packs the tokenized examples into rows of ``max_length`` tokens (best-fit
decreasing, padding-free: position ids restart at every example) and the loss covers the completions only.
seqpar splits each packed row over the ranks of a sequence-parallel group and keeps the examples apart in
attention. A word-level tokenizer and a small Llama built here, nothing downloaded; CPU and gloo. About a
minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import transformers
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from trl import SFTConfig

import seqpar.hf

VOCAB = 256  # <pad> <bos> <eos> <unk>, then the words w4 .. w255


def word_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Whitespace-separated words w4..w255 plus four special tokens."""
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


def summarisation_dataset(count: int, seed: int) -> Dataset:
    """Prompt: a document of 96-320 words, each mostly following from the previous one; completion: every 8th word."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        n = int(torch.randint(96, 320, (1,), generator=g))
        jumps = torch.rand(n, generator=g) < 0.15
        random_words = torch.randint(4, VOCAB, (n,), generator=g).tolist()
        words = [random_words[0]]
        for i in range(1, n):
            words.append(random_words[i] if jumps[i] else 4 + (words[-1] * 7 + 3) % (VOCAB - 4))
        prompt = " ".join(f"w{w}" for w in words)
        rows.append({"prompt": prompt + " ", "completion": " ".join(f"w{w}" for w in words[::8])})
    return Dataset.from_list(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sp", type=int, default=None, help="ranks per sequence (default: all of them)")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--output-dir", default="runs/sft_trainer")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    sft_args = SFTConfig(
        output_dir=args.output_dir,
        use_cpu=True,
        bf16=False,
        packing=True,  # best-fit decreasing into rows of max_length, padding-free
        max_length=1024,
        per_device_train_batch_size=1,  # packed rows per data-parallel replica, shared by its sp ranks
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        warmup_steps=5,
        max_steps=args.max_steps,
        logging_steps=max(1, args.max_steps // 8),
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = seqpar.hf.SequenceParallelSFTTrainer(
        model=model,
        args=sft_args,
        train_dataset=summarisation_dataset(512, seed=0),
        eval_dataset=summarisation_dataset(16, seed=1),
        processing_class=word_tokenizer(),
        sequence_parallel=seqpar.hf.SequenceParallelConfig(sp_size=args.sp),
    )
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if trainer.is_world_process_zero():
        print(
            f"sp {trainer.sp_mesh.sp_size} x dp {trainer.dp_size}: completion loss {losses[0]:.3f} -> "
            f"{losses[-1]:.3f}, eval loss {eval_loss:.3f}"
        )
        result = {
            "sp": trainer.sp_mesh.sp_size,
            "dp": trainer.dp_size,
            "steps": trainer.state.global_step,
            "first_loss": losses[0],
            "last_loss": losses[-1],
            "eval_loss": eval_loss,
        }
        with open(os.path.join(args.output_dir, "result.json"), "w") as f:
            json.dump(result, f)
    trainer.accelerator.end_training()  # tears the process group down before the interpreter exits


if __name__ == "__main__":
    main()
