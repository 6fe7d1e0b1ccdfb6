"""Where each transformers model family keeps its parts: one declarative entry per ``model_type``.

``FAMILIES`` is the registry every axis reads (through ``seqpar.models.anatomy``); ``register_family`` extends it.

Note [model families]
    An entry names attribute paths, not classes: ``decoder`` from the model with a head to its decoder (a bare
    decoder is accepted as it is), ``text_model`` from there to a multimodal model's text decoder, then from
    the text decoder its ``layers`` (a ``ModuleList``), ``embedding``, final ``norm`` and ``rotary`` embedding,
    ``head`` from the model, and from each layer its ``attention``, ``mlp``, ``layer_norms`` and the token
    ``mixers`` other than attention (state-space or convolutional blocks of hybrid models). An MLP holding the
    ``experts`` path is a mixture of experts. ``tp_plan`` lists, per layer, the projections tensor parallel
    splits column-wise (the inputs of attention and of the MLP) or row-wise (their outputs); None where the
    family has no plan (fused projections, experts). A hybrid's ``hybrid`` names its token mixer's row (Note
    [mixer rows]) and the quirks its sizes read (Note [hybrid sizes]). A family that follows Llama's anatomy is
    one line: ``Family("qwen2")``. One generic resolver (``seqpar.models.anatomy``) reads every entry, and every
    consumer (prepare_model, data, tensor and pipeline parallel, the tiled MLP, activation offload, the doctor)
    asks it, so a new family is one entry here (or one ``register_family`` call) and nothing else.

Note [declared layer parts]
    seqpar makes exact across ranks only the token mixing it knows of: attention, and the declared ``mixers``
    (each with an adapter). Anything else in a decoder layer runs on each rank's shard alone, which is right
    only for what acts on each token by itself. So an entry accounts for every module of its layers: the
    attention, the mixers, the MLP, the ``per_token`` blocks and the norms, with all their submodules. A module
    outside them that holds parameters of its own (or the layer's own parameters, or a convolution or pooling
    module) could mix tokens, and ``prepare_model`` refuses the model, naming the module, its class and its
    layer, rather than run it silently wrong. Modules without parameters (dropout, activations, rotary
    tables) are let through: they act on each token, or are read by the declared parts.
"""

from __future__ import annotations

from dataclasses import dataclass

from seqpar.errors import SeqparInputError
from seqpar.models.hybrid_families import (
    NEMOTRON_MAMBA2,
    QWEN4_EXP,
    SSM_MAMBA1,
    SSM_MAMBA2,
    ZAMBA_MAMBA2,
    count_layer_types,
    kimi_config,
    kimi_fields,
    lfm2_config,
    lfm2_fields,
    nemotron_config,
    nemotron_fields,
    zamba_config,
    zamba_fields,
    zamba_width,
)
from seqpar.models.hybrid_sizes import Hybrid
from seqpar.models.mixers import GatedDeltaNet, Kda, Lightning, Mamba1, Mamba2, ShortConv

LLAMA_TP_PLAN = (
    ("self_attn.q_proj", "colwise"),
    ("self_attn.k_proj", "colwise"),
    ("self_attn.v_proj", "colwise"),
    ("self_attn.o_proj", "rowwise"),
    ("mlp.gate_proj", "colwise"),
    ("mlp.up_proj", "colwise"),
    ("mlp.down_proj", "rowwise"),
)
"""Megatron-style splits of a Llama block: q/k/v and gate/up column-wise, o and down row-wise (Note [tp x sp])."""
_TP_STYLES = ("colwise", "rowwise")


@dataclass(frozen=True)
class Family:
    """The anatomy of one transformers model family as attribute paths (Note [model families])."""

    model_type: str
    """The transformers ``config.model_type`` the entry is for."""
    decoder: str = "model"
    """Path from the model with a head (``...ForCausalLM``) to its decoder."""
    text_model: str | None = None
    """Path from the decoder to a multimodal model's text decoder (``language_model``); None for a text model."""
    layers: str = "layers"
    """Path from the text decoder to its ``ModuleList`` of decoder layers."""
    embedding: str = "embed_tokens"
    """Path from the text decoder to the input embedding."""
    norm: str | None = "norm"
    """Path from the text decoder to the final norm."""
    rotary: str | None = "rotary_emb"
    """Path from the text decoder to the rotary embedding (None: the family has none there)."""
    head: str = "lm_head"
    """Path from the model with a head to the output head."""
    attention: str = "self_attn"
    """Path from a decoder layer to its attention module."""
    mlp: str | None = "mlp"
    """Path from a decoder layer to its MLP (dense, or a mixture of experts); None where the layer holds its MLP's
    projections itself (OPT's ``fc1`` and ``fc2``, named in ``per_token``)."""
    experts: str | None = None
    """Path from an MLP to its experts: an MLP that has it is a mixture of experts (None: every MLP is dense)."""
    layer_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    """Paths from a decoder layer to its norms."""
    mixers: tuple[str, ...] = ()
    """Paths from a decoder layer to its token mixers other than attention: a hybrid's layers each hold attention
    or one of these (and an MLP or not), and each mixer's class needs a seqpar adapter (Note [mixer adapters])."""
    per_token: tuple[str, ...] = ()
    """Paths from a decoder layer to further blocks, or its own parameters, that act on each token alone
    (GraniteMoeHybrid's experts beside its shared MLP, Dory's per-channel residual rates): what a layer holds
    outside its declared parts is refused when it has parameters (Note [declared layer parts])."""
    layer_kind: str | None = None
    """Path from a decoder layer to the name of its kind, for a family whose layers keep attention, a token mixer
    or an MLP under one path (Nemotron-H's ``block_type`` of the module at ``mixer``, Kimi Linear's at
    ``self_attn``); None: the paths tell."""
    kinds: tuple[tuple[str, str], ...] = ()
    """(a ``layer_kind`` value, "attention", "mixer" or "mlp"): which part a layer of that kind holds at a path
    the entry names for more than one part."""
    kinds_field: str | None = None
    """The config field listing each layer's kind, for a family whose layers keep attention or a token mixer under
    one path and do not hold their kind (RecurrentGemma's ``layers_block_type``): read in place of ``layer_kind``."""
    tp_plan: tuple[tuple[str, str], ...] | None = LLAMA_TP_PLAN
    """(path from a layer, "colwise" or "rowwise") for tensor parallel; None: the family has no plan."""
    vision: str | None = None
    """Path from the decoder (or, where the tower sits beside the decoder, from the model) to a multimodal model's
    vision tower, which keeps its own attention and runs on whole rows (Note [whole-row calls]); None for a text
    model."""
    positions: str = "text"
    """"text": ``[B, S]`` position ids; "mrope": Qwen's multimodal RoPE, ``[3, B, S]`` (or ``[4, B, S]`` with
    the text positions first) computed by the model from the whole row's image grids."""
    image_blocks: str | None = None
    """The call keyword whose non-zero entries mark image tokens that see their whole image (Gemma 3's
    ``token_type_ids``, Gemma 4's ``mm_token_type_ids``: one block per run of them)."""
    image_block_layers: tuple[str, ...] | None = None
    """The layer types whose attention takes the image blocks (Gemma 4: its sliding layers; its full layers stay
    causal); None: every layer."""
    attention_interface: bool = False
    """Its attention looks its function up in transformers' ``AttentionInterface`` although the model class says
    ``_supports_attention_backend = False`` (Qwen3-Next, Qwen3.5, Olmo-Hybrid, Bamba, Falcon-H1: the flag stands
    for more backends there);
    checked for the entries that set it."""
    mask_context: str | None = None
    """Where the call context travels for a family whose layers do not hand their keywords down to the mixers
    (Note [context in the mask]): "mask", as the decoder's ``attention_mask``, which reaches every mixer unchanged
    (Mamba, Falcon-Mamba); "mapping", as every entry of the mask mapping by layer type, which the decoder takes as
    it is (Jamba); "state", as the ``state`` the decoder hands every block (RWKV); None: in the keywords."""
    vision_units: bool = False
    """The vision encoder encodes each image, crop, tile or temporal patch on its own, so its work may be split
    over the SP group (Note [vision split]); False: every rank encodes every image (a safe default for new entries)."""
    hybrid: Hybrid | None = None
    """Its token mixer's row and the quirks of its hybrid layers, as the sizes read them (Note [hybrid sizes]);
    None: every layer is attention."""
    unsized: tuple[str, ...] = ()
    """Parts seqpar's sizes lack: its estimate and plans are refused naming them (Note [unsized parts])."""
    mla: bool = False
    """Its MLA attention's sizes were checked against built models (Note [MLA sizes]); others' MLA is refused."""
    derived: bool = False
    """Read from the model itself (Note [read anatomy]), not written as an entry."""
    image_rows: str | None = None
    """How ``seqpar doctor`` lays out generated image rows from the config alone: "grids" (Qwen-VL's image grids
    between vision delimiters), "blocks" (Gemma 3's begin/end tokens around a fixed run); None: it does not."""
    images: str | None = None
    """Why calls with images are refused where seqpar serves the text path only (Note [read anatomy]); None: none."""

    def __post_init__(self) -> None:
        if not isinstance(self.model_type, str) or not self.model_type:
            raise SeqparInputError(f"a model family needs its model_type (a non-empty string), got {self.model_type!r}")
        if self.mask_context not in (None, "mask", "mapping", "state"):
            raise SeqparInputError(
                f"a family's mask_context must be None, 'mask', 'mapping' or 'state', got {self.mask_context!r}"
            )
        if self.hybrid is not None and not isinstance(self.hybrid, Hybrid):
            raise SeqparInputError(f"a family's hybrid must be a seqpar.models.Hybrid, got {self.hybrid!r}")
        if self.image_rows not in (None, "grids", "blocks"):
            raise SeqparInputError(f"a family's image_rows must be None, 'grids' or 'blocks', got {self.image_rows!r}")
        if self.positions not in ("text", "mrope"):
            raise SeqparInputError(f"a family's positions must be 'text' or 'mrope', got {self.positions!r}")
        parts = [part for _, part in self.kinds if part not in ("attention", "mixer", "mlp")]
        if parts or bool(self.kinds) != (self.layer_kind is not None or self.kinds_field is not None):
            raise SeqparInputError(
                f"a family's kinds map layer kinds to 'attention', 'mixer' or 'mlp' and come with its layer_kind "
                f"path or kinds_field, got layer_kind={self.layer_kind!r}, kinds={self.kinds!r}"
            )
        bad = [style for _, style in self.tp_plan or () if style not in _TP_STYLES]
        if bad:
            raise SeqparInputError(f"tp_plan styles must be {' or '.join(_TP_STYLES)}, got {bad}")


_NORMS = ("input_layernorm", "post_attention_layernorm")  # Llama's
_GEMMA_NORMS = (*_NORMS, "pre_feedforward_layernorm", "post_feedforward_layernorm")
_MOE = dict(experts="experts", tp_plan=None)  # experts are not split by tensor parallel
_QWEN_VL = dict(text_model="language_model", vision="visual", positions="mrope", vision_units=True, image_rows="grids")


def _zamba(block: str) -> dict:
    """Zamba's and Zamba2's layers: a norm and Mamba each; "hybrid" ones first run the shared ``block`` (attention
    over the hidden state joined with the embeddings, an MLP, two norms) and a projection."""
    shared = "input_layernorm", "pre_ff_layernorm"
    norms = ("input_layernorm", "mamba_decoder.input_layernorm", *(f"{block}.{name}" for name in shared))
    parts = dict(attention=f"{block}.self_attn", mlp=f"{block}.feed_forward", per_token=("linear",), layer_norms=norms)
    return dict(norm="final_layernorm", rotary=None, mixers=("mamba", "mamba_decoder.mamba"), tp_plan=None, **parts)


_RWKV = dict(decoder="rwkv", layers="blocks", embedding="embeddings", norm="ln_out", rotary=None, head="head")
_SSM = dict(decoder="backbone", embedding="embeddings", norm="norm_f", rotary=None, layer_norms=("norm",), tp_plan=None)
_GATED_GDN = Hybrid(GatedDeltaNet, attention_gate=True, qk_norm="head")  # Qwen3-Next's and Qwen3.5's attention
FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (
        Family("llama"),
        Family("mistral"),
        Family("qwen2"),
        Family("qwen3"),
        Family("olmo"),
        Family("olmo2", layer_norms=("post_attention_layernorm", "post_feedforward_layernorm")),
        Family("granite"),
        Family("gemma"),
        Family("gemma2", layer_norms=_GEMMA_NORMS),
        Family("gemma3_text", layer_norms=_GEMMA_NORMS),
        Family(
            "gemma3",
            text_model="language_model",
            layer_norms=_GEMMA_NORMS,
            vision="vision_tower",
            image_blocks="token_type_ids",
            vision_units=True,
            image_rows="blocks",
        ),
        Family("qwen2_vl", **_QWEN_VL),
        Family("qwen2_5_vl", **_QWEN_VL),
        Family("qwen3_vl", **_QWEN_VL),
        # Qwen3.5: a Qwen3-VL-style vision tower before a gated DeltaNet hybrid decoder (dense or with experts)
        Family(
            "qwen3_5",
            **_QWEN_VL,
            mixers=("linear_attn",),
            attention_interface=True,
            tp_plan=None,
        ),
        Family(
            "qwen3_5_moe",
            **_QWEN_VL,
            mixers=("linear_attn",),
            attention_interface=True,
            **_MOE,
        ),
        Family("llava", text_model="language_model", vision="vision_tower", vision_units=True),
        Family("llava_onevision", text_model="language_model", vision="vision_tower", vision_units=True),
        Family("llava_next_video", text_model="language_model", vision="vision_tower", vision_units=True),
        Family("idefics3", text_model="text_model", vision="vision_model", vision_units=True),
        Family("smolvlm", text_model="text_model", vision="vision_model", vision_units=True),
        Family("internvl", text_model="language_model", vision="vision_tower", vision_units=True),
        Family("phi3", tp_plan=None),  # fused qkv_proj and gate_up_proj: a column split would cut across q, k, v
        Family("mixtral", **_MOE),
        Family("qwen2_moe", **_MOE),  # dense MLPs in mlp_only_layers, experts elsewhere
        Family("qwen3_moe", **_MOE),
        Family("gpt_oss", **_MOE),
        # its attention's adapter convolves q/k across ranks (Note [CCA halo]); per-channel residual scales
        Family("zaya", per_token=("post_attention_residual_scale", "post_mlp_residual_scale"), **_MOE),
        Family(  # each block wraps its two norms and attention in norm_attn_norm; experts in ffn
            "dbrx",
            decoder="transformer",
            layers="blocks",
            embedding="wte",
            norm="norm_f",
            attention="norm_attn_norm.attn",
            mlp="ffn",
            layer_norms=("norm_attn_norm.norm_1", "norm_attn_norm.norm_2"),
            **_MOE,
        ),
        # MLA attention: queries and keys of one head size, values of another (Note [value head size])
        Family("deepseek_v2", mla=True, **_MOE),  # dense MLPs in the first first_k_dense_replace layers, experts after
        Family("deepseek_v3", mla=True, **_MOE),
        Family("minicpm3", mla=True, tp_plan=None),  # low-rank q and kv projections: no Llama tp plan
        # hybrids: each layer holds attention or a token mixer with a seqpar adapter (Note [mixer adapters])
        Family(
            "lfm2",
            norm="embedding_norm",
            mlp="feed_forward",
            layer_norms=("operator_norm", "ffn_norm"),
            mixers=("conv",),
            tp_plan=None,
            hybrid=Hybrid(ShortConv, qk_norm="head", layer_type="conv", fields=lfm2_fields, config=lfm2_config),
        ),
        Family(  # LFM2's anatomy, experts in the layers after the first dense ones
            "lfm2_moe",
            norm="embedding_norm",
            rotary="pos_emb",
            mlp="feed_forward",
            experts="experts",
            layer_norms=("operator_norm", "ffn_norm"),
            mixers=("conv",),
            tp_plan=None,
            hybrid=Hybrid(ShortConv, qk_norm="head", layer_type="conv"),
        ),
        Family(  # LFM2's anatomy with sandwich norms, sliding-window layers and a per-head gate on attention
            "lfm3",
            norm="embedding_norm",
            mlp="feed_forward",
            layer_norms=("operator_norm", "ffn_norm", "post_operator_norm", "post_ffn_norm"),
            mixers=("conv",),
            tp_plan=None,
            hybrid=Hybrid(ShortConv, qk_norm="head", layer_type="conv"),
        ),
        Family("qwen3_next", mixers=("linear_attn",), attention_interface=True, hybrid=_GATED_GDN, **_MOE),
        Family("qwen3_5_text", mixers=("linear_attn",), attention_interface=True, hybrid=_GATED_GDN, tp_plan=None),
        Family("qwen3_5_moe_text", mixers=("linear_attn",), attention_interface=True, hybrid=_GATED_GDN, **_MOE),
        # gated DeltaNet and QSA layers, no final norm; n-gram embeddings (Note [n-gram halo]), hyper-connections
        Family("qwen4_exp_text", mixers=("linear_attn", "ple"), attention_interface=True, **QWEN4_EXP, **_MOE),
        Family(  # Qwen3.5's gated DeltaNet between sliding-window layers (rotary) and full layers (no position)
            "lara_mini",
            mixers=("linear_attn",),
            attention_interface=True,
            hybrid=Hybrid(GatedDeltaNet, qk_norm="head"),
            **_MOE,
        ),
        Family(  # attention layers normalise after attention and MLP, gated DeltaNet layers before them
            "olmo_hybrid",
            layer_norms=("input_layernorm", "post_attention_layernorm", "post_feedforward_layernorm"),
            mixers=("linear_attn",),
            attention_interface=True,
            tp_plan=None,
            hybrid=Hybrid(GatedDeltaNet, qk_norm="whole"),  # q/k norms over all heads, no output gate
        ),
        # Mamba2 (SSD) layers between attention layers, no rotary embedding, experts and a shared MLP
        Family(
            "granitemoehybrid",
            mlp="shared_mlp",
            per_token=("block_sparse_moe",),
            mixers=("mamba",),
            rotary=None,
            tp_plan=None,
            hybrid=Hybrid(Mamba2, shared_mlp=True),
        ),
        Family(  # each layer runs attention and Mamba2 side by side
            "falcon_h1",
            norm="final_layernorm",
            mlp="feed_forward",
            layer_norms=("input_layernorm", "pre_ff_layernorm"),
            mixers=("mamba",),
            attention_interface=True,
            tp_plan=None,
            hybrid=Hybrid(
                Mamba2,
                names=(("gated_norm", ("mamba_rms_norm", False)), ("ssm_width", "mamba_d_ssm")),
                parallel=True,
                biases=("attention_bias", "mlp_bias", "mamba_proj_bias", "projectors_bias"),
            ),
        ),
        Family(  # each layer holds one of Mamba2, attention (no rotary), experts or an MLP at "mixer"
            "nemotron_h",
            embedding="embeddings",
            norm="norm_f",
            rotary=None,
            attention="mixer",
            mlp="mixer",
            experts="experts",
            layer_norms=("norm",),
            mixers=("mixer",),
            layer_kind="block_type",
            kinds=(("full_attention", "attention"), ("linear_attention", "mixer"), ("moe", "mlp"), ("mlp", "mlp")),
            attention_interface=True,
            tp_plan=None,
            hybrid=Hybrid(
                Mamba2,
                names=NEMOTRON_MAMBA2,
                types_field="layers_block_type",
                biases=("mlp_bias",),
                fields=nemotron_fields,
                config=nemotron_config,
                derive=(("num_hidden_layers", count_layer_types),),
            ),
        ),
        # Mamba2 (SSD) in every layer, no attention
        Family("mamba2", **_SSM, mixers=("mixer",), hybrid=Hybrid(Mamba2, names=SSM_MAMBA2, state_space=True)),
        Family(  # Mamba1 in every layer, no attention; the blocks are called with the mask alone
            "mamba",
            **_SSM,
            mixers=("mixer",),
            mask_context="mask",
            hybrid=Hybrid(Mamba1, names=SSM_MAMBA1, state_space=True),
        ),
        Family(  # Mamba's anatomy; its mixer normalises dt, B and C (weightless norms)
            "falcon_mamba",
            **_SSM,
            mixers=("mixer",),
            mask_context="mask",
            hybrid=Hybrid(Mamba1, names=(*SSM_MAMBA1, ("dt_norms", True)), state_space=True),
        ),
        Family(  # each layer holds Mamba1 or attention (no rotary), then experts or an MLP
            "jamba",
            norm="final_layernorm",
            rotary=None,
            mlp="feed_forward",
            experts="experts",
            layer_norms=("input_layernorm", "pre_ff_layernorm"),
            mixers=("mamba",),
            mask_context="mapping",
            attention_interface=True,
            tp_plan=None,
            hybrid=Hybrid(Mamba1, names=(("dt_norms", True), ("dt_norm_weights", True))),  # weighted norms
        ),
        Family(  # KDA (gated delta rule, decay per channel) or MLA attention without rotary at self_attn, experts
            "kimi_linear",
            rotary=None,
            mixers=("self_attn",),
            layer_kind="block_type",
            kinds=(("full_attention", "attention"), ("linear_attention", "mixer")),
            attention_interface=True,
            hybrid=Hybrid(Kda, fields=kimi_fields, config=kimi_config),
            mla=True,
            **_MOE,
        ),
        Family(  # Kimi Linear's layout with rotary MLA layers and a one-projection KDA output gate
            "bailing_hybrid",
            mixers=("self_attn",),
            layer_kind="block_type",
            kinds=(("full_attention", "attention"), ("linear_attention", "mixer")),
            attention_interface=True,
            hybrid=Hybrid(Kda),
            **_MOE,
        ),
        Family("zamba", **_zamba("shared_transf")),  # Mamba1 in heads (Note [Mamba1 state]); no sizes read
        Family(  # Mamba2 in every layer; some layers first run a shared attention block and a per-layer projection
            "zamba2",
            **_zamba("shared_transformer"),  # its rotary table exists only with use_mem_rope
            attention_interface=True,
            hybrid=Hybrid(
                Mamba2,
                names=ZAMBA_MAMBA2,
                shared_word="hybrid",
                layer_type="mamba",
                types_field="layers_block_type",
                biases=("add_bias_linear",),
                fields=zamba_fields,
                config=zamba_config,
                derive=(("intermediate_size", zamba_width),),
            ),
        ),
        Family(
            "bamba",
            norm="final_layernorm",
            mlp="feed_forward",
            layer_norms=("input_layernorm", "pre_ff_layernorm"),
            mixers=("mamba",),
            attention_interface=True,
            tp_plan=None,
            hybrid=Hybrid(Mamba2, types_field="attn_layer_indices"),
        ),
        Family(  # lightning attention (Note [lightning blocks]) or softmax attention at self_attn, experts everywhere
            "minimax",
            mixers=("self_attn",),
            layer_kind="block_type",
            kinds=(("full_attention", "attention"), ("linear_attention", "mixer")),
            hybrid=Hybrid(Lightning),
            **_MOE,
        ),
        # RWKV-4: time mixing (the WKV recurrence) and channel mixing, each shifting tokens by one (Note [WKV state])
        Family(
            "rwkv",
            **_RWKV,
            layer_norms=("pre_ln", "ln1", "ln2"),
            mixers=("attention", "feed_forward"),
            mask_context="state",
            tp_plan=None,
        ),
        Family(  # the RG-LRU block (Note [RG-LRU state]) or sliding-window attention (rotary inside) at temporal_block
            "recurrent_gemma",
            norm="final_norm",
            rotary=None,
            attention="temporal_block",
            mlp="mlp_block",
            layer_norms=("temporal_pre_norm", "channel_pre_norm"),
            mixers=("temporal_block",),
            kinds_field="layers_block_type",
            kinds=(("sliding_attention", "attention"), ("linear_attention", "mixer")),
            tp_plan=None,
        ),
    )
}
"""The registry: ``model_type`` -> ``Family``. The documented extension point (``register_family``)."""


UNSERVED: dict[str, str] = {}
"""``model_type`` -> why seqpar does not serve that family (hybrids whose token mixers have no adapter yet)."""


def register_family(family: Family, *, replace: bool = False) -> Family:
    """Add a model family to ``FAMILIES`` so that every axis serves models of its ``model_type``.

    Args:
        family: the entry (Note [model families]).
        replace: allow replacing an entry of the same ``model_type``.

    Returns:
        The entry.

    Raises:
        SeqparInputError: not a ``Family``, or a ``model_type`` already registered without ``replace``.
    """
    if not isinstance(family, Family):
        raise SeqparInputError(f"register_family takes a seqpar.models.Family, got {type(family).__name__}")
    if family.model_type in FAMILIES and not replace and FAMILIES[family.model_type] != family:
        raise SeqparInputError(
            f"model family {family.model_type!r} is registered already; pass replace=True to change its entry"
        )
    FAMILIES[family.model_type] = family
    return family
