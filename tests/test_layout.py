"""Layouts: shards, gathers and position ids against explicitly written index lists, on 3 gloo ranks."""

from __future__ import annotations

import pytest
import torch

import seqpar
from seqpar.errors import SeqparInputError
from tests._dist import run_ranks, shard_index


def _layout_worker(rank, world_size):
    mesh = seqpar.make_mesh()
    assert (mesh.sp_size, mesh.sp_rank, mesh.ring_size, mesh.ulysses_size) == (
        world_size,
        rank,
        world_size,
        1,
    )
    x = torch.arange(2 * 36 * 5, dtype=torch.float32).reshape(2, 36, 5).requires_grad_()
    for layout in ("contiguous", "zigzag"):
        idx = shard_index(layout, world_size, rank, 36)
        local = seqpar.shard_sequence(x, mesh, dim=1, layout=layout)
        torch.testing.assert_close(local, x[:, idx], atol=0, rtol=0)
        torch.testing.assert_close(seqpar.position_ids(36, mesh, layout), idx, atol=0, rtol=0)
        full = seqpar.gather_sequence(local.detach().clone(), mesh, dim=1, layout=layout)
        torch.testing.assert_close(full, x.detach(), atol=0, rtol=0)
        # the adjoint of the gather sums every rank's gradient for this shard
        shard = local.detach().clone().requires_grad_()
        weights = torch.arange(36, dtype=torch.float32)[None, :, None] * (rank + 1)
        (seqpar.gather_sequence(shard, mesh, dim=1, layout=layout) * weights).sum().backward()
        expected = torch.arange(36, dtype=torch.float32)[idx][None, :, None] * sum(range(1, world_size + 1))
        torch.testing.assert_close(shard.grad, expected.expand_as(shard), atol=0, rtol=0)
    with pytest.raises(SeqparInputError, match="multiple of 6"):
        seqpar.shard_sequence(torch.zeros(1, 35), mesh, dim=1, layout="zigzag")
    with pytest.raises(SeqparInputError, match="unknown layout 'striped'"):
        seqpar.position_ids(36, mesh, "striped")


def test_layouts_on_three_ranks():
    run_ranks(3, _layout_worker)


def _mesh_worker(rank, world_size):
    mesh = seqpar.make_mesh(sp_size=2)  # dp 2 x sp 2
    assert (mesh.sp_size, mesh.sp_rank) == (2, rank % 2)
    assert mesh.device_mesh.mesh_dim_names == ("dp", "ring", "ulysses")
    with pytest.raises(SeqparInputError, match="must equal the world size"):
        seqpar.make_mesh(sp_size=3)
    with pytest.raises(SeqparInputError, match="must divide sp_size"):
        seqpar.make_mesh(sp_size=4, ulysses_size=3)


def test_make_mesh_with_data_parallel_replicas():
    run_ranks(4, _mesh_worker)
