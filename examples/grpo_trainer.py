"""TRL's GRPOTrainer with prompts + completions split over the ranks (seqpar.hf.SequenceParallelGRPOTrainer).

    torchrun --nproc-per-node 2 examples/grpo_trainer.py
    torchrun --nproc-per-node 4 examples/grpo_trainer.py --sp 2   # 2 data-parallel replicas x sp 2

Each prompt is a long "document" of words; the reward of a completion is the share of its words that occur
in the document (a copying task a small model learns), minus a little for each missing word up to 16. Each
sequence-parallel group samples its completions once with the whole model; the log-probabilities, the
clipped loss and the KL term to the reference model run on the split sequence. A word-level tokenizer and a
small Llama built here, nothing downloaded; CPU and gloo. About a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import transformers
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from trl import GRPOConfig

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


def documents(count: int, seed: int) -> Dataset:
    """Prompts of 200-400 words drawn from a per-document set of 24 words."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        words = torch.randint(4, VOCAB, (24,), generator=g)
        n = int(torch.randint(200, 400, (1,), generator=g))
        picks = words[torch.randint(0, 24, (n,), generator=g)]
        rows.append({"prompt": " ".join(f"w{int(w)}" for w in picks)})
    return Dataset.from_list(rows)


def copy_reward(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """Share of the completion's words found in its prompt, minus 0.02 per word short of 16."""
    rewards = []
    for prompt, completion in zip(prompts, completions):
        seen, words = set(prompt.split()), completion.split()
        share = sum(w in seen for w in words) / max(len(words), 1)
        rewards.append(share - 0.02 * max(16 - len(words), 0))
    return rewards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sp", type=int, default=None, help="ranks per sequence (default: all of them)")
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--output-dir", default="runs/grpo_trainer")
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
    where = os.path.join(args.output_dir, "initial")  # TRL builds its reference model from the policy's path
    if int(os.environ.get("RANK", "0")) == 0 and not os.path.exists(os.path.join(where, "config.json")):
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(where)
    grpo_args = GRPOConfig(
        output_dir=args.output_dir,
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=8,  # completions per data-parallel replica, shared by its sp ranks
        num_generations=4,
        max_completion_length=16,
        gradient_accumulation_steps=1,
        beta=0.02,  # a KL term to the initial model
        loss_type="dapo",
        learning_rate=2e-3,
        max_steps=args.max_steps,
        logging_steps=max(1, args.max_steps // 6),
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    if torch.distributed.is_available() and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")  # before loading: rank 0 has just saved the model
    torch.distributed.barrier()
    trainer = seqpar.hf.SequenceParallelGRPOTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(where),
        reward_funcs=copy_reward,
        args=grpo_args,
        train_dataset=documents(256, seed=0),
        processing_class=word_tokenizer(),
        sequence_parallel=seqpar.hf.SequenceParallelConfig(sp_size=args.sp),
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    if trainer.is_world_process_zero():
        print(
            f"sp {trainer.sp_mesh.sp_size} x dp {trainer.dp_size}: reward {logs[0]['reward']:.3f} -> "
            f"{logs[-1]['reward']:.3f}, loss {logs[-1]['loss']:.4f}, kl {logs[-1]['kl']:.4f}"
        )
        result = {
            "sp": trainer.sp_mesh.sp_size,
            "dp": trainer.dp_size,
            "steps": trainer.state.global_step,
            "first_reward": logs[0]["reward"],
            "last_reward": logs[-1]["reward"],
            "last_loss": logs[-1]["loss"],
        }
        with open(os.path.join(args.output_dir, "result.json"), "w") as f:
            json.dump(result, f)
    trainer.accelerator.end_training()  # tears the process group down before the interpreter exits


if __name__ == "__main__":
    main()
