"""Dataloaders that give every rank the rows of its data-parallel replica, not of its process.

Note [loaders by replica]
    accelerate shards the Trainer's dataloader over processes: a ``BatchSamplerShard`` hands batch
    ``i`` to process ``i mod world``. Under sequence parallelism the ranks of one SP group must hold the
    *same* rows (each takes a slice of their tokens), so the unit that gets distinct batches is the
    data-parallel replica. The Trainer subclass therefore takes the dataloader accelerate prepared and
    points its batch-sampler shard at the replicas: ``num_processes = dp`` and ``process_index = dp
    rank``, attributes the shard reads at every iteration (transformers does the same for its own
    rank-aware samplers). Sampling order is unchanged (accelerate seeds it identically on every
    process), so ranks of one group get identical batches, and ``shard_step`` verifies that they do.
    Iterable datasets are sharded inside the dataset or dispatched from process 0 by accelerate, which
    cannot be redirected this way; they are refused.

Note [epoch ends]
    One process training on batches of ``dp x B`` rows sees, at the end of an epoch whose rows do not fill
    the last batch, a short batch of the ``r`` rows left. accelerate's ``even_batches`` (its default for
    training) would instead top every replica's last batch up with rows from the start of the epoch, so
    those rows would be trained on twice in that step and every step after it would differ. For training,
    the shard is made a ``ReplicaBatchSampler``: replica ``j`` gets batch ``j`` of every round of ``dp``
    consecutive batches as it is (the last one short), and an *empty* batch ``[]`` in a last round that has
    no batch left for it. Every replica thus has the same number of micro-batches per epoch (the Trainer's
    step count and the DDP/FSDP collectives stay in step), and the rows of a step are exactly those one
    process sees. The collate function is wrapped so that an empty batch becomes a batch of zero rows,
    which ``to_shard`` turns into a tiny padding batch whose labels are all ignored: the replica runs its
    forward and backward with zero tokens, adding exactly nothing to the loss (already normalised by the
    step's token count over every rank) or to the gradients. With ``dataloader_drop_last=True`` the
    incomplete last round is dropped, as one process drops its short batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, Sampler

from seqpar.errors import SeqparInputError
from seqpar.hf.batches import SequenceShard, replica_of, shard_step, to_shard
from seqpar.mesh import SequenceParallelMesh


class ReplicaBatchSampler(BatchSamplerShard):
    """The batches of one data-parallel replica: batch ``dp_rank`` of every round of ``dp`` (Note [epoch ends]).

    Never repeats a row: a last round without a batch for this replica yields ``[]``; a short batch stays short.
    """

    def __len__(self) -> int:
        n = len(self.batch_sampler)
        if self.split_batches:  # each batch is shared out among the replicas (a short one dropped by drop_last)
            return n
        return n // self.num_processes if self.drop_last else math.ceil(n / self.num_processes)

    def __iter__(self) -> Iterator[list[int]]:
        return self._split() if self.split_batches else self._rounds()

    def _rounds(self) -> Iterator[list[int]]:
        round_: list[list[int]] = []
        for batch in self.batch_sampler:
            round_.append(batch)
            if len(round_) == self.num_processes:
                yield round_[self.process_index]
                round_ = []
        if round_ and not self.drop_last:
            yield round_[self.process_index] if self.process_index < len(round_) else []

    def _split(self) -> Iterator[list[int]]:
        # one batch of dp x B rows per step, sliced by replica; the short last batch is sliced as it is
        for batch in self.batch_sampler:
            width = self.batch_sampler.batch_size // self.num_processes
            yield list(batch[width * self.process_index : width * (self.process_index + 1)])


class _EmptyAwareCollator:
    """The loader's collate function, except that an empty batch becomes a batch of zero rows."""

    def __init__(self, collate: Callable) -> None:
        self.collate = collate

    def __call__(self, features: list) -> object:
        if len(features) == 0:
            return {"input_ids": torch.zeros(0, 0, dtype=torch.long)}
        return self.collate(features)


def shard_by_replica(loader: object, dp_size: int, dp_rank: int, *, world_size: int, even_batches: bool | None = None):
    """Make an accelerate-prepared dataloader yield this data-parallel replica's batches (Note [loaders by replica]).

    Args:
        loader: the dataloader returned by ``Trainer.get_train_dataloader`` / ``get_eval_dataloader``.
        dp_size: data-parallel replicas (world size / sp size).
        dp_rank: this rank's replica.
        world_size: processes in the job (accelerate's ``num_processes``).
        even_batches: None for training: every replica gets the same number of batches, the last ones as
            one process would see them, empty where a replica has no row left (Note [epoch ends]); False:
            replicas may get one batch fewer (evaluation, which evens them out itself).

    Returns:
        The same loader.

    Raises:
        SeqparInputError: a loader whose batches accelerate assigns per process in another way (an
            iterable dataset, batches dispatched from one process).
    """
    if world_size == 1:
        return loader
    candidates = (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None))
    shard = next((s for s in candidates if isinstance(s, BatchSamplerShard)), None)
    if shard is None:
        raise SeqparInputError(
            f"seqpar.hf needs a map-style dataset (with __len__) batched per process by accelerate; got a "
            f"{type(loader).__name__} over {type(getattr(loader, 'dataset', None)).__name__}. Iterable datasets are "
            "sharded per process by accelerate, which would give the ranks of a sequence-parallel group different rows"
        )
    shard.num_processes = dp_size
    shard.process_index = dp_rank
    if even_batches is not None:
        shard.even_batches = even_batches
        return loader
    # the shard object belongs to this loader alone; its class decides how the rounds end (Note [epoch ends])
    shard.__class__ = ReplicaBatchSampler
    base = getattr(loader, "base_dataloader", loader)  # accelerate's adapter iterates its base loader
    if not isinstance(base.collate_fn, _EmptyAwareCollator):
        base.collate_fn = _EmptyAwareCollator(base.collate_fn)
    return loader


class _EpochOrder(Sampler[int]):
    """Every row once per epoch: in order, or in a permutation drawn from ``seed + epoch`` (the same on every rank)."""

    def __init__(self, size: int, shuffle: bool, seed: int) -> None:
        self.size, self.shuffle, self.seed, self.epoch = size, shuffle, seed, 0

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(self.size))
        return iter(torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist())


class _ReplicaLoader(DataLoader):
    """A DataLoader over one replica's batches whose ``set_epoch`` reshuffles as ``DistributedSampler`` does."""

    def set_epoch(self, epoch: int) -> None:
        """Draw the next epoch's order (call it before every epoch when shuffling)."""
        self.batch_sampler.batch_sampler.sampler.epoch = epoch


def replica_loader(
    dataset: object,
    mesh: object,
    *,
    batch_size: int,
    collate_fn: Callable,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    **loader_options: object,
) -> DataLoader:
    """A DataLoader of this data-parallel replica's batches for hand-written (accelerate) loops.

    The rows are ordered once per epoch, the same on every rank, and batch ``j`` of every round of ``dp``
    consecutive batches of ``batch_size`` rows goes to replica ``j``: the rows of one round are one process's
    batch of ``dp x batch_size``, no row is repeated at the end of an epoch, and every replica has the same
    number of batches (an empty one becomes a zero-token padding batch in ``shard_step``; Note [epoch ends]).
    Do not ``accelerator.prepare`` it: accelerate would shard it by process.

    Args:
        dataset: a map-style dataset (with ``__len__``).
        mesh: the mesh from ``seqpar.make_mesh`` (its "dp" axis numbers the replicas).
        batch_size: rows per replica per batch.
        collate_fn: the collator (e.g. ``DataCollatorWithFlattening()``).
        shuffle: draw a new order every epoch from ``seed + epoch`` (call ``loader.set_epoch(epoch)``).
        seed: the shuffling seed, the same on every rank.
        drop_last: drop the last round when it is not complete, as one process drops a short batch.
        **loader_options: other ``DataLoader`` arguments (``num_workers``, ``pin_memory`` ...).

    Returns:
        The DataLoader (with ``set_epoch``).
    """
    dp_size, dp_rank = replica_of(mesh)
    batches = BatchSampler(_EpochOrder(len(dataset), shuffle, seed), batch_size, drop_last)
    sampler = ReplicaBatchSampler(batches, num_processes=dp_size, process_index=dp_rank)
    return _ReplicaLoader(dataset, batch_sampler=sampler, collate_fn=_EmptyAwareCollator(collate_fn), **loader_options)


def replica_sampler(
    dataset: Sequence, mesh: SequenceParallelMesh, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False
) -> DistributedSampler:
    """A sampler giving every rank the rows of its data-parallel replica (the same rows within an SP group).

    Like ``DistributedSampler`` it repeats rows to give every replica as many when ``drop_last=False`` and
    the dataset does not divide by dp; ``seqpar.hf.replica_loader`` never repeats a row (Note [epoch ends]).

    For hand-written loops: pass it to a plain ``DataLoader`` (do not ``accelerator.prepare`` that loader:
    accelerate would shard it by process instead). Call ``set_epoch`` on it every epoch when shuffling.

    Args:
        dataset: a map-style dataset.
        mesh: the mesh from ``seqpar.make_mesh`` (its "dp" axis numbers the replicas).
        shuffle: as in ``torch.utils.data.DistributedSampler``.
        seed: as in ``DistributedSampler``.
        drop_last: as in ``DistributedSampler``.

    Returns:
        A ``DistributedSampler`` over the data-parallel replicas.
    """
    dp_size, dp_rank = replica_of(mesh)
    return DistributedSampler(
        dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )


class ShardingCollator:
    """The loader's collate function followed by sharding: each batch becomes this rank's shard.

    In the main process (``num_workers=0``) every rank shards through ``shard_step`` over the whole job, so one
    rank's bad batch raises on every rank and a group whose ranks loaded different rows is caught (Note [one
    exchange per step]); every replica has as many batches (Note [epoch ends]), so the ranks call it in step.
    A worker process cannot take part in collectives and checks its own batch only.
    """

    def __init__(self, collate: object, mesh: SequenceParallelMesh, layout: str, seq_length: int | None) -> None:
        self.collate, self.mesh, self.layout, self.seq_length = collate, mesh, layout, seq_length

    def __call__(self, features: list) -> SequenceShard:
        batch, options = self.collate(features), {"layout": self.layout, "seq_length": self.seq_length}
        if torch.utils.data.get_worker_info() is None and dist.is_initialized():
            shard = shard_step([batch], self.mesh, group=dist.group.WORLD, **options).shards[0]
        else:
            shard = to_shard(batch, self.mesh, **options)
        shard["labels"] = shard["shift_labels"]  # so that model(**batch) computes outputs.loss (already shifted)
        return shard
