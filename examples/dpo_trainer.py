"""TRL's DPOTrainer with every chosen and rejected row split over the ranks (seqpar.hf.SequenceParallelDPOTrainer).

    torchrun --nproc-per-node 2 examples/dpo_trainer.py
    torchrun --nproc-per-node 4 examples/dpo_trainer.py --sp 2              # 2 data-parallel replicas x sp 2
    torchrun --nproc-per-node 2 examples/dpo_trainer.py --loss-type ipo     # any of DPOConfig's loss types

Preference pairs: the prompt is a long "document" of words, each mostly following from the previous one by a
fixed rule; the chosen completion continues the rule, the rejected one is random words. The policy and the
reference model (its initial copy) score both completions with the sequence split over the ranks of a
sequence-parallel group; the DPO loss and TRL's metrics (rewards/accuracies, rewards/margins, ...) are those
of one process. A word-level tokenizer and a small Llama built here, nothing downloaded; CPU and gloo. About
a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import copy
import json
import os

import torch
import transformers
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from trl import DPOConfig

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


def follow(word: int) -> int:
    """The rule: the word that usually comes next."""
    return 4 + (word * 7 + 3) % (VOCAB - 4)


def preference_dataset(count: int, seed: int) -> Dataset:
    """Prompts of 200-500 words; chosen: 16-48 words that follow the rule, rejected: as many random words."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        n, m = int(torch.randint(200, 500, (1,), generator=g)), int(torch.randint(16, 48, (1,), generator=g))
        jumps = torch.rand(n, generator=g) < 0.15
        random_words = torch.randint(4, VOCAB, (n + m,), generator=g).tolist()
        words = [random_words[0]]
        for i in range(1, n):
            words.append(random_words[i] if jumps[i] else follow(words[-1]))
        chosen = [follow(words[-1])]
        while len(chosen) < m:
            chosen.append(follow(chosen[-1]))
        text = lambda ws: "".join(f"w{w} " for w in ws)  # noqa: E731  (a trailing space: <eos> stays a word)
        rows.append({"prompt": text(words), "chosen": text(chosen), "rejected": text(random_words[n:])})
    return Dataset.from_list(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sp", type=int, default=None, help="ranks per sequence (default: all of them)")
    parser.add_argument("--loss-type", default="sigmoid", help="DPOConfig.loss_type (sigmoid, ipo, hinge, ...)")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--output-dir", default="runs/dpo_trainer")
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
    reference = copy.deepcopy(model)  # the frozen reference: the policy as it starts
    dpo_args = DPOConfig(
        output_dir=args.output_dir,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        loss_type=[args.loss_type],
        beta=0.1,
        per_device_train_batch_size=2,  # pairs per data-parallel replica, shared by its sp ranks
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        max_steps=args.max_steps,
        logging_steps=max(1, args.max_steps // 6),
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = seqpar.hf.SequenceParallelDPOTrainer(
        model=model,
        ref_model=reference,
        args=dpo_args,
        train_dataset=preference_dataset(240, seed=0),
        eval_dataset=preference_dataset(8, seed=1),
        processing_class=word_tokenizer(),
        sequence_parallel=seqpar.hf.SequenceParallelConfig(sp_size=args.sp),
    )
    trainer.train()
    evaluation = trainer.evaluate()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    if trainer.is_world_process_zero():
        print(
            f"sp {trainer.sp_mesh.sp_size} x dp {trainer.dp_size}: DPO loss {logs[0]['loss']:.3f} -> "
            f"{logs[-1]['loss']:.3f}, reward accuracy {logs[-1]['rewards/accuracies']:.2f}, held-out margin "
            f"{evaluation['eval_rewards/margins']:.3f}"
        )
        result = {
            "sp": trainer.sp_mesh.sp_size,
            "dp": trainer.dp_size,
            "steps": trainer.state.global_step,
            "first_loss": logs[0]["loss"],
            "last_loss": logs[-1]["loss"],
            "eval_loss": evaluation["eval_loss"],
            "eval_reward_accuracy": evaluation["eval_rewards/accuracies"],
        }
        with open(os.path.join(args.output_dir, "result.json"), "w") as f:
            json.dump(result, f)
    trainer.accelerator.end_training()  # tears the process group down before the interpreter exits


if __name__ == "__main__":
    main()
