"""Running a block plan: each block through a kernel, merged by log-sum-exp forward, gradients added backward.

Every strategy hands its plans (``seqpar.sequence_parallel.tiling.planner``) to these two loops.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from seqpar.sequence_parallel.kernels import AttentionKernel, select_kernel
from seqpar.sequence_parallel.kernels.alibi import AlibiBias
from seqpar.sequence_parallel.kernels.merge import merge_into
from seqpar.sequence_parallel.tiling.planner import Block


def is_whole(blocks: Sequence[Block], q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether ``blocks`` is one unmasked call over all local queries and keys (no accumulation needed).

    Args:
        blocks: a plan.
        q: the local queries ``[B, H, Sq, D]``; k: the keys in hand ``[B, Hkv, Sk, D]``.

    Returns:
        True when the kernel's own ``(out, lse)`` for the whole of ``q`` and ``k`` is the result.
    """
    return (
        len(blocks) == 1
        and blocks[0].mask is None
        and (blocks[0].q.start, blocks[0].q.stop) == (0, q.shape[2])
        and (blocks[0].kv.start, blocks[0].kv.stop) == (0, k.shape[2])
    )


def _kernel_for(block: Block, kernel: AttentionKernel, q: torch.Tensor, k: torch.Tensor) -> AttentionKernel:
    """``kernel``, unless the block is masked and it takes no masks: then the preferred kernel that does."""
    if block.mask is None or kernel.takes_masks:
        return kernel
    return select_kernel(q, k, k, mask=block.mask)


def _bias(alibi: AlibiBias | None, block: Block) -> dict:
    """The kernel keyword of ``block``'s ALiBi bias (Note [ALiBi]): none without one, so kernels without it run."""
    return {} if alibi is None else {"alibi": alibi.block(block.q, block.kv)}


def blocks_forward(
    kernel: AttentionKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: Sequence[Block],
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    alibi: AlibiBias | None = None,
) -> None:
    """Run ``blocks`` and merge each result into the float32 running ``(out, lse)`` in place.

    Args:
        kernel: the chosen kernel (masked blocks go to one that takes masks when it does not).
        q: ``[B, H, Sq, D]``; k, v: ``[B, Hkv, Sk, D]``, in the local coordinates of ``blocks``.
        blocks: the plan.
        scale: softmax scale.
        out: running output ``[B, H, Sq, D]`` float32, updated in place.
        lse: running log-sum-exp ``[B, H, Sq]`` float32, updated in place.
        alibi: the ALiBi bias of ``q``'s rows and ``k``'s columns (Note [ALiBi]), or None; the kernel takes it.
    """
    for b in blocks:
        o, l = _kernel_for(b, kernel, q, k).forward(
            q[:, :, b.q], k[:, :, b.kv], v[:, :, b.kv], causal=b.causal, scale=scale, mask=b.mask, **_bias(alibi, b)
        )
        merge_into(out[:, :, b.q], lse[:, :, b.q], o, l)


def _tiles(blocks: Sequence[Block], split: int | None) -> list[Block]:
    if split is None:
        return list(blocks)
    tiles = []
    for b in blocks:
        if b.causal or b.mask is not None:
            tiles.append(b)
            continue
        for q0 in range(b.q.start, b.q.stop, split):
            for k0 in range(b.kv.start, b.kv.stop, split):
                tiles.append(Block(slice(q0, min(q0 + split, b.q.stop)), slice(k0, min(k0 + split, b.kv.stop)), False))
    return tiles


def blocks_backward(
    kernel: AttentionKernel,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    blocks: Sequence[Block],
    scale: float,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    split: int | None = None,
    alibi: AlibiBias | None = None,
) -> None:
    """Backward of ``blocks`` with the final ``out``/``lse``; adds into float32 ``dq``, ``dk``, ``dv`` in place.

    Each block's gradients are added as soon as the kernel returns them, so at most one block's
    temporaries are alive at a time; with ``split``, full (non-causal) blocks are further cut into
    ``split x split`` tiles to keep those temporaries small (gradients of tiles add up exactly, since every
    tile uses the final ``out`` and ``lse``).

    Args:
        kernel: the chosen kernel (masked blocks go to one that takes masks when it does not).
        dout: gradient of the output ``[B, H, Sq, D]``.
        q, k, v: as for ``blocks_forward``.
        out, lse: the final (fully merged) output and log-sum-exp of these queries.
        blocks: the plan the forward ran.
        scale: softmax scale.
        dq, dk, dv: float32 gradients shaped like ``q``, ``k``, ``v``, added to in place.
        split: tile size for full blocks, or None to run every block whole.
        alibi: as for ``blocks_forward``.
    """
    for b in _tiles(blocks, split):
        dq_b, dk_b, dv_b = _kernel_for(b, kernel, q, k).backward(
            dout[:, :, b.q],
            q[:, :, b.q],
            k[:, :, b.kv],
            v[:, :, b.kv],
            out[:, :, b.q],
            lse[:, :, b.q],
            causal=b.causal,
            scale=scale,
            mask=b.mask,
            **_bias(alibi, b),
        )
        dq[:, :, b.q] += dq_b
        del dq_b
        dk[:, :, b.kv] += dk_b
        del dk_b
        dv[:, :, b.kv] += dv_b
