"""Bytes per element of the dtypes that the memory estimate and the planner price, by name, without torch.

``DTYPE_BYTES`` names them ("bf16", "fp16", "fp32"); ``DTYPES`` maps a name to its torch dtype, importing torch
only when one is looked up (Note [torch-free planning] in seqpar.planning).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from seqpar.errors import SeqparInputError

if TYPE_CHECKING:
    import torch

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Name -> bytes per element: the dtypes ``seqpar plan``, ``seqpar estimate`` and the trainer's ``--dtype`` take."""
_TORCH_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_SHORT_NAMES = {torch_name: name for name, torch_name in _TORCH_NAMES.items()}


class TorchDtypes(Mapping):
    """Name -> torch dtype for the names of ``DTYPE_BYTES``; iterating and ``in`` need no torch, a lookup imports it."""

    def __getitem__(self, name: str) -> torch.dtype:
        if name not in _TORCH_NAMES:
            raise KeyError(name)
        import torch

        return getattr(torch, _TORCH_NAMES[name])

    def __iter__(self) -> Iterator[str]:
        return iter(DTYPE_BYTES)

    def __len__(self) -> int:
        return len(DTYPE_BYTES)

    def __repr__(self) -> str:
        return f"TorchDtypes({', '.join(DTYPE_BYTES)})"


DTYPES = TorchDtypes()
"""Name -> torch dtype ("bf16" -> torch.bfloat16, ...), torch imported at the first lookup."""


def dtype_bytes(dtype: object) -> int:
    """Bytes per element of ``dtype``.

    Args:
        dtype: a name of ``DTYPE_BYTES`` ("bf16", "fp16", "fp32"), torch's name of one of them ("bfloat16",
            "float16", "float32"), or a dtype object with an ``itemsize`` (a ``torch.dtype``).

    Returns:
        The bytes of one element.

    Raises:
        SeqparInputError: an unknown name, or an object that is not a dtype.
    """
    if isinstance(dtype, str):
        short = _SHORT_NAMES.get(dtype, dtype)
        if short not in DTYPE_BYTES:
            raise SeqparInputError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_BYTES)} or a torch dtype")
        return DTYPE_BYTES[short]
    itemsize = getattr(dtype, "itemsize", None)
    if not isinstance(itemsize, int) or itemsize < 1:
        raise SeqparInputError(f"dtype must be a torch dtype or one of {', '.join(DTYPE_BYTES)}, not {dtype!r}")
    return itemsize
