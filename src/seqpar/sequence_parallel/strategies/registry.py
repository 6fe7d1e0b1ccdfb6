"""One row per attention strategy: its function, its head rule, its bytes and buffers and the mesh it needs.

Everything that names, validates, enumerates or prices a strategy reads these rows; ``select_strategy``
(``seqpar.sequence_parallel.selection``) picks one of them for ``strategy="auto"``.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from seqpar.errors import SeqparInputError
from seqpar.sequence_parallel.strategies.heads import (
    HeadSplit,
    head_split,
    kv_head_repeats,
    ulysses_heads_problem,
)
from seqpar.sequence_parallel.strategies.volumes import (
    allgather_bytes,
    hybrid_bytes,
    local_bytes,
    ring_bytes,
    ulysses_bytes,
)

if TYPE_CHECKING:
    import torch

BytesModel = Callable[[int, int, int, int, int, int, int], float]
"""(heads, kv_heads, sp_size, ulysses_size, local_tokens, head_dim, itemsize) -> bytes (Note [strategy bytes])."""
BufferModel = Callable[[int, int], int]
"""(local_tokens, sp_size) -> tokens of keys and values its exchange buffers hold on one rank (Note [DiT memory])."""


@dataclass(frozen=True)
class StrategyRow:
    """One attention strategy: what runs, which heads it allows, what it sends, and what mesh it needs."""

    name: str
    """The name ``seqpar.attention(strategy=...)`` takes ("local" is chosen, never asked for)."""
    function_path: str
    """Where the strategy function lives, "module:name"; ``function`` imports it on first use, so the rows (and
    the planner and estimator that read them) load no torch."""
    all_to_all: str | None
    """Which ranks its head all-to-all spans: "sp" (the whole SP group), "ulysses" (the mesh's ulysses axis), or
    None (no all-to-all: any head count works)."""
    kv_exchange: str | None
    """How K/V reach the other ranks' queries: "ring" (blocks around a ring), "gather" (all-gathered), or None."""
    head_groups: bool
    """Whether more than one KV head per rank after the all-to-all runs it in head groups (Note [ulysses memory])."""
    two_d: bool
    """Whether it needs a 2-D mesh (a ring axis x an ulysses axis) to be itself."""
    bytes_model: BytesModel
    """Bytes per rank per layer, forward + backward, one batch row (Note [strategy bytes])."""
    buffer_model: BufferModel
    """The tokens of keys and values its exchange buffers hold on one rank beside its own (Note [DiT memory])."""
    key_bias: bool = False
    """Whether it applies an ALiBi bias from its blocks' global query and key positions (its function takes
    ``alibi=``, the slopes: Note [ALiBi]); a call with slopes refuses a strategy without it."""

    @functools.cached_property
    def function(self) -> Callable[..., torch.Tensor]:
        """The strategy function; every one takes ``(q, k, v, *, mesh, layout, causal, scale, kernel, mask, sinks)``.

        Returns:
            The function ``function_path`` names, imported on the first access and kept on the row.
        """
        module, _, name = self.function_path.partition(":")
        return getattr(importlib.import_module(module), name)

    def degree(self, sp_size: int, ulysses_size: int) -> int:
        """The all-to-all degree the heads must split over on these degrees (1 without an all-to-all).

        Args:
            sp_size: the sequence-parallel degree.
            ulysses_size: the mesh's ulysses degree (1 on a flat mesh).

        Returns:
            ``sp_size``, ``ulysses_size`` or 1.
        """
        return {"sp": sp_size, "ulysses": ulysses_size}.get(self.all_to_all, 1)

    def split(self, heads: int, kv_heads: int, sp_size: int, ulysses_size: int = 1) -> HeadSplit | None:
        """How the all-to-all splits the heads (Note [uneven heads]); None when it cannot (fewer heads than ranks).

        Args:
            heads: query heads.
            kv_heads: key/value heads.
            sp_size: the sequence-parallel degree.
            ulysses_size: the mesh's ulysses degree.

        Returns:
            ``head_split`` over ``degree`` (one range of all heads without an all-to-all).
        """
        return head_split(heads, kv_heads, self.degree(sp_size, ulysses_size))

    def kv_repeats(self, heads: int, kv_heads: int, sp_size: int, ulysses_size: int = 1) -> int | None:
        """Copies of each KV head the even all-to-all needs (Note [ulysses heads]); None when the split is uneven.

        Args:
            heads: query heads.
            kv_heads: key/value heads.
            sp_size: the sequence-parallel degree.
            ulysses_size: the mesh's ulysses degree.

        Returns:
            1 without an all-to-all; else ``kv_head_repeats`` over ``degree``.
        """
        return kv_head_repeats(heads, kv_heads, self.degree(sp_size, ulysses_size))

    def heads_problem(
        self, heads: int, kv_heads: int, sp_size: int, ulysses_size: int = 1, what: str | None = None
    ) -> str | None:
        """Why these heads cannot run this strategy on these degrees, as a message for the user, or None.

        Args:
            heads: query heads.
            kv_heads: key/value heads (already known to divide ``heads``).
            sp_size: the sequence-parallel degree.
            ulysses_size: the mesh's ulysses degree.
            what: the all-to-all's name in the message (default: the strategy's, "hybrid's ulysses axis").

        Returns:
            The message, or None when the heads split (always None without an all-to-all).
        """
        degree = self.degree(sp_size, ulysses_size)
        if degree <= 1:
            return None
        default = f"{self.name}'s ulysses axis" if self.all_to_all == "ulysses" else self.name
        return ulysses_heads_problem(heads, kv_heads, degree, what or default)

    def bytes_sent(
        self,
        heads: int,
        kv_heads: int,
        sp_size: int,
        ulysses_size: int,
        local_tokens: int,
        head_dim: int,
        itemsize: int,
    ) -> float:
        """Bytes one rank sends per layer in one forward + backward of one batch row (Note [strategy bytes]).

        Args:
            heads: query heads.
            kv_heads: key/value heads.
            sp_size: the sequence-parallel degree.
            ulysses_size: the mesh's ulysses degree (read by hybrid only).
            local_tokens: tokens per rank.
            head_dim: head dimension.
            itemsize: bytes per element of q, k, v.

        Returns:
            The bytes, without the input check's signature exchange.
        """
        return self.bytes_model(heads, kv_heads, sp_size, ulysses_size, local_tokens, head_dim, itemsize)

    def buffer_bytes(self, local_tokens: int, sp_size: int, token_bytes: int) -> int:
        """Bytes of the exchange buffers one rank holds in a layer's attention (Note [DiT memory]).

        Args:
            local_tokens: tokens per rank.
            sp_size: the sequence-parallel degree.
            token_bytes: bytes of one token's key and value.

        Returns:
            0 on one rank; else the row's buffered tokens times ``token_bytes``.
        """
        return 0 if sp_size == 1 else self.buffer_model(local_tokens, sp_size) * token_bytes


def _ulysses(h: int, kv: int, sp_size: int, _u: int, n: int, d: int, e: int) -> float:
    return ulysses_bytes(h, kv, sp_size, n, d, e)


def _ring(_h: int, kv: int, sp_size: int, _u: int, n: int, d: int, e: int) -> float:
    return ring_bytes(kv, sp_size, n, d, e)


def _allgather(_h: int, kv: int, sp_size: int, _u: int, n: int, d: int, e: int) -> float:
    return allgather_bytes(kv, sp_size, n, d, e)


def _hybrid(h: int, kv: int, sp_size: int, u: int, n: int, d: int, e: int) -> float:
    return hybrid_bytes(h, kv, u, sp_size // u, n, d, e)


def _two_blocks(n: int, _sp: int) -> int:
    return 2 * n  # ring: the block in flight beside the one in use; Ulysses: its all-to-all's send and receive


def _gathered(n: int, sp_size: int) -> int:
    return n * sp_size  # the whole sequence's keys and values


def _no_buffers(_n: int, _sp: int) -> int:
    return 0


_HERE = "seqpar.sequence_parallel.strategies"
ULYSSES = StrategyRow(
    "ulysses", f"{_HERE}.ulysses:ulysses_attention", "sp", None, True, False, _ulysses, _two_blocks, key_bias=True
)
RING = StrategyRow("ring", f"{_HERE}.ring:ring_attention", None, "ring", False, False, _ring, _two_blocks, True)
ALLGATHER = StrategyRow(
    "allgather", f"{_HERE}.allgather:allgather_attention", None, "gather", False, False, _allgather, _gathered, True
)
HYBRID = StrategyRow("hybrid", f"{_HERE}.hybrid:hybrid_attention", "ulysses", "ring", False, True, _hybrid, _two_blocks)
"""Its buffers are counted as ring's (Note [DiT memory])."""
LOCAL = StrategyRow(
    "local", f"{_HERE}.local:local_attention", None, None, False, False, local_bytes, _no_buffers, key_bias=True
)
"""One rank holds the whole sequence (a sequence-parallel size of 1): chosen, never asked for."""
AUTO = "auto"
"""The name that asks ``select_strategy`` to choose (Note [auto strategy])."""

STRATEGY_ROWS = {row.name: row for row in (ULYSSES, RING, ALLGATHER, HYBRID, LOCAL)}
"""Name -> row, every strategy ``seqpar.attention`` can run."""
STRATEGIES = (*(name for name in STRATEGY_ROWS if name != LOCAL.name), AUTO)
"""The names a caller may pass as ``strategy=``: every row but "local", and "auto"."""


def strategy_row(name: str) -> StrategyRow:
    """The registry row of ``name`` ("local" included; not "auto", which ``select_strategy`` resolves).

    Args:
        name: a strategy name.

    Returns:
        Its row.

    Raises:
        SeqparInputError: an unknown name (the message lists the registry).
    """
    row = STRATEGY_ROWS.get(name) if isinstance(name, str) else None
    if row is None:
        raise SeqparInputError(f"unknown strategy {name!r}; choose one of {STRATEGIES}")
    return row


def check_strategy_name(strategy: str) -> None:
    """Raise unless ``strategy`` is a name a caller may pass (one of ``STRATEGIES``).

    Args:
        strategy: the name given.

    Raises:
        SeqparInputError: "unknown strategy ..." listing ``STRATEGIES``.
    """
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise SeqparInputError(f"unknown strategy {strategy!r}; choose one of {STRATEGIES}")


def strategy_options(sp_size: int) -> list[tuple[StrategyRow, int]]:
    """Every (row, ulysses degree) that can run on ``sp_size`` ranks, before any head rule (the planner's list).

    Args:
        sp_size: the sequence-parallel degree.

    Returns:
        ``[(LOCAL, 1)]`` on one rank; else the rows without an all-to-all at degree 1, then for every divisor
        ``u > 1`` of ``sp_size`` the row whose all-to-all spans ``u`` ranks (the whole group, or a 2-D mesh's
        ulysses axis).
    """
    if sp_size == 1:
        return [(LOCAL, 1)]
    rows = [r for r in STRATEGY_ROWS.values() if r is not LOCAL]
    options = [(r, 1) for r in rows if r.all_to_all is None]
    for u in range(2, sp_size + 1):
        if sp_size % u == 0:
            spans = "sp" if u == sp_size else "ulysses"
            options += [(r, u) for r in rows if r.all_to_all == spans]
    return options
