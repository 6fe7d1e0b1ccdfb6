"""Exact merging of partial attention results through their log-sum-exp (Note [LSE merge]).

Used by the blockwise kernels and by every strategy that sees the keys in pieces.

Note [LSE merge]
    A partial result over key set A is (o_A, l_A) with l_A = log sum_{j in A} exp(s_j) and o_A the softmax
    average of v over A. Over A and B together: l = logaddexp(l_A, l_B) and
    o = exp(l_A - l) * o_A + exp(l_B - l) * o_B (Milakov & Gimelshein 2018; Rabe & Staats 2021).
    The running (o, l) stay in float32 and are cast to the input dtype once, at the end. A row that has
    seen no key has l = -inf and o = 0; with l = -inf on both sides the weights are computed against 0
    instead of -inf, so they come out 0 rather than NaN.
"""

from __future__ import annotations

import torch


def new_accumulator(like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty running result for queries shaped like ``like`` ``[B, H, S, D]``: zeros and ``-inf`` (float32)."""
    out = torch.zeros(like.shape, dtype=torch.float32, device=like.device)
    lse = torch.full(like.shape[:-1], float("-inf"), dtype=torch.float32, device=like.device)
    return out, lse


def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merge one block's ``(block_out, block_lse)`` into the running float32 ``(out, lse)``, in place.

    Args:
        out: running output ``[..., S, D]`` (float32; may be a view into a larger accumulator).
        lse: running log-sum-exp ``[..., S]`` (float32).
        block_out: the block's output, any float dtype, same shape as ``out``.
        block_lse: the block's log-sum-exp, same shape as ``lse``.
    """
    new = torch.logaddexp(lse, block_lse)
    ref = new.masked_fill(new == float("-inf"), 0.0)
    out.mul_(torch.exp(lse - ref).unsqueeze(-1))
    out.addcmul_(block_out, torch.exp(block_lse - ref).unsqueeze(-1))
    lse.copy_(new)
