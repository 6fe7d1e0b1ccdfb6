"""Ulysses attention: all-to-all to whole sequences of a subset of heads, local attention, all-to-all back.

Communication per rank per layer is about 4·N·h/P elements (Jacobs et al., DeepSpeed-Ulysses, 2023).

Note [ulysses heads]
    Query heads must divide by the degree P. Rank p gets query heads p*H/P .. (p+1)*H/P-1, which read
    key/value heads p*Hkv/P .. when Hkv % P == 0. With fewer KV heads than P (and P % Hkv == 0), each KV head
    is repeated P/Hkv times before the exchange so that rank p gets exactly the one KV head its query heads
    read; autograd sums the repeated gradients back. The layout only changes the chunk order of the
    exchange, so the local attention always sees the sequence in global order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from seqpar.comm import head_to_seq_shards, seq_to_head_shards
from seqpar.kernels import AttentionKernel
from seqpar.layout import natural_order_index, owner_order_index
from seqpar.masking import SequenceMask
from seqpar.strategies.local import local_attention

__all__ = ["ulysses_attention"]


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    layout: str,
    causal: bool,
    scale: float,
    kernel: AttentionKernel,
    mask: SequenceMask | None = None,
) -> torch.Tensor:
    """Ulysses attention over ``group`` (Note [ulysses heads]); inputs already validated.

    Args:
        q: ``[B, H, S/P, D]``; k, v: ``[B, Hkv, S/P, D]``, sharded with ``layout``.
        group: the all-to-all group (size P).
        layout, causal, scale: as in ``seqpar.attention``.
        kernel: the local kernel.
        mask: packed documents and sliding window (Note [masked tiles]), or None.

    Returns:
        ``[B, H, S/P, D]`` local output.
    """
    size = dist.get_world_size(group)
    kv_heads = k.shape[1]
    if kv_heads % size:
        k = k.repeat_interleave(size // kv_heads, dim=1)
        v = v.repeat_interleave(size // kv_heads, dim=1)
    to_natural = natural_order_index(layout, size, q.device)
    to_owner = owner_order_index(layout, size, q.device)
    qh, kh, vh = (seq_to_head_shards(t, group, to_natural, to_owner) for t in (q, k, v))  # [B, H/P, S, D]
    out = local_attention(qh, kh, vh, causal=causal, scale=scale, kernel=kernel, mask=mask)
    return head_to_seq_shards(out, group, to_natural, to_owner)
