"""``seqpar.doctor`` and ``seqpar doctor``: sharded step vs one process per layer, and the setup pitfalls.

Every supported family agrees at sp 2 (gpt-oss's sinks and Gemma 2's soft-capped logits too); a token mixer
inserted into layer k, and attention computed without seqpar in layer k, are found at layer k; each pitfall is
found in a batch or model built to have it and not in its clean twin. One spawn of 2 ranks holds the library
checks; the CLI runs once on the demo model.
"""

from __future__ import annotations

import subprocess

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import seqpar
from seqpar.cli import main as cli_main
from seqpar.errors import SeqparInputError
from tests._commands import seqpar_command
from tests._dist import run_ranks
from tests._models import SEQ, VOCAB, build, tiny_config, tokens

FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "gemma3", "phi3", "olmo2")


class ConvMixer(torch.nn.Module):
    """An MLP plus a depthwise convolution along the sequence (as in Mamba-style blocks): mixes neighbours."""

    def __init__(self, mlp: torch.nn.Module, hidden: int) -> None:
        super().__init__()
        self.mlp = mlp
        self.conv = torch.nn.Conv1d(hidden, hidden, 3, padding=1, groups=hidden)

    def forward(self, x):
        return self.mlp(x) + self.conv(x.transpose(1, 2)).transpose(1, 2)


class CumsumMixer(torch.nn.Module):
    """An MLP plus a running sum over the sequence: no module type gives it away, only its outputs."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return self.mlp(x) + 0.05 * x.cumsum(dim=1)


class OwnAttention(torch.nn.Module):
    """Llama attention computed here as softmax(q k^T) v, not through transformers' AttentionInterface."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        a = self.inner
        b, s, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, s, -1, a.head_dim).transpose(1, 2) for p in (a.q_proj, a.k_proj, a.v_proj))
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        scores = (q @ k.transpose(-1, -2)) * a.scaling
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        out = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        return a.o_proj(out.transpose(1, 2).reshape(b, s, -1)), None


class NoBackend(transformers.LlamaForCausalLM):
    """A Llama that says it does not route attention through transformers' AttentionInterface."""

    _supports_attention_backend = False


def _sinks_and_softcap(mesh):
    """gpt-oss (attention sinks) and Gemma 2 (soft-capped logits), 4 layers each: OK at every layer."""
    for kind in ("gpt_oss", "gemma2"):
        report = seqpar.doctor(build(kind), mesh, {"input_ids": tokens(2, SEQ, 1)})
        assert report.verdict and report.agrees and not report.pitfalls, f"{kind}:\n{report}"
        assert [r.name for r in report.rows] == [*(f"model.layers.{i}" for i in range(4)), "output"], kind
        assert all(r.activation < 1e-5 and r.gradient < 1e-5 for r in report.rows), f"{kind}:\n{report}"
        assert [r.attention_calls for r in report.rows] == [1, 1, 1, 1, -1], kind
        assert "VERDICT: OK" in str(report), kind


def _three_layer_llama():
    config = tiny_config("llama")
    config.num_hidden_layers = 3
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def _kinds(report) -> list[tuple[str, str]]:
    return [(p.kind, p.module) for p in report.pitfalls]


def _families(mesh):
    for kind in FAMILIES:
        report = seqpar.doctor(build(kind), mesh, {"input_ids": tokens(2, SEQ, 1)}, strategy="ring")
        assert report.verdict and report.agrees, f"{kind}:\n{report}"
        assert [r.name for r in report.rows] == ["model.layers.0", "model.layers.1", "output"], kind
        assert all(r.activation < 1e-5 and r.gradient < 1e-5 for r in report.rows), f"{kind}:\n{report}"
        assert [r.attention_calls for r in report.rows] == [1, 1, -1], kind
        assert report.loss[0] == pytest.approx(report.loss[1], rel=1e-5), kind
        assert "VERDICT: OK" in str(report), kind


def _hybrids(mesh):
    """Hybrids whose mixers seqpar adapts (Note [mixer adapters]): OK at every layer, no token-mixing pitfall,
    seqpar attention only in the attention layer; the report names what each mixer's steps ran on this CPU
    (Note [mixer implementations]: transformers' PyTorch code, as no fused package runs on CPU tensors)."""
    ran = {
        "lfm2": ["Lfm2ShortConv: convolution -> torch"],
        "qwen3_next": ["Qwen3NextGatedDeltaNet: convolution -> torch", "Qwen3NextGatedDeltaNet: recurrence -> torch"],
    }
    for kind, lines in ran.items():
        report = seqpar.doctor(build(kind), mesh, {"input_ids": tokens(2, SEQ, 1)})
        assert report.verdict and not report.pitfalls, f"{kind}:\n{report}"
        assert [r.attention_calls for r in report.rows] == [0, 1, 0, 0, -1], f"{kind}:\n{report}"
        assert [k.split(" (")[0] for k in report.kernels] == lines, report.kernels
        assert all(f"mixer kernel: {k}" in str(report) for k in report.kernels), str(report)
    # a kernelized model (transformers' use_kernels, which its from_pretrained turns on where the kernels package
    # is installed): transformers' hub mapping has no CPU kernel for the convolution, so the line reads PyTorch
    # still, and says "hub" only where kernelize installed one (Note [hub kernels]; tests/test_hub_kernels.py)
    kernelized = build("lfm2")
    kernelized.use_kernels = True  # transformers' own setter (the kernels package is one of its dependencies)
    report = seqpar.doctor(kernelized, mesh, {"input_ids": tokens(2, SEQ, 1)})
    assert kernelized.use_kernels and report.verdict, str(report)
    assert [k.split(" (")[0] for k in report.kernels] == ran["lfm2"], report.kernels


def _layer_k(mesh):
    """Layer 1 of 3 mixes tokens (a convolution, a running sum) or attends by itself: flagged at layer 1."""
    ids = {"input_ids": tokens(2, SEQ, 2)}
    for make, module in (
        (lambda mlp: ConvMixer(mlp, 48), "model.layers.1.mlp.conv"),
        (CumsumMixer, "model.layers.1.mlp"),
    ):
        model = _three_layer_llama()
        model.model.layers[1].mlp = make(model.model.layers[1].mlp)
        report = seqpar.doctor(model, mesh, ids)
        assert not report.verdict and report.first_failing == "model.layers.1", str(report)
        # layer 0 computes the same; its gradients differ only through layer 1's backward
        assert report.rows[0].activation_ok and not report.rows[1].activation_ok, str(report)
        assert report.rows[1].first_module == "model.layers.1.mlp", str(report)
        assert _kinds(report) == [("token_mixing", module)], str(report)
        assert "VERDICT: DIFFERS from model.layers.1" in str(report)
    model = _three_layer_llama()
    model.model.layers[1].self_attn = OwnAttention(model.model.layers[1].self_attn)
    report = seqpar.doctor(model, mesh, ids)  # refused at run time, naming the module (Note [attention went
    assert not report.verdict and "VERDICT: SETUP" in str(report), str(report)  # through seqpar])
    assert "model.layers.1.self_attn (OwnAttention) ran without calling seqpar's attention" in str(report)
    # the same model without the inserted module agrees
    assert seqpar.doctor(_three_layer_llama(), mesh, ids).verdict


def _packing(mesh):
    docs = [{"input_ids": tokens(1, n, 10 + n)[0].tolist()} for n in (13, 21, 14)]
    packed = transformers.DataCollatorWithFlattening()(docs)  # labels -100 at each document start
    clean = seqpar.doctor(build("llama"), mesh, packed)
    assert clean.verdict and not clean.pitfalls, str(clean)
    no_positions = transformers.DataCollatorWithFlattening(return_position_ids=False)(docs)
    report = seqpar.doctor(build("llama"), mesh, no_positions)
    assert _kinds(report) == [("packing", "batch['position_ids']")] and report.agrees, str(report)
    assert "no position_ids" in report.pitfalls[0].problem
    run_on = {**packed, "position_ids": torch.arange(SEQ)[None]}
    report = seqpar.doctor(build("llama"), mesh, run_on)
    assert _kinds(report) == [("packing", "batch['position_ids']")], str(report)
    assert "run on across a document start" in report.pitfalls[0].problem and "token 13" in report.pitfalls[0].problem
    flash_kwargs = {"input_ids": packed["input_ids"], "cu_seq_lens_q": torch.tensor([0, 13, 34, 48])}
    report = seqpar.doctor(build("llama"), mesh, flash_kwargs)
    assert _kinds(report) == [("packing", "batch['position_ids']")] and "cu_seq_lens_q" in str(report)
    ids = tokens(1, SEQ, 3)
    ids[0, 20] = VOCAB - 1  # an end-of-document token inside the row
    assert seqpar.doctor(build("llama"), mesh, {"input_ids": ids}).verdict  # not named: not looked for
    report = seqpar.doctor(build("llama"), mesh, {"input_ids": ids}, eos_token_id=VOCAB - 1)
    assert _kinds(report) == [("packing", "batch['position_ids']")], str(report)
    # a one-process baseline with the config's default use_cache would mix the documents
    baseline = seqpar.doctor(build("llama"), mesh, packed)
    assert [(n.kind, n.module) for n in baseline.notes] == [("baseline", "config.use_cache")], str(baseline)
    model = build("llama")
    model.config.use_cache = False
    assert seqpar.doctor(model, mesh, packed).notes == []


def _batch_pitfalls(mesh):
    ids = tokens(2, SEQ, 4)
    shifted = torch.roll(ids, -1, dims=1)
    shifted[:, -1] = -100
    report = seqpar.doctor(build("llama"), mesh, {"input_ids": ids, "labels": shifted})
    assert _kinds(report) == [("labels", "batch['labels']")] and report.agrees, str(report)
    assert "labels look shifted already" in report.pitfalls[0].problem and report.compared_without == ["labels"]
    assert seqpar.doctor(build("llama"), mesh, {"input_ids": ids, "labels": ids}).verdict
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    report = seqpar.doctor(build("llama"), mesh, {"input_ids": ids, "attention_mask": mask})
    assert _kinds(report) == [("padding", "batch['attention_mask']")] and report.agrees, str(report)
    assert "row 1 is padded on the left" in report.pitfalls[0].problem
    right = torch.ones_like(ids)
    right[1, -5:] = 0
    assert seqpar.doctor(build("llama"), mesh, {"input_ids": ids, "attention_mask": right}).verdict


def _model_pitfalls(mesh, rank):
    ids = {"input_ids": tokens(2, SEQ, 5)}
    config = tiny_config("phi3")
    config.resid_pdrop = 0.1
    torch.manual_seed(0)
    dropping = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    report = seqpar.doctor(dropping.train(), mesh, ids)
    assert ("dropout", "model.layers.1.resid_mlp_dropout") in _kinds(report) and report.agrees, str(report)
    assert {k for k, _ in _kinds(report)} == {"dropout"} and len(report.pitfalls) == 4, str(report)
    assert seqpar.doctor(dropping.eval(), mesh, ids).verdict
    config = tiny_config("llama")
    config.attention_dropout = 0.1
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    report = seqpar.doctor(model, mesh, ids)
    assert _kinds(report) == [("dropout", "config.attention_dropout")] and report.agrees, str(report)
    report = seqpar.doctor(build("llama", seed=rank), mesh, ids)
    assert _kinds(report) == [("ranks", "parameters")], str(report)
    report = seqpar.doctor(build("llama"), mesh, {"input_ids": tokens(2, SEQ, 5 + rank)})
    assert ("ranks", "batch['input_ids']") in _kinds(report), str(report)
    torch.manual_seed(0)
    report = seqpar.doctor(NoBackend(tiny_config("llama")).eval(), mesh, ids)
    assert not report.compared and not report.verdict and _kinds(report)[0][0] == "refused", str(report)
    assert "does not route attention through" in report.verdict_line()
    with pytest.raises(SeqparInputError, match=r"before seqpar\.prepare_model"):
        seqpar.doctor(seqpar.prepare_model(build("llama"), mesh), mesh, ids)
    with pytest.raises(SeqparInputError, match="cannot find the decoder layers"):
        seqpar.doctor(torch.nn.Linear(2, 2), mesh, ids)


def _vision_language(mesh, rank):
    """A batch with pixels: both copies called on whole rows; every layer and the vision tower's gradients (in the
    output row) compared; a missing gradient sum in the vision split shows there; other pixels are refused."""
    from seqpar.sequence_parallel import vision_split
    from tests._vlm_models import build, sample

    for family in ("qwen2_5_vl", "gemma3"):
        report = seqpar.doctor(build(family), mesh, sample(family))
        names = [row.name for row in report.rows]
        assert names == ["model.language_model.layers.0", "model.language_model.layers.1", "output"], str(report)
        assert report.verdict and all(row.attention_calls == 1 for row in report.rows[:2]), str(report)

    class NotSummed(vision_split._GatherSummed):
        @staticmethod
        def backward(ctx, grad):
            start = sum(ctx.lengths[: ctx.rank])
            return grad[start : start + ctx.lengths[ctx.rank]], None, None, None

    kept, vision_split._GatherSummed = vision_split._GatherSummed, NotSummed
    try:
        report = seqpar.doctor(build("qwen2_5_vl"), mesh, sample("qwen2_5_vl"))
    finally:
        vision_split._GatherSummed = kept
    assert [row.name for row in report.rows if not row.passes] == ["output"], str(report)
    assert report.rows[-1].activation_ok and not report.rows[-1].gradient_ok, str(report)
    batch = sample("qwen2_5_vl")
    batch["pixel_values"] = batch["pixel_values"] + rank
    report = seqpar.doctor(build("qwen2_5_vl"), mesh, batch)
    assert not report.compared and _kinds(report)[-1][0] == "refused", str(report)


def _generated_vision_language(mesh):
    """The rows ``seqpar doctor`` generates for a vision-language model (images between text, random pixels) are
    taken by the model as its processor's are; the doctor agrees on them (Qwen3-VL's DeepStack, Qwen3.5's gated
    DeltaNet layers, Gemma 3's blocks)."""
    from seqpar.diagnosis.multimodal import generated_multimodal_batch
    from tests._vlm_models import build, config

    for family in ("qwen3_vl", "qwen3_5", "gemma3"):
        batch = generated_multimodal_batch(config(family), 48, 2, seed=3)
        assert batch["input_ids"].shape == (2, 48)
        report = seqpar.doctor(build(family), mesh, batch)
        assert report.verdict and report.compared, str(report)


def _worker(rank, world_size):
    mesh = seqpar.make_mesh()
    _vision_language(mesh, rank)
    _generated_vision_language(mesh)
    _families(mesh)
    _hybrids(mesh)
    _sinks_and_softcap(mesh)
    _layer_k(mesh)
    _packing(mesh)
    _batch_pitfalls(mesh)
    _model_pitfalls(mesh, rank)


def test_doctor_families_layers_and_pitfalls():
    run_ranks(2, _worker)


def _doctor(*args: str) -> str:
    """``seqpar doctor`` forked from the session's command server (its ranks forked from it too: Note [forked
    commands]); its standard output, once it ended well."""
    command = seqpar_command(["doctor", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = command.communicate(timeout=240)
    assert command.returncode == 0, err
    return out


def test_seqpar_doctor_cli_on_the_demo_model():
    out = _doctor("--sp", "2", "--seq-len", "128")
    assert "VERDICT: OK" in out and "model.layers.1" in out, out
    assert "strategy auto -> ulysses" in out and "note [baseline] config.use_cache" in out, out


@pytest.fixture(scope="module")
def vlm_configs(tmp_path_factory):
    from tests._vlm_models import config

    root = tmp_path_factory.mktemp("vlm")
    for family in ("qwen2_5_vl", "gemma3", "llava"):
        config(family).save_pretrained(root / family)
    return root


def test_seqpar_doctor_cli_generates_rows_with_images_for_a_vision_language_model(vlm_configs):
    out = _doctor("--model", str(vlm_configs / "qwen2_5_vl"), "--seq-len", "64")
    assert "VERDICT: OK" in out and "model.language_model.layers.1" in out, out


@pytest.mark.parametrize(
    ("family", "flags", "message"),
    [
        ("llava", [], "generates image batches for qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_5, qwen3_5_moe, gemma3, not"),
        ("gemma3", ["--data", "README.md"], "--data holds text rows, but this is a vision-language model"),
        ("gemma3", ["--seq-len", "10"], "too short for the generated images"),
    ],
)
def test_seqpar_doctor_cli_refuses_vision_language_rows_it_cannot_make(capfd, vlm_configs, family, flags, message):
    assert cli_main(["doctor", "--model", str(vlm_configs / family), *flags]) == 2
    assert message in capfd.readouterr().err
