"""Mixture-of-experts sizes in the memory estimate and the planner: stored experts vs the ones a token uses.

Real transformers models built from configs (no process groups): their parameter counts are the reference.
"""

from __future__ import annotations

import pytest
import transformers

import seqpar
from seqpar.memory.activations import activation_bytes
from seqpar.models import ModelSizes, active_parameters, parameter_counts
from seqpar.planning.models import load_model_shape

SIZES = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=2000,
    head_dim=32,
)
EXPERTS = dict(num_experts_per_tok=2)

# family -> (config, largest relative miss allowed: the biases, sinks and q/k norms left out of the count)
FAMILIES = {
    "llama": (transformers.LlamaConfig(**SIZES), 0.0),
    "mixtral": (transformers.MixtralConfig(**SIZES, **EXPERTS, num_local_experts=8), 0.0),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig(**SIZES, **EXPERTS, num_experts=8, moe_intermediate_size=128, mlp_only_layers=[0]),
        1e-3,
    ),
    "qwen2_moe": (
        transformers.Qwen2MoeConfig(
            **SIZES, **EXPERTS, num_experts=8, moe_intermediate_size=128, shared_expert_intermediate_size=256
        ),
        1e-3,
    ),
    "gpt_oss": (transformers.GptOssConfig(**SIZES, **EXPERTS, num_local_experts=8), 5e-3),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_stored_parameters_match_the_built_model(family):
    config, miss = FAMILIES[family]
    model = transformers.AutoModelForCausalLM.from_config(config)
    built = sum(p.numel() for p in model.parameters())
    stored, layer, head = parameter_counts(ModelSizes.from_config(config))
    assert abs(stored - built) <= miss * built, (stored, built)
    largest = max(sum(p.numel() for p in block.parameters()) for block in model.model.layers)
    assert abs(layer - largest) <= max(miss, 1e-9) * 4 * largest, (layer, largest)
    assert head == config.vocab_size * config.hidden_size
    # the planner's shape carries the same sizes through its config round trip
    shape = load_model_shape(config.to_dict())
    assert shape.num_params == stored


def test_active_parameters_count_the_routed_experts_only():
    config = FAMILIES["mixtral"][0]
    d = ModelSizes.from_config(config)
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    attention = h * 32 * (2 * 8 + 2 * 4) + 2 * h
    per_layer = attention + 2 * 3 * h * inter + 8 * h  # two experts of eight, and the router
    assert active_parameters(d) == layers * per_layer + config.vocab_size * h + h
    assert d.mlp_width == 2 * inter  # the MLP activations of a token: two experts' widths
    dense = transformers.LlamaConfig(**SIZES)
    assert (
        active_parameters(ModelSizes.from_config(dense))
        == parameter_counts(ModelSizes.from_config(dense))[0] - 2000 * 256
    )
    shape = load_model_shape(config.to_dict())
    assert shape.active_params == active_parameters(d) < shape.num_params
    assert shape.mlp_width == 2 * inter


def test_estimate_counts_stored_weights_and_active_activations():
    """Weights, gradients and AdamW states follow the stored experts; the activations follow the routed ones, plus
    the routed copies of the tokens and the experts' outputs (2 k h a token, Note [mixture-of-experts sizes])."""
    mixtral = FAMILIES["mixtral"][0]
    # the dense model whose MLP is as wide as the two experts a token uses: fewer weights, and activations less
    # the routed copies where the layer's saved tensors exist (a whole layer, or a recomputed one, or a chunk)
    dense = transformers.LlamaConfig(**{**SIZES, "intermediate_size": 2 * SIZES["intermediate_size"]})
    moe_dims, dense_dims = ModelSizes.from_config(mixtral), ModelSizes.from_config(dense)
    routed = 2 * 2 * SIZES["hidden_size"] * 4  # bytes a token: two experts, fp32
    for features, kept, recomputed, extra in (
        ((), 4096 * routed, 0, 0),
        (("checkpointing",), 0, 4096 * routed, 0),
        (("checkpointing", "tiled_mlp"), 0, 0, 1024 * routed),
    ):
        moe = activation_bytes(moe_dims, 4096, 4, features, 1024)
        plain = activation_bytes(dense_dims, 4096, 4, features, 1024)
        assert moe["kept_per_layer"] - plain["kept_per_layer"] == kept
        assert moe["recomputed"] - plain["recomputed"] == recomputed and moe["extra"] - plain["extra"] == extra
    settings = dict(dims=seqpar.ParallelDims(sp_size=2), features=("checkpointing",))
    moe = seqpar.estimate_memory(mixtral, 8192, **settings)
    stored = parameter_counts(moe_dims)[0]
    assert moe.optimizer_state == 2 * 4 * stored  # AdamW's two fp32 moments of every stored expert
    assert moe.optimizer_state > 2 * seqpar.estimate_memory(dense, 8192, **settings).optimizer_state
    sharded = seqpar.ParallelDims(dp_shard_size=2, sp_size=2)
    fsdp = seqpar.estimate_memory(mixtral, 8192, sharded, features=("checkpointing",), dp_mode="fsdp")
    assert fsdp.optimizer_state == -(-stored * 4 // 4) * 2  # sharded over the four dp x sp ranks


def test_bad_expert_counts_are_refused():
    config = {**SIZES, "num_local_experts": 4, "num_experts_per_tok": 5}
    with pytest.raises(seqpar.SeqparInputError, match="num_experts_per_tok"):
        ModelSizes.from_config(config)
