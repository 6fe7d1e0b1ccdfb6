"""The served families whose sizes seqpar does not model yet, each with the parts its sizes lack.

``ModelSizes`` and ``unmodelled_sizes`` refuse their configs naming those parts (Note [unsized parts]).

Note [unsized parts]
    DeepSeek-V4, HY-V4 and Qwen4-Exp train under seqpar, but their layers hold parts that ``ModelSizes`` does
    not describe (hyper-connections' residual streams, indexers and compressors, their gathered buffers and
    dense masks, hashed tables), and read as Llama-shaped (or MLA) decoders their estimate would be a wrong
    number. Each family's row names those parts (``Family.unsized`` for a registry entry, ``UNSIZED_PARTS`` for
    a family served by its read anatomy), and ``ModelSizes.from_config``, ``unmodelled_sizes`` and so the
    estimate and the planner refuse the config with "unmodelled: " and the list before reading any size,
    rather than count the rest: a part left out would under-count the peak. What their new exchanges send is
    measured against a model of it in ``benchmarks/indexed.py`` (``indexed_cpu.json``). A multimodal family is
    sized by its text config, so its row is that config's model type.
"""

from __future__ import annotations

from seqpar.models.families import FAMILIES
from seqpar.models.hybrid_families import HYPER_CONNECTIONS

_MASK = "the dense S/P x S mask the attention builds"
_HY_V4 = (
    "its MLA attention with an output gate (gate_proj)",
    f"the DSA indexer (its projections, the gathered indexer keys, {_MASK}) and the shared-indexer layers",
    HYPER_CONNECTIONS,
)

UNSIZED_PARTS: dict[str, tuple[str, ...]] = {
    "deepseek_v4": (
        "its attention (low-rank queries, one key = value head, the grouped output projection o_groups x o_lora_rank)",
        "compressed attention (the CSA and HCA compressors and the CSA indexer, their projections gathered over the "
        f"row, the pooled entries, the gathered sliding keys, {_MASK})",
        HYPER_CONNECTIONS,
        "hash-routed experts (the tid2eid table)",
    ),
    "hy_v4": _HY_V4,
    "hy_v4_vl_text": _HY_V4,
}
"""Model type (a multimodal model's text config's) -> the parts seqpar's sizes do not describe, for the families
served by their read anatomy; a registry entry says it as ``Family.unsized`` (Note [unsized parts])."""


def unsized_parts(model_type: object) -> tuple[str, ...]:
    """The parts of ``model_type``'s layers that seqpar's sizes do not describe (none: they describe it)."""
    if not isinstance(model_type, str):
        return ()
    family = FAMILIES.get(model_type)
    return family.unsized if family is not None else UNSIZED_PARTS.get(model_type, ())


def unsized_reason(model_type: object) -> str | None:
    """Why seqpar's sizes refuse ``model_type`` ("unmodelled: " and the parts), or None where they describe it."""
    parts = unsized_parts(model_type)
    if not parts:
        return None
    return (
        f"unmodelled: {'; '.join(parts)}: the {model_type!r} layers hold these parts, which seqpar's sizes do not "
        "describe yet, so its memory estimate and plans would be wrong for this model; training under seqpar is "
        "not affected (Note [unsized parts])"
    )
