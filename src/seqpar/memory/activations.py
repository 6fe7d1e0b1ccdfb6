"""Per-token activation and attention-communication sizes of one decoder layer, for the memory estimate.

The formulas are explained once, in Note [memory estimate] (estimate.py).
"""

from __future__ import annotations

from seqpar.memory.mixers import mixer_elements
from seqpar.models import ModelSizes
from seqpar.models.hybrid_sizes import OWN_MLP_KINDS
from seqpar.sequence_parallel.strategies.registry import strategy_row


def comm_elements(strategy: str, d: ModelSizes, sp_size: int, ulysses: int) -> float:
    """Attention communication buffers of one layer's forward and backward, elements per local token."""
    if sp_size == 1 or not d.attention_layers:  # a state-space model has no attention
        return 0.0
    row = strategy_row(strategy)
    heads, kv = d.num_attention_heads // d.tp_size, max(1, d.num_key_value_heads // d.tp_size)
    split = row.split(heads, kv, sp_size, ulysses)
    elements = 0.0
    if row.all_to_all is not None and split is not None:  # contiguous sends of q, k, v, head-sharded receipts
        degree = split.degree  # the busiest receiver: ceil(H/P) heads, KV copied up where they fall unevenly
        received = max(
            degree * (b - a + 2 * (kb - ka) + (2 * (b - a) if split.local_kv_index(r) is not None else 0))
            for r, ((a, b), (ka, kb)) in enumerate(zip(split.q_ranges, split.kv_ranges, strict=True))
        )
        elements += d.dim * (heads + 2 * split.wire_kv_heads + received)
    if row.kv_exchange == "ring":  # after an all-to-all a ring rank holds as many k, v elements as before it
        elements += 8.0 * d.kv_width
    if row.kv_exchange == "gather":
        elements += 4.0 * d.kv_width * sp_size
    return elements


def _attention_elements(d: ModelSizes) -> int:
    """Elements one token keeps in a layer for its backward outside the MLP, its input left out (Note [memory
    estimate], its MLA paragraph for MLA)."""
    h, hq, hkv = d.hidden_size, d.q_width, d.kv_width
    if not d.mla:
        return 4 * h + 3 * hq + 2 * hkv
    latents = d.q_lora_rank + d.kv_lora_rank + d.qk_rope_head_dim
    return 5 * h + 4 * hq + d.v_width + 3 * latents


def _mixer_bytes(d: ModelSizes, tokens: int, b: int, sp_size: int) -> dict[str, int]:
    """Bytes a layer of each kind keeps outside its MLP, its input left out (Note [memory estimate]; a hybrid's
    layers, Note [hybrid memory])."""
    latent_norms = d.q_lora_rank + d.kv_lora_rank  # MLA's two latent RMSNorms (Note [MLA sizes])
    norm_copies = 0 if b >= 4 else 4 * (2 * d.hidden_size + latent_norms)  # 16-bit: float32 RMSNorm input copies
    if not d.layer_kinds:
        return {"attention": tokens * (b * _attention_elements(d) + norm_copies)}
    kinds = {}
    for kind in d.kind_counts:
        own, float32 = mixer_elements(d, kind, sp_size, b)
        kinds[kind] = int(tokens * (b * own + 4 * float32 + norm_copies))
    return kinds


def activation_bytes(
    d: ModelSizes, tokens: int, b: int, features: tuple[str, ...], mlp_chunk: int, sp_size: int = 1
) -> dict:
    """Kept, recomputed and transient activation bytes of the layers (Note [memory estimate]; hybrids: Note
    [hybrid memory], ``kept_per_layer`` the layers' mean)."""
    h, i = d.hidden_size, d.mlp_width
    tiled = "tiled_mlp" in features
    mixers = _mixer_bytes(d, tokens, b, sp_size)
    attention = max(mixers.values())
    # experts: the tokens' copies routed to the experts and their weighted outputs (Note [mixture-of-experts sizes])
    routed = 2 * d.num_experts_per_tok * h if d.num_experts and d.moe_layers else 0
    if routed and d.shared_width and d.shared_expert_gate:  # the gated shared expert's output, kept for its gate
        routed += h
    mlp = 0 if tiled else tokens * b * (4 * i + routed)
    if any(kind in OWN_MLP_KINDS for kind in d.layer_kinds):  # Nemotron-H's, Zamba2's MLPs: in ``mixers``
        mlp = 0
    saved = attention + mlp
    chunk = min(mlp_chunk, tokens)
    extra = tokens * b * (h if tiled else i + h) + (chunk * b * (5 * i + routed) if tiled else 0)
    layers = d.num_hidden_layers
    every = sum(n * mixers[kind] for kind, n in d.kind_counts.items()) + layers * mlp  # what all layers save
    kept_per_layer = tokens * h * b + (0 if "checkpointing" in features else every // max(1, layers))
    kept_layers = d.num_hidden_layers
    if "offload" in features and "checkpointing" in features:
        kept_layers = min(2, d.num_hidden_layers)  # the rest waits in host memory
    return {
        "kept_per_layer": kept_per_layer,
        "kept_layers": kept_layers,
        "kept": kept_per_layer * kept_layers + 3 * tokens * h * b,  # + the final norm's input and outputs
        "recomputed": saved if "checkpointing" in features else 0,
        "recomputed_attention": attention if "checkpointing" in features else 0,
        "extra": extra,
    }
