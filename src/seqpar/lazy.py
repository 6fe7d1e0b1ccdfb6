"""Package faces that import their names on first use, so ``import seqpar`` stays close to ``import torch``.

A face lists ``name -> module`` and hands ``module_getattr(...)`` to Python as its ``__getattr__`` (PEP 562).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


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
