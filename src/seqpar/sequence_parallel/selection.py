"""``select_strategy``: the one place that turns ``strategy=`` into the registry row that runs, "auto" included.

"auto" is a static rule on the heads and the mesh, refined under a mask by the bytes each strategy sends.

Note [auto strategy]
    Without a mask (or with one that adds nothing to causal) "auto" is the static rule: hybrid on a 2-D
    mesh whose ulysses axis the heads split over, else ulysses when the heads split over P (one all-to-all
    hop, no sequential ring steps), else ring, which serves any head count. "Split" includes the uneven
    split of Note [uneven heads] as long as its slowest rank attends at most ``MAX_HEAD_IMBALANCE`` (5/4)
    times the mean heads: 28 heads at P = 8 (4 against 3.5, 1.14x) or 14 at P = 4 (1.14x) take Ulysses,
    6 heads at P = 4 (2 against 1.5, 1.33x) the ring, whose zigzag layout evens the work. The bound is not
    measured on GPUs: it caps the attention time the head imbalance adds at a quarter, where the
    ring's sequential steps and exposed hop begin to be the cheaper cost; ``seqpar plan`` weighs the
    imbalance in time (Note [plan time model]) for a chosen layout.
    Under a mask the ring and the all-gather move only the K/V some peer query sees (Note [mask-aware ring]),
    while Ulysses moves every head shard whatever the mask. So when the static rule says ulysses and the
    call has a mask, "auto" compares the bytes the busiest rank sends in one forward + backward:
    - ring: ``2 Hkv d (2 sent e + returned 4)`` per batch row, with ``sent`` the rank's tokens that peers
      need (forward, and again backward) and ``returned`` the peers' tokens it needs (their dK/dV go home
      in float32), both counted from the ``kv_needs`` table; without a table (nothing spared) the plain
      ring's ``2 Hkv d (S/P) (2 (P-1) e + 4 P)``;
    - ulysses: ``(P-1)/P T (H + Hkv') (S/P) d e`` (``Hkv'`` after copying KV heads up to P, ``T`` = 4
      tensors, 6 in head groups: Note [strategy bytes]), its busiest rank's under an uneven split;
    and picks the ring when its bytes are at most ``RING_BYTES_RATIO`` (a quarter) of Ulysses'. Every
    input is the same on every rank (the global mask, every rank's chunk ids, the shapes the input check
    compares), and the maximum over ranks is taken, so every rank picks the same and no rank waits on a
    collective the others skip; nothing is communicated. The table is the one the ring then runs with
    (same key in ``mask.plans``), and the choice is kept there too, so the layers of one step pay for it
    once (a table build is tens of milliseconds for a 128K-token row at P = 8, one thread; see
    docs/benchmarks.md, "The auto rule's crossover"); a call given ``position_ids=`` builds its own mask:
    pass a prebuilt one.
    The ratio sits where CPU runs of ``python -m benchmarks.masks`` (ring against ulysses under placed and zigzag
    rows of documents, RL groups, windows and log-normal mixes) had the ring winning: it won clearly where
    its bytes were a third of Ulysses' or less, and above that the balance of the work and the noise
    decided (the rows: docs/benchmarks.md). On links slower than one host's loopback the bytes weigh more
    and the crossover moves up; on links faster against the compute (NVLink) it may move down; neither is
    measured, so the ratio stays where the CPU runs won.
    Ring rather than the all-gather: the same bytes (the same table), but the all-gather builds the whole
    sequence's K/V of its peers (zero-filled where not needed) on every rank, the ring one block of S/P at a
    time, and its step was never faster in those runs.
    A 2-D mesh keeps hybrid: its ring axis is already mask-aware, and the mesh says the all-to-all runs on
    the fast links. Only the bytes are compared, not the balance of the work: the placed and balanced
    layouts even it (Notes [placed layout], [balanced layout]); with zigzag and uneven documents the
    busiest ring rank can carry ~1.4x the mean while Ulysses' heads are always even.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from seqpar.errors import SeqparInputError
from seqpar.sequence_parallel.strategies.registry import (
    ALLGATHER,
    AUTO,
    HYBRID,
    RING,
    ULYSSES,
    StrategyRow,
    check_strategy_name,
    strategy_row,
)
from seqpar.sequence_parallel.strategies.volumes import GRAD_BYTES, ring_bytes

if TYPE_CHECKING:
    from seqpar.sequence_parallel.layouts.chunks import Layout
    from seqpar.sequence_parallel.masks.sequence_mask import SequenceMask
    from seqpar.sequence_parallel.tiling.kv_needs import KVNeeds

# the mask's tables (torch) load only under a mask: without one the rule reads the registry alone, which the
# memory estimate and the planner ask without torch (Note [torch-free planning] in seqpar.planning)

RING_BYTES_RATIO = 0.25
""""auto" takes the mask-aware ring when its busiest rank sends at most this fraction of Ulysses' bytes."""

MAX_HEAD_IMBALANCE = 1.25
""""auto" takes an uneven head split when its slowest rank attends at most this many times the mean heads."""


def select_strategy(
    strategy: str,
    heads: int,
    kv_heads: int,
    sp_size: int,
    ulysses_size: int = 1,
    *,
    mask: SequenceMask | None = None,
    layout: Layout = "zigzag",
    causal: bool = True,
    local_tokens: int = 0,
    head_dim: int = 1,
    itemsize: int = 4,
    key_bias: bool = False,
) -> str:
    """The strategy a call runs: "auto" resolved (Note [auto strategy]), an explicit name checked against its row.

    Every input is the same on every rank, so every rank selects the same strategy without communicating.

    Args:
        strategy: a name from ``STRATEGIES`` ("auto" included).
        heads: query heads.
        kv_heads: key/value heads.
        sp_size: the sequence-parallel degree.
        ulysses_size: the mesh's ulysses degree (1 on a flat mesh).
        mask: the call's sequence mask (the same on every rank), or None: without one (or a trivial one, or
            with ``local_tokens`` 0) "auto" is the static rule.
        layout: the layout the sequence is sharded with.
        causal: the token-level causal rule (ignored under block-causal ranges, which replace it).
        local_tokens: tokens per rank (``q.shape[2]``).
        head_dim: head dimension.
        itemsize: bytes per element of q, k, v.
        key_bias: the call adds an ALiBi bias (Note [ALiBi]): only a row with ``key_bias`` runs it; "auto" takes
            the static rule's row when it has it (the mask's byte comparison aside: the mask-aware ring does not
            apply the bias), else allgather.

    Returns:
        A registry name: "hybrid", "ulysses" or "ring" for "auto" (not "hybrid" with ``key_bias``: "allgather"
        instead); ``strategy`` itself otherwise.

    Raises:
        SeqparInputError: an unknown name, heads that the named strategy cannot split on these degrees, or a
            named strategy without ``key_bias`` for a call with one.
    """
    check_strategy_name(strategy)
    if strategy != AUTO:
        row = strategy_row(strategy)
        problem = row.heads_problem(heads, kv_heads, sp_size, ulysses_size)
        if problem is None and key_bias and not row.key_bias:
            served = ", ".join(r.name for r in (ULYSSES, RING, ALLGATHER, HYBRID) if r.key_bias)
            problem = f"strategy {strategy!r} applies no ALiBi bias (Note [ALiBi]); ask for one that does: {served}"
        if problem is not None:
            raise SeqparInputError(problem)
        return strategy
    static = _static_auto(heads, kv_heads, sp_size, ulysses_size)
    if key_bias:
        return (static if static.key_bias else ALLGATHER).name  # its mask-aware ring would not apply the bias
    if static is not ULYSSES or mask is None or mask.trivial or local_tokens < 1:
        return static.name
    return _masked_auto(heads, kv_heads, sp_size, mask, layout, causal, local_tokens, head_dim, itemsize)


def _static_auto(heads: int, kv_heads: int, sp_size: int, ulysses_size: int) -> StrategyRow:
    """Note [auto strategy], without a mask: hybrid on a 2-D mesh the heads allow, else ulysses, else ring."""

    def balanced(row: StrategyRow) -> bool:  # the heads split, and not too unevenly
        split = row.split(heads, kv_heads, sp_size, ulysses_size)
        return split is not None and split.imbalance <= MAX_HEAD_IMBALANCE

    if 1 < ulysses_size < sp_size and balanced(HYBRID):
        return HYBRID
    if balanced(ULYSSES):
        return ULYSSES
    return RING


def _masked_auto(
    heads: int,
    kv_heads: int,
    sp_size: int,
    mask: SequenceMask,
    layout: Layout,
    causal: bool,
    local_tokens: int,
    head_dim: int,
    itemsize: int,
) -> str:
    """Note [auto strategy] under a mask: the mask-aware ring when its bytes are a small fraction of Ulysses'."""
    from seqpar.sequence_parallel.layouts.chunks import rank_chunk_ids
    from seqpar.sequence_parallel.tiling.kv_needs import kv_needs

    causal = causal and mask.blocks is None  # the blocks replace the causal rule (Note [block-causal ranges])
    chunk_ids = tuple(rank_chunk_ids(layout, sp_size, r) for r in range(sp_size))
    chunk = local_tokens // len(chunk_ids[0])
    key = ("auto strategy", chunk_ids, chunk, causal, heads, kv_heads, itemsize)
    if key not in mask.plans:
        needs = kv_needs(mask, chunk_ids, chunk, causal)  # the ring's own table (same cache key)
        ring = masked_ring_bytes(needs, [local_tokens] * sp_size, kv_heads, head_dim, itemsize)
        ulysses = ULYSSES.bytes_sent(heads, kv_heads, sp_size, 1, local_tokens, head_dim, itemsize)
        mask.plans[key] = RING.name if ring <= RING_BYTES_RATIO * ulysses else ULYSSES.name
    return mask.plans[key]


def masked_ring_bytes(
    needs: KVNeeds | None, sizes: Sequence[int], kv_heads: int, head_dim: int, itemsize: int
) -> float:
    """Bytes the busiest rank sends in the (mask-aware) ring, one forward + backward, one batch row.

    Args:
        needs: the ``kv_needs`` table, or None when nothing is spared (the plain ring runs).
        sizes: every rank's local token count (equal).
        kv_heads: key/value heads.
        head_dim: head dimension.
        itemsize: bytes per element of K and V (their gradients travel in float32).

    Returns:
        The largest bytes of any rank (Note [auto strategy]).
    """
    size, token = len(sizes), 2 * kv_heads * head_dim  # K and V of one token
    if needs is None:
        return max(ring_bytes(kv_heads, size, n, head_dim, itemsize) for n in sizes)
    most = 0.0
    for me in range(size):
        sent = sum(len(needs[r][me]) for r in range(size) if r != me)
        returned = sum(len(needs[me][s]) for s in range(size) if s != me)
        most = max(most, token * (2 * sent * itemsize + returned * GRAD_BYTES))
    return most
