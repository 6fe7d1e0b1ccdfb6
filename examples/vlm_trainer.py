"""Vision-language SFT with the sequence split over the ranks: TRL's VLM recipe under SequenceParallelSFTTrainer.

    torchrun --nproc-per-node 2 examples/vlm_trainer.py
    torchrun --nproc-per-node 4 examples/vlm_trainer.py --sp 2              # 2 data-parallel replicas x sp 2

A dataset of ``messages`` and ``images`` as TRL's VLM datasets hold them, a Gemma 3 processor as
``processing_class`` (TRL then collates with its vision collator). Every rank of a sequence-parallel group
runs the vision tower on the whole row and merges the image features into it; the text decoder's input is
then split over the group, Gemma 3's image tokens keep their bidirectional attention. A word-level
tokenizer, a real Gemma3Processor and a small Gemma 3 built here, nothing downloaded; CPU and gloo. Under
20 seconds on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch
import transformers
from datasets import Dataset
from PIL import Image
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from trl import SFTConfig

import seqpar.hf

WORDS = 240  # w3 .. w239, then the roles and Gemma 3's markers
SPECIAL = ("<pad>", "<bos>", "<eos>")
MARKS = ("<image_soft_token>", "<start_of_image>", "<end_of_image>", "<start_of_turn>", "<end_of_turn>")
TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ m['role'] }} {% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<start_of_image>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %} "
    "{% endfor %}<end_of_turn> {% endfor %}"
)
IMAGE_TOKENS = 16  # image features per image after Gemma 3's pooling: (32 / 4 patches)^2 pooled to 4 x 4


def processor() -> transformers.Gemma3Processor:
    """A Gemma3Processor over a word-level vocabulary: <pad> <bos> <eos>, w3..w239, the roles, the markers."""
    vocab = {t: i for i, t in enumerate(SPECIAL)} | {f"w{i}": i for i in range(3, WORDS)}
    for token in ("user", "assistant", *MARKS):
        vocab[token] = len(vocab)
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.add_special_tokens([AddedToken(t, special=True) for t in (*SPECIAL, *MARKS)])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        extra_special_tokens={"image_token": MARKS[0], "boi_token": MARKS[1], "eoi_token": MARKS[2]},
    )
    images = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    return transformers.Gemma3Processor(images, tokenizer, chat_template=TEMPLATE, image_seq_length=IMAGE_TOKENS)


def captions(count: int, seed: int) -> Dataset:
    """Each sample: 1-3 images of coloured stripes, the user asks with a few words, the assistant answers with
    the words that name each image's stripe count (learnable from the pixels)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        stripes = rng.integers(1, 8, int(rng.integers(1, 4)))
        images = []
        for n in stripes:
            pixels = np.zeros((32, 32, 3), dtype=np.uint8)
            pixels[:, :, 0] = (np.arange(32)[None, :] * n // 32 % 2) * 255
            images.append(Image.fromarray(pixels))
        question = " ".join(f"w{int(w)}" for w in rng.integers(3, WORDS, int(rng.integers(4, 40))))
        answer = " ".join(f"w{100 + int(n)}" for n in stripes)
        turns = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        rows.append({"messages": turns, "images": images})
    return Dataset.from_list(rows)


def model(proc: transformers.Gemma3Processor) -> transformers.Gemma3ForConditionalGeneration:
    """A two-layer Gemma 3 (sliding and full attention) with a two-layer SigLIP tower, random weights."""
    torch.manual_seed(0)
    tok = proc.tokenizer
    text = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=32,
        layer_types=["sliding_attention", "full_attention"],
        pad_token_id=tok.pad_token_id,
    )
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=4
    )
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=IMAGE_TOKENS,
        image_token_id=tok.image_token_id,
        boi_token_index=tok.boi_token_id,
        eoi_token_index=tok.eoi_token_id,
    )
    return transformers.Gemma3ForConditionalGeneration(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sp", type=int, default=None, help="ranks per sequence (default: all of them)")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--output-dir", default="runs/vlm_trainer")
    args = parser.parse_args()

    proc = processor()
    sft_args = SFTConfig(
        output_dir=args.output_dir,
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=1,  # Gemma 3: one row a batch (one image-block mask per batch)
        per_device_eval_batch_size=1,
        learning_rate=3e-3,
        warmup_steps=3,
        max_steps=args.max_steps,
        logging_steps=max(1, args.max_steps // 6),
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = seqpar.hf.SequenceParallelSFTTrainer(
        model=model(proc),
        args=sft_args,
        train_dataset=captions(256, seed=0),
        eval_dataset=captions(8, seed=1),
        processing_class=proc,
        sequence_parallel=seqpar.hf.SequenceParallelConfig(sp_size=args.sp),
    )
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if trainer.is_world_process_zero():
        print(
            f"sp {trainer.sp_mesh.sp_size} x dp {trainer.dp_size}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
            f"eval loss {eval_loss:.3f}"
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
