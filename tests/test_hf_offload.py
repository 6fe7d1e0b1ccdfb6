"""Optimizer offload through the Hugging Face Trainer's doors: the documented options reach ``fully_shard``.

seqpar's Trainer leaves FSDP2 to accelerate (Note [FSDP2 under the Trainer]), so CPU offload there is
accelerate's and transformers' own option: ``TrainingArguments(fsdp=True, fsdp_config={"cpu_offload": True})``
or, from an accelerate config, ``fsdp_offload_params: true`` (``FSDP_OFFLOAD_PARAMS``). Both become
``FullyShardedDataParallelPlugin(cpu_offload=CPUOffloadPolicy())``, which accelerate's FSDP2 preparation hands
to every ``fully_shard`` call. accelerate applies the plugin only on GPU-class devices, and its policy pins
host memory, which needs CUDA: without a GPU the calls are recorded instead of run; with one, a one-process
FSDP2 model is prepared for real and its units are checked.
"""

from __future__ import annotations

import types

import pytest
import torch
from accelerate.utils import FullyShardedDataParallelPlugin, fsdp2_prepare_model
from torch.distributed.fsdp import CPUOffloadPolicy
from transformers import TrainingArguments

from seqpar.hf.config import check_training_arguments
from tests._models import build


def _accelerator(plugin: FullyShardedDataParallelPlugin) -> types.SimpleNamespace:
    """What ``fsdp2_prepare_model`` reads of an Accelerator."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    state = types.SimpleNamespace(fsdp_plugin=plugin)
    return types.SimpleNamespace(
        state=state, torch_device_mesh=None, mixed_precision="no", is_main_process=True, device=device
    )


def test_training_arguments_offload_reaches_fully_shard(tmp_path, monkeypatch):
    args = TrainingArguments(output_dir=str(tmp_path), fsdp=True, fsdp_config={"cpu_offload": True}, report_to="none")
    check_training_arguments(args)  # seqpar takes it as it is
    plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)  # as the Trainer builds it
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) and plugin.fsdp_version == 2
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")  # what `fsdp_offload_params: true` exports
    assert isinstance(FullyShardedDataParallelPlugin(fsdp_version=2).cpu_offload, CPUOffloadPolicy)

    calls = []

    def record(module, **kwargs):
        calls.append((module, kwargs))
        return module

    monkeypatch.setattr(torch.distributed.fsdp, "fully_shard", record)
    model = build("llama")
    fsdp2_prepare_model(_accelerator(plugin), model)
    sharded = {id(module) for module, _ in calls}
    assert {id(model), id(model.model.layers[0]), id(model.model.embed_tokens)} <= sharded
    assert all(isinstance(kwargs["offload_policy"], CPUOffloadPolicy) for _, kwargs in calls), calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="accelerate's policy pins host memory: CUDA only")
def test_training_arguments_offload_shards_on_a_gpu(tmp_path):
    import torch.distributed as dist

    args = TrainingArguments(output_dir=str(tmp_path), fsdp=True, fsdp_config={"cpu_offload": True}, report_to="none")
    plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("cuda:nccl,cpu:gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = fsdp2_prepare_model(_accelerator(plugin), build("llama"))
        for unit in (model, model.model.layers[0]):
            group = unit._get_fsdp_state()._fsdp_param_group
            assert isinstance(group.offload_policy, CPUOffloadPolicy)
        assert all(p.to_local().device.type == "cpu" for p in model.parameters())
    finally:
        if started:
            dist.destroy_process_group()
