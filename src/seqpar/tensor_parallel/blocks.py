"""Tensor parallel on the mesh's "tp" axis for transformers decoder blocks, composed with sequence parallel.

Attention heads and the MLP are split over "tp" with torch's ``parallelize_module``; ulysses splits what remains.

Note [tp x sp]
    Each decoder block gets column-wise q/k/v and gate/up projections and row-wise o/down projections
    (Megatron-style), so a tp rank computes attention for ``heads / tp`` query heads and ``kv_heads / tp``
    KV heads of its own sequence shard; seqpar's attention then runs over the SP group that shares the
    rank's tp coordinate, and ulysses (if any) splits those local heads further. Activations between blocks
    are replicated over tp, so every tp rank holds the same tokens: the loss is normalised over the SP
    (x dp) group only and gradients are summed over the same group (``data_parallel_group``), never over tp.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from seqpar.errors import SeqparInputError
from seqpar.mesh import SequenceParallelMesh
from seqpar.models import find_anatomy

_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def _has(module: torch.nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def apply_tensor_parallel(model: torch.nn.Module, mesh: SequenceParallelMesh) -> torch.nn.Module:
    """Split every decoder block of ``model`` over the mesh's "tp" axis (Note [tp x sp]).

    Args:
        model: a transformers model of a family with a tensor-parallel plan (``seqpar.models.Family.tp_plan``:
            Llama, Qwen2/3, Mistral, Gemma, ...), before ``prepare_model`` or after.
        mesh: a mesh from ``seqpar.make_mesh(tp_size=...)``.

    Returns:
        The same model, its block projections now DTensors sharded over "tp".

    Raises:
        SeqparInputError: no "tp" axis, an unknown family or one without a plan, heads or KV heads not
            divisible by tp, or blocks without the plan's projections.
    """
    dm = mesh.device_mesh
    if dm is None or "tp" not in (dm.mesh_dim_names or ()):
        raise SeqparInputError("apply_tensor_parallel needs a mesh from seqpar.make_mesh(tp_size=...)")
    tp_mesh = dm["tp"]
    tp = tp_mesh.size()
    found = find_anatomy(model)
    if isinstance(found, str):
        raise SeqparInputError(f"no decoder blocks found in {type(model).__name__} for tensor parallel: {found}")
    plan = found.family.tp_plan
    if plan is None:
        raise SeqparInputError(
            f"the {found.family.model_type!r} model family has no tensor-parallel plan (seqpar.models.Family.tp_plan: "
            "fused projections or experts are not split)"
        )
    config = getattr(found.decoder, "config", None) or model.config  # a multimodal model's text config
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
    if heads % tp or kv_heads % tp:
        raise SeqparInputError(f"tensor parallel {tp} must divide the heads ({heads}) and KV heads ({kv_heads})")
    for block in found.layers:
        missing = [name for name, _ in plan if not _has(block, name)]
        if missing:
            raise SeqparInputError(f"decoder block lacks {missing} for tensor parallel")
        parallelize_module(block, tp_mesh, {name: _STYLES[style]() for name, style in plan})
    return model
