"""ALiBi: a per-head linear bias on the distance between a key and its query, applied from global positions.

Note [ALiBi]
    BLOOM and MPT add ``slope_h * (key position - c)`` to every score of head ``h``, with ``c`` constant per
    query row (BLOOM: 0, MPT: the last key's position); softmax does not change under a constant shift of a row,
    so both are ``slope_h * (key - query)``, which seqpar applies: bounded by the sequence (or window), the same
    in every block of a row, so the log-sum-exp merge (Note [LSE merge]) is unchanged. Packed documents restart
    their position ids, and position ids rise by one inside a document (``check_packed_positions``), so the
    difference of two tokens' global indices in one document is the difference of their position ids: a query
    sees only keys of its own document, and the global token index serves for both. The strategy that runs a
    block knows the global token index of each of its query rows and key columns (``AlibiBias.q``, ``.kv``) and
    which heads it holds (``slopes``); the reference kernel adds the bias after the scale (and before a soft-cap),
    as a score modification like the cap (Note [logit soft-capping]). The bias does not depend on q or k, so the
    backward is the ordinary one of the biased scores; the slopes are the model's constants and get no gradient.
    A strategy row says whether it applies the bias (``StrategyRow.key_bias``): Ulysses (each rank's heads over the
    whole sequence), the ring (its steps' key chunks and backward pieces have known global ids) and the all-gather
    do; hybrid does not. One that does not is refused for a call with slopes, and "auto" picks one that does
    (Note [auto strategy]). Under a mask the ring and the all-gather keep their plain schedules (every K/V moves):
    their mask-aware ones (Note [mask-aware ring]) do not carry the bias, so "auto" skips the byte comparison
    that would favour them; the masked tiles still skip what no query sees.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AlibiBias:
    """The slopes of the heads in one kernel call and the global token index of its query rows and key columns."""

    slopes: torch.Tensor
    """``[H]`` float, one slope per query head of the call."""
    q: torch.Tensor
    """``[Sq]`` int64: the global token index of each query row."""
    kv: torch.Tensor
    """``[Sk]`` int64: the global token index of each key column."""

    def block(self, q: slice, kv: slice) -> AlibiBias:
        """The bias of the query rows ``q`` and key columns ``kv`` of this call."""
        return AlibiBias(self.slopes, self.q[q], self.kv[kv])

    def heads(self, start: int, stop: int) -> AlibiBias:
        """The bias of query heads ``start:stop`` alone (the heads a rank attends under an all-to-all)."""
        return AlibiBias(self.slopes[start:stop], self.q, self.kv)

    def scores(self, kv_heads: int, cols: slice) -> torch.Tensor:
        """``[1, Hkv, G, Sq, kb]`` float32: the bias of key columns ``cols``, in the reference kernel's head groups."""
        distance = (self.kv[cols].to(self.slopes.device)[None, :] - self.q.to(self.slopes.device)[:, None]).float()
        bias = self.slopes.float()[:, None, None] * distance  # [H, Sq, kb]
        return bias.reshape(1, kv_heads, bias.shape[0] // kv_heads, *bias.shape[1:])


Chunks = tuple[Sequence[int], int]
"""Global chunk ids in a block's order and the chunk's length in tokens: ``((0,), S)`` is a whole sequence."""


def alibi_bias(slopes: torch.Tensor | None, q: Chunks, kv: Chunks) -> AlibiBias | None:
    """The bias of query rows and key columns given as chunks (``Chunks``), or None without slopes: the global
    token indices are made only for a call that has slopes, never on the plain path."""
    if slopes is None:
        return None
    return AlibiBias(slopes, _positions(*q, slopes.device), _positions(*kv, slopes.device))


def _positions(chunk_ids: Sequence[int], chunk: int, device: torch.device) -> torch.Tensor:
    """The global token indices of the chunks ``chunk_ids`` (in that order) of ``chunk`` tokens each."""
    ids = torch.as_tensor(list(chunk_ids), device=device, dtype=torch.int64)
    return (ids[:, None] * chunk + torch.arange(chunk, device=device)[None, :]).flatten()
