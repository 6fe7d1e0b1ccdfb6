"""``seqpar plan --doc-len``: packed documents shrink every strategy's attention work and the K/V a placed ring or
all-gather moves, never Ulysses' all-to-all (Note [planned documents]).

No process groups: the planner is arithmetic over a model's sizes and a cluster's rates.
"""

from __future__ import annotations

import json
import math

import pytest

import seqpar
from seqpar.cli import main as cli_main
from seqpar.planning import Cluster, Layout, load_model_shape, model_flops, plan, step_time
from seqpar.planning.documents import placed_kv_fraction, visible_fraction

SEQ = 131072


def test_fractions_written_out():
    assert visible_fraction(SEQ, None) == visible_fraction(SEQ, SEQ) == visible_fraction(SEQ, 2 * SEQ) == 1.0
    assert visible_fraction(8191, 1023) == 1024 / 8192  # (N + 1) / (S + 1)
    # a ring of 4 over 8192 tokens holds shares of 2048: a 512-token document is whole but one per rank is cut,
    # whose head (256 tokens on average) goes to the next rank, against the plain ring's 3 shares
    assert placed_kv_fraction(8192, 512, 4) == 256 / (3 * 2048)
    # 5000-token documents span 3 shares: their own ring moves 2 of the plain ring's 3 shares
    assert placed_kv_fraction(8192, 5000, 4) == pytest.approx(2 / 3)
    assert placed_kv_fraction(8192, 8192, 4) == 1.0  # one document: the plain ring
    assert placed_kv_fraction(8192, 512, 1) == placed_kv_fraction(8192, None, 4) == 1.0


def test_step_time_with_documents():
    model, cluster = load_model_shape("llama-8b"), Cluster(gpus=8)
    seen = visible_fraction(SEQ, 2048)
    ulysses, ring = Layout(1, 8, 8, 1, "ulysses"), Layout(1, 8, 1, 1, "ring")
    one, packed = (step_time(model, SEQ, ulysses, cluster, doc_len=n) for n in (None, 2048))
    assert packed.all_to_all == one.all_to_all > 0  # every head shard moves whatever the mask
    assert packed.attention == pytest.approx(one.attention * seen)  # no ring term: compute only
    assert packed.matmul == one.matmul
    one, packed = (step_time(model, SEQ, ring, cluster, doc_len=n) for n in (None, 2048))
    # the ring's K/V: 1024 tokens per rank instead of 7 shares of 16K, so compute is the attention term
    moved = placed_kv_fraction(SEQ, 2048, 8)
    assert moved == 1024 / (7 * SEQ / 8) and packed.attention < one.attention * seen * 1.01
    assert packed.total < step_time(model, SEQ, ulysses, cluster, doc_len=2048).total
    flops = model_flops(model, SEQ, 1, 2048)
    assert model_flops(model, SEQ) > flops > model_flops(model, SEQ) - 3.5 * 2 * SEQ**2 * 32 * 128 * 32
    with pytest.raises(seqpar.SeqparInputError, match="doc_len must be a positive"):
        step_time(model, SEQ, ring, cluster, doc_len=0)


def test_plan_with_documents_ranks_the_placed_ring_first(tmp_path, capsys):
    cluster = Cluster(gpus=16)
    result = plan("llama-8b", SEQ, cluster, doc_len=2048)
    best = {}
    for c in result.candidates:  # the fastest of each strategy at sp 8, the same dp mode and features
        lay = c.layout
        if (lay.sp, lay.dp_mode, lay.features) == (8, "fsdp", ("chunked_loss", "tiled_mlp")):
            best.setdefault(lay.strategy, c.time.total)
    assert best["ring"] < best["ulysses"] and best["allgather"] < best["ulysses"], best
    assert result.top(1)[0].layout.strategy in ("ring", "allgather")
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "llama-8b", "--seq-len", "128K", "--gpus", "16", "--doc-len", "2K"]
    assert cli_main([*argv, "--json", str(out)]) == 0
    assert "packed documents of 2,048 tokens (placed)" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["doc_len"] == 2048 and math.isclose(saved["top"][0]["step_s"], result.top(1)[0].time.total)
    assert cli_main([*argv[:-1], "0"]) == 2
    assert "not a positive token count" in capsys.readouterr().err
    with pytest.raises(seqpar.SeqparInputError, match="doc_len must be a positive"):
        plan("llama-8b", SEQ, cluster, doc_len=-1)
