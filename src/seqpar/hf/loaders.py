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
"""

from __future__ import annotations

from accelerate.data_loader import BatchSamplerShard

from seqpar.errors import SeqparInputError

__all__ = ["shard_by_replica"]


def shard_by_replica(loader: object, dp_size: int, dp_rank: int, *, world_size: int, even_batches: bool | None = None):
    """Make an accelerate-prepared dataloader yield this data-parallel replica's batches (Note [loaders by replica]).

    Args:
        loader: the dataloader returned by ``Trainer.get_train_dataloader`` / ``get_eval_dataloader``.
        dp_size: data-parallel replicas (world size / sp size).
        dp_rank: this rank's replica.
        world_size: processes in the job (accelerate's ``num_processes``).
        even_batches: when given, whether replicas are topped up to the same number of batches.

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
