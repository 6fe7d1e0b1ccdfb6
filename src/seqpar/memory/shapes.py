"""The sizes of a decoder-only transformer read from its transformers config, and its parameter counts.

The memory estimate and the tools built on it read a model only through ``model_dims``.

Note [mixture-of-experts sizes]
    A mixture-of-experts layer stores ``E`` gated experts of width ``I_e`` (``moe_intermediate_size`` where
    the config has one, else ``intermediate_size``: Mixtral, gpt-oss) and a router ``E x hidden``, plus a
    shared expert where the config names one (``shared_expert_intermediate_size``, Qwen2-MoE). Each token
    runs through ``k = num_experts_per_tok`` of them, so a layer *stores* ``3 h I_e E`` MLP weights but a
    token *uses* ``3 h I_e k``. Weights, gradients and optimizer states scale with the stored count; FLOPs
    and the MLP's activations with the active one: ``ModelDims.intermediate`` is the per-token width
    ``k I_e`` (+ the shared expert) so the activation formulas hold unchanged, and the stored experts are in
    ``parameter_counts``. Layers that stay dense (Qwen's ``mlp_only_layers`` and ``decoder_sparse_step``)
    keep ``intermediate_size``; the larger of the two widths is used per token, which over-counts, never
    under-counts. Biases, sinks and q/k norms (a few vectors a layer) are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from seqpar.errors import SeqparInputError

__all__ = ["ModelDims", "active_parameters", "model_dims", "parameter_counts"]


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
    dense_intermediate: int = 0
    """MLP width of the dense layers (0: the same as ``intermediate``)."""
    experts: int = 0
    """Experts stored per mixture-of-experts layer (0: a dense model)."""
    experts_per_token: int = 0
    """Experts each token runs through."""
    expert_intermediate: int = 0
    """Width of one expert's gate and up projections (per tp rank)."""
    shared_intermediate: int = 0
    """Width of the shared expert every token runs through (per tp rank; 0: none)."""
    moe_layers: int = 0
    """How many of the layers are mixture-of-experts layers."""


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
    moe = _experts(get, get("num_hidden_layers"), tp)
    dense = get("intermediate_size") // tp
    active = moe.get("experts_per_token", 0) * moe.get("expert_intermediate", 0) + moe.get("shared_intermediate", 0)
    return ModelDims(
        hidden=hidden,
        q_width=heads * head_dim // tp,
        kv_width=kv_heads * head_dim // tp,
        intermediate=max(active, dense if moe.get("moe_layers", 0) < get("num_hidden_layers") else 0),
        vocab=get("vocab_size"),
        layers=get("num_hidden_layers"),
        heads=heads,
        kv_heads=kv_heads,
        tied=bool(get("tie_word_embeddings", False)),
        dense_intermediate=dense,
        **moe,
    )


def _experts(get, layers: int, tp: int) -> dict:
    """The mixture-of-experts fields of ``ModelDims`` (Note [mixture-of-experts sizes]); zeros when dense."""
    experts = get("num_local_experts") or get("num_experts") or 0
    if not isinstance(experts, int) or experts <= 1:
        return {}
    per_token = get("num_experts_per_tok") or get("experts_per_token") or 0
    if not isinstance(per_token, int) or not 0 < per_token <= experts:
        raise SeqparInputError(f"num_experts_per_tok must be in 1..{experts} (the experts), got {per_token!r}")
    width = get("moe_intermediate_size") or get("intermediate_size")
    step, dense_only = get("decoder_sparse_step") or 1, set(get("mlp_only_layers") or ())
    sparse = sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
    return {
        "experts": experts,
        "experts_per_token": per_token,
        "expert_intermediate": width // tp,
        "shared_intermediate": (get("shared_expert_intermediate_size") or 0) // tp,
        "moe_layers": sparse,
    }


def _attention_params(d: ModelDims) -> int:
    return d.hidden * (2 * d.q_width + 2 * d.kv_width) + 2 * d.hidden  # projections and the two RMSNorms


def _moe_mlp_params(d: ModelDims, experts: int) -> int:
    """MLP weights of a mixture-of-experts layer with ``experts`` experts counted, router and shared expert."""
    shared = 3 * d.hidden * d.shared_intermediate + (d.hidden if d.shared_intermediate else 0)
    return 3 * d.hidden * d.expert_intermediate * experts + d.hidden * d.experts + shared


def parameter_counts(d: ModelDims) -> tuple[int, int, int]:
    """Stored parameters of a Llama-style model (gated MLPs or experts, two RMSNorms per layer) on one tp rank.

    Args:
        d: the model's sizes (Note [mixture-of-experts sizes] for experts).

    Returns:
        (all parameters, the largest decoder layer's, the output head's ``vocab x hidden``).
    """
    sparse_layers = min(d.moe_layers, d.layers)  # a pipeline stage's view keeps the count of the whole model
    dense = _attention_params(d) + 3 * d.hidden * (d.dense_intermediate or d.intermediate)
    sparse = _attention_params(d) + _moe_mlp_params(d, d.experts) if sparse_layers else 0
    head = d.vocab * d.hidden
    total = (d.layers - sparse_layers) * dense + sparse_layers * sparse + head * (1 if d.tied else 2) + d.hidden
    return total, max(dense if sparse_layers < d.layers else 0, sparse), head


def active_parameters(d: ModelDims) -> int:
    """Parameters one token runs through (the experts it is routed to; the embedding row left out), one tp rank.

    Args:
        d: the model's sizes.

    Returns:
        The active parameter count; ``parameter_counts(d)[0] - vocab x hidden`` for a dense model.
    """
    sparse_layers = min(d.moe_layers, d.layers)
    dense = _attention_params(d) + 3 * d.hidden * (d.dense_intermediate or d.intermediate)
    sparse = _attention_params(d) + _moe_mlp_params(d, d.experts_per_token) if sparse_layers else 0
    return (d.layers - sparse_layers) * dense + sparse_layers * sparse + d.vocab * d.hidden + d.hidden
