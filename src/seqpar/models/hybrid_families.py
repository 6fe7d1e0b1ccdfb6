"""The hooks of the hybrid families whose configs read otherwise: Nemotron-H, Zamba2, Kimi Linear, LFM2, Qwen4-Exp.

Each family's ``Hybrid`` entry (``families.py``) names its hooks; ``hybrid_sizes.py`` calls them (Note [hybrid sizes]).
"""

from __future__ import annotations

from typing import Any

from seqpar.errors import SeqparInputError
from seqpar.models.hybrid_sizes import SharedBlocks, layer_types, positive
from seqpar.models.mixers import Get

# A ``seqpar.models.sizes.ModelSizes``; named loosely so that this module stays below ``sizes.py``
# in the import order.
ModelSizes = Any

# Config names of state-space mixers that differ from their rows' (Note [hybrid sizes]), per family
SSM_MAMBA2 = (  # Mamba2's own config names
    *(("heads", "num_heads"), ("head_dim", "head_dim"), ("state", "state_size"), ("groups", "n_groups")),
    *(("conv_width", "conv_kernel"), ("chunk", "chunk_size"), ("conv_bias", "use_conv_bias")),
    *(("proj_bias", "use_bias"), ("expand", None)),
)
SSM_MAMBA1 = (  # Mamba's and Falcon-Mamba's
    *(("inner", "intermediate_size"), ("state", "state_size"), ("conv_width", "conv_kernel")),
    *(("dt_rank", "time_step_rank"), ("conv_bias", "use_conv_bias"), ("proj_bias", "use_bias")),
)
NEMOTRON_MAMBA2 = (
    *(("heads", "mamba_num_heads"), ("head_dim", "mamba_head_dim"), ("state", "ssm_state_size")),
    *(("groups", "n_groups"), ("conv_width", "conv_kernel"), ("chunk", "chunk_size")),
    *(("conv_bias", "use_conv_bias"), ("proj_bias", "use_bias"), ("expand", None)),
)
ZAMBA_MAMBA2 = (  # its head width derived from the expansion, its convolution biased, its projections not
    *(("heads", "n_mamba_heads"), ("head_dim", None), ("groups", "mamba_ngroups"), ("chunk", "chunk_size")),
    *(("conv_bias", True), ("proj_bias", False)),
)

HYPER_CONNECTIONS = "hyper-connections (the residual streams a token keeps, their mixing weights and activations)"
"""A part of DeepSeek-V4's, HY-V4's and Qwen4-Exp's layers that seqpar's sizes lack (Note [unsized parts])."""

QWEN4_EXP = dict(
    norm=None,
    layer_norms=(),
    per_token=("attn_hyper_connection", "mlp_hyper_connection"),
    unsized=(
        "experts-only MLPs (no intermediate_size)",
        "the QSA indexer (its projections, the gathered indexer keys and rotary table, the dense S/P x S mask the "
        "attention builds)",
        "the n-gram embedding tables (ple_layer_ids)",
        HYPER_CONNECTIONS,
    ),
)
"""Qwen4-Exp's paths: no norms of its own in a layer or after the layers (each hyper-connection, per token, holds
one), its residual streams mixed into a layer's input and its output injected back by a hyper-connection apiece;
and the parts its sizes lack (Note [unsized parts])."""


def count_layer_types(get: Get) -> int:
    """Nemotron-H's ``num_hidden_layers``: its config derives them from the layer types."""
    return len(layer_types(get))


def nemotron_fields(get: Get, roles: tuple[str, ...]) -> dict:
    """Nemotron-H's fields: one norm a layer, ungated MLPs and experts in layers of their own (Note [hybrid sizes])."""
    if get("moe_latent_size"):
        raise SeqparInputError("nemotron_h with moe_latent_size: seqpar's sizes do not count latent experts")
    fields: dict = dict(layer_norms=1, mlp_gated=False)
    if "moe" in roles:
        fields.update(moe_layers=roles.count("moe"), shared_expert_gate=False)
        fields.update(shared_expert_intermediate_size=get("moe_shared_expert_intermediate_size") or 0)
    return fields


def nemotron_config(d: ModelSizes) -> dict:
    """The config fields that read back to ``nemotron_fields``."""
    return dict(moe_shared_expert_intermediate_size=d.shared_expert_intermediate_size)


def zamba_width(get: Get) -> int:
    """Zamba2's MLP width when a config.json lacks it: its config derives ``4 H``."""
    return 4 * (get("hidden_size") or 0)


def zamba_fields(get: Get, roles: tuple[str, ...]) -> dict:
    """Zamba2's fields: one norm a layer, the shared blocks' attention over twice the hidden width and their MLP,
    their adapters (Note [hybrid sizes])."""
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    read = {"num_mem_blocks": get("num_mem_blocks") or 1, "adapter_rank": get("adapter_rank")}
    read = positive(read.get, tuple(read), "Zamba2")
    shared = SharedBlocks(read["num_mem_blocks"], read["adapter_rank"], bool(get("use_shared_attention_adapter")))
    width = get("intermediate_size") or 4 * hidden
    return dict(shared=shared, head_dim=2 * hidden // heads, layer_norms=1, intermediate_size=width)


def zamba_config(d: ModelSizes) -> dict:
    """The config fields that read back to ``zamba_fields``."""
    shared = d.shared
    return dict(
        num_mem_blocks=shared.count,
        adapter_rank=shared.adapter_rank,
        use_shared_attention_adapter=shared.attention_adapters,
    )


def kimi_fields(get: Get, roles: tuple[str, ...]) -> dict:
    """Kimi Linear's experts: ``mlp_layer_types``' "sparse" layers (or those from ``first_k_dense_replace`` on), each
    with ``n_shared_experts`` ungated shared experts beside them (Note [hybrid sizes])."""
    mlp_types = get("mlp_layer_types")
    if mlp_types is None:  # as KimiLinearConfig derives them
        dense = get("first_k_dense_replace", 1)
        mlp_types = ["dense" if i < dense else "sparse" for i in range(get("num_hidden_layers") or 0)]
    sparse = list(mlp_types).count("sparse")
    if not sparse:
        return dict(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, moe_layers=0)
    shared = (get("n_shared_experts") or get("num_shared_experts") or 0) * (get("moe_intermediate_size") or 0)
    return dict(moe_layers=sparse, shared_expert_intermediate_size=shared, shared_expert_gate=False)


def kimi_config(d: ModelSizes) -> dict:
    """The config fields that read back to ``kimi_fields``."""
    config: dict = dict(mlp_layer_types=["dense"] * (d.num_hidden_layers - d.moe_layers) + ["sparse"] * d.moe_layers)
    if d.num_experts:
        config.update(num_local_experts=d.num_experts, n_shared_experts=d.shared_width // d.expert_width)
    return config


def lfm2_fields(get: Get, roles: tuple[str, ...]) -> dict:
    """LFM2's MLP width as ``Lfm2MLP`` builds it (Note [hybrid sizes])."""
    width = get("intermediate_size")
    if get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        if get("block_ffn_dim_multiplier") is not None:
            multiple = get("block_multiple_of") or 1
            width = multiple * -(-int(get("block_ffn_dim_multiplier") * width) // multiple)
    return dict(intermediate_size=width)


def lfm2_config(d: ModelSizes) -> dict:
    """The config fields that read back to ``lfm2_fields``: the width as it is."""
    return dict(block_auto_adjust_ff_dim=False)
