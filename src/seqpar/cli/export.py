"""``seqpar export``: a Hugging Face model directory from a ``seqpar train`` checkpoint, in one process.

The checkpoint may come from any layout (dp, sp, tp, pp, FSDP2); the run's settings give the model (Note [hf export]).
"""

from __future__ import annotations

import argparse


def add_export_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``seqpar export``'s arguments: the checkpoint, the output directory and ``--run-config``.

    Args:
        parser: the subcommand's parser.
    """
    parser.add_argument("checkpoint", help="a complete checkpoint directory, <run_dir>/checkpoints/step_NNNNNNN")
    parser.add_argument("out", help="the Hugging Face model directory to write (new, or empty)")
    parser.add_argument(
        "--run-config",
        default=None,
        help="the run's config.json (default: the one in the checkpoint's run directory, two levels up)",
    )


def run_export(args: argparse.Namespace) -> int:
    """Write the model directory and print where it is; returns the exit code.

    Args:
        args: the parsed flags of ``add_export_flags``.

    Returns:
        0.

    Raises:
        SeqparInputError: a missing, incomplete or damaged checkpoint, an ``out`` that is not empty, or run
            settings that cannot be found or do not build the checkpoint's model.
    """
    from seqpar.train.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.out, args.run_config)
    print(f"hugging face model: {out}", flush=True)
    return 0
