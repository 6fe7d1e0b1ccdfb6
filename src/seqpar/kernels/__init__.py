"""Local attention kernels (out + log-sum-exp, forward and backward) and the rule that picks one.

``select_kernel`` names its choice through the ``seqpar`` logger and returns the kernel object.
"""

from __future__ import annotations

import logging

import torch

from seqpar.errors import SeqparInputError
from seqpar.kernels.base import AttentionKernel
from seqpar.kernels.reference import ReferenceKernel
from seqpar.kernels.torch_cpu import TorchCPUFlashKernel
from seqpar.kernels.torch_cuda import TorchCUDAEfficientKernel, TorchCUDAFlashKernel, TorchCuDNNKernel

__all__ = [
    "KERNELS",
    "AttentionKernel",
    "ReferenceKernel",
    "TorchCPUFlashKernel",
    "TorchCUDAEfficientKernel",
    "TorchCUDAFlashKernel",
    "TorchCuDNNKernel",
    "select_kernel",
]

_log = logging.getLogger("seqpar")

# In order of preference for "auto"; the reference kernel runs anywhere and comes last.
KERNELS: tuple[AttentionKernel, ...] = (
    TorchCuDNNKernel(),
    TorchCUDAFlashKernel(),
    TorchCUDAEfficientKernel(),
    TorchCPUFlashKernel(),
    ReferenceKernel(),
)


def select_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kernel: str | AttentionKernel = "auto",
    mask: torch.Tensor | None = None,
) -> AttentionKernel:
    """The kernel that will run these inputs.

    Args:
        q: a representative query (device, dtype and shape matter).
        k: a representative key.
        v: a representative value.
        kernel: "auto", a kernel name from ``KERNELS``, or an ``AttentionKernel`` instance.
        mask: the boolean mask the kernel must accept, if any.

    Returns:
        The chosen kernel; ``kernel.name`` says which.

    Raises:
        SeqparInputError: an unknown name, or a named kernel that cannot run these inputs (with the reason).
    """
    if isinstance(kernel, AttentionKernel):
        candidates: tuple[AttentionKernel, ...] = (kernel,)
    elif kernel == "auto":
        candidates = KERNELS
    else:
        candidates = tuple(c for c in KERNELS if c.name == kernel)
        if not candidates:
            names = ", ".join(["auto", *(c.name for c in KERNELS)])
            raise SeqparInputError(f"unknown attention kernel {kernel!r}; choose one of {names}")
    reasons = []
    for candidate in candidates:
        reason = candidate.unsupported_reason(q, k, v, mask)
        if reason is None:
            _log.debug("seqpar attention kernel: %s", candidate.name)
            return candidate
        reasons.append(f"{candidate.name}: {reason}")
    raise SeqparInputError("no attention kernel can run these inputs (" + "; ".join(reasons) + ")")
