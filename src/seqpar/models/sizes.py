"""The sizes of a decoder-only transformer read from its transformers config, and its parameter counts.

``ModelSizes`` is the one description of a model's sizes that the memory estimate and the planner read.

Note [mixture-of-experts sizes]
    A mixture-of-experts layer stores ``E`` gated experts of width ``I_e`` (``moe_intermediate_size`` where
    the config has one, else ``intermediate_size``: Mixtral, gpt-oss) and a router ``E x hidden``, plus a
    shared expert where the config names one (``shared_expert_intermediate_size``, Qwen2-MoE). Each token
    runs through ``k = num_experts_per_tok`` of them, so a layer *stores* ``3 h I_e E`` MLP weights but a
    token *uses* ``3 h I_e k``. Weights, gradients and optimizer states scale with the stored count; FLOPs
    and the MLP's activations with the active one: ``ModelSizes.mlp_width`` is the per-token width
    ``k I_e`` (+ the shared expert) so the activation formulas hold unchanged, and the stored experts are in
    ``parameter_counts``. Besides the MLP's activations of that width, an expert layer keeps ``2 k h`` per
    token: transformers' experts (grouped_mm, the CPU default) keep the ``k`` copies of each token routed to
    its experts and the ``k`` weighted outputs before they are summed (counted with saved-tensor hooks on
    Mixtral and DeepSeek-V3 layers, ``tests/test_estimate.py``; the router's float32 scores, about ten
    ``E``-wide vectors a token, are left out). Layers that stay dense (Qwen's ``mlp_only_layers`` and
    ``decoder_sparse_step``) keep ``intermediate_size``; the larger of the two widths is used per token, and
    the routed copies are counted in every layer where some are expert layers, which over-counts, never
    under-counts. Biases, sinks and q/k norms (a few vectors a layer) are left out. DeepSeek's schema
    (``n_routed_experts``, ``n_shared_experts`` experts of ``moe_intermediate_size`` sharing one ungated
    shared MLP, dense ``first_k_dense_replace`` first layers; GLM-4-MoE and dots.llm1 share it) reads into the
    same fields.

Note [MLA sizes]
    MLA attention (DeepSeek-V2/V3, MiniCPM3) projects the queries through a rank-``r_q`` bottleneck
    (``q_a_proj``, an RMSNorm, ``q_b_proj``; a plain ``q_proj`` when ``q_lora_rank`` is None) and the keys
    and values through one shared latent: ``kv_a_proj_with_mqa`` makes ``r_kv`` latent plus ``d_rope``
    rotary key columns, an RMSNorm, ``kv_b_proj`` expands the latent to every head's ``d_nope`` key and
    ``d_v`` value columns, and ``o_proj`` reads ``heads x d_v``. Queries and keys have
    ``d_qk = d_nope + d_rope`` columns per head, and every head has its own keys and values after the
    expansion. seqpar pads the values to ``d_qk`` (Note [value head size]), so the attention seqpar runs is
    a plain multi-head attention of ``heads`` heads of ``d_qk``: ``ModelSizes.dim`` is ``d_qk`` and the
    key/value heads are the query heads, which makes the communication sizes and attention FLOPs those of
    the padded tensors seqpar moves. The projections' weights are counted exactly (the two latent norms
    included), as ``parameter_counts`` of the built model. Only the model types whose layers were checked
    so are read (DeepSeek-V2/V3, MiniCPM3); other MLA configs (DSA indexers, Kimi Linear's KDA layers) are
    refused with the reason.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from seqpar.errors import SeqparInputError

__all__ = ["ModelSizes", "active_parameters", "parameter_counts"]


@dataclass(frozen=True)
class ModelSizes:
    """Sizes of a decoder-only transformer with gated (SwiGLU) MLPs or experts, as in a Hugging Face config.

    The fields are the whole model's, under the config's names; the ``*_width`` properties are those of one of
    ``tp_size`` tensor-parallel ranks. Mixture-of-experts models: weights, gradients and optimizer states count
    the stored experts, FLOPs and activations the ones a token runs through (Note [mixture-of-experts sizes]).
    """

    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the dense MLP's gate and up projections (of one expert in configs that have no
    ``moe_intermediate_size``, such as Mixtral's)."""
    num_hidden_layers: int
    """Decoder layers."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (grouped-query attention when fewer than the query heads)."""
    vocab_size: int
    """Rows of the embedding and the language-model head."""
    head_dim: int = 0
    """Width of one head; 0 means hidden_size // num_attention_heads."""
    tie_word_embeddings: bool = False
    """Whether the language-model head shares the embedding's weights."""
    model_type: str = "llama"
    """The Hugging Face model type the sizes came from."""
    source: str = ""
    """Where the sizes came from (a file, or a preset's published config)."""
    num_experts: int = 0
    """Experts stored per mixture-of-experts layer; 0 for a dense model."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to."""
    moe_intermediate_size: int = 0
    """Width of one expert's gate and up projections."""
    shared_expert_intermediate_size: int = 0
    """Width of the shared expert every token also runs through (Qwen2-MoE); 0 for none."""
    moe_layers: int = 0
    """How many layers are mixture-of-experts layers (the first ``num_hidden_layers - moe_layers`` are dense)."""
    shared_expert_gate: bool = True
    """Whether the shared expert has a ``hidden -> 1`` gate (Qwen2-MoE's); DeepSeek's has none."""
    q_lora_rank: int = 0
    """MLA: rank of the query bottleneck; 0 for a plain query projection (Note [MLA sizes])."""
    kv_lora_rank: int = 0
    """MLA: rank of the shared key/value latent; 0 for an attention that is not MLA."""
    qk_nope_head_dim: int = 0
    """MLA: query/key columns per head without the rotary embedding."""
    qk_rope_head_dim: int = 0
    """MLA: rotary query/key columns per head (the rotary key columns are one, shared by the heads)."""
    v_head_dim: int = 0
    """MLA: value columns per head (padded to ``dim`` inside seqpar's attention)."""
    tp_size: int = 1
    """Tensor-parallel degree the ``*_width`` properties and the parameter counts are of (one rank's share)."""

    @classmethod
    def from_config(cls, config: object, tp_size: int = 1, *, source: str = "") -> ModelSizes:
        """The sizes of a transformers config (or the dict of its fields; a multimodal one's ``text_config``).

        Args:
            config: a transformers config (LlamaConfig, Qwen2Config, ...) or a dict of its fields.
            tp_size: tensor-parallel degree of the ``*_width`` properties.
            source: where the config came from, named in errors and kept in ``source``.

        Returns:
            The ``ModelSizes``.

        Raises:
            SeqparInputError: a config without the sizes of a decoder (positive integers), query heads that do
                not group over the key/value heads, heads that tp does not divide, bad expert counts, MLA sizes
                that are not positive integers or MLA of a model type whose layers these sizes do not describe
                (Note [MLA sizes]), or a hybrid's other mixers (which these sizes do not describe either).
        """
        if isinstance(config, ModelSizes) and not source:  # already read: only the tp view may differ
            return config if config.tp_size == tp_size else config.for_tp(tp_size)
        try:
            return _from_config(config, tp_size, source)
        except SeqparInputError as error:
            if not source:
                raise
            raise SeqparInputError(f"model config {source}: {error}") from None

    def for_tp(self, tp_size: int) -> ModelSizes:
        """The same model seen by one of ``tp_size`` tensor-parallel ranks.

        Args:
            tp_size: tensor-parallel degree.

        Returns:
            A copy with ``tp_size`` set.

        Raises:
            SeqparInputError: heads or key/value heads that ``tp_size`` does not divide.
        """
        _check_tp(self.num_attention_heads, self.num_key_value_heads, tp_size)
        return dataclasses.replace(self, tp_size=tp_size)

    @property
    def dim(self) -> int:
        """Width of one attention head."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def q_width(self) -> int:
        """Query projection width of one tp rank."""
        return self.num_attention_heads * self.dim // self.tp_size

    @property
    def kv_width(self) -> int:
        """Key (or value) projection width of one tp rank."""
        return self.num_key_value_heads * self.dim // self.tp_size

    @property
    def mla(self) -> bool:
        """Whether the attention is MLA (Note [MLA sizes])."""
        return self.kv_lora_rank > 0

    @property
    def v_width(self) -> int:
        """Value columns of one token on one tp rank as the model makes them (unpadded; ``kv_width`` otherwise)."""
        return self.num_attention_heads * self.v_head_dim // self.tp_size if self.mla else self.kv_width

    @property
    def dense_width(self) -> int:
        """Width of a dense MLP's gate and up projections on one tp rank."""
        return self.intermediate_size // self.tp_size

    @property
    def expert_width(self) -> int:
        """Width of one expert's gate and up projections on one tp rank (0: a dense model)."""
        return self.moe_intermediate_size // self.tp_size

    @property
    def shared_width(self) -> int:
        """Width of the shared expert on one tp rank (0: none)."""
        return self.shared_expert_intermediate_size // self.tp_size

    @property
    def mlp_width(self) -> int:
        """Width of the MLP activations of one token on one tp rank: the routed experts' (and shared expert's)
        or the dense one, the larger where both kinds of layer exist (Note [mixture-of-experts sizes])."""
        if not self.num_experts:
            return self.dense_width
        active = self.num_experts_per_tok * self.expert_width + self.shared_width
        return max(active, self.dense_width if self.moe_layers < self.num_hidden_layers else 0)

    @property
    def layer_params(self) -> int:
        """Weights a token runs through in one decoder layer, averaged over the layers (norms left out)."""
        h = self.hidden_size
        return (active_parameters(self) - h * (self.vocab_size + 1 + 2 * self.num_hidden_layers)) // (
            self.num_hidden_layers
        )

    @property
    def num_params(self) -> int:
        """All stored weights: layers (every expert), embedding, head (once when tied) and the RMSNorm scales."""
        return parameter_counts(self)[0]

    @property
    def active_params(self) -> int:
        """Weights one token runs through: ``num_params`` less the experts it is not routed to and the embedding."""
        return active_parameters(self)

    def as_config(self) -> dict:
        """The whole model's sizes as a Hugging Face config dictionary.

        Returns:
            A dict that ``ModelSizes.from_config`` reads back to these sizes.
        """
        config = {
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "vocab_size": self.vocab_size,
            "head_dim": self.dim,
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        if self.mla:
            config.update(
                q_lora_rank=self.q_lora_rank or None,
                kv_lora_rank=self.kv_lora_rank,
                qk_nope_head_dim=self.qk_nope_head_dim,
                qk_rope_head_dim=self.qk_rope_head_dim,
                v_head_dim=self.v_head_dim,
            )
        if self.num_experts and not self.shared_expert_gate:  # DeepSeek's schema
            config.update(
                n_routed_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                n_shared_experts=self.shared_expert_intermediate_size // self.moe_intermediate_size,
                first_k_dense_replace=self.num_hidden_layers - self.moe_layers,
            )
        elif self.num_experts:
            config.update(
                num_local_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                mlp_only_layers=list(range(self.num_hidden_layers - self.moe_layers)),
            )
        return config


def _check_tp(heads: int, kv_heads: int, tp: int) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise SeqparInputError(f"tp_size must be a positive integer, got {tp!r}")
    if heads % tp or kv_heads % tp:
        raise SeqparInputError(f"tp_size {tp} must divide the heads ({heads}) and key/value heads ({kv_heads})")


_NOT_ATTENTION = ("conv", "linear_attention", "mamba", "mamba2", "recurrent", "linear")
"""``layer_types`` entries of token mixers other than attention."""


def _from_config(config: object, tp: int, source: str) -> ModelSizes:
    """``ModelSizes.from_config`` without the source in its errors."""
    if isinstance(config, dict):
        config = config.get("text_config", config)
    else:
        config = getattr(config, "text_config", None) or config
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    names = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "num_hidden_layers")
    missing = [n for n in names if not isinstance(get(n), int) or isinstance(get(n), bool) or get(n) <= 0]
    if missing:
        raise SeqparInputError(f"the model config lacks positive integer {', '.join(missing)}: not a decoder config")
    mixing = sorted({t for t in get("layer_types") or () if t in _NOT_ATTENTION})
    if mixing:  # LFM2, Qwen3-Next, Qwen3.5
        raise SeqparInputError(
            f"a hybrid model (layers of type {', '.join(mixing)} besides attention): seqpar's sizes describe "
            "attention layers only, so its memory estimate and plans would be wrong for this model; training "
            "under seqpar is not affected (Note [mixer adapters])"
        )
    hidden, heads, layers = get("hidden_size"), get("num_attention_heads"), get("num_hidden_layers")
    kv_heads = get("num_key_value_heads") or heads
    mla = _mla(get)
    if mla:  # every head has its own keys and values once the latent is expanded (Note [MLA sizes])
        kv_heads = heads
    if heads % kv_heads:
        raise SeqparInputError(f"{heads} query heads do not divide into {kv_heads} key/value heads")
    _check_tp(heads, kv_heads, tp)
    return ModelSizes(
        hidden_size=hidden,
        intermediate_size=get("intermediate_size"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=get("vocab_size"),
        head_dim=mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"] if mla else get("head_dim") or hidden // heads,
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        model_type=str(get("model_type", None) or "llama"),
        source=source,
        tp_size=tp,
        **_experts(get, layers),
        **mla,
    )


_MLA_TYPES = ("deepseek_v2", "deepseek_v3", "minicpm3")
"""Model types whose MLA layers Note [MLA sizes] describes (checked against built models)."""


def _mla(get) -> dict:
    """The MLA fields of ``ModelSizes`` (Note [MLA sizes]); none when the attention is not MLA."""
    if not get("kv_lora_rank") and not get("v_head_dim"):
        return {}
    if get("model_type") not in _MLA_TYPES:  # DSA indexers, KDA hybrids, other layer shapes around MLA
        raise SeqparInputError(
            f"MLA attention of model type {get('model_type')!r}: seqpar's sizes describe the MLA layers of "
            f"{', '.join(_MLA_TYPES)} only, so its memory estimate and plans could be wrong for this model; "
            "training under seqpar is not affected (Note [value head size])"
        )
    names = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    fields = {n: get(n) for n in names}
    bad = [n for n, v in fields.items() if not isinstance(v, int) or isinstance(v, bool) or v <= 0]
    q_rank = get("q_lora_rank") or 0
    if not isinstance(q_rank, int) or isinstance(q_rank, bool) or q_rank < 0:
        bad.append("q_lora_rank")
    if bad:
        raise SeqparInputError(f"MLA attention needs positive integer {', '.join(bad)} (q_lora_rank may be None)")
    return {**fields, "q_lora_rank": q_rank}


def _experts(get, layers: int) -> dict:
    """The mixture-of-experts fields of ``ModelSizes`` (Note [mixture-of-experts sizes]); none when dense."""
    experts = get("num_local_experts") or get("num_experts") or get("n_routed_experts") or 0
    if not isinstance(experts, int) or experts <= 1:
        return {}
    per_token = get("num_experts_per_tok") or get("experts_per_token") or 0
    if not isinstance(per_token, int) or not 0 < per_token <= experts:
        raise SeqparInputError(f"num_experts_per_tok must be in 1..{experts} (the experts), got {per_token!r}")
    width = get("moe_intermediate_size") or get("intermediate_size")
    if get("n_routed_experts"):  # DeepSeek: ungated shared experts, the first layers dense
        dense = get("first_k_dense_replace") or 0  # transformers' layers read no moe_layer_freq
        return {
            "num_experts": experts,
            "num_experts_per_tok": per_token,
            "moe_intermediate_size": width,
            "shared_expert_intermediate_size": (get("n_shared_experts") or 0) * width,
            "shared_expert_gate": False,
            "moe_layers": max(0, layers - dense),
        }
    step, dense_only = get("decoder_sparse_step") or 1, set(get("mlp_only_layers") or ())
    return {
        "num_experts": experts,
        "num_experts_per_tok": per_token,
        "moe_intermediate_size": width,
        "shared_expert_intermediate_size": get("shared_expert_intermediate_size") or 0,
        "moe_layers": sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0),
    }


def _attention_params(d: ModelSizes) -> int:
    """The attention's projections and the layer's two RMSNorms (Note [MLA sizes] for MLA)."""
    h = d.hidden_size
    if not d.mla:
        return h * (2 * d.q_width + 2 * d.kv_width) + 2 * h
    heads = d.num_attention_heads // d.tp_size
    r_q, r_kv = d.q_lora_rank, d.kv_lora_rank
    q = h * r_q + r_q + r_q * d.q_width if r_q else h * d.q_width  # bottleneck, its norm, expansion
    kv = h * (r_kv + d.qk_rope_head_dim) + r_kv + r_kv * heads * (d.qk_nope_head_dim + d.v_head_dim)
    return q + kv + d.v_width * h + 2 * h


def _moe_mlp_params(d: ModelSizes, experts: int) -> int:
    """MLP weights of a mixture-of-experts layer with ``experts`` experts counted, router and shared expert."""
    h = d.hidden_size
    shared = 3 * h * d.shared_width + (h if d.shared_width and d.shared_expert_gate else 0)
    return 3 * h * d.expert_width * experts + h * d.num_experts + shared


def _layer_params(d: ModelSizes, experts: int) -> tuple[int, int, int]:
    """(sparse layers, a dense layer's parameters, a sparse layer's) with ``experts`` experts counted."""
    sparse_layers = min(d.moe_layers, d.num_hidden_layers)  # a pipeline stage's view keeps the whole model's count
    dense = _attention_params(d) + 3 * d.hidden_size * d.dense_width
    sparse = _attention_params(d) + _moe_mlp_params(d, experts) if sparse_layers else 0
    return sparse_layers, dense, sparse


def parameter_counts(d: ModelSizes) -> tuple[int, int, int]:
    """Stored parameters of a Llama-style model (gated MLPs or experts, two RMSNorms per layer) on one tp rank.

    Args:
        d: the model's sizes (Note [mixture-of-experts sizes] for experts).

    Returns:
        (all parameters, the largest decoder layer's, the output head's ``vocab x hidden``).
    """
    sparse_layers, dense, sparse = _layer_params(d, d.num_experts)
    head = d.vocab_size * d.hidden_size
    total = (d.num_hidden_layers - sparse_layers) * dense + sparse_layers * sparse
    total += head * (1 if d.tie_word_embeddings else 2) + d.hidden_size
    return total, max(dense if sparse_layers < d.num_hidden_layers else 0, sparse), head


def active_parameters(d: ModelSizes) -> int:
    """Parameters one token runs through (the experts it is routed to; the embedding row left out), one tp rank.

    Args:
        d: the model's sizes.

    Returns:
        The active parameter count; ``parameter_counts(d)[0] - vocab x hidden`` for a dense model.
    """
    sparse_layers, dense, sparse = _layer_params(d, d.num_experts_per_tok)
    total = (d.num_hidden_layers - sparse_layers) * dense + sparse_layers * sparse
    return total + d.vocab_size * d.hidden_size + d.hidden_size
