"""``seqpar.attention``: exact attention over a sequence split across ranks, with one call for every strategy.

It validates on every rank, picks the kernel and the strategy, and dispatches.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from seqpar.errors import SeqparInputError
from seqpar.mesh import as_sp_mesh
from seqpar.sequence_parallel.checks import check_attention_inputs
from seqpar.sequence_parallel.kernels import AttentionKernel, select_kernel
from seqpar.sequence_parallel.layouts.chunks import Layout
from seqpar.sequence_parallel.masks.sequence_mask import SequenceMask, sequence_mask
from seqpar.sequence_parallel.selection import select_strategy
from seqpar.sequence_parallel.strategies.registry import strategy_row

_log = logging.getLogger("seqpar")


@dataclass(frozen=True)
class AttentionChoice:
    """What ``seqpar.attention`` runs for given inputs: the strategy (``"local"`` on one rank) and kernel."""

    strategy: str
    """A name in ``STRATEGY_ROWS`` ("local" on one rank): never "auto"."""
    kernel: AttentionKernel
    """The local kernel that computes every block."""


def choose_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mesh: object = None,
    strategy: str = "auto",
    kernel: str | AttentionKernel = "auto",
    softcap: float | None = None,
    mask: SequenceMask | None = None,
    layout: Layout = "zigzag",
    causal: bool = True,
    alibi: bool = False,
) -> AttentionChoice:
    """The strategy and kernel ``seqpar.attention`` uses for these (already checked) inputs.

    Args:
        q: this rank's query shard, as given to ``seqpar.attention``.
        k: this rank's key shard.
        v: this rank's value shard.
        mesh: as in ``seqpar.attention``.
        strategy: a strategy name or "auto".
        kernel: "auto", a kernel name or an ``AttentionKernel``.
        softcap: logit soft-capping, as in ``seqpar.attention`` (it decides the kernel).
        mask: the call's ``seqpar.sequence_mask`` (with its window), or None: under a mask "auto" may pick
            the mask-aware ring over ulysses (Note [auto strategy]).
        layout: the layout the sequence is sharded with, as in ``seqpar.attention``.
        causal: the token-level causal rule (False under block-causal ranges, as ``seqpar.attention`` runs it).
        alibi: the call adds an ALiBi bias (Note [ALiBi]): the reference kernel, and a strategy that applies it.

    Returns:
        The choice; passing its fields back to ``seqpar.attention`` runs exactly that.

    Raises:
        SeqparInputError: a kernel that cannot run these inputs; an unknown strategy, or heads it cannot split
            (``select_strategy``).
    """
    sp = as_sp_mesh(mesh)
    chosen_kernel = select_kernel(q, k, v, kernel, softcap=softcap, alibi=alibi)
    # one rank holds the whole sequence: whatever strategy was asked for, nothing needs to travel
    if sp.sp_size == 1:
        return AttentionChoice("local", chosen_kernel)
    shape = dict(local_tokens=q.shape[2], head_dim=q.shape[3], itemsize=q.element_size())
    sizes = (q.shape[1], k.shape[1], sp.sp_size, sp.ulysses_size)  # heads, kv heads, degrees
    chosen = select_strategy(strategy, *sizes, mask=mask, layout=layout, causal=causal, key_bias=alibi, **shape)
    return AttentionChoice(chosen, chosen_kernel)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mesh: object = None,
    strategy: str = "auto",
    causal: bool = True,
    layout: Layout = "zigzag",
    scale: float | None = None,
    kernel: str | AttentionKernel = "auto",
    check_inputs: bool = True,
    window: int | None = None,
    position_ids: torch.Tensor | None = None,
    mask: SequenceMask | None = None,
    blocks: int | Sequence[tuple[int, int]] | Sequence[Sequence[tuple[int, int]]] | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    alibi: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention of this rank's query shard against the whole (sharded) sequence.

    Equal, up to float rounding, to ``F.scaled_dot_product_attention`` on the gathered sequence, forward
    and backward, for every strategy and layout.

    Args:
        q: ``[batch, heads, local_seq, head_dim]``, this rank's shard of the queries (``layout`` order).
        k: ``[batch, kv_heads, local_seq, head_dim]``; ``kv_heads`` divides ``heads`` (GQA/MQA).
        v: like ``k``; its head size may differ from q's and k's (MLA: Note [value head size]).
        mesh: a ``SequenceParallelMesh`` (``seqpar.make_mesh``), the SP ProcessGroup, a 1-D DeviceMesh,
            or None for a single process.
        strategy: "ulysses", "ring", "allgather", "hybrid" (the mesh's ulysses axis x its ring axis) or
            "auto" (``select_strategy``: hybrid, ulysses or ring by the heads and the mesh; under a mask the
            mask-aware ring when it sends at most a quarter of ulysses' bytes, Note [auto strategy]).
        causal: apply a causal mask over global positions.
        layout: how the caller sharded the sequence: "contiguous", "zigzag", or the ``ChunkLayout`` of this
            batch (``shard.layout`` of ``shard_batch(layout="balanced")``, Note [balanced layout]).
        scale: softmax scale; defaults to ``1 / sqrt(head_dim)``.
        kernel: local kernel: "auto", a name in ``seqpar.sequence_parallel.kernels.KERNELS``, or an ``AttentionKernel``.
        check_inputs: check every rank's inputs against every other rank's (one small all-gather per call)
            so that bad input raises on all ranks instead of hanging; with False only local checks run.
        window: sliding window (a query sees itself and the ``window - 1`` keys before it); causal only.
            Tiles wholly outside the window are skipped.
        position_ids: this rank's shard of the global position ids ``[B, S/P]``; a restart at 0 starts a
            new packed document, and documents never see each other (one more small all-gather).
        mask: a prebuilt ``seqpar.sequence_mask`` (build it once per batch and pass it to every layer
            instead of ``position_ids``); ``window``, when given, replaces its window.
        blocks: block-causal attention (Note [block-causal ranges]): a block size (video frames) or global
            ``(start, stop)`` token ranges (images in a text stream), or one sequence of ranges per batch row
            (rows with their images at different tokens); a token sees all of its own block and of earlier
            blocks. Needs ``causal=True``; with a prebuilt mask, pass it to ``sequence_mask``.
        sinks: ``[heads]`` learned attention-sink logits (gpt-oss): each joins every query's softmax
            denominator of its head with value 0 (Note [attention sinks]); gets a gradient, summed over this
            rank's queries (sum it over the SP ranks like any replicated parameter's).
        softcap: logit soft-capping (Gemma 2): scores become ``softcap * tanh(score / softcap)`` before the
            softmax (Note [logit soft-capping]); it runs the reference kernel, on every device.
        alibi: ``[heads]`` ALiBi slopes (BLOOM, MPT): each score gains ``slope * (key - query)`` over global
            positions (Note [ALiBi]); the reference kernel and a strategy that applies it (ulysses, ring, allgather).
        chunk: chunked attention (Llama 4): a query sees only the keys of its own chunk of ``chunk`` tokens, chunks
            counted from each document's first token (Note [chunked attention]).

    Returns:
        ``[batch, heads, local_seq, v_head_dim]``: this rank's shard of the output, in ``q.dtype``.

    Raises:
        SeqparInputError: bad input on any rank (raised on every rank, before any other collective).
    """
    return attention_and_choice(
        q,
        k,
        v,
        mesh=mesh,
        strategy=strategy,
        causal=causal,
        layout=layout,
        scale=scale,
        kernel=kernel,
        check_inputs=check_inputs,
        window=window,
        position_ids=position_ids,
        mask=mask,
        blocks=blocks,
        sinks=sinks,
        softcap=softcap,
        alibi=alibi,
        chunk=chunk,
    )[0]


def attention_and_choice(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mesh: object = None,
    strategy: str = "auto",
    causal: bool = True,
    layout: Layout = "zigzag",
    scale: float | None = None,
    kernel: str | AttentionKernel = "auto",
    check_inputs: bool = True,
    window: int | None = None,
    position_ids: torch.Tensor | None = None,
    mask: SequenceMask | None = None,
    blocks: int | Sequence[tuple[int, int]] | Sequence[Sequence[tuple[int, int]]] | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    alibi: torch.Tensor | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, AttentionChoice]:
    """``seqpar.attention``'s output and the strategy and kernel that computed it (decided once)."""
    sp = as_sp_mesh(mesh)
    check_attention_inputs(
        q,
        k,
        v,
        group=sp.sp_group,
        strategy=strategy,
        layout=layout,
        causal=causal,
        scale=scale,
        ulysses_size=sp.ulysses_size,
        exchange=check_inputs,
        window=window if window is not None else (mask.window if mask is not None else None),
        documents=2 if mask is not None else (1 if position_ids is not None else 0),
        sinks=sinks,
        softcap=softcap,
        alibi=alibi,
        chunk=chunk,
    )
    if mask is None:
        mask = sequence_mask(position_ids, sp, layout=layout, window=window, batch_size=q.shape[0], blocks=blocks)
    elif blocks is not None:
        raise SeqparInputError("blocks= goes to seqpar.sequence_mask when a prebuilt mask is passed")
    elif window is not None:
        mask = mask.with_window(window)
    _check_blocks(mask, causal, q.shape[2] * sp.sp_size, q.shape[0])
    if mask.starts is not None and mask.starts.shape[1] != q.shape[2] * sp.sp_size:
        raise SeqparInputError(
            f"the sequence mask covers {mask.starts.shape[1]} tokens but the sequence has "
            f"{q.shape[2] * sp.sp_size}; build it from this batch's position ids"
        )
    mask = mask.with_chunks(chunk, q.shape[2] * sp.sp_size)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    value_width = v.shape[-1]
    q, k, v = same_head_width(q, k, v)  # Note [value head size]
    causal = causal and mask.blocks is None  # the blocks replace the causal rule (Note [block-causal ranges])
    options = dict(mesh=sp, strategy=strategy, kernel=kernel, softcap=softcap, mask=mask, layout=layout, causal=causal)
    choice = choose_attention(q, k, v, alibi=alibi is not None, **options)
    _log.debug("seqpar.attention: strategy=%s kernel=%s sp=%d", choice.strategy, choice.kernel.name, sp.sp_size)
    biased = {} if alibi is None else {"alibi": alibi}  # only a row with key_bias takes it (Note [ALiBi])
    out = strategy_row(choice.strategy).function(
        q, k, v, mesh=sp, layout=layout, causal=causal, scale=scale, kernel=choice.kernel, mask=mask, sinks=sinks,
        **biased,
    )  # fmt: skip
    return (out[..., :value_width] if out.shape[-1] != value_width else out), choice


def same_head_width(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k and v zero-padded to one head size (Note [value head size]); unchanged when they share it.

    Note [value head size]
        MLA attention (DeepSeek-V2/V3, Kimi K2, MiniCPM3) has queries and keys of one head size (192: 128
        without rotary, 64 with) and values of another (128). Every strategy and kernel of seqpar moves and
        multiplies one head size, so the narrower side is padded with zeros: zero value columns make zero
        output columns (sliced off), and zero query and key columns add nothing to any score, so outputs,
        the log-sum-exp and every gradient are those of the unpadded attention (the pad's backward drops the
        padded columns' gradients). The scale is taken from the queries' own head size before padding. The cost
        is the padded columns' traffic and work: MLA's values move 1.5x their bytes. ``tests/test_attention_exact.py``
        compares it with SDPA (which takes the two sizes), forward and backward, in every strategy.
    """
    width = max(q.shape[-1], v.shape[-1])
    if q.shape[-1] == v.shape[-1]:
        return q, k, v
    return tuple(t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))


def _check_blocks(mask: SequenceMask, causal: bool, seq_len: int, batch: int) -> None:
    """Block-causal ranges need ``causal=True``, must lie inside the sequence and, given per row, name every
    row of the batch (same answer on every rank)."""
    if mask.blocks is None:
        return
    if not causal:
        raise SeqparInputError("block-causal blocks need causal=True (causal=False is already fully bidirectional)")
    if mask.blocks.end > seq_len:
        raise SeqparInputError(f"block ranges reach token {mask.blocks.end} but the sequence has {seq_len} tokens")
    if mask.blocks.per_row and len(mask.blocks.rows) != batch:
        raise SeqparInputError(f"block ranges are given for {len(mask.blocks.rows)} rows but the batch has {batch}")
