"""Zamba (Mamba1 in heads, Note [Mamba1 state]) and RWKV-4 (token shifts and the WKV state, Note [WKV state]) under
sequence parallelism, judged as the zoo judges every family (loss, logits, every gradient vs one process).

Both are exact at 2 and 3 ranks and with packed documents (each alone); with the scan's state exchange or the halo
exchange switched off they come out WRONG; an RWKV call that brings a state of its own (a cache) is refused.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from benchmarks import zoo
from benchmarks.zoo import EXACT, WRONG
from seqpar.sequence_parallel.mixers import conv, scan
from tests._dist import run_ranks

RECURRENT = ["rwkv", "zamba"]


def _judged(rank: int, world: int, model_type: str, packed: bool = False) -> dict:
    """The zoo's judgement of ``model_type`` on this rank (its ``_merge`` takes the worst of the ranks')."""
    return zoo._judge_family(rank, world, model_type, ("causal-lm",), packed=packed, control=False)


def _exact_on_rank(rank: int, world: int, packings: tuple[bool, ...]) -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    for packed in packings:
        found = {t: _judged(rank, world, t, packed) for t in RECURRENT}
        assert {t: o["status"] for t, o in found.items()} == dict.fromkeys(RECURRENT, EXACT), (packed, found)


def test_zamba_and_rwkv_are_exact_at_two_and_three_ranks_and_packed():
    """As ``python -m benchmarks.zoo --only zamba,rwkv`` (``--sp 3``, ``--packed``) judges them, on the session's
    pools of ranks (a sweep would spawn its own)."""
    run_ranks(2, _exact_on_rank, (False, True))
    run_ranks(3, _exact_on_rank, (False,))


def _controls_on_rank(rank: int, world: int) -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    kept = {module: module.gather_sequence for module in (scan, conv)}

    def nothing_from_the_others(x, mesh, dim, layout):  # gathered (every rank takes part), then zeroed
        return torch.zeros_like(kept[conv](x, mesh, dim=dim, layout=layout))

    found = {}
    for module in (scan, conv):  # the states between chunks, then the halos of the shifts and convolutions
        module.gather_sequence = nothing_from_the_others
        try:
            found[module.__name__] = {t: _judged(rank, world, t)["status"] for t in RECURRENT}
        finally:
            module.gather_sequence = kept[module]
    assert all(status == WRONG for row in found.values() for status in row.values()), found
    assert {t: _judged(rank, world, t)["status"] for t in RECURRENT} == dict.fromkeys(RECURRENT, EXACT)  # undone


def test_the_state_or_the_halo_switched_off_is_wrong():
    run_ranks(2, _controls_on_rank)


def _refused_on_rank(rank: int, world: int) -> None:
    import transformers

    import seqpar
    from seqpar.errors import SeqparInputError
    from seqpar.models.zoo import CAUSAL_LM, TEXT_IDS, tiny_model

    transformers.logging.set_verbosity_error()
    mesh = seqpar.make_mesh(sp_size=world)
    model = seqpar.prepare_model(tiny_model("rwkv", (CAUSAL_LM,)), mesh)
    ids = torch.randint(*TEXT_IDS, (1, 8), generator=torch.Generator().manual_seed(0))
    shard = seqpar.shard_batch({"input_ids": ids}, mesh)
    state = [torch.zeros(1, model.config.hidden_size, model.config.num_hidden_layers) for _ in range(5)]
    with pytest.raises(SeqparInputError, match="without a KV cache"):  # on every rank (Note [agreeing on errors])
        model(input_ids=shard["input_ids"], position_ids=shard["position_ids"], state=state)
    with torch.no_grad():  # the same call without it runs
        assert model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits.shape[:2] == (1, 4)


def test_an_rwkv_state_of_its_own_is_refused():
    run_ranks(2, _refused_on_rank)


def test_the_rows_count_the_mixers_as_built():
    """Note [mixer rows]: the Mamba1 row (which adapts Zamba's mixer) and the RWKV row count the parameters built;
    the memory estimate refuses both models by name (no ``Family.hybrid`` reads their sizes)."""
    import seqpar
    from seqpar.errors import SeqparInputError
    from seqpar.models import anatomy
    from seqpar.models.mixers import Mamba1, Rwkv
    from seqpar.models.zoo import CAUSAL_LM, tiny_config, tiny_model

    for model_type in RECURRENT:
        config = tiny_config(model_type)
        with pytest.raises(SeqparInputError, match=f"'{model_type}'"):
            seqpar.estimate_memory(config, 1024, seqpar.ParallelDims(sp_size=2))
    zamba, rwkv = tiny_config("zamba"), tiny_config("rwkv")
    hidden = zamba.hidden_size
    row = Mamba1(hidden * zamba.mamba_expand, zamba.mamba_d_state, zamba.mamba_d_conv, zamba.mamba_dt_rank)
    mixer = anatomy(tiny_model("zamba", (CAUSAL_LM,))).mixers[0]
    assert row.params(hidden) == sum(p.numel() for p in mixer.parameters())
    row = Rwkv.read(lambda name, default=None: getattr(rwkv, name, default), Rwkv.names, rwkv.hidden_size)
    block = tiny_model("rwkv", (CAUSAL_LM,)).rwkv.blocks[1]
    built = [p.numel() for part in (block.attention, block.feed_forward) for p in part.parameters()]
    assert row.params(rwkv.hidden_size) == sum(built)


@pytest.mark.fast
@pytest.mark.parametrize("heads", [False, True], ids=["mamba", "zamba-heads"])
def test_mamba1_decayed_state_read_equals_float64_far_past_float32s_range(heads, monkeypatch):
    """The read of an entering state decayed to each token (Note [Mamba1 state]) over elapsed steps whose exponents
    reach -1000 (held at the floor there) equals the float64 formula, value and every gradient, within 1e-5 of each
    one's largest entry (float32's rounding is 6e-8); its hand-written backward passes gradcheck in float64 on
    exponents past the floor, Zamba's heads included. Control: a floor held where decays still matter (-2) is
    judged wrong."""
    from seqpar.models.mixers import Mamba1
    from seqpar.sequence_parallel.mixers import mamba1
    from seqpar.sequence_parallel.mixers.mamba1 import _Carried

    g = torch.Generator().manual_seed(0)
    channels = (3, 5) if heads else (6,)
    n, t, entries = 2, 3 * Mamba1.scan_block + 7, 4  # blocks of the scan's size and a short last one
    step = torch.rand(n, t, *channels, generator=g, dtype=torch.float64) * 0.5
    elapsed = step.cumsum(1)
    c = torch.randn(n, t, *channels[:-1], entries, generator=g, dtype=torch.float64)
    rate = -torch.rand(*channels, entries, generator=g, dtype=torch.float64) * 16 - 0.01
    entering = torch.randn(n, *channels, entries, generator=g, dtype=torch.float64)
    reference = (elapsed, c, rate, entering)
    assert (rate * elapsed[..., None]).min() < -1000  # far past the floor and float32's range

    def formula(e, c_, r, s):
        kept = torch.exp(r * e[..., None]) * s[:, None]
        return torch.matmul(kept, c_[..., None])[..., 0]

    weights = torch.randn(n, t, *channels, generator=g, dtype=torch.float64)
    wide = [x.clone().requires_grad_() for x in reference]
    (formula(*wide) * weights).sum().backward()
    narrow = [x.float().requires_grad_() for x in reference]
    out = _Carried.apply(*narrow)
    (out * weights.float()).sum().backward()
    expected = formula(*reference)

    def off(mine: torch.Tensor, theirs: torch.Tensor) -> float:
        return float((mine.detach().double() - theirs).abs().max() / theirs.abs().max())

    assert off(out, expected) <= 1e-5
    for mine, theirs in zip(narrow, wide, strict=True):
        assert off(mine.grad, theirs.grad) <= 1e-5

    short = [elapsed[:, :9] * 40, c[:, :9], rate, entering]  # exponents past the floor within a few tokens
    assert torch.autograd.gradcheck(_Carried.apply, [x.clone().requires_grad_() for x in short])
    monkeypatch.setattr(mamba1, "_FLOOR", -2.0)
    assert off(_Carried.apply(*(x.float() for x in reference)), expected) > 1e-3
