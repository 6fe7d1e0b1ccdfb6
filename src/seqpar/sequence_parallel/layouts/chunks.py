"""How a global sequence is cut into per-rank shards ("contiguous", "zigzag" or a ``ChunkLayout``) and put back.

Every strategy, the loss and the position ids use these same chunk orders, so they can never disagree; the
layout name registry (``NAMED_LAYOUTS``) lives here too.

Note [layout registry]
    Every layout is a ``SequenceLayout``: a ``name``, whether it is ``per_batch``, ``chunks_for(P)`` (the global
    chunk ids each of P ranks holds when a row is cut into equal chunks), ``pad_multiple(P)`` (what a row is
    padded to a multiple of before it is cut or solved), ``shard`` and ``gather``. The fixed ones
    (``FixedLayout``: "contiguous", "zigzag") cut every row alike; a ``ChunkLayout`` is one explicit cut; the
    per-batch ones (``PerBatchLayout``: "balanced", "placed", "auto") are solved from each batch's global
    position ids by ``shard_batch`` into that batch's ``ChunkLayout`` (Notes [balanced layout], [placed
    layout]), so they cut nothing themselves and say so; each carries its ``solver``, which ``shard_batch``
    calls (``layout_row`` gives any layout argument's row). ``NAMED_LAYOUTS`` is the one list of names: the
    configs (``SequenceParallelConfig``, ``seqpar train``), the CLI's ``--layout`` choices, ``prepare_model``
    and ``shard_batch`` read it, and ``named_layout`` refuses any other name with the list. Layout arguments
    stay names or ``ChunkLayout`` objects; the rows describe them.

Note [zigzag layout]
    The sequence is cut into 2P equal chunks; rank r holds chunks r and 2P-1-r, in that order. Under a
    causal mask the early chunk of a rank sees little and the late chunk sees much, so every rank does the
    same amount of attention work (Brandon et al., "Striped Attention", 2023, and the zigzag variant used
    by Llama 3 context parallelism). Position ids and labels must be sharded with the same layout.
"""

from __future__ import annotations

import functools
import importlib
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from seqpar.errors import SeqparInputError
from seqpar.mesh import as_sp_mesh
from seqpar.sequence_parallel.comm.collectives import all_gather_first_dim, reduce_scatter_first_dim


@runtime_checkable
class SequenceLayout(Protocol):
    """What every layout tells (Note [layout registry]): its name, how P ranks cut a row, shard and gather."""

    @property
    def name(self) -> str:
        """The layout's name ("contiguous", "zigzag", "balanced", ...)."""

    @property
    def per_batch(self) -> bool:
        """Whether it is solved per batch from the batch's global position ids (then it cuts nothing itself)."""

    def chunks_for(self, world_size: int) -> tuple[tuple[int, ...], ...]:
        """The global chunk ids each of ``world_size`` ranks holds, rank by rank, in local order."""

    def pad_multiple(self, world_size: int) -> int:
        """The multiple of tokens a row is padded to before it is cut (or solved) over ``world_size`` ranks."""

    def shard(self, x: torch.Tensor, mesh: object, dim: int = 1) -> torch.Tensor:
        """This rank's shard of the full sequence ``x`` (as ``shard_sequence``)."""

    def gather(self, x_local: torch.Tensor, mesh: object, dim: int = 1) -> torch.Tensor:
        """The full sequence from every rank's shard (as ``gather_sequence``)."""


@dataclass(frozen=True)
class FixedLayout:
    """A layout that cuts every row the same way: ``chunks_per_rank`` equal chunks per rank (Note [zigzag layout]).

    One chunk per rank is "contiguous" (rank r holds chunk r); two is "zigzag" (rank r holds r and 2P-1-r).
    """

    name: str
    """The name callers pass as ``layout=``."""
    chunks_per_rank: int
    """1 (contiguous) or 2 (zigzag)."""
    per_batch = False
    reorders_row = False
    chooses = False

    def chunks_for(self, world_size: int) -> tuple[tuple[int, ...], ...]:
        """The global chunk ids each of ``world_size`` ranks holds, in local order.

        Args:
            world_size: ranks P.

        Returns:
            ``((0,), (1,), ...)`` for one chunk per rank; ``((0, 2P-1), (1, 2P-2), ...)`` for two.
        """
        if self.chunks_per_rank == 1:
            return tuple((r,) for r in range(world_size))
        return tuple((r, 2 * world_size - 1 - r) for r in range(world_size))

    def pad_multiple(self, world_size: int) -> int:
        """``chunks_per_rank x world_size``: every chunk equally long."""
        return self.chunks_per_rank * world_size

    def shard(self, x: torch.Tensor, mesh: object, dim: int = 1) -> torch.Tensor:
        """``shard_sequence(x, mesh, dim, layout=self.name)``."""
        return shard_sequence(x, mesh, dim, self.name)

    def gather(self, x_local: torch.Tensor, mesh: object, dim: int = 1) -> torch.Tensor:
        """``gather_sequence(x_local, mesh, dim, layout=self.name)``."""
        return gather_sequence(x_local, mesh, dim, self.name)


@dataclass(frozen=True)
class PerBatchLayout:
    """A layout solved per batch from the batch's global position ids; its name stands for the ``ChunkLayout``
    that ``shard_batch`` (or its ``solver``) returns, which every call of that batch is then given."""

    name: str
    """The name ``shard_batch``, ``prepare_model`` and the configs take."""
    solver_path: str
    """Where its solver lives, "module:name"; ``solver`` imports it on first use (the solvers import this module)."""
    pad_chunks: int = 2
    """The row is padded to a multiple of ``pad_chunks`` x P before it is solved (when it is not reordered)."""
    reorders_row: bool = False
    """The row is reordered (and padded) before it is sharded: the placed layout (Note [placed layout])."""
    chooses: bool = False
    """It stands for another per-batch layout, picked from the batch's own ids: "auto" (Note [placed layout])."""
    per_batch = True

    @functools.cached_property
    def solver(self) -> Callable[..., Any]:
        """``(global position ids [B, S], P) ->`` the batch's ``ChunkLayout``; its ``Placement`` when the layout
        reorders the row; the name of the layout it stands for, from the ids alone, when it ``chooses``."""
        module, _, name = self.solver_path.partition(":")
        return getattr(importlib.import_module(module), name)

    def _refuse(self) -> SeqparInputError:
        rows = [r for r in NAMED_LAYOUTS.values() if r.per_batch and not r.chooses] if self.chooses else [self]
        made_by = " or ".join(f"seqpar.{r.solver_path.partition(':')[2]}" for r in rows)
        return SeqparInputError(
            f"layout {self.name!r} is made per batch: pass the ChunkLayout that shard_batch returned (shard.layout) "
            f"or that {made_by} made, not the name"
        )

    def pad_multiple(self, world_size: int) -> int:
        """``pad_chunks x world_size``.

        Raises:
            SeqparInputError: a layout that reorders the row (its solver pads the row it places).
        """
        if self.reorders_row:
            raise self._refuse()
        return self.pad_chunks * world_size

    def chunks_for(self, world_size: int) -> tuple[tuple[int, ...], ...]:
        """Raises: the chunks are the batch's own (``shard_batch``).

        Raises:
            SeqparInputError: always, naming what makes the ``ChunkLayout``.
        """
        raise self._refuse()

    def shard(self, x: torch.Tensor, mesh: object, dim: int = 1) -> torch.Tensor:
        """Raises: shard a batch with ``shard_batch(layout=name)``.

        Raises:
            SeqparInputError: always, naming what makes the ``ChunkLayout``.
        """
        raise self._refuse()

    def gather(self, x_local: torch.Tensor, mesh: object, dim: int = 1) -> torch.Tensor:
        """Raises: gather with the batch's ``ChunkLayout``.

        Raises:
            SeqparInputError: always, naming what makes the ``ChunkLayout``.
        """
        raise self._refuse()


CONTIGUOUS = FixedLayout("contiguous", 1)
ZIGZAG = FixedLayout("zigzag", 2)
BALANCED = PerBatchLayout("balanced", "seqpar.sequence_parallel.layouts.balanced:balanced_layout")
PLACED = PerBatchLayout("placed", "seqpar.sequence_parallel.layouts.placed:placed_layout", reorders_row=True)
AUTO = PerBatchLayout("auto", "seqpar.sequence_parallel.layouts.placed.auto:resolve_auto_layout", chooses=True)

NAMED_LAYOUTS: dict[str, FixedLayout | PerBatchLayout] = {
    row.name: row for row in (CONTIGUOUS, ZIGZAG, BALANCED, PLACED, AUTO)
}
"""The layout name registry (Note [layout registry]): every name a ``layout=`` argument, a config or the CLI takes."""


def layout_names(per_batch: bool | None = None) -> tuple[str, ...]:
    """The registered layout names, in registry order.

    Args:
        per_batch: True for the per-batch ones only, False for the fixed ones only, None for all.

    Returns:
        The names.
    """
    return tuple(n for n, row in NAMED_LAYOUTS.items() if per_batch is None or row.per_batch == per_batch)


LAYOUTS = layout_names(per_batch=False)
"""The fixed layouts' names, ("contiguous", "zigzag"): what ``seqpar.attention`` takes as a name."""
PER_BATCH_LAYOUTS = layout_names(per_batch=True)
"""Layouts solved per batch (Note [balanced layout], Note [placed layout]): their names stand for a ``ChunkLayout``;
"auto" is "placed" on packed rows and "balanced" otherwise, chosen per batch (Note [placed layout])."""


def named_layout(name: str) -> FixedLayout | PerBatchLayout:
    """The registry row of a layout name.

    Args:
        name: a name from ``layout_names()``.

    Returns:
        Its ``FixedLayout`` or ``PerBatchLayout``.

    Raises:
        SeqparInputError: an unknown name (the message lists the registry).
    """
    row = NAMED_LAYOUTS.get(name) if isinstance(name, str) else None
    if row is None:
        raise SeqparInputError(
            f"unknown layout {name!r}; choose one of {LAYOUTS} or pass a ChunkLayout (made per batch by "
            f"shard_batch: {', '.join(PER_BATCH_LAYOUTS)})"
        )
    return row


def layout_row(layout: Layout) -> FixedLayout | PerBatchLayout | ChunkLayout:
    """The row describing a layout argument: a ``ChunkLayout`` itself, a name its registry row (``named_layout``)."""
    return layout if isinstance(layout, ChunkLayout) else named_layout(layout)


@dataclass(frozen=True)
class ChunkLayout:
    """An explicit layout: the sequence is cut into equal chunks and rank r holds ``chunk_ids[r]``, in that order.

    ``seqpar.balanced_layout`` makes one per batch (Note [balanced layout]); ``shard_batch(layout="balanced")``
    returns it as ``shard.layout``. Pass the same object to every call that takes a layout for that batch.
    """

    chunk_ids: tuple[tuple[int, ...], ...]
    """Global chunk indices of each rank, rank by rank, ascending within a rank (its local order): together a
    permutation of ``0..n-1``, the same count per rank."""
    name: str = "balanced"
    """How the layout was made (for messages)."""

    def __post_init__(self) -> None:
        ids = tuple(tuple(int(c) for c in per_rank) for per_rank in self.chunk_ids)
        object.__setattr__(self, "chunk_ids", ids)
        if not ids or not ids[0]:
            raise SeqparInputError("a ChunkLayout needs at least one rank with at least one chunk")
        if len({len(per_rank) for per_rank in ids}) != 1:
            raise SeqparInputError(f"every rank of a ChunkLayout must hold the same number of chunks, got {ids}")
        if sorted(c for per_rank in ids for c in per_rank) != list(range(len(ids) * len(ids[0]))):
            raise SeqparInputError(f"the chunk ids of a ChunkLayout must be a permutation of 0..n-1, got {ids}")
        if any(list(per_rank) != sorted(per_rank) for per_rank in ids):
            raise SeqparInputError(f"each rank's chunk ids in a ChunkLayout must be ascending, got {ids}")

    @property
    def world_size(self) -> int:
        """Ranks the layout is for."""
        return len(self.chunk_ids)

    @property
    def chunks_per_rank(self) -> int:
        """Chunks each rank holds."""
        return len(self.chunk_ids[0])

    @property
    def digest(self) -> int:
        """A CRC-32 of the chunk ids, for ranks to check that they hold the same layout."""
        return zlib.crc32(repr(self.chunk_ids).encode())

    def __str__(self) -> str:
        return f"{self.name} layout ({self.world_size} ranks x {self.chunks_per_rank} chunks)"

    per_batch = False  # already solved: it cuts its own batch's rows
    reorders_row = False
    chooses = False

    def pad_multiple(self, world_size: int) -> int:
        """``chunks_per_rank x world_size``."""
        return self.chunks_per_rank * world_size

    def chunks_for(self, world_size: int) -> tuple[tuple[int, ...], ...]:
        """``chunk_ids``, once ``world_size`` is checked against the ranks the layout is for.

        Raises:
            SeqparInputError: a layout made for another number of ranks.
        """
        if self.world_size != world_size:
            raise SeqparInputError(f"the {self} does not fit a group of {world_size} ranks")
        return self.chunk_ids

    def shard(self, x: torch.Tensor, mesh: object, dim: int = 1) -> torch.Tensor:
        """``shard_sequence(x, mesh, dim, layout=self)``."""
        return shard_sequence(x, mesh, dim, self)

    def gather(self, x_local: torch.Tensor, mesh: object, dim: int = 1) -> torch.Tensor:
        """``gather_sequence(x_local, mesh, dim, layout=self)``."""
        return gather_sequence(x_local, mesh, dim, self)


Layout = str | ChunkLayout
"""A layout argument: a fixed layout's name ("contiguous", "zigzag"), or an explicit ``ChunkLayout``."""


def chunks_per_rank(layout: Layout) -> int:
    """Number of equal chunks each rank holds under ``layout`` (1 for contiguous, 2 for zigzag).

    Raises:
        SeqparInputError: for an unknown layout, or a per-batch name (its chunks are the batch's own).
    """
    row = layout_row(layout)
    if row.per_batch:
        raise row._refuse()
    return row.chunks_per_rank


@functools.lru_cache(maxsize=64)
def _chunk_ids(layout: Layout, world_size: int) -> tuple[tuple[int, ...], ...]:
    return layout_row(layout).chunks_for(world_size)


def rank_chunk_ids(layout: Layout, world_size: int, rank: int | None = None) -> tuple[int, ...]:
    """Global chunk indices held by ``rank`` (in local order), or by every rank, rank-major, if ``rank`` is None.

    The global sequence has ``world_size * chunks_per_rank(layout)`` chunks of equal length.
    """
    ids = _chunk_ids(layout, world_size)
    if rank is None:
        return tuple(c for per_rank in ids for c in per_rank)
    return ids[rank]


def _check_divisible(seq_len: int, layout: Layout, world_size: int) -> int:
    n_chunks = world_size * chunks_per_rank(layout)
    if seq_len % n_chunks:
        raise SeqparInputError(
            f"sequence length {seq_len} does not divide into the {layout} layout over {world_size} ranks "
            f"(needs a multiple of {n_chunks}); pad the sequence to a multiple of {n_chunks}"
        )
    return seq_len // n_chunks


def _sp_rank_and_size(mesh: object) -> tuple[int, int, dist.ProcessGroup | None]:
    sp = as_sp_mesh(mesh)
    return sp.sp_rank, sp.sp_size, sp.sp_group


def shard_sequence(x: torch.Tensor, mesh: object, dim: int = 1, layout: Layout = "zigzag") -> torch.Tensor:
    """This rank's shard of a full sequence tensor (no communication; differentiable).

    Args:
        x: the full sequence, identical on every rank of the sequence-parallel group.
        mesh: a ``SequenceParallelMesh`` (``seqpar.make_mesh``), a process group, or a 1-D DeviceMesh.
        dim: the sequence dimension of ``x``.
        layout: "contiguous", "zigzag" (Note [zigzag layout]) or a ``ChunkLayout``.

    Returns:
        The local shard, ``x.shape[dim] // P`` long along ``dim``, chunks in local order.

    Raises:
        SeqparInputError: unknown layout, or a length that does not divide into the layout.
    """
    rank, size, _ = _sp_rank_and_size(mesh)
    return shard_for_rank(x, rank, size, dim, layout)


def shard_for_rank(x: torch.Tensor, rank: int, world_size: int, dim: int, layout: Layout) -> torch.Tensor:
    """The shard of a full sequence tensor that ``rank`` of ``world_size`` holds (no group needed).

    Args:
        x: the full sequence.
        rank: the sequence-parallel rank whose shard to take.
        world_size: the sequence-parallel degree.
        dim: the sequence dimension of ``x``.
        layout: "contiguous", "zigzag" (Note [zigzag layout]) or a ``ChunkLayout``.

    Returns:
        ``x.shape[dim] // world_size`` positions along ``dim``, chunks in local order (a view when contiguous).

    Raises:
        SeqparInputError: unknown layout, or a length that does not divide into the layout.
    """
    chunk = _check_divisible(x.shape[dim], layout, world_size)
    pieces = [x.narrow(dim, c * chunk, chunk) for c in rank_chunk_ids(layout, world_size, rank)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def natural_order_index(layout: Layout, world_size: int, device: torch.device | None = None) -> torch.Tensor:
    """Index that turns rank-major chunks into global order: ``natural[j] = rank_major[index[j]]``."""
    ids = torch.tensor(rank_chunk_ids(layout, world_size))
    return ids.argsort().to(device)


def owner_order_index(layout: Layout, world_size: int, device: torch.device | None = None) -> torch.Tensor:
    """Index that turns globally ordered chunks into rank-major order: ``rank_major[i] = natural[index[i]]``."""
    return torch.tensor(rank_chunk_ids(layout, world_size), device=device)


def reorder_chunks(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """Split ``dim`` into ``len(index)`` equal chunks and return them in the order ``index`` gives."""
    n = index.numel()
    shape = list(x.shape)
    chunked = x.reshape(*shape[:dim], n, shape[dim] // n, *shape[dim + 1 :])
    return chunked.index_select(dim, index).reshape(shape)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, size: int, dim: int, layout: Layout):
        ctx.group, ctx.size, ctx.dim, ctx.layout = group, size, dim, layout
        out = all_gather_first_dim(x.movedim(dim, 0), group)  # [S, ...], rank-major chunks
        out = reorder_chunks(out, 0, natural_order_index(layout, size, out.device))
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # The adjoint of an all-gather sums every rank's gradient for this rank's shard.
        moved = grad.movedim(ctx.dim, 0)
        moved = reorder_chunks(moved, 0, owner_order_index(ctx.layout, ctx.size, grad.device))
        return reduce_scatter_first_dim(moved, ctx.group).movedim(0, ctx.dim), None, None, None, None


def gather_sequence(x_local: torch.Tensor, mesh: object, dim: int = 1, layout: Layout = "zigzag") -> torch.Tensor:
    """Reassemble the full sequence from every rank's shard (the inverse of ``shard_sequence``).

    Differentiable: the gradient of a shard is the sum, over ranks, of the gradient each rank's
    full-sequence result received for that shard (the adjoint of an all-gather). If every rank computes the
    same loss from the gathered tensor, divide it by the group size to keep single-device gradients.

    Args:
        x_local: this rank's shard (same shape on every rank).
        mesh: a ``SequenceParallelMesh``, a process group, or a 1-D DeviceMesh.
        dim: the sequence dimension.
        layout: the layout the shards were made with.

    Returns:
        The full sequence, in global order, on every rank.

    Raises:
        SeqparInputError: unknown layout, or a local length that does not divide into the layout.
    """
    _, size, group = _sp_rank_and_size(mesh)
    local_len = x_local.shape[dim]
    if local_len % chunks_per_rank(layout):
        raise SeqparInputError(
            f"local length {local_len} is not a multiple of {chunks_per_rank(layout)} chunks ({layout} layout)"
        )
    if size == 1:
        return x_local
    return _GatherSequence.apply(x_local, group, size, dim % x_local.dim(), layout)


def position_ids(
    seq_len: int, mesh: object, layout: Layout = "zigzag", device: torch.device | str | None = None
) -> torch.Tensor:
    """Global position ids of this rank's tokens under ``layout`` (for RoPE and for labels).

    Args:
        seq_len: the full (global) sequence length.
        mesh: a ``SequenceParallelMesh``, a process group, or a 1-D DeviceMesh.
        layout: "contiguous", "zigzag" or a ``ChunkLayout``.
        device: where to put the result.

    Returns:
        A ``LongTensor`` of shape ``[seq_len // P]``.

    Raises:
        SeqparInputError: unknown layout, or a length that does not divide into the layout.
    """
    rank, size, _ = _sp_rank_and_size(mesh)
    return shard_for_rank(torch.arange(seq_len, device=device), rank, size, 0, layout)
