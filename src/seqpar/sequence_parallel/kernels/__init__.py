"""Local attention kernels (out + log-sum-exp, forward and backward) and the rule that picks one.

``select_kernel`` names its choice through the ``seqpar`` logger and returns the kernel object.
"""

from __future__ import annotations

import logging

import torch

from seqpar.errors import SeqparInputError
from seqpar.sequence_parallel.kernels.base import AttentionKernel
from seqpar.sequence_parallel.kernels.reference import ReferenceKernel
from seqpar.sequence_parallel.kernels.torch_cpu import TorchCPUFlashKernel
from seqpar.sequence_parallel.kernels.torch_cuda import TorchCUDAEfficientKernel, TorchCUDAFlashKernel, TorchCuDNNKernel

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
    softcap: float | None = None,
    alibi: bool = False,
) -> AttentionKernel:
    """The kernel that will run these inputs.

    Args:
        q: a representative query (device, dtype and shape matter).
        k: a representative key.
        v: a representative value.
        kernel: "auto", a kernel name from ``KERNELS``, or an ``AttentionKernel`` instance.
        mask: the boolean mask the kernel must accept, if any.
        softcap: logit soft-capping (Note [logit soft-capping]): only the reference kernel caps scores, so
            "auto" and "reference" give ``ReferenceKernel(softcap=softcap)``.
        alibi: the call adds an ALiBi bias (Note [ALiBi]): only the reference kernel applies it, chosen likewise.

    Returns:
        The chosen kernel; ``kernel.name`` says which.

    Raises:
        SeqparInputError: an unknown name, a named kernel that cannot run these inputs (with the reason), or
            a kernel other than the reference one with ``softcap``.
    """
    if softcap is not None or alibi:
        return _score_kernel(kernel, softcap)
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


def _score_kernel(kernel: str | AttentionKernel, softcap: float | None) -> AttentionKernel:
    """The kernel of attention whose scores are modified (soft-capped, ALiBi-biased): the reference kernel (Note [logit
    soft-capping], Note [ALiBi])."""
    if isinstance(kernel, ReferenceKernel):
        chosen = ReferenceKernel(kernel.block_size, softcap)
    elif kernel in ("auto", ReferenceKernel.name):
        chosen = ReferenceKernel(softcap=softcap)
    else:
        name = kernel.name if isinstance(kernel, AttentionKernel) else str(kernel)
        lacks = f"no logit soft-capping (softcap={softcap})" if softcap is not None else "no ALiBi bias (Note [ALiBi])"
        raise SeqparInputError(
            f"attention kernel {name} has {lacks}; use kernel 'auto' or "
            "'reference' (PyTorch's fused attention ops take no score modification)"
        )
    _log.debug("seqpar attention kernel: %r", chosen)
    return chosen
