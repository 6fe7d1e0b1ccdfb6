"""ZAYA under sequence parallelism: its attention's CCA projection convolves q/k and shifts v across ranks.

The zoo's tiny ZAYA is exact at sp 2 and 3 and with two packed documents in a row (Note [CCA halo]); with the
halo's contents zeroed, or the documents' starts ignored, it is not (the exchange and the cut are what make it so).
A second tiny ZAYA (biased projections, a sliding-window layer, a halo wider than a zigzag chunk) is exact too.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from benchmarks import zoo
from seqpar.models.zoo import zoo_model_types
from tests._pool import RankPool

ZAYA = "zaya"


def _wide(config: object) -> object:
    """The tiny config with biases, a sliding-window first layer and a 7-token halo (a sp 2 zigzag chunk is 6)."""
    config.attention_bias, config.cca_time0, config.cca_time1 = True, 5, 4
    config.sliding_window, config.layer_types = 5, ["hybrid_sliding", "hybrid"]
    return config


def _on_rank(rank: int, world_size: int, change: str, *args: object) -> None:
    """The zoo's judgement of ZAYA on this rank, with ``change`` made inside the rank: "halo off" (each chunk sees
    zeros before it), "documents off" (the halo crosses document starts), "wide" (``_wide``'s config)."""
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
        zoo._family_on_rank(rank, world_size, ZAYA, *args)
    finally:
        cca.chunk_halos, cca._since_start, models_zoo.tiny_config = saved


@pytest.fixture(scope="module")
def pools():
    found: dict[int, RankPool] = {}
    yield lambda sp: found.setdefault(sp, RankPool(sp, timeout=timedelta(seconds=60)))
    for pool in found.values():
        pool.close(kill=True)


def _judged(pool: RankPool, change: str, packed: bool) -> dict:
    mappings = zoo_model_types()[ZAYA].mappings
    return zoo.pool_outcome(pool, _on_rank, change, mappings, packed, False, deadline_s=120)


@pytest.mark.parametrize("sp, packed", [(2, False), (3, False), (2, True)], ids=["sp2", "sp3", "packed"])
def test_zaya_is_exact(sp, packed):
    outcome = zoo.sweep(sp, [ZAYA], packed=packed)[ZAYA]
    assert outcome["status"] == zoo.EXACT, outcome


def test_wide_zaya_is_exact_with_packed_documents(pools):
    outcome = _judged(pools(2), "wide", True)
    assert outcome["status"] == zoo.EXACT, outcome


@pytest.mark.parametrize("change, packed", [("halo off", False), ("documents off", True)])
def test_zaya_without_its_halo_or_document_cut_is_wrong(pools, change, packed):
    outcome = _judged(pools(2), change, packed)
    assert outcome["status"] == zoo.WRONG, outcome
