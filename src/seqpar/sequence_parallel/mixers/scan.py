"""A linear recurrence (gated DeltaNet's delta rule) over a sequence split into chunks across ranks, exact.

Each rank runs the model's own chunked kernel on its pieces; one all-gather of per-chunk summaries passes the state.

Note [state passing]
    A gated DeltaNet layer keeps a state ``S`` (``[heads, dk, dv]``) that every token updates,
    ``S <- exp(g) (I - beta k k^T) S + beta k v^T``, and reads, ``o = S^T q``. The update is affine in the
    state, so over one chunk of tokens ``S_out = M S_in + S_loc``: ``S_loc`` is the chunk's final state from
    a zero start, and ``M`` (``[heads, dk, dk]``) is its final state from the identity with zero values, both
    from transformers' own kernel (``initial_state=`` and ``output_final_state=True``), unmodified. Every rank
    summarises each of its layout chunks by ``(M, S_loc)`` (sizes independent of the sequence length), one
    all-gather shares them, every rank composes them in the sequence's chunk order
    (``S_in(c + 1) = M_c S_in(c) + S_loc_c``, from zero) and reruns the first piece of each of its chunks from
    the state that reaches it. This works for any layout and any number of ranks, with no head-divisibility
    limit.
    Packed documents: the state restarts at every document start (``SequenceMask.starts``): a chunk is cut
    into pieces there, pieces after the first start from zero, and a chunk holding a start passes on its last
    piece's state alone (``M = 0``). So each document gives what it gives alone, as it must; transformers'
    one process carries the state from one packed document into the next.
    Backward: autograd through the kernel calls and the all-gather, whose backward is a reduce-scatter; every
    rank runs it for every layer, so no rank waits on another that skipped it (Note [symmetric exchange]).
    Cost: the kernel runs about twice per chunk plus once per extra piece (the identity run is ``dk`` wide),
    and the exchange moves ``(dk + dv) dk`` numbers per head and chunk. Where ``M`` is a decay times the
    identity (SSD, lightning attention: one number per head over a piece), ``through`` gives that number alone
    (``decay_only``) and the exchange moves ``1 + dk dv`` numbers per head and chunk.

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

from collections.abc import Callable

import torch

from seqpar.layouts.chunks import Layout, chunks_per_rank, gather_sequence, rank_chunk_ids
from seqpar.mesh import SequenceParallelMesh
from seqpar.sequence_parallel.masks import SequenceMask
from seqpar.sequence_parallel.mixers.conv import token_positions

__all__ = ["Recurrence", "chunked_state_scan"]

Recurrence = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""``run(*inputs, initial_state)`` on one piece of one row: (output ``[1, T, ...]``, final state ``[1, H, dk, dv]``)."""
Passage = Callable[..., torch.Tensor]
"""``through(*inputs)`` on one piece of one row: ``M`` ``[1, H, dk, dk]`` with ``S_out = M S_in + S_loc`` (its
decay ``[1, H, 1, 1]`` where ``M`` is that times the identity)."""


def _pieces(starts: torch.Tensor, first: bool) -> list[tuple[int, int, bool]]:
    """A chunk's pieces ``(start, stop, starts_a_document)``, cut where documents start (``starts`` ``[T]``)."""
    cuts = [0] + [int(t) for t in starts.nonzero().flatten() if int(t) > 0] + [starts.numel()]
    return [(a, b, bool(starts[a]) or (first and a == 0)) for a, b in zip(cuts, cuts[1:], strict=False)]


def chunked_state_scan(
    run: Recurrence,
    through: Passage,
    inputs: tuple[torch.Tensor, ...],
    state: tuple[int, int, int],
    sp: SequenceParallelMesh,
    layout: Layout,
    mask: SequenceMask | None,
    decay_only: bool = False,
) -> torch.Tensor:
    """A linear recurrence over the whole sequence, on this rank's chunks (Note [state passing]).

    Args:
        run: the model's chunked kernel, called on one piece of one row at a time.
        through: what a piece does to the state that enters it (``M``).
        inputs: the per-token tensors the kernel takes, each ``[B, L, ...]``, this rank's chunks in ``layout`` order.
        state: the state's ``(heads, dk, dv)``.
        sp: the sequence-parallel mesh.
        layout: the layout of the shards.
        mask: the batch's mask (its ``starts`` restart the state at packed documents).
        decay_only: ``M`` is a decay per head times the identity, and ``through`` gives the decay alone.

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
    outputs, summaries, first_pieces = [], [], []
    for b in range(batch):
        row_out, row_summary = [], []
        for c in range(chunks):
            span = slice(c * size, (c + 1) * size)
            is_start = starts[b, span] if starts is not None else torch.zeros(size, dtype=torch.bool)
            pieces = _pieces(is_start.cpu(), first=ids[c] == 0)
            outs, final = [], None
            for a, z, _ in pieces:
                part = [t[b : b + 1, span][:, a:z] for t in inputs]
                out, final = run(*part, initial_state=None)
                outs.append(out)
            opening, stop, restart = pieces[0]
            if len(pieces) == 1 and not restart:  # the state passes through the chunk
                passes = through(*[t[b : b + 1, span][:, opening:stop] for t in inputs])
            else:  # a document starts in the chunk: what leaves it is its last piece's own state
                passes = torch.zeros(1, heads, width, width, dtype=torch.float32, device=device)
            row_summary.append((passes, final))
            row_out.append(outs)
            first_pieces.append((b, c, restart, stop))
        outputs.append(row_out)
        summaries.append(row_summary)
    passing = torch.stack([torch.cat([s[c][0] for s in summaries]) for c in range(chunks)])  # [chunks, B, H, m, m]
    final = torch.stack([torch.cat([s[c][1] for s in summaries]) for c in range(chunks)])  # [chunks, B, H, dk, dv]
    flat = (passing.flatten(-2), final.to(passing.dtype).flatten(-2))
    summaries = torch.cat(flat, dim=-1)  # one exchange (Note [symmetric exchange])
    every = gather_sequence(summaries, sp, dim=0, layout=layout) if sp.sp_size > 1 else summaries  # chunk order
    every_through = every[..., : width * width].unflatten(-1, (width, width))
    every_final = every[..., width * width :].unflatten(-1, (dk, dv))
    incoming, entering = [], every_final.new_zeros(batch, heads, dk, dv)
    for passes, final_state in zip(every_through, every_final, strict=True):  # S_in(c + 1) = M_c S_in(c) + S_loc_c
        incoming.append(entering)
        entering = (passes * entering if decay_only else passes @ entering) + final_state
    rows = []
    for b in range(batch):
        pieces_out = []
        for c in range(chunks):
            outs = list(outputs[b][c])
            _, _, restart, stop = first_pieces[b * chunks + c]
            if not restart:  # the opening piece continues a document from the chunk before
                span = slice(c * size, (c + 1) * size)
                part = [t[b : b + 1, span][:, :stop] for t in inputs]
                outs[0], _ = run(*part, initial_state=incoming[ids[c]][b : b + 1])
            pieces_out.append(torch.cat(outs, dim=1))
        rows.append(torch.cat(pieces_out, dim=1))
    out = torch.cat(rows, dim=0)
    if sp.sp_size > 1:  # Note [symmetric exchange]: the gathered summaries reach the output on every rank
        out = out + 0.0 * every.sum().to(out.dtype)
    return out
