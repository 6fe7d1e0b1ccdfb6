"""Parameter counts of a model from its ``ModelSizes``: all stored, the largest layer's, the head's, the active ones.

The memory estimate reads weights, gradients and optimizer states from these (Note [hybrid sizes] for hybrids).
"""

from __future__ import annotations

from typing import Any

from seqpar.models.hybrid_sizes import ATTENTION, MLP_KINDS, OWN_MLP_KINDS, PARALLEL, SHARED, shared_block_params

# A ``seqpar.models.sizes.ModelSizes``; named loosely so that this module stays below ``sizes.py``
# in the import order (sizes.py imports it).
ModelSizes = Any


def _attention_params(d: ModelSizes) -> int:
    """The attention's projections and the layer's two RMSNorms (Note [MLA sizes] for MLA)."""
    h = d.hidden_size
    if not d.mla:  # Note [hybrid sizes]: the output gate doubles q_proj, the q/k norms add a head (or all) each
        gate = d.q_width * h if d.attention_gate else 0
        norms = (d.q_width + d.kv_width if d.qk_norm_whole else 2 * d.dim) if d.qk_norm else 0
        return h * (2 * d.q_width + 2 * d.kv_width) + gate + norms + d.layer_norms * h
    heads = d.num_attention_heads // d.tp_size
    r_q, r_kv = d.q_lora_rank, d.kv_lora_rank
    q = h * r_q + r_q + r_q * d.q_width if r_q else h * d.q_width  # bottleneck, its norm, expansion
    kv = h * (r_kv + d.qk_rope_head_dim) + r_kv + r_kv * heads * (d.qk_nope_head_dim + d.v_head_dim)
    return q + kv + d.v_width * h + 2 * h


def _moe_mlp_params(d: ModelSizes, experts: int) -> int:
    """MLP weights of a mixture-of-experts layer with ``experts`` experts counted, router and shared expert."""
    h, matrices = d.hidden_size, 3 if d.mlp_gated else 2
    shared = matrices * h * d.shared_width + (h if d.shared_width and d.shared_expert_gate else 0)
    return matrices * h * d.expert_width * experts + h * d.num_experts + shared


def _kind_params(d: ModelSizes, kind: str, dense: int, sparse: int) -> int:
    """Parameters of one layer of ``kind`` outside the MLP it holds beside its mixer (Note [hybrid sizes])."""
    norms = d.layer_norms * d.hidden_size
    if kind == ATTENTION:
        return _attention_params(d)
    if kind in MLP_KINDS:  # Nemotron-H: an MLP, or experts, is a layer of its own
        return (dense if kind == "mlp" else sparse) + norms
    mixer = d.mixer.params(d.hidden_size) + norms  # the row's count (Note [mixer rows])
    if kind == PARALLEL:  # Falcon-H1: both mixers after one norm; the layer's norms counted once
        return _attention_params(d) + mixer - norms
    if kind == SHARED:  # Zamba2: its mixer layer, the projection after the shared block, the adapters
        return mixer + d.hidden_size * d.hidden_size + shared_block_params(d)[1]
    return mixer


def _layer_params(d: ModelSizes, experts: int) -> tuple[int, int, int, int, int]:
    """(sparse layers, a dense layer's MLP parameters, a sparse layer's, all layers' token mixers and norms,
    the largest layer's) with ``experts`` experts counted; where MLPs are layers of their own, these are in the
    mixers' count and the first three are 0."""
    sparse_layers = min(d.moe_layers, d.num_hidden_layers)  # a pipeline stage's view keeps the whole model's count
    dense = (3 if d.mlp_gated else 2) * d.hidden_size * d.dense_width
    sparse = _moe_mlp_params(d, experts) if sparse_layers else 0
    mixers = {kind: _kind_params(d, kind, dense, sparse) for kind in d.kind_counts}
    total = sum(n * mixers[kind] for kind, n in d.kind_counts.items())
    runs = d.kind_counts.get(SHARED, 0)
    if runs:  # Zamba2 (Note [hybrid sizes]): a layer that runs a block holds it whole, with the adapters of each run
        base, adapters = shared_block_params(d)
        count = d.shared.count
        per_block = [len(range(block, runs, count)) for block in range(min(count, runs))]
        if d.tie_word_embeddings:  # transformers ties the blocks only then: each stored once
            total += len(per_block) * base
        else:  # a copy in every layer that runs it
            total += runs * base + (sum(n * n for n in per_block) - runs) * adapters
        mixers[SHARED] += base + (per_block[0] - 1) * adapters
    if any(kind in OWN_MLP_KINDS for kind in d.layer_kinds):
        return 0, 0, 0, total, max(mixers.values())
    mlp = max(dense if sparse_layers < d.num_hidden_layers else 0, sparse)
    return sparse_layers, dense, sparse, total, max(mixers.values(), default=0) + mlp


def parameter_counts(d: ModelSizes) -> tuple[int, int, int]:
    """Stored parameters of a Llama-style model (gated MLPs or experts, two RMSNorms per layer) on one tp rank,
    or of a hybrid's layers (Note [hybrid sizes]).

    Args:
        d: the model's sizes (Note [mixture-of-experts sizes] for experts).

    Returns:
        (all parameters, the largest decoder layer's, the output head's ``vocab x hidden``).
    """
    sparse_layers, dense, sparse, mixers, largest = _layer_params(d, d.num_experts)
    head = d.vocab_size * d.hidden_size
    total = mixers + (d.num_hidden_layers - sparse_layers) * dense + sparse_layers * sparse
    total += head * (1 if d.tie_word_embeddings else 2) + d.hidden_size
    return total, largest, head


def active_parameters(d: ModelSizes) -> int:
    """Parameters one token runs through (the experts it is routed to; the embedding row left out), one tp rank.

    Args:
        d: the model's sizes.

    Returns:
        The active parameter count; ``parameter_counts(d)[0] - vocab x hidden`` for a dense model.
    """
    sparse_layers, dense, sparse, mixers, _ = _layer_params(d, d.num_experts_per_tok)
    total = mixers + (d.num_hidden_layers - sparse_layers) * dense + sparse_layers * sparse
    return total + d.vocab_size * d.hidden_size + d.hidden_size
