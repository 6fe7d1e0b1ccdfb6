"""How query and key/value heads split over an all-to-all of a given degree (Note [ulysses heads]).

The input checks, the Ulysses and hybrid all-to-alls, the registry rows and the planner all ask this module.
"""

from __future__ import annotations

__all__ = ["kv_head_repeats", "ulysses_degrees", "ulysses_heads_problem"]


def kv_head_repeats(heads: int, kv_heads: int, degree: int) -> int | None:
    """Copies of each key/value head an all-to-all over ``degree`` ranks needs (Note [ulysses heads]).

    The heads split when the degree divides the query heads and either divides the KV heads (no copies)
    or is a multiple of them (each KV head is copied ``degree // kv_heads`` times, so every rank receives
    the one KV head its query heads read).

    Args:
        heads: query heads.
        kv_heads: key/value heads.
        degree: ranks of the all-to-all.

    Returns:
        1 or ``degree // kv_heads``; None when these heads cannot be split over ``degree`` ranks.
    """
    if degree < 1 or heads % degree:
        return None
    if kv_heads % degree == 0:
        return 1
    if degree % kv_heads == 0:
        return degree // kv_heads
    return None


def ulysses_degrees(heads: int, kv_heads: int) -> list[int]:
    """The all-to-all degrees these heads allow, in increasing order (``kv_head_repeats`` is not None).

    Args:
        heads: query heads.
        kv_heads: key/value heads.

    Returns:
        Every degree from 1 to ``heads`` that splits the heads.
    """
    return [p for p in range(1, heads + 1) if kv_head_repeats(heads, kv_heads, p) is not None]


def ulysses_heads_problem(heads: int, kv_heads: int, degree: int, what: str) -> str | None:
    """Why the heads cannot be split over ``degree`` ranks, as a message for the user, or None.

    Args:
        heads: query heads.
        kv_heads: key/value heads (already known to divide ``heads``).
        degree: ranks of the all-to-all.
        what: the name of the all-to-all in the message ("ulysses", "hybrid's ulysses axis").

    Returns:
        The message (naming the degrees that would work and the alternatives), or None when they split.
    """
    if kv_head_repeats(heads, kv_heads, degree) is not None:
        return None
    valid = ulysses_degrees(heads, kv_heads)
    instead = "(or use strategy 'ring', 'allgather', or 'hybrid' with a smaller ulysses_size)"
    if heads % degree:
        return f"{what} needs query heads ({heads}) divisible by the degree {degree}; valid degrees: {valid} {instead}"
    return (
        f"{what} needs key/value heads ({kv_heads}) divisible by the degree {degree} or dividing it; "
        f"valid degrees: {valid} {instead}"
    )
