"""``seqpar.hf.Accelerator``: accelerate's ``Accelerator`` whose ``parallelism_config`` sp/cp degrees run on seqpar.

Change the import and accelerate's sequence- and context-parallel guides run as written, on CPUs and GPUs.

Note [seqpar.hf.Accelerator]
    accelerate runs ``sp_size`` on DeepSpeed's Ulysses and ``cp_size`` on torch's ``context_parallel`` (with
    FSDP2). This subclass builds accelerate without the config (``hidden_parallelism_environment``), reads
    the degrees with ``plan_parallelism`` (Note [accelerate's ParallelismConfig]) and does the rest itself:

    - ``torch_device_mesh``: a DeviceMesh named as accelerate names it (``dp_replicate``, ``dp_shard``,
      ``cp``, ``sp``, flattened ``dp``, ``dp_shard_cp``, ``dp_cp``), so ``torch_device_mesh["sp"]`` is the
      sequence-parallel group; seqpar's own mesh (``seqpar_mesh``) covers the same ranks.
    - ``prepare``: models get the sequence split of ``seqpar.parallelize`` (sp: the Ulysses mesh; cp: one rank
      outside ``maybe_context_parallel``, the cp mesh inside) with the loss hooks of Note [loss under
      seqpar.hf.Accelerator], then DDP-wrapped over every process as accelerate does. A DataLoader yields
      this data-parallel replica's batches (Note [loaders by replica], Note [epoch ends]: ``len``,
      ``set_epoch`` and epochs as one process's; no row repeated); under sp each batch is this rank's
      ``to_shard`` shard (``input_ids``, ``position_ids``, ``shift_labels``, and ``labels``, the same tensor
      as ``shift_labels``, so that the guide's ``model(**batch)`` computes ``outputs.loss``), as DeepSpeed's
      ``UlyssesSPDataLoaderAdapter`` does; under cp the whole batch, the same on every rank of the group.
    - ``maybe_context_parallel``: ``seqpar.context_parallel`` over the cp mesh with the planned strategy
      ("allgather", or "ring" for ``cp_comm_strategy="alltoall"``), zigzag layout.
    - ``gather_for_metrics``: over the replicas (one rank per replica, any row counts); ``gather`` and
      ``reduce`` keep accelerate's meaning (every process). ``accumulate``, ``backward``, ``no_sync``,
      ``clip_grad_norm_`` are accelerate's.

    Without sp or cp (both 1) the config goes to accelerate unchanged. DeepSpeed and FSDP engines are
    refused with sp/cp (DDP reduces the gradients).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from accelerate import Accelerator as _AccelerateAccelerator
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import DistributedType, recursively_apply
from torch.distributed.device_mesh import DeviceMesh

from seqpar.errors import SeqparInputError
from seqpar.hf.accelerate_loss import ShardLoss
from seqpar.hf.batches import replica_of
from seqpar.hf.loaders import ShardingCollator, shard_by_replica
from seqpar.hf.parallelism import (
    ParallelismPlan,
    accelerate_device_mesh,
    hidden_parallelism_environment,
    parallelism_from_environment,
    plan_parallelism,
)
from seqpar.mesh import SequenceParallelMesh
from seqpar.parallel import parallelize
from seqpar.sequence_parallel.comm import all_gather_first_dim
from seqpar.sequence_parallel.context_parallel.context_manager import context_parallel


class Accelerator(_AccelerateAccelerator):
    """accelerate's ``Accelerator`` with ``parallelism_config``'s sp/cp degrees run by seqpar (Note above).

    Takes accelerate's constructor arguments; ``parallelism_config`` is accelerate's ``ParallelismConfig``
    (or read from the environment ``accelerate launch`` exports), built as accelerate documents it.

    Attributes:
        parallelism_plan: what the config means for seqpar (None without sp/cp).
        seqpar_mesh: seqpar's mesh (None without sp/cp).

    Raises:
        SeqparInputError: degrees that do not multiply to the processes, tp_size, settings seqpar cannot honour
            (Note [accelerate's ParallelismConfig]), DeepSpeed or FSDP with sp/cp.
    """

    def __init__(self, *args: object, parallelism_config: object | None = None, **kwargs: object) -> None:
        config = parallelism_config if parallelism_config is not None else parallelism_from_environment()
        self.parallelism_plan: ParallelismPlan | None = None
        self.seqpar_mesh: SequenceParallelMesh | None = None
        if config is None or getattr(config, "sp_size", 1) * getattr(config, "cp_size", 1) == 1:
            super().__init__(*args, parallelism_config=config, **kwargs)
            return
        with hidden_parallelism_environment():
            super().__init__(*args, parallelism_config=None, **kwargs)
        if self.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
            raise SeqparInputError(
                f"seqpar.hf.Accelerator runs sp/cp with DDP over every process, not {self.distributed_type.value}: "
                "launch without the DeepSpeed/FSDP config (the parallelism_config alone)"
            )
        plan = plan_parallelism(None, config, self.num_processes)
        self.parallelism_plan, self._seqpar_config = plan, config
        self.seqpar_mesh = plan.dims.build_mesh()
        self._device_mesh = accelerate_device_mesh(config, self.device.type)
        self._shard_losses: list[tuple[torch.nn.Module, ShardLoss]] = []

    @property
    def parallelism_config(self) -> object | None:
        """The ``ParallelismConfig`` given (or read from the environment)."""
        return self._seqpar_config if self.parallelism_plan is not None else super().parallelism_config

    @property
    def torch_device_mesh(self) -> DeviceMesh | None:
        """The DeviceMesh with accelerate's dimension names (``["sp"]``, ``["cp"]``, ``["dp_cp"]``, ``["dp"]``)."""
        return self._device_mesh if self.parallelism_plan is not None else super().torch_device_mesh

    _cp_size = property(lambda self: self._seqpar_config.cp_size if self.parallelism_plan is not None else 1)

    def prepare(self, *args: object, device_placement: list[bool] | None = None) -> object:
        """accelerate's ``prepare``; models and DataLoaders are readied for sp/cp first (Note above).

        Args:
            *args: models, optimizers, DataLoaders, schedulers, as accelerate takes them.
            device_placement: as accelerate takes it.

        Returns:
            The prepared objects, in order (one object alone, as accelerate returns it).
        """
        if self.parallelism_plan is not None:
            for obj in args:
                if isinstance(obj, torch.nn.Module) and not any(m is obj for m, _ in self._shard_losses):
                    self._prepare_sequence_model(obj)
        return super().prepare(*args, device_placement=device_placement)

    def _prepare_sequence_model(self, model: torch.nn.Module) -> None:
        sequence = self.parallelism_plan.sequence_parallel
        sharded = self._cp_size == 1  # sp: the loader yields shards; cp: whole batches outside the block
        mesh = self.seqpar_mesh if sharded else None
        parallelize(model, mesh, options=sequence.parallelize_options())
        self._shard_losses.append((model, ShardLoss(model, sharded=sharded, layout=sequence.layout)))

    def _prepare_cp(self, *args: object) -> tuple:  # accelerate's torch context parallel: seqpar's is below
        return args

    def prepare_data_loader(
        self, data_loader: torch.utils.data.DataLoader, device_placement: bool | None = None, slice_fn_for_dispatch=None
    ) -> object:
        """This replica's batches (sp: this rank's shards of them); accelerate's preparation otherwise.

        Args:
            data_loader: a DataLoader over a map-style dataset.
            device_placement: as accelerate takes it.
            slice_fn_for_dispatch: as accelerate takes it.

        Returns:
            The prepared DataLoader.

        Raises:
            SeqparInputError: an iterable dataset (its rows would differ within a sequence-parallel group).
        """
        if self.parallelism_plan is None or getattr(data_loader, "_is_accelerate_prepared", False):
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        if device_placement is None:
            device_placement = self.device_placement
        loader = prepare_data_loader(
            data_loader,
            self.device,
            num_processes=self.num_processes,
            process_index=self.process_index,
            split_batches=self.split_batches,
            put_on_device=device_placement,
            rng_types=self.rng_types.copy(),
            dispatch_batches=self.dispatch_batches,
            even_batches=self.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=self.use_seedable_sampler,
            data_seed=self.dataloader_config.data_seed,
            non_blocking=self.non_blocking,
            use_stateful_dataloader=self.use_stateful_dataloader,
        )
        dp_size, dp_rank = replica_of(self.seqpar_mesh)
        loader = shard_by_replica(loader, dp_size, dp_rank, world_size=self.num_processes)
        if self._cp_size == 1:
            sequence = self.parallelism_plan.sequence_parallel
            base = getattr(loader, "base_dataloader", loader)
            base.collate_fn = ShardingCollator(base.collate_fn, self.seqpar_mesh, sequence.layout, sequence.seq_length)
        self._dataloaders.append(loader)
        return loader

    @contextlib.contextmanager
    def maybe_context_parallel(
        self,
        buffers: Sequence[torch.Tensor] | None = None,
        buffer_seq_dims: Sequence[int] | None = None,
        no_restore_buffers: Iterable[torch.Tensor] | None = None,
    ) -> Iterator[None]:
        """Shard ``buffers`` over the cp group with ``seqpar.context_parallel`` for one step (cp_size > 1).

        Args:
            buffers: whole-sequence tensors, the same on every rank of the cp group (input_ids, shift_labels,
                labels, position_ids, attention_mask ...), sharded in place.
            buffer_seq_dims: the sequence dim of each.
            no_restore_buffers: buffers left sharded on exit.

        Yields:
            None; inside, the prepared models run on the shards and ``outputs.loss`` is this rank's share of the
            token mean (Note [loss under seqpar.hf.Accelerator]). Without cp it does nothing, as accelerate's.

        Raises:
            SeqparInputError: on every rank, buffers seqpar cannot shard (``seqpar.context_parallel``).
        """
        if self._cp_size == 1:
            if self.parallelism_plan is None:
                with super().maybe_context_parallel(buffers, buffer_seq_dims, no_restore_buffers):
                    yield
            else:
                yield
            return
        sequence, mesh = self.parallelism_plan.sequence_parallel, self.seqpar_mesh
        buffers, buffer_seq_dims = _distinct(buffers, buffer_seq_dims)
        with contextlib.ExitStack() as stack:
            stack.enter_context(
                context_parallel(
                    mesh,
                    buffers=buffers,
                    buffer_seq_dims=buffer_seq_dims,
                    no_restore_buffers=no_restore_buffers,
                    strategy=sequence.strategy,
                    layout=sequence.layout,
                )
            )
            for model, loss in self._shard_losses:
                parallelize(model, mesh, options=sequence.parallelize_options())
                loss.block = mesh
                stack.callback(self._leave_block, model, loss)
            yield

    def _leave_block(self, model: torch.nn.Module, loss: ShardLoss) -> None:
        sequence = self.parallelism_plan.sequence_parallel
        loss.block = None
        parallelize(model, None, options=sequence.parallelize_options())

    def gather_for_metrics(self, input_data: object, use_gather_object: bool = False) -> object:
        """Gather ``input_data`` over the data-parallel replicas (every rank of a sp/cp group holds the same).

        Args:
            input_data: tensors (any first-dim size per replica), nested in lists/tuples/dicts, or objects.
            use_gather_object: gather with ``all_gather_object`` (lists are concatenated).

        Returns:
            The replicas' data concatenated in replica order; nothing repeated (Note [epoch ends]).
        """
        if self.parallelism_plan is None:
            return super().gather_for_metrics(input_data, use_gather_object)
        dp_size, _ = replica_of(self.seqpar_mesh)
        group = self.seqpar_mesh.device_mesh.get_group("dp") if dp_size > 1 else None
        try:
            recursively_apply(lambda x: x, input_data, error_on_other_type=True)
        except TypeError:
            use_gather_object = True
        if use_gather_object:
            parts = [input_data]
            if group is not None:
                parts = [None] * dp_size
                dist.all_gather_object(parts, input_data, group=group)
            return [x for part in parts for x in (part if isinstance(part, list) else [part])]
        return recursively_apply(lambda t: _gather_rows(t, group), input_data)


def _distinct(buffers: Sequence | None, dims: Sequence | None) -> tuple[list | None, list | None]:
    """``buffers`` with a tensor listed twice at the same dim kept once (accelerate's example passes
    ``labels`` and ``shift_labels`` as one tensor); anything else is left for ``context_parallel`` to judge."""
    if buffers is None or dims is None or len(buffers) != len(dims):
        return buffers, dims
    kept: list[tuple[object, object]] = []
    for b, d in zip(buffers, dims):
        if not any(b is k and d == kd for k, kd in kept):
            kept.append((b, d))
    return [b for b, _ in kept], [d for _, d in kept]


def _gather_rows(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``tensor`` of every rank of ``group`` concatenated along dim 0 (first dims may differ; 0-d become 1-d)."""
    tensor = tensor.detach()
    tensor = tensor[None] if tensor.dim() == 0 else tensor
    if group is None:
        return tensor
    sizes = all_gather_first_dim(torch.tensor([tensor.shape[0]], device=tensor.device), group).tolist()
    padded = tensor.new_zeros((max(sizes), *tensor.shape[1:]))  # equal first dims for one all-gather
    padded[: tensor.shape[0]] = tensor
    parts = all_gather_first_dim(padded, group).split(max(sizes))
    return torch.cat([part[:n] for part, n in zip(parts, sizes)])
