"""Sequence parallel composed with data and tensor parallel on one mesh (4 gloo ranks) trains like one process.

Every path (plain gradient reduction, DDP and FSDP2 with and without their no-sync contexts, FSDP2 with its
parameters, gradients and optimizer state in host memory, hybrid ring x ulysses, tensor parallel) at gradient
accumulation 1 and 2 (the no-sync contexts at 2: at 1 no micro-batch runs inside them), on packed documents:
per-step loss and gradient norm (rel 1e-5) and parameters after 3 plain SGD steps (rel 1e-4) equal one process.
SGD, not Adam: Adam's first update is about the sign of the gradient, so a gradient scaled on some elements would
hide.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy

import seqpar
from seqpar.errors import SeqparInputError
from tests._dist import run_ranks
from tests._models import SEQ, build, documents_alone_history, tokens

# Packed rows: documents restart their position ids; edges fall inside shards and chunks at 2 and 4 ranks.
DOCUMENTS = [(13, 21, 14), (30, 18), (48,), (7, 7, 34)]
STEPS, LR = 3, 1.0  # plain SGD: a gradient scaled on some elements moves those parameters by that much
LOSS_TOL = dict(atol=1e-6, rtol=1e-5)  # per-step loss and gradient norm
# parameters after the SGD steps, whose steps are linear in the gradient (no Adam: Note [AdamW floors]): one fp32
# process (eager or SDPA attention) is 70 times inside this bound of the same steps in float64, entry by entry
PARAM_TOL = dict(atol=1e-6, rtol=1e-4)


def packed_rows(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: 4 packed rows of SEQ tokens and their position ids."""
    ids = tokens(len(DOCUMENTS), SEQ, 20 + step)
    positions = torch.stack([torch.cat([torch.arange(n) for n in docs]) for docs in DOCUMENTS])
    return ids, positions


def _reference(model, steps):
    """One process, every document run by itself: per-step (loss, gradient norm), SGD updates."""
    return documents_alone_history(model, lambda step: packed_rows(step)[0], DOCUMENTS, steps, LR, float("inf"))


def _parallel(model, forward, mesh, group, dp_rank, dp_size, accumulation, *, reduce=None, no_sync=None):
    """SGD steps on this rank's shards of each micro-batch; per-step (loss, gradient norm) of the whole batch.

    ``forward`` is the (possibly wrapped) model to call; ``model`` owns the parameters. ``group`` is the
    dp x sp group: ``reduce_gradients`` runs over it with buckets of ``reduce`` MiB when given (no DDP/FSDP).
    ``no_sync`` wraps every micro-batch but the last.
    """
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    history = []
    for step in range(STEPS):
        ids, positions = packed_rows(step)
        micro = [
            {"input_ids": i.chunk(dp_size)[dp_rank], "position_ids": p.chunk(dp_size)[dp_rank]}
            for i, p in zip(ids.chunk(accumulation), positions.chunk(accumulation))
        ]
        shards = [seqpar.shard_batch(b, mesh) for b in micro]
        total = seqpar.count_valid_tokens([s["shift_labels"] for s in shards], group)
        step_loss = torch.zeros(())
        for m, shard in enumerate(shards):
            last = m == len(shards) - 1
            with contextlib.nullcontext() if last or no_sync is None else no_sync():
                logits = forward(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
                loss = seqpar.cross_entropy(logits, shard["shift_labels"], num_valid_tokens=total)
                loss.backward()
            step_loss += loss.detach()
        if reduce is not None:
            seqpar.reduce_gradients(model.parameters(), group, bucket_mb=reduce)
        norm = seqpar.clip_grad_norm_(model.parameters(), max_norm=float("inf"))  # DTensor-aware
        opt.step()
        opt.zero_grad()
        history.append(torch.stack([seqpar.sum_over(step_loss, group), norm]))
    return torch.stack(history)


def _assert_same_training(got, want, model, reference_model, what):
    torch.testing.assert_close(got, want, **LOSS_TOL, msg=lambda m: f"{what} (loss, grad norm) per step: {m}")
    for (name, p), q in zip(model.named_parameters(), reference_model.parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        torch.testing.assert_close(full.detach(), q.detach(), **PARAM_TOL, msg=lambda m, n=name: f"{what} {n}: {m}")


def _summing_comm_hook(group, bucket):
    """The DDP hook seqpar once used: it sums a bucket that may already hold reduced gradients."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


@functools.cache
def _trained_reference():
    """The model both worker families start from and its one-process SGD run: computed once per rank process
    (the pool's ranks run many cases), each case works on copies."""
    ref = build("llama").train()
    reference_model = copy.deepcopy(ref)
    want = _reference(reference_model, STEPS)
    return ref, reference_model, want


def _reference_copies():
    ref, reference_model, want = (copy.deepcopy(x) for x in _trained_reference())
    moved = max(
        float((p.detach() - q.detach()).abs().max()) for p, q in zip(reference_model.parameters(), ref.parameters())
    )
    assert moved > 1e-2, f"SGD must move the parameters visibly (largest change {moved})"
    return ref, reference_model, want


def _dp_sp_mesh():
    mesh = seqpar.make_mesh(sp_size=2, dp_size=2)
    assert mesh.sp_size == 2 and mesh.device_mesh["dp"].size() == 2
    group = seqpar.data_parallel_group(mesh)
    assert dist.get_world_size(group) == 4
    return mesh, mesh.device_mesh.get_local_rank("dp"), group


DP_MODES = ("reduce", "ddp", "ddp-no-sync", "fsdp", "fsdp-no-sync", "fsdp-offload")
# the no-sync contexts at accumulation 2 only: at 1 the one micro-batch is the last, run outside them (as "ddp", "fsdp")
DP_CASES = [
    (mode, accumulation, "dp2-sp2")
    for mode in DP_MODES
    for accumulation in (1, 2)
    if accumulation == 2 or not mode.endswith("no-sync")
]
# a hybrid mesh (ring 2 x ulysses 2, dp 1) with DDP over its 4 SP ranks; FSDP2 over the 4 sp ranks alone
DP_CASES += [("ddp", 2, "hybrid"), ("reduce", 2, "hybrid"), ("fsdp-offload", 2, "hybrid")]


def _dp_sp_worker(rank, world_size, mode, accumulation, kind):
    mesh, dp_rank, _ = _dp_sp_mesh()
    ref, reference_model, want = _reference_copies()
    if kind == "hybrid":
        run_mesh, run_dp_rank, dp_size, strategy = seqpar.make_mesh(sp_size=4, ulysses_size=2), 0, 1, "hybrid"
    else:
        run_mesh, run_dp_rank, dp_size, strategy = mesh, dp_rank, 2, "ring"
    model = seqpar.prepare_model(copy.deepcopy(ref), run_mesh, strategy=strategy).train()
    offload = mode == "fsdp-offload"  # Note [optimizer offload]: on gloo the shards are host tensors anyway
    forward = (
        model
        if mode == "reduce"
        else seqpar.apply_data_parallel(model, run_mesh, mode.split("-")[0], offload_optimizer=offload)
    )
    if mode.startswith("fsdp"):  # the policy reached fully_shard of every unit, root included
        for unit in (model.model.layers[0], model):
            policy = unit._get_fsdp_state()._fsdp_param_group.offload_policy
            assert isinstance(policy, CPUOffloadPolicy) == offload and not getattr(policy, "pin_memory", False)
    no_sync = None
    if mode == "ddp-no-sync":
        no_sync = forward.no_sync
    elif mode == "fsdp-no-sync":

        @contextlib.contextmanager
        def no_sync(module=model):
            module.set_requires_gradient_sync(False)
            yield
            module.set_requires_gradient_sync(True)

    run_group = seqpar.data_parallel_group(run_mesh)
    got = _parallel(
        model,
        forward,
        run_mesh,
        run_group,
        run_dp_rank,
        dp_size,
        accumulation,
        # 2 KiB buckets at accumulation 2: small tensors coalesced, larger ones summed in place
        reduce=(16.0 if accumulation == 1 else 2 / 1024) if mode == "reduce" else None,
        no_sync=no_sync,
    )
    _assert_same_training(got, want, model, reference_model, f"{mode} {strategy} accumulation {accumulation}")
    if mode == "reduce":
        with pytest.raises(SeqparInputError, match="bucket_mb must be positive"):
            seqpar.reduce_gradients(model.parameters(), run_group, bucket_mb=0)
        # a parameter listed twice and one bucket per dtype (inf): each gradient summed exactly once
        ranks = dist.get_world_size(run_group)
        small, large = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4096))
        for bucket_mb in (1 / 1024, float("inf")):
            small.grad = torch.full((3,), dist.get_rank() + 1.0)
            large.grad = torch.full((4096,), dist.get_rank() + 1.0)
            seqpar.reduce_gradients([small, large, small, large], run_group, bucket_mb=bucket_mb)
            for p in (small, large):
                torch.testing.assert_close(p.grad, torch.full_like(p.grad, ranks * (ranks + 1) / 2))
    if mode != "reduce":  # the wrapper summed them already: a second sum would count each rank's part G times
        with pytest.raises(SeqparInputError, match=r"already summed over ranks by (DDP|FSDP2)"):
            seqpar.reduce_gradients(model.parameters(), run_group)


@pytest.mark.parametrize(
    ("mode", "accumulation", "kind"), [pytest.param(*c, id=f"{c[2]}-{c[0]}-accumulation{c[1]}") for c in DP_CASES]
)
def test_dp2_x_sp2_trains_like_one_process(mode, accumulation, kind):
    run_ranks(4, _dp_sp_worker, mode, accumulation, kind)


def _dp_sp_controls_worker(rank, world_size):
    mesh, dp_rank, group = _dp_sp_mesh()
    ref, reference_model, want = _reference_copies()
    # The comparison of the cases above sees the error of summing what DDP already reduced (earlier micro-batches
    # counted once per rank): the old summing comm hook must fail it.
    from torch.nn.parallel import DistributedDataParallel

    model = seqpar.prepare_model(copy.deepcopy(ref), mesh, strategy="ring").train()
    summing = DistributedDataParallel(model, process_group=group)
    summing.register_comm_hook(group, _summing_comm_hook)
    got = _parallel(model, summing, mesh, group, dp_rank, 2, accumulation=2)
    with pytest.raises(AssertionError, match="grad norm"):
        _assert_same_training(got, want, model, reference_model, "summing comm hook")
    with pytest.raises(SeqparInputError, match=r"already wrapped by apply_data_parallel \(DDP\)"):
        model = seqpar.prepare_model(copy.deepcopy(ref), mesh, strategy="ring")
        seqpar.apply_data_parallel(model, mesh, "ddp")
        seqpar.apply_data_parallel(model, mesh, "ddp")
    # a mesh the caller already has: "dp" x a flat "sp" axis
    from torch.distributed.device_mesh import init_device_mesh

    theirs = seqpar.make_mesh(device_mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp")))
    assert theirs.sp_size == 2 and theirs.sp_rank == rank % 2
    q = torch.randn(1, 4, SEQ, 16, generator=torch.Generator().manual_seed(7))
    local = seqpar.shard_sequence(q, theirs, dim=2).requires_grad_()
    out = seqpar.attention(local, local, local, mesh=theirs, strategy="ring")
    want = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    torch.testing.assert_close(out, seqpar.shard_sequence(want, theirs, dim=2), atol=2e-5, rtol=1e-4)
    with pytest.raises(SeqparInputError, match="dimension names must be among"):
        seqpar.make_mesh(device_mesh=init_device_mesh("cpu", (4,), mesh_dim_names=("cp",)))
    with pytest.raises(SeqparInputError, match=r"dp_size \(3\) x sp_size \(2\) must equal the world size \(4\)"):
        seqpar.make_mesh(sp_size=2, dp_size=3)
    with pytest.raises(SeqparInputError, match="unknown data-parallel mode"):
        seqpar.apply_data_parallel(build("llama"), mesh, "zero3")
    with pytest.raises(SeqparInputError, match="offload_optimizer needs mode 'fsdp'"):
        seqpar.apply_data_parallel(build("llama"), mesh, "ddp", offload_optimizer=True)


def test_summing_hook_fails_and_meshes_and_modes_are_checked():
    run_ranks(4, _dp_sp_controls_worker)


def _tp_sp_worker(rank, world_size):
    mesh = seqpar.make_mesh(sp_size=2, tp_size=2)
    names = mesh.device_mesh.mesh_dim_names
    assert names == ("dp", "ring", "ulysses", "tp") and mesh.sp_size == 2
    group = seqpar.data_parallel_group(mesh)  # the ranks sharing this rank's tp coordinate
    assert dist.get_world_size(group) == 2
    ref, reference_model, want = _reference_copies()
    # one function for the four runs: DTensor's sharding cache keeps the first run's mesh (equal by value), whose
    # groups the pool destroys after a function, so a second function on an equal tp mesh would reach dead groups
    for strategy, accumulation in itertools.product(("ring", "ulysses"), (1, 2)):
        model = seqpar.apply_tensor_parallel(copy.deepcopy(ref), mesh)
        seqpar.prepare_model(model, mesh, strategy=strategy).train()
        assert model.model.layers[0].self_attn.q_proj.weight.to_local().shape[0] == 2 * 12  # 2 of 4 heads
        got = _parallel(model, model, mesh, group, 0, 1, accumulation, reduce=16.0)
        _assert_same_training(got, want, model, reference_model, f"tp {strategy} accumulation {accumulation}")
    with pytest.raises(SeqparInputError, match="must divide the heads"):
        seqpar.apply_tensor_parallel(build("llama"), seqpar.make_mesh(sp_size=1, tp_size=4))


def test_tp2_x_sp2_trains_like_one_process():
    run_ranks(4, _tp_sp_worker)
