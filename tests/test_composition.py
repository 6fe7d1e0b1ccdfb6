"""Sequence parallel composed with data parallel on one mesh: dp=2 x sp=2 (4 gloo ranks) trains like one process.

FSDP2, DDP and plain gradient reduction each end 3 AdamW steps (clipping active) with single-process parameters.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import seqpar
from seqpar.errors import SeqparInputError
from tests._dist import run_ranks
from tests.test_transformers import SEQ, build, tokens


def _reference(model, rows, steps):
    """Per-step (loss, gradient norm before clipping); Adam alone would hide a scaled gradient."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-6)
    losses = []
    for step in range(steps):
        ids = rows[step]
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        opt.step()
        opt.zero_grad()
        losses.append(torch.stack([loss.detach(), norm]))
    return torch.stack(losses)


def _parallel(model, rows, steps, mesh, dp_rank, dp_size, mode):
    forward = seqpar.apply_data_parallel(model, mesh, mode) if mode != "reduce" else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-6)
    everyone = dist.group.WORLD
    losses = []
    for step in range(steps):
        mine = rows[step].chunk(dp_size)[dp_rank]  # this replica's rows of the global batch
        shard = seqpar.shard_batch({"input_ids": mine}, mesh)
        total = seqpar.count_valid_tokens(shard["shift_labels"], everyone)
        logits = forward(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
        loss = seqpar.cross_entropy(logits, shard["shift_labels"], num_valid_tokens=total)
        loss.backward()
        if mode == "reduce":
            seqpar.reduce_gradients(model.parameters(), everyone)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        opt.step()
        opt.zero_grad()
        losses.append(torch.stack([seqpar.sum_over(loss, everyone), norm]))
    return torch.stack(losses)


def _dp_sp_worker(rank, world_size):
    mesh = seqpar.make_mesh(sp_size=2, dp_size=2)
    dp_rank = mesh.device_mesh.get_local_rank("dp")
    assert mesh.sp_size == 2 and mesh.device_mesh["dp"].size() == 2
    steps = 3
    rows = [tokens(4, SEQ, 20 + s) for s in range(steps)]  # global batch of 4 rows per step
    ref = build("llama").train()
    reference_model = copy.deepcopy(ref)
    want = _reference(reference_model, rows, steps)
    assert (want[:, 1] > 0.5).all(), "clipping must be active"
    for mode in ("reduce", "ddp", "fsdp"):
        model = seqpar.prepare_model(copy.deepcopy(ref), mesh, strategy="ring").train()
        got = _parallel(model, rows, steps, mesh, dp_rank, 2, mode)
        torch.testing.assert_close(
            got, want, atol=1e-5, rtol=1e-5, msg=lambda m, md=mode: f"{md} (loss, grad norm) per step: {m}"
        )
        for (name, p), q in zip(model.named_parameters(), reference_model.parameters()):
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            torch.testing.assert_close(
                full.detach(), q.detach(), atol=1e-5, rtol=1e-5, msg=lambda m, n=name, md=mode: f"{md} {n}: {m}"
            )
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


def test_dp2_x_sp2_trains_like_one_process():
    run_ranks(4, _dp_sp_worker)


def _tp_sp_worker(rank, world_size):
    mesh = seqpar.make_mesh(sp_size=2, tp_size=2)
    names = mesh.device_mesh.mesh_dim_names
    assert names == ("dp", "ring", "ulysses", "tp") and mesh.sp_size == 2
    group = seqpar.data_parallel_group(mesh)  # the ranks sharing this rank's tp coordinate
    assert dist.get_world_size(group) == 2
    steps = 3
    rows = [tokens(2, SEQ, 30 + s) for s in range(steps)]
    ref = build("llama").train()
    reference_model = copy.deepcopy(ref)
    want = _reference(reference_model, rows, steps)
    for strategy in ("ring", "ulysses"):
        model = seqpar.apply_tensor_parallel(copy.deepcopy(ref), mesh)
        seqpar.prepare_model(model, mesh, strategy=strategy).train()
        assert model.model.layers[0].self_attn.q_proj.weight.to_local().shape[0] == 2 * 12  # 2 of 4 heads
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-6)
        got = []
        for step in range(steps):
            shard = seqpar.shard_batch({"input_ids": rows[step]}, mesh)
            logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
            loss = seqpar.cross_entropy(logits, shard["shift_labels"], group)
            loss.backward()
            seqpar.reduce_gradients(model.parameters(), group)
            norm = seqpar.clip_grad_norm_(model.parameters(), max_norm=0.5)  # mixed DTensor / tensor grads
            opt.step()
            opt.zero_grad()
            got.append(torch.stack([seqpar.sum_over(loss, group), norm]))
        torch.testing.assert_close(
            torch.stack(got), want, atol=1e-5, rtol=1e-5, msg=lambda m, s=strategy: f"tp {s}: {m}"
        )
        for (name, p), q in zip(model.named_parameters(), reference_model.parameters()):
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            torch.testing.assert_close(
                full.detach(), q.detach(), atol=1e-5, rtol=1e-5, msg=lambda m, n=name, s=strategy: f"tp {s} {n}: {m}"
            )
    with pytest.raises(SeqparInputError, match="must divide the heads"):
        seqpar.apply_tensor_parallel(build("llama"), seqpar.make_mesh(sp_size=1, tp_size=4))


def test_tp2_x_sp2_trains_like_one_process():
    run_ranks(4, _tp_sp_worker)
