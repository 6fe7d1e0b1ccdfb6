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

"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass

from seqpar.errors import SeqparInputError
from seqpar.models.families import FAMILIES
from seqpar.models.hybrid_sizes import (
    ATTENTION,
    PARALLEL,
    Hybrid,
    SharedBlocks,
    hybrid_config,
    hybrid_fields,
    layer_types,
    ssm_fields,
)
from seqpar.models.mixers import MixerSizes, mixer_layer_types
from seqpar.models.mla_sizes import mla_fields
from seqpar.models.parameters import active_parameters, parameter_counts
from seqpar.models.unsized import unsized_reason


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
    layer_kinds: tuple[str, ...] = ()
    """Hybrids: each layer's role (``ATTENTION``, ``MIXER``, ``PARALLEL``, ``SHARED`` or an MLP's, Note [hybrid
    sizes]); empty when every layer is attention."""
    attention_gate: bool = False
    """The attention's output gate (Qwen3-Next, Qwen3.5): ``q_proj`` makes the queries and the gate."""
    qk_norm: bool = False
    """Per-head RMSNorms of the queries and keys in the attention layers (hybrids only; others leave them out)."""
    layer_norms: int = 2
    """RMSNorms per layer: 2, or 1 in a state-space model whose layers are a norm and a mixer (Mamba, Mamba2)."""
    mlp_gated: bool = True
    """The MLPs and experts have a gate projection (SwiGLU); False: an up and a down projection (Nemotron-H)."""
    qk_norm_whole: bool = False
    """The q/k RMSNorms span every head's columns (Olmo-Hybrid) rather than one head's."""
    mixer: MixerSizes | None = None
    """Hybrids: the sizes of their token mixer other than attention, an instance of its row (Note [mixer rows])."""
    shared: SharedBlocks | None = None
    """Zamba2: its shared blocks (Note [hybrid sizes])."""
    rotary: bool = True
    """The attention layers rotate q and k (False: the family has no rotary embedding, ``Family.rotary``)."""

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
    def hybrid(self) -> bool:
        """Whether some layers hold a token mixer other than attention (Note [hybrid sizes])."""
        return any(kind != ATTENTION for kind in self.layer_kinds)

    @property
    def kind_counts(self) -> dict[str, int]:
        """Layers of each kind among ``num_hidden_layers``: the config's own, or in proportion for a pipeline
        stage's share of them, the largest remainders rounded up (ties in the model's order; Note [hybrid
        sizes])."""
        if not self.layer_kinds:
            return {"attention": self.num_hidden_layers}
        whole = {kind: self.layer_kinds.count(kind) for kind in dict.fromkeys(self.layer_kinds)}
        if self.num_hidden_layers == len(self.layer_kinds):
            return whole
        shares = {kind: n * self.num_hidden_layers / len(self.layer_kinds) for kind, n in whole.items()}
        counts = {kind: int(share) for kind, share in shares.items()}
        by_remainder = sorted(shares, key=lambda kind: counts[kind] - shares[kind])  # stable: model order on ties
        for kind in by_remainder[: self.num_hidden_layers - sum(counts.values())]:  # the largest remainders
            counts[kind] += 1
        return {kind: n for kind, n in counts.items() if n}

    @property
    def attention_layers(self) -> int:
        """Layers among ``num_hidden_layers`` that run attention (Falcon-H1's run it beside Mamba2)."""
        counts = self.kind_counts
        return counts.get(ATTENTION, 0) + counts.get(PARALLEL, 0)

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
        hybrid = _hybrid_of(self.model_type)
        if self.num_experts and hybrid is not None and hybrid.shared_mlp:
            config.update(
                num_local_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                intermediate_size=self.moe_intermediate_size,
                shared_intermediate_size=self.shared_expert_intermediate_size,
            )
        elif self.num_experts and not self.shared_expert_gate:  # DeepSeek's schema
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
        if self.hybrid and hybrid is not None:  # after the experts: a hybrid's own names for them win
            config.update(hybrid_config(self, hybrid))
        return config


def _check_tp(heads: int, kv_heads: int, tp: int) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise SeqparInputError(f"tp_size must be a positive integer, got {tp!r}")
    if heads % tp or kv_heads % tp:
        raise SeqparInputError(f"tp_size {tp} must divide the heads ({heads}) and key/value heads ({kv_heads})")


def _hybrid_of(model_type: str) -> Hybrid | None:
    """The ``Family.hybrid`` of a model type; None for a family without one, or a model type of no family."""
    family = FAMILIES.get(model_type)
    return family.hybrid if family is not None else None


def _from_config(config: object, tp: int, source: str) -> ModelSizes:
    """``ModelSizes.from_config`` without the source in its errors."""
    if isinstance(config, dict):
        config = config.get("text_config", config)
    else:
        config = getattr(config, "text_config", None) or config
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    model_type = str(get("model_type", None) or "llama")
    if unsized := unsized_reason(model_type):  # parts the sizes lack: no number (Note [unsized parts])
        raise SeqparInputError(unsized)
    family = FAMILIES.get(model_type)
    quirks = _hybrid_of(model_type)
    rotary = family is None or family.rotary is not None
    for field, derive in quirks.derive if quirks is not None else ():
        if get(field) is None:  # a config.json's field that its config class derives
            get = _answering(get, field, derive(get))
    if quirks is not None and quirks.state_space:  # a norm and a mixer per layer, no attention, no MLP
        fields = ssm_fields(get, model_type, quirks, tp)
        return ModelSizes(**fields, model_type=model_type, source=source, tp_size=tp, rotary=rotary)
    names = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "num_hidden_layers")
    missing = [n for n in names if not isinstance(get(n), int) or isinstance(get(n), bool) or get(n) <= 0]
    if missing and get("model_type", None) is None:
        raise SeqparInputError(f"the model config lacks positive integer {', '.join(missing)}: not a decoder config")
    if missing:  # a family shaped otherwise (experts alone, other names): a number here would be a guess
        raise SeqparInputError(
            f"unmodelled: the {model_type!r} config names no positive integer {', '.join(missing)}, which seqpar's "
            "sizes read (Llama-shaped decoders and the families of its registry); its memory estimate and plans "
            "would be guesses, training under seqpar is not affected"
        )
    types = layer_types(get)
    if quirks is not None and quirks.parallel:  # attention beside the mixer in every layer, whatever the types say
        types = [PARALLEL] * get("num_hidden_layers")
    words = mixer_layer_types()
    mixing = sorted({t for t in types if t in words or t == PARALLEL})
    if mixing and quirks is None:
        known = [t for t, f in FAMILIES.items() if f.hybrid is not None and not f.hybrid.state_space]
        raise SeqparInputError(
            f"a hybrid model (layers of type {', '.join(mixing)} besides attention) of model type {model_type!r}: "
            f"seqpar's sizes describe the hybrid layers of {', '.join(known)} only, so its memory "
            "estimate and plans would be wrong for this model; training under seqpar is not affected "
            "(Note [hybrid sizes])"
        )
    hybrid = hybrid_fields(get, model_type, quirks, types, tp) if mixing else {}
    hidden, heads, layers = get("hidden_size"), get("num_attention_heads"), get("num_hidden_layers")
    kv_heads = get("num_key_value_heads") or heads
    mla = mla_fields(get, tuple(t for t, f in FAMILIES.items() if f.mla))
    if mla:  # every head has its own keys and values once the latent is expanded (Note [MLA sizes])
        kv_heads = heads
    if heads % kv_heads:
        raise SeqparInputError(f"{heads} query heads do not divide into {kv_heads} key/value heads")
    _check_tp(heads, kv_heads, tp)
    if hybrid and len(hybrid["layer_kinds"]) != layers:
        raise SeqparInputError(f"{len(hybrid['layer_kinds'])} layer types for {layers} layers")
    experts = _experts(get, layers)
    if quirks is not None and quirks.shared_mlp:  # the shared MLP is the dense MLP, or an ungated shared expert
        shared = get("shared_intermediate_size") or get("intermediate_size")
        if experts:
            experts.update(shared_expert_intermediate_size=shared, shared_expert_gate=False)
        hybrid["intermediate_size"] = shared
    return ModelSizes(
        hidden_size=hidden,
        intermediate_size=hybrid.pop("intermediate_size", None) or get("intermediate_size"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=get("vocab_size"),
        head_dim=mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
        if mla
        else hybrid.pop("head_dim", None) or get("head_dim") or hidden // heads,
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        model_type=model_type,
        source=source,
        tp_size=tp,
        rotary=rotary,
        **(experts | mla | hybrid),  # a hybrid's own reading of its experts wins
    )


def _answering(get, field: str, value: int):
    """``get`` that answers ``field`` with ``value`` (a field a config derives but its dict lacks)."""

    def read(name: str, default=None):
        return value if name == field else get(name, default)

    return read


def _experts(get, layers: int) -> dict:
    """The mixture-of-experts fields of ``ModelSizes`` (Note [mixture-of-experts sizes]); none when dense."""
    experts = get("num_local_experts") or get("num_experts") or get("n_routed_experts") or 0
    if not isinstance(experts, int) or experts <= 1:
        return {}
    per_token = get("num_experts_per_tok") or get("experts_per_token") or get("num_experts_per_token") or 0
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
    if get("expert_layer_period"):  # Jamba: experts in every period-th layer from the offset
        period, offset = get("expert_layer_period"), get("expert_layer_offset") or 0
        dense_only = {i for i in range(layers) if i % period != offset}
    return {
        "num_experts": experts,
        "num_experts_per_tok": per_token,
        "moe_intermediate_size": width,
        "shared_expert_intermediate_size": get("shared_expert_intermediate_size") or 0,
        "moe_layers": sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0),
    }


PARAMETER_SLACK = 0.01
"""How far seqpar's parameter count of a family without a registry entry may be from its built model's (biases and
norms it does not count); beyond it the family's sizes are unmodelled (Note [sizes of read families])."""


def unmodelled_sizes(model_config: object) -> str | None:
    """Why seqpar's sizes do not describe a family without a registry entry, or None (Note [sizes of read families]).

    Note [sizes of read families]
        ``ModelSizes`` reads a config as a Llama-shaped decoder (gated MLPs, two norms a layer) unless a registry
        entry says more. A family served by the anatomy read from the model (Note [read anatomy]) may be shaped
        otherwise (a plain two-matrix MLP, parallel blocks, extra projections), and its estimate would then be a
        wrong number. So for a model type without an entry the memory estimate and the planner build the model
        on the meta device (nothing allocated) and compare its parameter count with the sizes' count: beyond
        ``PARAMETER_SLACK`` they refuse, naming both counts, rather than print a number they cannot stand behind.
        The answer is kept per config (the planner estimates every candidate layout of one model), and a
        registered family or a preset loads no torch for this (Note [torch-free planning]).
    """
    fields = model_config if isinstance(model_config, dict) else getattr(model_config, "to_dict", dict)()
    model_type = fields.get("model_type")
    text = fields.get("text_config")
    if unsized := unsized_reason(text.get("model_type") if isinstance(text, dict) else model_type):
        return unsized
    if not isinstance(model_type, str) or model_type in FAMILIES:
        return None
    return _unmodelled(json.dumps(fields, sort_keys=True, default=str))


@functools.lru_cache(maxsize=8)
def _unmodelled(fields_json: str) -> str | None:
    """``unmodelled_sizes`` of one config, given as its fields' canonical JSON."""
    import torch
    import transformers

    fields = json.loads(fields_json)
    model_type = fields.pop("model_type")
    try:
        config = transformers.AutoConfig.for_model(model_type, **fields)
        with torch.device("meta"):
            built = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    except Exception as error:  # no causal LM transformers can build from this config
        return f"seqpar has no entry for {model_type!r} and cannot build it to check its sizes ({error})"
    counted = parameter_counts(ModelSizes.from_config(config))[0]
    if abs(counted - built) <= PARAMETER_SLACK * built:
        return None
    return (
        f"unmodelled: seqpar's sizes count {counted:,} parameters for {model_type!r}, the model has {built:,} "
        f"({(counted - built) / built:+.1%}); its layers are not the Llama-shaped ones the sizes describe (a plain "
        "MLP, parallel blocks or extra parts), so the estimate would be wrong; describe the family with "
        "seqpar.models.register_family"
    )
