"""The shape of a decoder model as the planner needs it: sizes read from a config.json, a model dir or a preset.

Only sizes matter here (no weights): they give the FLOPs, the bytes on the wire and the memory of a step.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from seqpar.errors import SeqparInputError
from seqpar.memory.shapes import ModelDims, active_parameters, model_dims, parameter_counts

__all__ = ["PRESETS", "ModelShape", "load_model_shape"]


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a decoder-only transformer with gated (SwiGLU) MLPs or experts, as in a Hugging Face config.

    Mixture-of-experts models: weights, gradients and optimizer states count the stored experts, FLOPs and
    activations the ones a token runs through (Note [mixture-of-experts sizes] in ``seqpar.memory.shapes``).
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

    @property
    def dim(self) -> int:
        """Width of one attention head."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def dims(self) -> ModelDims:
        """The sizes as the memory estimate reads them (one tensor-parallel rank of one)."""
        return model_dims(self.as_config(), 1)

    @property
    def layer_params(self) -> int:
        """Weights a token runs through in one decoder layer, averaged over the layers (norms left out)."""
        d = self.dims
        return (active_parameters(d) - d.hidden * (d.vocab + 1 + 2 * d.layers)) // d.layers

    @property
    def mlp_width(self) -> int:
        """Width of the MLP activations of one token: the routed experts' (and shared expert's) or the dense one."""
        return self.dims.intermediate

    @property
    def num_params(self) -> int:
        """All stored weights: layers (every expert), embedding, head (once when tied) and the RMSNorm scales."""
        return parameter_counts(self.dims)[0]

    @property
    def active_params(self) -> int:
        """Weights one token runs through: ``num_params`` less the experts it is not routed to and the embedding."""
        return active_parameters(self.dims)

    def as_config(self) -> dict:
        """The sizes as a Hugging Face config dictionary."""
        return {
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "vocab_size": self.vocab_size,
            "head_dim": self.dim,
            "tie_word_embeddings": self.tie_word_embeddings,
            **self._moe_config(),
        }

    def _moe_config(self) -> dict:
        if not self.num_experts:
            return {}
        return {
            "num_local_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "mlp_only_layers": list(range(self.num_hidden_layers - self.moe_layers)),
        }


# Values copied from each model's config.json on the Hugging Face Hub (the URL in ``source``).
PRESETS: dict[str, ModelShape] = {
    "llama-8b": ModelShape(
        4096, 14336, 32, 32, 8, 128256, source="https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json"
    ),
    "llama-70b": ModelShape(
        8192, 28672, 80, 64, 8, 128256, source="https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json"
    ),
    "llama2-7b": ModelShape(
        4096, 11008, 32, 32, 32, 32000, source="https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json"
    ),
    "qwen2.5-7b": ModelShape(
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


def shape_from_config(config: dict, source: str = "") -> ModelShape:
    """A ``ModelShape`` from a Hugging Face config dictionary (``text_config`` of multimodal configs used).

    Args:
        config: the parsed config.json.
        source: where it came from, for messages.

    Returns:
        The sizes.

    Raises:
        SeqparInputError: a size is missing or not a positive integer, or the heads do not divide.
    """
    try:
        d = model_dims(config, 1)
    except SeqparInputError as error:
        raise SeqparInputError(f"model config {source}: {error}") from None
    return ModelShape(
        hidden_size=d.hidden,
        intermediate_size=d.dense_intermediate,
        num_hidden_layers=d.layers,
        num_attention_heads=d.heads,
        num_key_value_heads=d.kv_heads,
        vocab_size=d.vocab,
        head_dim=d.q_width // d.heads,
        tie_word_embeddings=d.tied,
        model_type=str(config.get("text_config", config).get("model_type", "llama")),
        source=source,
        num_experts=d.experts,
        num_experts_per_tok=d.experts_per_token,
        moe_intermediate_size=d.expert_intermediate,
        shared_expert_intermediate_size=d.shared_intermediate,
        moe_layers=d.moe_layers,
    )


def load_model_shape(model: str | dict | ModelShape) -> ModelShape:
    """The model's sizes from a preset name, a config.json, a model directory or a config dictionary.

    Args:
        model: a name in ``PRESETS``, a path to a config.json or to a directory holding one, a config dict,
            or a ``ModelShape`` (returned as it is).

    Returns:
        The sizes.

    Raises:
        SeqparInputError: an unknown name, a missing or unreadable file, or a config without the sizes.
    """
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, dict):
        return shape_from_config(model, "(dict)")
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
    return shape_from_config(config, path)
