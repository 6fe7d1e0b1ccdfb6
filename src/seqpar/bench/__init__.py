"""Benchmarks behind ``seqpar bench NAME``, the ones a user runs on their own machines; each has a ``main(argv)``.

They measure, in one run, ratios against a single process or between strategies; they never assert speed.
"""

from __future__ import annotations

import datetime
import json
import shlex
import sys
from collections.abc import Mapping, Sequence

BENCHMARKS = ("attention", "maxlen", "cuda")
"""The benchmarks of ``seqpar bench``; those that only produce the project's records run as
``python -m benchmarks.NAME`` from a source checkout (benchmarks/README.md)."""


def provenance(name: str, argv: list[str] | None, command: Sequence[str] | None = None) -> dict[str, str]:
    """The fields every saved record carries, so a table built from it can name how and when it was measured.

    Args:
        name: The benchmark's name, as in ``seqpar bench NAME``.
        argv: The options the benchmark was given (``None``: the process's own, as ``main`` reads them).
        command: The words that run the benchmark before its options (default ``seqpar bench NAME``).

    Returns:
        ``command``: the line that reproduces the run; ``measured``: today's ISO date.
    """
    options = sys.argv[1:] if argv is None else argv
    words = ["seqpar", "bench", name] if command is None else list(command)
    return {"command": shlex.join([*words, *options]), "measured": datetime.date.today().isoformat()}


def save_records(
    path: str, name: str, argv: list[str] | None, records: Sequence[Mapping], command: Sequence[str] | None = None
) -> None:
    """Write ``records`` to ``path`` as a JSON list, each with its ``provenance`` (the ``--json FILE`` of a bench).

    Args:
        path: the file to write.
        name: The benchmark's name, as in ``seqpar bench NAME``.
        argv: The options the benchmark was given (``None``: the process's own).
        records: one mapping per measured case.
        command: as ``provenance``.
    """
    stamp = provenance(name, argv, command)
    with open(path, "w") as f:
        json.dump([{**r, **stamp} for r in records], f, indent=1)


__all__ = ["BENCHMARKS", "provenance", "save_records"]
