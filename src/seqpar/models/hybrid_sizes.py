"""The sizes of a hybrid model's token mixers read from its config: which layers hold which mixer, and its fields.

``ModelSizes`` (``sizes.py``) reads these for the families whose ``Family.hybrid`` says how (Note [hybrid sizes]).

Note [hybrid sizes]).

Note [hybrid sizes]
    A hybrid model's layers each hold attention or another token mixer (``ModelSizes.layer_kinds``, read from
    the config's ``layer_types``, or Bamba's ``attn_layer_indices``), and an MLP or experts as in the rest of
    this module. The mixers counted, each with the layer's two RMSNorms (2H), H the hidden size:
    * gated DeltaNet (Qwen3-Next, Qwen3.5, Olmo-Hybrid; the ``GatedDeltaNet`` row): key heads Hk of dk, value
      heads Hv of dv, ``key_dim = Hk dk``, ``value_dim = Hv dv``, conv width K: the q/k/v/z projections
      ``H (2 key_dim + 2 value_dim)`` (one fused matrix in Qwen3-Next, four in Qwen3.5), b and a ``2 H Hv``,
      the depthwise convolution ``(2 key_dim + value_dim) K`` (no bias), ``A_log`` and ``dt_bias`` (2 Hv),
      the gated norm (dv) and ``out_proj`` (``value_dim H``).
    * Mamba2 / SSD (Bamba, GraniteMoeHybrid, Nemotron-H, Falcon-H1, Zamba2, Mamba2; the ``Mamba2`` row): Hm heads of
      d_head, ``I_m = Hm d_head``, G groups of state size N, conv width K: ``in_proj``
      ``H (2 I_m + 2 G N + Hm)`` (its bias with ``proj_bias``), the convolution ``(I_m + 2 G N) K``
      (its bias with ``conv_bias``), ``A_log``, ``D``, ``dt_bias`` (3 Hm), the gated norm (I_m; not
      in Falcon-H1 by default) and ``out_proj`` (``I_m H``, biased with ``proj_bias``).
    * Mamba1 (Mamba, Falcon-Mamba; ``intermediate_size`` I channels, state N, dt rank R, conv width K):
      ``in_proj`` ``2 H I``, the convolution ``I K`` (+ I bias), ``x_proj`` ``I (R + 2N)``, ``dt_proj``
      ``R I + I``, ``A_log`` ``I N``, ``D`` I, ``out_proj`` ``I H`` (biases with ``use_bias``). Pure
      state-space models (``Hybrid.state_space``: Mamba2, Mamba, Falcon-Mamba) have one RMSNorm per layer
      (``layer_norms``), no attention and no MLP, and tie the head by default.
    * LFM2's gated short convolution (the ``ShortConv`` row, ``conv_L_cache`` = K): ``in_proj`` ``3 H^2``, the
      convolution ``H K``, ``out_proj`` ``H^2`` (each with a bias under ``bias``). LFM2's MLP width is the one
      its layers build: with ``block_auto_adjust_ff_dim``, ``2/3`` of ``intermediate_size``, times
      ``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of``; ``intermediate_size`` holds that.
    * KDA (Kimi Linear; ``linear_num_heads`` h of ``linear_head_dim`` d, ``D = h d``): q, k, v ``3 H D``,
      their convolution ``3 D K`` (no bias), the low-rank decay and output gate (``f_a``/``g_a`` ``H d``,
      ``f_b``/``g_b`` ``d D``), ``dt_bias`` D, ``A_log`` h, ``b_proj`` ``H h``, the gated norm (d) and
      ``o_proj`` (``D H``); the ``Kda`` row.
    * MiniMax's lightning attention: ``qkv_proj`` ``3 H^2``, ``out_proj`` and ``output_gate`` ``H^2`` each
      and an RMSNorm (H), with experts in every layer. Jamba's Mamba1 layers add weighted RMSNorms on dt, B
      and C (``R + 2N``); its experts sit in every ``expert_layer_period``-th layer from
      ``expert_layer_offset``.
    Their attention layers are Llama's plus, where the family has them, per-head q/k RMSNorms
    (``qk_norm``: 2 head_dim; Olmo-Hybrid's span all heads, ``qk_norm_whole``), Qwen3-Next's output gate
    (``attention_gate``: ``q_proj`` twice as wide), or MLA (Kimi Linear, Note [MLA sizes]).
    GraniteMoeHybrid's dense ``shared_mlp`` (``shared_intermediate_size``) is the MLP; with experts it is an
    ungated shared expert beside them. Kimi Linear's experts sit in its "sparse" ``mlp_layer_types``, with
    ``n_shared_experts`` ungated shared experts (its config's dict names them ``num_experts``,
    ``num_experts_per_token``, ``num_shared_experts``). Three families lay their layers out otherwise:
    * Nemotron-H: one RMSNorm a layer, and each layer holds one of Mamba2 (its own field names), attention
      (no rotary), an MLP or experts (``MLP_KINDS``), both ungated (``up_proj``, ReLU^2, ``down_proj``:
      ``mlp_gated`` False) with an ungated shared expert; a config.json's ``hybrid_override_pattern`` reads
      as the layer types, and ``num_hidden_layers`` is their count. Latent experts (``moe_latent_size``)
      are refused.
    * Falcon-H1: attention and Mamba2 side by side after one norm in every layer (``PARALLEL`` layers),
      then the MLP; its Mamba2 has no gated norm unless ``mamba_rms_norm`` (``Mamba2.gated_norm``); the muP
      multipliers are scalars and a buffer, no parameters. Its biases (``attention_bias``, ``mlp_bias``,
      ``mamba_proj_bias``, ``projectors_bias``) are refused.
    * Zamba2: every layer is one RMSNorm and Mamba2; its "hybrid" layers (``SHARED`` layers) first run one of
      ``num_mem_blocks`` shared blocks (``SharedBlocks.count``, taken in turn) and a projection ``H^2``. A block
      is an attention over the hidden state joined with the embeddings (``2 H`` inputs, ``head_dim`` ``2 H /
      heads``: q, k, v ``2 H`` wide each, ``o_proj`` to H), a gated MLP and two norms (2H and H), and holds,
      for every layer that runs it, low-rank adapters of rank r: a gate/up one (``H r + 2 r I``) and, with
      ``use_shared_attention_adapter``, q/k/v ones (``3 x 2 (2H) r``). transformers 5 ties the blocks only
      when ``tie_word_embeddings`` is set (its weight tying is switched off with the embeddings'); untied,
      every hybrid layer holds its own copy of its block with all that block's adapters, and the counts
      follow. MLPs held this way (``OWN_MLP_KINDS``) are not counted again per layer.
    Each layer's role (``ModelSizes.layer_kinds``) is one of ``ATTENTION``, ``MIXER`` (the family's row),
    ``PARALLEL`` (attention beside the mixer), ``SHARED`` (a shared block, then the mixer) or, alone, an MLP or
    experts (``MLP_KINDS``); what differs by family is its ``Family.hybrid`` entry (``Hybrid``: the row, the
    config names of the row's fields, the flags and the hooks of ``hybrid_families.py``), never a branch here.
    A pipeline stage of ``n`` of the model's ``L`` layers holds the kinds in proportion
    (``ModelSizes.kind_counts``). Hybrids are counted at tp 1 (their families have no tensor-parallel plan
    in seqpar). A hybrid of another model type (its ``layer_types`` name a mixer) is refused with the reason.
    ``tests/test_estimate.py`` checks every count against the built tiny models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from seqpar.errors import SeqparInputError
from seqpar.models.mixers import MIXER_LAYER, Get, MixerSizes, mixer_layer_types

# A ``seqpar.models.sizes.ModelSizes``; named loosely so that this module stays below ``sizes.py``
# in the import order (sizes.py imports it).
ModelSizes = Any

ATTENTION = "attention"
"""A layer of attention (and its MLP)."""
MIXER = "mixer"
"""A layer of the family's token mixer (its ``Hybrid.mixer`` row) other than attention."""
PARALLEL = "attention_mixer"
"""A layer that runs attention and the mixer side by side after one norm (Falcon-H1's)."""
SHARED = "shared_mixer"
"""A layer that runs a shared block, then the mixer (Zamba2's "hybrid" layers)."""
MLP_KINDS = ("mlp", "moe")
"""Layers that hold an MLP or experts alone, no token mixer (Nemotron-H's)."""
OWN_MLP_KINDS = (*MLP_KINDS, SHARED)
"""Kinds of layers that hold a model's MLPs when the other layers have none (Nemotron-H's; Zamba2's layers that
run the shared block, whose MLP it is)."""

_PATTERN = {"M": MIXER_LAYER, "*": ATTENTION, "E": "moe", "-": "mlp"}  # a config.json's hybrid_override_pattern


@dataclass(frozen=True)
class Hybrid:
    """How a hybrid family's config reads into ``ModelSizes``: its mixer's row and its quirks (Note [hybrid sizes])."""

    mixer: type[MixerSizes]
    """The row of its token mixer (``seqpar.models.mixers``)."""
    names: tuple[tuple[str, object], ...] = ()
    """(row field, its config name or value) where the family's config differs from the row's ``names``."""
    state_space: bool = False
    """A norm and the mixer in every layer, no attention, no MLP, the head tied by default (Mamba, Mamba2)."""
    parallel: bool = False
    """Every layer runs attention beside the mixer (Falcon-H1): ``PARALLEL`` layers, whatever the types say."""
    shared_word: str | None = None
    """The ``layer_types`` word of layers that first run a shared block (Zamba2's); the others are all mixers."""
    attention_gate: bool = False
    """The attention's output gate (Qwen3-Next, Qwen3.5)."""
    qk_norm: str | None = None
    """The attention's q/k RMSNorms: "head" (one head's width), "whole" (every head's, Olmo-Hybrid) or None."""
    shared_mlp: bool = False
    """The MLP is a shared one: the dense MLP, or an ungated shared expert beside the experts (GraniteMoeHybrid)."""
    biases: tuple[str, ...] = ()
    """Config flags of biases the sizes leave out: refused when set."""
    layer_type: str = MIXER_LAYER
    """The word its config's layer types use for a mixer layer (written back by ``as_config``)."""
    types_field: str = "layer_types"
    """The config field ``as_config`` writes the layer types to ("attn_layer_indices": the attention layers')."""
    fields: Callable[[Get, tuple[str, ...]], dict] | None = None
    """Further fields of its config (from ``get`` and the layer roles), ``hybrid_families.py``'s."""
    config: Callable[[ModelSizes], dict] | None = None
    """The inverse of ``fields``: config fields that read back to them."""
    derive: tuple[tuple[str, Callable[[Get], int]], ...] = ()
    """(config field, how its config derives it) for fields a config.json may lack."""

    def __post_init__(self) -> None:
        if not (isinstance(self.mixer, type) and issubclass(self.mixer, MixerSizes)):
            raise SeqparInputError(f"a Hybrid's mixer is a row of seqpar.models.MIXER_KINDS, got {self.mixer!r}")
        if self.qk_norm not in (None, "head", "whole"):
            raise SeqparInputError(f"a Hybrid's qk_norm must be None, 'head' or 'whole', got {self.qk_norm!r}")

    def mixer_names(self) -> dict[str, object]:
        """The row's field names in this family's config."""
        return {**self.mixer.names, **dict(self.names)}


@dataclass(frozen=True)
class SharedBlocks:
    """Zamba2's shared blocks: how many the "hybrid" layers take in turn, and their adapters (Note [hybrid sizes])."""

    count: int
    """``num_mem_blocks``."""
    adapter_rank: int
    """The rank of the per-layer adapters."""
    attention_adapters: bool = False
    """Per-layer q/k/v adapters (``use_shared_attention_adapter``)."""


def layer_types(get: Get) -> list[str]:
    """The config's ``layer_types`` (Nemotron-H's pattern, Jamba's period or Bamba's indices in a config.json)."""
    types = get("layer_types") or get("layers_block_type")
    layers = get("num_hidden_layers") or 0
    if not types and get("hybrid_override_pattern"):
        types = [_PATTERN.get(c, c) for c in get("hybrid_override_pattern")]
    if not types and get("attn_layer_period"):
        period, offset = get("attn_layer_period"), get("attn_layer_offset") or 0
        types = [ATTENTION if i % period == offset else MIXER_LAYER for i in range(layers)]
    if not types and get("attn_layer_indices") is not None:
        attention = set(get("attn_layer_indices"))
        types = [ATTENTION if i in attention else MIXER_LAYER for i in range(layers)]
    return list(types or ())


def positive(get: Get, names: tuple[str, ...], what: str) -> dict:
    """``names`` read with ``get``, each a positive integer, or one ``SeqparInputError`` naming the others."""
    fields = {n: get(n) for n in names}
    bad = [n for n, v in fields.items() if not isinstance(v, int) or isinstance(v, bool) or v <= 0]
    if bad:
        raise SeqparInputError(f"{what} layers need positive integer {', '.join(bad)}")
    return fields


def _roles(hybrid: Hybrid, types: list[str]) -> tuple[str, ...]:
    """Each layer's role (Note [hybrid sizes]) from the config's layer types."""
    if hybrid.parallel:
        return (PARALLEL,) * len(types)
    if hybrid.shared_word is not None:
        return tuple(SHARED if t == hybrid.shared_word else MIXER for t in types)
    words = mixer_layer_types()
    return tuple(t if t in MLP_KINDS else MIXER if t in words else ATTENTION for t in types)


def hybrid_fields(get: Get, model_type: str, hybrid: Hybrid, types: list[str], tp: int) -> dict:
    """The hybrid fields of ``ModelSizes`` (Note [hybrid sizes])."""
    if tp != 1:
        raise SeqparInputError(f"hybrid models are counted at tp_size 1 (their families have no tp plan), not {tp}")
    roles = _roles(hybrid, types)
    biased = [n for n in hybrid.biases if get(n)]
    if biased:
        raise SeqparInputError(f"{model_type} with {', '.join(biased)}: seqpar's sizes leave these biases out")
    fields: dict = {"layer_kinds": roles}
    if hybrid.fields is not None:
        fields.update(hybrid.fields(get, roles))
    try:
        fields["mixer"] = hybrid.mixer.read(get, hybrid.mixer_names(), get("hidden_size"))
    except SeqparInputError as error:
        raise SeqparInputError(f"{model_type}: {error}") from None
    if hybrid.qk_norm:
        fields.update(qk_norm=True, qk_norm_whole=hybrid.qk_norm == "whole")
    if hybrid.attention_gate:
        fields.update(attention_gate=True)
    return fields


def ssm_fields(get: Get, model_type: str, hybrid: Hybrid, tp: int) -> dict:
    """``ModelSizes``' fields of a state-space model (Mamba2, Mamba, Falcon-Mamba; Note [hybrid sizes]): one
    RMSNorm and a mixer per layer; no attention (one nominal head) and no MLP (width 0)."""
    if tp != 1:
        raise SeqparInputError(f"state-space models are counted at tp_size 1 (no tp plan), not {tp}")
    base = positive(get, ("hidden_size", "num_hidden_layers", "vocab_size"), f"{model_type} model")
    hidden = base["hidden_size"]
    try:
        mixer = hybrid.mixer.read(get, hybrid.mixer_names(), hidden)
    except SeqparInputError as error:
        raise SeqparInputError(f"{model_type}: {error}") from None
    return dict(
        **base,
        mixer=mixer,
        intermediate_size=0,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=hidden,
        tie_word_embeddings=bool(get("tie_word_embeddings", True)),
        layer_kinds=(MIXER,) * base["num_hidden_layers"],
        layer_norms=1,
    )


def hybrid_config(d: ModelSizes, hybrid: Hybrid) -> dict:
    """The config fields that read back to ``d``'s hybrid sizes."""
    config = d.mixer.as_config(hybrid.mixer_names(), d.hidden_size) if d.mixer is not None else {}
    if hybrid.state_space:
        return config
    if hybrid.types_field == "attn_layer_indices":
        config[hybrid.types_field] = [i for i, kind in enumerate(d.layer_kinds) if kind == ATTENTION]
    else:
        words = {ATTENTION: "full_attention", SHARED: hybrid.shared_word}
        types = [words.get(k, k if k in MLP_KINDS else hybrid.layer_type) for k in d.layer_kinds]
        config[hybrid.types_field] = types
    if hybrid.shared_mlp and not d.num_experts:
        config.update(shared_intermediate_size=d.intermediate_size, num_local_experts=0)
    if hybrid.config is not None:
        config.update(hybrid.config(d))
    return config


def shared_block_params(d: ModelSizes) -> tuple[int, int]:
    """(one of Zamba2's shared blocks without adapters, the adapters each layer that runs it adds): the attention
    over ``2 H`` inputs, the MLP, the two norms; low-rank q/k/v adapters (with ``attention_adapters``) and
    a gate/up adapter (Note [hybrid sizes])."""
    h, wide, rank, width = d.hidden_size, 2 * d.hidden_size, d.shared.adapter_rank, d.intermediate_size
    base = wide * (d.q_width + 2 * d.kv_width) + d.q_width * h + 3 * h * width + wide + h
    adapters = (6 * wide * rank if d.shared.attention_adapters else 0) + h * rank + rank * 2 * width
    return base, adapters
