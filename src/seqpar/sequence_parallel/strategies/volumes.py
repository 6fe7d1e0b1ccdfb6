"""Bytes each strategy sends per rank and layer in one forward + backward, from the algorithm's own arithmetic.

The registry rows carry these models; ``select_strategy`` compares them, ``seqpar bench strategies`` checks them.

Note [strategy bytes]
    One batch row, one layer, forward + backward, the unmasked algorithm, without the input check's
    signature exchange (``seqpar bench strategies`` adds it). ``n`` is the tokens per rank (S/P), ``e`` the
    bytes per element of q, k, v; accumulated gradients that travel go in float32 (4 bytes).
    - ulysses over P ranks: (P-1)/P of q, k, v, out forward and of dout, dq, dk, dv backward leave each
      rank, with the KV heads copied up to P when there are fewer (Note [ulysses heads]); in head groups
      (more than one KV head per rank after the exchange) q, k, v and out go once more backward.
    - ring over R ranks: K and V go R-1 hops forward and again backward; the float32 dK, dV go R hops home.
    - allgather over P ranks: K and V are all-gathered forward and again backward (P-1 chunks each); the
      float32 dK, dV of the whole sequence are reduce-scattered, which gloo runs as a ring all-reduce
      (2 (P-1)/P of the P-fold tensor).
    - hybrid, U x R: the all-to-all of ulysses over U ranks (no head groups), then the ring over R ranks on
      the head-sharded tensors (each rank holds as many K/V elements as before the exchange).
"""

from __future__ import annotations

from seqpar.sequence_parallel.strategies.heads import kv_head_repeats

__all__ = ["GRAD_BYTES", "allgather_bytes", "hybrid_bytes", "local_bytes", "ring_bytes", "ulysses_bytes"]

GRAD_BYTES = 4
"""Bytes per element of the dK/dV partials that travel (float32, Note [mask-aware ring schedule])."""


def _copied_kv_heads(heads: int, kv_heads: int, degree: int) -> int:
    """KV heads on the wire of an all-to-all over ``degree`` ranks (copied up when fewer than the degree)."""
    repeats = kv_head_repeats(heads, kv_heads, degree)
    if repeats is None:
        raise ValueError(f"{heads}/{kv_heads} heads do not split over {degree} ranks")
    return kv_heads * repeats


def ulysses_bytes(heads: int, kv_heads: int, sp_size: int, local_tokens: int, head_dim: int, itemsize: int) -> float:
    """Bytes a rank sends in Ulysses' all-to-alls, one forward + backward, one batch row (Note [strategy bytes]).

    Args:
        heads: query heads.
        kv_heads: key/value heads (must split over ``sp_size``: ``kv_head_repeats``).
        sp_size: the all-to-all degree P.
        local_tokens: tokens per rank, S/P.
        head_dim: head dimension.
        itemsize: bytes per element of the exchanged tensors.

    Returns:
        The bytes.

    Raises:
        ValueError: heads that do not split over ``sp_size``.
    """
    copied = _copied_kv_heads(heads, kv_heads, sp_size)
    tensors = 6 if copied > sp_size else 4  # head groups exchange q, k, v, out again backward
    return (sp_size - 1) / sp_size * tensors * (heads + copied) * local_tokens * head_dim * itemsize


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
        kv_heads: key/value heads (must split over ``ulysses_size``).
        ulysses_size: the all-to-all degree U.
        ring_size: the ring degree R.
        local_tokens: tokens per rank, S/(U R).
        head_dim: head dimension.
        itemsize: bytes per element.

    Returns:
        The bytes (Note [strategy bytes]).

    Raises:
        ValueError: heads that do not split over ``ulysses_size``.
    """
    copied = _copied_kv_heads(heads, kv_heads, ulysses_size)
    u = ulysses_size
    exchange = (u - 1) / u * 4 * (heads + copied) * local_tokens * head_dim * itemsize
    return exchange + ring_bytes(copied, ring_size, local_tokens, head_dim, itemsize)


def local_bytes(*_sizes: int) -> float:
    """One rank holds the whole sequence: nothing travels.

    Returns:
        0.
    """
    return 0.0
