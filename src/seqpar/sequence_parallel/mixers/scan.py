"""A linear recurrence (gated DeltaNet's delta rule) over a sequence split into chunks across ranks, exact.

Each rank runs the model's own chunked kernel on its pieces; one all-gather of per-chunk summaries passes the state.

Note [state passing]
    A gated DeltaNet layer keeps a state ``S`` (``[heads, dk, dv]``) that every token updates,
    ``S <- exp(g) (I - beta k k^T) S + beta k v^T``, and reads, ``o = S^T q``. The update is affine in the
    state, so over one chunk of tokens ``S_out = M S_in + S_loc``, and each output is its zero-start value plus
    a term linear in ``S_in``. Every rank summarises each of its layout chunks by ``(M, S_loc)`` (sizes
    independent of the sequence length), one all-gather shares them, every rank composes them in the sequence's
    chunk order (``S_in(c + 1) = M_c S_in(c) + S_loc_c``, from zero) and adds to the first piece of each of its
    chunks the term of the state that reaches it. This works for any layout and any number of ranks, with no
    head-divisibility limit.
    Where the pieces come from: each adapter's ``opening`` runs a chunk's first piece once and returns its
    zero-start output, ``S_loc``, ``M`` and the map from ``S_in`` to the output's term (``Opening``). For the
    gated delta rule (gated DeltaNet, KDA) that is one call of transformers' own kernel, unmodified, with
    ``dk`` zero columns appended to the values and the initial state ``[0 | I]``: the kernel is linear column by
    column, so the first ``dv`` columns are the zero-start run (output, ``S_loc``) and the last ``dk`` the run
    from the identity with zero values (``q_t^T A_t`` per token, and ``M = A_T``); the term is then
    ``(q_t^T A_t) S_in``. The value-independent work (the decays, the triangular solve) is done once for both.
    For SSD, Mamba1 and lightning attention ``M`` is a decay (per head, or per channel and entry) times the
    identity, and the term is the read-out of the decayed ``S_in``.
    Packed documents: the state restarts at every document start (``SequenceMask.starts``): a chunk is cut
    into pieces there, pieces after the first start from zero, and a chunk holding a start passes on its last
    piece's state alone (``M = 0``). So each document gives what it gives alone, as it must; transformers'
    one process carries the state from one packed document into the next.
    Backward: autograd through the kernel calls and the all-gather, whose backward is a reduce-scatter; every
    rank runs it for every layer, so no rank waits on another that skipped it (Note [symmetric exchange]).
    Calls: the pieces of a shard that run alike (from zero, or as openings) and have the same length go
    through the kernel together, as rows of one batch: on unpacked rows that is at most two calls per layer,
    whatever the rows and chunks; packed documents cut pieces of many lengths, each length its own call. Where
    the kernel is fla's (``varlen``: the dispatcher resolved to it on the tensors' device, Note [mixer
    implementations]), the pieces that run alike go through one call whatever their lengths, laid end to end in
    one row with their boundaries in ``cu_seqlens`` and one initial and final state each: at most two calls per
    layer, packed or not. transformers' PyTorch kernels refuse ``cu_seqlens``, and mamba_ssm's per-sequence
    final states have no backward, so those keep a call per length.
    Cost: one kernel run per piece, the opening piece's ``dv + dk`` wide for the delta rule, plus a read-out per
    token of the opening piece; the exchange moves ``(dk + dv) dk`` numbers per head and chunk, and where
    ``M`` is a decay times the identity (SSD, lightning attention; ``decay_only``), ``1 + dk dv``. A chunk that
    opens a document (the sequence's first) needs no ``opening``.

Note [symmetric exchange]
    A collective with autograd must be entered by every rank in the backward as in the forward. A rank whose
    outputs do not depend on the others' (its chunks all start documents, or it holds the first chunk) still
    calls the all-gather, but autograd would skip its reduce-scatter, since nothing it computes needs the
    gathered tensor, and the other ranks would wait for it. So the gathered summaries are added to the output
    with weight 0: the gradient they pass is zero, and every rank runs the reduce-scatter. And the two
    summaries travel as one tensor: a chunk that holds a document start hands on ``M = 0``, which has no
    graph, so a separate exchange of ``M`` would have a backward on some ranks only.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import NamedTuple

import torch

from seqpar.mesh import SequenceParallelMesh
from seqpar.sequence_parallel.layouts.chunks import Layout, chunks_per_rank, gather_sequence, rank_chunk_ids
from seqpar.sequence_parallel.masks import SequenceMask
from seqpar.sequence_parallel.mixers.conv import token_positions

Recurrence = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""``run(*inputs, initial_state)`` on n pieces of T tokens stacked as rows: (output ``[n, T, ...]``, final state
``[n, H, dk, dv]``); with ``cu_seqlens`` (``varlen``), n pieces laid end to end in one row: (``[1, sum T, ...]``,
``[n, H, dk, dv]``)."""


class Opening(NamedTuple):
    """Chunks' first pieces that continue a document, run once (Note [state passing]): what ``opening(*inputs)``
    returns for n pieces of T tokens stacked as rows."""

    out: torch.Tensor
    """``[n, T, ...]`` the output from a zero state, as ``run`` gives it."""
    final: torch.Tensor
    """``[n, H, dk, dv]`` the state leaving each piece from a zero state (``S_loc``)."""
    passes: torch.Tensor
    """``M`` with ``S_out = M S_in + S_loc``: ``[n, H, dk, dk]``, or its decay ``[n, H, 1, 1]`` (``decay_only``)."""
    respond: Callable[[torch.Tensor], torch.Tensor]
    """``S_in`` ``[n, H, dk, dv]`` -> the term it adds to ``out``, of ``out``'s shape."""


def _pieces(starts: torch.Tensor, first: bool) -> list[tuple[int, int, bool]]:
    """A chunk's pieces ``(start, stop, starts_a_document)``, cut where documents start (``starts`` ``[T]``)."""
    cuts = [0] + [int(t) for t in starts.nonzero().flatten() if int(t) > 0] + [starts.numel()]
    return [(a, b, bool(starts[a]) or (first and a == 0)) for a, b in zip(cuts, cuts[1:], strict=False)]


Member = tuple[int, int, int, int, int]
"""A piece of a shard: (row, chunk, piece, first token, length)."""


def _stacked(t: torch.Tensor, members: list[Member], length: int, chunks: int, varlen: bool) -> torch.Tensor:
    """The pieces ``members`` of ``t`` ``[B, L, ...]``, ``length`` tokens each, stacked as rows: a view of ``t``
    where they are whole chunks of a block of rows and chunks (unpacked rows, where the kernel then saves no copy
    of its inputs), else a copy; ``varlen``: of any lengths, laid end to end in one row."""
    if len(members) == 1:
        b, _, _, at, n = members[0]
        return t[b : b + 1, at : at + n]
    if varlen:
        return torch.cat([t[b : b + 1, at : at + n] for b, _, _, at, n in members], dim=1)
    size = t.shape[1] // chunks
    if length == size:
        rows, cols = sorted({m[0] for m in members}), sorted({m[1] for m in members})
        block = [(b, c) for b in range(rows[0], rows[-1] + 1) for c in range(cols[0], cols[-1] + 1)]
        if block == [(m[0], m[1]) for m in members]:  # the order they were listed in: row by row
            grid = t.unflatten(1, (chunks, size))[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]
            return grid.flatten(0, 1)
    return torch.cat([t[b : b + 1, at : at + length] for b, _, _, at, _ in members])


def _unstacked(t: torch.Tensor, members: list[Member], varlen: bool) -> tuple[torch.Tensor, ...]:
    """Each member's part of ``t`` as ``_stacked`` laid them out, ``[1, length, ...]``."""
    return t.split([m[4] for m in members], dim=1) if varlen else t.split(1)


def chunked_state_scan(
    run: Recurrence,
    opening: Callable[..., Opening],
    inputs: tuple[torch.Tensor, ...],
    state: tuple[int, int, int],
    sp: SequenceParallelMesh,
    layout: Layout,
    mask: SequenceMask | None,
    decay_only: bool = False,
    varlen: bool = False,
) -> torch.Tensor:
    """A linear recurrence over the whole sequence, on this rank's chunks (Note [state passing]).

    Args:
        run: the model's chunked kernel from a zero state, on pieces stacked as the rows of a batch.
        opening: chunks' first pieces that continue a document from the chunk before (``Opening``), stacked so.
        inputs: the per-token tensors the kernel takes, each ``[B, L, ...]``, this rank's chunks in ``layout`` order.
        state: the state's ``(heads, dk, dv)``.
        sp: the sequence-parallel mesh.
        layout: the layout of the shards.
        mask: the batch's mask (its ``starts`` restart the state at packed documents).
        decay_only: ``M`` is a decay per head times the identity, and ``opening`` gives the decay alone.
        varlen: ``run`` and ``opening`` take ``cu_seqlens``, one initial and final state per sequence, and get the
            pieces that run alike in one call, laid end to end in one row.

    Returns:
        The outputs for this rank's tokens, concatenated along the sequence as ``run`` gives them.
    """
    batch, local = inputs[0].shape[:2]
    heads, dk, dv = state
    width = 1 if decay_only else dk  # M's rows and columns as they travel
    device = inputs[0].device
    chunks = chunks_per_rank(layout) if sp.sp_size > 1 else 1
    size = local // chunks
    ids = rank_chunk_ids(layout, sp.sp_size, sp.sp_rank) if sp.sp_size > 1 else (0,)
    index = token_positions(layout, sp, local)
    starts = mask.starts[:, index] == index if mask is not None and mask.starts is not None else None
    # every (row, chunk, piece), grouped by how it runs and its length: one kernel call per group
    groups: dict[tuple[bool, int], list[Member]] = {}
    pieces_of: dict[tuple[int, int], int] = {}
    for b in range(batch):
        for c in range(chunks):
            span = slice(c * size, (c + 1) * size)
            is_start = starts[b, span] if starts is not None else torch.zeros(size, dtype=torch.bool)
            pieces = _pieces(is_start.cpu(), first=ids[c] == 0)
            pieces_of[b, c] = len(pieces)
            for number, (a, z, restart) in enumerate(pieces):
                key = (restart, 0 if varlen else z - a)
                groups.setdefault(key, []).append((b, c, number, c * size + a, z - a))
    outs: dict[tuple[int, int, int], torch.Tensor] = {}
    last: dict[tuple[int, int, int], torch.Tensor] = {}
    through: dict[tuple[int, int], torch.Tensor] = {}  # M of each chunk that is one opening piece
    responses = []  # (respond, the (row, chunk) of each of its rows)
    for (restart, length), members in groups.items():
        part = [_stacked(t, members, length, chunks, varlen) for t in inputs]
        bounds = {}
        if varlen:  # each piece's first token in the row, and the row's end
            cuts = [0, *itertools.accumulate(m[4] for m in members)]
            bounds = {"cu_seqlens": torch.tensor(cuts, dtype=torch.long, device=device)}
        if restart:  # a document starts here: nothing enters the piece
            out, final = run(*part, initial_state=None, **bounds)
        else:  # each chunk's first piece, continuing a document from the chunk before
            opened = opening(*part, **bounds)
            out, final = opened.out, opened.final
            responses.append((opened.respond, members))
            for i, (b, c, *_) in enumerate(members):
                if pieces_of[b, c] == 1:
                    through[b, c] = opened.passes[i : i + 1]
        for i, ((b, c, number, *_), piece) in enumerate(zip(members, _unstacked(out, members, varlen), strict=True)):
            outs[b, c, number], last[b, c, number] = piece, final[i : i + 1]
    zero = torch.zeros(1, heads, width, width, dtype=torch.float32, device=device)
    # a chunk holding a document start passes on its last piece's own state (M = 0)
    passing = [through.get((b, c), zero) for b in range(batch) for c in range(chunks)]
    final = [last[b, c, pieces_of[b, c] - 1] for b in range(batch) for c in range(chunks)]
    # [chunks, B, H, m, m] and [chunks, B, H, dk, dv], from the (row, chunk) lists
    passing = torch.stack([torch.cat(passing[c::chunks]) for c in range(chunks)])
    final = torch.stack([torch.cat(final[c::chunks]) for c in range(chunks)])
    flat = (passing.flatten(-2), final.to(passing.dtype).flatten(-2))
    summaries = torch.cat(flat, dim=-1)  # one exchange (Note [symmetric exchange])
    every = gather_sequence(summaries, sp, dim=0, layout=layout) if sp.sp_size > 1 else summaries  # chunk order
    every_through = every[..., : width * width].unflatten(-1, (width, width))
    every_final = every[..., width * width :].unflatten(-1, (dk, dv))
    incoming, entering = [], every_final.new_zeros(batch, heads, dk, dv)
    for passes, final_state in zip(every_through, every_final, strict=True):  # S_in(c + 1) = M_c S_in(c) + S_loc_c
        incoming.append(entering)
        entering = (passes * entering if decay_only else passes @ entering) + final_state
    for respond, members in responses:  # the opening pieces' terms of the states that reach them
        terms = respond(torch.cat([incoming[ids[c]][b : b + 1] for b, c, *_ in members]))
        for (b, c, *_), term in zip(members, _unstacked(terms, members, varlen), strict=True):
            outs[b, c, 0] = (outs[b, c, 0] + term).to(outs[b, c, 0].dtype)
    rows = [[outs[b, c, n] for c in range(chunks) for n in range(pieces_of[b, c])] for b in range(batch)]
    out = torch.cat([torch.cat(row, dim=1) for row in rows], dim=0)
    if sp.sp_size > 1:  # Note [symmetric exchange]: the gathered summaries reach the output on every rank
        out = out + 0.0 * every.sum().to(out.dtype)
    return out
