"""The DiT zoo sweep: every transformer class of the installed diffusers, tiny, prepare_diffusers vs one process.

Each class is exact (prediction and every gradient within its float64 floor) or refused naming what seqpar cannot
serve; none runs wrong, crashes or hangs. Zoo tier (``-m zoo``); ``benchmarks/dit_zoo_cpu.json`` is its record.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.dit_zoo import RECORD, sweep, totals
from benchmarks.zoo import BUILD, CRASH, EXACT, HANG, REFUSED, WRONG
from tests._dist import session_pool
from tests.test_zoo import NOT_JUDGED

diffusers = pytest.importorskip("diffusers")

pytestmark = pytest.mark.zoo

AT_LEAST = 53
"""Exact classes today (the floor a change may not go below; raise it as classes are served)."""
SUBSET = (
    "WanTransformer3DModel",
    "ChronoEditTransformer3DModel",
    "CogVideoXTransformer3DModel",
    "FluxTransformer2DModel",
    "PixArtTransformer2DModel",
    "SD3Transformer2DModel",
    "ChromaTransformer2DModel",
)
"""Cross-attention kept local (Wan by entry, ChronoEdit from diffusers' _cp_plan, PixArt from its structure), joint
attention (CogVideoX, Flux by entry, SD3 and the double- and single-stream Chroma from their structure)."""


@pytest.fixture(scope="module")
def zoo() -> dict:
    """Every class at sp 2, and the negative control of ``SUBSET`` (on the session's ranks, as each sweep here)."""
    return sweep(2, controls=SUBSET, pool=session_pool(2))


def test_every_class_is_exact_or_refused_by_name(zoo):
    bad = {k: v for k, v in zoo.items() if v["status"] in (WRONG, CRASH, HANG, BUILD)}
    assert not bad, json.dumps(bad, indent=1)
    refused = {k: v["reason"] for k, v in zoo.items() if v["status"] == REFUSED}
    assert all(why.startswith("seqpar.prepare_diffusers: ") for why in refused.values()), refused
    assert totals(zoo)[EXACT] >= AT_LEAST, totals(zoo)


@pytest.mark.parametrize(("sp", "strategy"), [(2, "ulysses"), (3, "ring"), (4, "allgather")])
def test_a_subset_at_other_degrees_and_strategies(sp, strategy):
    """The tiny models have 2 heads: Ulysses runs at sp 2."""
    found = sweep(sp, list(SUBSET), strategy, pool=session_pool(sp))
    assert {k: v["status"] for k, v in found.items()} == dict.fromkeys(SUBSET, EXACT), json.dumps(found, indent=1)


def test_the_negative_control_comes_out_wrong(zoo):
    """Gradients left unreduced (each rank's before the sweep's reduction): every class that runs must come out
    WRONG, or the judgement would pass a missing exchange."""
    found = {k: zoo[k].get("control", NOT_JUDGED) for k in SUBSET}
    assert {k: v["status"] for k, v in found.items()} == dict.fromkeys(SUBSET, WRONG), json.dumps(found, indent=1)


def test_the_record_is_this_sweep(zoo):
    """The DiT support matrix the docs show (benchmarks/dit_zoo_cpu.json) is what this diffusers gives."""
    record = json.loads(RECORD.read_text())[-1]
    if record["diffusers"] != diffusers.__version__:
        pytest.skip(f"the record is of diffusers {record['diffusers']}; run python -m benchmarks.dit_zoo")
    changed = {
        k: (record["models"].get(k, {}).get("status"), v["status"])
        for k, v in zoo.items()
        if record["models"].get(k, {}).get("status") != v["status"]
    }
    assert not changed, f"(record, now): {changed}; rerun python -m benchmarks.dit_zoo and python scripts/records.py"
