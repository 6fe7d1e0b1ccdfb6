"""The attention masks of transformers' ``config.layer_types`` that seqpar builds, one row per layer type.

A layer's row says what its mask adds to the causal rule beyond what its attention module hands seqpar's attention.
"""

from __future__ import annotations

from dataclasses import dataclass

from seqpar.errors import SeqparInputError


@dataclass(frozen=True)
class LayerMask:
    """What seqpar reads for one layer type's mask."""

    chunk_field: str | None = None
    """The config field holding the chunk size of chunked attention (Note [chunked attention]), or None. Sliding
    windows need no field: the attention module hands its window to seqpar's attention at each call."""
    indexer: bool = False
    """The layer's attention picks its keys with an indexer, served only where the indexer's class has a
    ``SPARSE_INDEXERS`` row (Note [indexed attention])."""
    compressed: bool = False
    """The layer's attention also attends to keys a compressor pools over windows of tokens, served only where the
    compressor's class has a ``KEY_COMPRESSORS`` row (Note [compressed attention])."""


LAYER_MASKS = {
    "full_attention": LayerMask(),
    "sliding_attention": LayerMask(),
    "chunked_attention": LayerMask(chunk_field="attention_chunk_size"),  # Llama 4's chunked layers
    "indexed_attention": LayerMask(indexer=True),  # DSA layers: causal, their indexer's picks on top
    # DeepSeek-V4: a sliding window, and keys pooled over windows of 4 (an indexer's picks) or 128 tokens
    "compressed_sparse_attention": LayerMask(compressed=True),
    "heavily_compressed_attention": LayerMask(compressed=True),
}
"""``config.layer_types`` entry -> its row; a layer type without a row is refused by the anatomy reader."""


def layer_mask(module: object) -> tuple[str, LayerMask] | None:
    """The layer type of an attention module's layer and its row, or None (no layer types, or no row)."""
    config = getattr(module, "config", None)
    kinds = getattr(config, "layer_types", None) or ()
    index = getattr(module, "layer_idx", None)
    if not isinstance(index, int) or not 0 <= index < len(kinds) or kinds[index] not in LAYER_MASKS:
        return None
    return kinds[index], LAYER_MASKS[kinds[index]]


def layer_chunk(module: object) -> int | None:
    """The chunk size of the attention module's layer when its layer type is chunked, else None.

    Raises:
        SeqparInputError: a model with chunked layers whose attention module does not say its layer index.
    """
    config = getattr(module, "config", None)
    kinds = getattr(config, "layer_types", None) or ()
    if not any(LAYER_MASKS[kind].chunk_field for kind in kinds if kind in LAYER_MASKS):
        return None
    found = layer_mask(module)
    if found is None:
        raise SeqparInputError(
            f"{type(module).__name__} belongs to a model with chunked attention layers but does not say its layer "
            "index (layer_idx), so seqpar cannot tell whether its mask is chunked"
        )
    field = found[1].chunk_field
    return None if field is None else getattr(config, field)
