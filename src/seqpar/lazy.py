"""Package faces that import their names on first use, so ``import seqpar`` stays close to ``import torch``.

A face lists ``name -> module`` and hands ``module_getattr(...)`` to Python as its ``__getattr__`` (PEP 562);
modules that moved keep their old dotted names as aliases (``MOVED_MODULES``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["MOVED_MODULES", "MovedModuleFinder", "install_moved_module_finder", "module_getattr", "moved_name"]


def module_getattr(face: str, names: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``names[name]`` on first use and keeps the value in ``namespace``.

    Args:
        face: The importing package's dotted name, for the error message.
        names: Public name -> the module that defines it.
        namespace: The package's ``globals()``; a resolved name is stored there, so it is looked up once.

    Returns:
        The function to assign to the package's ``__getattr__``.

    Raises:
        AttributeError: From the returned function, for a name the face does not list.
    """

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {face!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__


# Modules that moved in the restructuring to one package per axis: the old dotted name -> the new one.
MOVED_MODULES = {
    "seqpar.api": "seqpar.sequence_parallel.api",
    "seqpar.strategies": "seqpar.sequence_parallel.strategies",
    "seqpar.strategies.policy": "seqpar.sequence_parallel.strategies.registry",
    "seqpar.strategies.choice": "seqpar.sequence_parallel.selection",
    "seqpar.strategies.planner": "seqpar.sequence_parallel.plans.planner",
    "seqpar.strategies.tiles": "seqpar.sequence_parallel.plans.tiles",
    "seqpar.strategies.blocks": "seqpar.sequence_parallel.plans.blocks",
    "seqpar.strategies.pieces": "seqpar.sequence_parallel.plans.pieces",
    "seqpar.strategies.kv_needs": "seqpar.sequence_parallel.plans.kv_needs",
    "seqpar.strategies.masking": "seqpar.sequence_parallel.masks.sequence_mask",
    "seqpar.strategies.mask_blocks": "seqpar.sequence_parallel.masks.block_ranges",
    "seqpar.checks": "seqpar.sequence_parallel.checks",
    "seqpar.comm": "seqpar.sequence_parallel.comm",
    "seqpar.kernels": "seqpar.sequence_parallel.kernels",
    "seqpar.integrations.transformers": "seqpar.sequence_parallel.prepare",
    "seqpar.integrations.context_parallel": "seqpar.sequence_parallel.context_parallel",
    "seqpar.integrations.cp_autograd": "seqpar.sequence_parallel.context_parallel.autograd",
    "seqpar.integrations.sdpa_mode": "seqpar.sequence_parallel.context_parallel.sdpa_mode",
    "seqpar.layout": "seqpar.sequence_parallel.layouts.chunks",
    "seqpar.balanced": "seqpar.sequence_parallel.layouts.balanced",
    "seqpar.placement": "seqpar.sequence_parallel.layouts.placed",
    # hf files split only for an old 300-line cap, merged again
    "seqpar.hf.trainer_evaluation": "seqpar.hf.trainer",
    "seqpar.hf.grpo_checks": "seqpar.hf.grpo",
    "seqpar.hf.grpo_loss": "seqpar.hf._grpo_loss",
    "seqpar.bench.maxlen_report": "seqpar.bench.maxlen",
    # renamed so that the lazy face's ``seqpar.memory.tiled_mlp`` is always the function, never its module
    "seqpar.memory.tiled_mlp": "seqpar.memory.tiled",  # the maxlen bench's report, one module with it again
}


def moved_name(name: str) -> str | None:
    """The new dotted name of a module written under its old name (a moved package's submodules too), else None."""
    if name in MOVED_MODULES:
        return MOVED_MODULES[name]
    package = name.rpartition(".")[0]
    while package:
        if package in MOVED_MODULES:
            return f"{MOVED_MODULES[package]}.{name[len(package) + 1 :]}"
        package = package.rpartition(".")[0]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Loads a moved module's old name as the very module object of its new name (one copy, one class identity)."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.new}; import it from there (the old name is an alias)",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(self.new)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module was executed under its new name."""


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old names in ``MOVED_MODULES`` (and nothing else), so imports written before the move keep working."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        """The alias spec for a moved module's old name; ``None`` (not ours) for every other name."""
        new = moved_name(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new))


def install_moved_module_finder() -> None:
    """Put one ``MovedModuleFinder`` first on ``sys.meta_path``; idempotent.

    First, because the path finder would otherwise load a moved package's submodule a second time under its old
    name (two copies of every class); the finder answers only old names, so other imports are unaffected.
    """
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
