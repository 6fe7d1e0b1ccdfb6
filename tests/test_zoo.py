"""The zoo sweep: every causal-LM and image-text-to-text family of the installed transformers, tiny, vs one process.

Each family is exact (loss, logits, every gradient within its float64 floor) or refused naming what seqpar cannot
serve; none runs wrong, crashes or hangs. Its own tier (``-m zoo``); ``benchmarks/zoo_cpu.json`` is its record.
"""

from __future__ import annotations

import json

import pytest
import transformers

from benchmarks import ROOT, zoo_images
from benchmarks.zoo import BUILD, CRASH, EXACT, HANG, REFUSED, SET_ASIDE, WRONG, sweep, totals
from seqpar.models.zoo import CAUSAL_LM, IMAGE_TEXT_TO_TEXT
from tests._background import Chain
from tests._dist import session_pool
from tests.zoo_sweeps import CONTROLS, IMAGES_CONTROLS, ZOO_STAGE

pytestmark = pytest.mark.zoo

RECORD = ROOT / "benchmarks" / "zoo_cpu.json"
IMAGES_RECORD = ROOT / "benchmarks" / "zoo_images_cpu.json"
IMAGES_AT_LEAST = 53
"""Image-text-to-text families exact with their images today."""
IMAGES_SUBSET = (*IMAGES_CONTROLS, "mistral3", "lfm2_vl", "video_llava")
"""An image row of each pixel layout: plain images, Qwen's patch rows and grids (mRoPE), a batch of images per
row with a pixel mask, an image and its size, NaFlex patches, a model with an image and a video tower."""
AT_LEAST = {CAUSAL_LM: 154, IMAGE_TEXT_TO_TEXT: 77}
"""Exact families today (the floor a change may not go below; raise it as families are added)."""
SUBSET = (*CONTROLS, "gpt2", "opt", "falcon", "glm4_moe", "phi", "llava")
"""Families of every kind seqpar reads or has an entry for: dense, sliding windows, hybrid, learned positions,
parallel blocks, experts, a multimodal model's text path."""
NOT_JUDGED = {"status": "no negative control judged"}
"""What a family's outcome stands for when its sweep judged no control (the control test then fails)."""


def _swept(launches: Chain, name: str) -> dict:
    """Sweep ``name`` of the session's background stage ``zoo_sweeps`` (tests/zoo_sweeps.py), once it has ended."""
    out = launches.paths[ZOO_STAGE]
    try:
        launches.wait(ZOO_STAGE)
    except AssertionError as failure:  # the sweeps write their output to a file of their own
        log = out / "log.txt"
        raise AssertionError(f"{failure}\n{log.read_text()[-6000:] if log.exists() else ''}") from None
    return json.loads((out / f"{name}.json").read_text())


def _record() -> dict:
    return json.loads(RECORD.read_text())[-1]


@pytest.fixture(scope="module")
def zoo(launches: Chain) -> dict:
    """Every family at sp 2, and the negative control of ``CONTROLS``: the background stage's sweep."""
    return _swept(launches, "zoo")


def test_every_family_is_exact_or_refused_by_name(zoo):
    bad = {k: v for k, v in zoo.items() if v["status"] in (WRONG, CRASH, HANG)}
    assert not bad, json.dumps(bad, indent=1)
    refused = {k: v["reason"] for k, v in zoo.items() if v["status"] == REFUSED}
    unnamed = {k: why for k, why in refused.items() if "knows no model family" in why}
    assert not unnamed, unnamed
    counts = totals(zoo)
    for mapping, least in AT_LEAST.items():
        assert counts[mapping][EXACT] >= least, (mapping, counts[mapping])


def test_the_record_is_this_sweep(zoo):
    """The support matrix the docs show (benchmarks/zoo_cpu.json) is what this transformers gives."""
    record = _record()
    if record["transformers"] != transformers.__version__:
        pytest.skip(f"the record is of transformers {record['transformers']}; run python -m benchmarks.zoo")
    changed = {
        k: (record["models"].get(k, {}).get("status"), v["status"])
        for k, v in zoo.items()
        if record["models"].get(k, {}).get("status") != v["status"]
    }
    assert not changed, f"(record, now): {changed}; rerun python -m benchmarks.zoo and python scripts/records.py"


def test_a_subset_at_three_ranks_and_packed_documents():
    at_three = sweep(3, list(SUBSET), pool=session_pool(3))
    packed = sweep(2, list(SUBSET), packed=True, pool=session_pool(2))
    for outcomes in (at_three, packed):
        assert {k: v["status"] for k, v in outcomes.items()} == dict.fromkeys(SUBSET, EXACT), outcomes


def test_the_negative_control_comes_out_wrong(zoo):
    """Gradients left unreduced (each rank's before the sweep's reduction): the judgement catches it in every family
    that runs, naming a gradient."""
    outcomes = {k: zoo[k].get("control", NOT_JUDGED) for k in CONTROLS}
    assert {k: v["status"] for k, v in outcomes.items()} == dict.fromkeys(CONTROLS, WRONG), outcomes
    assert all(v["worst"].startswith("grad ") for v in outcomes.values())


def test_statuses_are_the_documented_ones():
    assert {v["status"] for v in _record()["models"].values()} <= {EXACT, REFUSED, BUILD, SET_ASIDE}


@pytest.fixture(scope="module")
def with_images(launches: Chain) -> dict:
    """Every image family at sp 2, and the negative control of ``IMAGES_CONTROLS``: the background stage's sweep."""
    return _swept(launches, "images")


def test_families_with_images_are_exact_or_refused_by_name(with_images):
    """Every image-text-to-text family with an image row on whole rows: none wrong, crashed or hung."""
    bad = {k: v for k, v in with_images.items() if v["status"] in (WRONG, CRASH, HANG)}
    assert not bad, json.dumps(bad, indent=1)
    assert zoo_images.totals(with_images)[EXACT] >= IMAGES_AT_LEAST, zoo_images.totals(with_images)
    refused = {k: v["reason"] for k, v in with_images.items() if v["status"] == REFUSED}
    assert "masks its image tokens in its own code" in refused["paligemma"]  # a prefix block: text only


def test_the_images_record_is_this_sweep(with_images):
    record = json.loads(IMAGES_RECORD.read_text())[-1]
    if record["transformers"] != transformers.__version__:
        pytest.skip(f"the record is of transformers {record['transformers']}; run python -m benchmarks.zoo_images")
    changed = {
        k: (record["models"].get(k, {}).get("status"), v["status"])
        for k, v in with_images.items()
        if record["models"].get(k, {}).get("status") != v["status"]
    }
    assert not changed, f"(record, now): {changed}; rerun python -m benchmarks.zoo_images and scripts/records.py"


def test_images_at_three_ranks_and_the_negative_control(with_images):
    """A subset at sp 3 stays exact; with gradients left unreduced (at sp 2) every one of the first three comes out
    wrong."""
    outcomes = zoo_images.sweep(3, list(IMAGES_SUBSET), pool=session_pool(3))
    assert {k: v["status"] for k, v in outcomes.items()} == dict.fromkeys(IMAGES_SUBSET, EXACT), outcomes
    control = {k: with_images[k].get("control", NOT_JUDGED) for k in IMAGES_CONTROLS}
    assert {k: v["status"] for k, v in control.items()} == dict.fromkeys(IMAGES_CONTROLS, WRONG), control


def test_a_one_element_gradient_is_judged_at_its_modules_scale():
    """A scalar's gradient (HY-V4-VL's hyper-connection head scale) sums every token's share and may cancel far below
    them: judged at its module's largest gradient, rounding passes; an error of its own size still fails, and a
    tensor of more entries keeps its own scale."""
    import torch

    from benchmarks.zoo import judge

    exact, fp32 = torch.tensor([1.07e-4], dtype=torch.float64), torch.tensor([1.07e-4 + 2e-9])
    module = (2e-9, 2.85e-4)  # the module's floor and scale (module_floors)
    assert judge("s", fp32 + 1.3e-8, fp32, exact)[0] > 1.0  # its own scale: 1e-4 x 1.07e-4, past it
    assert judge("s", fp32 + 1.3e-8, fp32, exact, module)[0] < 1.0
    assert judge("s", fp32 * 0.9, fp32, exact, module)[0] > 1.0  # 10% off: WRONG at either scale
    vector = (torch.cat([exact, exact]), torch.cat([fp32, fp32]))
    assert judge("v", vector[1] + 1.3e-8, vector[1], vector[0], module)[0] > 1.0
