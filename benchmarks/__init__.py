"""The project's benchmarks that produce its records (benchmarks/*.json), run as ``python -m benchmarks.NAME``.

They live beside the package, not in the wheel; ``seqpar bench`` keeps those a user runs on their own machines.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping, Sequence

from seqpar import bench

__all__ = ["ROOT", "command", "provenance", "python_path", "save_records"]

ROOT = pathlib.Path(__file__).resolve().parent.parent
"""The repository's root, where ``python -m benchmarks.NAME`` runs."""


def command(name: str) -> list[str]:
    """The words that run ``benchmarks/NAME.py`` from the repository's root, before its options."""
    return ["python", "-m", f"benchmarks.{name}"]


def provenance(name: str, argv: list[str] | None) -> dict[str, str]:
    """``seqpar.bench.provenance`` with the command ``python -m benchmarks.NAME``."""
    return bench.provenance(name, argv, command(name))


def save_records(path: str, name: str, argv: list[str] | None, records: Sequence[Mapping]) -> None:
    """``seqpar.bench.save_records`` with the command ``python -m benchmarks.NAME``."""
    bench.save_records(path, name, argv, records, command(name))


def python_path() -> str:
    """``PYTHONPATH`` for a subprocess that runs ``-m benchmarks.NAME`` whatever its working directory."""
    return os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
