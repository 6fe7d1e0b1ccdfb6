"""Benchmarks behind ``seqpar bench NAME``: each module has a ``main(argv)`` and a docstring on how to run it.

They measure, in one run, ratios against a single process or between strategies; they never assert speed.
"""

from __future__ import annotations

import datetime
import shlex
import sys

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


__all__ = ["BENCHMARKS", "provenance"]
