"""Which (query rows, key columns) rectangles a rank computes, and running a kernel over them.

Every strategy reduces to this: local query chunks against a key/value piece whose chunk ids are known.

Note [block plan]
    The global sequence is cut into equal chunks with global ids (``seqpar.layout``). Under a causal mask,
    query chunk g sees key chunk j fully when j < g, causally when j == g, and not at all when j > g.
    When the query and key chunks are the same strictly increasing list, one causal call over the whole
    square is exact (an earlier local chunk is also earlier globally). Otherwise each query chunk gets its
    fully visible key chunks (grouped into contiguous runs) and its diagonal; neighbouring query chunks with
    the same runs share one call. Invisible rectangles are never computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from seqpar.kernels import AttentionKernel
from seqpar.merge import merge_into

__all__ = ["Block", "blocks_backward", "blocks_forward", "plan_blocks"]


@dataclass(frozen=True)
class Block:
    """One kernel call: query token range ``q``, key token range ``kv``, and whether it is a causal square."""

    q: slice
    kv: slice
    causal: bool


def _runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous runs of sorted local indices as half-open ``(start, stop)``."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def plan_blocks(q_chunks: Sequence[int], kv_chunks: Sequence[int], chunk_len: int, causal: bool) -> list[Block]:
    """Kernel calls that cover exactly the visible part of ``q_chunks x kv_chunks`` (Note [block plan]).

    Args:
        q_chunks: global chunk ids of the local queries, in local order.
        kv_chunks: global chunk ids of the keys/values in hand, in their local order.
        chunk_len: tokens per chunk (the same for all chunks).
        causal: whether a causal mask applies.
    """
    q_all = slice(0, len(q_chunks) * chunk_len)
    kv_all = slice(0, len(kv_chunks) * chunk_len)
    if not causal:
        return [Block(q_all, kv_all, False)]
    if list(q_chunks) == list(kv_chunks) and all(a < b for a, b in zip(q_chunks, q_chunks[1:])):
        return [Block(q_all, kv_all, True)]

    def tokens(start: int, stop: int) -> slice:
        return slice(start * chunk_len, stop * chunk_len)

    full: list[tuple[tuple[int, int], list[tuple[int, int]]]] = []  # (q run, kv runs)
    diagonal: list[Block] = []
    for i, g in enumerate(q_chunks):
        visible = _runs([j for j, c in enumerate(kv_chunks) if c < g])
        if visible:
            if full and full[-1][1] == visible and full[-1][0][1] == i:
                full[-1] = ((full[-1][0][0], i + 1), visible)
            else:
                full.append(((i, i + 1), visible))
        diagonal += [Block(tokens(i, i + 1), tokens(j, j + 1), True) for j, c in enumerate(kv_chunks) if c == g]
    blocks = [Block(tokens(*q_run), tokens(*kv_run), False) for q_run, kv_runs in full for kv_run in kv_runs]
    return blocks + diagonal


def blocks_forward(
    kernel: AttentionKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: Sequence[Block],
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Run ``blocks`` and merge each result into the float32 running ``(out, lse)`` in place."""
    for b in blocks:
        o, l = kernel.forward(q[:, :, b.q], k[:, :, b.kv], v[:, :, b.kv], causal=b.causal, scale=scale)
        merge_into(out[:, :, b.q], lse[:, :, b.q], o, l)


def _tiles(blocks: Sequence[Block], split: int | None) -> list[Block]:
    if split is None:
        return list(blocks)
    tiles = []
    for b in blocks:
        if b.causal:
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
) -> None:
    """Backward of ``blocks`` with the final ``out``/``lse``; adds into float32 ``dq``, ``dk``, ``dv`` in place.

    Each block's gradients are added as soon as the kernel returns them, so at most one block's
    temporaries are alive at a time; with ``split``, full (non-causal) blocks are further cut into
    ``split x split`` tiles to keep those temporaries small (gradients of tiles add up exactly, since every
    tile uses the final ``out`` and ``lse``).
    """
    for b in _tiles(blocks, split):
        dq_b, dk_b, dv_b = kernel.backward(
            dout[:, :, b.q],
            q[:, :, b.q],
            k[:, :, b.kv],
            v[:, :, b.kv],
            out[:, :, b.q],
            lse[:, :, b.q],
            causal=b.causal,
            scale=scale,
        )
        dq[:, :, b.q] += dq_b
        del dq_b
        dk[:, :, b.kv] += dk_b
        del dk_b
        dv[:, :, b.kv] += dv_b
