"""The contract every local attention kernel meets: forward returns (out, lse); backward takes the final ones.

Kernels know nothing about ranks; strategies call them on blocks of queries and keys.
"""

from __future__ import annotations

import abc

import torch


class AttentionKernel(abc.ABC):
    """One local attention implementation.

    Shapes follow SDPA: q ``[B, H, Sq, D]``, k and v ``[B, Hkv, Sk, D]`` with ``H % Hkv == 0`` (grouped-query
    attention: query head ``h`` reads key/value head ``h // (H // Hkv)``). ``causal`` is the top-left aligned
    mask (query i sees keys 0..i) and is only asked for with ``Sq == Sk``.
    """

    name: str = "abstract"
    takes_masks: bool = False
    """Whether ``forward``/``backward`` accept a boolean ``mask`` (``[B or 1, H or 1, Sq, Sk]``, True = attend)."""

    @abc.abstractmethod
    def unsupported_reason(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> str | None:
        """Why this kernel cannot run these inputs here, or None when it can."""

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        scale: float,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of one block.

        Returns:
            ``out`` ``[B, H, Sq, D]`` (any float dtype; strategies upcast before merging) and the float32
            log-sum-exp of the scaled scores ``lse`` ``[B, H, Sq]`` (``-inf`` for a row that sees no key,
            whose ``out`` is 0).
        """

    @abc.abstractmethod
    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        *,
        causal: bool,
        scale: float,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of one block, given the *final* (merged) ``out`` and ``lse`` of these query rows.

        With the final statistics, ``softmax = exp(s - lse)`` is the true global probability and
        ``rowsum(dout * out)`` the true correction term, so block gradients simply add up.

        Returns:
            ``dq`` ``[B, H, Sq, D]``, ``dk`` and ``dv`` ``[B, Hkv, Sk, D]``.
        """

    def __repr__(self) -> str:
        return f"<seqpar kernel {self.name}>"


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean keep-mask as the additive mask fused ops take (0 where kept, -inf elsewhere)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def mark_empty_rows(out: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Give rows that see no key out 0 and lse -inf, the values the merge expects (fused ops differ here)."""
    seen = mask.any(-1).expand(lse.shape)
    return out.masked_fill(~seen[..., None], 0), lse.masked_fill(~seen, float("-inf"))


def unmark_empty_rows(lse: torch.Tensor) -> torch.Tensor:
    """lse for a fused backward: +inf on rows that see no key, so exp(score - lse) is 0 there, not NaN."""
    return lse.masked_fill(lse == float("-inf"), float("inf"))
