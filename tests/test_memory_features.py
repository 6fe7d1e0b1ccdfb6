"""Tiled MLP and checkpoint offload: the same loss and gradients as without them, alone and under seqpar.

Model families from configs (random weights), a plain PyTorch MLP, prepared models at sp 1-3 (real gloo
ranks) with checkpointing, DDP and FSDP2, and a ``seqpar train`` run; bad input raises SeqparInputError.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import transformers
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import seqpar
from seqpar.errors import SeqparInputError
from seqpar.memory import apply_activation_offload, apply_tiled_mlp, is_tiled, offload_layer_inputs, tiled_mlp
from tests._dist import run_ranks
from tests._models import SEQ, VOCAB, build, tokens
from tests.test_train_cli import TINY, losses, seqpar_trains

RTOL, ATOL = 1e-5, 1e-6  # fp32; the tiled MLP sums its parameter gradients chunk by chunk
CHUNK = 7  # 2 x 48 tokens -> 13 full chunks and one of 5


def _loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(want, got, what):
    torch.testing.assert_close(got[0], want[0], rtol=RTOL, atol=0, msg=lambda m: f"{what} loss: {m}")
    assert sorted(got[1]) == sorted(want[1]), what
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{what} {n}: {m}")


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3"])
def test_tiled_mlp_gives_the_untiled_loss_and_gradients(kind):
    ref = build(kind).train()
    model = copy.deepcopy(ref)
    assert apply_tiled_mlp(model, chunk_tokens=CHUNK) == 2
    assert all(is_tiled(layer.mlp) for layer in model.model.layers)
    ids = tokens(2, SEQ, 1)
    _assert_same(_loss_and_grads(ref, ids), _loss_and_grads(model, ids), kind)
    with torch.no_grad():  # no graph: the chunked forward alone
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=RTOL, atol=ATOL)


class _Shapes(TorchDispatchMode):
    """Shapes of every tensor an op produces."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


class _PlainMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(12)
        self.body = nn.Sequential(nn.Linear(12, 40), nn.GELU(), nn.Dropout(0.0), nn.Linear(40, 12))
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 12))

    def forward(self, x):
        return self.body(self.norm(x)) * self.scale


def test_plain_mlp_keeps_one_chunk_of_intermediates_and_matches():
    torch.manual_seed(0)
    ref = _PlainMLP()
    mlp = tiled_mlp(copy.deepcopy(ref), 16)
    x = torch.randn(3, 20, 12, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    dout = torch.randn(3, 20, 12)
    out = ref(x)
    out.backward(dout)
    saved = []
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t)
    with hooks, _Shapes() as forward:
        got = mlp(x2)
    with _Shapes() as backward:
        got.backward(dout)
    torch.testing.assert_close(got, out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(x2.grad, x.grad, rtol=RTOL, atol=ATOL)
    for (name, p), q in zip(ref.named_parameters(), mlp.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    # the graph keeps only the input; intermediates ([tokens, 40]) exist for at most 16 of the 60 tokens
    # (the transposed weights are [12, 40])
    assert saved == [(60, 12)], saved
    rows = [math.prod(s[:-1]) for s in forward.shapes + backward.shapes if len(s) >= 2 and s[-1] == 40]
    assert max(rows) == 16, rows


def test_plain_mlp_under_autocast_recomputes_in_the_forward_dtype():
    """bf16 autocast on the CPU: the backward's recomputation runs under the forward's autocast state."""
    torch.manual_seed(0)
    ref = _PlainMLP()
    mlp = tiled_mlp(copy.deepcopy(ref), 16)
    dtypes = []
    mlp.body[0].register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    x, dout = torch.randn(3, 20, 12), torch.randn(3, 20, 12)

    def run(model):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = (model(xi) * dout).sum()
        loss.backward()  # outside autocast, as a training loop calls it
        return loss.detach(), xi.grad, [p.grad for p in model.parameters()]

    want, got = run(ref), run(mlp)
    assert dtypes == [torch.bfloat16] * 8  # 60 tokens in 4 chunks: in the forward and again in the backward
    torch.testing.assert_close(got[0], want[0], rtol=RTOL, atol=0)
    # the input gradient is computed row by row in bf16 in both (recomputed in fp32 it is 0.6% off)
    torch.testing.assert_close(got[1], want[1], rtol=1e-3, atol=1e-5)
    # bf16 tolerance: each chunk's weight gradient is rounded to bf16 before the chunks are summed
    for (name, _), p, q in zip(ref.named_parameters(), want[2], got[2], strict=True):
        tol = {"rtol": 1.6e-2, "atol": 1e-2 * p.abs().max().item()}
        torch.testing.assert_close(q, p, **tol, msg=lambda m, n=name: f"{n}: {m}")


class _BatchNormMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)


class _RouterMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x), x.mean()


def test_what_cannot_be_tiled_is_refused_with_its_name():
    llama = build("llama")
    with pytest.raises(SeqparInputError, match="chunk_tokens must be a positive"):
        apply_tiled_mlp(llama, chunk_tokens=0)
    with pytest.raises(SeqparInputError, match="found no decoder MLP"):
        apply_tiled_mlp(nn.Sequential(nn.Linear(4, 4)))
    holder = nn.ModuleDict({"ok": _PlainMLP(), "bad": _BatchNormMLP()})
    with pytest.raises(SeqparInputError, match=r"cannot tile the MLP bad .*bad\.bn \(BatchNorm1d\)"):
        apply_tiled_mlp(holder, modules=[holder["ok"], holder["bad"]])
    assert not is_tiled(holder["ok"]), "checked before anything changes"
    dropout = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.1), nn.Linear(8, 4))
    with pytest.raises(SeqparInputError, match=r"1 \(Dropout\)"):
        tiled_mlp(dropout, 4)
    with pytest.raises(SeqparInputError, match="returned tuple"):
        tiled_mlp(_RouterMLP(), 4)(torch.randn(2, 8))
    with pytest.raises(SeqparInputError, match="takes one tensor"):
        tiled_mlp(_PlainMLP(), 4)(torch.randn(2, 12), torch.randn(2, 12))
    moe = transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
        shared_expert_intermediate_size=16,
    )  # fmt: skip
    with pytest.raises(SeqparInputError, match=r"cannot tile the MLP model\.layers\.0\.mlp"):
        apply_tiled_mlp(transformers.AutoModelForCausalLM.from_config(moe))


def test_offload_hooks_give_the_same_loss_and_gradients_on_the_cpu():
    ref = build("llama").train()
    model = copy.deepcopy(ref)
    with pytest.raises(SeqparInputError, match="enable checkpointing first"):
        apply_activation_offload(model)
    with pytest.raises(SeqparInputError, match="found no decoder layers"):
        apply_activation_offload(nn.Linear(2, 2))
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if not torch.cuda.is_available():
        with pytest.warns(UserWarning, match="does nothing without CUDA"):
            assert apply_activation_offload(model) is False
    offload = offload_layer_inputs(model, copy_cpu_tensors=True)
    ids = tokens(2, SEQ, 1)
    _assert_same(_loss_and_grads(ref, ids), _loss_and_grads(model, ids), "offload")
    # one hidden state per layer moved, [2, 48, 48] fp32 each; evaluation moves nothing
    assert (offload.offloaded, offload.offloaded_bytes) == (2, 2 * 2 * SEQ * 48 * 4)
    with torch.no_grad():
        model(input_ids=ids)
    assert offload.offloaded == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_and_tiled_mlp_on_cuda():
    ref = build("llama").train().cuda()
    ids = tokens(2, SEQ, 1).cuda()
    want = _loss_and_grads(ref, ids)
    model = copy.deepcopy(ref)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    apply_tiled_mlp(model, chunk_tokens=CHUNK)
    assert apply_activation_offload(model) is True
    _assert_same(want, _loss_and_grads(model, ids), "cuda: tiled + offload")
    counted = copy.deepcopy(ref)
    counted.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    offload = offload_layer_inputs(counted)  # through pinned memory and the side stream
    _assert_same(want, _loss_and_grads(counted, ids), "cuda: offload")
    assert offload.offloaded == 2


def _check_prepared(mesh, modes, what):
    """Checkpointing + tiled MLP + offload hooks (+ DDP / FSDP2) against the plain prepared model."""
    shard = seqpar.shard_batch({"input_ids": tokens(2, SEQ, 1)}, mesh)

    def run(model, forward=None):
        logits = (forward or model)(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
        loss = seqpar.cross_entropy(logits, shard["shift_labels"], mesh)
        loss.backward()
        if forward is None:
            seqpar.reduce_gradients(model.parameters(), mesh)
        grads = {}
        for name, p in model.named_parameters():
            grads[name] = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
        return seqpar.sum_over(loss.detach(), mesh), grads

    ref = build("llama").train()
    want = run(seqpar.prepare_model(copy.deepcopy(ref), mesh))
    for mode in modes:
        model = seqpar.prepare_model(copy.deepcopy(ref), mesh)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        assert apply_tiled_mlp(model, chunk_tokens=5) == 2
        offload = offload_layer_inputs(model, copy_cpu_tensors=True)
        forward = seqpar.apply_data_parallel(model, mesh, mode) if mode else None
        _assert_same(want, run(model, forward), f"checkpointing + tiled MLP + offload, {what}, {mode or 'no wrapper'}")
        assert offload.offloaded == 2


def _under_prepare_model(rank, world_size):
    _check_prepared(seqpar.make_mesh(), [None, "ddp", "fsdp"] if world_size == 2 else [None], f"sp {world_size}")
    if world_size == 2:  # sp 1: each rank the whole sequence (dp 2 x sp 1, gradients summed over sp only)
        _check_prepared(seqpar.make_mesh(sp_size=1), [None], "sp 1")


@pytest.mark.parametrize("world_size", [2, 3])
def test_tiled_mlp_and_offload_under_prepare_model(world_size):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_ranks(world_size, _under_prepare_model)


def test_train_cli_tiled_mlp_gives_the_same_losses(tmp_path):
    from seqpar.train.config import TrainConfig
    from seqpar.train.model import build_model

    options = dict(seq_len=192, hidden_size=32, layers=2, heads=2, activation_checkpointing=True)

    def train_model(config):  # as seqpar train builds it: the features come with seqpar.parallelize
        return seqpar.parallelize(build_model(config, 64), None, options=config.parallelize_options())

    # the flag reaches the model (the same losses below would also come from a run that ignored it)
    built = train_model(TrainConfig(**options, tiled_mlp=True, tiled_mlp_chunk=40))
    assert [is_tiled(layer.mlp) for layer in built.model.layers] == [True, True]
    assert built.model.layers[0].mlp.forward.chunk_tokens == 40
    plain_built = train_model(TrainConfig(**options))
    assert not any(is_tiled(m) for m in plain_built.modules())
    common = [*TINY, "--steps", "2", "--eval-examples", "2", "--activation-checkpointing"]
    # 96 tokens per rank in chunks of 40; offload does nothing on the CPU and says so
    plain, tiled = seqpar_trains(
        [*common, "--run-dir", str(tmp_path / "plain")],
        [*common, "--tiled-mlp", "--tiled-mlp-chunk", "40", "--offload-activations", "--run-dir", str(tmp_path / "t")],
    )
    assert plain.returncode == 0, plain.stderr
    assert tiled.returncode == 0, tiled.stderr
    if not torch.cuda.is_available():
        assert "activation offload does nothing without CUDA" in tiled.stderr
    for key in ("loss", "grad_norm"):
        want, got = losses(tmp_path / "plain", key), losses(tmp_path / "t", key)
        assert sorted(got) == [1, 2] and got == pytest.approx(want, rel=1e-5), key
