"""The installed transformers zoo: its causal-LM and image-text-to-text model types, and a tiny config of each.

``python -m benchmarks.zoo`` builds every one from ``tiny_config`` and judges seqpar on it (issue 58).
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from seqpar.models._tiny_config import TEXT_IDS, TINY_VOCAB, tiny_fields

__all__ = [
    "CAUSAL_LM",
    "IMAGE_TEXT_TO_TEXT",
    "TEXT_IDS",
    "TINY_VOCAB",
    "ZooEntry",
    "model_class_name",
    "short_reason",
    "tiny_config",
    "tiny_model",
    "zoo_model_types",
]

CAUSAL_LM = "causal-lm"
IMAGE_TEXT_TO_TEXT = "image-text-to-text"


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
        fields = tiny_fields(default, _reads_mrope_sections(model_type))
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
