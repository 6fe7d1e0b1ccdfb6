"""Ulysses and hybrid with head counts the degree does not split evenly equal single-device attention (gloo, CPU).

Outputs and gradients at P = 3, 4 and 8 (5 heads at 3, 6 and 14 at 4, 28 query / 4 KV heads at 8; MHA and GQA,
ranges that straddle KV groups), causal and not, both layouts, packed documents and windows, hybrid meshes with
an uneven ulysses axis, attention sinks and soft-capping; negative controls; a Qwen2 model with 14 heads
trained at sp 4 equals one process.
"""

from __future__ import annotations

import copy
import itertools
import math
import types

import pytest
import torch
import transformers

import seqpar
from seqpar.sequence_parallel.comm import uneven_all_to_all
from seqpar.sequence_parallel.selection import select_strategy
from seqpar.sequence_parallel.strategies.heads import HeadSplit, head_split
from tests._cases import check_case, check_mask_case, packed_positions
from tests._dist import run_ranks, shard_index
from tests._floors import StepFloors, assert_near_float64
from tests._models import SEQ, VOCAB, tokens
from tests._sink_cases import SOFTCAP, check_sinks_softcap

# (query heads, KV heads) per world size, none split evenly by it (Note [uneven heads])
UNEVEN = {
    3: [(5, 5), (5, 1), (6, 2), (7, 7)],  # (6, 2): neither 2 nor 3 divides the other; ranks share KV heads
    4: [(6, 6), (6, 2), (6, 3), (14, 2)],  # (14, 2): rank 1's heads 4..7 read KV heads 0, 0, 0, 1
}


def _flat(rank, world_size, heads, combos=None):
    """Every layout, causal and not, batch 1 and 2 (or the ``combos`` given)."""
    mesh, (h, kv) = seqpar.make_mesh(), heads
    dim = 8 if world_size == 8 else 16
    for layout, causal, batch in combos or itertools.product(("zigzag", "contiguous"), (True, False), (1, 2)):
        check_case(rank, world_size, mesh, "ulysses", layout, causal, batch, h, kv, dim, 4 * world_size)


def _masks(rank, world_size, heads):
    """Packed documents, alone and with a window, prebuilt masks and position ids."""
    mesh, (h, kv) = seqpar.make_mesh(), heads
    positions = packed_positions(8 * world_size)[None]
    for layout, window, prebuilt in (("zigzag", None, True), ("contiguous", 7, False), ("zigzag", 5, True)):
        check_mask_case(rank, world_size, mesh, "ulysses", layout, 1, h, kv, positions, window, prebuilt)
    two = torch.cat([positions, packed_positions(8 * world_size, (9, 3, 22))[None]])
    check_mask_case(rank, world_size, mesh, "ulysses", "zigzag", 2, h, kv, two, None, prebuilt=False)
    # attention sinks (each rank applies those of its own range of heads) and soft-capping
    for causal, window, packed in ((True, 5, True), (False, None, False)):
        options = dict(sinks=True, softcap=SOFTCAP, window=window, packed=packed)
        check_sinks_softcap(rank, world_size, mesh, "ulysses", "zigzag", causal, h, kv, **options)


def _hybrid(rank, world_size, ulysses_size, heads):
    """A hybrid mesh whose ulysses axis does not split the heads evenly, with and without documents."""
    mesh, (h, kv) = seqpar.make_mesh(ulysses_size=ulysses_size), heads
    assert not head_split(h, kv, ulysses_size).even
    for layout, causal in itertools.product(("zigzag", "contiguous"), (True, False)):
        check_case(rank, world_size, mesh, "hybrid", layout, causal, 1, h, kv, 16, 4 * world_size)
    positions = packed_positions(8 * world_size)[None]
    check_mask_case(rank, world_size, mesh, "hybrid", "zigzag", 1, h, kv, positions, None, prebuilt=True)
    check_mask_case(rank, world_size, mesh, "hybrid", "zigzag", 1, h, kv, positions, 6, prebuilt=False)
    check_sinks_softcap(rank, world_size, mesh, "hybrid", "zigzag", True, h, kv, sinks=True, softcap=SOFTCAP)


def _eight(rank, world_size):
    """P = 8 (the most ranks to spawn, fresh, so one call, kept short): 28 query / 4 KV heads (Qwen2.5-7B's)
    on a head dim of 8, causal and not, both layouts, documents with a window; hybrid 4 x 2 with 14 / 2 heads."""
    _flat(rank, world_size, (28, 4), (("zigzag", True, 1), ("contiguous", False, 2)))
    mesh, positions = seqpar.make_mesh(), packed_positions(8 * world_size)[None]
    check_mask_case(rank, world_size, mesh, "ulysses", "zigzag", 1, 28, 4, positions, 5, prebuilt=True)
    hybrid = seqpar.make_mesh(ulysses_size=4)
    check_case(rank, world_size, hybrid, "hybrid", "zigzag", True, 1, 14, 2, 8, 4 * world_size)
    check_mask_case(rank, world_size, hybrid, "hybrid", "contiguous", 1, 14, 2, positions, None, prebuilt=False)


def _cases() -> list:
    """Grouped by world size, so that the shared rank pools are not evicted and respawned between cases."""
    cases = []
    for p in (3, 4):
        cases += [pytest.param(p, "flat", hk, id=f"P{p}-H{hk[0]}kv{hk[1]}") for hk in UNEVEN[p]]
        hk = (5, 1) if p == 3 else (6, 3)
        cases.append(pytest.param(p, "masks", hk, id=f"P{p}-masks-H{hk[0]}kv{hk[1]}"))
    for hk in ((5, 5), (6, 3), (3, 1)):
        cases.append(pytest.param(4, "hybrid", (2, hk), id=f"P4-hybrid-U2-H{hk[0]}kv{hk[1]}"))
    return [*cases, pytest.param(8, "eight", None, id="P8-H28kv4-hybrid-U4-H14kv2")]


def _worker(rank, world_size, kind, case):
    if kind == "flat":
        _flat(rank, world_size, case)
    elif kind == "masks":
        _masks(rank, world_size, case)
    elif kind == "hybrid":
        _hybrid(rank, world_size, *case)
    else:
        _eight(rank, world_size)


def _no_exchange(output, input, output_split_sizes, input_split_sizes, group):
    """``all_to_all_single`` that keeps this rank's own block and zeros what the peers would have sent."""
    rank = torch.distributed.get_rank(group)
    output.zero_()
    out_at, in_at = sum(output_split_sizes[:rank]), sum(input_split_sizes[:rank])
    n = output_split_sizes[rank]
    output[out_at : out_at + n].copy_(input[in_at : in_at + n])


def _controls(rank, world_size):
    """Negative controls: the checks fail when the exchange is switched off, and when a rank whose query heads fall
    unevenly on its KV heads (14 / 2 heads at P = 4: rank 1 reads KV heads 0, 0, 0, 1) leaves their pairing to the
    kernel's i // (n/m) instead of copying its KV heads up (Note [uneven heads])."""
    mesh = seqpar.make_mesh()
    real_dist = uneven_all_to_all.dist
    uneven_all_to_all.dist = types.SimpleNamespace(
        get_rank=real_dist.get_rank, get_world_size=real_dist.get_world_size, all_to_all_single=_no_exchange
    )
    try:
        with pytest.raises(AssertionError, match=r" out: "):
            check_case(rank, world_size, mesh, "ulysses", "zigzag", True, 1, 6, 2, 16, 32)
    finally:
        uneven_all_to_all.dist = real_dist
    paired = HeadSplit.local_kv_index
    HeadSplit.local_kv_index = lambda self, r: None
    try:
        with pytest.raises(AssertionError, match=r" out: "):
            check_case(rank, world_size, mesh, "ulysses", "zigzag", False, 1, 14, 2, 16, 32)
    finally:
        HeadSplit.local_kv_index = paired
    check_case(rank, world_size, mesh, "ulysses", "zigzag", False, 1, 14, 2, 16, 32)  # restored: exact again


def test_negative_controls():
    run_ranks(4, _controls)


def _exchange(rank, world_size):
    """The uneven all-to-all on its own: every rank gets its heads of the whole sequence in global order, and the
    way back is the adjoint, summing a head that went to several ranks (Note [uneven all-to-all])."""
    from seqpar.sequence_parallel.comm import head_to_seq_ranges, seq_to_head_ranges
    from seqpar.sequence_parallel.layouts.chunks import natural_order_index, owner_order_index

    group = seqpar.make_mesh().sp_group
    for layout, ranges in itertools.product(
        ("zigzag", "contiguous"), (((0, 1), (0, 2), (1, 2)), ((0, 3), (3, 5), (5, 7)))
    ):
        heads, seq = ranges[-1][1], 12 * world_size
        gen = torch.Generator().manual_seed(len(ranges) + heads)
        whole, back = torch.randn(2, heads, seq, 4, generator=gen), torch.randn(2, heads, seq, 4, generator=gen)
        idx = shard_index(layout, world_size, rank, seq)
        orders = (natural_order_index(layout, world_size), owner_order_index(layout, world_size))
        start, stop = ranges[rank]
        got = seq_to_head_ranges(whole[:, :, idx].transpose(1, 2).contiguous().transpose(1, 2), group, *orders, ranges)
        torch.testing.assert_close(got, whole[:, start:stop], rtol=0, atol=0)  # a copy: bit-exact
        # what rank r sends back for heads [a_r, b_r) sums, per head, over the ranks that hold it
        returned = head_to_seq_ranges(back[:, start:stop] * (rank + 1), group, *orders, ranges, heads)
        weight = torch.tensor([sum(r + 1 for r, (a, b) in enumerate(ranges) if a <= h < b) for h in range(heads)])
        want = back[:, :, idx] * weight.view(1, -1, 1, 1).float()
        torch.testing.assert_close(returned, want, atol=1e-6, rtol=1e-6, msg=lambda m, w=(layout, ranges): f"{w}: {m}")


def test_uneven_exchange_and_its_adjoint():
    run_ranks(3, _exchange)


def test_head_split_ranges_and_costs():
    """The split itself, worked out by hand: ceil shares first, each rank's KV heads, the busiest rank's bytes."""
    split = head_split(28, 4, 8)
    assert split.q_ranges == ((0, 4), (4, 8), (8, 12), (12, 16), (16, 19), (19, 22), (22, 25), (25, 28))
    # 7 query heads per KV head: rank 1 (heads 4..7) reads KV 0 and 1, rank 4 (16..18) KV 2 only
    assert split.kv_ranges == ((0, 1), (0, 2), (1, 2), (1, 3), (2, 3), (2, 4), (3, 4), (3, 4))
    assert split.local_kv_index(1) == (0, 0, 0, 1) and split.local_kv_index(0) is None
    assert split.max_heads == 4 and split.imbalance == pytest.approx(4 * 8 / 28) and split.wire_kv_heads == 11
    # rank 3 (4 query heads, 2 KV heads): 2 (28 - 4) + 2 * 7 * 4 + 2 (11 - 2) + 2 * 7 * 2 heads over 4 tensors
    assert split.sent_heads() == pytest.approx((2 * 24 + 56 + 2 * 9 + 28) / 4)
    even = head_split(8, 2, 4)
    assert even.even and even.sent_heads() == pytest.approx(3 / 4 * (8 + 4))  # KV heads copied up to 4
    assert head_split(3, 3, 4) is None
    # auto: Ulysses where the slowest rank attends at most 1.25x the mean heads, else ring
    for heads, kv, p, want in ((28, 4, 8, "ulysses"), (14, 2, 4, "ulysses"), (5, 5, 3, "ulysses"), (6, 6, 4, "ring")):
        assert select_strategy("auto", heads, kv, p) == want, (heads, p)
        assert (math.ceil(heads / p) * p / heads <= 1.25) == (want == "ulysses")
    assert select_strategy("auto", 6, 3, 8, 4) == "ring"  # 6 heads over ulysses 4: 1.33x; 8 > 6 heads
    assert select_strategy("auto", 14, 2, 8, 4) == "hybrid"


def _qwen2_14_heads():
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=56,  # head_dim 4
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").train()


def _qwen2_training(rank, world_size):
    """Three AdamW steps at sp 4 under ulysses (14 heads: 4, 4, 3, 3 per rank) equal one process: the loss at every
    step, logits and every parameter's gradient at the first; after them every parameter entry within
    ``FLOOR_FACTOR`` times its rounding floor of a float64 run's (Note [AdamW floors]: the gradients' rounding
    measured from one process and one whose attention sums otherwise, SDPA). Returns the least margin (bound /
    distance) of seqpar's entries."""
    mesh = seqpar.make_mesh()
    ref = _qwen2_14_heads()
    model = seqpar.prepare_model(copy.deepcopy(ref), mesh, strategy="ulysses").train()
    twin, exact = copy.deepcopy(ref), copy.deepcopy(ref).double()
    twin.set_attn_implementation("sdpa")

    def adamw(params):
        return torch.optim.AdamW(params, lr=3e-3, eps=1e-6)

    floors = StepFloors(exact, adamw)
    opts = [adamw(m.parameters()) for m in (ref, twin, exact, model)]
    idx = shard_index("zigzag", world_size, rank, SEQ)
    for step in range(3):
        ids = tokens(2, SEQ, 20 + step)
        want = ref(input_ids=ids, labels=ids)
        want.loss.backward()
        for other in (twin, exact):
            other(input_ids=ids, labels=ids).loss.backward()
        shard = seqpar.shard_batch({"input_ids": ids}, mesh)
        logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
        loss = seqpar.cross_entropy(logits, shard["shift_labels"], mesh)
        loss.backward()
        seqpar.reduce_gradients(model.parameters(), mesh)
        what = f"step {step} P={world_size}"
        total = seqpar.sum_over(loss.detach(), mesh)
        torch.testing.assert_close(total, want.loss.detach(), atol=1e-6, rtol=1e-5, msg=lambda m, w=what: f"{w}: {m}")
        if step == 0:  # from the same parameters: after a step they differ by the steps' rounding (the floors)
            torch.testing.assert_close(
                logits, want.logits[:, idx], atol=2e-5, rtol=1e-4, msg=lambda m, w=what: f"{w}: {m}"
            )
            for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                message = f"{what} {name}"
                torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-4, msg=lambda m, w=message: f"{w}: {m}")
        floors.record(exact, (ref, twin))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert seqpar.last_attention_choice(model).strategy == "ulysses"
    return assert_near_float64(model.named_parameters(), exact, floors.floors(), "after 3 AdamW steps")


def test_qwen2_with_14_heads_trains_under_ulysses_at_sp_4():
    run_ranks(4, _qwen2_training)


@pytest.mark.parametrize(("world_size", "kind", "case"), _cases())
def test_uneven_heads_match_single_device(world_size, kind, case):
    # P = 8 on fresh ranks: a pool of 8 would evict the session's pools of 1-4 ranks (tests/_dist.MAX_POOLED_RANKS),
    # which the next tests would spawn again
    run_ranks(world_size, _worker, kind, case, fresh=world_size == 8)
