"""The model registry (``seqpar.models``): every family resolves, unknown ones are named, a new family serves all.

Real transformers models from tiny configs; the new family is ``tests._toy_family``'s renamed Llama, checked
against the Llama holding its weights on every axis (one process, then one spawn of 2 gloo ranks).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import ClassVar

import pytest
import torch
import transformers
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import seqpar
import seqpar.models
from seqpar.data_parallel import decoder_blocks
from seqpar.diagnosis.pitfalls import decoder_layers, token_mixing_suspects
from seqpar.errors import SeqparInputError
from seqpar.models import FAMILIES, Family, ModelSizes, anatomy, find_anatomy, register_family
from seqpar.pipeline_parallel.stages import find_parts, original_names, split_model
from seqpar.planning import Cluster, load_model_shape, plan
from tests._dist import run_ranks, shard_index
from tests._models import SEQ, VOCAB, build, tiny_config, tokens
from tests._toy_family import TOY, register_toy, to_llama_name, toy_and_llama

ATOL, RTOL = 2e-5, 1e-4
_SMALL = dict(
    vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def _config(kind: str):
    """A tiny config of every built-in family: tests._models' kinds and the families only registered here."""
    if kind == "gemma":
        return transformers.GemmaConfig(**_SMALL, head_dim=12)
    if kind == "olmo":
        return transformers.OlmoConfig(**_SMALL)
    if kind == "granite":
        return transformers.GraniteConfig(**_SMALL)
    if kind == "qwen2_moe":  # layer 0 dense, layer 1 experts and a shared expert
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32)
        return transformers.Qwen2MoeConfig(**_SMALL, **moe, mlp_only_layers=[0])
    if kind == "gemma3_vlm":  # the multimodal model: its text decoder is model.language_model
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28)
        text = {k: v for k, v in _SMALL.items() if k != "vocab_size"}
        return transformers.Gemma3Config(
            text_config=dict(**text, vocab_size=VOCAB + 8, head_dim=12), vision_config=dict(**vision, patch_size=14)
        )
    return tiny_config(kind)


KINDS = (
    "llama", "qwen2", "mistral", "qwen3", "gemma3", "gemma2", "gpt_oss", "mixtral", "qwen3_moe", "phi3", "olmo2",
    "gemma", "olmo", "granite", "qwen2_moe", "gemma3_vlm", "deepseek_v2", "deepseek_v3", "minicpm3",
)  # fmt: skip
# layers whose MLP is a mixture of experts, of 4 (tests._models' MoE configs) or 2 (qwen2_moe, deepseek: layer 0 dense)
EXPERT_LAYERS = {"gpt_oss": 4, "mixtral": 4, "qwen3_moe": 4, "qwen2_moe": 1, "deepseek_v2": 1, "deepseek_v3": 1}


@pytest.fixture(scope="module")
def toy_registered():
    register_toy()
    yield TOY
    FAMILIES.pop(TOY.model_type, None)


def test_every_built_in_family_has_a_tiny_model_here():
    """Each entry is judged against one process by a tiny model of this suite's, or by the zoo sweep's
    (``tests/test_zoo.py``, whose record pins each family's status)."""
    from seqpar.models.zoo import zoo_model_types
    from tests import _vlm_models

    hybrids = {tiny_config(kind).model_type for kind in HYBRIDS + OTHER_HYBRIDS}
    covered = {_config(kind).model_type for kind in KINDS} | set(_vlm_models.FAMILIES) | hybrids
    assert covered <= set(FAMILIES)
    assert not set(FAMILIES) - {TOY.model_type} - covered - set(zoo_model_types())


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava"])
def test_every_vision_language_family_resolves_its_anatomy(family):
    from tests._vlm_models import build as build_vlm

    model = build_vlm(family)
    parts = anatomy(model)
    decoder = model.model.language_model
    assert parts.family is FAMILIES[family] and parts.decoder is decoder
    assert parts.name(decoder) == "model.language_model" and parts.layers is decoder.layers
    assert parts.embedding is model.get_input_embeddings() and parts.head is model.get_output_embeddings()
    assert parts.attention == tuple(layer.self_attn for layer in decoder.layers)
    assert isinstance(getattr(model.model, parts.family.vision), torch.nn.Module)  # the tower that keeps its attention


@pytest.mark.parametrize("kind", KINDS)
def test_every_family_resolves_its_anatomy(kind):
    torch.manual_seed(0)
    config = _config(kind)
    if kind == "gemma3_vlm":
        model = transformers.Gemma3ForConditionalGeneration(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    parts = anatomy(model)
    decoder = model.get_decoder()
    text = "model.language_model" if kind == "gemma3_vlm" else "model"
    assert parts.family is FAMILIES[config.model_type]
    assert parts.decoder is decoder and parts.name(decoder) == text
    assert parts.layers is decoder.layers and parts.name(parts.layers) == f"{text}.layers"
    assert parts.embedding is model.get_input_embeddings() and parts.head is model.get_output_embeddings()
    assert parts.norm is decoder.norm and parts.rotary is decoder.rotary_emb
    assert parts.attention == tuple(layer.self_attn for layer in decoder.layers)
    assert all(type(m).__name__.endswith("Attention") for m in parts.attention)
    assert parts.mlps == tuple(layer.mlp for layer in decoder.layers)
    assert len(parts.moe_mlps) == EXPERT_LAYERS.get(kind, 0)
    assert all("Norm" in type(m).__name__ for m in parts.norms)
    assert len(parts.layer_norms) == len(parts.family.layer_norms) * len(decoder.layers)
    assert parts.mixers == () and parts.undeclared() == []  # the entry accounts for every part of its layers
    assert decoder_blocks(model) == list(decoder.layers)
    bare = anatomy(model.model)  # the decoder without its head
    assert bare.head is None and bare.layers is decoder.layers


HYBRIDS = ("lfm2", "qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "granitemoehybrid", "bamba", "falcon_h1")
# families whose layers keep their parts elsewhere: by layer kind at one path, no attention, a shared block
OTHER_HYBRIDS = (
    *("nemotron_h", "mamba2", "zamba2", "kimi_linear", "minimax", "mamba", "falcon_mamba", "jamba"),
    "recurrent_gemma",
)


@pytest.mark.parametrize("kind", OTHER_HYBRIDS)
def test_a_family_with_layer_kinds_shared_blocks_or_no_attention_resolves_every_part(kind):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind))
    parts = anatomy(model)
    layers = parts.layers
    if kind == "nemotron_h":  # Mamba2, experts, attention, MLP: each at "mixer"
        assert parts.attention == (None, None, layers[2].mixer, None) and parts.mixers == (layers[0].mixer,)
        assert parts.mlps == (layers[1].mixer, layers[3].mixer) and parts.moe_mlps == (layers[1].mixer,)
        assert parts.norm is model.model.norm_f and parts.embedding is model.model.embeddings
    elif kind in ("mamba2", "mamba", "falcon_mamba"):
        assert parts.attention == (None,) * 2 and parts.mlps == () and parts.decoder is model.backbone
        assert parts.mixers == tuple(layer.mixer for layer in layers)
    elif kind == "jamba":  # Mamba1 with experts in layers 0 and 2, attention with an MLP in layer 1
        assert parts.attention == (None, layers[1].self_attn, None)
        assert parts.mixers == (layers[0].mamba, layers[2].mamba)
        assert parts.moe_mlps == (layers[0].feed_forward, layers[2].feed_forward)
    elif kind in ("kimi_linear", "minimax"):  # KDA or MLA, lightning or softmax attention at self_attn, by block_type
        assert parts.attention == (None, layers[1].self_attn, None)
        assert parts.mixers == (layers[0].self_attn, layers[2].self_attn)
        assert parts.mlps == tuple(layer.mlp for layer in layers)  # MiniMax: experts in every layer
    elif kind == "recurrent_gemma":  # the RG-LRU block or attention at temporal_block, by the config's layer types
        assert parts.attention == (None, layers[1].temporal_block, None)
        assert parts.mixers == (layers[0].temporal_block, layers[2].temporal_block)
        assert parts.mlps == tuple(layer.mlp_block for layer in layers) and parts.norm is model.model.final_norm
        entry = FAMILIES[kind]  # a kind the entry does not map is named, with where it was read
        register_family(dataclasses.replace(entry, kinds=(("linear_attention", "mixer"),)), replace=True)
        try:
            said = "layers[1].config.layers_block_type[1] of a known kind (linear_attention; it is 'sliding_attention')"
            assert said in find_anatomy(model)
        finally:
            register_family(entry, replace=True)
    else:  # Zamba2: layers 0 and 2 run the shared attention block, then their own projection and Mamba2
        shared = (layers[0].shared_transformer.self_attn, layers[2].shared_transformer.self_attn)
        assert parts.attention == (shared[0], None, shared[1])
        assert parts.mixers == (layers[0].mamba_decoder.mamba, layers[1].mamba, layers[2].mamba_decoder.mamba)
        assert parts.per_token == (layers[0].linear, layers[2].linear)
    assert parts.rotary is (model.model.rotary_emb if kind == "minimax" else None) and parts.undeclared() == []


def test_a_layer_of_unknown_kind_is_named():
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("nemotron_h"))
    model.model.layers[2].block_type = "retention"
    assert "layers[2].block_type of a known kind (full_attention, linear_attention, moe, mlp; it is 'retention')" in (
        find_anatomy(model)
    )
    with pytest.raises(SeqparInputError, match="kinds map layer kinds to 'attention', 'mixer' or 'mlp'"):
        Family("x", layer_kind="block_type", kinds=(("moe", "experts"),))


@pytest.mark.parametrize("kind", HYBRIDS)
def test_a_hybrid_family_resolves_attention_where_layers_have_it_and_its_mixers(kind):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind))
    parts = anatomy(model)
    layers = model.model.layers
    assert parts.attention == tuple(getattr(layer, "self_attn", None) for layer in layers)
    mixer = parts.family.mixers[0]  # LFM2's conv, the gated DeltaNet's linear_attn: layers 0, 2 and 3
    assert parts.mixers == tuple(getattr(layer, mixer) for layer in layers if getattr(layer, mixer, None) is not None)
    final = {"lfm2": "embedding_norm", "bamba": "final_layernorm", "falcon_h1": "final_layernorm"}.get(kind, "norm")
    assert len(parts.mixers) == (4 if kind == "falcon_h1" else 3) and parts.norm is getattr(model.model, final)
    assert parts.rotary is (None if kind == "granitemoehybrid" else model.model.rotary_emb)
    assert parts.undeclared() == []


def test_a_module_outside_the_declared_parts_is_refused_by_name():
    """Note [declared layer parts]: GraniteMoeHybrid's experts beside its shared MLP are declared per_token; the entry
    without them is refused naming the router, while a parameter-free module (dropout) is let through."""
    config = tiny_config("granitemoehybrid")
    config.num_local_experts, config.num_experts_per_tok = 4, 2
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.model.layers[0].dropout = torch.nn.Dropout(0.0)
    assert anatomy(model).undeclared() == []
    entry = FAMILIES["granitemoehybrid"]
    register_family(dataclasses.replace(entry, per_token=()), replace=True)
    try:
        assert anatomy(model).undeclared()[:2] == [
            "model.layers.0.block_sparse_moe (GraniteMoeHybridMoE) in layer 0",
            "model.layers.1.block_sparse_moe (GraniteMoeHybridMoE) in layer 1",
        ]
        with pytest.raises(SeqparInputError, match=r"hold model\.layers\.0\.block_sparse_moe \(GraniteMoeHybridMoE\)"):
            seqpar.prepare_model(model, None)
    finally:
        register_family(entry, replace=True)


def test_a_family_whose_anatomy_cannot_be_read_gets_the_clear_message(monkeypatch):
    """BLOOM adds an ALiBi bias in its own attention code, which seqpar's attention does not apply without an adapter
    row that applies it (Note [ALiBi]; here the row says it does not): refused, named."""
    from seqpar.models.own_attention import OWN_ATTENTION

    row = OWN_ATTENTION["BloomAttention"]
    monkeypatch.setitem(OWN_ATTENTION, "BloomAttention", dataclasses.replace(row, alibi=False))
    bloom = transformers.BloomForCausalLM(
        transformers.BloomConfig(n_layer=2, hidden_size=16, n_head=2, vocab_size=VOCAB)
    )
    why = find_anatomy(bloom)
    assert why.startswith("seqpar has no entry for 'bloom' models (BloomForCausalLM) and cannot read their anatomy: ")
    assert "BloomModel adds an ALiBi position bias" in why and "register_family" in why
    with pytest.raises(SeqparInputError, match=r"cannot find the parts of this model: seqpar has no entry for 'bloom'"):
        anatomy(bloom)
    with pytest.raises(SeqparInputError, match=r"cannot serve this model's attention: seqpar has no entry for 'bloom'"):
        seqpar.prepare_model(bloom, None)
    with pytest.raises(SeqparInputError, match=r"found no decoder MLP in BloomForCausalLM \(seqpar has no entry"):
        seqpar.apply_tiled_mlp(bloom)
    with pytest.raises(SeqparInputError, match=r"cannot find the decoder layers of BloomForCausalLM: seqpar has no"):
        decoder_layers(bloom)
    with pytest.raises(SeqparInputError, match=r"found no decoder layers in BloomForCausalLM to offload: seqpar"):
        seqpar.apply_activation_offload(bloom)
    assert find_parts(bloom).startswith("the decoder layers of BloomForCausalLM cannot be found: seqpar has no")
    assert decoder_blocks(bloom) == []  # FSDP2 then shards the root only
    assert "has no config.model_type" in find_anatomy(torch.nn.Linear(2, 2))
    assert "reads a family's anatomy only from a model" in find_anatomy(bloom.config)


def test_the_toy_family_is_read_from_the_model_without_an_entry():
    """The toy's anatomy, read from its classes, is its hand-written entry's; a part of no known kind is refused."""
    toy, _ = toy_and_llama()
    registered = FAMILIES.pop(TOY.model_type, None)  # whichever test ran before
    try:
        read = find_anatomy(toy).family
        assert read.derived and dataclasses.replace(read, derived=False, tp_plan=TOY.tp_plan) == dataclasses.replace(
            TOY, attention_interface=True
        )
        assert read.tp_plan is None, "the config's Llama plan names self_attn and mlp, which the toy has not"
        grouped = copy.deepcopy(toy)  # a group norm normalises over tokens: not a per-token norm
        grouped.body.blocks[1].pre = torch.nn.GroupNorm(4, 48)
        with pytest.raises(SeqparInputError, match=r"layer 1 \(ToyBlock\) holds pre \(GroupNorm\) where other"):
            seqpar.prepare_model(grouped, None)
        for block in toy.body.blocks:  # the negative control: the same toy with a part seqpar cannot classify
            block.ffn = torch.nn.Conv1d(16, 16, 3)
        with pytest.raises(
            SeqparInputError,
            match=r"cannot read their anatomy: layer 0 \(ToyBlock\) .* MLP\(s\) "
            r"\(none\).* ffn \(Conv1d\)",
        ):
            seqpar.prepare_model(toy, None)
    finally:
        if registered is not None:
            register_family(registered)


def test_family_entries_are_checked(toy_registered):
    with pytest.raises(SeqparInputError, match=r"takes a seqpar\.models\.Family"):
        register_family("llama")
    with pytest.raises(SeqparInputError, match="'llama' is registered already"):
        register_family(Family("llama", layers="blocks"))
    assert register_family(Family("llama")) is not None  # the same entry again changes nothing
    with pytest.raises(SeqparInputError, match="tp_plan styles must be colwise or rowwise"):
        Family("x", tp_plan=(("mlp.up_proj", "diagonal"),))
    toy, _ = toy_and_llama()
    register_family(dataclasses.replace(TOY, mixers=("post",)), replace=True)
    try:  # a declared mixer seqpar does not exchange is refused, not run on each shard alone
        with pytest.raises(SeqparInputError, match=r"mixers LlamaRMSNorm \(besides attention\) have no seqpar adapter"):
            seqpar.prepare_model(toy, None)
    finally:
        register_family(TOY, replace=True)
    register_family(dataclasses.replace(TOY, attention="attn"), replace=True)
    try:
        assert find_anatomy(toy).startswith(
            "ToyForCausalLM lacks layers[0].attn, layers[1].attn where the 'toy_llama' family entry puts them"
        )
    finally:
        register_family(TOY, replace=True)


def test_model_sizes_is_the_one_dataclass_of_sizes():
    assert seqpar.planning.ModelSizes is ModelSizes
    config = tiny_config("qwen3")  # head_dim 12: q 48 wide, kv 24
    sizes = ModelSizes.from_config(config)
    assert (sizes.hidden_size, sizes.num_hidden_layers, sizes.dim, sizes.model_type) == (48, 2, 12, "qwen3")
    assert sizes.for_tp(2) == ModelSizes.from_config(config, 2)
    assert (sizes.for_tp(2).q_width, sizes.for_tp(2).kv_width, sizes.for_tp(2).mlp_width) == (24, 12, 48)
    with pytest.raises(SeqparInputError, match=r"tp_size 4 must divide the heads \(4\) and key/value heads \(2\)"):
        sizes.for_tp(4)
    model = transformers.AutoModelForCausalLM.from_config(config)
    built = sum(p.numel() for p in model.parameters())
    assert sizes.num_params == built - 2 * 12 * 2  # the q/k norms (a few vectors a layer) are left out
    moe = ModelSizes.from_config(_config("qwen2_moe"))
    assert (moe.num_experts, moe.moe_layers, moe.mlp_width) == (4, 1, max(2 * 16 + 32, 96))
    assert ModelSizes.from_config(moe.as_config()) == moe
    assert load_model_shape(config.to_dict()) == dataclasses.replace(sizes, source="(dict)")
    with pytest.raises(SeqparInputError, match=r"model config x\.json: the model config lacks positive integer"):
        ModelSizes.from_config({"hidden_size": 4}, source="x.json")


@dataclasses.dataclass(frozen=True)
class _ToyScan(seqpar.models.MixerSizes):
    """A mixer row as a new kind would add it (Note [mixer rows]): a scan of ``width`` taps and a state per channel."""

    kind = "toy_scan"
    label = "toy scan"
    layer_types = ("toy",)
    names: ClassVar[dict] = {"width": "toy_width", "state": ("toy_state", 2)}

    width: int
    state: int = 2

    def params(self, hidden: int) -> int:
        return 2 * hidden * hidden + hidden * self.width

    def conv(self, hidden: int) -> tuple[int, int]:
        return hidden, self.width

    def elements(self, hidden: int, sp: int) -> tuple[int, float]:
        return 3 * hidden, float(hidden * self.state * (1 if sp == 1 else 2))

    def exchange(self, rows: int, chunks: int) -> int:
        return chunks * rows * self.state * 4

    def head_parallel(self, hidden: int) -> int:
        return 2 * hidden


def test_a_new_mixer_kind_is_a_row_and_a_family_entry_no_branch_elsewhere():
    """Note [mixer rows]: a registered row and a ``Family`` naming it are all the sizes, the parameter counts, the
    memory estimate and ``as_config`` need; the row's own counts are what they report."""
    from seqpar.memory.mixers import exchange_bytes, mixer_elements
    from seqpar.models import MIXER_KINDS, Hybrid, register_mixer_kind

    config = dict(
        model_type="toy_hybrid", hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=64, num_hidden_layers=3, layer_types=["toy", "full_attention", "toy"], toy_width=4,
    )  # fmt: skip
    register_mixer_kind(_ToyScan)
    try:
        with pytest.raises(SeqparInputError, match="toy besides attention"):  # no family entry: refused, not guessed
            ModelSizes.from_config(config)
        register_family(Family("toy_hybrid", mixers=("mixer",), hybrid=Hybrid(_ToyScan)))
        sizes = ModelSizes.from_config(config)
        assert sizes.mixer == _ToyScan(4, 2) and sizes.layer_kinds == ("mixer", "attention", "mixer")
        assert ModelSizes.from_config(sizes.as_config()) == sizes
        dense = ModelSizes.from_config({**config, "layer_types": ["full_attention"] * 3, "model_type": "llama"})
        mixer_layer, attention_layer = 2 * 16 * 16 + 16 * 4 + 2 * 16, 16 * (2 * 16 + 2 * 16) + 2 * 16  # norms too
        assert sizes.num_params == dense.num_params + 2 * (mixer_layer - attention_layer)
        assert exchange_bytes(sizes, "mixer", 1, 2, 4) == (2 * 16 * 3 * 4, 2 * 2 * 4)
        assert mixer_elements(sizes, "mixer", 2, 4) == (5 * 16 + 3 * 16 + 16, 16 * 2 * 2.0)
        assert seqpar.estimate_memory(config, 1024, seqpar.ParallelDims(sp_size=2)).mixer_state == 2 * (
            2 * 16 * 3 * 4 + 2 * 2 * 4
        )
        with pytest.raises(SeqparInputError, match="Hybrid's qk_norm must be None, 'head' or 'whole'"):
            Hybrid(_ToyScan, qk_norm="all")
        with pytest.raises(SeqparInputError, match="mixer kind 'toy_scan' is registered already"):
            register_mixer_kind(dataclasses.make_dataclass("Other", [], bases=(_ToyScan,), frozen=True))
    finally:
        FAMILIES.pop("toy_hybrid", None)
        MIXER_KINDS.pop("toy_scan")


def test_every_mixer_row_names_the_classes_its_adapter_runs():
    """Note [mixer rows], Note [mixer adapters]: each adapter belongs to one row, and each row's classes have one."""
    from seqpar.models import MIXER_KINDS
    from seqpar.sequence_parallel.mixers import ADAPTERS

    adapted = [name for row in MIXER_KINDS.values() for name in row.adapts]
    assert sorted(adapted) == sorted(ADAPTERS)


def _loss_and_grads(model, ids, names=lambda n: n):
    model.zero_grad()
    logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return logits.detach(), loss.detach(), {names(n): p.grad.clone() for n, p in model.named_parameters()}


def test_a_registered_family_serves_every_axis_in_one_process(toy_registered):
    toy, llama = toy_and_llama()
    ids = tokens(2, SEQ, 1)
    logits, loss, grads = _loss_and_grads(llama, ids)
    got = _loss_and_grads(toy, ids, to_llama_name)
    torch.testing.assert_close(got[0], logits, atol=ATOL, rtol=RTOL)  # the toy is the Llama under other names
    # data parallel's units, the doctor's layers, attention and (no) other token mixers
    assert decoder_blocks(toy) == list(toy.body.blocks)
    prefix, parts = decoder_layers(toy)
    assert prefix == "body.blocks" and [parts.name(m) for m in parts.attention] == [
        "body.blocks.0.mixer",
        "body.blocks.1.mixer",
    ]
    assert [token_mixing_suspects(parts, i) for i in range(2)] == [[], []]
    # pipeline stages: the parts, two stages run one after the other, the parameters' original names
    found = find_parts(toy)
    assert found.names == ("body", "out") and found.paths == ("tok", "blocks") and not found.tied
    stages = split_model(found, [1, 1], [0, 1], return_hidden=False)
    positions = torch.arange(SEQ)[None].expand(2, SEQ)
    with torch.no_grad():
        torch.testing.assert_close(stages[1](stages[0](ids, positions), positions), logits, atol=ATOL, rtol=RTOL)
    params = dict(toy.named_parameters())
    named = [(n, p) for stage in stages for n, p in original_names(stage)]
    assert sorted(n for n, _ in named) == sorted(params) and all(params[n] is p for n, p in named)
    # tiled MLP: the family's MLPs, the same loss and gradients
    tiled = copy.deepcopy(toy)
    assert seqpar.apply_tiled_mlp(tiled, chunk_tokens=16) == 2 and seqpar.memory.is_tiled(tiled.body.blocks[1].ffn)
    got = _loss_and_grads(tiled, ids, to_llama_name)
    torch.testing.assert_close(got[1], loss, atol=ATOL, rtol=RTOL)
    for name, grad in grads.items():
        torch.testing.assert_close(got[2][name], grad, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")
    with pytest.raises(SeqparInputError, match="enable checkpointing first"):  # its layers are found
        seqpar.apply_activation_offload(toy)
    # memory estimate and planner: the toy's sizes are the Llama's
    sizes = ModelSizes.from_config(toy.config)
    assert sizes == dataclasses.replace(ModelSizes.from_config(llama.config), model_type="toy_llama")
    assert seqpar.estimate_memory(toy.config, 4096, seqpar.ParallelDims(sp_size=2)) == seqpar.estimate_memory(
        llama.config, 4096, seqpar.ParallelDims(sp_size=2)
    )
    assert load_model_shape(toy.config.to_dict()).num_params == sum(p.numel() for p in toy.parameters())
    planned = plan(toy.config.to_dict(), 4096, Cluster(gpus=2, gpus_per_node=2))
    assert planned.model.model_type == "toy_llama" and planned.candidates


def _sp_case(rank, world_size, toy, llama, ids, mesh):
    """prepare_model: the toy's sharded logits, loss and summed gradients equal the Llama's in one process."""
    logits, loss, grads = _loss_and_grads(llama, ids)
    idx = shard_index("zigzag", world_size, rank, SEQ)
    for strategy in ("ring", "ulysses"):
        model = seqpar.prepare_model(copy.deepcopy(toy), mesh, strategy=strategy)
        shard = seqpar.shard_batch({"input_ids": ids}, mesh)
        got = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
        torch.testing.assert_close(got, logits[:, idx], atol=ATOL, rtol=RTOL)
        sharded_loss = seqpar.cross_entropy(got, shard["shift_labels"], mesh)
        sharded_loss.backward()
        seqpar.reduce_gradients(model.parameters(), mesh)
        torch.testing.assert_close(seqpar.sum_over(sharded_loss.detach(), mesh), loss, atol=ATOL, rtol=RTOL)
        for name, p in model.named_parameters():
            torch.testing.assert_close(
                p.grad,
                grads[to_llama_name(name)],
                atol=ATOL,
                rtol=RTOL,
                msg=lambda m, n=name, s=strategy: f"{s} {n}: {m}",
            )


def _tp_case(toy, llama, ids):
    """apply_tensor_parallel: the family's plan splits the renamed projections; logits unchanged."""
    mesh = seqpar.make_mesh(sp_size=1, tp_size=2)
    model = seqpar.apply_tensor_parallel(copy.deepcopy(toy), mesh)
    q, down = model.body.blocks[0].mixer.q_proj.weight, model.body.blocks[0].ffn.down_proj.weight
    assert isinstance(q, DTensor) and q.to_local().shape[0] == 2 * 12 and down.to_local().shape[1] == 96 // 2
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, llama(input_ids=ids).logits, atol=ATOL, rtol=RTOL)


def _fsdp_case(toy, llama, ids, mesh):
    """apply_data_parallel("fsdp"): the toy's embedding, every block and its head are FSDP2 units of their own."""
    _, _, grads = _loss_and_grads(llama, ids)
    model = seqpar.prepare_model(copy.deepcopy(toy), mesh, strategy="ring")
    seqpar.apply_data_parallel(model, mesh, "fsdp")
    units = [model.body.tok, *model.body.blocks, model.out, model]
    assert all(isinstance(unit, FSDPModule) for unit in units) and not isinstance(model.body.final, FSDPModule)
    shard = seqpar.shard_batch({"input_ids": ids}, mesh)
    logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
    seqpar.cross_entropy(logits, shard["shift_labels"], mesh).backward()
    for name, p in model.named_parameters():
        full = p.grad.full_tensor()
        torch.testing.assert_close(
            full, grads[to_llama_name(name)], atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"fsdp {n}: {m}"
        )


def _pipeline_case(toy, llama, ids):
    """apply_pipeline_parallel at pp 2: the toy's stages give the Llama's loss and gradients."""
    _, loss, grads = _loss_and_grads(llama, ids)
    mesh = seqpar.make_mesh(pp_size=2)
    model = seqpar.prepare_model(copy.deepcopy(toy), mesh)
    pipe = seqpar.apply_pipeline_parallel(model, mesh, microbatches=2)
    got = pipe.step(seqpar.shard_batch({"input_ids": ids}, mesh))
    torch.testing.assert_close(got, loss, atol=ATOL, rtol=RTOL)
    for stage in pipe.stages:
        for name, p in original_names(stage):
            torch.testing.assert_close(
                p.grad, grads[to_llama_name(name)], atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"pp {n}: {m}"
            )


def _doctor_case(toy, ids, mesh):
    """seqpar.doctor finds the toy's layers and attention by its family's entry: every layer agrees."""
    report = seqpar.doctor(toy, mesh, {"input_ids": ids}, strategy="ring")
    assert report.verdict and report.agrees, str(report)
    assert [r.name for r in report.rows] == ["body.blocks.0", "body.blocks.1", "output"], str(report)
    assert [r.attention_calls for r in report.rows] == [1, 1, -1], str(report)


def _toy_worker(rank, world_size, registered):
    if registered:
        register_toy()  # a spawned rank starts with the built-in registry
    assert (TOY.model_type in FAMILIES) == registered
    toy, llama = toy_and_llama()
    ids = tokens(2, SEQ, 3)
    mesh = seqpar.make_mesh(sp_size=2)
    _sp_case(rank, world_size, toy, llama, ids, mesh)
    if registered:
        _tp_case(toy, llama, ids)
    else:  # the config's tp plan names Llama's paths, not the toy's: read anatomy carries no plan
        with pytest.raises(SeqparInputError, match="no tensor-parallel plan"):
            seqpar.apply_tensor_parallel(copy.deepcopy(toy), seqpar.make_mesh(sp_size=1, tp_size=2))
    _fsdp_case(toy, llama, ids, mesh)
    _pipeline_case(toy, llama, ids)
    _doctor_case(toy, ids, mesh)


def test_a_registered_family_serves_every_axis_on_two_ranks():
    run_ranks(2, _toy_worker, True, fresh=True)  # it registers a family for the rest of the process's life


def test_a_family_read_from_the_model_serves_every_axis_on_two_ranks():
    """The toy without its entry: every axis finds its parts by the anatomy read from its classes."""
    run_ranks(2, _toy_worker, False)


def _own_backend_worker(rank, world_size):
    """A Llama layer whose attention switches to its own backend: refused at that module on every rank, and the
    negative control: with the check's hook taken off, the same model runs and its logits are wrong."""
    reference = build("llama")
    ids = tokens(2, SEQ, 5)
    with torch.no_grad():
        want = reference(input_ids=ids).logits
    mesh = seqpar.make_mesh(sp_size=world_size)
    shard = seqpar.shard_batch({"input_ids": ids}, mesh)
    for checked in (True, False):
        model = seqpar.prepare_model(copy.deepcopy(reference), mesh)
        attention = model.model.layers[1].self_attn
        attention.config = copy.deepcopy(attention.config)  # a backend picked by the family's own code
        attention.config._attn_implementation = "eager"
        if not checked:
            attention._forward_hooks.clear()  # the check's hook is the only forward hook there
        with torch.no_grad():
            if checked:
                with pytest.raises(SeqparInputError, match=r"^model\.layers\.1\.self_attn \(LlamaAttention\) ran "
                                   r"without calling seqpar's attention"):  # fmt: skip
                    model(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
                continue
            logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
        idx = shard_index("zigzag", world_size, rank, SEQ)
        assert (logits - want[:, idx]).abs().max() > 1e-2, "each rank attends over its own shard alone"


@pytest.mark.parametrize("world_size", [2, 3])
def test_attention_that_bypasses_seqpar_is_refused_at_run_time(world_size):
    run_ranks(world_size, _own_backend_worker)


READ_TP = ("starcoder2", "phi", "gpt_neox", "smollm3", "cohere2")
"""Families without an entry whose own tp plan uses plain column and row splits (Note [read anatomy])."""


def _read_tp_worker(rank, world_size):
    from seqpar.models.zoo import CAUSAL_LM, tiny_model

    ids = tokens(2, SEQ, 4)
    for model_type in READ_TP:
        reference = tiny_model(model_type, (CAUSAL_LM,))
        assert find_anatomy(reference).family.tp_plan, model_type
        model = seqpar.apply_tensor_parallel(copy.deepcopy(reference), seqpar.make_mesh(sp_size=1, tp_size=2))
        want, got = reference(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
        torch.testing.assert_close(
            got.logits, want.logits, atol=ATOL, rtol=RTOL, msg=lambda m, t=model_type: f"{t}: {m}"
        )
        want.loss.backward()
        got.loss.backward()
        for (name, p), q in zip(reference.named_parameters(), model.parameters(), strict=True):
            grad = q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad
            torch.testing.assert_close(
                grad, p.grad, atol=ATOL, rtol=RTOL, msg=lambda m, n=name, t=model_type: f"{t} {n}: {m}"
            )


def test_tensor_parallel_follows_a_read_familys_own_plan():
    """tp 2 on families whose plan transformers declares (fused GPT-NeoX qkv, biases): logits and gradients."""
    run_ranks(2, _read_tp_worker)


def test_read_families_whose_masks_seqpar_does_not_build_are_refused_by_name():
    """Falcon with ALiBi (a bias built by the model), Kolibri 1.1's pooled key selection on its indexed layers, and a
    chunk size no layer type names: refused, the feature named (a compressed layer without its compressor's row:
    tests/test_frontier.py)."""
    from seqpar.models.zoo import CAUSAL_LM, tiny_config, tiny_model

    falcon = tiny_config("falcon")
    falcon.alibi = True
    with pytest.raises(SeqparInputError, match=r"'falcon' models .* ALiBi position bias \(config\.alibi\)"):
        seqpar.prepare_model(transformers.AutoModelForCausalLM.from_config(falcon), None)
    with pytest.raises(SeqparInputError, match=r"layer \d is a sparse-attention layer \(indexed_attention\) whose"):
        seqpar.prepare_model(tiny_model("kolibri1_1", (CAUSAL_LM,), device="meta"), None)
    llama4 = tiny_model("llama4_text", (CAUSAL_LM,), device="meta")
    llama4.config.layer_types = ["full_attention"] * llama4.config.num_hidden_layers  # the chunk size kept
    with pytest.raises(SeqparInputError, match=r"chunked \(attention_chunk_size=8\) on layers its layer_types do not"):
        seqpar.prepare_model(llama4, None)
    assert not isinstance(find_anatomy(tiny_model("falcon", (CAUSAL_LM,), device="meta")), str), "RoPE Falcon is read"


def test_seqpar_models_lists_entries_read_families_and_refusals(capsys):
    """``seqpar models`` on the installed transformers: a registered family, a read one, a refused one, named; and
    whether a multimodal family's images are served (its tower read) or its text path only (PaliGemma's own mask)."""
    from seqpar.cli import main

    assert main(["models", "--only", "llama,olmo3,cpmant,t5,llava,mistral3,paligemma", "--json"]) == 0
    rows = {row["model_type"]: row for row in map(json.loads, capsys.readouterr().out.splitlines())}
    statuses = {"llama": "entry", "olmo3": "read", "cpmant": "refused", "llava": "entry", "mistral3": "read"}
    assert {k: r["status"] for k, r in rows.items()} == {**statuses, "paligemma": "read"}
    assert "learned relative position bias" in rows["cpmant"]["why"]
    images = {k: r.get("images") for k, r in rows.items() if k in ("llama", "llava", "mistral3", "paligemma")}
    assert images == {"llama": "", "llava": "with images", "mistral3": "with images", "paligemma": "text only"}
    assert "masks its image tokens in its own code" in rows["paligemma"]["why"]
    assert main(["models", "--only", "olmo3"]) == 0
    assert "1 read" in capsys.readouterr().out


def test_a_mask_or_bias_the_family_builds_itself_is_refused():
    """A layer that hands seqpar's attention an additive bias of its own (as Falcon's ALiBi would, or a
    ``position_bias=`` as Inkling's relative logits, or a sparse indexer's ``indices=``): refused, not ignored. The
    negative control: the same model without that bias runs."""

    def biased(forward, keyword):
        def call(*args, attention_mask=None, **kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            bias = torch.zeros(hidden.shape[0], 1, hidden.shape[1], hidden.shape[1])
            return forward(*args, **{"attention_mask": attention_mask, **kwargs, keyword: bias})

        return call

    ids = tokens(1, SEQ, 6)
    shard = seqpar.shard_batch({"input_ids": ids}, None)
    for keyword, said in (
        ("attention_mask", "a mask or bias tensor"),
        ("position_bias", "position_bias= "),
        ("indices", "indices= "),
    ):
        model = seqpar.prepare_model(build("llama"), None)
        with torch.no_grad():
            model(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
            model.model.layers[1].self_attn.forward = biased(model.model.layers[1].self_attn.forward, keyword)
            with pytest.raises(SeqparInputError, match=f"LlamaAttention handed seqpar's attention {said}"):
                model(input_ids=shard["input_ids"], position_ids=shard["position_ids"])


def test_a_read_multimodal_family_names_its_tower_or_why_images_are_refused():
    """Mistral 3 has no entry: its text decoder and its vision tower (the child built from its vision_config) are
    read, so calls with images run on whole rows (tests/test_zoo.py judges them against one process). PaliGemma's
    own code masks its image and prefix tokens bidirectionally: its text path is served, and a call with pixels is
    refused naming that (Note [read anatomy])."""
    from seqpar.models.zoo import IMAGE_TEXT_TO_TEXT, tiny_model

    read = find_anatomy(tiny_model("mistral3", (IMAGE_TEXT_TO_TEXT,)))
    assert read.family.derived and read.family.vision == "vision_tower" and not read.family.images
    assert read.name(read.decoder) == "model.language_model"
    model = tiny_model("paligemma", (IMAGE_TEXT_TO_TEXT,))
    read = find_anatomy(model)
    assert read.family.vision is None and "masks its image tokens in its own code" in read.family.images
    model = seqpar.prepare_model(model, None)
    shard = seqpar.shard_batch({"input_ids": tokens(1, SEQ, 7) % 90 + 4}, None)
    call = dict(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
    with torch.no_grad():
        model(**call)
        with pytest.raises(SeqparInputError, match="masks its image tokens in its own code"):
            model(**call, pixel_values=torch.zeros(1, 3, 16, 16))


def test_a_model_that_masks_its_images_itself_would_run_wrong_unread(monkeypatch):
    """The negative control of the image-mask check (Note [read anatomy]): with it switched off, PaliGemma's images
    are served whole-row, and its bidirectional prefix (token types 0) is silently lost to the causal mask."""
    from benchmarks.zoo_images import image_inputs
    from seqpar.models import derived
    from seqpar.models.zoo import IMAGE_TEXT_TO_TEXT, tiny_model

    model = tiny_model("paligemma", (IMAGE_TEXT_TO_TEXT,))
    ids, extra = image_inputs(model, 4)
    types = torch.zeros_like(ids)
    types[:, -6:] = 1  # the image and the prompt a prefix that sees itself both ways, the rest the suffix
    with torch.no_grad():
        want = model(input_ids=ids, token_type_ids=types, **extra).logits
        assert (want - model(input_ids=ids, **extra).logits).abs().max() > 1e-2  # the prefix block matters
    monkeypatch.setattr(derived, "_OWN_IMAGE_MASKS", ())
    unchecked = seqpar.prepare_model(copy.deepcopy(model), None)
    assert find_anatomy(unchecked).family.vision == "vision_tower"
    with torch.no_grad():
        got = unchecked(input_ids=ids, token_type_ids=types, **extra).logits
    assert (got - want).abs().max() > 1e-2


def test_every_own_attention_row_has_its_adapter():
    """Note [attention adapters]: the reader's table (what it counts as served) and the adapters' (what runs) name the
    same classes, so a class the reader accepts always has a forward that attends through seqpar."""
    from seqpar.models.own_attention import OWN_ATTENTION, OWN_POSITIONS
    from seqpar.sequence_parallel.attention_adapters import ADAPTERS, POSITION_ADAPTERS

    assert sorted(OWN_ATTENTION) == sorted(ADAPTERS)
    assert sorted(OWN_POSITIONS) == sorted(POSITION_ADAPTERS)


def test_a_read_mrope_family_refuses_embeddings_on_shards():
    """GLM-4V has no entry: its text config's mRoPE sections are read, so a call on inputs_embeds shards (whose
    [B, S] positions would be wrong for any image token in them) is refused as for Qwen-VL's entry."""
    from seqpar.models.zoo import IMAGE_TEXT_TO_TEXT, tiny_model

    model = tiny_model("glm4v", (IMAGE_TEXT_TO_TEXT,))
    read = find_anatomy(model)
    assert read.family.derived and read.family.positions == "mrope" and read.family.vision == "visual"
    model = seqpar.prepare_model(model, None)
    shard = seqpar.shard_batch({"input_ids": tokens(1, SEQ, 7) % 80 + 4}, None)
    embeds = model.get_input_embeddings()(shard["input_ids"])
    with torch.no_grad(), pytest.raises(SeqparInputError, match="numbers image tokens with mRoPE"):
        model(inputs_embeds=embeds, position_ids=shard["position_ids"])
