"""Vision-language models (tiny, from configs: ``tests._vlm_models.FAMILIES``) on whole rows under seqpar.

Logits of real tokens, the loss and every parameter's gradient (the vision tower's included) equal one process
at P = 2 (ring, ulysses), 3 (ring) and, for a family of each way the vision work meets the ranks (``AT_FOUR``), 4
(allgather); switching the gradient sum off fails the check; bad input raises on every rank (Note [whole-row
calls]).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist

import seqpar
from seqpar.errors import SeqparInputError
from seqpar.sequence_parallel.whole_rows import padded_row_length
from tests._dist import run_ranks, shard_index
from tests._floors import StepFloors, assert_near_float64
from tests._vlm_models import FAMILIES, IMAGE, build, documents, pack, sample

LOGITS_ATOL, LOSS_ATOL = 2e-5, 2e-5
GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-8  # of each tensor's largest entry, plus an absolute floor


def _reference(family: str) -> tuple[torch.nn.Module, dict, torch.Tensor, torch.Tensor]:
    ref = build(family)
    batch = sample(family)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    out = ref(**batch, labels=labels)
    out.loss.backward()
    return ref, batch, out.logits.detach(), out.loss.detach()


def _sharded_step(model, batch, mesh, layout):
    shard = seqpar.shard_batch(
        {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}, mesh, layout=layout
    )
    logits = model(**batch, seqpar_layout=shard.layout).logits
    loss = seqpar.cross_entropy(logits, shard["shift_labels"], mesh)
    loss.backward()
    return shard, logits.detach(), seqpar.sum_over(loss.detach(), mesh)


def _summed_gradients(model, mesh) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, group=seqpar.as_sp_mesh(mesh).sp_group) if mesh is not None else None
        grads[name] = g
    return grads


def _assert_gradients(found: dict, ref: torch.nn.Module, what: str) -> None:
    for name, p in ref.named_parameters():
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        atol = GRAD_RTOL * float(want.abs().max()) + GRAD_ATOL
        torch.testing.assert_close(found[name], want, rtol=0, atol=atol, msg=lambda m, n=name: f"{what} {n}: {m}")


def _exact(rank, world_size, family, strategy, layout):
    mesh = seqpar.make_mesh()
    ref, batch, want_logits, want_loss = _reference(family)
    model = seqpar.prepare_model(copy.deepcopy(build(family)), mesh, strategy=strategy)
    shard, logits, loss = _sharded_step(model, batch, mesh, layout)
    what = f"{family} {strategy} {layout} P={world_size}"
    s = batch["input_ids"].shape[1]
    idx = shard_index(shard.layout, world_size, rank, padded_row_length(s, world_size, shard.layout))
    real = idx < s
    keep = batch["attention_mask"][:, idx.clamp(max=s - 1)].bool() & real
    got, want = logits[keep], want_logits[:, idx.clamp(max=s - 1)][keep]
    torch.testing.assert_close(got, want, atol=LOGITS_ATOL, rtol=0, msg=lambda m: f"{what} logits: {m}")
    torch.testing.assert_close(loss, want_loss, atol=LOSS_ATOL, rtol=0, msg=lambda m, w=what: f"{w} loss: {m}")
    _assert_gradients(_summed_gradients(model, mesh), ref, what)


AT_FOUR = ("gemma3", "internvl", "qwen3_5", "llava")
"""The families at P = 4 (all-gather), one of each way the vision work meets 4 ranks: Gemma 3 (one image a rank, its
image blocks attending both ways under all-gather), InternVL (split down to one tile on most ranks), Qwen3.5 (mRoPE
positions, a video, gated DeltaNet layers; 3 image and 2 video units, fewer than the ranks: encoded whole on every
rank) and LLaVA (3 images: the same for plain positions). Every family runs at P = 2 (ring, Ulysses) and 3 (ring):
their own positions, placeholders and towers do not change with P, and the split and whole encodings of each
family's units are theirs at P = 2 and 3 (Qwen's videos whole at 3)."""
CASES = [
    (2, "ring", "zigzag", FAMILIES),
    (2, "ulysses", "contiguous", FAMILIES),
    (3, "ring", "zigzag", FAMILIES),
    (4, "allgather", "zigzag", AT_FOUR),
]


def _worker(rank, world_size, strategy, layout, families):
    for family in families:
        _exact(rank, world_size, family, strategy, layout)


@pytest.mark.parametrize(
    ("world_size", "strategy", "layout", "families"), CASES, ids=[f"P{w}-{s}-{lay}" for w, s, lay, _ in CASES]
)
def test_vlm_whole_rows_equal_one_process(world_size, strategy, layout, families):
    run_ranks(world_size, _worker, strategy, layout, families)


def _controls(rank, world_size):
    """Negative controls: the checks above fail without the gradient sum and without Gemma 3's image blocks."""
    mesh = seqpar.make_mesh()
    ref, batch, want_logits, _ = _reference("qwen2_5_vl")
    model = seqpar.prepare_model(copy.deepcopy(build("qwen2_5_vl")), mesh, strategy="ring")
    assert model.model.visual.config._attn_implementation == "eager"  # the vision tower keeps its own attention
    _sharded_step(model, batch, mesh, "zigzag")
    unsummed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with pytest.raises(AssertionError):
        _assert_gradients({n: unsummed.get(n, torch.zeros_like(p)) for n, p in model.named_parameters()}, ref, "")
    _, batch, want_logits, _ = _reference("gemma3")
    model = seqpar.prepare_model(build("gemma3"), mesh, strategy="ring")
    without_blocks = {k: v for k, v in batch.items() if k != "token_type_ids"}
    shard, logits, _ = _sharded_step(model, without_blocks, mesh, "zigzag")
    s = batch["input_ids"].shape[1]
    idx = shard_index(shard.layout, world_size, rank, s + (-s % (2 * world_size)))
    real = idx < s
    with pytest.raises(AssertionError):
        torch.testing.assert_close(logits[:, real], want_logits[:, idx[real]], atol=LOGITS_ATOL, rtol=0)


def _float64(batch: dict) -> dict:
    return {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}


def _training(rank, world_size):
    """5 AdamW steps on whole rows (fresh samples each step): every parameter entry within ``FLOOR_FACTOR`` times
    its rounding floor of the float64 model's after the same steps (Note [AdamW floors]). The gradients' rounding is
    measured per tensor and step from one process and a second one that differs only in its attention's summation
    order (transformers' SDPA instead of eager), then carried through the replayed steps: Adam turns the rounding of
    a near-zero gradient into a step (a key bias, which softmax ignores: its exact gradient is zero), and a bound
    from two fp32 runs' distance measured the order, not seqpar (issue 57: Gemma 3's vision layer_norm1.bias off
    by 1.36e-5 on another CPU, bound 4.2e-6). Returns the least margin (bound / distance) of seqpar's entries."""
    mesh = seqpar.make_mesh()
    margin = math.inf
    for family in ("qwen2_5_vl", "gemma3"):
        ref = build(family).train()
        model = seqpar.prepare_model(copy.deepcopy(ref), mesh, strategy="ring")
        twin, exact = copy.deepcopy(ref), copy.deepcopy(ref).double()
        twin.set_attn_implementation("sdpa")

        def adamw(params):  # eps 1e-6 as in tests/test_transformers.py
            return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, eps=1e-6)

        floors = StepFloors(exact, adamw)
        opts = [adamw(m.parameters()) for m in (ref, twin, exact, model)]
        for step in range(5):
            batch = sample(family, seed=step)
            labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
            for one in (ref, twin):
                one(**batch, labels=labels).loss.backward()
            exact(**_float64(batch), labels=labels).loss.backward()
            _sharded_step(model, batch, mesh, "zigzag")
            seqpar.reduce_gradients(model.parameters(), mesh)
            floors.record(exact, (ref, twin))
            for opt in opts:
                opt.step()
                opt.zero_grad()
        found = assert_near_float64(model.named_parameters(), exact, floors.floors(), f"{family} after 5 AdamW steps")
        margin = min(margin, found)
    return margin


PACKED = ("qwen2_5_vl", "gemma3", "llava")


def _packed(rank, world_size):
    """Rows packing several multimodal documents (images of different sizes, a timed video) equal each document
    run alone in one process: logits, the loss over all documents, every gradient; LLaVA with its vision tower
    frozen; zigzag at P = 2, the balanced layout at P = 3, the placed layout (rows reordered, Gemma 3's image blocks
    moved with their documents) at both. Packed rows in plain [3, B, S] mRoPE positions and an image split by a
    document start are refused."""
    mesh = seqpar.make_mesh()
    for layout in ("zigzag" if world_size == 2 else "balanced", "placed"):
        moved = [_packed_family(rank, world_size, mesh, family, layout) for family in PACKED]
        if layout == "placed" and world_size == 3:  # at P = 3 it moves Gemma 3's documents, image blocks and all
            assert moved == [False, True, False], moved
    _packed_refusals(mesh)


def _packed_family(rank, world_size, mesh, family, layout):
    ref = build(family)
    if family == "llava":
        ref.model.vision_tower.requires_grad_(False)
    model = seqpar.prepare_model(copy.deepcopy(ref), mesh, strategy="ring")
    docs = documents(family, 0) + documents(family, 1)
    # two rows of documents (Gemma 3's images then sit at other tokens in each row: per-row blocks); Gemma 3 placed
    # packs one row, which the placement reorders, moving its image blocks with their documents
    rows = [docs] if family == "gemma3" and layout == "placed" else [docs[:3], docs[3:]]
    # the balanced layout cuts a row into more chunks when its length allows: 8 a rank here
    batch = pack(ref, rows, multiple=8 * world_size if layout == "balanced" else 1)
    predicted = sum(d["input_ids"].shape[1] - 1 for d in docs)
    want = torch.zeros(*batch["input_ids"].shape, ref.config.get_text_config().vocab_size)
    want_loss = torch.zeros(())
    for b, row in enumerate(rows):
        start = 0
        for doc in row:
            out = ref(**doc, labels=doc["input_ids"])
            share = out.loss * (doc["input_ids"].shape[1] - 1) / predicted
            share.backward()
            want_loss += share.detach()
            want[b, start : start + doc["input_ids"].shape[1]] = out.logits[0].detach()
            start += doc["input_ids"].shape[1]
    with torch.no_grad():  # one process on the packed rows lets documents see each other: the test can tell
        leaky = ref(**batch).logits
    real = batch["attention_mask"].bool()
    assert (leaky[real] - want[real]).abs().max() > 1e-2, f"{family}: packing changed nothing"
    text = batch["position_ids"] if batch["position_ids"].dim() == 2 else batch["position_ids"][0]
    rows_in = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "position_ids": text}
    shard = seqpar.shard_batch(rows_in, mesh, layout=layout)
    if layout == "balanced":  # its chunks follow the documents: not the zigzag's two per rank
        assert shard.layout.chunks_per_rank > 2, shard.layout
    logits = model(**batch, seqpar_layout=shard.layout, seqpar_placement=shard.placement).logits
    loss = seqpar.cross_entropy(logits, shard["shift_labels"], mesh)
    loss.backward()
    what = f"packed {family} {layout} P={world_size}"
    s = batch["input_ids"].shape[1]
    if shard.placement is not None:  # each placed token's index in the batch's row, -1 for padding
        orig = shard.placement.order[:, shard_index(shard.layout, world_size, rank, shard.placement.seq_len)]
    else:
        idx = shard_index(shard.layout, world_size, rank, padded_row_length(s, world_size, shard.layout))
        orig = torch.where(idx < s, idx, -1).expand(batch["input_ids"].shape[0], -1)
    keep = (orig >= 0) & batch["attention_mask"].gather(1, orig.clamp(min=0)).bool()
    row_of = torch.arange(orig.shape[0])[:, None].expand_as(orig)
    got, wanted = logits[keep], want[row_of[keep], orig[keep]]
    torch.testing.assert_close(got, wanted, atol=LOGITS_ATOL, rtol=0, msg=lambda m, w=what: f"{w} logits: {m}")
    loss = seqpar.sum_over(loss.detach(), mesh)
    torch.testing.assert_close(loss, want_loss, atol=LOSS_ATOL, rtol=0, msg=lambda m, w=what: f"{w} loss: {m}")
    _assert_gradients(_summed_gradients(model, mesh), ref, what)
    if family == "llava":
        assert all(p.grad is None for p in model.model.vision_tower.parameters()), "a frozen tower got gradients"
    if shard.placement is None:
        return False
    return any(bool((torch.diff(row[row >= 0]) < 0).any()) for row in shard.placement.order)  # a document moved


def _packed_refusals(mesh):
    qwen = seqpar.prepare_model(build("qwen2_5_vl"), mesh)
    batch = pack(qwen, [documents("qwen2_5_vl")])
    plain = dict(batch, position_ids=batch["position_ids"][1:])
    _raises(r"need transformers' \[4, B, S\] form", lambda: qwen(**plain))
    llava = seqpar.prepare_model(build("llava"), mesh)
    batch = pack(llava, [documents("llava")])
    split = batch["position_ids"].clone()
    first = int((batch["input_ids"][0] == IMAGE).nonzero()[0])
    split[0, first + 3 :] = torch.arange(split.shape[1] - first - 3)  # a document starts inside the first image
    _raises("crosses a document start", lambda: llava(**dict(batch, position_ids=split)))
    broken = batch["position_ids"].clone()
    broken[0, 5] = 9
    _raises("must count up by 1 inside a document", lambda: llava(**dict(batch, position_ids=broken)))
    placed = seqpar.shard_batch(
        {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}, mesh, layout="placed"
    )
    _raises("pass seqpar_placement=shard.placement", lambda: llava(**batch, seqpar_layout=placed.layout))
    other = pack(llava, [documents("llava")[::-1]])  # other document lengths in the row: another placement
    elsewhere = seqpar.shard_batch(
        {"input_ids": other["input_ids"], "position_ids": other["position_ids"]}, mesh, layout="placed"
    )
    call = dict(batch, seqpar_layout=elsewhere.layout, seqpar_placement=elsewhere.placement)
    _raises("not the placement of these rows", lambda: llava(**call))
    # a block of tokens 2..5 kept whole (moved to 6..9) or cut apart by padding in the placed row
    from seqpar.sequence_parallel.layouts.placed import Placement
    from seqpar.sequence_parallel.whole_rows import _placed_blocks

    whole = Placement(torch.tensor([[-1] * 4 + [0, 1, 2, 3, 4, 5]]), torch.zeros(1, 10), placed.layout)
    cut = Placement(torch.tensor([[0, 1, 2, 3, -1, -1, 4, 5, -1, -1]]), torch.zeros(1, 10), placed.layout)
    assert _placed_blocks(((2, 6),), whole) == (((6, 10),), False)
    assert _placed_blocks(((2, 6),), cut)[1]


def _tower_inputs(model, family: str) -> list[int]:
    """Record the leading size (images, crops, tiles, patches) of every input the vision tower gets."""
    seen = []
    from seqpar.models import FAMILIES as REGISTRY

    tower = model.model.get_submodule(REGISTRY[family].vision)

    def record(_, args, kwargs):
        pixels = args[0] if args else next(v for k, v in kwargs.items() if k.startswith(("pixel", "hidden")))
        seen.append(int(pixels.shape[0]))

    tower.register_forward_pre_hook(record, with_kwargs=True)
    return seen


def _vision_split(rank, world_size):
    """Each rank's vision tower encodes a share of the images (together: all of them, once); split off, every
    rank encodes all; without the gradient sum in the gather's backward the tower's gradients are wrong."""
    from seqpar.sequence_parallel import vision_split

    mesh = seqpar.make_mesh()
    for family in ("qwen2_5_vl", "gemma3", "llava_onevision", "idefics3", "internvl"):
        whole = build(family)
        everything = _tower_inputs(whole, family)
        whole(**sample(family))
        for split in (True, False):
            model = seqpar.prepare_model(build(family), mesh, split_vision=split)
            seen = _tower_inputs(model, family)
            _sharded_step(model, sample(family), mesh, "zigzag")
            counts = [None] * world_size
            dist.all_gather_object(counts, sum(seen))
            if split:
                assert sum(counts) == sum(everything) and max(counts) < sum(everything), (family, counts, everything)
            else:
                assert counts == [sum(everything)] * world_size, (family, counts, everything)
    import dataclasses

    from seqpar.models import FAMILIES as REGISTRY
    from seqpar.models import register_family

    declared = REGISTRY["llava"]  # an entry that does not declare per-unit encoding is never split
    register_family(dataclasses.replace(declared, vision_units=False), replace=True)
    try:
        model = seqpar.prepare_model(build("llava"), mesh)
        seen = _tower_inputs(model, "llava")
        _sharded_step(model, sample("llava"), mesh, "zigzag")
        assert seen == [sample("llava")["pixel_values"].shape[0]], seen
    finally:
        register_family(declared, replace=True)
    ref, batch, _, _ = _reference("qwen2_5_vl")
    model = seqpar.prepare_model(copy.deepcopy(build("qwen2_5_vl")), mesh, strategy="ring")
    _sharded_step(model, batch, mesh, "zigzag")
    _assert_gradients(_summed_gradients(model, mesh), ref, "split qwen2_5_vl")

    class NotSummed(vision_split._GatherSummed):
        @staticmethod
        def backward(ctx, grad):
            start = sum(ctx.lengths[: ctx.rank])
            return grad[start : start + ctx.lengths[ctx.rank]], None, None, None

    vision_split._GatherSummed, kept = NotSummed, vision_split._GatherSummed
    try:
        model = seqpar.prepare_model(copy.deepcopy(build("qwen2_5_vl")), mesh, strategy="ring")
        _sharded_step(model, batch, mesh, "zigzag")
        with pytest.raises(AssertionError, match="visual"):
            _assert_gradients(_summed_gradients(model, mesh), ref, "")
    finally:
        vision_split._GatherSummed = kept
    _raises("split_vision must be True or False", lambda: seqpar.prepare_model(build("llava"), mesh, split_vision=1))


def _raises(match: str, call) -> None:
    with pytest.raises(SeqparInputError, match=match):
        call()


def _bad_input(rank, world_size):
    """Each mistake raises one SeqparInputError on every rank, before the vision tower or any attention runs."""
    mesh = seqpar.make_mesh()
    qwen = seqpar.prepare_model(build("qwen2_vl"), mesh)
    batch = sample("qwen2_vl")
    shard = seqpar.shard_batch({"input_ids": batch["input_ids"]}, mesh)
    other = dict(batch, pixel_values=batch["pixel_values"] + rank)  # rank 1 holds another sample's pixels
    _raises("passed other rows than rank 0", lambda: qwen(**other))
    timed = seqpar.prepare_model(build("qwen2_5_vl"), mesh)
    video = sample("qwen2_5_vl")
    late = dict(video, second_per_grid_ts=video["second_per_grid_ts"] * (1 + rank))  # other video timing on rank 1
    _raises("passed other rows than rank 0", lambda: timed(**late))
    drifted = seqpar.prepare_model(build("qwen2_vl"), mesh)
    drifted.config.text_config.rms_norm_eps *= 1 + rank  # rank 1's model built from another config
    _raises("models have different configs", lambda: drifted(**batch))
    sharded = dict(batch, input_ids=shard["input_ids"], attention_mask=None, mm_token_type_ids=None)
    _raises("passed other rows than rank 0", lambda: qwen(**sharded))
    _raises("position_ids must cover the whole row", lambda: qwen(**batch, position_ids=shard["position_ids"]))
    flat = torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"])
    _raises(r"mRoPE from the image grids", lambda: qwen(**batch, position_ids=flat))
    embeds = qwen.get_input_embeddings()(shard["input_ids"])
    _raises("not with inputs_embeds shards", lambda: qwen(inputs_embeds=embeds, position_ids=shard["position_ids"]))
    placeholders = shard["input_ids"].clone()
    placeholders[:, 0] = IMAGE
    _raises("no pixels came", lambda: qwen(input_ids=placeholders, position_ids=shard["position_ids"]))
    labels = {"labels": batch["input_ids"]} if rank == 1 else {}  # one rank's mistake, raised on both
    _raises("do not pass labels", lambda: qwen(**batch, **labels))
    left = dict(batch, attention_mask=batch["attention_mask"].flip(1))
    _raises("padding before real tokens", lambda: qwen(**left))
    placed = seqpar.shard_batch({"input_ids": batch["input_ids"]}, mesh, layout="placed")
    _raises("placed layout reorders the rows", lambda: qwen(**batch, seqpar_layout=placed.layout))
    from tests._models import build as build_text

    text = seqpar.prepare_model(build_text("llama"), mesh)
    types = torch.zeros_like(shard["input_ids"])
    call = dict(input_ids=shard["input_ids"], position_ids=shard["position_ids"], token_type_ids=types)
    _raises("belong to a whole-row call", lambda: text(**call))


_PARTS = {"controls": _controls, "training": _training, "bad-input": _bad_input, "vision-split": _vision_split}


def _part(rank, world_size, part):
    _PARTS[part](rank, world_size)


@pytest.mark.parametrize("part", list(_PARTS))
def test_vlm_controls_training_and_bad_input(part):
    run_ranks(2, _part, part)


@pytest.mark.parametrize("world_size", [2, 3])
def test_vlm_packed_rows_equal_documents_alone(world_size):
    run_ranks(world_size, _packed)
