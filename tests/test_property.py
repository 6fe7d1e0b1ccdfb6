"""Property-based sweep: random shapes, world sizes, strategies, layouts, packed documents and windows match SDPA.

Hypothesis runs derandomized inside each of 4 gloo ranks, so every rank draws the same examples; a
world size below 4 runs on a sub-group and the other ranks wait for the verdict.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import seqpar
from tests._cases import dense_mask, packed_positions
from tests._dist import run_ranks, shard_index

ATOL, RTOL = 2e-5, 1e-4


@st.composite
def problems(draw):
    size = draw(st.integers(1, 4))
    strategy = draw(st.sampled_from(["ring", "allgather", "ulysses", "auto"]))
    kv_heads = draw(st.integers(1, 3))
    group = draw(st.integers(1, 3))
    if strategy == "ulysses":  # any shape ulysses can serve: a query head per rank at least, evenly split or not
        kv_heads, group = draw(st.sampled_from([(kv, g) for kv in (1, 2, 3, 4) for g in (1, 2, 3) if kv * g >= size]))
    return {
        "size": size,
        "strategy": strategy,
        "layout": draw(st.sampled_from(["zigzag", "contiguous"])),
        "causal": draw(st.booleans()),
        "batch": draw(st.integers(1, 2)),
        "heads": kv_heads * group,
        "kv_heads": kv_heads,
        "head_dim": draw(st.sampled_from([8, 16, 40, 64, 96, 128])),
        "chunk": draw(st.integers(1, 9)),
        "seed": draw(st.integers(0, 2**16)),
        "bshd": draw(st.booleans()),  # inputs as transposed [B, S, H, D] views, as models produce them
        "doc_lengths": draw(st.one_of(st.none(), st.lists(st.integers(1, 12), min_size=1, max_size=6))),
        "window": draw(st.one_of(st.none(), st.integers(1, 20))),
    }


def _check(rank, groups, p):
    size = p["size"]
    seq = 2 * size * p["chunk"]
    gen = torch.Generator().manual_seed(p["seed"])
    q = torch.randn(p["batch"], p["heads"], seq, p["head_dim"], generator=gen)
    k, v = (torch.randn(p["batch"], p["kv_heads"], seq, p["head_dim"], generator=gen) for _ in range(2))
    dout = torch.randn(p["batch"], p["heads"], seq, p["head_dim"], generator=gen)
    window = p["window"] if p["causal"] else None  # a window needs the causal mask
    positions = packed_positions(seq, p["doc_lengths"])[None] if p["doc_lengths"] else torch.arange(seq)[None]
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = dense_mask(positions, p["causal"], window) if (p["doc_lengths"] or window) else None
    ref = F.scaled_dot_product_attention(*refs, attn_mask=mask, is_causal=p["causal"] and mask is None, enable_gqa=True)
    ref.backward(dout)
    idx = shard_index(p["layout"], size, rank, seq)
    if p["bshd"]:
        local = [t[:, :, idx].transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]  # [B, S, H, D]
        views = [t.transpose(1, 2) for t in local]  # strided [B, H, S, D]
    else:
        local = [t[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
        views = local
    extra = {"window": window}
    if p["doc_lengths"]:
        extra["position_ids"] = positions[:, idx]
    out = seqpar.attention(
        *views, mesh=groups[size], strategy=p["strategy"], causal=p["causal"], layout=p["layout"], **extra
    )
    out.backward(dout[:, :, idx])
    grads = [t.grad.transpose(1, 2) if p["bshd"] else t.grad for t in local]
    for got, want in zip((out, *grads), (ref, *(t.grad for t in refs)), strict=True):
        torch.testing.assert_close(got, want[:, :, idx].detach(), atol=ATOL, rtol=RTOL, msg=lambda m: f"{p}: {m}")


def _property_worker(rank, world_size):
    groups = {1: None, 2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2]), 4: seqpar.make_mesh()}

    @settings(max_examples=60, derandomize=True, deadline=None, database=None, phases=[Phase.generate])
    @given(problems())
    def agree(p):
        failure = ""
        if rank < p["size"]:
            try:
                _check(rank, groups, p)
            except Exception as e:  # reported below, after every rank has voted
                failure = f"rank {rank}: {e}"
        verdict = torch.tensor([1 if failure else 0])
        dist.all_reduce(verdict)  # all ranks fail the same example together, so none is left waiting
        assert not verdict.item(), failure or "another rank failed this example"

    agree()


def test_property_sweep():
    run_ranks(4, _property_worker)
