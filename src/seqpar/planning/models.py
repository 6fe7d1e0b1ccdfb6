"""The shape of a decoder model as the planner needs it: sizes read from a config.json, a model dir or a preset.

Only sizes matter here (no weights): they give the FLOPs, the bytes on the wire and the memory of a step.
"""

from __future__ import annotations

import json
import os

from seqpar.errors import SeqparInputError
from seqpar.models import ModelSizes
from seqpar.models.sizes import unmodelled_sizes

# Values copied from each model's config.json on the Hugging Face Hub (the URL in ``source``).
PRESETS: dict[str, ModelSizes] = {
    "llama-8b": ModelSizes(
        4096, 14336, 32, 32, 8, 128256, source="https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json"
    ),
    "llama-70b": ModelSizes(
        8192, 28672, 80, 64, 8, 128256, source="https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json"
    ),
    "llama2-7b": ModelSizes(
        4096, 11008, 32, 32, 32, 32000, source="https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json"
    ),
    "qwen2.5-7b": ModelSizes(
        3584,
        18944,
        28,
        28,
        4,
        152064,
        model_type="qwen2",
        source="https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json",
    ),
}


def load_model_shape(model: str | dict | ModelSizes) -> ModelSizes:
    """The model's sizes from a preset name, a config.json, a model directory or a config dictionary.

    Args:
        model: a name in ``PRESETS``, a path to a config.json or to a directory holding one, a config dict,
            or a ``ModelSizes`` (returned as it is).

    Returns:
        The sizes.

    Raises:
        SeqparInputError: an unknown name, a missing or unreadable file, or a config without the sizes.
    """
    if isinstance(model, ModelSizes):
        return model
    if isinstance(model, dict):
        return _checked(ModelSizes.from_config(model, source="(dict)"), model)
    if not isinstance(model, str):
        raise SeqparInputError(f"model must be a preset name, a path or a config dict, got {type(model).__name__}")
    if model.lower() in PRESETS:
        return PRESETS[model.lower()]
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.isfile(path):
        raise SeqparInputError(
            f"model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json or a directory with one"
        )
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise SeqparInputError(f"cannot read model config {path}: {error}") from error
    if not isinstance(config, dict):
        raise SeqparInputError(f"model config {path} is not a JSON object")
    return _checked(ModelSizes.from_config(config, source=path), config)


def _checked(sizes: ModelSizes, config: dict) -> ModelSizes:
    """The sizes, where they describe the model (Note [sizes of read families]: only a family without an entry is
    built, on the meta device, to be checked; the others load no torch)."""
    unmodelled = unmodelled_sizes(config)
    if unmodelled:
        raise SeqparInputError(f"cannot plan: {unmodelled}")
    return sizes
