"""The zoo sweep: every causal-LM and image-text-to-text family of the installed transformers, tiny, vs one process.

Each family is exact (loss, logits, every gradient within its float64 floor) or refused naming what seqpar cannot
serve; none runs wrong, crashes or hangs. Its own tier (``-m zoo``); ``benchmarks/zoo_cpu.json`` is its record.
"""

from __future__ import annotations

import json

import pytest
import transformers

from benchmarks import ROOT
from benchmarks.zoo import BUILD, CRASH, EXACT, HANG, REFUSED, SET_ASIDE, WRONG, sweep, totals
from seqpar.models.zoo import CAUSAL_LM, IMAGE_TEXT_TO_TEXT

pytestmark = pytest.mark.zoo

RECORD = ROOT / "benchmarks" / "zoo_cpu.json"
AT_LEAST = {CAUSAL_LM: 117, IMAGE_TEXT_TO_TEXT: 58}
"""Exact families today (the floor a change may not go below; raise it as families are added)."""
SUBSET = ("llama", "gemma3_text", "qwen3_next", "olmo3", "gpt2", "opt", "falcon", "glm4_moe", "phi", "llava")
"""Families of every kind seqpar reads or has an entry for: dense, sliding windows, hybrid, learned positions,
parallel blocks, experts, a multimodal model's text path."""


def _record() -> dict:
    return json.loads(RECORD.read_text())[-1]


@pytest.fixture(scope="module")
def zoo() -> dict:
    return sweep(2)


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
    for outcomes in (sweep(3, list(SUBSET)), sweep(2, list(SUBSET), packed=True)):
        assert {k: v["status"] for k, v in outcomes.items()} == dict.fromkeys(SUBSET, EXACT), outcomes


def test_the_negative_control_comes_out_wrong():
    """Gradients left unreduced: the judgement catches it in every family that runs, naming a gradient."""
    outcomes = sweep(2, list(SUBSET[:4]), control=True)
    assert {k: v["status"] for k, v in outcomes.items()} == dict.fromkeys(SUBSET[:4], WRONG), outcomes
    assert all(v["worst"].startswith("grad ") for v in outcomes.values())


def test_statuses_are_the_documented_ones():
    assert {v["status"] for v in _record()["models"].values()} <= {EXACT, REFUSED, BUILD, SET_ASIDE}
