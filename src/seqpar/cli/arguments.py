"""The flags that ``seqpar doctor`` and ``seqpar estimate`` share: the model, the sequence-parallel degrees, the dtype.

Both read a model as ``seqpar train`` does: a config.json, a model directory, or the embedded demo model and its sizes.
"""

from __future__ import annotations

import argparse

from seqpar.memory.dtypes import DTYPES
from seqpar.planning.models import PRESETS
from seqpar.train.config import TrainConfig


def add_model_argument(parser: argparse.ArgumentParser, *, presets: bool) -> None:
    """Add ``--model``: a config.json or model directory, by default ``seqpar train``'s demo model.

    Args:
        parser: the subcommand's parser.
        presets: whether the planner's preset names are taken too.
    """
    where = (
        f"config.json, model directory or a preset ({', '.join(PRESETS)})"
        if presets
        else "config.json or model directory"
    )
    parser.add_argument("--model", default="default", help=f"{where}; default: the train demo's")


def add_degree_arguments(parser: argparse.ArgumentParser, *, sp_default: int | None, sp_help: str) -> None:
    """Add ``--sp`` and ``--ulysses``.

    Args:
        parser: the subcommand's parser.
        sp_default: the default sequence-parallel degree; None makes ``--sp`` required.
        sp_help: what ``--sp`` means to the subcommand.
    """
    required = {"required": True} if sp_default is None else {"default": sp_default}
    parser.add_argument("--sp", type=int, help=sp_help, **required)
    parser.add_argument("--ulysses", type=int, default=1, help="ulysses degree inside sp (hybrid)")


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--dtype`` (fp32, bf16 or fp16; default fp32), read through ``seqpar.planning.memory.DTYPES``.

    Args:
        parser: the subcommand's parser.
    """
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="parameters and activations")


def add_default_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the sizes of the default model (``--model default``): ``--hidden``, ``--layers``, ``--heads``.

    Args:
        parser: the subcommand's parser.
    """
    parser.add_argument("--hidden", type=int, default=TrainConfig.hidden_size, help="default model: hidden size")
    parser.add_argument("--layers", type=int, default=TrainConfig.layers, help="default model: layers")
    parser.add_argument("--heads", type=int, default=TrainConfig.heads, help="default model: heads")


def model_settings(args: argparse.Namespace, **fields: object) -> TrainConfig:
    """The ``TrainConfig`` that builds the model of the shared flags (and ``--seq-len``), as ``seqpar train`` would.

    Args:
        args: parsed flags of a parser given ``add_model_argument`` and ``add_default_model_arguments``, and
            ``--seq-len``.
        **fields: further ``TrainConfig`` fields (data files, tokenizer, seed).

    Returns:
        The settings.
    """
    return TrainConfig(
        model=None if args.model == "default" else args.model,
        hidden_size=args.hidden,
        layers=args.layers,
        heads=args.heads,
        seq_len=args.seq_len,
        eval_lengths=[args.seq_len],
        **fields,
    )
