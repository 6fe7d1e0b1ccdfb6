"""``layout="auto"``: the per-batch layout a batch gets, read from its global position ids (Note [placed layout]).

Every rank holds the same global ids, so every rank resolves the same layout without communicating.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from seqpar.errors import SeqparInputError


def resolve_auto_layout(position_ids: torch.Tensor, *, blocks: int | Sequence[tuple[int, int]] | None = None) -> str:
    """The per-batch layout ``layout="auto"`` stands for on this batch (Note [placed layout]).

    Args:
        position_ids: the *global* position ids ``[B, S]`` or ``[S]`` (restarting at 0 at each packed document).
        blocks: block-causal blocks, as ``seqpar.sequence_mask`` takes them, or None.

    Returns:
        "placed" when the rows are packed documents (the position ids restart inside a row) and no blocks are
        given; else "balanced" (on plain causal rows the same work balance as zigzag).

    Raises:
        SeqparInputError: position ids that are not an integer ``[S]`` or ``[B, S]`` tensor.
    """
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() not in (1, 2):
        raise SeqparInputError(f"position_ids must be a [S] or [B, S] tensor, got {position_ids!r:.80}")
    if position_ids.is_floating_point():
        raise SeqparInputError(f"position_ids must be integers, got {position_ids.dtype}")
    rows = position_ids[None] if position_ids.dim() == 1 else position_ids
    packed = bool((rows[:, 1:] == 0).any())  # a document starts inside a row
    return "placed" if packed and blocks is None else "balanced"
