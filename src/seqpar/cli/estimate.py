"""``seqpar estimate``: the predicted per-rank memory of one training step, as a table (``seqpar.estimate_memory``).

seqpar estimate --model ./llama-config.json --seq-len 65536 --sp 8 --features checkpointing chunked_loss
seqpar estimate --model llama-70b --seq-len 131072 --sp 2 --tp 2 --dp 2 --dp-mode fsdp --pp 2 --pp-microbatches 8
"""

from __future__ import annotations

import argparse

import transformers

from seqpar.cli.arguments import (
    add_default_model_arguments,
    add_degree_arguments,
    add_dtype_argument,
    add_model_argument,
    model_settings,
)
from seqpar.memory import FEATURES, estimate_memory
from seqpar.memory.dtypes import DTYPES
from seqpar.memory.estimate import estimate_stage_memory
from seqpar.memory.pipeline import bubble_fraction, stage_views
from seqpar.mesh import ParallelDims
from seqpar.planning.models import PRESETS
from seqpar.train.data import load_tokenizer
from seqpar.train.model import model_config


def add_estimate_flags(p: argparse.ArgumentParser) -> None:
    """Add ``seqpar estimate``'s flags to its subcommand's parser.

    Args:
        p: the ``estimate`` parser of the ``seqpar`` command line.
    """
    add_model_argument(p, presets=True)
    p.add_argument("--seq-len", type=int, required=True, help="tokens of one whole sequence")
    add_degree_arguments(p, sp_default=None, sp_help="sequence-parallel degree")
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    add_dtype_argument(p)
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--features", nargs="*", default=[], help=f"any of: {', '.join(FEATURES)}")
    p.add_argument("--strategy", default="auto", help="attention strategy")
    p.add_argument("--optimizer", default="adamw", help="adamw, adam or sgd")
    p.add_argument("--dp-mode", default="replicate", help="replicate, ddp or fsdp")
    p.add_argument("--loss-chunk", type=int, default=1024, help="tokens per piece of the chunked loss")
    p.add_argument("--mlp-chunk", type=int, default=1024, help="tokens per chunk of the tiled MLP")
    p.add_argument(
        "--keep-gradients", action="store_true", help="gradients live between steps (zeroed in place, not freed)"
    )
    p.add_argument(
        "--offload-optimizer",
        action="store_true",
        help="FSDP2 CPU offload (needs --dp-mode fsdp): parameters, gradients and optimizer state in host "
        "memory, the update on the CPU; the device keeps the layers in flight, the host figure is printed apart",
    )
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (the busier end rank is estimated)")
    p.add_argument("--pp-schedule", default="1f1b", help="gpipe, 1f1b or interleaved")
    p.add_argument("--pp-microbatches", type=int, default=None, help="micro-batches per pipeline step (default --pp)")
    p.add_argument(
        "--vision-patches",
        type=int,
        default=0,
        help="a Qwen-VL model's vision patches of one micro-batch (sum of t x h x w over its image and video grids): "
        "the vision tower is counted too",
    )
    p.add_argument(
        "--no-split-vision",
        action="store_true",
        help="every rank encodes all the patches (prepare_model(split_vision=False)) instead of about 1/sp of them",
    )
    add_default_model_arguments(p)
    p.add_argument("--vocab", type=int, default=None, help="default model: vocabulary (default: byte tokenizer)")


def run_estimate(args: argparse.Namespace) -> int:
    """Print the estimate's table for the parsed ``seqpar estimate`` flags; returns the exit code.

    Raises:
        SeqparInputError: an unreadable config or settings the estimate cannot take.
    """
    vocab = args.vocab
    if vocab is None:
        tokenizer = load_tokenizer(None)
        vocab = getattr(tokenizer, "vocab_size", None) or len(tokenizer)
    settings = model_settings(args)
    if args.model.lower() in PRESETS:  # the planner's sizes, nothing downloaded
        hf_config = transformers.AutoConfig.for_model(**PRESETS[args.model.lower()].as_config())
    else:
        hf_config = model_config(settings, vocab)
    dp = {"dp_shard_size" if args.dp_mode == "fsdp" else "dp_replicate_size": args.dp}
    dims = ParallelDims(**dp, sp_size=args.sp, ulysses_size=args.ulysses, tp_size=args.tp, pp_size=args.pp)
    options = dict(
        dtype=DTYPES[args.dtype],
        micro_batch=args.micro_batch,
        features=tuple(args.features),
        strategy=args.strategy,
        optimizer=args.optimizer,
        dp_mode=args.dp_mode,
        loss_chunk=args.loss_chunk,
        mlp_chunk=args.mlp_chunk,
        keep_gradients=args.keep_gradients,
        offload_optimizer=args.offload_optimizer,
        pp_schedule=args.pp_schedule,
        pp_microbatches=args.pp_microbatches,
        vision_patches=args.vision_patches,
        split_vision=not args.no_split_vision,
    )
    estimate = estimate_memory(hf_config, args.seq_len, dims, **options)
    print(estimate.table())
    if args.pp > 1:
        layers = getattr(hf_config, "num_hidden_layers", 0)
        first, last = stage_views(layers, args.pp, args.pp_schedule, args.pp_microbatches)
        bubble = bubble_fraction(args.pp, args.pp_schedule, args.pp_microbatches)
        print(
            f"pipeline: pp {args.pp} {args.pp_schedule}, {args.pp_microbatches or args.pp} micro-batches; "
            f"{first.layers} of {layers} layers per rank; micro-batches in flight: first rank {first.in_flight:g}, "
            f"last rank {last.in_flight:g}; bubble {bubble:.0%} (Note [pipeline memory and time])"
        )
        peaks = [e.peak / 2**30 for e in estimate_stage_memory(hf_config, args.seq_len, dims, **options)]
        print(f"peak per rank: first {peaks[0]:.1f} GiB, last {peaks[1]:.1f} GiB (the table shows the larger)")
    return 0
