"""Tiny Hugging Face causal language models and token batches shared by the model-level tests.

Kept apart from ``tests._cases`` so that the attention tests do not import transformers.
"""

from __future__ import annotations

import torch
import transformers

__all__ = ["SEQ", "VOCAB", "build", "tiny_config", "tokens"]

SEQ = 48  # divides 2P for P = 1..4
VOCAB = 96


def tiny_config(kind: str):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common)
    if kind == "mistral":
        return transformers.MistralConfig(**common, sliding_window=7)
    if kind == "qwen3":  # q/k norms
        return transformers.Qwen3Config(**common, head_dim=12)
    if kind == "gemma3":  # sliding and full layers alternate, query_pre_attn_scalar scaling, logit soft-cap
        layers = ["sliding_attention", "full_attention"]
        return transformers.Gemma3TextConfig(**common, head_dim=12, sliding_window=5, layer_types=layers)
    if kind == "phi3":  # fused qkv projection
        return transformers.Phi3Config(**common, pad_token_id=0)
    if kind == "olmo2":
        return transformers.Olmo2Config(**common)
    raise ValueError(kind)


def build(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(kind), attn_implementation="eager").eval()


def tokens(batch: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
