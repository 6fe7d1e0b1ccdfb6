"""Hub kernels under seqpar's mixer adapters (Note [hub kernels]): a model kernelized by ``kernels``' own
``kernelize`` runs its hub kernels in seqpar's calls too, and ``seqpar doctor`` names them.

The hub cannot be reached here, so the repository is local: a layer that counts its calls and runs transformers'
PyTorch function, installed by ``kernelize`` as a hub kernel is, for Qwen3-Next's convolution and gated delta rule.
"""

from __future__ import annotations

import collections
import inspect
import logging
import sys

import torch
import transformers
from kernels import Mode, kernelize, use_kernel_mapping

import seqpar
from seqpar.models import anatomy
from seqpar.sequence_parallel import mixers
from seqpar.sequence_parallel.mixers import hub
from tests._dist import run_ranks, shard_index
from tests._models import SEQ, VOCAB, tiny_config

CALLS: collections.Counter[str] = collections.Counter()
"""Calls of each counting hub kernel in this process, by its layer name."""
HUB = {"causal_conv1d_fn": "causal_conv1d_fn", "chunk_gated_delta_rule": "torch_chunk_gated_delta_rule"}
"""The hub's layer names of the Qwen3-Next functions kernelized here -> their names in the modeling module."""


class _CountingRepository:
    """A local repository of one hub kernel: it counts its calls and runs transformers' PyTorch function."""

    def __init__(self, function: object, layer: str) -> None:
        self.function, self.layer = function, layer

    def load(self) -> type[torch.nn.Module]:
        forward_of = type(self.function).forward
        # the PyTorch function inside transformers' dispatcher (the fused packages are not installed here)
        dispatcher = dict(zip(forward_of.__code__.co_freevars, forward_of.__closure__))["func"].cell_contents
        torch_function, layer = dispatcher.__wrapped__, self.layer

        def forward(self, *args, **kwargs):
            CALLS[layer] += 1
            return torch_function(*args, **kwargs)

        forward.__signature__ = inspect.signature(forward_of)  # kernelize checks the hub layer's signature
        return type("CountingKernel", (torch.nn.Module,), {"forward": forward})

    def __str__(self) -> str:
        return f"counting/{self.layer}"


def _kernelized(seed: int = 0) -> torch.nn.Module:
    """A tiny Qwen3-Next, its convolutions and gated delta rules kernelized by ``kernels`` on the CPU."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3_next"), attn_implementation="eager")
    module = sys.modules[type(anatomy(model).mixers[0]).__module__]
    mapping = {layer: {"cpu": _CountingRepository(getattr(module, name), layer)} for layer, name in HUB.items()}
    logging.getLogger("kernels").setLevel(logging.ERROR)  # every other function: "no kernel mapping", once per layer
    with use_kernel_mapping(mapping):
        return kernelize(model, mode=Mode.TRAINING, device="cpu")


def _seqpar_run(model, mesh, ids):
    shard = seqpar.shard_batch({"input_ids": ids}, mesh, layout="zigzag")
    CALLS.clear()
    logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"], seqpar_layout=shard.layout).logits
    loss = seqpar.cross_entropy(logits, shard["shift_labels"], mesh)
    loss.backward()
    seqpar.reduce_gradients(model.parameters(), mesh)
    return logits.detach(), seqpar.sum_over(loss.detach(), mesh), dict(CALLS)


def _gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in model.named_parameters()}


def _assert_gradients(model: torch.nn.Module, ref: torch.nn.Module, ids: torch.Tensor) -> None:
    """Every parameter's gradient as one process's, judged as the zoo judges a family (``benchmarks.zoo.judge``:
    within 1e-5 of its float64 scale, or 4x one fp32 process's own distance from the float64 model, its module's
    where it is rounding noise in both). Measured: the worst at 0.25 of its bound (a ``dt_bias``); with the gradients
    left unreduced, 1.1e4 past it."""
    from benchmarks.zoo import WideFloats, judge, module_floors

    exact = _kernelized().double()  # the same weights, in float64 throughout
    exact.set_experts_implementation("eager")  # a grouped matmul takes no float64; the loop over experts does
    with WideFloats():
        exact(input_ids=ids, labels=ids).loss.backward()
    want, wide = _gradients(ref), _gradients(exact)
    floors = module_floors(want, wide)
    for name, got in _gradients(model).items():
        judged = judge(f"grad {name}", got, want[name], wide[name], floors.get(name.rpartition(".")[0], (0.0, 0.0)))
        assert judged is None or judged[0] <= 1.0, judged


def _hub_kernels_at_two(rank, world_size):
    """seqpar's calls run the hub kernels and equal one process on them (logits, loss, every gradient); the adapter
    as it was before routing (seqpar's forward alone as the class's) runs none of them, the same logits on
    PyTorch."""
    mesh = seqpar.make_mesh()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    ref, model = _kernelized(), _kernelized()
    CALLS.clear()
    out = ref(input_ids=ids, labels=ids)
    out.loss.backward()
    assert set(CALLS) == set(HUB), CALLS  # one process: the hub kernels run, so the counting repository works
    model = seqpar.prepare_model(model, mesh)
    logits, loss, calls = _seqpar_run(model, mesh, ids)
    assert set(calls) == set(HUB) and min(calls.values()) >= 3, calls  # three mixer layers each
    want = out.logits.detach()[:, shard_index("zigzag", world_size, rank, SEQ)]
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, out.loss.detach(), rtol=0, atol=1e-6)
    _assert_gradients(model, ref, ids)
    # negative control: each mixer's class as the adapter was, seqpar's forward not wrapped by kernels' routing
    for mixer in anatomy(model).mixers:
        cls = type(mixer).__mro__[1]
        mixer.__class__ = type(type(mixer).__name__, (cls,), {"forward": mixers.ADAPTERS[cls.__name__].forward})
    model.zero_grad(set_to_none=True)
    logits, _, calls = _seqpar_run(model, mesh, ids)
    assert calls == {}, calls
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


def test_kernelized_mixers_run_their_hub_kernels_under_seqpar():
    run_ranks(2, _hub_kernels_at_two)


def test_doctor_lines_name_the_hub_kernel():
    """The mixer kernel lines say "hub" where ``kernelize`` installed one, with its repository and layers; a model
    not kernelized reads as before (PyTorch on this CPU)."""
    lines = [k.line() for k in mixers.implementations(anatomy(_kernelized()).mixers, "cpu")]
    assert lines == [
        "Qwen3NextGatedDeltaNet: convolution -> hub (kernelized from counting/causal_conv1d_fn in 3 of 3 layers; "
        "packed rows: seqpar's taps)",
        "Qwen3NextGatedDeltaNet: recurrence -> hub (kernelized from counting/chunk_gated_delta_rule in 3 of 3 layers)",
    ], lines
    plain = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3_next"))
    kinds = [k.implementation for k in mixers.implementations(anatomy(plain).mixers, "cpu")]
    assert kinds == ["torch", "torch"], kinds


def test_routing_seqpar_cannot_read_is_refused(monkeypatch):
    """A class whose forward routes hub kernels in a way seqpar cannot read (another ``kernels``: here, a wrapper
    keeping its functions under another name) is what its mixer lacks, which ``prepare_model`` refuses, rather than
    run it without its kernels."""
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3_next"))
    assert mixers.mismatched_mixers(anatomy(model).mixers) == []
    cls = type(anatomy(model).mixers[0])
    own, functions = cls.forward, ("causal_conv1d_fn",)

    def routed(self, *args, **kwargs):
        return own(self, *args, **kwargs) if functions else None

    monkeypatch.setattr(cls, "forward", routed)
    monkeypatch.setattr(hub, "_wrapper_code", lambda: routed.__code__)
    assert mixers.mismatched_mixers(anatomy(model).mixers) == [
        "Qwen3NextGatedDeltaNet lacks the kernel functions its forward routes to hub kernels (kernels' "
        "use_kernelized_func)"
    ]
