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
    scrambled = seqpar.ChunkLayout(((1, 4), (0, 5), (2, 3)))
    for layout in ("contiguous", "zigzag", scrambled):
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
    # shard_batch(layout="balanced"): every tensor sharded with the batch's own layout, the same on every rank
    positions = torch.cat([torch.arange(n) for n in (40, 7, 3, 11, 27)])[None]  # 88 tokens, padded to 90
    batch = {"input_ids": torch.arange(88)[None] + 1000, "position_ids": positions}
    shard = seqpar.shard_batch(batch, mesh, layout="balanced")
    assert isinstance(shard.layout, seqpar.ChunkLayout) and shard.layout.chunk_ids != ((0, 5), (1, 4), (2, 3))
    padded = torch.cat([batch["input_ids"], torch.zeros(1, 2, dtype=torch.long)], 1)
    idx = shard_index(shard.layout, world_size, rank, 90)
    torch.testing.assert_close(shard["input_ids"], padded[:, idx], atol=0, rtol=0)
    full_positions = torch.cat([positions, torch.arange(2)[None]], 1)
    torch.testing.assert_close(shard["position_ids"], full_positions[:, idx], atol=0, rtol=0)
    torch.testing.assert_close(seqpar.gather_sequence(shard["input_ids"], mesh, layout=shard.layout), padded)
    # shard_batch(layout="auto"): the packed row is placed (every rank resolves the same), a plain row balanced
    auto, placed = (seqpar.shard_batch(batch, mesh, layout=name) for name in ("auto", "placed"))
    assert auto.layout == placed.layout and auto.layout.name == "placed"
    assert all(torch.equal(auto[key], placed[key]) for key in placed)
    whole = seqpar.gather_sequence(auto["input_ids"], mesh, layout=auto.layout)
    torch.testing.assert_close(auto.placement.restore(whole, 88), batch["input_ids"], atol=0, rtol=0)
    plain = seqpar.shard_batch({"input_ids": batch["input_ids"]}, mesh, layout="auto")
    assert plain.layout.name == "balanced" and plain.layout.chunk_ids == ((0, 5), (1, 4), (2, 3))  # zigzag's
    torch.testing.assert_close(plain["input_ids"], padded[:, shard_index(plain.layout, world_size, rank, 90)])
    with pytest.raises(SeqparInputError, match="multiple of 6"):
        seqpar.shard_sequence(torch.zeros(1, 35), mesh, dim=1, layout="zigzag")
    with pytest.raises(SeqparInputError, match="unknown layout 'striped'"):
        seqpar.position_ids(36, mesh, "striped")
    with pytest.raises(SeqparInputError, match="made per batch"):
        seqpar.shard_sequence(x, mesh, dim=1, layout="balanced")
    with pytest.raises(SeqparInputError, match="does not fit a group of 3 ranks"):
        seqpar.shard_sequence(x, mesh, dim=1, layout=seqpar.ChunkLayout(((0, 1), (2, 3))))
    # a ChunkLayout that differs across ranks is refused on every rank, before attention's collectives
    q = torch.randn(1, 2, 12, 8)
    mine = seqpar.ChunkLayout(((0, 1), (2, 3), (4, 5)) if rank else ((1, 4), (0, 5), (2, 3)))
    with pytest.raises(SeqparInputError, match="inputs differ across ranks"):
        seqpar.attention(q, q, q, mesh=mesh, layout=mine)
    with pytest.raises(SeqparInputError, match="made per batch"):
        seqpar.attention(q, q, q, mesh=mesh, layout="balanced")


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


def test_layout_rows_carry_their_solver_and_pad_multiple():
    """Note [layout registry]: each per-batch row solves a batch with its own solver and pads to its own multiple;
    a row that reorders pads in its solver and refuses to name a multiple (one process, no group)."""
    from seqpar.sequence_parallel.layouts.chunks import NAMED_LAYOUTS, layout_row

    ids = torch.cat([torch.arange(40), torch.arange(7), torch.arange(41)])[None]  # packed documents
    solved = {n: r.solver(ids) if r.chooses else r.solver(ids, 2) for n, r in NAMED_LAYOUTS.items() if r.per_batch}
    assert solved["balanced"] == seqpar.balanced_layout(ids, 2) and solved["auto"] == "placed"
    assert solved["placed"].layout == seqpar.placed_layout(ids, 2).layout
    multiples = {name: layout_row(name).pad_multiple(3) for name in ("contiguous", "zigzag", "balanced", "auto")}
    assert multiples == {"contiguous": 3, "zigzag": 6, "balanced": 6, "auto": 6}
    assert layout_row(seqpar.ChunkLayout(((0, 3, 4), (1, 2, 5)))).pad_multiple(2) == 6
    with pytest.raises(SeqparInputError, match="made per batch"):
        layout_row("placed").pad_multiple(3)
