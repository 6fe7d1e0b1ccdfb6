"""Benchmarks behind ``seqpar bench NAME``: each module has a ``main(argv)`` and a docstring on how to run it.

They measure, in one run, ratios against a single process or between strategies; they never assert speed.
"""

from __future__ import annotations

import datetime
import json
import shlex
import sys
from collections.abc import Mapping, Sequence

BENCHMARKS = (
    "attention",
    "strategies",
    "masks",
    "placement",
    "llama_step",
    "cuda",
    "context_parallel",
    "hf_trainer",
    "maxlen",
    "features",
    "plan_check",
    "soak",
    "pipeline",
    "rl_memory",
    "imports",
    "vision_split",
    "vlm_memory",
    "mixers",
    "video_dit",
)


def provenance(name: str, argv: list[str] | None) -> dict[str, str]:
    """The fields every saved record carries, so a table built from it can name how and when it was measured.

    Args:
        name: The benchmark's name, as in ``seqpar bench NAME``.
        argv: The options the benchmark was given (``None``: the process's own, as ``main`` reads them).

    Returns:
        ``command``: the ``seqpar bench`` line that reproduces the run; ``measured``: today's ISO date.
    """
    options = sys.argv[1:] if argv is None else argv
    return {"command": shlex.join(["seqpar", "bench", name, *options]), "measured": datetime.date.today().isoformat()}


def save_records(path: str, name: str, argv: list[str] | None, records: Sequence[Mapping]) -> None:
    """Write ``records`` to ``path`` as a JSON list, each with its ``provenance`` (the ``--json FILE`` of a bench).

    Args:
        path: the file to write.
        name: The benchmark's name, as in ``seqpar bench NAME``.
        argv: The options the benchmark was given (``None``: the process's own).
        records: one mapping per measured case.
    """
    stamp = provenance(name, argv)
    with open(path, "w") as f:
        json.dump([{**r, **stamp} for r in records], f, indent=1)


__all__ = ["BENCHMARKS", "provenance", "save_records"]
