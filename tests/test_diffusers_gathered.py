"""Attention calls ``seqpar.prepare_diffusers`` serves by gathering every rank's keys (Note [gathered keys]), on gloo
ranks against one process: masks over token pairs, a processor's padding product, keys of a joint sequence.

Each case judges the prediction and every parameter's gradient as the DiT zoo does (``RTOL`` of the float64 scale,
or ``FLOOR_FACTOR`` times the fp32 run's distance from float64), and each exchange has a negative control: the
same run with one part of the exchange switched off must come out WRONG.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks.zoo import EXACT, WRONG
from tests._dist import run_ranks

diffusers = pytest.importorskip("diffusers")

_PADDED = 5  # text tokens of HunyuanVideo 1.5's prompt that are padding (the product mask then hides some keys)


def _padded_hunyuan_video15(spec):
    """HunyuanVideo 1.5's zoo batch with the last tokens of both prompts padding."""

    def inputs(gen: torch.Generator) -> dict:
        batch = spec.inputs(gen)
        for key in ("encoder_attention_mask", "encoder_attention_mask_2"):
            batch[key] = batch[key].clone()
            batch[key][:, -_PADDED:] = 0
        return batch

    return dataclasses.replace(spec, inputs=inputs)


def _segmented_ideogram4(spec):
    """Ideogram 4's zoo batch packed as two samples: the text and the first 16 image tokens, then the other 32."""

    def inputs(gen: torch.Generator) -> dict:
        batch = spec.inputs(gen)
        batch["segment_ids"] = batch["segment_ids"].clone()
        batch["segment_ids"][:, 40:] = 2
        return batch

    return dataclasses.replace(spec, inputs=inputs)


_BATCHES = {
    "HunyuanVideo15Transformer3DModel": _padded_hunyuan_video15,
    "Ideogram4Transformer2DModel": _segmented_ideogram4,
}


def _ranks_judge(rank: int, world_size: int, name: str, strategy: str, control: str, want: str) -> None:
    """Judge ``name`` at ``world_size`` under ``strategy`` with the exchange's part ``control`` switched off ("" for
    none); assert its status is ``want``."""
    from benchmarks.dit_zoo import _judge_class
    from seqpar.integrations import _diffusion_gathered as gathered
    from tests import _dit_zoo

    spec, sdpa, gather, product = _dit_zoo.ZOO[name], gathered._sdpa, gathered.gather_sequence, gathered._product_mask
    if name in _BATCHES:
        _dit_zoo.ZOO[name] = _BATCHES[name](spec)
    if control == "rank order":  # the keys gathered in rank order, not the layout's global order of the columns
        gathered._sdpa = lambda q, k, v, mask, named, sp, layout: sdpa(q, k, v, mask, named, sp, gathered._RANK_ORDER)
    elif control == "no key gradients back":  # each rank keeps the other ranks' keys' gradients to itself

        def gather_forward(x, sp, dim, layout):
            return gather(x.detach(), sp, dim=dim, layout=layout) if x.requires_grad else gather(x, sp, dim, layout)

        gathered.gather_sequence = gather_forward
    elif control == "every key seen":  # the processor's padding product read as all True
        gathered._product_mask = lambda mask, sp, where: torch.ones(
            (*mask.shape[:-1], mask.shape[-1] * sp.sp_size), dtype=torch.bool
        )
    try:
        outcome = _judge_class(world_size, name, strategy, False)
    finally:
        _dit_zoo.ZOO[name], gathered._sdpa, gathered.gather_sequence, gathered._product_mask = (
            spec,
            sdpa,
            gather,
            product,
        )
    assert outcome["status"] == want, (control, outcome)


_MODELS = {
    "Ideogram4Transformer2DModel": "two packed samples' segments over token pairs (a boolean mask)",
    "PRXTransformer2DModel": "image queries against [whole text; image] keys",
    "NucleusMoEImageTransformer2DModel": "image queries against [image; whole text] keys, text padding",
    "MochiTransformer3DModel": "joint attention in a module of its own class (a row)",
    "HunyuanVideo15Transformer3DModel": "a padding product over each call's own pairs, some text padding",
}


@pytest.mark.parametrize(
    ("world_size", "strategy"), [(2, "ring"), (3, "ring"), (2, "ulysses")], ids=["P2-ring", "P3-ring", "P2-ulysses"]
)
@pytest.mark.parametrize("name", list(_MODELS))
def test_gathered_attention_equals_one_process(name, world_size, strategy):
    run_ranks(world_size, _ranks_judge, name, strategy, "", EXACT)


_CONTROLS = [
    ("Ideogram4Transformer2DModel", "rank order"),
    ("Ideogram4Transformer2DModel", "no key gradients back"),
    ("PRXTransformer2DModel", "no key gradients back"),
    ("NucleusMoEImageTransformer2DModel", "no key gradients back"),
    ("HunyuanVideo15Transformer3DModel", "every key seen"),
]


@pytest.mark.parametrize(("name", "control"), _CONTROLS, ids=[f"{n}-{c}" for n, c in _CONTROLS])
def test_negative_control_each_part_switched_off_comes_out_wrong(name, control):
    run_ranks(2, _ranks_judge, name, "ring", control, WRONG)
