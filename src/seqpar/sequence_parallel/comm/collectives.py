"""All-gather and reduce-scatter of equal pieces along the first dimension, for any backend.

They move bytes only; callers decide what the pieces mean.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# PyTorch 2.13 renamed the tensor-in/tensor-out collectives; older releases only have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where ``group``'s collectives need their tensors: the current GPU under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_first_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0, rank-major (``[P * n, ...]``)."""
    size = dist.get_world_size(group)
    x = x.contiguous()
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    _all_gather(out, x, group=group)
    return out


def reduce_scatter_first_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's ``1/P`` slice of dim 0 (``[n / P, ...]``)."""
    size = dist.get_world_size(group)
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    _reduce_scatter(out, x, group=group)
    return out
