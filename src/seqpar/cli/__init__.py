"""The ``seqpar`` command line: ``seqpar train`` trains a model with the sequence split over ranks.

seqpar train                                   # embedded demo: pass-key recitation, 2 CPU ranks, ~2 minutes
seqpar train --model ./my-llama --data a.jsonl --seq-len 32768 --sp 8    # under torchrun on GPUs
seqpar demo                                    # every attention strategy on 2 CPU ranks vs one device
seqpar estimate --seq-len 65536 --sp 4         # predicted per-rank memory of a training step
seqpar plan --model llama-8b --seq-len 1M --gpus 64   # which degrees, strategy and memory features
seqpar doctor --model ./my-llama --sp 2        # does a sharded step differ from one process, and why
seqpar export runs/x/checkpoints/step_0000300 ./my-model   # a checkpoint as a Hugging Face model directory
seqpar models                                  # which families of the installed transformers seqpar serves
seqpar bench attention                         # benchmarks: attention, maxlen, cuda
"""

from __future__ import annotations

import argparse
import importlib
import sys

from seqpar.bench import BENCHMARKS
from seqpar.errors import SeqparInputError

# name -> (help, description); a subcommand's flags (and the modules behind them) load only when it is the one run,
# so `seqpar --help` and `seqpar plan` do not import the trainer, transformers or the doctor
_COMMANDS = {
    "demo": ("run every attention strategy on spawned CPU ranks and check it", None),
    "train": (
        "train a model with the sequence split over ranks (no arguments: the embedded CPU demo)",
        "Train a causal language model with sequence parallelism. Without arguments it runs the embedded demo: a "
        "small Llama trained on pass-key recitation with each sequence split over 2 spawned CPU ranks. Under "
        "torchrun it uses the ranks torchrun started (NCCL on GPUs). Settings come from the defaults, then "
        "--config, then the flags.",
    ),
    "plan": (
        "rank the dp/sp/ulysses/tp degrees, strategies and memory features for a model on a cluster",
        "Predict per-rank peak memory, step time, tokens/s per device and MFU of every valid layout of --model at "
        "--seq-len on the described cluster, print the best and say why the rest were rejected.",
    ),
    "estimate": (
        "print the predicted per-rank memory of a training step",
        "Predict one rank's memory during one training step (forward, backward, gradient sum, optimizer) from a "
        "model config, without allocating it.",
    ),
    "doctor": (
        "compare one sequence-parallel training step with one process, layer by layer, and find setup pitfalls",
        "Run one forward and backward of the model on --sp ranks and on one process with the same weights and "
        "batch; print per decoder layer the largest relative difference of activations and of parameter "
        "gradients, the first layer beyond the dtype's tolerance, the setup pitfalls found (packing without "
        "position ids, shifted labels, attention outside seqpar, token mixing outside attention, dropout, left "
        "padding) and a verdict. Exit code 0 when everything agrees and no pitfall is found, else 1.",
    ),
    "export": (
        "write a Hugging Face model directory from a seqpar train checkpoint",
        "Read a complete seqpar train checkpoint (written at any dp/sp/tp/pp layout, FSDP2 included) in one "
        "process and write the model as a Hugging Face directory (config.json, model.safetensors, generation "
        "config, the run's tokenizer) that AutoModelForCausalLM.from_pretrained loads. The model comes from the "
        "run's config.json; OUT must be new or empty.",
    ),
    "models": (
        "list the families of the installed transformers seqpar serves, and why it refuses the others",
        "Build a tiny model of every causal-LM and image-text-to-text model type of the installed transformers on "
        "the meta device and check it as prepare_model does: served by seqpar's registry entry ('entry'), served by "
        "the anatomy read from the model ('read'), or refused with the reason. Nothing runs; the zoo sweep "
        "(docs/models.md) measures which served families equal one process.",
    ),
    "bench": (
        "run a benchmark (ratios measured side by side in one run)",
        "Benchmarks: " + ", ".join(BENCHMARKS) + ". `seqpar bench NAME --help` explains each; the project's other "
        "benchmarks run from a source checkout as `python -m benchmarks.NAME`.",
    ),
}


def _demo_flags(demo: argparse.ArgumentParser) -> None:
    demo.add_argument("--ranks", type=int, default=2, help="sequence-parallel ranks to spawn (gloo, 1 thread each)")
    demo.add_argument("--seq", type=int, default=4096, help="total sequence length")
    demo.add_argument("--heads", type=int, default=8, help="query heads")
    demo.add_argument("--kv-heads", type=int, default=2, help="key/value heads (grouped-query attention)")
    demo.add_argument("--head-dim", type=int, default=64, help="head dimension")


def _bench_flags(bench: argparse.ArgumentParser) -> None:
    bench.add_argument("name", choices=BENCHMARKS, help="which benchmark")
    bench.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own options")


def _add_flags(command: str, parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``command`` to its parser, importing only the module that defines them."""
    if command == "demo":
        _demo_flags(parser)
    elif command == "bench":
        _bench_flags(parser)
    elif command == "train":
        from seqpar.train.config import build_parser

        build_parser(parser)
    elif command == "plan":
        from seqpar.planning.cli import add_plan_flags

        add_plan_flags(parser)
    elif command == "export":
        from seqpar.cli.export import add_export_flags

        add_export_flags(parser)
    elif command == "models":
        from seqpar.cli.models import add_models_flags

        add_models_flags(parser)
    elif command == "estimate":
        from seqpar.cli.estimate import add_estimate_flags

        add_estimate_flags(parser)
    else:
        from seqpar.cli.doctor import add_doctor_flags

        add_doctor_flags(parser)


def _parse(argv: list[str]) -> argparse.Namespace:
    """The parsed command line; only the subcommand named in ``argv`` (if any) gets its flags."""
    chosen = next((a for a in argv if not a.startswith("-")), None)  # the top level has no options but --help
    parser = argparse.ArgumentParser(prog="seqpar", description="Sequence parallelism for long-context training.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command, (summary, description) in _COMMANDS.items():
        command_parser = sub.add_parser(command, help=summary, description=description)
        if command == chosen:
            _add_flags(command, command_parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``seqpar`` console script."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.command == "bench":
        return importlib.import_module(f"seqpar.bench.{args.name}").main(args.options)
    if args.command == "plan":
        from seqpar.planning.cli import run_plan

        return run_plan(args)
    if args.command in ("estimate", "doctor", "export"):  # bad input: a message and exit code 2
        try:
            if args.command == "estimate":
                from seqpar.cli.estimate import run_estimate

                return run_estimate(args)
            if args.command == "export":
                from seqpar.cli.export import run_export

                return run_export(args)
            from seqpar.cli.doctor import run_doctor

            return run_doctor(args)
        except SeqparInputError as error:
            print(f"seqpar {args.command}: {error}", file=sys.stderr)
            return 2
    if args.command == "models":
        from seqpar.cli.models import run_models

        return run_models(args)
    if args.command == "demo":
        from seqpar.cli.demo import run_demo

        return run_demo(args.ranks, args.seq, args.heads, args.kv_heads, args.head_dim)
    return _train(args)


def _train(args: argparse.Namespace) -> int:
    """``seqpar train``: launch the ranks, or print the plan of the settings (``--plan``)."""
    from seqpar.train.config import config_from_args
    from seqpar.train.launch import launch

    try:
        config = config_from_args(args)
        if config.plan:
            from seqpar.cli.plan import train_plan

            print(train_plan(config))
            return 0
        return launch(config)
    except SeqparInputError as error:
        print(f"seqpar train: {error}", file=sys.stderr)
        return 2
