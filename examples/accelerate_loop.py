"""Your own accelerate training loop with the sequence split over the ranks: the seqpar recipe, exact loss.

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_loop.py   # its torchrun launcher; CPU here
    torchrun --nproc-per-node 2 examples/accelerate_loop.py
    torchrun --nproc-per-node 4 examples/accelerate_loop.py --sp 2                # 2 data-parallel replicas x sp 2

The recipe: ``Accelerator`` (it wraps the model in DDP over every process), ``seqpar.make_mesh``,
``seqpar.prepare_model`` before ``accelerator.prepare``, a DataLoader that gives every rank the rows of its
data-parallel replica (``seqpar.hf.replica_loader``: no row repeated at an epoch's end; not
``accelerator.prepare``-d, which would shard it per process), ``seqpar.hf.shard_step`` for each optimizer
step's micro-batches (shards plus the step's valid token count over every rank), and
``seqpar.cross_entropy(..., num_valid_tokens=...)`` times ``accelerator.num_processes`` for DDP's average.
The same synthetic summarisation documents as examples/hf_trainer.py, packed by DataCollatorWithFlattening;
a small Llama, nothing downloaded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import torch
import torch.distributed as dist
import transformers
from accelerate import Accelerator

import seqpar
import seqpar.hf

VOCAB, BOS, SEP, EOS = 256, 1, 2, 3


def summarisation_examples(count: int, seed: int) -> list[dict[str, list[int]]]:
    """Documents of 96-320 words (mostly a fixed successor map, 15% random) and their every 8th word."""
    g = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(count):
        n = int(torch.randint(96, 320, (1,), generator=g))
        jumps = torch.rand(n, generator=g) < 0.15
        random_words = torch.randint(4, VOCAB, (n,), generator=g).tolist()
        words = [random_words[0]]
        for i in range(1, n):
            words.append(random_words[i] if jumps[i] else 4 + (words[-1] * 7 + 3) % (VOCAB - 4))
        examples.append({"input_ids": [BOS, *words, SEP, *words[::8], EOS]})
    return examples


def epochs(loader):
    """The loader's batches, epoch after epoch, reshuffled each time (every rank draws the same order)."""
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sp", type=int, default=None, help="ranks per sequence (default: all of them)")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--output-dir", default="runs/accelerate_loop")
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True)  # on GPUs: Accelerator(); torchrun then gives NCCL
    mesh = seqpar.hf.build_mesh(seqpar.hf.SequenceParallelConfig(sp_size=args.sp))  # dp = world / sp
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
    model = seqpar.prepare_model(transformers.AutoModelForCausalLM.from_config(config), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = accelerator.prepare(model, optimizer)  # DDP over every process: it averages gradients
    data = summarisation_examples(1024, seed=0)
    loader = seqpar.hf.replica_loader(
        data,
        mesh,
        batch_size=4,  # examples per data-parallel replica, shared by its sp ranks
        collate_fn=transformers.DataCollatorWithFlattening(return_position_ids=True),
        shuffle=True,
        seed=0,
    )
    group = dist.group.WORLD if accelerator.num_processes > 1 else None
    batches, losses = epochs(loader), []
    for _ in range(args.max_steps):
        micro = [next(batches) for _ in range(args.accumulation)]
        step = seqpar.hf.shard_step(micro, mesh, group=group)  # collective: checks and counts on every rank
        step_loss = torch.zeros((), device=accelerator.device)
        for i, shard in enumerate(step.shards):
            last = i == len(step.shards) - 1
            with contextlib.nullcontext() if last else accelerator.no_sync(model):
                shard = {k: v.to(accelerator.device) for k, v in shard.items()}
                logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
                # this rank's token losses / the step's valid tokens over every rank (Note [global token ...])
                loss = seqpar.cross_entropy(logits, shard["shift_labels"], num_valid_tokens=step.num_valid_tokens)
                accelerator.backward(loss * accelerator.num_processes)  # DDP averages; scaled, that is the sum
            step_loss += loss.detach()
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(seqpar.sum_over(step_loss, group)))  # the step's token-mean loss, as one process
    if accelerator.is_main_process:
        print(f"sp {mesh.sp_size}: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "result.json"), "w") as f:
            result = {"sp": mesh.sp_size, "steps": len(losses), "first_loss": losses[0], "last_loss": losses[-1]}
            json.dump(result, f)
    accelerator.end_training()  # tears the process group down before the interpreter exits


if __name__ == "__main__":
    main()
