"""``seqpar.ParallelDims`` (degrees, checks, mesh shapes) and ``seqpar.parallelize`` against one process.

tp 2 x sp 2 and dp 2 x sp 2 (FSDP2) on 4 gloo ranks in one spawn: per-step loss and gradient norm (rel 1e-5)
and parameters after 3 SGD steps (rel 1e-4) on packed documents equal one process (tests/test_composition.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import transformers

import seqpar
from seqpar.errors import SeqparInputError
from seqpar.memory import is_tiled
from tests._dist import run_ranks
from tests._models import build
from tests.test_composition import STEPS, _assert_same_training, _parallel, _reference


@pytest.mark.parametrize(
    ("degrees", "message"),
    [
        ({"sp_size": 0}, "sp_size must be a positive integer, got 0"),
        ({"tp_size": -2}, "tp_size must be a positive integer, got -2"),
        ({"dp_shard_size": 1.5}, "dp_shard_size must be a positive integer, got 1.5"),
        ({"pp_size": True}, "pp_size must be a positive integer, got True"),
        ({"sp_size": 4, "ulysses_size": 3}, r"ulysses_size 3 must divide sp_size 4; valid: \[1, 2, 4\]"),
    ],
)
def test_parallel_dims_refuse_bad_degrees(degrees, message):
    with pytest.raises(SeqparInputError, match=message):
        seqpar.ParallelDims(**degrees)


def test_parallel_dims_derived_sizes_and_mesh_axes():
    dims = seqpar.ParallelDims(dp_replicate_size=2, dp_shard_size=3, sp_size=4, ulysses_size=2, tp_size=2, pp_size=2)
    assert (dims.ring_size, dims.dp_size, dims.world_size) == (2, 6, 96)
    assert dims.mesh_axes == (("pp", 2), ("dp", 6), ("ring", 2), ("ulysses", 2), ("tp", 2))
    assert seqpar.ParallelDims(sp_size=2).mesh_axes == (("dp", 1), ("ring", 2), ("ulysses", 1))
    dims.check_world(96)
    with pytest.raises(SeqparInputError, match="= 96 ranks, but the world size is 8"):
        dims.check_world(8)


def test_parallel_dims_for_world_fills_the_missing_degree():
    assert seqpar.ParallelDims.for_world(8, sp_size=2) == seqpar.ParallelDims(dp_replicate_size=4, sp_size=2)
    assert seqpar.ParallelDims.for_world(8, dp_size=2, tp_size=2).sp_size == 2
    assert seqpar.ParallelDims.for_world(4, sp_size=2, shard_dp=True).dp_shard_size == 2
    with pytest.raises(SeqparInputError, match=r"dp_size \(3\) x sp_size \(2\) must equal the world size \(4\)"):
        seqpar.ParallelDims.for_world(4, sp_size=2, dp_size=3)
    with pytest.raises(SeqparInputError, match="tp_size 3 must divide the world size 4"):
        seqpar.ParallelDims.for_world(4, tp_size=3)
    with pytest.raises(SeqparInputError, match="pp_size 3 x tp_size 1 must divide the world size 4"):
        seqpar.ParallelDims.for_world(4, pp_size=3)


def test_every_representation_of_the_degrees_gives_one_parallel_dims():
    from seqpar.hf import SequenceParallelConfig, plan_parallelism
    from seqpar.planning.timing import Layout
    from seqpar.train.config import TrainConfig

    config = TrainConfig(sp=4, ulysses=2, dp=2, tp=2, pp=2, dp_mode="replicate")
    assert config.dims() == seqpar.ParallelDims(dp_replicate_size=2, sp_size=4, ulysses_size=2, tp_size=2, pp_size=2)
    assert TrainConfig(dp=2, dp_mode="fsdp").dims().dp_shard_size == 2
    assert config.parallelize_options().dp_mode is None
    layout = Layout(dp=2, sp=4, ulysses=2, tp=2, strategy="hybrid", dp_mode="fsdp", pp=2)
    assert layout.dims == seqpar.ParallelDims(dp_shard_size=2, sp_size=4, ulysses_size=2, tp_size=2, pp_size=2)
    assert Layout.of(layout.dims, "hybrid", dp_mode="fsdp") == layout and layout.world == 32
    assert SequenceParallelConfig(sp_size=2, ulysses_size=2).dims(8) == seqpar.ParallelDims(
        dp_replicate_size=4, sp_size=2, ulysses_size=2
    )
    assert plan_parallelism(None, None, 4).dims == seqpar.ParallelDims(sp_size=4)
    with pytest.raises(SeqparInputError, match="world size 6 is not divisible by sp_size 4"):
        SequenceParallelConfig(sp_size=4).dims(6)
    with pytest.raises(SeqparInputError, match="ulysses_size 3 must divide sp_size 4"):
        SequenceParallelConfig(sp_size=4, ulysses_size=3)
    with pytest.raises(SeqparInputError, match="--ulysses 3 must divide --sp 4"):
        TrainConfig(sp=4, ulysses=3).validate()
    d = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    dims = seqpar.ParallelDims(dp_replicate_size=2, sp_size=4, ulysses_size=2)
    assert seqpar.estimate_memory(d, 256, dims) == seqpar.estimate_memory(d, 256, dims=dims)
    sharded = seqpar.ParallelDims(dp_shard_size=2, sp_size=4, ulysses_size=2)  # the estimate reads dp_size only
    assert seqpar.estimate_memory(d, 256, sharded) == seqpar.estimate_memory(d, 256, dims)
    with pytest.raises(SeqparInputError, match=r"dims must be a seqpar\.ParallelDims, not int"):
        seqpar.estimate_memory(d, 256, 4)
    with pytest.raises(TypeError, match="sp_size"):
        seqpar.estimate_memory(d, 256, dims, sp_size=4)  # the loose degrees are gone


def test_parallelize_options_refuse_what_cannot_work():
    with pytest.raises(SeqparInputError, match="dp_mode must be one of"):
        seqpar.ParallelizeOptions(dp_mode="zero3")
    with pytest.raises(SeqparInputError, match="offload_optimizer needs dp_mode 'fsdp'"):
        seqpar.ParallelizeOptions(dp_mode="ddp", offload_optimizer=True)
    with pytest.raises(SeqparInputError, match="offload_activations moves what activation checkpointing keeps"):
        seqpar.ParallelizeOptions(offload_activations=True)
    with pytest.raises(SeqparInputError, match="tiled_mlp_chunk must be a positive number"):
        seqpar.ParallelizeOptions(tiled_mlp_chunk=0)
    with pytest.raises(SeqparInputError, match=r"unknown settings \['layuot'\]"):
        seqpar.parallelize(build("llama"), None, layuot="contiguous")
    with pytest.raises(SeqparInputError, match=r"dp_mode 'ddp' needs a mesh from seqpar\.make_mesh"):
        seqpar.parallelize(build("llama"), None, dp_mode="ddp")


def _check_mesh(mesh, dims, names):
    assert mesh.device_mesh.mesh_dim_names == names
    assert mesh.device_mesh.mesh.shape == tuple(size for _, size in dims.mesh_axes)
    # the mesh has one "dp" axis: it cannot tell replicated from sharded replicas, only their product
    assert mesh.dims.mesh_axes == dims.mesh_axes and mesh.sp_size == dims.sp_size


def _cases():
    """(name, dims, mesh axis names, options, gradients summed by hand, check of the parallelized model)."""

    def tp_check(model):
        assert model.model.layers[0].self_attn.q_proj.weight.to_local().shape[0] == 2 * 12  # 2 of 4 heads
        assert is_tiled(model.model.layers[0].mlp)  # tiled after tensor parallel

    def fsdp_check(model):
        layer = model.model.layers[0]
        assert type(layer).__name__.startswith("FSDP"), type(layer).__name__
        assert layer.gradient_checkpointing, "activation checkpointing before FSDP2"

    tp = seqpar.ParallelDims(sp_size=2, tp_size=2)
    dp = seqpar.ParallelDims(dp_shard_size=2, sp_size=2)
    tp_options = seqpar.ParallelizeOptions(strategy="ulysses", tiled_mlp=True, tiled_mlp_chunk=16)
    dp_options = seqpar.ParallelizeOptions(strategy="ring", dp_mode="fsdp", activation_checkpointing=True)
    return [
        ("tp 2 x sp 2", tp, ("dp", "ring", "ulysses", "tp"), tp_options, True, tp_check),
        ("dp 2 x sp 2 fsdp", dp, ("dp", "ring", "ulysses"), dp_options, False, fsdp_check),
    ]


def _parallelize_worker(rank, world_size):
    # make_mesh keeps its signature and builds its mesh through ParallelDims
    mesh = seqpar.make_mesh(sp_size=2, ulysses_size=2)
    _check_mesh(mesh, seqpar.ParallelDims(dp_replicate_size=2, sp_size=2, ulysses_size=2), ("dp", "ring", "ulysses"))
    assert torch.equal(mesh.device_mesh.mesh, torch.arange(4).reshape(2, 1, 2))
    with pytest.raises(SeqparInputError, match="= 2 ranks, but the world size is 4"):
        seqpar.ParallelDims(sp_size=2).build_mesh()
    ref = build("llama").train()
    reference_model = copy.deepcopy(ref)
    want = _reference(reference_model, STEPS)
    failures = []
    for name, dims, names, options, by_hand, check in _cases():
        mesh = dims.build_mesh()  # collective: every rank builds every case's mesh
        try:
            _check_mesh(mesh, dims, names)
            model = copy.deepcopy(ref)
            forward = seqpar.parallelize(model, mesh, options=options)
            check(model)
            group = seqpar.data_parallel_group(mesh)  # dp x sp of this rank's tp coordinate
            assert dist.get_world_size(group) == dims.dp_size * dims.sp_size
            dp_rank = mesh.device_mesh.get_local_rank("dp")
            got = _parallel(model, forward, mesh, group, dp_rank, dims.dp_size, 2, reduce=16.0 if by_hand else None)
            _assert_same_training(got, want, model, reference_model, name)
        except AssertionError as error:  # each case reports on its own; every rank still runs every collective
            failures.append(f"{name}: {error!r}")
    assert not failures, "\n".join(failures)


def test_parallelize_at_tp2_x_sp2_and_fsdp_dp2_x_sp2_trains_like_one_process():
    run_ranks(4, _parallelize_worker)


def test_a_job_smaller_than_the_launch_names_accelerate_cpu(monkeypatch):
    """torchrun started 2 processes, accelerate without cpu=True sees 1 on a CPU machine: the message says so."""
    from accelerate import ParallelismConfig

    from seqpar.hf import plan_parallelism

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SeqparInputError, match=r"the launcher started 2 processes.*Accelerator\(cpu=True\)"):
        plan_parallelism(None, ParallelismConfig(cp_size=2), 1)
    monkeypatch.setenv("WORLD_SIZE", "1")  # a plain mismatch keeps the plain advice
    with pytest.raises(SeqparInputError, match="= 2 processes, but the job has 1; make the degrees multiply"):
        plan_parallelism(None, ParallelismConfig(cp_size=2), 1)
