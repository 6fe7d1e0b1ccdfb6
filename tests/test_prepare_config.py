"""``prepare_model`` leaves the caller's config object as it was (Note [the model's own config]).

A model built from it afterwards equals one process, as the prepared one does sharded (Llama; Qwen2-VL's sub-configs).
"""

from __future__ import annotations

import pytest
import torch
import transformers

import seqpar
from seqpar.sequence_parallel.prepare import ATTENTION_NAME
from seqpar.sequence_parallel.whole_rows import padded_row_length
from tests import _vlm_models
from tests._dist import run_ranks, shard_index
from tests._models import SEQ, tiny_config, tokens

ATOL, RTOL = 2e-5, 1e-4


def _holders(model: torch.nn.Module, configs: list[object]) -> list[str]:
    """``module.attribute`` names of the model that hold one of ``configs`` (by identity)."""
    return [
        f"{name or type(model).__name__}.{attr}"
        for name, module in model.named_modules()
        for attr, value in vars(module).items()
        if any(value is c for c in configs)
    ]


def _text(rank: int, world_size: int) -> None:
    mesh = seqpar.make_mesh()
    config = tiny_config("llama")
    torch.manual_seed(0)
    a = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    seqpar.prepare_model(a, mesh)
    assert config._attn_implementation == "eager", "prepare_model changed the caller's config"
    assert a.config._attn_implementation == ATTENTION_NAME and _holders(a, [config]) == []
    torch.manual_seed(0)
    b = transformers.AutoModelForCausalLM.from_config(config).eval()  # from A's original config object
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="eager").eval()
    ids = tokens(2, SEQ, 1)
    with torch.no_grad():
        want = ref(ids).logits
        torch.testing.assert_close(b(ids).logits, want, atol=ATOL, rtol=RTOL)  # plain attention, whole rows
        shard = seqpar.shard_batch({"input_ids": ids}, mesh)
        got = a(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
    idx = shard_index(shard.layout, world_size, rank, SEQ)
    torch.testing.assert_close(got, want[:, idx], atol=ATOL, rtol=RTOL)
    seqpar.prepare_model(a, mesh)  # again: the model's own copy stays its own
    assert config._attn_implementation == "eager" and a.config._attn_implementation == ATTENTION_NAME


def _multimodal(rank: int, world_size: int) -> None:
    mesh = seqpar.make_mesh()
    family = "qwen2_vl"
    config = _vlm_models.config(family)
    torch.manual_seed(0)
    a = transformers.AutoModelForImageTextToText.from_config(config, attn_implementation="eager").float().eval()
    assert a.model.language_model.config is config.text_config  # the sub-config is shared, as transformers builds it
    seqpar.prepare_model(a, mesh)
    subs = [config.text_config, config.vision_config]
    assert [config._attn_implementation] + [c._attn_implementation for c in subs] == ["eager"] * 3
    assert _holders(a, [config, *subs]) == []
    assert a.model.language_model.config is a.config.text_config
    assert a.config.text_config._attn_implementation == ATTENTION_NAME
    assert a.model.visual.config._attn_implementation == "eager"  # the vision tower keeps its own attention
    torch.manual_seed(0)
    b = transformers.AutoModelForImageTextToText.from_config(config).float().eval()
    ref = _vlm_models.build(family)
    batch = _vlm_models.sample(family)
    with torch.no_grad():
        want = ref(**batch).logits
        torch.testing.assert_close(b(**batch).logits, want, atol=ATOL, rtol=RTOL)
        text = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        shard = seqpar.shard_batch(text, mesh)
        got = a(**batch, seqpar_layout=shard.layout).logits
    s = batch["input_ids"].shape[1]
    idx = shard_index(shard.layout, world_size, rank, padded_row_length(s, world_size, shard.layout))
    keep = batch["attention_mask"][:, idx.clamp(max=s - 1)].bool() & (idx < s)
    torch.testing.assert_close(got[keep], want[:, idx.clamp(max=s - 1)][keep], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("check", [_text, _multimodal], ids=["llama", "qwen2_vl"])
def test_a_model_built_from_the_config_after_prepare_model_equals_one_process(check):
    run_ranks(2, check)
