"""The mixer rows: one per token-mixer kind other than attention, holding everything seqpar counts of the kind.

``Family.hybrid`` names a family's row; ``ModelSizes.mixer`` holds its sizes; consumers ask the row (Note [mixer rows]).

Note [mixer rows]
    A row is the class of one mixer kind's sizes (a frozen ``MixerSizes`` dataclass): ``kind`` is its registered
    name, ``layer_types`` the config's words for its layers, ``adapts`` the transformers classes whose seqpar adapter
    runs it (``seqpar.sequence_parallel.mixers``, which keeps the forwards: they sit above this layer), ``names``
    the config names of its fields; ``read`` and ``as_config`` translate a config, and ``params``, ``conv``,
    ``elements``, ``exchange`` and ``head_parallel`` give its parameters, its halo, what a token keeps for the
    backward and what its layer exchanges (Note [hybrid sizes], Note [hybrid memory]). The parameter counts, the
    memory estimate, the planner's timing and the mixers bench ask the row and never compare its name, so a new kind
    is a row here (``register_mixer_kind``), its forward and adapter, and the ``Family`` entries that name it.
"""

from __future__ import annotations

from seqpar.errors import SeqparInputError
from seqpar.models.mixers.base import Get, MixerSizes
from seqpar.models.mixers.delta import GatedDeltaNet, Kda
from seqpar.models.mixers.mamba import Mamba1, Mamba2
from seqpar.models.mixers.rg_lru import RgLru
from seqpar.models.mixers.rwkv import Rwkv
from seqpar.models.mixers.simple import Lightning, NGramEmbedding, ShortConv

__all__ = [
    "MIXER_KINDS",
    "MIXER_LAYER",
    "SHARED_LAYER",
    "GatedDeltaNet",
    "Get",
    "Kda",
    "Lightning",
    "Mamba1",
    "Mamba2",
    "MixerSizes",
    "NGramEmbedding",
    "RgLru",
    "Rwkv",
    "ShortConv",
    "mixer_layer_types",
    "register_mixer_kind",
]

MIXER_KINDS: dict[str, type[MixerSizes]] = {
    row.kind: row for row in (GatedDeltaNet, Kda, Mamba2, Mamba1, ShortConv, Lightning, RgLru, Rwkv, NGramEmbedding)
}
"""The registry: mixer kind -> its row."""

MIXER_LAYER = "linear_attention"
"""The word most hybrid configs' ``layer_types`` use for a layer of a token mixer other than attention."""

SHARED_LAYER = "hybrid"
"""Zamba's and Zamba2's word for a layer that runs their shared attention block, then the mixer."""

_OTHER_LAYERS = ("recurrent", "linear", SHARED_LAYER)
"""Further words for such layers: recurrent ones no row counts (refused with the reason), Zamba's shared-block ones."""


def mixer_layer_types() -> tuple[str, ...]:
    """Every ``layer_types`` entry that names a layer of a token mixer other than attention."""
    return (MIXER_LAYER, *_OTHER_LAYERS, *(word for row in MIXER_KINDS.values() for word in row.layer_types))


def register_mixer_kind(row: type[MixerSizes], *, replace: bool = False) -> type[MixerSizes]:
    """Add a mixer kind's row to ``MIXER_KINDS`` (Note [mixer rows]).

    Args:
        row: the ``MixerSizes`` dataclass of the kind, its ``kind`` set.
        replace: allow replacing a row of the same kind.

    Returns:
        The row.

    Raises:
        SeqparInputError: not a ``MixerSizes`` subclass with a ``kind``, or a kind registered already.
    """
    if not (isinstance(row, type) and issubclass(row, MixerSizes) and isinstance(getattr(row, "kind", None), str)):
        raise SeqparInputError(f"register_mixer_kind takes a MixerSizes dataclass with its kind, got {row!r}")
    if row.kind in MIXER_KINDS and not replace and MIXER_KINDS[row.kind] is not row:
        raise SeqparInputError(f"mixer kind {row.kind!r} is registered already; pass replace=True to change its row")
    MIXER_KINDS[row.kind] = row
    return row
