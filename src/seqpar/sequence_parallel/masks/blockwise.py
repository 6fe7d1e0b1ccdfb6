"""Arbitrary masks over the global sequence as a block table plus an elementwise rule (FlexAttention's BlockMask).

A ``SequenceMask`` carries one as ``predicate``: its table skips or keeps tiles, its rule masks the others.

Note [blockwise masks]
    A mask that no document, window or block range describes (prefix-LM, chunked attention, any
    ``mask_mod``) is given as FlexAttention gives it: the global ``[q, kv]`` plane cut into blocks of
    ``block = (q tokens, kv tokens)``, each block EMPTY (nothing visible), FULL (everything visible) or
    PARTIAL (the rule decides each pair), and a rule ``evaluate(q0, q1, k0, k1)`` that returns the
    ``[B or 1, q1 - q0, k1 - k0]`` visibility of global queries ``[q0, q1)`` against global keys
    ``[k0, k1)``. The table is the truth where it speaks (as in FlexAttention's kernels: a FULL block is
    computed unmasked, an EMPTY one not at all), the rule inside PARTIAL blocks. A tile of the planner
    (Note [masked tiles]) covers a rectangle of blocks: it is skipped when every covered block is EMPTY in
    every batch row, adds nothing to the other rules when every one is FULL, and is masked otherwise; two
    prefix sums over the table answer that for all tiles at once, so the rule is evaluated only on the
    masked tiles, once per batch (the plans are kept on the mask). The mask is head-independent (one
    table for all heads), so every strategy can split heads (Ulysses) and tiles alike, and combines with
    the causal rule, documents and a window by AND. When nothing above the diagonal is visible
    (``within_causal``) the caller may pass ``causal=True`` as well, so that the chunk-level causal plan
    and the zigzag balance apply; the AND then changes nothing. The mask-aware exchanges (Note [mask-aware
    ring]) do not read the table: they send the keys the other rules let through, which is exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

EMPTY, PARTIAL, FULL_BLOCK = 0, 1, 2
"""Kinds of the blocks of a ``BlockwiseMask``'s table."""


def _prefix(table: torch.Tensor) -> torch.Tensor:
    """``[B, nQ + 1, nK + 1]`` 2-D inclusive prefix sums of a ``[B, nQ, nK]`` boolean table."""
    counts = torch.zeros(table.shape[0], table.shape[1] + 1, table.shape[2] + 1, dtype=torch.long)
    counts[:, 1:, 1:] = table.long().cumsum(1).cumsum(2)
    return counts


@dataclass(frozen=True)
class BlockwiseMask:
    """A head-independent mask over the global sequence: a block table and a rule (Note [blockwise masks])."""

    length: int
    """Tokens in the (square) global sequence."""
    block: tuple[int, int]
    """Tokens per block along the queries and along the keys."""
    kinds: torch.Tensor
    """``[B or 1, nQ, nK]`` int8 on the CPU: ``EMPTY``, ``PARTIAL`` or ``FULL_BLOCK`` of each block."""
    evaluate: Callable[[int, int, int, int], torch.Tensor] = field(compare=False)
    """``(q0, q1, k0, k1) -> [B or 1, q1 - q0, k1 - k0]`` bool visibility of global queries against keys."""
    counts: tuple[torch.Tensor, torch.Tensor] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "counts", (_prefix(self.kinds == EMPTY), _prefix(self.kinds == FULL_BLOCK)))

    def tile_rules(
        self, q_lo: torch.Tensor, q_hi: torch.Tensor, kv_lo: torch.Tensor, kv_hi: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(skip, mixed)``, each ``[Tq, Tk]`` bool, for tiles with inclusive global bounds (``tile_kinds``).

        skip: every block the tile touches is EMPTY in every row; mixed: some block is not FULL in some row.
        """
        bq, bk = self.block
        qa, qb = (q_lo // bq)[:, None], (q_hi // bq + 1)[:, None]  # [Tq, 1] block rows [qa, qb)
        ka, kb = (kv_lo // bk)[None], (kv_hi // bk + 1)[None]  # [1, Tk]
        area = (qb - qa) * (kb - ka)

        def inside(c: torch.Tensor) -> torch.Tensor:  # [B, Tq, Tk] count of marked blocks under each tile
            return c[:, qb, kb] - c[:, qa, kb] - c[:, qb, ka] + c[:, qa, ka]

        empty, full = self.counts
        return (inside(empty) == area).all(0), ~(inside(full) == area).all(0)

    def dense(self, q: tuple[int, int], kv: tuple[int, int]) -> torch.Tensor:
        """``[B or 1, 1, q, kv]`` bool visibility of global queries ``[q0, q1)`` against keys ``[k0, k1)``."""
        bq, bk = self.block
        seen = self.evaluate(q[0], q[1], kv[0], kv[1]).cpu()  # [B or 1, q, kv]
        kind = self.kinds[:, torch.arange(*q) // bq][:, :, torch.arange(*kv) // bk]  # [B or 1, q, kv]
        seen = torch.where(kind == FULL_BLOCK, True, torch.where(kind == EMPTY, False, seen))
        return seen[:, None]

    def within_causal(self) -> bool:
        """True when no key after its query is visible: the blocks above the diagonal are EMPTY, and the
        PARTIAL blocks that the diagonal crosses show nothing above it (evaluated once)."""
        bq, bk = self.block
        n_q, n_k = self.kinds.shape[1:]
        q_last = torch.arange(n_q)[:, None] * bq + bq - 1  # last query of each block row
        k_first = torch.arange(n_k)[None] * bk
        above = k_first > q_last  # [nQ, nK]: the whole block lies above the diagonal
        crossing = (torch.arange(n_k)[None] * bk + bk - 1 > torch.arange(n_q)[:, None] * bq) & ~above
        if (self.kinds[:, above] != EMPTY).any() or (self.kinds[:, crossing] == FULL_BLOCK).any():
            return False
        for a, b in crossing.nonzero().tolist():
            if not (self.kinds[:, a, b] == PARTIAL).any():
                continue
            q = torch.arange(a * bq, min((a + 1) * bq, self.length))
            k = torch.arange(b * bk, min((b + 1) * bk, self.length))
            seen = self.evaluate(int(q[0]), int(q[-1]) + 1, int(k[0]), int(k[-1]) + 1).cpu()
            if (seen & (k[None] > q[:, None])[None]).any():
                return False
        return True


def key_mask(valid: torch.Tensor, block: int | None = None) -> BlockwiseMask:
    """The ``BlockwiseMask`` of a key-padding mask: every query sees exactly the valid keys of its row.

    A key block is FULL when all its keys are valid, EMPTY when none is, PARTIAL otherwise (the same for
    every query block), so tiles over padding are skipped and wholly valid ones run unmasked.

    Args:
        valid: ``[B or 1, S]`` bool over the global sequence (True: the key is seen by every query).
        block: tokens per block along both axes; default ``max(16, ceil(S / 512))`` (tables of at most
            512 x 512 blocks per row).

    Returns:
        The mask over the square ``S x S`` plane.
    """
    valid = valid.detach().bool().cpu()
    rows, length = valid.shape
    block = block or max(16, -(-length // 512))
    n = -(-length // block)
    padded = torch.zeros(rows, n * block, dtype=torch.bool)
    padded[:, :length] = valid
    seen = padded.view(rows, n, block).sum(-1)  # [R, nK] valid keys per block
    width = torch.full((n,), block)
    width[-1] = length - (n - 1) * block  # the last block may be short
    per_block = torch.where(seen == 0, EMPTY, torch.where(seen == width, FULL_BLOCK, PARTIAL))
    kinds = per_block.to(torch.int8)[:, None, :].expand(rows, n, n).contiguous()

    def evaluate(q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        return valid[:, None, k0:k1].expand(rows, q1 - q0, k1 - k0)

    return BlockwiseMask(length, (block, block), kinds, evaluate)
