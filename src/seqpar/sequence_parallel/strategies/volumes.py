"""Bytes each strategy sends per rank and layer in one forward + backward, from the algorithm's own arithmetic.

The registry rows carry these models; ``select_strategy`` compares them, ``benchmarks/strategies.py`` checks them.

Note [strategy bytes]
    One batch row, one layer, forward + backward, the unmasked algorithm, without the input check's
    signature exchange (``python -m benchmarks.strategies`` adds it). ``n`` is the tokens per rank (S/P), ``e`` the
    bytes per element of q, k, v; accumulated gradients that travel go in float32 (4 bytes).
    - ulysses over P ranks: (P-1)/P of q, k, v, out forward and of dout, dq, dk, dv backward leave each
      rank, with the KV heads copied up to P when there are fewer (Note [ulysses heads]); in head groups
      (more than one KV head per rank after the exchange) q, k, v and out go once more backward. An uneven
      split (Note [uneven heads]) counts the busiest rank: ``HeadSplit.sent_heads`` per tensor, which is
      (P-1)/P (H + Hkv') when even, more when a rank holds ceil(H/P) heads or neighbours share a KV head.
    - ring over R ranks: K and V go R-1 hops forward and again backward; the float32 dK, dV go R hops home.
    - allgather over P ranks: K and V are all-gathered forward and again backward (P-1 chunks each); the
      float32 dK, dV of the whole sequence are reduce-scattered, which gloo runs as a ring all-reduce
      (2 (P-1)/P of the P-fold tensor).
    - hybrid, U x R: the all-to-all of ulysses over U ranks (no head groups), then the ring over R ranks on
      the head-sharded tensors (each rank holds as many K/V elements as before the exchange; under an uneven
      split the busiest rank's KV heads, copied up to its query heads where they fall unevenly).
"""

from __future__ import annotations

from seqpar.sequence_parallel.strategies.heads import HeadSplit, head_split

GRAD_BYTES = 4
"""Bytes per element of the dK/dV partials that travel (float32, Note [mask-aware ring schedule])."""


def _split(heads: int, kv_heads: int, degree: int) -> HeadSplit:
    """The head split of an all-to-all over ``degree`` ranks (Note [uneven heads])."""
    split = head_split(heads, kv_heads, degree)
    if split is None:
        raise ValueError(f"{heads}/{kv_heads} heads do not split over {degree} ranks")
    return split


def ulysses_bytes(heads: int, kv_heads: int, sp_size: int, local_tokens: int, head_dim: int, itemsize: int) -> float:
    """Bytes a rank sends in Ulysses' all-to-alls, one forward + backward, one batch row (Note [strategy bytes]).

    Args:
        heads: query heads.
        kv_heads: key/value heads (dividing ``heads``).
        sp_size: the all-to-all degree P.
        local_tokens: tokens per rank, S/P.
        head_dim: head dimension.
        itemsize: bytes per element of the exchanged tensors.

    Returns:
        The bytes.

    Raises:
        ValueError: fewer query heads than ``sp_size``.
    """
    split = _split(heads, kv_heads, sp_size)
    # head groups (even splits only) exchange q, k, v, out again backward
    tensors = 6 if split.even and split.wire_kv_heads > sp_size else 4
    return tensors * split.sent_heads() * local_tokens * head_dim * itemsize


def ring_bytes(kv_heads: int, ring_size: int, local_tokens: int, head_dim: int, itemsize: int) -> float:
    """Bytes a rank sends in the plain ring, one forward + backward, one batch row (Note [strategy bytes]).

    Args:
        kv_heads: key/value heads each rank holds.
        ring_size: ranks of the ring R.
        local_tokens: tokens per rank.
        head_dim: head dimension.
        itemsize: bytes per element of K and V.

    Returns:
        The bytes.
    """
    token = 2 * kv_heads * head_dim  # K and V of one token
    return token * local_tokens * (2 * (ring_size - 1) * itemsize + ring_size * GRAD_BYTES)


def allgather_bytes(kv_heads: int, sp_size: int, local_tokens: int, head_dim: int, itemsize: int) -> float:
    """Bytes a rank sends in the all-gather strategy on gloo, forward + backward, one batch row (Note [strategy bytes]).

    Args:
        kv_heads: key/value heads.
        sp_size: ranks P.
        local_tokens: tokens per rank.
        head_dim: head dimension.
        itemsize: bytes per element of K and V.

    Returns:
        The bytes.
    """
    local_kv = 2 * kv_heads * local_tokens * head_dim  # K and V elements of one rank
    gathers = 2 * (sp_size - 1) * local_kv * itemsize
    return gathers + 2 * (sp_size - 1) / sp_size * sp_size * local_kv * GRAD_BYTES


def hybrid_bytes(
    heads: int, kv_heads: int, ulysses_size: int, ring_size: int, local_tokens: int, head_dim: int, itemsize: int
) -> float:
    """Bytes a rank sends in hybrid (ulysses over U x ring over R), forward + backward, one batch row.

    Args:
        heads: query heads.
        kv_heads: key/value heads (dividing ``heads``).
        ulysses_size: the all-to-all degree U.
        ring_size: the ring degree R.
        local_tokens: tokens per rank, S/(U R).
        head_dim: head dimension.
        itemsize: bytes per element.

    Returns:
        The bytes (Note [strategy bytes]).

    Raises:
        ValueError: fewer query heads than ``ulysses_size``.
    """
    split = _split(heads, kv_heads, ulysses_size)
    exchange = 4 * split.sent_heads() * local_tokens * head_dim * itemsize
    # the busiest ring rank holds its KV heads for U times the tokens (U x its share of the wire's heads)
    held = ulysses_size * max(split.ring_kv_heads(r) for r in range(ulysses_size))
    return exchange + ring_bytes(held, ring_size, local_tokens, head_dim, itemsize)


def local_bytes(*_sizes: int) -> float:
    """One rank holds the whole sequence: nothing travels.

    Returns:
        0.
    """
    return 0.0
