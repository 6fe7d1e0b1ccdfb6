"""TRL's generation-side collectives with each sequence-parallel group acting as one process (one replica).

Used by ``SequenceParallelGRPOTrainer`` around TRL's generation, rewards and advantages (Note [one process per group]).

Note [one process per group]
    TRL's ``GRPOTrainer`` shares prompts out by process (``accelerator.process_index`` slices the gathered
    advantages back, ``accelerator.num_processes`` sizes the generation batch) and gathers completion lengths,
    rewards and logged prompts over every process with ``accelerator.gather`` and accelerate's module-level
    ``gather`` / ``gather_object``. Under sequence parallelism the ``sp_size`` ranks of a group hold the same
    prompts and completions, so gathering over every process would count each row ``sp_size`` times and put
    rows of one group in several places. While TRL generates and scores, the trainer's ``accelerator`` is
    therefore a ``ReplicaAccelerator``: ``num_processes`` is the number of data-parallel replicas,
    ``process_index`` this rank's replica, and its gathers run over the data-parallel group (the ranks that
    hold the same sequence position in every replica), which holds every replica's rows exactly once. TRL
    calls accelerate's module-level ``gather`` and ``gather_object`` by name from its module, so for the
    duration of that call those two names in TRL's module point at the same replica gathers; they are put
    back afterwards, also after an exception. Everything else (device, autocast, unwrapping, the main
    process) is the real Accelerator's.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist

from seqpar.sequence_parallel.comm.collectives import all_gather_first_dim, collective_device


class ReplicaAccelerator:
    """An Accelerator as a trainer's code sees it when every data-parallel replica is one process.

    Attributes:
        num_processes: the data-parallel replicas.
        process_index: this rank's replica.
    """

    def __init__(self, accelerator: object, group: dist.ProcessGroup | None, size: int, rank: int) -> None:
        self._accelerator, self._group = accelerator, group
        self.num_processes, self.process_index = size, rank

    def __getattr__(self, name: str) -> object:
        return getattr(self._accelerator, name)

    def gather(self, tensor: object) -> object:
        """Concatenate every replica's tensor along dim 0 (a scalar becomes one row), as ``accelerate.gather``.

        Args:
            tensor: a tensor, or a list / tuple / dict of them.

        Returns:
            The same structure, gathered over the data-parallel group.
        """
        if isinstance(tensor, (list, tuple)):
            return type(tensor)(self.gather(t) for t in tensor)
        if isinstance(tensor, dict):
            return {k: self.gather(v) for k, v in tensor.items()}
        x = tensor.reshape(1) if tensor.dim() == 0 else tensor
        if self._group is None:
            return x.clone()
        home, dtype = x.device, x.dtype
        moved = x.to(collective_device(self._group), torch.uint8 if dtype == torch.bool else dtype)
        return all_gather_first_dim(moved, self._group).to(home, dtype)

    def gather_object(self, obj: object) -> list:
        """Every replica's list concatenated in replica order (a non-list counts as one item), as accelerate's."""
        items = obj if isinstance(obj, list) else [obj]
        if self._group is None:
            return list(items)
        table: list = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(table, items, group=self._group)
        return [x for part in table for x in part]

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum", scale: float = 1.0) -> torch.Tensor:
        """Sum (or mean) a tensor over the replicas, as ``Accelerator.reduce``."""
        out = tensor.clone()
        if self._group is not None:
            home = out.device
            out = out.to(collective_device(self._group))
            dist.all_reduce(out, group=self._group)
            out = out.to(home)
        if reduction == "mean":
            out = out / self.num_processes
        return out * scale


@contextlib.contextmanager
def replica_collectives(trainer: object, view: ReplicaAccelerator, module_name: str) -> Iterator[None]:
    """Within: ``trainer.accelerator`` is ``view`` and module ``module_name``'s gathers are its (Note [one process
    per group]).

    Args:
        trainer: the trainer whose ``accelerator`` attribute is replaced for the duration.
        view: the replica view of its Accelerator.
        module_name: the trainer's module, whose ``gather`` / ``gather_object`` names are pointed at ``view``.

    Yields:
        None.
    """
    module = sys.modules[module_name]
    saved = trainer.accelerator, getattr(module, "gather", None), getattr(module, "gather_object", None)
    trainer.accelerator = view
    module.gather, module.gather_object = view.gather, view.gather_object
    try:
        yield
    finally:
        trainer.accelerator = saved[0]
        module.gather, module.gather_object = saved[1], saved[2]
