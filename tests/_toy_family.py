"""A model family seqpar has never seen: Llama's computation under other module names and its own model_type.

``toy_and_llama()`` builds the toy and a transformers Llama holding the same weights; ``register_toy()`` describes
the toy's anatomy to ``seqpar.models`` (in every process that uses it: spawned ranks start with the built-in
registry).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import transformers
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.llama import modeling_llama as llama

import seqpar.models
from tests._models import tiny_config

__all__ = ["TOY", "ToyConfig", "ToyForCausalLM", "register_toy", "to_llama_name", "toy_and_llama"]


class ToyConfig(transformers.LlamaConfig):
    model_type = "toy_llama"


class ToyBlock(nn.Module):
    """A Llama decoder layer whose attention is ``mixer``, MLP ``ffn`` and norms ``pre`` / ``post``."""

    def __init__(self, config: ToyConfig, layer_idx: int) -> None:
        super().__init__()
        self.pre = llama.LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mixer = llama.LlamaAttention(config, layer_idx)
        self.post = llama.LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.ffn = llama.LlamaMLP(config)

    def forward(self, hidden: torch.Tensor, position_embeddings: tuple, **kwargs: object) -> torch.Tensor:
        hidden = hidden + self.mixer(self.pre(hidden), position_embeddings=position_embeddings, **kwargs)[0]
        return hidden + self.ffn(self.post(hidden))


class ToyPreTrainedModel(llama.LlamaPreTrainedModel):
    config_class = ToyConfig
    base_model_prefix = "body"
    _no_split_modules: ClassVar[list[str]] = ["ToyBlock"]
    _can_record_outputs: ClassVar[dict] = {}


class ToyModel(ToyPreTrainedModel):
    """The decoder: ``tok`` (embedding), ``blocks``, ``final`` (norm), ``rope``."""

    def __init__(self, config: ToyConfig) -> None:
        super().__init__(config)
        self.tok = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(ToyBlock(config, i) for i in range(config.num_hidden_layers))
        self.final = llama.LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rope = llama.LlamaRotaryEmbedding(config)
        self.post_init()

    def forward(self, input_ids=None, position_ids=None, inputs_embeds=None, **kwargs) -> BaseModelOutputWithPast:
        for unused in ("use_cache", "attention_mask", "past_key_values"):
            kwargs.pop(unused, None)
        hidden = self.tok(input_ids) if inputs_embeds is None else inputs_embeds
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device)[None]
        rope = self.rope(hidden, position_ids)
        for block in self.blocks:
            hidden = block(hidden, rope, attention_mask=None, position_ids=position_ids, **kwargs)
        return BaseModelOutputWithPast(last_hidden_state=self.final(hidden))


class ToyForCausalLM(ToyPreTrainedModel):
    """The toy with its head ``out`` on the decoder ``body``."""

    def __init__(self, config: ToyConfig) -> None:
        super().__init__(config)
        self.body = ToyModel(config)
        self.out = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, position_ids=None, **kwargs) -> CausalLMOutputWithPast:
        hidden = self.body(input_ids=input_ids, position_ids=position_ids, **kwargs).last_hidden_state
        return CausalLMOutputWithPast(logits=self.out(hidden))


TOY = seqpar.models.Family(
    "toy_llama",
    decoder="body",
    layers="blocks",
    embedding="tok",
    norm="final",
    rotary="rope",
    head="out",
    attention="mixer",
    mlp="ffn",
    layer_norms=("pre", "post"),
    tp_plan=tuple(
        (path.replace("self_attn", "mixer").replace("mlp", "ffn"), s) for path, s in seqpar.models.LLAMA_TP_PLAN
    ),
)
_RENAMES = (
    ("body.tok.", "model.embed_tokens."),
    ("body.blocks.", "model.layers."),
    ("body.final.", "model.norm."),
    ("out.", "lm_head."),
    (".mixer.", ".self_attn."),
    (".ffn.", ".mlp."),
    (".pre.", ".input_layernorm."),
    (".post.", ".post_attention_layernorm."),
)


def to_llama_name(name: str) -> str:
    """The Llama parameter name of a toy parameter name."""
    for toy, ours in _RENAMES:
        name = name.replace(toy, ours)
    return name


def register_toy() -> None:
    seqpar.models.register_family(TOY)


def toy_and_llama(seed: int = 0, attn: str = "sdpa", layers: int = 2) -> tuple[ToyForCausalLM, nn.Module]:
    """The toy and a tiny Llama (``tests._models.tiny_config("llama")``) with the same weights."""
    config = tiny_config("llama")
    config.num_hidden_layers = layers
    torch.manual_seed(seed)
    reference = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    fields = {k: v for k, v in config.to_dict().items() if k != "model_type"}
    toy = ToyForCausalLM._from_config(ToyConfig(**fields), attn_implementation=attn).eval()
    weights = reference.state_dict()
    toy.load_state_dict({name: weights[to_llama_name(name)] for name in toy.state_dict()})
    return toy, reference
