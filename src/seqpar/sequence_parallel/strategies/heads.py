"""How query and key/value heads split over an all-to-all of a given degree (Notes [ulysses heads], [uneven heads]).

The input checks, the Ulysses and hybrid all-to-alls, the registry rows, the planner and the estimator ask it.

Note [uneven heads]
    When the degree P does not split the heads evenly (``kv_head_repeats`` is None), rank r takes the
    contiguous query heads ``[a_r, b_r)`` with ``b_r - a_r`` = ceil(H/P) for the first ``H % P`` ranks and
    floor(H/P) for the rest, and the KV heads those query heads read: ``[a_r // g, (b_r - 1) // g + 1)``
    with g = H / Hkv query heads per KV head. A range may straddle KV groups (two or more KV heads), and a
    KV head read by the query heads of several neighbouring ranks goes to each of them; the backward sums
    its gradient over them (the exchange's adjoint, Note [uneven all-to-all]). On the wire each rank
    receives its own KV heads only, so no KV head is copied beyond the ranks that read it.
    The local kernels pair query head i with KV head i // (n/m) (n query, m KV heads). A range whose heads
    fall unevenly on its KV heads (28 / 4 heads at P = 8: rank 1 holds query heads 4..7, three of KV head
    0 and one of KV head 1) breaks that, so after the exchange such a rank copies its KV heads up to one per
    query head (``local_kv_index``): the bytes on the wire stay the same, the rank's whole-sequence K/V grow
    to n heads (and in hybrid the ring then carries n heads; ``ring_kv_heads``).
    The price of an uneven split is balance: the slowest rank attends ceil(H/P) heads, ``imbalance`` =
    ceil(H/P) P / H times the mean, and its all-to-all bytes grow likewise (``sent_heads``). Only H < P is
    refused: a rank would hold no head (use ring, or hybrid with a smaller ulysses axis).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadSplit:
    """Which query and key/value heads each rank of an all-to-all holds after it (Note [uneven heads])."""

    heads: int
    """Query heads H."""
    kv_heads: int
    """Key/value heads Hkv (divides H)."""
    degree: int
    """Ranks of the all-to-all P."""
    q_ranges: tuple[tuple[int, int], ...]
    """``(start, stop)`` of every rank's query heads, disjoint and in rank order."""
    kv_ranges: tuple[tuple[int, int], ...]
    """``(start, stop)`` of every rank's KV heads (neighbours may share one)."""

    @property
    def even(self) -> bool:
        """Whether the degree splits the heads evenly (Note [ulysses heads]): the all-heads-alike exchange runs."""
        return kv_head_repeats(self.heads, self.kv_heads, self.degree) is not None

    @property
    def max_heads(self) -> int:
        """Query heads of the busiest rank, ceil(H / P)."""
        return max(b - a for a, b in self.q_ranges)

    @property
    def imbalance(self) -> float:
        """The busiest rank's query heads over the mean, ceil(H / P) P / H (1.0 when even)."""
        return self.max_heads * self.degree / self.heads

    @property
    def wire_kv_heads(self) -> int:
        """KV heads all ranks receive together (Hkv when the KV heads split, more when neighbours share)."""
        return sum(b - a for a, b in self.kv_ranges)

    def local_kv_index(self, rank: int) -> tuple[int, ...] | None:
        """Which of its received KV heads each of ``rank``'s query heads reads, or None when the kernel's GQA does.

        Args:
            rank: the all-to-all rank.

        Returns:
            One received-KV-head index per query head when the query heads fall unevenly on the KV heads
            (the rank then copies its K/V up to them, Note [uneven heads]); None when query head i reads KV
            head i // (n/m), as the kernels pair them.
        """
        (a, b), (ka, kb) = self.q_ranges[rank], self.kv_ranges[rank]
        group = self.heads // self.kv_heads
        index = tuple((a + i) // group - ka for i in range(b - a))
        n, m = b - a, kb - ka
        if n % m == 0 and index == tuple(i // (n // m) for i in range(n)):
            return None
        return index

    def ring_kv_heads(self, rank: int) -> int:
        """KV heads ``rank`` holds for its local attention (and carries around hybrid's ring) after the exchange.

        Args:
            rank: the all-to-all rank.

        Returns:
            Its received KV heads, or its query heads when it copies them up (``local_kv_index``).
        """
        (a, b), (ka, kb) = self.q_ranges[rank], self.kv_ranges[rank]
        return kb - ka if self.local_kv_index(rank) is None else b - a

    def sent_heads(self) -> float:
        """Heads' worth of S/P tokens the busiest rank sends per exchanged tensor pair (q-like and KV-like).

        Rank r sends ``H - n_r`` query heads of its shard into the sequence-to-heads direction and
        ``(P - 1) n_r`` back, and likewise for its m_r KV heads out of the ``wire_kv_heads`` M; averaged over
        the two directions (each tensor of Ulysses' forward + backward has a partner going the other way,
        Note [strategy bytes]) that is ``(H + (P - 2) n_r + M + (P - 2) m_r) / 2``; (P - 1)/P (H + M) when even.

        Returns:
            The largest over the ranks.
        """
        p, h, m = self.degree, self.heads, self.wire_kv_heads
        return max(
            (h + (p - 2) * (b - a) + m + (p - 2) * (kb - ka)) / 2
            for (a, b), (ka, kb) in zip(self.q_ranges, self.kv_ranges, strict=True)
        )


def head_split(heads: int, kv_heads: int, degree: int) -> HeadSplit | None:
    """The contiguous ceil/floor split of the heads over ``degree`` ranks (Note [uneven heads]).

    When ``kv_head_repeats`` allows an even split, the ranges are those of Note [ulysses heads] (KV heads
    fewer than the degree show up as shared ranges, each rank receiving the one its query heads read).

    Args:
        heads: query heads.
        kv_heads: key/value heads (dividing ``heads``).
        degree: ranks of the all-to-all.

    Returns:
        The split; None when ``degree`` is not in 1..``heads`` or the KV heads do not divide the query heads.
    """
    if not 1 <= degree <= heads or kv_heads < 1 or heads % kv_heads:
        return None
    base, extra = divmod(heads, degree)
    group = heads // kv_heads
    q_ranges, kv_ranges, start = [], [], 0
    for r in range(degree):
        stop = start + base + (r < extra)
        q_ranges.append((start, stop))
        kv_ranges.append((start // group, (stop - 1) // group + 1))
        start = stop
    return HeadSplit(heads, kv_heads, degree, tuple(q_ranges), tuple(kv_ranges))


def kv_head_repeats(heads: int, kv_heads: int, degree: int) -> int | None:
    """Copies of each key/value head the even all-to-all over ``degree`` ranks needs (Note [ulysses heads]).

    The heads split evenly when the degree divides the query heads and either divides the KV heads (no
    copies) or is a multiple of them (each KV head is copied ``degree // kv_heads`` times, so every rank
    receives the one KV head its query heads read). Other degrees take the uneven split (``head_split``).

    Args:
        heads: query heads.
        kv_heads: key/value heads.
        degree: ranks of the all-to-all.

    Returns:
        1 or ``degree // kv_heads``; None when these heads do not split evenly over ``degree`` ranks.
    """
    if degree < 1 or heads % degree:
        return None
    if kv_heads % degree == 0:
        return 1
    if degree % kv_heads == 0:
        return degree // kv_heads
    return None


def ulysses_degrees(heads: int, kv_heads: int, *, even: bool = False) -> list[int]:
    """The all-to-all degrees these heads allow, in increasing order.

    Args:
        heads: query heads.
        kv_heads: key/value heads.
        even: only the degrees that split the heads evenly (``kv_head_repeats`` is not None).

    Returns:
        Every degree from 1 to ``heads`` (Note [uneven heads]), or the even ones.
    """
    if even:
        return [p for p in range(1, heads + 1) if kv_head_repeats(heads, kv_heads, p) is not None]
    return list(range(1, heads + 1)) if kv_heads >= 1 and heads % kv_heads == 0 else []


def ulysses_heads_problem(heads: int, kv_heads: int, degree: int, what: str) -> str | None:
    """Why the heads cannot be split over ``degree`` ranks, as a message for the user, or None.

    Any degree up to the query heads splits them, unevenly where it must (Note [uneven heads]).

    Args:
        heads: query heads.
        kv_heads: key/value heads (already known to divide ``heads``).
        degree: ranks of the all-to-all.
        what: the name of the all-to-all in the message ("ulysses", "hybrid's ulysses axis").

    Returns:
        The message (naming the alternatives), or None when they split.
    """
    if head_split(heads, kv_heads, degree) is not None:
        return None
    return (
        f"{what} over {degree} ranks needs at least {degree} query heads (one per rank); the model has {heads} "
        f"(use strategy 'ring', 'allgather', or 'hybrid' with ulysses_size at most {heads})"
    )
