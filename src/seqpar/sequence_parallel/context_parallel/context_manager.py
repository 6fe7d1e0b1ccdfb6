"""``seqpar.context_parallel``: a drop-in for torch's experimental ``context_parallel`` context manager.

Code that calls ``F.scaled_dot_product_attention`` runs sequence-parallel by changing one import.

Note [grad-requiring buffers]
    torch's context manager shards a buffer by resizing it and copying its shard in, and torch refuses to
    resize a tensor that requires grad. seqpar re-points the tensor instead: under ``no_grad``,
    ``buffer.set_(shard)``, where ``shard`` is a fresh contiguous tensor holding this rank's tokens. The
    Python object stays the same (the caller's names, module buffers and the autograd leaf all see the
    shard); only its storage and sizes change. The old storage is kept, untouched and uncopied, by a
    detached alias and set back on exit, so tensors that share it (views, aliases) see the full data
    throughout and writes into a shard inside the block are dropped on exit, as with torch.

    A leaf's ``.grad`` always has the leaf's shape at the time you look. Inside the block the leaf *is*
    its shard, and backward accumulates into ``.grad`` the gradient, with respect to this rank's tokens,
    of the losses of all ranks added together (seqpar's attention sends the key/value gradients home to
    the ranks that own those tokens). On exit a restored leaf's ``.grad`` becomes the full gradient, the
    same on every rank: the ``.grad`` it had at entry (put aside for the block) plus the all-gather of
    the shard's (one all-gather per leaf that got a gradient in the block). A backward after the block
    adds the full gradient too (Note [gradients after the block]), so both orders, and several blocks
    before one backward (gradient accumulation), give the same ``.grad``. The graph keeps what it saved
    of the buffers (Note [buffers saved by the graph]), with torch's in-place check. A leaf in
    ``no_restore_buffers`` stays a shard, and so does its ``.grad`` (sharded at entry if it had one;
    ``context_parallel_unshard`` gathers it). If the block raises, tensors and ``.grad`` are put back as
    they were at entry, without a collective (gradients from a backward inside the block are dropped).

    Tensors that require grad but are not leaves are refused: their ``grad_fn`` expects the full shape;
    shard those differentiably with ``seqpar.shard_sequence``. Parameters are refused (they are
    replicated, never sharded), as torch does. Blocks may shard a leaf with other meshes, layouts or dims
    one after another, but a block may not take a leaf that an enclosing block holds sharded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from seqpar.errors import SeqparInputError
from seqpar.mesh import SequenceParallelMesh, as_sp_mesh
from seqpar.sequence_parallel.context_parallel.autograd import (
    LeafGradients,
    SavedBuffers,
    ShardSpec,
    restore_in_place,
    shard_in_place,
)
from seqpar.sequence_parallel.context_parallel.flex_mode import (
    BLOCK_MASK_PROBLEMS,
    SequenceParallelFlex,
    block_mask_problem,
    block_mask_signature,
    shard_block_masks,
    split_block_masks,
)
from seqpar.sequence_parallel.context_parallel.sdpa_mode import agree_or_raise
from seqpar.sequence_parallel.layouts.chunks import LAYOUTS, chunks_per_rank, gather_sequence
from seqpar.sequence_parallel.strategies import STRATEGIES

_BUFFER_PROBLEMS = (
    "buffers and buffer_seq_dims (seq_dims) have different lengths",
    "a buffer is not a torch.Tensor",
    "an nn.Parameter is in buffers (parameters are replicated, never sharded)",
    "a buffer requires grad but is not a leaf (shard it differentiably with seqpar.shard_sequence)",
    "the same tensor appears twice in buffers",
    "no_restore_buffers is not a subset of buffers",
    "a sequence dim is out of range for its buffer",
    "buffers have different sequence lengths (every buffer must cover the same sequence)",
    "a sequence length does not divide into the layout",
    "unknown strategy or layout",
    "a buffer's .grad does not have the buffer's shape",
    "a leaf that requires grad is already sharded by an enclosing block",
    "a leaf that requires grad, left sharded by no_restore_buffers, would be sharded again while a graph of the "
    "earlier block is alive: unshard it, pass a fresh leaf (t.detach().requires_grad_()) or free that graph",
)
_MASK_PROBLEMS = len(_BUFFER_PROBLEMS)  # codes of the BlockMasks' problems (Note [flex under context_parallel])
_BUFFER_PROBLEMS += BLOCK_MASK_PROBLEMS


def _sp_mesh(mesh: object, where: str) -> SequenceParallelMesh:
    if isinstance(mesh, DeviceMesh) and mesh.ndim != 1:
        raise SeqparInputError(
            f"{where}: the DeviceMesh has {mesh.ndim} dimensions; pass its 1-D sequence sub-mesh "
            "(e.g. mesh['cp']) or a seqpar mesh from seqpar.make_mesh"
        )
    if not isinstance(mesh, (DeviceMesh, SequenceParallelMesh, dist.ProcessGroup)):
        raise SeqparInputError(
            f"{where}: mesh must be a 1-D DeviceMesh, a seqpar mesh (seqpar.make_mesh) or a ProcessGroup, "
            f"not {type(mesh).__name__}"
        )
    return as_sp_mesh(mesh)


def _index_of(tensor: torch.Tensor, tensors: Sequence[torch.Tensor]) -> int:
    # by identity: == on tensors compares values
    return next((i for i, t in enumerate(tensors) if t is tensor), -1)


def _list_problem(buffers: list, dims: list, layout: str) -> tuple[int, str] | None:
    """Problems of the buffer list itself, shared by ``context_parallel`` and ``context_parallel_unshard``."""
    if len(buffers) != len(dims):
        return 0, f"{_BUFFER_PROBLEMS[0]}: {len(buffers)} buffers, {len(dims)} sequence dims"
    if layout not in LAYOUTS:
        return 9, f"layout={layout!r}; choose from {LAYOUTS}"
    for i, b in enumerate(buffers):
        if not isinstance(b, torch.Tensor):
            return 1, f"buffer {i} is a {type(b).__name__}, not a torch.Tensor"
        if not isinstance(dims[i], int) or not -b.dim() <= dims[i] < b.dim():
            return 6, f"buffer {i} has {b.dim()} dims; sequence dim {dims[i]!r} is out of range"
    return None


def _buffer_problem(
    buffers: list, dims: list, skip: list, sp: SequenceParallelMesh, strategy: str, layout: str
) -> tuple[int, str] | None:
    problem = _list_problem(buffers, dims, layout)
    if problem is not None:
        return problem
    if strategy not in STRATEGIES:
        return 9, f"strategy={strategy!r}; choose from {STRATEGIES}"
    for i, b in enumerate(buffers):
        if isinstance(b, torch.nn.Parameter):
            return 2, f"buffer {i}: {_BUFFER_PROBLEMS[2]}"
        if b.requires_grad and not b.is_leaf:
            return 3, f"buffer {i}: {_BUFFER_PROBLEMS[3]}"
        if _index_of(b, buffers) != i:
            return 4, f"buffer {i}: {_BUFFER_PROBLEMS[4]}"
    if any(_index_of(s, buffers) < 0 for s in skip):
        return 5, _BUFFER_PROBLEMS[5]
    lengths = [b.shape[d] for b, d in zip(buffers, dims)]
    if len(set(lengths)) > 1:
        return 7, f"{_BUFFER_PROBLEMS[7]}: lengths {lengths} (slice tables such as RoPE to the sequence length)"
    chunks = sp.sp_size * chunks_per_rank(layout)
    if lengths and lengths[0] % chunks:
        return 8, (
            f"sequence length {lengths[0]} does not divide into the {layout} layout over {sp.sp_size} ranks; "
            f"pad it to a multiple of {chunks}"
        )
    for i, b in enumerate(buffers):
        if b.requires_grad and b.grad is not None and b.grad.shape != b.shape:
            return 10, f"buffer {i}: .grad has shape {tuple(b.grad.shape)}, the buffer {tuple(b.shape)}"
        leaf = LeafGradients.problem(b) if b.requires_grad else None
        if leaf is not None:
            return 11 + leaf, f"buffer {i}: {_BUFFER_PROBLEMS[11 + leaf]}"
    return None


def _masks_problem(masks: list, buffers: list, dims: list, sp: SequenceParallelMesh, layout: str) -> tuple | None:
    """Problems of the BlockMasks among the buffers (Note [flex under context_parallel])."""
    lengths = [b.shape[d] for b, d in zip(buffers, dims)]
    found = block_mask_problem(masks, lengths[0] if lengths else None)
    if found is not None:
        return _MASK_PROBLEMS + found[0], found[1]
    chunks = sp.sp_size * chunks_per_rank(layout)
    if masks and masks[0].seq_lengths[0] % chunks:
        return 8, f"BlockMask length {masks[0].seq_lengths[0]} does not divide into the {layout} layout ({chunks})"
    return None


def _signature(buffers: list, dims: list, strategy: str, layout: str) -> list[int]:
    """Integers every rank must agree on: the options, the buffers' number, sequence length and shapes.

    Computed before the checks' verdict is known, so it copes with malformed lists.
    """
    tensors = [(b, d) for b, d in zip(buffers, dims) if isinstance(b, torch.Tensor) and isinstance(d, int)]
    tensors = [(b, d) for b, d in tensors if -b.dim() <= d < b.dim()]
    length = tensors[0][0].shape[tensors[0][1]] if tensors else -1
    # hash() of a tuple of ints is the same in every process (unlike that of a str)
    shapes = hash(tuple((d, *b.shape, b.dtype.itemsize) for b, d in tensors))
    named = ((strategy, STRATEGIES), (layout, LAYOUTS))
    options = [table.index(name) if name in table else -1 for name, table in named]
    return [*options, len(buffers), length, shapes]


def _describe(row: list[int]) -> str:
    strategy = STRATEGIES[row[0]] if row[0] >= 0 else "?"
    layout = LAYOUTS[row[1]] if row[1] >= 0 else "?"
    masks = f", BlockMasks hash {row[5]}" if len(row) > 5 else ""
    return f"{row[2]} buffers, sequence length {row[3]}, {strategy}/{layout}, shapes/dtypes hash {row[4]}{masks}"


@contextlib.contextmanager
def context_parallel(
    mesh: object,
    *,
    buffers: Sequence[torch.Tensor] | None = None,
    buffer_seq_dims: Sequence[int] | None = None,
    no_restore_buffers: Iterable[torch.Tensor] | None = None,
    strategy: str = "auto",
    layout: str = "zigzag",
) -> Iterator[None]:
    """Shard ``buffers`` along their sequence dims in place and run every SDPA call on the shards with seqpar.

    A drop-in for ``torch.distributed.tensor.experimental.context_parallel``: on entry each buffer (token
    ids, labels shifted *before* the block, position tables, q/k/v) becomes this rank's shard in the
    ``layout`` order that attention assumes; inside, every ``torch.nn.functional.scaled_dot_product_attention``
    call (under any name) runs ``seqpar.attention`` over ``mesh`` with its ``is_causal``, ``scale`` and
    ``enable_gqa``; on exit the buffers are restored, except those in ``no_restore_buffers``, and nothing of
    the block is left behind, also when it raises (no mode, no saved-tensor hooks). Unlike torch's, it runs
    on CPU and GPU, takes buffers that require grad and lets backward run inside or after the block (Note
    [grad-requiring buffers]), serves non-causal attention with the zigzag layout, and offers every seqpar
    strategy. Blocks may nest (the innermost block's mesh serves its SDPA calls). ``sdpa_kernel`` around or
    inside the block does not restrict seqpar, which calls the fused attention ops itself.

    Args:
        mesh: a 1-D DeviceMesh (``init_device_mesh("cpu" | "cuda", (P,))``), a seqpar mesh
            (``seqpar.make_mesh``, hybrid included) or the sequence-parallel ProcessGroup.
        buffers: full-sequence tensors, identical on every rank, to shard in place; leaves that require
            grad included (q/k/v, latents), parameters and other tensors that require grad excluded;
            FlexAttention BlockMasks built on the whole sequence (held as the shard's inside, always restored).
        buffer_seq_dims: the sequence dim of each buffer (ignored for a BlockMask).
        no_restore_buffers: buffers to leave sharded on exit (a subset of ``buffers``); their ``.grad``
            stays this rank's shard.
        strategy: "auto", "ring", "ulysses", "allgather" or "hybrid".
        layout: "zigzag" (balanced causal work) or "contiguous".

    Yields:
        None. Inside the block each buffer is its shard and a leaf's ``.grad`` is its shard's gradient. After
        it a restored leaf's ``.grad`` is the full gradient of the sum of all ranks' losses, identical on
        every rank, whether backward ran inside the block or after it (one all-gather per such leaf, at exit
        or in that backward), added to the ``.grad`` it had at entry.

    Raises:
        SeqparInputError: on every rank before any other collective, if any rank passed a mesh that is not
            1-D or seqpar's, mismatched buffers/dims, buffers of different sequence lengths, a length that
            does not divide into the layout, an ``nn.Parameter``, a non-leaf that requires grad, a
            ``no_restore_buffers`` that is not a subset, a leaf that an enclosing block holds sharded, or a
            ``no_restore_buffers`` leaf sharded again while the earlier block's graph lives, a BlockMask
            that does not cover the sequence or depends on the head; inside the block, for an SDPA call with
            an ``attn_mask`` other than a key-padding mask (Note [key-padding masks]), ``dropout_p > 0``, or
            tokens that are not the buffers' shard (cross-attention to a text, joint [text; shard] attention:
            Note [foreign keys]), a flex call that the block cannot serve (flex_mode).
        RuntimeError: from a backward, as torch's "modified by an inplace operation", if a buffer saved by
            the graph was changed in place inside the block after it was saved.
    """
    sp = _sp_mesh(mesh, "seqpar.context_parallel")
    buffers = list(buffers) if buffers is not None else []
    dims = list(buffer_seq_dims) if buffer_seq_dims is not None else []
    skip = list(no_restore_buffers) if no_restore_buffers is not None else []
    buffers, dims, masks = split_block_masks(buffers, dims)  # BlockMasks are always restored
    skip = [s for s in skip if not any(s is m for m in masks)]
    problem = _buffer_problem(buffers, dims, skip, sp, strategy, layout)
    problem = problem if problem is not None or not masks else _masks_problem(masks, buffers, dims, sp, layout)
    signature = [*_signature(buffers, dims, strategy, layout), block_mask_signature(masks)]
    agree_or_raise(sp.sp_group, "seqpar.context_parallel", problem, _BUFFER_PROBLEMS, signature, _describe)
    specs = [ShardSpec.of(b, d, sp, layout) for b, d in zip(buffers, dims)]
    restored = [_index_of(b, skip) < 0 for b in buffers]
    with torch.no_grad():
        kept = shard_in_place(buffers, specs, restored)
    saved, leaves, finished = SavedBuffers(buffers), [], False
    try:
        for b, spec, restore in zip(buffers, specs, restored):  # Note [gradients after the block]
            if b.requires_grad:
                record = LeafGradients.of(b)
                leaves.append((record, *record.enter(b, spec, restore)))
        local = buffers[0].shape[dims[0]] if buffers else None  # sharded by now (Note [foreign keys])
        with saved, shard_block_masks(masks, sp), SequenceParallelFlex(sp, strategy, layout, seq_len=local):
            yield
        finished = True
    finally:
        saved.freeze()
        for record, arm, _node in leaves:
            record.leave(arm)
        leaves.clear()  # the block's AccumulateGrad nodes now live as long as its graph
        with torch.no_grad():
            restore_in_place(buffers, specs, restored, kept, gather=finished)


def context_parallel_unshard(
    mesh: object, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int], *, layout: str = "zigzag"
) -> list[torch.Tensor]:
    """The full sequences of tensors sharded by ``context_parallel`` (outputs, gradients), on every rank.

    Args:
        mesh: the mesh the block ran on.
        buffers: this rank's shards (same shapes on every rank).
        seq_dims: the sequence dim of each.
        layout: the block's layout.

    Returns:
        One full-sequence tensor per buffer, in global order (not differentiable, like torch's).

    Raises:
        SeqparInputError: on every rank, if any rank passed mismatched lists, dims out of range, a local
            length that does not divide into the layout, or shapes that differ across ranks.
    """
    sp = _sp_mesh(mesh, "seqpar.context_parallel_unshard")
    buffers, dims = list(buffers), list(seq_dims)
    problem = _list_problem(buffers, dims, layout)
    if problem is None:
        bad = [i for i, (b, d) in enumerate(zip(buffers, dims)) if b.shape[d] % chunks_per_rank(layout)]
        problem = (8, f"local lengths of buffers {bad} do not divide into the {layout} layout") if bad else None
    signature = _signature(buffers, dims, "auto", layout)
    where = "seqpar.context_parallel_unshard"
    agree_or_raise(sp.sp_group, where, problem, _BUFFER_PROBLEMS, signature, _describe)
    with torch.no_grad():
        return [gather_sequence(b, sp, dim=d, layout=layout) for b, d in zip(buffers, dims)]
