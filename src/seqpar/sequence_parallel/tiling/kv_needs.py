"""Which of a peer's key/value tokens some local query can see: the table behind mask-aware communication.

Note [mask-aware ring]
    Under a mask beyond plain causal (documents, a window, blocks), most of a peer's K/V is often seen by
    no local query: with 16 packed documents at P = 4 a rank needs the keys of the few documents its
    queries lie in, with a window of S/8 only the S/8 keys before its chunks. Every rank holds the same
    mask (Note [documents from position ids]; windows and block ranges are plain numbers), so every rank
    computes the same table ``needs[r][s]``: the local token indices of rank s's K/V that some query of
    rank r sees. Senders and receivers thus agree on every message's size without asking each other.
    The set of queries that may see key k is one interval ``[lo(k), hi(k)]`` of global indices (per batch
    row): its document, intersected with ``q >= k`` (causal), ``q >= bs(k)`` (block-causal, Note
    [block-causal ranges]) and ``q <= k + window - 1``. With a prefix count of rank r's queries over the
    sequence, "some query of r in ``[lo, hi]``" is one subtraction per key, so the table costs O(S·P).
    Rows of a batch share their K/V messages, so a key is sent when any row needs it.
    The receiver puts the tokens it gets into a zero-filled block of the sender's full shape and runs the
    unchanged tile plan (Note [masked tiles]) on it: a token not sent is seen by no local query, so it
    lies only in skipped tiles or under False entries of masked tiles (its zeros give weight 0 and
    contribute nothing, where uninitialised memory could give 0 * NaN), and its dK/dV are exactly 0. The
    backward returns the dK/dV rows of the received tokens only, and the owner adds them to its own.
    The table is kept on the mask (``SequenceMask.plans``), so the layers of one step share it; when it
    saves nothing (every rank needs everything) the strategies run their plain collectives instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from seqpar.sequence_parallel.masks.sequence_mask import SequenceMask

KVNeeds = tuple[tuple[torch.Tensor, ...], ...]
"""``needs[r][s]``: int64 local token indices of rank s's K/V that rank r's queries see (``needs[r][r]`` all)."""


def global_tokens(chunk_ids: Sequence[int], chunk_len: int) -> torch.Tensor:
    """``[len(chunk_ids) * chunk_len]`` global index of each local token of a rank holding ``chunk_ids``."""
    ids = torch.tensor(list(chunk_ids), dtype=torch.long)
    return (ids[:, None] * chunk_len + torch.arange(chunk_len)[None]).flatten()


def _query_bounds(mask: SequenceMask, causal: bool, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B or 1, S]`` first and last global query that may see each key (Note [mask-aware ring])."""
    key = torch.arange(seq_len)[None]  # [1, S]
    lo, hi = torch.zeros_like(key), torch.full_like(key, seq_len - 1)
    if mask.starts is not None:  # the key's document: [start, next start - 1]
        ends = torch.searchsorted(mask.starts.contiguous(), mask.starts.contiguous(), right=True)  # [B, S]
        lo, hi = torch.maximum(lo, mask.starts), torch.minimum(hi, ends - 1)
    if mask.blocks is not None:
        lo = torch.maximum(lo, mask.blocks.starts(key[0]))  # [S], or [B, S] when the rows' blocks differ
    elif causal:
        lo = torch.maximum(lo, key)
    if mask.window is not None:
        hi = torch.minimum(hi, key + mask.window - 1)
    return lo, hi


def kv_needs(
    mask: SequenceMask | None, chunk_ids: Sequence[Sequence[int]], chunk_len: int, causal: bool
) -> KVNeeds | None:
    """The table of Note [mask-aware ring], or None when there is no mask or it spares no token.

    Args:
        mask: the sequence mask (the same on every rank).
        chunk_ids: every rank's global chunk ids, in rank order and local order.
        chunk_len: tokens per chunk.
        causal: the token-level causal rule (False under blocks, which carry their own rule).

    Returns:
        ``needs[r][s]`` (int64 local indices into rank s's tokens, sorted), shared through ``mask.plans``.
    """
    if mask is None or mask.trivial:
        return None
    cache = ("kv_needs", tuple(tuple(ids) for ids in chunk_ids), chunk_len, causal)
    if cache not in mask.plans:
        mask.plans[cache] = _table(mask, chunk_ids, chunk_len, causal)
    return mask.plans[cache]


def _table(mask: SequenceMask, chunk_ids: Sequence[Sequence[int]], chunk_len: int, causal: bool) -> KVNeeds | None:
    size = len(chunk_ids)
    seq_len = chunk_len * sum(len(ids) for ids in chunk_ids)
    lo, hi = _query_bounds(mask, causal, seq_len)
    tokens = [global_tokens(ids, chunk_len) for ids in chunk_ids]
    needs, spared = [], False
    for r in range(size):
        member = torch.zeros(seq_len + 1, dtype=torch.long)
        member[tokens[r] + 1] = 1
        before = member.cumsum(0)  # before[i]: queries of rank r at global indices < i
        seen = ((before[hi + 1] - before[lo] > 0) & (lo <= hi)).any(0)  # [S]: some query of r sees the key
        row = []
        for s in range(size):
            local = seen[tokens[s]].nonzero().flatten() if s != r else torch.arange(len(tokens[s]))
            spared |= len(local) < len(tokens[s])
            row.append(local)
        needs.append(tuple(row))
    return tuple(needs) if spared else None


def take_tokens(k: torch.Tensor, v: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[2, B, Hkv, n, D]``: the tokens ``index`` (local, int64) of ``k`` and ``v`` ``[B, Hkv, S, D]``, stacked."""
    index = index.to(k.device)
    return torch.stack([k.index_select(2, index), v.index_select(2, index)])


def zero_block_with(tokens: torch.Tensor, index: torch.Tensor, like: torch.Tensor, length: int) -> torch.Tensor:
    """``[2, B, Hkv, length, D]`` zeros with ``tokens`` ``[2, B, Hkv, n, D]`` at ``index`` (Note [mask-aware ring])."""
    two, b, h, _, d = tokens.shape
    block = torch.zeros((two, b, h, length, d), dtype=like.dtype, device=like.device)
    return block.index_copy_(3, index.to(like.device), tokens)
