"""The sizes of a hybrid model's token mixers read from its config: which layers hold which mixer, and its fields.

``ModelSizes`` (``sizes.py``) reads these for the families the memory estimate models (Note [hybrid sizes]).

Note [hybrid sizes]
    A hybrid model's layers each hold attention or another token mixer (``ModelSizes.layer_kinds``, read from
    the config's ``layer_types``, or Bamba's ``attn_layer_indices``), and an MLP or experts as in the rest of
    this module. The mixers counted, each with the layer's two RMSNorms (2H), H the hidden size:
    * gated DeltaNet (Qwen3-Next, Qwen3.5, Olmo-Hybrid; ``linear_*`` fields): key heads Hk of dk, value heads Hv of dv,
      ``key_dim = Hk dk``, ``value_dim = Hv dv``, conv width K: the q/k/v/z projections
      ``H (2 key_dim + 2 value_dim)`` (one fused matrix in Qwen3-Next, four in Qwen3.5), b and a ``2 H Hv``,
      the depthwise convolution ``(2 key_dim + value_dim) K`` (no bias), ``A_log`` and ``dt_bias`` (2 Hv),
      the gated norm (dv) and ``out_proj`` (``value_dim H``).
    * Mamba2 / SSD (Bamba, GraniteMoeHybrid, Nemotron-H, Falcon-H1, Zamba2; ``mamba_*`` fields): Hm heads of
      d_head, ``I_m = Hm d_head``, G groups of state size N, conv width K: ``in_proj``
      ``H (2 I_m + 2 G N + Hm)`` (its bias with ``mamba_proj_bias``), the convolution ``(I_m + 2 G N) K``
      (its bias with ``mamba_conv_bias``), ``A_log``, ``D``, ``dt_bias`` (3 Hm), the gated norm (I_m; not
      in Falcon-H1 by default) and ``out_proj`` (``I_m H``, biased with ``mamba_proj_bias``).
    * Mamba1 (Mamba, Falcon-Mamba; ``intermediate_size`` I channels, state N, dt rank R, conv width K):
      ``in_proj`` ``2 H I``, the convolution ``I K`` (+ I bias), ``x_proj`` ``I (R + 2N)``, ``dt_proj``
      ``R I + I``, ``A_log`` ``I N``, ``D`` I, ``out_proj`` ``I H`` (biases with ``use_bias``). Pure
      state-space models (``SSM_MIXERS``: Mamba2, Mamba, Falcon-Mamba) have one RMSNorm per layer
      (``layer_norms``), no attention and no MLP, and tie the head by default.
    * LFM2's gated short convolution (``conv_L_cache`` = K): ``in_proj`` ``3 H^2``, the convolution ``H K``,
      ``out_proj`` ``H^2`` (each with a bias under ``conv_bias``). LFM2's MLP width is the one its layers
      build: with ``block_auto_adjust_ff_dim``, ``2/3`` of ``intermediate_size``, times
      ``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of``; ``intermediate_size`` holds that.
    * KDA (Kimi Linear; ``linear_num_heads`` h of ``linear_head_dim`` d, ``D = h d``): q, k, v ``3 H D``,
      their convolution ``3 D K`` (no bias), the low-rank decay and output gate (``f_a``/``g_a`` ``H d``,
      ``f_b``/``g_b`` ``d D``), ``dt_bias`` D, ``A_log`` h, ``b_proj`` ``H h``, the gated norm (d) and
      ``o_proj`` (``D H``); read into the gated DeltaNet fields with as many key as value heads.
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
    * Falcon-H1: attention and Mamba2 side by side after one norm in every layer (``attention_mamba2``),
      then the MLP; its Mamba2 has no gated norm unless ``mamba_rms_norm`` (``mamba_gated_norm``); the muP
      multipliers are scalars and a buffer, no parameters. Its biases (``attention_bias``, ``mlp_bias``,
      ``mamba_proj_bias``, ``projectors_bias``) are refused.
    * Zamba2: every layer is one RMSNorm and Mamba2; its "hybrid" layers (``shared_mamba2``) first run one of
      ``num_mem_blocks`` shared blocks (``shared_blocks``, taken in turn) and a projection ``H^2``. A block
      is an attention over the hidden state joined with the embeddings (``2 H`` inputs, ``head_dim`` ``2 H /
      heads``: q, k, v ``2 H`` wide each, ``o_proj`` to H), a gated MLP and two norms (2H and H), and holds,
      for every layer that runs it, low-rank adapters of rank r: a gate/up one (``H r + 2 r I``) and, with
      ``use_shared_attention_adapter``, q/k/v ones (``3 x 2 (2H) r``). transformers 5 ties the blocks only
      when ``tie_word_embeddings`` is set (its weight tying is switched off with the embeddings'); untied,
      every hybrid layer holds its own copy of its block with all that block's adapters, and the counts
      follow. MLPs held this way (``OWN_MLP_KINDS``) are not counted again per layer.
    A pipeline stage of ``n`` of the model's ``L`` layers holds the kinds in proportion
    (``ModelSizes.kind_counts``). Hybrids are counted at tp 1 (their families have no tensor-parallel plan
    in seqpar). A hybrid of another model type (its ``layer_types`` name a mixer) is refused with the reason.
    ``tests/test_estimate.py`` checks every count against the built tiny models.
"""

from __future__ import annotations

from typing import Any

from seqpar.errors import SeqparInputError

# A ``seqpar.models.sizes.ModelSizes``; named loosely so that this module stays below ``sizes.py``
# in the import order (sizes.py imports it).
ModelSizes = Any

__all__ = [
    "HYBRID_MIXERS",
    "MIXER_KINDS",
    "MLP_KINDS",
    "NOT_ATTENTION",
    "OWN_MLP_KINDS",
    "SSM_MIXERS",
    "hybrid_config",
    "hybrid_fields",
    "layer_types",
    "mixer_params",
    "shared_block_params",
    "ssm_fields",
]


NOT_ATTENTION = ("conv", "linear_attention", "mamba", "mamba2", "recurrent", "linear", "attention_mamba2", "hybrid")
"""``layer_types`` entries of token mixers other than attention (Falcon-H1's, as ``layer_types`` reads its layers;
Zamba2's "hybrid" layers hold Mamba2 after the shared block)."""

MIXER_KINDS = (
    "attention_mamba2",
    "gated_deltanet",
    "kda",
    "lightning",
    "mamba1",
    "mamba2",
    "shared_mamba2",
    "short_conv",
)
"""The token mixers other than attention whose sizes ``ModelSizes`` counts (Note [hybrid sizes])."""

MLP_KINDS = ("mlp", "moe")
"""Kinds of Nemotron-H's layers that hold an MLP or experts alone, no token mixer (Note [hybrid sizes])."""

OWN_MLP_KINDS = (*MLP_KINDS, "shared_mamba2")
"""Kinds of layers that hold a model's MLPs when the other layers have none (Nemotron-H's; Zamba2's layers that
run the shared block, whose MLP it is)."""

HYBRID_MIXERS = {
    "qwen3_next": "gated_deltanet",
    "qwen3_5_text": "gated_deltanet",
    "qwen3_5_moe_text": "gated_deltanet",
    "bamba": "mamba2",
    "granitemoehybrid": "mamba2",
    "lfm2": "short_conv",
    "jamba": "mamba1",
    "minimax": "lightning",
    "olmo_hybrid": "gated_deltanet",
    "nemotron_h": "mamba2",
    "falcon_h1": "attention_mamba2",
    "kimi_linear": "kda",
    "zamba2": "mamba2",
}
"""Model types whose hybrid layers Note [hybrid sizes] describes -> the kind of their non-attention layers."""

SSM_MIXERS = {"mamba2": "mamba2", "mamba": "mamba1", "falcon_mamba": "mamba1"}
"""State-space model types (a norm and a mixer per layer, no attention, no MLP) -> their mixer's kind."""

_GDN_FIELDS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)
_MAMBA_FIELDS = ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv", "mamba_chunk_size")
_NEMOTRON_MAMBA = dict(  # our Mamba2 field -> Nemotron-H's name for it
    mamba_n_heads="mamba_num_heads",
    mamba_d_head="mamba_head_dim",
    mamba_d_state="ssm_state_size",
    mamba_n_groups="n_groups",
    mamba_d_conv="conv_kernel",
    mamba_chunk_size="chunk_size",
)
_NEMOTRON_KINDS = {"M": "mamba", "*": "attention", "E": "moe", "-": "mlp"}  # its config.json's pattern
_UNCOUNTED_BIASES = {  # model type -> the biases its sizes leave out (refused when set)
    "nemotron_h": ("mlp_bias",),
    "falcon_h1": ("attention_bias", "mlp_bias", "mamba_proj_bias", "projectors_bias"),
    "zamba2": ("add_bias_linear",),
}


def layer_types(get) -> list[str]:
    """The config's ``layer_types`` (Bamba's from ``attn_layer_indices`` in a config.json)."""
    types = get("layer_types") or get("layers_block_type")
    if not types and get("hybrid_override_pattern"):  # Nemotron-H's config.json
        types = [_NEMOTRON_KINDS.get(c, c) for c in get("hybrid_override_pattern")]
    if get("model_type") == "falcon_h1":  # attention and Mamba2 side by side in every layer
        types = ["attention_mamba2"] * (get("num_hidden_layers") or 0)
    if not types and get("model_type") == "jamba" and get("attn_layer_period"):  # a config.json's fields
        period, offset = get("attn_layer_period"), get("attn_layer_offset") or 0
        types = ["attention" if i % period == offset else "mamba" for i in range(get("num_hidden_layers") or 0)]
    if not types and get("model_type") == "bamba" and get("attn_layer_indices") is not None:
        attention = set(get("attn_layer_indices"))
        types = ["attention" if i in attention else "mamba" for i in range(get("num_hidden_layers") or 0)]
    return list(types or ())


def _positive(get, names: tuple[str, ...], what: str) -> dict:
    """``names`` read with ``get``, each a positive integer, or one ``SeqparInputError`` naming the others."""
    fields = {n: get(n) for n in names}
    bad = [n for n, v in fields.items() if not isinstance(v, int) or isinstance(v, bool) or v <= 0]
    if bad:
        raise SeqparInputError(f"{what} layers need positive integer {', '.join(bad)}")
    return fields


def hybrid_fields(get, model_type: str, types: list[str], tp: int) -> dict:
    """The hybrid fields of ``ModelSizes`` (Note [hybrid sizes])."""
    if tp != 1:
        raise SeqparInputError(f"hybrid models are counted at tp_size 1 (their families have no tp plan), not {tp}")
    mixer = HYBRID_MIXERS[model_type]
    kinds = tuple(t if t in MLP_KINDS else mixer if t in NOT_ATTENTION else "attention" for t in types)
    if model_type == "zamba2":  # every layer a Mamba2 layer; its "hybrid" ones first run a shared block
        kinds = tuple("shared_mamba2" if t == "hybrid" else "mamba2" for t in types)
    fields: dict = {"layer_kinds": kinds}
    biased = [n for n in _UNCOUNTED_BIASES.get(model_type, ()) if get(n)]
    if biased:
        raise SeqparInputError(f"{model_type} with {', '.join(biased)}: seqpar's sizes leave these biases out")
    if model_type == "nemotron_h":  # MLPs and experts are layers of their own (Note [hybrid sizes])
        return fields | _nemotron_fields(get, kinds)
    if model_type == "zamba2":
        return fields | _zamba_fields(get)
    if model_type == "kimi_linear":  # KDA: as many key as value heads, of one width
        return fields | _kimi_fields(get)
    if model_type == "olmo_hybrid":  # q/k norms over all heads, no output gate
        fields.update(_positive(get, _GDN_FIELDS, "gated DeltaNet"), qk_norm=True, qk_norm_whole=True)
    elif mixer == "gated_deltanet":
        fields.update(_positive(get, _GDN_FIELDS, "gated DeltaNet"), attention_gate=True, qk_norm=True)
    elif mixer in ("mamba2", "attention_mamba2"):
        hidden, heads = get("hidden_size"), get("mamba_n_heads")
        if not get("mamba_d_head") and isinstance(heads, int) and heads > 0:  # as the configs derive it
            fields["mamba_d_head"] = (get("mamba_expand") or 2) * hidden // heads
        read = {n: fields.get(n) or get(n) for n in _MAMBA_FIELDS}
        fields.update(_positive(read.get, _MAMBA_FIELDS, "Mamba2"))
        fields.update(mamba_conv_bias=bool(get("mamba_conv_bias", True)), mamba_proj_bias=bool(get("mamba_proj_bias")))
        if mixer == "attention_mamba2":  # Falcon-H1: its SSD width must be the heads' (the kernel's reshape)
            fields.update(mamba_gated_norm=bool(get("mamba_rms_norm")))
            _check_ssm_width(get, fields)
    elif mixer == "lightning":  # MiniMax: the recurrence's block length
        fields.update(_positive(get, ("block_size",), "lightning attention"))
    elif mixer == "mamba1":  # Jamba: Mamba1 with weighted norms on dt, B and C
        hidden = get("hidden_size")
        rank = get("mamba_dt_rank")
        read = dict(
            mamba_d_inner=(get("mamba_expand") or 2) * hidden,
            mamba_d_state=get("mamba_d_state"),
            mamba_d_conv=get("mamba_d_conv"),
            mamba_dt_rank=-(-hidden // 16) if rank == "auto" else rank,
        )
        fields.update(_positive(read.get, tuple(read), "Mamba1"), mamba_dt_norms=True)
        fields.update(mamba_conv_bias=bool(get("mamba_conv_bias", True)), mamba_proj_bias=bool(get("mamba_proj_bias")))
    else:  # LFM2: the MLP width its layers build
        fields.update(_positive(get, ("conv_L_cache",), "LFM2 convolution"), conv_bias=bool(get("conv_bias")))
        fields.update(qk_norm=True, intermediate_size=_lfm2_width(get))
    return fields


def _nemotron_fields(get, kinds: tuple[str, ...]) -> dict:
    """Nemotron-H's fields: one norm a layer, Mamba2 under its names, ungated MLPs and experts in layers of
    their own (Note [hybrid sizes])."""
    if get("moe_latent_size"):
        raise SeqparInputError("nemotron_h with moe_latent_size: seqpar's sizes do not count latent experts")
    fields = _positive(lambda n: get(_NEMOTRON_MAMBA[n]), tuple(_NEMOTRON_MAMBA), "Mamba2")
    fields.update(mamba_conv_bias=bool(get("use_conv_bias", True)), mamba_proj_bias=bool(get("use_bias")))
    fields.update(layer_kinds=kinds, layer_norms=1, mlp_gated=False)
    if "moe" in kinds:
        fields.update(moe_layers=kinds.count("moe"), shared_expert_gate=False)
        fields.update(shared_expert_intermediate_size=get("moe_shared_expert_intermediate_size") or 0)
    return fields


def _kimi_fields(get) -> dict:
    """Kimi Linear's KDA sizes under the gated DeltaNet fields, and its experts: ``mlp_layer_types``'
    "sparse" layers (or those from ``first_k_dense_replace`` on), each with ``n_shared_experts`` ungated
    shared experts beside them (Note [hybrid sizes])."""
    read = _positive(get, ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"), "KDA")
    heads, width = read["linear_num_heads"], read["linear_head_dim"]
    fields = dict(linear_num_key_heads=heads, linear_num_value_heads=heads, linear_key_head_dim=width)
    fields.update(linear_value_head_dim=width, linear_conv_kernel_dim=read["linear_conv_kernel_dim"])
    mlp_types = get("mlp_layer_types")
    if mlp_types is None:  # as KimiLinearConfig derives them
        dense = get("first_k_dense_replace", 1)
        mlp_types = ["dense" if i < dense else "sparse" for i in range(get("num_hidden_layers") or 0)]
    sparse = list(mlp_types).count("sparse")
    if not sparse:
        return fields | dict(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, moe_layers=0)
    shared = (get("n_shared_experts") or get("num_shared_experts") or 0) * (get("moe_intermediate_size") or 0)
    return fields | dict(moe_layers=sparse, shared_expert_intermediate_size=shared, shared_expert_gate=False)


def _zamba_fields(get) -> dict:
    """Zamba2's fields: one norm and Mamba2 a layer (its own names), the shared blocks' attention over twice the
    hidden width and their MLP, their adapters (Note [hybrid sizes])."""
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    read = dict(
        mamba_n_heads=get("n_mamba_heads"),
        mamba_d_state=get("mamba_d_state"),
        mamba_n_groups=get("mamba_ngroups"),
        mamba_d_conv=get("mamba_d_conv"),
        mamba_chunk_size=get("chunk_size"),
        shared_blocks=get("num_mem_blocks") or 1,
        adapter_rank=get("adapter_rank"),
    )
    fields = _positive(read.get, tuple(read), "Zamba2")
    fields.update(
        mamba_d_head=(get("mamba_expand") or 2) * hidden // fields["mamba_n_heads"], head_dim=2 * hidden // heads
    )
    fields.update(layer_norms=1, mamba_conv_bias=True, intermediate_size=get("intermediate_size") or 4 * hidden)
    return fields | dict(shared_attention_adapters=bool(get("use_shared_attention_adapter")))


def shared_block_params(d: ModelSizes) -> tuple[int, int]:
    """(one of Zamba2's shared blocks without adapters, the adapters each layer that runs it adds): the attention
    over ``2 H`` inputs, the MLP, the two norms; low-rank q/k/v adapters (with ``shared_attention_adapters``) and
    a gate/up adapter (Note [hybrid sizes])."""
    h, wide, rank, width = d.hidden_size, 2 * d.hidden_size, d.adapter_rank, d.intermediate_size
    base = wide * (d.q_width + 2 * d.kv_width) + d.q_width * h + 3 * h * width + wide + h
    adapters = (6 * wide * rank if d.shared_attention_adapters else 0) + h * rank + rank * 2 * width
    return base, adapters


def _check_ssm_width(get, fields: dict) -> None:
    """Falcon-H1's ``mamba_d_ssm`` (when set) must be its heads' width: the scan reshapes it into them."""
    width = get("mamba_d_ssm")
    if width is not None and width != fields["mamba_n_heads"] * fields["mamba_d_head"]:
        raise SeqparInputError(f"falcon_h1: mamba_d_ssm {width} is not mamba_n_heads x mamba_d_head")


def ssm_fields(get, model_type: str, tp: int) -> dict:
    """``ModelSizes``' fields of a state-space model (Mamba2, Mamba, Falcon-Mamba; Note [hybrid sizes]): one
    RMSNorm and a mixer per layer; no attention (one nominal head) and no MLP (width 0)."""
    if tp != 1:
        raise SeqparInputError(f"state-space models are counted at tp_size 1 (no tp plan), not {tp}")
    base = _positive(get, ("hidden_size", "num_hidden_layers", "vocab_size"), f"{model_type} model")
    kind = SSM_MIXERS[model_type]
    hidden = base["hidden_size"]
    if kind == "mamba2":
        names = dict(
            mamba_n_heads="num_heads",
            mamba_d_head="head_dim",
            mamba_d_state="state_size",
            mamba_n_groups="n_groups",
            mamba_d_conv="conv_kernel",
            mamba_chunk_size="chunk_size",
        )
    else:
        names = dict(
            mamba_d_inner="intermediate_size",
            mamba_d_state="state_size",
            mamba_d_conv="conv_kernel",
            mamba_dt_rank="time_step_rank",
        )
    fields = {ours: get(theirs) for ours, theirs in names.items()}
    if fields.get("mamba_dt_rank") == "auto":  # as MambaConfig derives it
        fields["mamba_dt_rank"] = -(-hidden // 16)
    fields = _positive(fields.get, tuple(fields), f"{model_type} mixer")
    return dict(
        **base,
        **fields,
        intermediate_size=0,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=hidden,
        tie_word_embeddings=bool(get("tie_word_embeddings", True)),
        layer_kinds=(kind,) * base["num_hidden_layers"],
        layer_norms=1,
        mamba_conv_bias=bool(get("use_conv_bias", True)),
        mamba_proj_bias=bool(get("use_bias", False)),
        mamba_dt_norms=model_type == "falcon_mamba",
    )


def _ssm_config(d: ModelSizes) -> dict:
    """The config fields of a state-space model that read back to ``d`` (``ssm_fields``' inverse)."""
    shared = dict(state_size=d.mamba_d_state, conv_kernel=d.mamba_d_conv, use_conv_bias=d.mamba_conv_bias,
                  use_bias=d.mamba_proj_bias)  # fmt: skip
    if d.mamba_n_heads:
        return shared | dict(num_heads=d.mamba_n_heads, head_dim=d.mamba_d_head, n_groups=d.mamba_n_groups,
                             chunk_size=d.mamba_chunk_size)  # fmt: skip
    return shared | dict(intermediate_size=d.mamba_d_inner, time_step_rank=d.mamba_dt_rank)


def _lfm2_width(get) -> int:
    """LFM2's MLP width as ``Lfm2MLP`` builds it (Note [hybrid sizes])."""
    width = get("intermediate_size")
    if get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        if get("block_ffn_dim_multiplier") is not None:
            multiple = get("block_multiple_of") or 1
            width = multiple * -(-int(get("block_ffn_dim_multiplier") * width) // multiple)
    return width


def hybrid_config(d: ModelSizes) -> dict:
    """The config fields that read back to ``d``'s hybrid sizes."""
    if d.model_type in SSM_MIXERS:
        return _ssm_config(d)
    if d.model_type == "lfm2":
        types = ["conv" if k == "short_conv" else "full_attention" for k in d.layer_kinds]
        return {"layer_types": types, "conv_L_cache": d.conv_L_cache, "conv_bias": d.conv_bias,
                "block_auto_adjust_ff_dim": False}  # fmt: skip
    if d.model_type == "nemotron_h":
        config = {theirs: getattr(d, ours) for ours, theirs in _NEMOTRON_MAMBA.items()}
        config.update(use_conv_bias=d.mamba_conv_bias, use_bias=d.mamba_proj_bias)
        config.update(moe_shared_expert_intermediate_size=d.shared_expert_intermediate_size)
        kinds = {"mamba2": "linear_attention", "attention": "full_attention"}
        return config | {"layers_block_type": [kinds.get(k, k) for k in d.layer_kinds]}
    types = ["linear_attention" if k != "attention" else "full_attention" for k in d.layer_kinds]
    if d.model_type == "zamba2":
        config = dict(n_mamba_heads=d.mamba_n_heads, mamba_d_state=d.mamba_d_state, mamba_ngroups=d.mamba_n_groups)
        config.update(mamba_d_conv=d.mamba_d_conv, chunk_size=d.mamba_chunk_size, num_mem_blocks=d.shared_blocks)
        config.update(adapter_rank=d.adapter_rank, use_shared_attention_adapter=d.shared_attention_adapters)
        types = ["hybrid" if k == "shared_mamba2" else "mamba" for k in d.layer_kinds]
        return config | dict(layers_block_type=types, mamba_expand=d.mamba_n_heads * d.mamba_d_head // d.hidden_size)
    if d.model_type == "kimi_linear":
        mlp_types = ["dense"] * (d.num_hidden_layers - d.moe_layers) + ["sparse"] * d.moe_layers
        config = dict(layer_types=types, mlp_layer_types=mlp_types, linear_num_heads=d.linear_num_value_heads)
        config.update(linear_head_dim=d.linear_key_head_dim, linear_conv_kernel_dim=d.linear_conv_kernel_dim)
        if d.num_experts:
            config.update(num_local_experts=d.num_experts, n_shared_experts=d.shared_width // d.expert_width)
        return config
    if d.model_type == "bamba":
        types = None
        config = {"attn_layer_indices": [i for i, k in enumerate(d.layer_kinds) if k == "attention"]}
    else:
        config = {"layer_types": types}
    if d.block_size:  # MiniMax
        config.update(block_size=d.block_size)
    elif d.mamba_d_inner:  # Jamba
        config.update(mamba_expand=d.mamba_d_inner // d.hidden_size, mamba_d_state=d.mamba_d_state,
                      mamba_d_conv=d.mamba_d_conv, mamba_dt_rank=d.mamba_dt_rank)  # fmt: skip
    else:
        config.update({n: getattr(d, n) for n in (_GDN_FIELDS if d.linear_num_value_heads else _MAMBA_FIELDS)})
    if d.mamba_n_heads:
        config.update(mamba_conv_bias=d.mamba_conv_bias, mamba_proj_bias=d.mamba_proj_bias)
    if d.model_type == "falcon_h1":
        config.update(mamba_rms_norm=d.mamba_gated_norm, mamba_d_ssm=d.mamba_n_heads * d.mamba_d_head)
    if d.model_type == "granitemoehybrid" and not d.num_experts:
        config.update(shared_intermediate_size=d.intermediate_size, num_local_experts=0)
    return config


def mixer_params(d: ModelSizes, kind: str) -> int:
    """Parameters of one layer's token mixer of ``kind`` and the layer's two RMSNorms (Note [hybrid sizes]).

    Args:
        d: the model's sizes.
        kind: one of ``MIXER_KINDS`` (attention is counted in ``sizes.py``).

    Returns:
        The parameter count (the MLP left out).
    """
    h = d.hidden_size
    if kind == "gated_deltanet":
        keys = d.linear_num_key_heads * d.linear_key_head_dim
        values = d.linear_num_value_heads * d.linear_value_head_dim
        heads = d.linear_num_value_heads
        projections = h * (2 * keys + 2 * values + 2 * heads) + values * h
        conv = (2 * keys + values) * d.linear_conv_kernel_dim
        return projections + conv + 2 * heads + d.linear_value_head_dim + 2 * h
    if kind == "mamba2":
        inner, heads = d.mamba_n_heads * d.mamba_d_head, d.mamba_n_heads
        conv = inner + 2 * d.mamba_n_groups * d.mamba_d_state
        projected = inner + conv + heads
        bias = (projected + h) if d.mamba_proj_bias else 0
        conv_params = conv * d.mamba_d_conv + (conv if d.mamba_conv_bias else 0)
        norm = inner if d.mamba_gated_norm else 0
        return h * projected + inner * h + bias + conv_params + 3 * heads + norm + d.layer_norms * h
    if kind == "mamba1":  # in_proj, conv, x_proj, dt_proj (biased), A_log, D, out_proj (Note [hybrid sizes])
        inner, n, rank = d.mamba_d_inner, d.mamba_d_state, d.mamba_dt_rank
        bias = 2 * inner + h if d.mamba_proj_bias else 0
        conv = inner * d.mamba_d_conv + (inner if d.mamba_conv_bias else 0)
        scan = inner * (rank + 2 * n) + rank * inner + inner + inner * n + inner
        norms = rank + 2 * n if d.model_type == "jamba" else 0  # Jamba's norms on dt, B and C have weights
        return 2 * h * inner + conv + scan + inner * h + bias + norms + d.layer_norms * h
    if kind == "shared_mamba2":  # Zamba2: its Mamba2 layer, the projection after the shared block, the adapters
        return mixer_params(d, "mamba2") + h * h + shared_block_params(d)[1]
    if kind == "kda":  # q, k, v, their convolution, the low-rank decay and gate, beta, A_log, o_norm, o_proj
        heads, width = d.linear_num_value_heads, d.linear_key_head_dim
        inner = heads * width
        gates = 2 * (h * width + width * inner) + inner + heads  # f_a, f_b, g_a, g_b, dt_bias, A_log
        return 4 * h * inner + 3 * inner * d.linear_conv_kernel_dim + gates + h * heads + width + 2 * h
    if kind == "lightning":  # qkv_proj, out_proj and output_gate over H = heads x head_dim, its RMSNorm
        return 5 * h * h + h + d.layer_norms * h
    if kind == "short_conv":
        bias = 5 * h if d.conv_bias else 0
        return 4 * h * h + h * d.conv_L_cache + bias + 2 * h
    raise SeqparInputError(f"unknown mixer kind {kind!r}; choose from {', '.join(MIXER_KINDS)}")
