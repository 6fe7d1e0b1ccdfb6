"""Diffusers transformers whose forward goes on past the gather, joins or regroups its tokens, via prepare_diffusers.

Each case is judged by ``benchmarks.dit_zoo``'s verdict (the prediction and every gradient against one process,
within ``FLOOR_FACTOR`` times the fp32 run's distance from float64, or its module's floor) on gloo ranks; each
mechanism's negative control, the mechanism switched off, comes out WRONG.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest
import torch

from benchmarks.dit_zoo import judge_class
from benchmarks.zoo import BOTH, EXACT, WRONG
from tests._dist import run_ranks

diffusers = pytest.importorskip("diffusers")

TAILS = (
    "AnyFlowTransformer3DModel",
    "HeliosTransformer3DModel",
    "Krea2Transformer2DModel",
    "HunyuanVideoFramepackTransformer3DModel",
)
"""Gathered before the end of the forward (Note [gathered tail]): per-token output modulation (AnyFlow), gathers
inside each block from diffusers' _cp_plan (Helios), a drop of the joined text by its whole length after the blocks
(Krea2 derived, HunyuanVideo Framepack by entry)."""


def _judged_worker(rank, world_size, name, strategy, want, patch, control=False):
    """``name`` judged at ``world_size`` ranks: ``want`` (EXACT or WRONG); with ``control`` its gradients before
    the sum over the group judged too, from the same run, and WRONG."""
    with patch() if patch is not None else contextlib.nullcontext():
        outcome = judge_class(world_size, name, strategy, BOTH if control else False)
    assert outcome["status"] == want, json.dumps(outcome, indent=1)
    if control:
        assert outcome["control"]["status"] == WRONG, json.dumps(outcome["control"], indent=1)


JOINED = (
    "ZImageTransformer2DModel",
    "ErnieImageTransformer2DModel",
    "BriaFibo2Transformer2DModel",
    "MiniMaxMusic3Transformer1DModel",
    "LongCatAudioDiTTransformer",
    "SanaWMLTX2RefinerTransformer3DModel",
)
"""One sequence joined in the forward ([image; caption], [gist; image; context], [timestep token; audio]) cut as
one and gathered before the forward drops a part by its whole length (Z-Image, ERNIE-Image by entry: no parameter
after the gather; Bria FIBO 2 by entry, MiniMax Music 3 derived: a tail), and per-token modulation or a long skip
after the blocks (LongCat audio, Sana-WM's LTX2 refiner, by entry)."""
GATHERED_KEYS_AND_TAIL = (
    "OmniGenTransformer2DModel",
    "QwenImage21Transformer2DModel",
    "AceStepTransformer1DModel",
)
"""Masks over token pairs served by gathered keys (Note [gathered keys]), then a tail over the whole tokens: OmniGen
keeps the image's tokens by their place from the sequence's end, Qwen-Image 2.1's output norm reads a mask over the
whole joint sequence (both in ``DIFFUSION_TAILS``), AceStep's output modulation follows its blocks."""
ONE_HEAD = ("ErnieImageTransformer2DModel",)
"""Tiny builds with one attention head: no Ulysses at sp 2 (refused by seqpar.attention naming the heads)."""


def _cases() -> list:
    runs = [(3, "ring"), (2, "ulysses")]  # sp 2 ring: the sweep of tests/test_dit_zoo.py
    names = [*TAILS, *JOINED, *GATHERED_KEYS_AND_TAIL, "LatteTransformer3DModel"]
    return [
        pytest.param(name, world_size, strategy, id=f"{name}-P{world_size}-{strategy}")
        for name in names
        for world_size, strategy in runs
        if not (strategy == "ulysses" and name in ONE_HEAD)
    ]


@pytest.mark.parametrize(("name", "world_size", "strategy"), _cases())
def test_exact_at_every_degree(name, world_size, strategy):
    """Exact at sp 3 (ring) and under Ulysses; at sp 3 each rank's gradients before the sum over the group, the
    negative control judged from the same run, come out WRONG: the judgement sees a missing exchange."""
    run_ranks(world_size, _judged_worker, name, strategy, EXACT, None, world_size == 3)


@contextlib.contextmanager
def _tail_off():
    """The door without the tail's scaling: the output's gradient and the gathers' as they were."""
    from seqpar.integrations import diffusion

    kept = diffusion.tail_hooks
    diffusion.tail_hooks = lambda model, region, sp_size, handles: handles
    try:
        yield
    finally:
        diffusion.tail_hooks = kept


class _Unscaled:
    """Gathers that never sum: the output's gradient scaled by 1 / P, the gathers' taken as they come."""

    @property
    def summed(self) -> bool:
        return False

    @summed.setter
    def summed(self, value: bool) -> None:
        pass


@contextlib.contextmanager
def _gathers_unscaled():
    from seqpar.integrations import _diffusion_attention

    kept = _diffusion_attention.GatherShare
    _diffusion_attention.GatherShare = _Unscaled
    try:
        yield
    finally:
        _diffusion_attention.GatherShare = kept


@pytest.mark.parametrize("patch", [_tail_off, _gathers_unscaled], ids=["tail-unscaled", "gathers-unscaled"])
@pytest.mark.parametrize("name", TAILS)
def test_negative_control_the_tail_scaled_alone_or_not_at_all_is_wrong(name, patch):
    """Without the output's 1 / P every replicated part counts once per rank; without the gathers' sum over the
    group the sharded blocks get 1 / P of their gradient."""
    run_ranks(2, _judged_worker, name, "ring", WRONG, patch)


def _latte_batch(gen: torch.Generator) -> dict:
    """Three samples with their own timesteps: the temporal blocks' per-position timesteps differ between samples.
    (With two, zigzag's chunks of the B x S rows happen to hold each sample's own rows: chunk 0 of sample 0's,
    chunk 2P - 1 of sample 1's.)"""
    return dict(
        hidden_states=torch.randn(3, 4, 2, 12, 16, generator=gen),
        encoder_hidden_states=torch.randn(3, 24, 8, generator=gen),
        timestep=torch.tensor([100.0, 400.0, 700.0]),
        enable_temporal_attentions=True,
    )


@contextlib.contextmanager
def _latte_batch_of_two(folded: bool):
    """Latte swept on a batch of three; ``folded=False`` cuts its temporal timesteps as one sequence of B x S rows."""
    from seqpar.models import DIFFUSION_PLANS, Split, register_diffusion_plan
    from tests import _dit_zoo

    name = "LatteTransformer3DModel"
    spec, plan = _dit_zoo.ZOO[name], DIFFUSION_PLANS[name]
    _dit_zoo.ZOO[name] = dataclasses.replace(spec, inputs=_latte_batch)
    if not folded:
        shards = dict(plan.shards) | {"temporal_transformer_blocks.*": {"timestep": Split(0, 2)}}
        register_diffusion_plan(dataclasses.replace(plan, shards=shards))
    try:
        yield
    finally:
        _dit_zoo.ZOO[name] = spec
        register_diffusion_plan(plan)


def _latte_exact():
    return _latte_batch_of_two(True)


def _latte_unfolded():
    return _latte_batch_of_two(False)


def test_latte_cuts_the_temporal_timesteps_within_each_sample():
    """A batch of three: exact with the timesteps' fold cut per sample (``FoldedSplit``); cut as one sequence of
    B x S rows (the negative control), rank 0's rows of sample 1 get sample 0's and sample 2's timesteps."""
    run_ranks(2, _judged_worker, "LatteTransformer3DModel", "ring", EXACT, _latte_exact)
    run_ranks(2, _judged_worker, "LatteTransformer3DModel", "ring", WRONG, _latte_unfolded)


def _batched(inputs: dict, gen: torch.Generator) -> dict:
    """``inputs`` with a second sample of its own draws along every batched float tensor and its own timestep."""
    out = {}
    for key, value in inputs.items():
        batched = isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() >= 2
        if batched and not key.startswith("indices"):
            value = torch.cat([value, torch.randn(value.shape, generator=gen)])
        elif key in ("timestep", "guidance"):
            value = torch.cat([value, value + 100.0])
        out[key] = value
    return out


def _framepack_padded(gen: torch.Generator) -> dict:
    """Two samples, the second's text padded by 18 of 24 tokens: a key mask over [latents; image and text] in the
    blocks, whose padding reaches past the condition's last chunk (so that a mask cut as one sequence, which puts
    the last chunk of the whole sequence at the same place, differs)."""
    from tests._dit_zoo import _framepack_inputs

    inputs = _batched(_framepack_inputs(gen), gen)
    inputs["encoder_attention_mask"] = torch.ones(2, 24, dtype=inputs["encoder_attention_mask"].dtype)
    inputs["encoder_attention_mask"][1, -18:] = 0
    return inputs


def _ernie_padded(gen: torch.Generator) -> dict:
    """Two samples, the second's text 18 of 24 tokens: a key mask over [image; text]."""
    return dict(
        hidden_states=torch.randn(2, 16, 6, 8, generator=gen),
        timestep=torch.rand(2, generator=gen),
        text_bth=torch.randn(2, 24, 16, generator=gen),
        text_lens=torch.tensor([24, 18]),
    )


def _z_image_padded(gen: torch.Generator) -> dict:
    """Two samples of other image and caption lengths: padded to the longer joint sequence under a key mask."""
    return dict(
        x=[torch.randn(16, 1, 16, 24, generator=gen), torch.randn(16, 1, 8, 16, generator=gen)],
        t=torch.rand(2, generator=gen),
        cap_feats=[torch.randn(40, 16, generator=gen), torch.randn(96, 16, generator=gen)],
    )


PADDED = {
    "HunyuanVideoFramepackTransformer3DModel": _framepack_padded,
    "ErnieImageTransformer2DModel": _ernie_padded,
    "ZImageTransformer2DModel": _z_image_padded,
}


@contextlib.contextmanager
def _padded_batch(name: str):
    from tests import _dit_zoo

    spec = _dit_zoo.ZOO[name]
    _dit_zoo.ZOO[name] = dataclasses.replace(spec, inputs=PADDED[name])
    try:
        yield
    finally:
        _dit_zoo.ZOO[name] = spec


def _padded_worker(rank, world_size, name):
    with _padded_batch(name):
        outcome = judge_class(world_size, name, "ring", False)
    assert outcome["status"] == EXACT, json.dumps(outcome, indent=1)


@pytest.mark.parametrize("name", list(PADDED))
def test_a_padded_batch_of_two_is_exact(name):
    """The joined sequences' key masks (text padding, samples of other lengths) cut with the tokens."""
    run_ranks(2, _padded_worker, name)


def _misaligned_mask_worker(rank, world_size):
    from seqpar.models import DIFFUSION_PLANS, Split, register_diffusion_plan

    name = "HunyuanVideoFramepackTransformer3DModel"
    plan = DIFFUSION_PLANS[name]
    blocks = dict(plan.shards["*transformer_blocks.*"]) | {"attention_mask": Split(3, 4)}
    register_diffusion_plan(dataclasses.replace(plan, shards=dict(plan.shards) | {"*transformer_blocks.*": blocks}))
    try:
        with _padded_batch(name):
            outcome = judge_class(world_size, name, "ring", False)
    finally:
        register_diffusion_plan(plan)
    assert outcome["status"] == WRONG, json.dumps(outcome, indent=1)


def test_negative_control_framepack_mask_cut_as_one_sequence_is_wrong():
    """The key mask over [latents; condition] cut as one sequence, not part by part: it hides other keys."""
    run_ranks(2, _misaligned_mask_worker)


@contextlib.contextmanager
def _checkpointed():
    """The zoo's builds with diffusers' activation checkpointing on (the blocks, and the gathers on them, recomputed
    in the backward)."""
    from tests import _dit_zoo

    kept = _dit_zoo.build

    def build(name: str):
        model, inputs = kept(name)
        model.enable_gradient_checkpointing()
        return model, inputs

    _dit_zoo.build = build
    try:
        yield
    finally:
        _dit_zoo.build = kept


@pytest.mark.parametrize(
    "name",
    ["AnyFlowTransformer3DModel", "HeliosTransformer3DModel", "Krea2Transformer2DModel", "LatteTransformer3DModel"],
)
def test_exact_with_activation_checkpointing(name):
    run_ranks(2, _judged_worker, name, "ring", EXACT, _checkpointed)


def test_the_dit_verdict_judges_a_zero_gradient_by_its_modules_floor():
    """A key bias's gradient is zero in exact arithmetic (softmax ignores a shift every key shares): its own fp32
    noise is no measure of another run's, so it is judged against its module's floor (the weight's distance from
    float64), as the language zoo judges; judged by its own floor alone, the same gradient would be WRONG."""
    from benchmarks.dit_zoo import _verdict
    from benchmarks.zoo import FLOOR_FACTOR, judge

    parallel = torch.nn.Linear(2, 2)
    weight, exact_weight = torch.ones(2, 2), torch.ones(2, 2, dtype=torch.float64)
    weight[0, 0] += 1e-7  # the fp32 run's distance from float64: the module's floor
    bias, exact_bias = torch.full((2,), 1e-9), torch.zeros(2, dtype=torch.float64)
    parallel.weight.grad, parallel.bias.grad = weight.clone(), torch.full((2,), 5e-8)
    want = {"weight": weight, "bias": bias}
    exact = {"weight": exact_weight, "bias": exact_bias}
    pred = torch.ones(3)
    outcome = _verdict(parallel, pred, pred, pred.double(), want, exact)
    assert outcome["status"] == EXACT, outcome
    ratio, _ = judge("grad bias", parallel.bias.grad, bias, exact_bias)  # its own floor: 4.9e-8 against 4 x 1e-9
    assert ratio == pytest.approx((5e-8 - 1e-9) / (FLOOR_FACTOR * 1e-9), rel=1e-3)
    assert ratio > 1
