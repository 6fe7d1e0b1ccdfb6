"""Attention over a sliding window plus keys pooled over windows of tokens (DeepSeek-V4's CSA and HCA), sharded.

The compressor reads the row's projections gathered in global order, its attention the gathered window's keys.

Note [compressed attention]
    DeepSeek-V4's layers attend to a sliding window of their own keys (key = value, one head) and, on its
    compressed layers, to keys pooled over windows of the row: heavily compressed attention (HCA) pools each
    window of m' tokens (128) into one entry, compressed sparse attention (CSA) each window of m tokens (4),
    overlapping the window before it, and keeps an indexer's top k of them per query (the indexer pools its
    own keys over the same windows). A query at position p sees a pooled entry w when w < (p + 1) // m: the
    windows complete before it. transformers pools every complete window of the row from the row's start
    (windows follow the row's tokens, not its documents, and the entries' rotary positions are w x m) and
    checks that threshold against the query's own position id, which restarts at each document of a packed
    row; seqpar does the same, so a packed row is the one process's packed row.

    A window crosses shard edges wherever the layout cuts the row off a multiple of m (and CSA's overlap
    reaches into the window before), so each rank would pool windows it holds a part of. seqpar gathers what
    the compressor reads, not a halo: the compressor's module runs unchanged and takes its inputs from the
    cache argument transformers gives it for generation, which seqpar's pre-hook hands it as ``PooledInputs``.
    Its ``store_compression_weights`` all-gathers the projections ``kv`` and ``gate`` (its indexer's too) into
    global order, up to the call's width, and returns the complete windows from position 0; the overlap of a
    first call is empty and the pooled entries are returned as they are, as transformers does without a cache.
    So every rank pools the whole row's windows as one process does (``T / m`` entries of ``head_dim`` values),
    in global order; the indexer scores this rank's queries against all of
    them and keeps the top k over global entries (Note [indexed attention]: the same row, so the same picks,
    ties included), and the compressor's visibility of each local query (its causal threshold, and the picks)
    is kept for the attention. The gather's backward sums every rank's gradient of the row's projections back
    to the rank that holds them, so the projections' gradients are one process's; the pooling's own weights
    (position biases, norms) run on every rank over the same row, each rank's part of the loss giving its
    share, and their gradients sum over the ranks like every parameter's (Note [summed gradients]).

    The attention then gathers the sliding branch's keys as the allgather strategy does (key = value: one
    gather) and attends each local query, in one softmax with the heads' sinks (Note [attention sinks]), to
    the gathered keys its window, causality and document allow, and to the pooled entries the compressor
    allowed it. The strategy asked for serves the model's sliding-only layers; a compressed layer gathers.

    Why gathered inputs, not a halo: the compressor's own code then runs unchanged, windows, overlap, rotary
    positions and indexer alike, on every layout, with nothing of its arithmetic copied. The cost is bytes: a
    token sends ``head_dim`` values of sliding keys, and its projections (CSA: ``4 x head_dim`` for the
    compressor and ``4 x index_head_dim`` for the indexer; HCA: ``2 x head_dim``), each also reduce-scattered
    back in the backward but the indexer's (its picks carry no gradient). Pooling where a window's tokens live
    (a halo of one window's projections across each chunk edge, CSA's overlap included) and gathering the
    pooled entries would send about a sixteenth (``head_dim / m`` a token); a halo of the sliding window's keys
    instead of the gathered row would send less again. Neither is done yet. A layout whose chunk edges fall on
    multiples of m spares no exchange (the overlap and the window reach across them). A layout that reorders the
    row (the placed one) would pool other tokens' windows: a compressor refuses it, on every rank, naming it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from seqpar.errors import SeqparInputError
from seqpar.sequence_parallel.api import AttentionChoice, same_head_width
from seqpar.sequence_parallel.call_context import CallContext
from seqpar.sequence_parallel.indexed import visibility
from seqpar.sequence_parallel.kernels import select_kernel
from seqpar.sequence_parallel.layouts.chunks import NAMED_LAYOUTS, gather_sequence
from seqpar.sequence_parallel.strategies.local import masked_attention

if TYPE_CHECKING:
    from collections.abc import Callable

POOLED_KEY = "pooled"
"""``CallContext.cache`` key (with the attention module's id) of what its compressor let each local query see."""


@dataclass(frozen=True)
class PooledInputs:
    """The cache a compressor (and its indexer) is handed in a sharded call: its projections come back gathered."""

    ctx: CallContext
    rate: int
    """Tokens a pooled window holds (the compressor's ``compress_rate``)."""

    @property
    def layers(self) -> PooledInputs:
        return self  # every layer index reads the one gathering cache

    def __getitem__(self, layer_idx: int) -> PooledInputs:
        return self

    def store_compression_weights(
        self, name: str, kv: torch.Tensor, gate: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``[B, S/P, d]`` projections -> the whole row's complete windows ``[B, T x rate, d]``, from position 0."""
        both = gather_sequence(torch.cat([kv, gate], dim=-1), self.ctx.mesh, dim=1, layout=self.ctx.layout)
        both = both[:, : self.ctx.width]
        usable = both.shape[1] // self.rate * self.rate
        kv, gate = both[:, :usable].split([kv.shape[-1], gate.shape[-1]], dim=-1)
        return kv, gate, 0

    def update_overlap_state(self, name: str, kv: torch.Tensor, gate: torch.Tensor, head_dim: int) -> tuple:
        return None, None  # one call: no window before the row's first

    def update_compressor_states(self, name: str, compressed: torch.Tensor) -> torch.Tensor:
        return compressed


def compressor_hooks(
    attention: torch.nn.Module, compressor: torch.nn.Module, rate: str, running: Callable[[], CallContext | None]
) -> list:
    """The hooks that hand ``compressor`` its gathered inputs and keep what it let each local query see.

    Args:
        attention: the attention module that holds it.
        compressor: a compressor with a ``KEY_COMPRESSORS`` row.
        rate: the compressor's attribute holding its window size.
        running: the call context in progress, or None outside a sharded call.

    Returns:
        The hook handles.
    """
    signature = inspect.signature(compressor.forward)

    def entering(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ctx = running()
        if ctx is None:
            return args, kwargs
        if getattr(NAMED_LAYOUTS.get(getattr(ctx.layout, "name", None)), "reorders_row", False):
            raise SeqparInputError(
                f"{type(attention).__name__} pools its keys over windows of the row in the row's own order, across "
                f"its packed documents, and the {ctx.layout} reorders the row, so its windows would pool other "
                "tokens than one process's; shard its batches with a layout that keeps the row's order (zigzag, "
                "contiguous, balanced)"
            )
        bound = signature.bind(*args, **kwargs)
        bound.arguments["cache"] = PooledInputs(ctx, getattr(module, rate))
        return bound.args, bound.kwargs

    def leaving(module: torch.nn.Module, args: tuple, output: tuple) -> None:
        ctx = running()
        if ctx is not None:  # the causal threshold and the indexer's picks, or None: no window complete
            ctx.cache[(POOLED_KEY, id(attention))] = None if output[1] is None else output[1] == 0

    return [compressor.register_forward_pre_hook(entering, with_kwargs=True), compressor.register_forward_hook(leaving)]


def compressed_call(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    ctx: CallContext,
    kwargs: dict,
) -> torch.Tensor | None:
    """seqpar's attention of a module whose compressor ran in this call (``[B, S/P, H, D]``), else None."""
    if (POOLED_KEY, id(module)) not in ctx.cache:
        return None
    ctx.attended.add(id(module))  # Note [attention went through seqpar]
    pooled, window = ctx.cache.pop((POOLED_KEY, id(module))), kwargs.get("sliding_window")
    out, ctx.choices[getattr(module, "layer_idx", 0)] = compressed_attention(
        query, key, value, pooled, window, scaling, ctx, kwargs.get("s_aux")
    )
    return out.transpose(1, 2).contiguous()


def compressed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pooled_visible: torch.Tensor | None,
    window: int | None,
    scale: float | None,
    ctx: CallContext,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, AttentionChoice]:
    """Each local query attends to its window of the row and the pooled entries allowed it (Note [compressed
    attention]).

    Args:
        q: ``[B, H, S/P, D]`` local queries.
        k: ``[B, 1, S/P + T, D]`` local keys followed by the row's ``T`` pooled entries.
        v: the values, laid out as ``k`` (the same tensor where key = value).
        pooled_visible: ``[B, 1, S/P, T]`` bool, the pooled entries each local query may see, or None (T = 0).
        window: the sliding window in tokens, or None.
        scale: the softmax scale.
        ctx: the call context.
        sinks: ``[H]`` sink logits, or None.

    Returns:
        ``[B, H, S/P, D]``, and the strategy and kernel that computed it (the allgather strategy's gathering).
    """
    local = q.shape[2]
    seq = local * ctx.mesh.sp_size
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    width = v.shape[-1]
    q, k, v = same_head_width(q, k, v)
    keys = gather_sequence(k[:, :, :local], ctx.mesh, dim=2, layout=ctx.layout)  # [B, 1, S, D]
    values = keys if v is k else gather_sequence(v[:, :, :local], ctx.mesh, dim=2, layout=ctx.layout)
    visible = visibility(ctx, q.shape[0], local, q.device, window)
    visible = torch.nn.functional.pad(visible, (0, seq - visible.shape[-1])).expand(q.shape[0], -1, -1, -1)
    if pooled_visible is None:
        pooled_visible = visible.new_zeros(*visible.shape[:-1], k.shape[2] - local)
    allowed = torch.cat([visible, pooled_visible.expand(q.shape[0], -1, -1, -1)], dim=-1)
    keys, values = torch.cat([keys, k[:, :, local:]], dim=2), torch.cat([values, v[:, :, local:]], dim=2)
    kernel = select_kernel(q, keys, values, ctx.kernel, mask=allowed)
    out = masked_attention(q, keys, values, allowed, scale, kernel, sinks)
    return out[..., :width], AttentionChoice("allgather", kernel)
