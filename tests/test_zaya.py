"""ZAYA under sequence parallelism: its attention's CCA projection convolves q/k and shifts v across ranks.

The zoo's tiny ZAYA is exact at sp 2, and at sp 3 with two packed documents in a row (Note [CCA halo]); with the
halo's contents zeroed, or the documents' starts ignored, it is not (the exchange and the cut are what make it so).
A second tiny ZAYA (biased projections, a sliding-window layer, a halo wider than a zigzag chunk) is exact too.
Judged as ``python -m benchmarks.zoo`` judges it, on the session's pools of ranks (a sweep would spawn its own).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from benchmarks import zoo
from seqpar.models.zoo import CAUSAL_LM
from tests._dist import run_ranks

ZAYA = "zaya"


def _wide(config: object) -> object:
    """The tiny config with biases, a sliding-window first layer and a 7-token halo (a sp 2 zigzag chunk is 6)."""
    config.attention_bias, config.cca_time0, config.cca_time1 = True, 5, 4
    config.sliding_window, config.layer_types = 5, ["hybrid_sliding", "hybrid"]
    return config


def _on_rank(rank: int, world_size: int, change: str, packed: bool, want: str) -> None:
    """The zoo's judgement of ZAYA on this rank, with ``change`` made inside the rank: "halo off" (each chunk sees
    zeros before it), "documents off" (the halo crosses document starts), "wide" (``_wide``'s config), "none"; the
    ranks' outcomes merged as the zoo's sweep merges them (the worst) must be ``want``."""
    import seqpar.models.zoo as models_zoo
    from seqpar.sequence_parallel.mixers import cca

    saved = cca.chunk_halos, cca._since_start, models_zoo.tiny_config
    if change == "halo off":  # still exchanged, so every rank joins the collective as before
        cca.chunk_halos = lambda *a: torch.zeros_like(saved[0](*a))
    elif change == "documents off":
        cca._since_start = lambda *a: None
    elif change == "wide":
        models_zoo.tiny_config = lambda model_type: _wide(saved[2](model_type))
    try:
        with tempfile.TemporaryDirectory() as out_dir:  # the sweep's rank writes its outcome, never raises
            zoo._family_on_rank(rank, world_size, ZAYA, (CAUSAL_LM,), packed, False, out_dir)
            outcome = zoo._read_outcome(os.path.join(out_dir, f"rank{rank}.json"))
    finally:
        cca.chunk_halos, cca._since_start, models_zoo.tiny_config = saved
    everyone: list[dict | None] = [None] * world_size
    dist.all_gather_object(everyone, outcome)
    merged = zoo._merge(everyone)
    assert merged["status"] == want, merged


@pytest.mark.parametrize("sp, packed", [(2, False), (3, True)], ids=["sp2", "sp3-packed"])
def test_zaya_is_exact(sp, packed):
    run_ranks(sp, _on_rank, "none", packed, zoo.EXACT)


def test_wide_zaya_is_exact_with_packed_documents():
    run_ranks(2, _on_rank, "wide", True, zoo.EXACT)


@pytest.mark.parametrize("change, packed", [("halo off", False), ("documents off", True)])
def test_zaya_without_its_halo_or_document_cut_is_wrong(change, packed):
    run_ranks(2, _on_rank, change, packed, zoo.WRONG)
