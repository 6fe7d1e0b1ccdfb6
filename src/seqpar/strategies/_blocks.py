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

from seqpar.kernels import AttentionKernel, select_kernel
from seqpar.kernels.merge import merge_into
from seqpar.strategies.masking import SequenceMask

__all__ = ["MASK_TILE", "Block", "blocks_backward", "blocks_forward", "is_whole", "plan", "plan_blocks"]

MASK_TILE = 1024
MIN_WINDOW_TILE = 128


@dataclass(frozen=True)
class Block:
    """One kernel call: query token range ``q``, key token range ``kv``, and whether it is a causal square.

    ``mask`` (``[B, 1, len(q), len(kv)]`` bool, True = visible) is set for mixed tiles (Note [masked tiles]).
    """

    q: slice
    kv: slice
    causal: bool
    mask: torch.Tensor | None = None


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


def plan(
    q_chunks: Sequence[int],
    kv_chunks: Sequence[int],
    chunk_len: int,
    causal: bool,
    mask: SequenceMask | None,
    device: torch.device | None = None,
) -> list[Block]:
    """``plan_blocks``, or with a non-trivial ``mask`` the tiles of Note [masked tiles] (masks on ``device``).

    Masked plans are kept on the mask, so the layers of one forward share them.
    """
    if mask is None or mask.trivial:
        return plan_blocks(q_chunks, kv_chunks, chunk_len, causal)
    key = (tuple(q_chunks), tuple(kv_chunks), chunk_len, causal, str(device))
    if key not in mask.plans:
        mask.plans[key] = _masked_plan(q_chunks, kv_chunks, chunk_len, causal, mask, device)
    return mask.plans[key]


def _masked_plan(
    q_chunks: Sequence[int],
    kv_chunks: Sequence[int],
    chunk_len: int,
    causal: bool,
    mask: SequenceMask,
    device: torch.device | None,
) -> list[Block]:
    tile = min(chunk_len, MASK_TILE)
    if mask.window is not None:  # tiles of half a window: the band's masked edge wastes less compute
        tile = min(tile, max(MIN_WINDOW_TILE, mask.window // 2))
    blocks = []
    for i, g in enumerate(q_chunks):
        for j, c in enumerate(kv_chunks):
            if causal and c > g:
                continue
            for q0 in range(0, chunk_len, tile):
                for k0 in range(0, chunk_len, tile):
                    q_glob = (g * chunk_len + q0, g * chunk_len + min(q0 + tile, chunk_len))
                    kv_glob = (c * chunk_len + k0, c * chunk_len + min(k0 + tile, chunk_len))
                    kind = _classify(q_glob, kv_glob, causal, mask)
                    if kind == "skip":
                        continue
                    q_loc = slice(i * chunk_len + q0, i * chunk_len + q0 + q_glob[1] - q_glob[0])
                    kv_loc = slice(j * chunk_len + k0, j * chunk_len + k0 + kv_glob[1] - kv_glob[0])
                    keep = _dense_mask(q_glob, kv_glob, causal, mask, device) if kind == "mixed" else None
                    blocks.append(Block(q_loc, kv_loc, kind == "causal", keep))
    return blocks


def _classify(q: tuple[int, int], kv: tuple[int, int], causal: bool, mask: SequenceMask) -> str:
    """ "skip", "full", "causal" (a plain causal square) or "mixed", from the tile's corners.

    Every reason to skip is checked before any reason to mask, so a tile that is both on a window's edge
    and across documents is skipped, not computed under an all-False mask.
    """
    q_lo, q_hi = q[0], q[1] - 1
    kv_lo, kv_hi = kv[0], kv[1] - 1
    docs = None
    if mask.starts is not None:
        q_first, q_last = mask.starts[:, q_lo], mask.starts[:, q_hi]
        kv_first, kv_last = mask.starts[:, kv_lo], mask.starts[:, kv_hi]
        docs = (q_first, q_last, kv_first, kv_last)
    if causal and kv_lo > q_hi:
        return "skip"
    if mask.window is not None and q_lo - kv_hi >= mask.window:
        return "skip"
    if docs is not None and bool(((docs[3] < docs[0]) | (docs[2] > docs[1])).all()):
        return "skip"  # document starts never decrease: disjoint ranges share no document
    square = causal and q == kv
    if causal and kv_hi > q_lo and not square:
        return "mixed"
    if mask.window is not None and q_hi - kv_lo >= mask.window:
        return "mixed"
    if docs is not None and not bool(((docs[0] == docs[1]) & (docs[2] == docs[3]) & (docs[0] == docs[2])).all()):
        return "mixed"
    return "causal" if square else "full"


def _dense_mask(
    q: tuple[int, int], kv: tuple[int, int], causal: bool, mask: SequenceMask, device: torch.device | None
) -> torch.Tensor:
    """``[B or 1, 1, q, kv]`` bool visibility of one tile."""
    qi = torch.arange(*q)[:, None]
    ki = torch.arange(*kv)[None, :]
    keep = torch.ones(len(range(*q)), len(range(*kv)), dtype=torch.bool)
    if causal:
        keep &= ki <= qi
    if mask.window is not None:
        keep &= qi - ki < mask.window
    keep = keep[None, None]
    if mask.starts is not None:
        same = mask.starts[:, q[0] : q[1], None] == mask.starts[:, None, kv[0] : kv[1]]  # [B, q, kv]
        keep = keep & same[:, None]
    return keep if device is None else keep.to(device)


def is_whole(blocks: Sequence[Block], q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether ``blocks`` is one unmasked call over all local queries and keys (no accumulation needed)."""
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
        o, l = _kernel_for(b, kernel, q, k).forward(
            q[:, :, b.q], k[:, :, b.kv], v[:, :, b.kv], causal=b.causal, scale=scale, mask=b.mask
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
) -> None:
    """Backward of ``blocks`` with the final ``out``/``lse``; adds into float32 ``dq``, ``dk``, ``dv`` in place.

    Each block's gradients are added as soon as the kernel returns them, so at most one block's
    temporaries are alive at a time; with ``split``, full (non-causal) blocks are further cut into
    ``split x split`` tiles to keep those temporaries small (gradients of tiles add up exactly, since every
    tile uses the final ``out`` and ``lse``).
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
        )
        dq[:, :, b.q] += dq_b
        del dq_b
        dk[:, :, b.kv] += dk_b
        del dk_b
        dv[:, :, b.kv] += dv_b
