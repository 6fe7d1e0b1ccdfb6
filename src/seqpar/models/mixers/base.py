"""What every mixer row is: a frozen dataclass of one token mixer's sizes whose class answers for the kind.

``seqpar.models.mixers`` registers the rows (Note [mixer rows]); this module holds their common reading.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import ClassVar

from seqpar.errors import SeqparInputError

Get = Callable[..., object]
"""A config's field reader: ``get(name, default=None)``."""
Names = Mapping[str, object]
"""A row's field -> its config name (the forms of ``MixerSizes``)."""


@dataclass(frozen=True)
class MixerSizes:
    """One token mixer's sizes, and through its class the kind's row (Note [mixer rows]).

    A ``names`` value is the config name of a field (read with the field's default), a ``(name, default)`` pair,
    None (derived by the row, never read) or any other value (that value, whatever the config says).
    """

    kind: ClassVar[str]
    """The kind's registered name (``MIXER_KINDS``)."""
    label: ClassVar[str]
    """How errors name its layers."""
    layer_types: ClassVar[tuple[str, ...]] = ()
    """The config ``layer_types`` entries, beside the generic ``MIXER_LAYER``, that name layers of this kind."""
    adapts: ClassVar[tuple[str, ...]] = ()
    """The transformers classes whose seqpar adapter runs this kind (``seqpar.sequence_parallel.mixers.ADAPTERS``)."""
    names: ClassVar[Names] = {}
    """Field -> its config name in the configs that use the kind's usual names; a family gives its own
    (``Hybrid.names``)."""

    @classmethod
    def read(cls, get: Get, names: Names, hidden: int) -> MixerSizes:
        """The sizes in a config under ``names`` (ints positive, or one error naming every bad one)."""
        values, bad = {}, []
        for field in fields(cls):
            spec = names.get(field.name, field.default)
            value = cls.settle(get, names, field.name, cls._value(get, spec, field.default), hidden, values)
            if field.type in ("int", int) and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                bad.append(spec if isinstance(spec, str) else field.name)
            values[field.name] = bool(value) if field.type in ("bool", bool) else value
        if bad:
            raise SeqparInputError(f"{cls.label} layers need positive integer {', '.join(bad)}")
        return cls(**values)

    @staticmethod
    def _value(get: Get, spec: object, default: object) -> object:
        """The value ``spec`` gives (the ``names`` forms above)."""
        if isinstance(spec, str):
            return get(spec, None if default is MISSING else default)
        if isinstance(spec, tuple):
            return get(*spec)
        return None if spec is MISSING else spec

    @classmethod
    def settle(cls, get: Get, names: Names, field: str, value: object, hidden: int, read: dict) -> object:
        """The value of ``field`` from what the config gave (``value``; ``read`` holds the fields before it): a
        row derives here what its configs leave out or spell otherwise."""
        return value

    def as_config(self, names: Names, hidden: int) -> dict:
        """The config fields that read back to these sizes under ``names``."""
        config = {}
        for field in fields(self):
            spec = names.get(field.name, field.default)
            if isinstance(spec, str | tuple):
                config[spec if isinstance(spec, str) else spec[0]] = getattr(self, field.name)
        return config

    def params(self, hidden: int) -> int:
        """Parameters of one layer's mixer, the layer's norms left out (Note [hybrid sizes])."""
        raise NotImplementedError

    def conv(self, hidden: int) -> tuple[int, int]:
        """(channels, width) of its short convolution; (0, 1): none, and no halo."""
        return 0, 1

    def elements(self, hidden: int, sp_size: int) -> tuple[int, float]:
        """(elements in the model's dtype, float32 elements) one token keeps for the backward in the mixer, the
        layer's norms and the convolution's float32 taps left out (Note [hybrid memory])."""
        raise NotImplementedError

    def exchange(self, rows: int, chunks: int) -> int:
        """Bytes of this rank's state summaries in one layer's forward all-gather (Note [hybrid memory])."""
        return 0

    def head_parallel(self, hidden: int) -> int:
        """Elements per token a head-parallel all-to-all would move each way: the scan's inputs in, its output back."""
        raise NotImplementedError
