"""``seqpar.context_parallel``'s in-place sharding and the autograd around it: saved buffers, leaves' ``.grad``.

``shard_in_place`` re-points each buffer at its shard on entry and ``restore_in_place`` back on exit (Note
[grad-requiring buffers] in ``context_parallel``); the hooks here keep graphs built inside a block valid after it.

Note [buffers saved by the graph]
    Restoring a buffer (``b.set_(original)``) bumps its version counter, which its views share, and a
    graph that saved the buffer itself keeps that very TensorImpl, which now holds the full tensor. So
    while a block is open, ``SavedBuffers`` is the ``saved_tensors_hooks`` pair: a saved tensor that lives
    in a buffer's shard storage (the buffer, or any view of it) is packed as ``t.data``, a new TensorImpl
    on the same storage with its own version counter, which the restore neither re-points nor bumps.
    Torch skips its own in-place check for hooked saved tensors, so unpack makes it: a buffer's version at
    pack time must equal its version now (inside the block) or when the block exited; any other saved
    tensor keeps a detached alias (sharing its version counter, no reference cycle) and is checked the
    same way. Hooks set before the block (``save_on_cpu``, offloading) still get every saved tensor:
    ``pack`` hands them on, the shard aliases included (the version check of other tensors then rests
    with those hooks, as in torch); hooks set inside the block (activation checkpointing) take
    precedence in their region, as ``saved_tensors_hooks`` nesting does.

Note [gradients after the block]
    ``set_`` gives a leaf a new ``AccumulateGrad`` node (the node records the leaf's shape), so each
    block has its own: made for the shard on entry, held by the block until exit, and reached by every
    gradient edge the block's graph has to the leaf; the restore on exit leaves it to that graph. A
    backward after the block brings the node the shard's gradient while the leaf is full again. Python
    hooks cannot change a gradient's size, and ``AccumulateGrad`` would copy a shard into a full
    ``.grad`` (a size error, or a broadcast). So a pre-hook on the node (it runs only when the node does,
    not for ``torch.autograd.grad``'s captured inputs) moves ``.grad`` aside and lets the node add into a
    shard-sized zero ``.grad``; the leaf's post-accumulate hook then all-gathers that over the block's
    group (every rank runs the same backward, so the collective is symmetric) and sets ``.grad`` to what
    was moved aside plus the full gradient. Each node knows its block's sharding, so blocks with other
    meshes, layouts or dims mix exactly; while a later block holds the leaf sharded otherwise (open, or
    left so by ``no_restore_buffers``) the leaf takes its shard of the gathered gradient. The hooks of one
    leaf share a ``LeafGradients`` record, an attribute of the tensor, which also knows whose shard the leaf
    is, whether a block has it open (one at a time: a nested block may not take it again), and the full
    shapes of the blocks whose nodes a graph still holds (each hook tells the record when its node is
    freed): a ``no_restore_buffers`` leaf stays a shard, so no block may shard it again while such a graph
    lives. After the block the leaf's own node is a new
    one, outside the block's graph: ``backward(inputs=[leaf])`` and ``torch.autograd.grad`` with respect to
    the leaf see no use of it there (torch's rules for an unused input); call them inside the block.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.graph import get_gradient_edge, saved_tensors_hooks

from seqpar.mesh import SequenceParallelMesh
from seqpar.sequence_parallel.layouts.chunks import gather_sequence, shard_for_rank

_ATTRIBUTE = "_seqpar_context_parallel_grads"  # where a leaf keeps its LeafGradients record
# The hooks set before a block, to hand saved tensors on to (None where this torch does not say).
_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_LAYOUT_POLICY = getattr(torch.autograd, "enforce_grad_layout_policy", None)  # torch >= 2.13


@dataclass(frozen=True)
class ShardSpec:
    """How one block shards one buffer: enough to gather its gradient, and to compare two blocks."""

    mesh: SequenceParallelMesh
    dim: int
    layout: str
    full: torch.Size
    shard: torch.Size

    @staticmethod
    def of(buffer: torch.Tensor, dim: int, mesh: SequenceParallelMesh, layout: str) -> ShardSpec:
        dim %= buffer.dim()
        shard = list(buffer.shape)
        shard[dim] //= mesh.sp_size
        return ShardSpec(mesh, dim, layout, buffer.shape, torch.Size(shard))

    @property
    def key(self) -> tuple:
        """Equal for two blocks whose shards (and so whose gradients) of the buffer are the same."""
        group = self.mesh.sp_group
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
        return ranks, self.dim, self.layout, tuple(self.full)


def shard_in_place(buffers: list, specs: list[ShardSpec], restored: list[bool]) -> list:
    """Point every buffer at a new storage holding its shard (Note [grad-requiring buffers] in context_parallel).

    Returns, per buffer, the alias of its old storage and the ``.grad`` put aside for the block (restored
    leaves; a ``no_restore_buffers`` leaf's ``.grad`` is sharded along with it instead).
    """
    shards = [
        shard_for_rank(b, s.mesh.sp_rank, s.mesh.sp_size, s.dim, s.layout).clone(memory_format=torch.contiguous_format)
        for b, s in zip(buffers, specs)
    ]
    kept = []
    for b, s, shard, restore in zip(buffers, specs, shards, restored):
        grad = b.grad if b.requires_grad else None
        kept.append((b.detach(), grad if restore else None))  # the alias keeps sizes, strides and offset
        if grad is not None:
            b.grad = None
        b.set_(shard)
        if grad is not None and not restore:
            b.grad = shard_for_rank(grad, s.mesh.sp_rank, s.mesh.sp_size, s.dim, s.layout).clone(
                memory_format=torch.contiguous_format
            )
    return kept


def restore_in_place(buffers: list, specs: list[ShardSpec], restored: list[bool], kept: list, gather: bool) -> None:
    """Set the buffers back; a restored leaf's ``.grad`` becomes what was put aside plus the gathered shard's."""
    shard_grads = []
    for b, spec, restore, (original, aside) in zip(buffers, specs, restored, kept):
        if not restore:
            continue
        grad = b.grad if b.requires_grad else None
        if grad is not None:
            b.grad = None
        b.set_(original)
        if b.requires_grad:
            b.grad = aside
        if grad is not None and gather:
            shard_grads.append((b, grad, spec))
    for b, grad, spec in shard_grads:  # after every restore, so a failing collective leaves them restored
        full = gather_sequence(grad, spec.mesh, dim=spec.dim, layout=spec.layout)
        b.grad = full if b.grad is None else b.grad + full


class _Claim:
    """One buffer of an open or closed block: its version then, for the in-place check."""

    __slots__ = ("buffer", "exit_version")

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer, self.exit_version = buffer, None

    def version(self) -> int:
        return self.buffer._version if self.exit_version is None else self.exit_version


class _Packed:
    __slots__ = ("claim", "data", "outer_unpack", "version")

    def __init__(self, data: object, version: int | None, claim: _Claim | None, outer_unpack: object) -> None:
        self.data, self.version, self.claim, self.outer_unpack = data, version, claim, outer_unpack


def _storage_key(t: torch.Tensor) -> tuple | None:
    if not t.numel() or t.layout != torch.strided:
        return None
    try:
        return t.device, t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses, meta and fake tensors
        return None


class SavedBuffers(saved_tensors_hooks):
    """The saved-tensor hooks of one block (Note [buffers saved by the graph]); enter after sharding."""

    def __init__(self, buffers: Sequence[torch.Tensor]) -> None:
        super().__init__(self._pack, self._unpack)
        self.buffers, self.claims, self.outer = buffers, {}, None

    def __enter__(self) -> None:
        self.claims = {_storage_key(b): _Claim(b) for b in self.buffers}  # the shards' storages by now
        self.claims.pop(None, None)
        try:
            self.outer = _TOP_HOOKS(True) if _TOP_HOOKS is not None else None
        except (TypeError, RuntimeError):  # a torch whose private signature differs: no hooks to hand on
            self.outer = None
        super().__enter__()

    def freeze(self) -> None:
        """Call at exit, before any buffer is restored: later version changes are the restore's."""
        for claim in self.claims.values():
            claim.exit_version = claim.buffer._version

    def _pack(self, t: torch.Tensor) -> _Packed:
        claim = self.claims.get(_storage_key(t)) if self.claims else None
        outer_pack, outer_unpack = self.outer if self.outer is not None else (None, None)
        if claim is not None:
            data = t.data  # same storage, own TensorImpl and version counter
            version = claim.buffer._version
        else:
            data = t.detach()  # shares t's version counter; holds no grad_fn (no reference cycle)
            version = None if outer_pack is not None else data._version
        if outer_pack is not None:
            data = outer_pack(data)
        return _Packed(data, version, claim, outer_unpack)

    @staticmethod
    def _unpack(packed: _Packed) -> torch.Tensor:
        data = packed.data if packed.outer_unpack is None else packed.outer_unpack(packed.data)
        if packed.version is not None:
            now = packed.claim.version() if packed.claim is not None else packed.data._version
            if now != packed.version:
                where = " (a seqpar.context_parallel buffer, changed inside the block)" if packed.claim else ""
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: [{data.type()} {list(data.shape)}]{where} is at version {now}; expected "
                    f"version {packed.version} instead. Hint: enable anomaly detection to find the operation "
                    "that failed to compute its gradient, with torch.autograd.set_detect_anomaly(True)."
                )
        return data


class LeafGradients:
    """What one leaf's gradient hooks share (Note [gradients after the block]); an attribute of the leaf."""

    def __init__(self, leaf: torch.Tensor) -> None:
        self.held: ShardSpec | None = None  # whose shard the leaf is now: an open block's, or a no_restore one's
        self.open = False
        self.live: dict[int, tuple[int, ...]] = {}  # id of a hook on a node not freed yet: its block's full shape
        self.armed: tuple[ShardSpec, ShardSpec | None] | None = None
        self.aside, self.policy = None, None
        leaf.register_post_accumulate_grad_hook(self._gather)

    @staticmethod
    def of(leaf: torch.Tensor) -> LeafGradients:
        record = getattr(leaf, _ATTRIBUTE, None)
        if record is None:
            record = LeafGradients(leaf)
            setattr(leaf, _ATTRIBUTE, record)
        return record

    @staticmethod
    def problem(leaf: torch.Tensor) -> int | None:
        """0: ``leaf`` is open in a block already; 1: a live graph of an earlier block sharded another shape."""
        record = getattr(leaf, _ATTRIBUTE, None)
        if record is None:
            return None
        if record.open:
            return 0
        return 1 if any(full != tuple(leaf.shape) for full in record.live.values()) else None

    def enter(self, leaf: torch.Tensor, spec: ShardSpec, restore: bool) -> tuple[_Arm, object]:
        """Hook the shard-shaped leaf's new AccumulateGrad node; the block holds both until ``leave``."""
        arm = _Arm(leaf, self, spec, restore, self.held)
        node = get_gradient_edge(leaf).node
        node.register_prehook(arm)
        self.held, self.open, self.live[id(arm)] = spec, True, tuple(spec.full)
        weakref.finalize(arm, self.live.pop, id(arm), None)
        return arm, node

    def leave(self, arm: _Arm) -> None:
        arm.open = self.open = False
        if arm.restore:
            self.held = arm.before

    def _gather(self, leaf: torch.Tensor) -> None:
        if self.armed is None:
            return
        (spec, reshard), shard, aside = self.armed, leaf.grad, self.aside
        self.armed, self.aside = None, None
        if self.policy is not None:
            self.policy.__exit__(None, None, None)
            self.policy = None
        leaf.grad = aside
        full = gather_sequence(shard, spec.mesh, dim=spec.dim, layout=spec.layout)
        if reshard is not None:  # the leaf is another block's shard now: its shard of the gradient
            full = shard_for_rank(full, reshard.mesh.sp_rank, reshard.mesh.sp_size, reshard.dim, reshard.layout)
        leaf.grad = full if aside is None else aside + full


class _Arm:
    """The pre-hook of one block's AccumulateGrad node of a leaf: makes room for a shard-shaped gradient."""

    def __init__(
        self, leaf: torch.Tensor, record: LeafGradients, spec: ShardSpec, restore: bool, before: ShardSpec | None
    ) -> None:
        self.leaf, self.record, self.spec = leaf, record, spec  # the node holds the leaf anyway
        self.open, self.restore, self.before = True, restore, before

    def __call__(self, grads: tuple) -> None:
        leaf, record, spec, grad = self.leaf, self.record, self.spec, grads[0]
        if self.open or not self.restore or grad is None or record.armed is not None:
            return None  # the leaf is this block's shard (inside it, or left sharded): nothing to change
        now = record.held  # None: the leaf is whole again
        if now is not None and now.key == spec.key:
            return None  # the leaf is a shard just like this block's
        want = spec.full if now is None else now.shard
        if (spec.full == spec.shard and now is None) or grad.shape != spec.shard or leaf.shape != want:
            return None  # one rank, or not a gradient of this block's shard: AccumulateGrad takes it as it is
        record.armed, record.aside = (spec, now), leaf.grad
        room = torch.empty_strided(leaf.shape, [0] * leaf.dim(), dtype=leaf.dtype, device=leaf.device)
        leaf.grad = room
        room.set_(torch.zeros_like(grad))  # AccumulateGrad adds the gradient into it
        if _LAYOUT_POLICY is not None:  # the shard's strides are not the leaf's: no warning about it
            record.policy = _LAYOUT_POLICY(False)
        return None
