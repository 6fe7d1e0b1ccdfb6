"""Ranks agreeing before they raise: named integer signatures, their exchange, and problems named by rank.

Used by the attention input checks and by the model-call checks of ``seqpar.sequence_parallel.prepare``.

Note [agreeing on errors]
    A check that fails on one rank only (one rank has a different length, dtype or strategy) must not leave
    the other ranks waiting inside a collective. Each rank therefore encodes what it was given as a short
    integer signature, the group all-gathers the signatures (one small collective), and every rank runs
    the same checks over the same table. All ranks reach the same verdict and raise the same message.
    With ``check_inputs=False`` the exchange is skipped and only this rank's own inputs are checked.
    A signature is a frozen dataclass (``Signature``) whose fields have fixed widths, so every rank's row
    has the same length and every rank reads the table back field by field.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import typing
import zlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from seqpar.sequence_parallel.comm.collectives import all_gather_first_dim, collective_device

_S = typing.TypeVar("_S", bound="Signature")


class Signature:
    """Base of the frozen dataclasses that ranks exchange as one row of int64 (Note [agreeing on errors]).

    Fields are ``int``, ``bool``, fixed-length tuples of them (``tuple[int, int]``) or other signatures.
    """

    def to_ints(self) -> list[int]:
        """The fields, depth first, as one flat list of ``width()`` integers.

        Raises:
            ValueError: a tuple field of another length than its annotation (rows would not line up).
        """
        ints = _flatten(self)
        if len(ints) != self.width():
            raise ValueError(f"{type(self).__name__} encodes to {len(ints)} integers, not {self.width()}")
        return ints

    @classmethod
    def from_ints(cls: type[_S], ints: Sequence[int]) -> _S:
        """The signature that ``to_ints`` turned into ``ints``.

        Raises:
            ValueError: ``ints`` of another length than ``width()``.
        """
        values = iter(ints)
        sig = _build(cls, values)
        if next(values, None) is not None:
            raise ValueError(f"too many integers for {cls.__name__}")
        return sig

    @classmethod
    def width(cls) -> int:
        """Integers per encoded signature (the same on every rank)."""
        return len(_flatten(_build(cls, itertools.repeat(0))))


def _flatten(value: object) -> list[int]:
    if isinstance(value, Signature):
        return [i for f in dataclasses.fields(value) for i in _flatten(getattr(value, f.name))]
    if isinstance(value, tuple):
        return [i for item in value for i in _flatten(item)]
    return [int(value)]


@functools.cache
def _fields(kind: type) -> tuple[tuple[str, object], ...]:
    """``(name, type)`` of each field of a signature class, in order (annotations resolved once)."""
    hints = typing.get_type_hints(kind)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(kind))


def _build(kind: object, values: Iterator[int]) -> object:
    """A value of type ``kind`` (a signature, a fixed tuple, ``int`` or ``bool``) read from ``values``."""
    if isinstance(kind, type) and issubclass(kind, Signature):
        return kind(**{name: _build(hint, values) for name, hint in _fields(kind)})
    if typing.get_origin(kind) is tuple:
        return tuple(_build(item, values) for item in typing.get_args(kind))
    value = next(values, None)
    if value is None:
        raise ValueError("too few integers for the signature")
    return kind(value)


def by_rank(per_rank: list[list[str]]) -> list[str]:
    """Each distinct problem once, prefixed with the ranks that have it ("every rank" or "rank 0, 2").

    Args:
        per_rank: each rank's problems, in rank order.

    Returns:
        The prefixed problems, in order of first appearance.
    """
    problems = []
    for message in dict.fromkeys(m for rank_problems in per_rank for m in rank_problems):
        ranks = [r for r, rank_problems in enumerate(per_rank) if message in rank_problems]
        where = "every rank" if len(ranks) == len(per_rank) else f"rank {', '.join(map(str, ranks))}"
        problems.append(f"{where}: {message}")
    return problems


def exchange_signatures(sig: _S, group: dist.ProcessGroup) -> list[_S]:
    """Every rank's signature, in rank order (one small all-gather; Note [agreeing on errors]).

    Args:
        sig: this rank's signature; every rank passes one of the same class.
        group: the ranks that must agree.

    Returns:
        One signature of ``sig``'s class per rank of ``group``.
    """
    mine = torch.tensor(sig.to_ints(), dtype=torch.int64, device=collective_device(group))
    return [type(sig).from_ints(row) for row in all_gather_first_dim(mine[None], group).tolist()]


def config_digest(config: object) -> int:
    """A number the ranks compare to agree on a model's config: a checksum of its settings (less where it was
    loaded from; a value that is not JSON counts by its type).

    Args:
        config: a transformers config (or any object with plain attributes).

    Returns:
        A 32-bit checksum.
    """
    settings = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    settings.pop("_name_or_path", None)
    return zlib.crc32(json.dumps(settings, sort_keys=True, default=lambda v: f"<{type(v).__qualname__}>").encode())


def config_disagreement(digests: Sequence[int]) -> str | None:
    """The problem to raise when the ranks' ``config_digest`` values differ, or None when they agree.

    Args:
        digests: each rank's digest, in rank order.

    Returns:
        The message, naming each rank's digest, or None.
    """
    if len(set(digests)) <= 1:
        return None
    shown = ", ".join(f"rank {r}: {d:08x}" for r, d in enumerate(digests))
    return (
        f"the ranks' models have different configs (digests {shown}): build the model from one config on every "
        "rank, since the exchanges' sizes and every layer's arithmetic follow it"
    )
