"""The installed transformers zoo: its causal-LM and image-text-to-text model types, and a tiny config of each.

``python -m benchmarks.zoo`` builds every one from ``tiny_config`` and judges seqpar on it (issue 58).
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

CAUSAL_LM = "causal-lm"
IMAGE_TEXT_TO_TEXT = "image-text-to-text"

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
MAX_LAYERS = 4
WINDOW = 8
"""A sliding window (and a chunked-attention chunk) well inside the sweep's 24-token rows, so it bites."""


@dataclass(frozen=True)
class ZooEntry:
    """One ``model_type`` of the zoo: the mappings that list it, and why the sweep leaves it out (None: it runs)."""

    model_type: str
    mappings: tuple[str, ...]
    set_aside: str | None = None


def zoo_model_types(only: Collection[str] | None = None) -> dict[str, ZooEntry]:
    """Every model type of transformers' causal-LM and image-text-to-text mappings, in name order.

    Encoder-decoders (``config.is_encoder_decoder``) and encoders whose causal LM is the decoder half of an
    ``EncoderDecoderModel`` (the class reads ``config.is_decoder`` and the config declares cross-attention) are
    set aside with the reason: they are not decoder-only language models. ``only``: those model types alone.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    listed: dict[str, list[str]] = {}
    for mapping, names in ((CAUSAL_LM, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), (IMAGE_TEXT_TO_TEXT, _image_text())):
        for model_type in names:
            listed.setdefault(model_type, []).append(mapping)
    return {
        model_type: ZooEntry(model_type, tuple(listed[model_type]), _set_aside(model_type))
        for model_type in sorted(listed)
        if only is None or model_type in only
    }


def _image_text() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return dict(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def model_class_name(model_type: str) -> str:
    """The class transformers builds for ``model_type``: its causal LM, else its image-text-to-text model."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) or _image_text()[model_type]
    return name if isinstance(name, str) else name[0]


def _set_aside(model_type: str) -> str | None:
    import transformers

    try:
        config = transformers.AutoConfig.for_model(model_type)
    except Exception:  # the sweep reports it as BUILD, with tiny_config's sentence
        return None
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder (config.is_encoder_decoder): its language model is the decoder half"
    model_class = getattr(transformers, model_class_name(model_type), None)
    if model_class is None:
        return None
    reads_is_decoder = "is_decoder" in inspect.getsource(model_class.__init__)
    if reads_is_decoder and "add_cross_attention" in config.to_dict():
        return (
            f"an encoder: {model_class.__name__} is bidirectional unless config.is_decoder, the decoder half of "
            "an EncoderDecoderModel (cross-attention declared)"
        )
    return None


def tiny_config(model_type: str) -> Any:
    """A tiny float32 config of ``model_type`` (a ``PretrainedConfig``), or the sentence why none can be built.

    Hidden 64, 4 query and 2 key/value heads of 16 (multi-head families keep one key/value head per query
    head), MLPs of 128, a vocabulary of ``TINY_VOCAB`` with pad/bos/eos at 0-2 and other special ids above
    ``TEXT_IDS``, windows of 8, 256 positions, 4 experts of which 2 per token, no dropout and no router jitter.
    Per-layer patterns (``layer_types`` and the like) keep one layer of each kind they had, in their order, at
    least 2 layers; sub-configs (text, vision, audio) are shrunk by the same rules.
    """
    import transformers

    try:
        default = transformers.AutoConfig.for_model(model_type)
    except Exception as error:  # a sentence for the sweep, not an exception
        return f"its default config does not build: {_last_line(error)}"
    try:
        fields = _tiny_fields(default, _reads_mrope_sections(model_type))
        return type(default)(**fields)
    except Exception as error:
        return f"no tiny config: {_last_line(error)}"


ATTENTION = ("sdpa", "eager")
"""The attention implementations tried in order: the first the model accepts is built."""


def tiny_model(model_type: str, mappings: tuple[str, ...], device: str | None = None) -> Any:
    """The family's tiny model in float32 and eval mode (nothing random), or the sentence why it cannot be built.

    Args:
        model_type: a zoo model type.
        mappings: the mappings that list it (its causal LM is built where it has one).
        device: where to build it ("meta" for its structure alone); None: the default device.

    Returns:
        The model with a head, or a sentence.
    """
    import torch
    import transformers

    config = tiny_config(model_type)
    if isinstance(config, str):
        return config
    auto = transformers.AutoModelForCausalLM if CAUSAL_LM in mappings else transformers.AutoModelForImageTextToText
    error: BaseException | None = None
    for attention in ATTENTION:
        torch.manual_seed(0)
        try:
            with torch.device(device) if device else contextlib.nullcontext():
                return auto.from_config(config, attn_implementation=attention, dtype=torch.float32).eval()
        except Exception as e:  # another attention implementation may build
            error = e
    return f"the tiny model does not build: {_last_line(error)}"


_REFUSAL_FRAME = re.compile(
    r"^seqpar cannot serve this model's attention: |; describe it with seqpar\.models\.register_family \(.*?\)$"
)


def short_reason(refusal: str) -> str:
    """A refusal of ``prepare_model`` without the words every refusal shares, as the support matrix shows it.

    Args:
        refusal: the ``SeqparInputError`` message.

    Returns:
        What is specific to the family.
    """
    return _REFUSAL_FRAME.sub("", refusal)


def _last_line(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1].strip() if lines else ''}"[:300]


def _reads_mrope_sections(model_type: str) -> bool:
    """Whether the model's code splits its rotary table into multimodal sections (with a default of its own when
    the config names none: 64 rotary halves in Qwen2-VL's, which a tiny head does not have)."""
    import sys

    import transformers

    model_class = getattr(transformers, model_class_name(model_type), None)
    module = sys.modules.get(model_class.__module__) if model_class is not None else None
    return module is not None and "mrope_section" in inspect.getsource(module)


def _tiny_fields(config: Any, mrope: bool = False) -> dict[str, Any]:
    """The keyword arguments of a tiny ``type(config)``: its own fields shrunk, its sub-configs as shrunk dicts."""
    import transformers

    fields = config.to_dict()
    names = _real_names(config)
    tiny: dict[str, Any] = {}
    for key, value in fields.items():
        sub = _field(config, key)
        if isinstance(sub, transformers.PretrainedConfig):
            tiny[key] = {**_tiny_fields(sub, mrope), "model_type": sub.model_type}
        elif key in _DROPPED:
            continue
        else:
            tiny[key] = value
    old = dict(tiny)
    _shrink(tiny, names)
    _shrink_layers(tiny, names, old)
    rope = tiny.get("rope_parameters")
    flat_rope = isinstance(rope, dict) and "rope_type" in rope  # not keyed by layer type (Cohere Compass)
    if mrope and flat_rope and "mrope_section" not in rope:
        tiny["rope_parameters"] = {**rope, "mrope_section": [16, 24, 24]}  # Qwen2-VL's proportions
    _match_derived_sizes(tiny, old)
    _place_special_ids(tiny)
    return tiny


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
    (("vocab_size", "vocab_size_per_layer_input", "text_vocab_size"), _to(TINY_VOCAB)),
    (("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length"), _at_least(MAX_POSITIONS)),
    (("sliding_window", "attention_chunk_size", "sliding_window_size"), _at_most(WINDOW)),
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


_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "depth")


def _scaled_layer(layer: dict[str, Any], fields: dict[str, Any], old_fields: dict[str, Any]) -> dict[str, Any]:
    """One layer's own sizes scaled as the config's same sizes were (a global layer's heads twice as wide stay so)."""
    scaled = {}
    for key, value in layer.items():
        base_old, base_new = old_fields.get(key), fields.get(key)
        if isinstance(value, int) and isinstance(base_old, int) and isinstance(base_new, int) and base_old:
            value = max(1, base_new * value // base_old)
        scaled[key] = value
    return scaled


def _shrink_layers(fields: dict[str, Any], names: dict[str, str], old_fields: dict[str, Any]) -> None:
    """Cut the layer count, keeping one layer of each kind every per-layer pattern has (and at least 2)."""
    count_key = next((names.get(k, k) for k in _LAYER_COUNTS if isinstance(fields.get(names.get(k, k)), int)), None)
    if count_key is None:
        return
    old = fields[count_key]
    patterns = {k: v for k, v in fields.items() if isinstance(v, list | tuple) and len(v) == old and old > 1}
    patterns |= {
        k: v for k, v in fields.items() if isinstance(v, str) and len(v) == old and old > 1 and k != "model_type"
    }
    per_layer = fields.get("per_layer_config")
    if isinstance(per_layer, dict) and per_layer:  # a heterogeneous config: each listed layer's own fields
        by_index = {int(k): v for k, v in per_layer.items()}
        patterns["per_layer_config"] = [by_index.get(i) for i in range(old)]
    keep = _kept_layers(list(patterns.values()), old)
    if fields.get("num_kv_shared_layers"):  # the last layers read earlier layers' caches: one of each kind again
        keep = sorted(keep + [old - len(keep) + i for i in range(len(keep))])
    fields[count_key] = len(keep)
    for key, pattern in patterns.items():
        cut = [pattern[i] for i in keep]
        if key == "per_layer_config":
            fields[key] = {str(i): _scaled_layer(layer, fields, old_fields) for i, layer in enumerate(cut) if layer}
        else:
            fields[key] = "".join(cut) if isinstance(pattern, str) else type(pattern)(cut)
    for key, value in list(fields.items()):
        if key.endswith("_layer_period") and isinstance(value, int) and value > len(keep):
            fields[key] = len(keep)
        elif key.endswith("_layer_offset") and isinstance(value, int):
            period = fields.get(key.replace("_offset", "_period"), len(keep))
            fields[key] = value % max(1, min(period, len(keep)))


def _kept_layers(patterns: list[list[Any] | str], old: int) -> list[int]:
    """Layer indices to keep: the first layer of each kind across the patterns, in order, padded to 2 layers."""
    keep: list[int] = []
    seen: set[tuple[str, ...]] = set()
    for i in range(old):
        kind = tuple(repr(p[i]) for p in patterns)
        if kind not in seen:
            seen.add(kind)
            keep.append(i)
    for i in range(old):
        if len(keep) >= 2:
            break
        if i not in keep:
            keep.append(i)
    return sorted(keep)[:MAX_LAYERS] if len(keep) > MAX_LAYERS else sorted(keep)


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
    experts = next((fields[k] for k in ("n_routed_experts", "num_experts", "num_local_experts") if fields.get(k)), 0)
    if "num_experts_per_tok" in fields and fields["num_experts_per_tok"] is None and experts:
        fields["num_experts_per_tok"] = TOP_K
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
    if fields.get("sliding_window", 0) is None and layer_types and "sliding_attention" in layer_types:
        fields["sliding_window"] = WINDOW
    _shrink_mrope(fields)


def _shrink_mrope(fields: dict[str, Any]) -> None:
    """Multimodal rotary sections (time, height, width) cut in proportion to the tiny rotary half."""
    rope = fields.get("rope_parameters")
    sections = rope.get("mrope_section") if isinstance(rope, dict) else None
    if not sections:
        return
    rotary = fields.get("qk_rope_head_dim") or fields.get("head_dim") or HEAD_DIM
    factor = rope.get("partial_rotary_factor") or fields.get("partial_rotary_factor") or 1.0
    half = int(rotary * factor) // 2
    total = sum(sections)
    cut = [max(1, round(s * half / total)) for s in sections]
    cut[0] += half - sum(cut)
    fields["rope_parameters"] = {**rope, "mrope_section": cut}
