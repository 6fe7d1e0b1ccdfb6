"""The strategy rows and the layout name registry: what each row runs, picks and sends; names through configs and CLI.

One spawn of 4 gloo ranks checks that ``seqpar.attention`` runs each row's function and that the layout rows shard
and gather as the functions do; the rest reads the registries, the records and the configs in this process.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib

import pytest
import torch
import transformers

import seqpar
from seqpar.errors import SeqparInputError
from seqpar.hf import SequenceParallelConfig
from seqpar.sequence_parallel.checks import SIGNATURE_LENGTH
from seqpar.sequence_parallel.layouts.chunks import (
    NAMED_LAYOUTS,
    SequenceLayout,
    layout_names,
    named_layout,
    rank_chunk_ids,
)
from seqpar.sequence_parallel.masks.sequence_mask import SequenceMask
from seqpar.sequence_parallel.selection import select_strategy
from seqpar.sequence_parallel.strategies import STRATEGY_FUNCTIONS
from seqpar.sequence_parallel.strategies.registry import STRATEGIES, STRATEGY_ROWS, strategy_options, strategy_row
from seqpar.train.config import TrainConfig, build_parser, config_from_args
from tests._dist import run_ranks
from tests.test_bytes_sent import SIGNATURE_INTS, _analytical_bytes

ROOT = pathlib.Path(__file__).resolve().parent.parent
RANKS, ULYSSES, SEQ, HEAD_DIM = 4, 2, 64, 8


def _dispatch_worker(rank, world_size):
    meshes = {"flat": seqpar.make_mesh(), "two_d": seqpar.make_mesh(ulysses_size=ULYSSES)}
    gen = torch.Generator().manual_seed(rank)
    q = torch.randn(1, 4, SEQ // world_size, HEAD_DIM, generator=gen)
    k, v = (torch.randn(1, 2, SEQ // world_size, HEAD_DIM, generator=gen) for _ in "kv")
    for name in STRATEGIES[:-1]:
        row = strategy_row(name)
        mesh = meshes["two_d" if row.two_d else "flat"]
        choice = seqpar.choose_attention(q, k, v, mesh=mesh, strategy=name)
        assert choice.strategy == name, (name, choice)
        ran = seqpar.attention(q, k, v, mesh=mesh, strategy=name)
        mask = seqpar.sequence_mask(None, mesh, layout="zigzag", batch_size=1)  # as seqpar.attention builds it
        options = dict(layout="zigzag", causal=True, scale=HEAD_DIM**-0.5, kernel=choice.kernel, mask=mask)
        direct = row.function(q, k, v, mesh=mesh, sinks=None, **options)
        torch.testing.assert_close(ran, direct, rtol=0, atol=0, msg=f"seqpar.attention(strategy={name!r})")
    x = torch.arange(2 * SEQ).reshape(1, SEQ, 2)
    fixed = [NAMED_LAYOUTS[n] for n in layout_names(per_batch=False)]
    for row in [*fixed, seqpar.balanced_layout(torch.arange(SEQ), world_size)]:
        want = seqpar.shard_sequence(x, meshes["flat"], dim=1, layout=_arg(row))
        torch.testing.assert_close(row.shard(x, meshes["flat"]), want, rtol=0, atol=0)
        torch.testing.assert_close(row.gather(want, meshes["flat"]), x, rtol=0, atol=0)
        assert row.chunks_for(world_size) == tuple(rank_chunk_ids(_arg(row), world_size, r) for r in range(world_size))
    for name in layout_names(per_batch=True):
        with pytest.raises(SeqparInputError, match="made per batch"):
            NAMED_LAYOUTS[name].shard(x, meshes["flat"])


def _arg(row):
    """The ``layout=`` argument a row stands for: its name, or the ChunkLayout itself."""
    return row if isinstance(row, seqpar.ChunkLayout) else row.name


def test_rows_are_what_attention_runs_and_layout_rows_shard_as_the_functions():
    assert {name: row.function for name, row in STRATEGY_ROWS.items()} == STRATEGY_FUNCTIONS
    for name, row in STRATEGY_ROWS.items():
        module = importlib.import_module(f"seqpar.sequence_parallel.strategies.{name}")  # one algorithm a file
        assert row.name == name and row.function is getattr(module, f"{name}_attention")
        assert row.function_path == f"{module.__name__}:{name}_attention"  # imported on first use
    assert STRATEGIES == ("ulysses", "ring", "allgather", "hybrid", "auto") == seqpar.STRATEGIES
    run_ranks(RANKS, _dispatch_worker)


MASKED = {"local_tokens": 2048 // 4, "head_dim": 64, "itemsize": 4}
DOCS = (37, 301, 12, 95, 180, 64, 250, 9, 141, 77, 210, 33, 156, 120, 88, 275)  # as tests/test_mask_bytes.py

# (strategy, heads, kv_heads, sp_size, ulysses_size, mask) -> today's pick (the rule of Note [auto strategy])
CASES = [
    (("auto", 8, 8, 4, 1, None), "ulysses"),
    (("auto", 8, 2, 4, 1, None), "ulysses"),  # GQA: 2 KV heads copied up to 4
    (("auto", 8, 1, 8, 1, None), "ulysses"),  # MQA
    (("auto", 12, 3, 4, 1, None), "ulysses"),  # 3 KV heads over 4 ranks: shared by neighbours (Note [uneven heads])
    (("auto", 14, 2, 4, 1, None), "ulysses"),  # 4, 4, 3, 3 heads: the slowest rank 1.14x the mean
    (("auto", 28, 4, 8, 1, None), "ulysses"),
    (("auto", 5, 5, 4, 1, None), "ring"),  # 2, 1, 1, 1 heads: 1.6x
    (("auto", 14, 2, 8, 4, None), "hybrid"),  # an uneven ulysses axis, 1.14x
    (("auto", 12, 3, 6, 1, None), "ulysses"),
    (("auto", 6, 6, 4, 1, None), "ring"),  # 6 heads over 4: 2 against 1.5, 1.33x the mean
    (("auto", 4, 4, 8, 1, None), "ring"),
    (("auto", 8, 2, 4, 2, None), "hybrid"),
    (("auto", 6, 6, 4, 2, None), "hybrid"),
    (("auto", 4, 4, 8, 4, None), "hybrid"),
    (("auto", 3, 3, 4, 2, None), "ring"),  # 3 heads over the ulysses axis: 2 against 1.5; fewer than sp
    (("auto", 8, 8, 8, 8, None), "ulysses"),  # an ulysses axis as large as sp is plain ulysses
    (("auto", 8, 8, 1, 1, None), "ulysses"),  # (seqpar.attention runs "local" on one rank)
    (("auto", 8, 2, 4, 1, "docs"), "ring"),  # the mask-aware ring sends far fewer bytes
    (("auto", 8, 2, 4, 1, "window S/16"), "ring"),
    (("auto", 8, 2, 4, 1, "window S/4"), "ulysses"),
    (("auto", 8, 2, 4, 1, "trivial"), "ulysses"),
    (("auto", 8, 2, 4, 2, "docs"), "hybrid"),  # a 2-D mesh keeps hybrid
    (("auto", 6, 6, 4, 1, "docs"), "ring"),
    (("ring", 3, 3, 4, 1, None), "ring"),
    (("allgather", 6, 6, 4, 1, "docs"), "allgather"),
    (("ulysses", 8, 2, 4, 1, "docs"), "ulysses"),
    (("hybrid", 8, 2, 4, 2, None), "hybrid"),
]


def _mask(kind: str | None) -> SequenceMask | None:
    if kind is None:
        return None
    if kind == "docs":
        positions = torch.cat([torch.arange(n) for n in DOCS])[None]
        return SequenceMask(torch.arange(2048)[None] - positions, None, max(DOCS))
    if kind == "trivial":
        return SequenceMask()
    return SequenceMask(None, 2048 // int(kind.rpartition("/")[2]))


@pytest.mark.parametrize(("args", "picked"), CASES, ids=lambda c: " ".join(map(str, c)) if isinstance(c, tuple) else c)
def test_select_strategy_picks_todays_choices(args, picked):
    strategy, heads, kv_heads, sp, u, mask = args
    assert select_strategy(strategy, heads, kv_heads, sp, u, mask=_mask(mask), **MASKED) == picked
    if mask is None and sp > 1:  # the estimate and the unmasked rule agree with it
        config = {"hidden_size": 64 * heads, "num_attention_heads": heads, "num_key_value_heads": kv_heads}
        config |= {"intermediate_size": 128, "num_hidden_layers": 1, "vocab_size": 256, "head_dim": 64}
        estimate = seqpar.estimate_memory(
            transformers.LlamaConfig(**config),
            64 * sp,
            seqpar.ParallelDims(sp_size=sp, ulysses_size=u),
            strategy=strategy,
        )
        assert estimate.strategy == picked


def test_select_strategy_refuses_unknown_names_and_heads_the_row_cannot_split():
    with pytest.raises(SeqparInputError, match=r"unknown strategy 'spiral'; choose one of \('ulysses', 'ring'"):
        select_strategy("spiral", 8, 8, 4)
    with pytest.raises(SeqparInputError, match="unknown strategy 'local'"):  # chosen, never asked for
        select_strategy("local", 8, 8, 4)
    with pytest.raises(SeqparInputError, match=r"ulysses over 4 ranks needs at least 4 query heads.* has 3"):
        select_strategy("ulysses", 3, 3, 4)
    with pytest.raises(SeqparInputError, match="hybrid's ulysses axis over 4 ranks needs at least 4 query heads"):
        select_strategy("hybrid", 2, 1, 8, 4)
    assert select_strategy("ulysses", 6, 6, 4) == "ulysses"  # uneven heads run (Note [uneven heads])
    assert select_strategy("hybrid", 12, 3, 8, 4) == "hybrid"
    with pytest.raises(SeqparInputError, match="unknown strategy 'spiral'"):
        strategy_row("spiral")


def test_strategy_options_are_the_planners_families():
    """Every (strategy, ulysses degree) the planner tries: the rows without an all-to-all, then one per divisor."""

    def names(sp):
        return [(row.name, u) for row, u in strategy_options(sp)]

    assert names(1) == [("local", 1)]
    assert names(4) == [("ring", 1), ("allgather", 1), ("hybrid", 2), ("ulysses", 4)]
    assert names(6) == [("ring", 1), ("allgather", 1), ("hybrid", 2), ("hybrid", 3), ("ulysses", 6)]
    assert {name for sp in (1, 4) for name, _ in names(sp)} == set(STRATEGY_ROWS)


def test_bytes_models_match_the_records_and_the_measured_volumes():
    """The rows' bytes against the strategies bench's records and tests/test_bytes_sent.py's own arithmetic."""
    records = json.loads((ROOT / "benchmarks" / "strategies_cpu.json").read_text())
    assert records
    for r in records:
        row, p = strategy_row(r["strategy"]), r["ranks"]
        check = (p - 1) * SIGNATURE_LENGTH * 8  # the input check's int64 signature to each peer
        sent = row.bytes_sent(
            r["heads"], r["kv_heads"], p, r["ulysses"] if row.two_d else 1, r["seq"] // p, r["head_dim"], 4
        )
        assert sent + check == r["analytical_bytes"], r
        assert abs((sent + check) / r["sent_bytes_per_rank"] - 1) < 0.01, r
    for kv_heads in (2, 8):  # tests/test_bytes_sent.py: 4 ranks, ulysses 2, 2048 tokens, 8 heads of 64, fp32
        for name in STRATEGIES[:-1]:
            row = strategy_row(name)
            sent = row.bytes_sent(8, kv_heads, 4, 2 if row.two_d else 1, 2048 // 4, 64, 4)
            check = 3 * SIGNATURE_INTS * 8  # that file's count of the input check
            assert sent + check == pytest.approx(_analytical_bytes(name, kv_heads), rel=1e-12), (name, kv_heads)
    assert strategy_row("local").bytes_sent(8, 2, 1, 1, 2048, 64, 4) == 0


def test_layout_names_round_trip_through_the_configs_and_the_cli():
    assert layout_names() == ("contiguous", "zigzag", "balanced", "placed", "auto")
    assert seqpar.LAYOUTS == layout_names(per_batch=False) == ("contiguous", "zigzag")
    assert all(isinstance(row, SequenceLayout) and row.name == n for n, row in NAMED_LAYOUTS.items())
    parser = build_parser(argparse.ArgumentParser())
    for name in layout_names():
        assert SequenceParallelConfig(layout=name).layout == name
        config = config_from_args(parser.parse_args(["--layout", name]))
        assert config.layout == name and TrainConfig(layout=name).layout == name
        assert named_layout(name).per_batch == (name in ("balanced", "placed", "auto"))
    choices = next(a.choices for a in parser._actions if "--layout" in a.option_strings)
    assert tuple(choices) == layout_names()


def test_unknown_layout_names_get_the_registry():
    listed = (
        r"choose one of \('contiguous', 'zigzag'\) or pass a ChunkLayout \(made per batch by shard_batch: "
        r"balanced, placed, auto\)"
    )
    with pytest.raises(SeqparInputError, match="unknown layout 'striped'; " + listed):
        named_layout("striped")
    with pytest.raises(SeqparInputError, match="unknown layout 'striped'"):
        seqpar.shard_batch({"input_ids": torch.arange(8)[None]}, layout="striped")
    with pytest.raises(
        SeqparInputError,
        match=r"unknown layout 'striped'; choose one of \('contiguous', 'zigzag', "
        r"'balanced', 'placed', 'auto'\)",
    ):
        SequenceParallelConfig(layout="striped")
    parser = build_parser(argparse.ArgumentParser(exit_on_error=False))
    with pytest.raises(argparse.ArgumentError, match="'contiguous', 'zigzag', 'balanced', 'placed', 'auto'"):
        parser.parse_args(["--layout", "striped"])


def test_shard_batch_dispatches_per_batch_names_through_the_registry():
    ids = torch.arange(16)[None]
    packed = torch.tensor([[*range(5), *range(11)]])
    for name, positions, made in [
        ("balanced", None, "balanced"),
        ("placed", packed, "placed"),
        ("auto", packed, "placed"),
        ("auto", None, "balanced"),
    ]:
        batch = {"input_ids": ids} | ({"position_ids": positions} if positions is not None else {})
        shard = seqpar.shard_batch(batch, layout=name)
        assert isinstance(shard.layout, seqpar.ChunkLayout) and shard.layout.name == made, (name, shard.layout)


def test_the_docs_list_every_registered_name():
    guide = (ROOT / "docs" / "guides" / "strategies.md").read_text()
    for name in [*STRATEGY_ROWS, *layout_names()]:
        assert f"`{name}`" in guide, name
