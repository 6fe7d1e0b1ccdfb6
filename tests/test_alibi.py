"""ALiBi (Note [ALiBi]): BLOOM and MPT served by their attention adapters, the bias applied from global positions.

Both families at 2 and 3 ranks, with packed documents, equal one process on loss, logits and every gradient (the
zoo's judgement), under "auto" and under every strategy that applies the bias asked for by name; seqpar.attention
with slopes (grouped-query heads, packed documents, a window) equals a float64 softmax of the biased scores.
Negative controls: the slopes not handed to seqpar's attention, or of the wrong sign, come out WRONG; a strategy
whose row applies no key-position bias is refused by name on every rank, and "auto" never picks one.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import seqpar
from benchmarks import zoo
from seqpar.errors import SeqparInputError
from seqpar.models.zoo import CAUSAL_LM
from seqpar.sequence_parallel import attention_adapters
from seqpar.sequence_parallel.prepare import last_attention_choice
from seqpar.sequence_parallel.selection import select_strategy
from seqpar.sequence_parallel.strategies.registry import STRATEGIES, STRATEGY_ROWS
from tests._dist import run_ranks, shard_index
from tests.test_attention_adapters import Case, _cases_on_rank, _worst

ALIBI = ["bloom", "mpt"]
ASKED = [name for name in STRATEGIES if name in STRATEGY_ROWS]  # the names a caller passes, "auto" aside
BIASED = tuple(name for name in ASKED if STRATEGY_ROWS[name].key_bias)
UNBIASED = tuple(name for name in ASKED if not STRATEGY_ROWS[name].key_bias)


def _zoo_on_rank(rank: int, world: int, packed: bool) -> None:
    """The zoo's judgement of BLOOM and MPT (their causal LMs) on this rank, as ``python -m benchmarks.zoo --only
    bloom,mpt`` makes it (its sweep takes the worst of the ranks': here every rank must find them exact)."""
    import transformers

    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = {t: zoo._judge_family(rank, world, t, (CAUSAL_LM,), packed, False) for t in ALIBI}
    assert {t: o["status"] for t, o in found.items()} == dict.fromkeys(ALIBI, zoo.EXACT), found


@pytest.mark.parametrize("sp, packed", [(2, False), (3, True)])
def test_bloom_and_mpt_are_exact_in_the_zoo(sp, packed):
    run_ranks(sp, _zoo_on_rank, packed)  # on the session's pools of ranks (a sweep would spawn its own)


def test_every_strategy_that_applies_alibi_is_exact_by_name():
    assert set(BIASED) == {"ulysses", "ring", "allgather"}  # the rows that say key_bias (the registry's answer)
    families = ALIBI * len(BIASED)
    cases = tuple(Case(t, s, packed=i > 0) for i, (t, s) in enumerate(zip(families, BIASED, strict=False)))
    run_ranks(2, _cases_on_rank, cases)  # 4 heads over 2 ranks: Ulysses in head groups
    run_ranks(3, _cases_on_rank, (Case("mpt", "ulysses", packed=True),))  # 4 heads over 3: an uneven split


def _controls_on_rank(rank: int, world: int) -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    mpt_slopes = attention_adapters._mpt_slopes
    try:  # the slopes handed under a keyword seqpar's attention does not read: no bias at all
        attention_adapters.ALIBI_KEY = "not_alibi"
        unbiased = _worst(rank, world, Case("bloom"))
    finally:
        attention_adapters.ALIBI_KEY = "seqpar_alibi_slopes"
    try:  # the slopes of the wrong sign: keys far back favoured
        attention_adapters._mpt_slopes = lambda module, device: -mpt_slopes(module, device)
        flipped = _worst(rank, world, Case("mpt", packed=True))
    finally:
        attention_adapters._mpt_slopes = mpt_slopes
    assert unbiased[0] > 1.0 and flipped[0] > 1.0, (unbiased, flipped)
    assert _worst(rank, world, Case("mpt", packed=True))[0] <= 1.0  # the patches are undone: exact again


def test_the_bias_switched_off_or_flipped_is_wrong():
    run_ranks(2, _controls_on_rank)


def _attention_on_rank(rank: int, world: int) -> None:
    """seqpar.attention with slopes against a float64 softmax of the biased scores; unbiased rows, slopes of the
    wrong count and slopes on one rank only refused on every rank."""
    g = torch.Generator().manual_seed(3)
    seq, heads, kv_heads = 24, 4, 2
    q, k, v = (torch.randn(2, h, seq, 8, generator=g) for h in (heads, kv_heads, kv_heads))
    dout = torch.randn(q.shape, generator=g)
    slopes = torch.tensor([0.5, 0.25, -0.125, 0.0625])
    positions = torch.cat([torch.arange(10), torch.arange(14)])[None].expand(2, -1)  # two documents
    pos = torch.arange(seq)
    doc = torch.cat([torch.zeros(10), torch.ones(14)]).long()
    keep = (pos[None] <= pos[:, None]) & (doc[None] == doc[:, None]) & (pos[:, None] - pos[None] < 6)
    bias = slopes.double()[:, None, None] * (pos[None] - pos[:, None]).double()
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    scores = qd @ kd.repeat_interleave(2, 1).transpose(-1, -2) / 8**0.5 + bias
    want = torch.softmax(scores.masked_fill(~keep, float("-inf")), -1) @ vd.repeat_interleave(2, 1)
    want.backward(dout.double())
    mesh = seqpar.make_mesh(sp_size=world)
    idx = shard_index("zigzag", world, rank, seq)
    for strategy in (*BIASED, "auto"):
        ql, kl, vl = (t[:, :, idx].clone().requires_grad_() for t in (q, k, v))
        options = dict(mesh=mesh, strategy=strategy, position_ids=positions[:, idx], window=6, alibi=slopes)
        out = seqpar.attention(ql, kl, vl, **options)
        out.backward(dout[:, :, idx])
        for got, exact in ((out, want), (ql.grad, qd.grad), (kl.grad, kd.grad), (vl.grad, vd.grad)):
            torch.testing.assert_close(got, exact[:, :, idx].float(), atol=2e-5, rtol=1e-4, msg=strategy)
    shards = (q[:, :, idx], k[:, :, idx], v[:, :, idx])
    for strategy in UNBIASED:
        with pytest.raises(SeqparInputError, match=rf"strategy '{strategy}' applies no ALiBi bias"):
            seqpar.attention(*shards, mesh=mesh, strategy=strategy, alibi=slopes)
    with pytest.raises(SeqparInputError, match="alibi holds 3 slopes but q has 4 heads"):
        seqpar.attention(*shards, mesh=mesh, alibi=slopes[:3])
    with pytest.raises(SeqparInputError, match="inputs differ across ranks"):  # slopes on one rank only: no hang
        seqpar.attention(*shards, mesh=mesh, alibi=slopes if rank == 0 else None)


def _refused_on_rank(rank: int, world: int, strategy: str) -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    from seqpar.models.zoo import CAUSAL_LM, TEXT_IDS, tiny_model

    model = seqpar.prepare_model(tiny_model("bloom", (CAUSAL_LM,)), seqpar.make_mesh(sp_size=world), strategy=strategy)
    ids = torch.randint(*TEXT_IDS, (1, 12), generator=torch.Generator().manual_seed(0))
    shard = seqpar.shard_batch({"input_ids": ids}, seqpar.make_mesh(sp_size=world))
    with pytest.raises(SeqparInputError, match=rf"strategy '{strategy}' applies no ALiBi bias"):
        model(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
    auto = seqpar.prepare_model(tiny_model("bloom", (CAUSAL_LM,)), seqpar.make_mesh(sp_size=world))
    with torch.no_grad():
        auto(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
    assert STRATEGY_ROWS[last_attention_choice(auto).strategy].key_bias


def test_seqpar_attention_applies_slopes_and_refuses_strategies_without_them():
    run_ranks(2, _attention_on_rank)
    assert UNBIASED == ("hybrid",)
    for strategy in UNBIASED:  # refused by name on every rank (each rank raises, none hangs)
        run_ranks(2, _refused_on_rank, strategy)


def test_auto_picks_a_strategy_that_applies_the_bias():
    for heads, sp, ulysses in ((4, 2, 1), (4, 3, 1), (6, 4, 1), (8, 4, 2)):  # ulysses, ring, ring, hybrid
        for key_bias in (False, True):
            chosen = select_strategy("auto", heads, heads, sp, ulysses, key_bias=key_bias)
            assert STRATEGY_ROWS[chosen].key_bias or not key_bias, (heads, sp, ulysses, chosen)


@pytest.mark.parametrize("model_type, row", [("bloom", "BloomAttention"), ("mpt", "MptAttention")])
def test_alibi_without_an_adapter_row_that_applies_it_is_refused_by_name(monkeypatch, model_type, row):
    from seqpar.models.own_attention import OWN_ATTENTION
    from seqpar.models.zoo import CAUSAL_LM, tiny_model
    from seqpar.sequence_parallel.prepare import unserved_reason

    model = tiny_model(model_type, (CAUSAL_LM,))
    assert unserved_reason(model) is None
    monkeypatch.setitem(OWN_ATTENTION, row, dataclasses.replace(OWN_ATTENTION[row], alibi=False))
    reason = unserved_reason(model)
    assert reason is not None and "adds an ALiBi position bias" in reason, reason
