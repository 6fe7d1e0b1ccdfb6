"""The sizes of a decoder-only transformer read from its transformers config, and its parameter counts.

The memory estimate and the tools built on it read a model only through ``model_dims``.
"""

from __future__ import annotations

from dataclasses import dataclass

from seqpar.errors import SeqparInputError

__all__ = ["ModelDims", "model_dims", "parameter_counts"]


@dataclass(frozen=True)
class ModelDims:
    """The sizes of a decoder-only transformer read from its config (widths per tp rank)."""

    hidden: int
    q_width: int
    kv_width: int
    intermediate: int
    vocab: int
    layers: int
    heads: int
    kv_heads: int
    tied: bool


def model_dims(model_config: object, tp: int) -> ModelDims:
    """The sizes of ``model_config``, with the attention and MLP widths of one of ``tp`` ranks.

    Args:
        model_config: a transformers config (LlamaConfig, Qwen2Config, ...) or a dict of its fields; a
            multimodal config's ``text_config`` is read.
        tp: tensor-parallel degree.

    Returns:
        The ``ModelDims``.

    Raises:
        SeqparInputError: a config without the sizes of a decoder (positive integers), query heads that do
            not group over the key/value heads, or heads that tp does not divide.
    """
    if isinstance(model_config, dict):
        model_config = model_config.get("text_config", model_config)
    else:
        model_config = getattr(model_config, "text_config", None) or model_config
    get = model_config.get if isinstance(model_config, dict) else lambda k, d=None: getattr(model_config, k, d)
    names = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "num_hidden_layers")
    missing = [n for n in names if not isinstance(get(n), int) or isinstance(get(n), bool) or get(n) <= 0]
    if missing:
        raise SeqparInputError(f"the model config lacks positive integer {', '.join(missing)}: not a decoder config")
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    kv_heads = get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise SeqparInputError(f"{heads} query heads do not divide into {kv_heads} key/value heads")
    head_dim = get("head_dim") or hidden // heads
    if heads % tp or kv_heads % tp:
        raise SeqparInputError(f"tp_size {tp} must divide the heads ({heads}) and key/value heads ({kv_heads})")
    return ModelDims(
        hidden=hidden,
        q_width=heads * head_dim // tp,
        kv_width=kv_heads * head_dim // tp,
        intermediate=get("intermediate_size") // tp,
        vocab=get("vocab_size"),
        layers=get("num_hidden_layers"),
        heads=heads,
        kv_heads=kv_heads,
        tied=bool(get("tie_word_embeddings", False)),
    )


def parameter_counts(d: ModelDims) -> tuple[int, int, int]:
    """Parameters of a Llama-style model (gated MLP, two RMSNorms per layer) on one tp rank.

    Args:
        d: the model's sizes.

    Returns:
        (all parameters, one decoder layer's, the output head's ``vocab x hidden``).
    """
    layer = d.hidden * (2 * d.q_width + 2 * d.kv_width) + 3 * d.hidden * d.intermediate + 2 * d.hidden
    head = d.vocab * d.hidden
    total = d.layers * layer + head * (1 if d.tied else 2) + d.hidden
    return total, layer, head
