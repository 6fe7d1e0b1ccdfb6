"""The zoo's tiny configs: a family's default config shrunk to a few layers of width 64, its pattern kept.

``tiny_fields`` reads a default config into the keyword arguments of its tiny twin (``seqpar.models.zoo``'s helper).
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable
from typing import Any

from seqpar.models._tiny_layers import LAYER_COUNTS, shrink_layers
from seqpar.models.mixers import MIXER_LAYER, SHARED_LAYER, ShortConv

TINY_VOCAB = 128
TEXT_IDS = (4, 96)
"""The range ``[low, high)`` of ordinary token ids in a tiny model: pad, bos and eos sit below it and every other
special id (image, video, audio placeholders...) above it, so random text never holds a placeholder."""
_PAD_BOS_EOS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 128
EXPERTS = 4
TOP_K = 2
MAX_POSITIONS = 256
WINDOW = 8
"""A sliding window (and a chunked-attention chunk) well inside the sweep's 24-token rows, so it bites."""


_QWEN4 = {
    **dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=HEAD_DIM, indexer_budget=WINDOW),
    "indexer_compress_ratio": 4,
    # n-gram embeddings on its gated DeltaNet layer: 2 heads an order, ~1000-row tables (20M by default), eos set
    **dict(ple_layer_ids=[1], ple_embed_dim=32, heads_per_ngram=2, ngram_vocab_size_base=1000, eos_token_id=2),
}
_FAMILY_FIELDS: dict[str, dict[str, Any]] = {
    # its default leaves `layer_types` None, which its model indexes: LFM2's short-conv and attention layers
    "Lfm2MoeConfig": {"layer_types": [*ShortConv.layer_types, "full_attention"]},
    # its hybrid layers share one transformer block, tied from the first to the others: a second hybrid layer
    # gives the tie mapping something to tie (one alone fails `tie_weights_keys`)
    "ZambaConfig": {"layers_block_type": [MIXER_LAYER, SHARED_LAYER, SHARED_LAYER], "num_hidden_layers": 3},
    # its serialised layout lists attention and mlp blocks as separate layers (pairs, halved on load), and the
    # input, recurrent and output segments must add up to the layers: one layer (one pair) in each
    "DoryConfig": {
        "layer_types": ["sliding_attention", "mlp", "sliding_attention", "mlp", "full_attention", "mlp"],
        "num_hidden_layers": 6,
        "n_input_layers": 2,
        "n_recurrent_layers": 2,
        "n_output_layers": 2,
    },
    # its model reads `vocabulary_map["<image>"]`, None by default: the image placeholder alone
    "ChameleonConfig": {"vocabulary_map": lambda fields: {"<image>": fields.get("image_token_id") or TINY_VOCAB - 1}},
    # its model builds one projector per (vision layer, text layer) pair of `deepstack_layer_map`, None by default,
    # and splits `downsample_rate` (None by default) into its query and key window sides
    "Granite4VisionConfig": {"deepstack_layer_map": [[-1, 0]], "downsample_rate": "1/4"},
    # its vision adapter's first projection takes the pixel-shuffled patches (hidden / ratio^2 wide), and its projector
    # chain keeps one width from the adapter to the text projection, which the shrunk widths break
    "Llama4Config": {"vision_config": lambda fields: _llama4_vision(fields["vision_config"])},
    # its QSA indexer's sizes are None by default (its attention divides them): one key head, 8 kept in blocks of 4
    "Qwen4ExpTextConfig": _QWEN4,
    "Qwen4ExpConfig": {"text_config": lambda fields: {**fields["text_config"], **_QWEN4}},
    # its vision tower is optional and absent by default: the default vision config, shrunk, so images can be tried
    "Gemma4Config": {"vision_config": lambda fields: fields.get("vision_config") or _default_sub("Gemma4VisionConfig")},
    # its attention clamps queries, keys and values to `clip_qkv`, None by default (DBRX's own is 8)
    "DbrxConfig": {"attn_config": lambda fields: {**fields["attn_config"], "clip_qkv": 8.0}},
    # its heavily compressed layers pool windows of 128 tokens, none complete in 24: 8, whose windows cross shards
    "DeepseekV4Config": {"compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}},
}
"""Per config class, fields its defaults leave unusable that no rule can derive (value, or a function of the tiny
fields); each with the reason."""


def _llama4_vision(vision: dict[str, Any]) -> dict[str, Any]:
    width = vision["hidden_size"]
    shuffled = int(width / vision["pixel_shuffle_ratio"] ** 2)
    return {**vision, "intermediate_size": shuffled, **dict.fromkeys(_LLAMA4_PROJECTOR, width)}


_LLAMA4_PROJECTOR = ("projector_input_dim", "projector_output_dim", "vision_output_dim")


def _default_sub(name: str) -> dict[str, Any]:
    """The shrunk fields of transformers' default config class ``name``, with its model type."""
    import transformers

    default = getattr(transformers, name)()
    return {**_tiny_fields(default), "model_type": default.model_type}


def tiny_fields(default: Any, mrope: bool) -> dict[str, Any]:
    """The keyword arguments of ``type(default)``'s tiny config, its family's fixed fields applied.

    Args:
        default: the family's default config.
        mrope: the model's code splits its rotary table into multimodal sections.

    Returns:
        The fields.
    """
    fields = _tiny_fields(default, mrope, _old_widths(default))
    for key, value in _FAMILY_FIELDS.get(type(default).__name__, {}).items():
        fields[key] = value(fields) if callable(value) else value
    return fields


def _tiny_fields(config: Any, mrope: bool | list[int] = False, widths: frozenset[int] = frozenset()) -> dict[str, Any]:
    """The keyword arguments of a tiny ``type(config)``: its own fields shrunk, its sub-configs as shrunk dicts.

    ``mrope``: the model splits its rotary table into multimodal sections (the sections it assumes where the config
    names none, or True). ``widths``: the hidden sizes of the whole default config (parent and sub-configs), which a
    field naming a width of another part (``text_hidden_size``, ``hidden_size_global``...) repeats.
    """
    import transformers

    fields = config.to_dict()
    names = _real_names(config)
    own = _module_mrope(config)  # its own module's default sections first, then its parent's
    if isinstance(own, list) or (own and not isinstance(mrope, list)):
        mrope = own
    tiny: dict[str, Any] = {}
    old_subs: dict[str, dict[str, Any]] = {}
    for key, value in fields.items():
        sub = _field(config, key)
        if isinstance(sub, transformers.PretrainedConfig):
            tiny[key] = {**_tiny_fields(sub, mrope, widths), "model_type": sub.model_type}
            old_subs[key] = sub.to_dict()
        elif key in _DROPPED:
            continue
        else:
            tiny[key] = value
    old = dict(tiny)
    _shrink(tiny, names)
    _mirror_widths(tiny, old, widths)
    shrink_layers(tiny, names, old)
    layer_types = tiny.get("layer_types")
    if tiny.get("rope_parameters") == {} and isinstance(layer_types, list) and layer_types:
        # no rotary parameters where the model reads them per layer type (Cohere Compass): the default rotary
        tiny["rope_parameters"] = {t: {"rope_type": "default", "rope_theta": 10000.0} for t in sorted(set(layer_types))}
    for rope in _rope_tables(tiny):
        if mrope and "mrope_section" not in rope:  # the model's own default, else Qwen2-VL's proportions
            rope["mrope_section"] = list(mrope) if isinstance(mrope, list) else [16, 24, 24]
    _match_derived_sizes(tiny, old)
    _match_sub_configs(tiny, old_subs)
    _place_special_ids(tiny)
    return tiny


def _module_mrope(config: Any) -> list[int] | bool:
    """Whether the modelling module beside ``config``'s class splits its rotary table into multimodal sections (a
    composite model whose text model lives in another family's module: GLM-4.6V's in GLM-4V's): the sections it
    assumes where the config names none (Ernie 4.5 VL's ``.get("mrope_section", [22, 22, 20])``), True where it
    names no default, False where it reads none."""
    module_name = type(config).__module__.replace(".configuration_", ".modeling_")
    return module_name != type(config).__module__ and _mrope_default(module_name)


_MROPE_DEFAULT = re.compile(r"""["']mrope_section["'],\s*\[(\d+(?:,\s*\d+)*)\]""")


@functools.cache
def _mrope_default(module_name: str) -> list[int] | bool:
    import importlib

    try:
        source = inspect.getsource(importlib.import_module(module_name))
    except Exception:  # no such module (a configuration without modelling beside it), or no source
        return False
    if "mrope_section" not in source:
        return False
    found = _MROPE_DEFAULT.search(source)
    return [int(n) for n in found.group(1).split(",")] if found else True


def _rope_tables(fields: dict[str, Any]) -> list[dict[str, Any]]:
    """The rotary parameter dicts of ``fields`` (copies put back in place): the one ``rope_parameters``, or one per
    layer type where it is keyed by layer type (Cohere Compass, Dory)."""
    rope = fields.get("rope_parameters")
    if not isinstance(rope, dict):
        return []
    if "rope_type" in rope or "rope_theta" in rope:
        fields["rope_parameters"] = rope = dict(rope)
        return [rope]
    tables = {k: dict(v) for k, v in rope.items() if isinstance(v, dict)}
    fields["rope_parameters"] = {**rope, **tables}
    return list(tables.values())


def _old_widths(config: Any) -> frozenset[int]:
    """Every hidden size in ``config`` and its sub-configs (the values a field naming another part's width repeats)."""
    import transformers

    found: set[int] = set()
    names = _real_names(config)
    for alias in _RULES[0][0]:
        value = _field(config, names.get(alias, alias))
        if isinstance(value, int) and not isinstance(value, bool) and value > HIDDEN:
            found.add(value)
    for key in config.to_dict():
        sub = _field(config, key)
        if isinstance(sub, transformers.PretrainedConfig):
            found |= _old_widths(sub)
    return frozenset(found)


_WIDTH_NAME = re.compile(r"hidden_size|hidden_dim|adapter_(in|out)_dim|adapter_input_size|codebook_dim")


def _mirror_widths(fields: dict[str, Any], old: dict[str, Any], widths: frozenset[int]) -> None:
    """A field named for a width (``text_hidden_size``, ``adapter_out_dim``, ``codebook_dim``...) that no rule cut
    and that repeated some part's hidden size takes the tiny hidden size (every part's is ``HIDDEN``)."""
    for key, value in list(fields.items()):
        if isinstance(value, bool) or not isinstance(value, int) or value != old.get(key):
            continue
        if value in widths and _WIDTH_NAME.search(key):
            fields[key] = HIDDEN


def _match_sub_configs(fields: dict[str, Any], old_subs: dict[str, dict[str, Any]]) -> None:
    """Keep what a config's sub-configs read of one another consistent after each was cut by itself."""
    rope = fields.get("rope_parameters")
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    for key in old_subs:
        sub = fields[key]
        # a part of this model (no model type of its own: DBRX's attention config) reads the model's rotary base
        if theta is not None and not sub.get("model_type") and not {"rope_theta", "rope_parameters"} & set(sub):
            sub["rope_theta"] = theta
    # ids offset into the vocabulary for a sub-config's codebook (Apertus 1.5's image and audio codes): codebooks of
    # 8, one block after another at the top of the vocabulary, in their old order
    offsets = sorted((v, k) for k, v in fields.items() if k.endswith("_token_offset") and isinstance(v, int))
    if offsets:
        for key in old_subs:
            if isinstance(fields[key].get("codebook_size"), int):
                fields[key]["codebook_size"] = min(fields[key]["codebook_size"], 8)
        for n, (_, key) in enumerate(offsets):
            fields[key] = TINY_VOCAB - 8 * (len(offsets) - n)
    # vision feature layers index the vision tower: those past its cut depth count from its end (Molmo2's [24, 18])
    vision, old_vision = fields.get("vision_config"), old_subs.get("vision_config")
    if not isinstance(vision, dict) or old_vision is None:
        return
    depth_key = next((k for k in LAYER_COUNTS if isinstance(vision.get(k), int)), None)
    if depth_key is None or not isinstance(old_vision.get(depth_key), int):
        return
    depth, old_depth = vision[depth_key], old_vision[depth_key]
    for owner in [fields, *(fields[k] for k in old_subs)]:
        for key, value in list(owner.items()):
            if "feature_layer" in key:
                owner[key] = _recount_layers(value, depth, old_depth)


def _recount_layers(value: Any, depth: int, old_depth: int) -> Any:
    """Layer indices of a tower cut from ``old_depth`` to ``depth`` layers: each past the cut counted from the end."""
    if isinstance(value, list):
        return [_recount_layers(v, depth, old_depth) for v in value]
    if isinstance(value, bool) or not isinstance(value, int) or -depth <= value < depth:
        return value
    from_end = value - old_depth if value >= 0 else value
    return max(from_end, -depth)


def _field(config: Any, key: str) -> Any:
    """``config.key``, or None where reading it raises (a per-layer field of a heterogeneous config)."""
    try:
        return getattr(config, key, None)
    except Exception:
        return None


_DROPPED = frozenset({"transformers_version", "architectures", "_name_or_path", "dtype", "torch_dtype"})


def _real_names(config: Any) -> dict[str, str]:
    """Standard name -> the config's own field for it (``attribute_map``: gpt2's ``n_embd`` for ``hidden_size``)."""
    return dict(getattr(config, "attribute_map", {}) or {})


# (standard or common field names, new value from the old one). Each rule touches only the fields a config has.
_Rule = tuple[tuple[str, ...], Callable[[Any], Any]]


def _at_most(n: int) -> Callable[[Any], Any]:
    return lambda old: min(old, n) if isinstance(old, int) and not isinstance(old, bool) and old > 0 else old


def _to(value: Any) -> Callable[[Any], Any]:
    return lambda old: value if isinstance(old, int | float) and not isinstance(old, bool) else old


def _at_least(n: int) -> Callable[[Any], Any]:
    return lambda old: max(old, n) if isinstance(old, int) and not isinstance(old, bool) else old


_RULES: tuple[_Rule, ...] = (
    (
        (
            "hidden_size",
            "d_model",
            "n_embd",
            "embed_dim",
            "model_dim",
            "out_hidden_size",
            "projection_dim",
            "embedding_dim",
        ),
        _to(HIDDEN),
    ),
    (("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size", "decoder_ffn_dim"), _to(INTERMEDIATE)),
    (
        (
            "moe_intermediate_size",
            "expert_intermediate_size",
            "shared_expert_intermediate_size",
            "moe_shared_expert_intermediate_size",
            "shared_intermediate_size",
            "moe_ffn_hidden_size",
        ),
        _to(32),
    ),
    (
        ("num_attention_heads", "n_head", "num_heads", "n_heads", "attention_heads", "decoder_attention_heads"),
        _to(HEADS),
    ),
    (("head_dim", "attention_head_dim", "kv_channels", "qk_head_dim", "d_head"), _to(HEAD_DIM)),
    (("rotary_dim",), _to(HEAD_DIM // 2)),
    (("attention_hidden_size",), _to(2 * HIDDEN)),
    (
        ("vocab_size", "vocab_size_per_layer_input", "text_vocab_size", "unpadded_vocab_size"),
        _to(TINY_VOCAB),
    ),
    (("encoder_hash_byte_group_vocab",), _at_most(TINY_VOCAB)),  # BLT's hashed n-gram embeddings
    (("index_num_heads", "index_n_heads"), _at_most(HEADS // KV_HEADS)),  # an indexer's heads (Kolibri: per kv head)
    (("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length"), _at_least(MAX_POSITIONS)),
    (("sliding_window", "attention_chunk_size", "sliding_window_size"), _at_most(WINDOW)),
    (("floor_scale",), _at_most(WINDOW)),  # Llama 4's query temperature grows every floor_scale tokens: let it bite
    (("index_topk",), _at_most(WINDOW)),  # a sparse-attention indexer keeps fewer keys than the rows hold: it bites
    (
        ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts"),
        _at_most(EXPERTS),
    ),
    (("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token", "top_k"), _at_most(TOP_K)),
    (("n_group", "topk_group", "n_shared_experts", "num_shared_experts"), _at_most(1)),
    (("num_kv_shared_layers",), _at_most(2)),
    (("first_k_dense_replace", "first_k_dense", "num_dense_layers"), _at_most(1)),
    (("num_nextn_predict_layers", "mtp_num_layers", "num_mtp_layers"), _to(0)),
    # MLA: q/k heads of 8 + 8 rotary, values of 16, small latent ranks
    (("kv_lora_rank",), _to(16)),
    (("q_lora_rank",), _at_most(24)),
    (("qk_nope_head_dim", "qk_rope_head_dim"), _to(8)),
    (("v_head_dim",), _to(HEAD_DIM)),
    # linear attention and state-space mixers
    (("linear_num_key_heads",), _to(KV_HEADS)),
    (("linear_num_value_heads", "linear_num_heads"), _to(HEADS)),
    (("linear_key_head_dim", "linear_value_head_dim", "linear_head_dim"), _to(HEAD_DIM)),
    (("mamba_n_heads", "mamba_num_heads", "n_mamba_heads"), _to(HEADS)),
    (("mamba_d_head", "mamba_head_dim", "mamba_headdim"), _to(2 * HIDDEN // HEADS)),
    (("mamba_d_ssm",), _to(2 * HIDDEN)),
    (("mamba_d_state", "ssm_state_size", "state_size", "d_state"), _at_most(8)),
    (("mamba_n_groups", "mamba_ngroups", "n_groups"), _at_most(1)),
    (("chunk_size", "mamba_chunk_size"), _at_most(16)),
    (("mamba_dt_rank", "time_step_rank"), _at_most(4)),
    # convolutional image tokenizers (VQ-GAN towers): narrow, one residual block a level (group norms of 32 divide)
    (("base_channels", "latent_channels"), _at_most(32)),
    (("num_res_blocks",), _at_most(1)),
    (("router_jitter_noise", "jitter_noise", "router_z_loss_coef"), _to(0.0)),
    (("initializer_range",), _to(0.1)),
)


def _shrink(fields: dict[str, Any], names: dict[str, str]) -> None:
    """Apply ``_RULES`` and the dropout and key/value-head rules to ``fields`` in place."""
    heads_key = names.get("num_attention_heads", "num_attention_heads")
    old_heads = fields.get(heads_key)
    for aliases, rule in _RULES:
        for alias in aliases:
            key = names.get(alias, alias)
            if key in fields and fields[key] is not None:
                fields[key] = rule(fields[key])
    for key, value in list(fields.items()):
        if isinstance(value, float) and ("dropout" in key or key.endswith(("_pdrop", "drop_rate", "_drop"))):
            fields[key] = 0.0
    for alias in ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "num_key_value"):
        key = names.get(alias, alias)
        if isinstance(fields.get(key), int) and isinstance(old_heads, int):
            # grouped-query attention stays grouped (2 of 4); multi-head stays multi-head
            fields[key] = KV_HEADS if fields[key] < old_heads else HEADS
    if "use_cache" in fields:
        fields["use_cache"] = False
    if fields.get("is_decoder") is False:  # a decoder-only model that asks for the flag (Reformer's LM head)
        fields["is_decoder"] = True


def _place_special_ids(fields: dict[str, Any]) -> None:
    """pad, bos and eos at 0-2; every other special token id (a placeholder) above ``TEXT_IDS``, each its own."""
    above = iter(range(TEXT_IDS[1], TINY_VOCAB))
    for key, value in sorted(fields.items()):
        is_id = key.endswith(("_token_id", "_token_index", "_token_ids"))
        if not is_id or value is None:
            continue
        if key in _PAD_BOS_EOS:
            fields[key] = [_PAD_BOS_EOS[key]] if isinstance(value, list) else _PAD_BOS_EOS[key]
        elif isinstance(value, list):
            fields[key] = [next(above, TINY_VOCAB - 1) for _ in value]
        elif isinstance(value, int):
            fields[key] = next(above, TINY_VOCAB - 1)


def _match_derived_sizes(fields: dict[str, Any], old: dict[str, Any]) -> None:
    """Put back the relations between sizes that the rules cut one by one, and fill sizes a model needs but whose
    default is None (the modelling code reads them without deriving them)."""
    heads = fields.get("num_attention_heads")
    if "head_dim" in fields and fields["head_dim"] is None and isinstance(heads, int):
        fields["head_dim"] = HEAD_DIM
    if "num_key_value_heads" in fields and fields["num_key_value_heads"] is None and isinstance(heads, int):
        fields["num_key_value_heads"] = heads  # None: multi-head
    expert_keys = ("n_routed_experts", "num_experts", "num_local_experts")
    moe = any(
        isinstance(fields.get(k), int) and fields[k] > 0 for k in ("moe_intermediate_size", "num_experts_per_tok")
    )
    for key in expert_keys:  # a mixture of experts whose expert count is left None (Dots1, DiffusionGemma)
        if key in fields and fields[key] is None and moe:
            fields[key] = EXPERTS
    experts = next((fields[k] for k in expert_keys if fields.get(k)), 0)
    if "num_experts_per_tok" in fields and fields["num_experts_per_tok"] is None and experts:
        fields["num_experts_per_tok"] = TOP_K
    moe_width = fields.get("moe_intermediate_size", 0) is None and not any(
        k.startswith("enable_moe") and v is False for k, v in fields.items()
    )
    if moe_width and any(k in fields and fields[k] is None for k in expert_keys):
        # every expert field left None where the model builds its experts anyway (DiffusionGemma)
        fields["moe_intermediate_size"] = 32
        for key in (*expert_keys, "num_experts_per_tok", "top_k_experts"):
            if key in fields and fields[key] is None:
                fields[key] = EXPERTS if key in expert_keys else TOP_K
        experts = EXPERTS
    if "n_shared_experts" in fields and fields["n_shared_experts"] is None and experts:
        fields["n_shared_experts"] = 1
    layers = next((fields[k] for k in LAYER_COUNTS if isinstance(fields.get(k), int)), None)
    if "mlp_layer_types" in fields and fields["mlp_layer_types"] is None and experts and layers:
        # which layers are experts, left None (DeepSeek-OCR 2): the first dense, the others sparse
        dense = min(fields.get("first_k_dense_replace") or 1, layers - 1) if layers > 1 else 0
        fields["mlp_layer_types"] = ["dense"] * dense + ["sparse"] * (layers - dense)
    # MLA: head_dim names the rotary part (DeepSeek-V3) or the whole query/key head
    rope, nope = old.get("qk_rope_head_dim"), old.get("qk_nope_head_dim")
    if isinstance(rope, int) and isinstance(old.get("head_dim"), int):
        if old["head_dim"] == rope:
            fields["head_dim"] = fields["qk_rope_head_dim"]
        elif isinstance(nope, int) and old["head_dim"] == rope + nope:
            fields["head_dim"] = fields["qk_rope_head_dim"] + fields["qk_nope_head_dim"]
    # state-space heads tile the expanded width (Mamba2: num_heads x head_dim = expand x hidden)
    expand, hidden, ssm_heads = fields.get("expand"), fields.get("hidden_size"), fields.get("num_heads")
    widths = (expand, hidden, ssm_heads, fields.get("head_dim"))
    if all(isinstance(w, int) for w in widths) and "num_attention_heads" not in fields:
        fields["head_dim"] = expand * hidden // ssm_heads
    layer_types = fields.get("layer_types")
    sliding = layer_types and "sliding_attention" in layer_types
    # a model that counts sliding-attention heads builds a sliding mask even where no layer slides (Step3p7)
    sliding = sliding or any(
        "sliding" in k and k != "sliding_window" and isinstance(v, int) and not isinstance(v, bool) and v > 0
        for k, v in fields.items()
    )
    if fields.get("sliding_window", 0) is None and sliding:
        fields["sliding_window"] = WINDOW
    _match_width_parts(fields, old)
    _shrink_mrope(fields)


def _match_width_parts(fields: dict[str, Any], old: dict[str, Any]) -> None:
    """A tuple of sizes that added up to the hidden size (Reformer's axial position dims) still does, in proportion."""
    hidden, old_hidden = fields.get("hidden_size"), old.get("hidden_size")
    if not isinstance(hidden, int) or not isinstance(old_hidden, int) or hidden == old_hidden:
        return
    for key, value in list(fields.items()):
        parts = value if isinstance(value, list | tuple) and len(value) > 1 else None
        if not parts or not all(isinstance(p, int) and not isinstance(p, bool) and p > 0 for p in parts):
            continue
        if sum(parts) == old_hidden and value == old.get(key):
            cut = [max(1, p * hidden // old_hidden) for p in parts]
            cut[-1] += hidden - sum(cut)
            fields[key] = type(value)(cut)


def _shrink_mrope(fields: dict[str, Any]) -> None:
    """Multimodal rotary sections (time, height, width) cut in proportion to the tiny rotary half."""
    for rope in _rope_tables(fields):
        sections = rope.get("mrope_section")
        if not sections:
            continue
        rotary = fields.get("qk_rope_head_dim") or fields.get("head_dim") or HEAD_DIM
        factor = rope.get("partial_rotary_factor") or fields.get("partial_rotary_factor") or 1.0
        half = int(rotary * factor) // 2
        total = sum(sections)
        cut = [max(1, round(s * half / total)) for s in sections]
        cut[0] += half - sum(cut)
        rope["mrope_section"] = cut
