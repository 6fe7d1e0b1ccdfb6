"""transformers.Trainer with every packed row's tokens split over the ranks (seqpar.hf.SequenceParallelTrainer).

    torchrun --nproc-per-node 2 examples/hf_trainer.py                      # sp 2: both ranks share each row
    accelerate launch --multi_gpu --num_processes 2 examples/hf_trainer.py   # its torchrun launcher; CPU here
    torchrun --nproc-per-node 4 examples/hf_trainer.py --sp 2               # 2 data-parallel replicas x sp 2

A synthetic long-document summarisation task: each example is a document of random words, a separator and
its summary (every 8th word of the document). DataCollatorWithFlattening
packs the examples of a batch into one row whose position ids restart at every document, and seqpar keeps
the documents apart in attention. A small Llama with random weights, nothing downloaded; CPU and gloo (on
GPUs, torchrun picks NCCL: drop ``use_cpu``). About a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import transformers

import seqpar.hf

VOCAB, BOS, SEP, EOS = 256, 1, 2, 3  # words are ids 4..255


def summarisation_examples(count: int, seed: int) -> list[dict[str, list[int]]]:
    """Documents of 96-320 words, a separator, and their summary (every 8th word).

    A word mostly follows from the one before it (a fixed map, with 15% random jumps), so the model has
    something to learn in a few dozen steps; the summary can only be copied from far back in the document.
    """
    g = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(count):
        n = int(torch.randint(96, 320, (1,), generator=g))
        jumps = torch.rand(n, generator=g) < 0.15
        random_words = torch.randint(4, VOCAB, (n,), generator=g).tolist()
        words = [random_words[0]]
        for i in range(1, n):
            words.append(random_words[i] if jumps[i] else 4 + (words[-1] * 7 + 3) % (VOCAB - 4))
        examples.append({"input_ids": [BOS, *words, SEP, *words[::8], EOS]})  # labels: the inputs (collator)
    return examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sp", type=int, default=None, help="ranks per sequence (default: all of them)")
    parser.add_argument("--strategy", default="auto", help="auto, ring, ulysses, allgather or hybrid")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--output-dir", default="runs/hf_trainer")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    training_args = transformers.TrainingArguments(
        output_dir=args.output_dir,
        use_cpu=True,
        per_device_train_batch_size=4,  # examples per data-parallel replica, shared by its sp ranks
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        warmup_steps=5,
        max_steps=args.max_steps,
        logging_steps=max(1, args.max_steps // 8),
        eval_strategy="steps",
        eval_steps=20,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = seqpar.hf.SequenceParallelTrainer(
        model=model,
        args=training_args,
        train_dataset=summarisation_examples(1024, seed=0),
        eval_dataset=summarisation_examples(16, seed=1),
        data_collator=transformers.DataCollatorWithFlattening(return_position_ids=True),
        sequence_parallel=seqpar.hf.SequenceParallelConfig(sp_size=args.sp, strategy=args.strategy),
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
