"""What packed documents change in the plan: the attention work left, and the K/V a placed ring still moves.

``seqpar plan --doc-len N`` passes ``doc_len`` to ``step_time``, which scales by these two fractions.

Note [planned documents]
    Rows packed with documents of about ``N`` tokens, sharded with the placed layout (Note [placed
    layout]). Two terms of Note [plan time model] change, and nothing else (memory, the matmuls and
    Ulysses' all-to-alls, which move every head shard whatever the mask, stay as for one document):
    - attention work: a query sees only its document, so the causal pairs are ``S/N`` documents of
      ``N (N + 1) / 2`` instead of ``S (S + 1) / 2``: a fraction ``(N + 1) / (S + 1)`` (1 from ``N >= S``),
      for every strategy (the placed layout evens it over the ranks, Ulysses' heads are even anyway);
    - the K/V a ring (or the all-gather, or hybrid's ring axis) moves, as a fraction of the plain ring's
      ``(r - 1)`` shares of ``L = S/r`` tokens per rank (``r`` ring ranks): a document no longer than a
      share lies whole on one rank, except at most one per rank cut at its home run's end, whose head
      (half a document on average) goes to the next rank: ``N / 2`` tokens; a longer document spans
      ``k = ceil(N / L)`` ranks and its causal ring among them moves ``(k - 1) L``. The fraction is that
      over ``(r - 1) L``, at most 1; the dK/dV going home scale alike.
    It is an estimate of the layout's typical row, not the measured table of one batch
    (``python -m benchmarks.masks`` measures those): equal documents, and a padding budget that keeps no cut
    document whole (a batch whose documents all fit whole moves nothing at all).
"""

from __future__ import annotations

import math

from seqpar.errors import SeqparInputError


def check_doc_len(doc_len: int | None) -> None:
    """Raise unless ``doc_len`` is None or a positive integer.

    Raises:
        SeqparInputError: any other value.
    """
    if doc_len is not None and (not isinstance(doc_len, int) or isinstance(doc_len, bool) or doc_len < 1):
        raise SeqparInputError(f"doc_len must be a positive number of tokens or None, got {doc_len!r}")


def visible_fraction(seq_len: int, doc_len: int | None) -> float:
    """Causal (query, key) pairs inside documents of ``doc_len`` tokens over those of one whole sequence.

    Args:
        seq_len: tokens per sequence.
        doc_len: tokens per packed document, or None for one document.

    Returns:
        ``(doc_len + 1) / (seq_len + 1)``, at most 1 (Note [planned documents]).
    """
    if doc_len is None or doc_len >= seq_len:
        return 1.0
    return (doc_len + 1) / (seq_len + 1)


def placed_kv_fraction(seq_len: int, doc_len: int | None, ring: int) -> float:
    """The K/V a placed ring of ``ring`` ranks moves, over what the plain ring moves (Note [planned documents]).

    Args:
        seq_len: tokens per sequence.
        doc_len: tokens per packed document, or None for one document.
        ring: ranks of the ring (the SP degree over the ulysses degree).

    Returns:
        A fraction in [0, 1]; 1 without documents or without a ring.
    """
    if doc_len is None or ring < 2:
        return 1.0
    share = seq_len / ring
    sent = doc_len / 2 if doc_len <= share else (math.ceil(doc_len / share) - 1) * share
    return min(1.0, sent / ((ring - 1) * share))
