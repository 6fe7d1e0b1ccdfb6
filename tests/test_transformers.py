"""Hugging Face models (tiny Llama, Qwen2, Mistral with a sliding window, and more, from configs) under seqpar.

Sharded logits and loss equal the unsharded model's; 5 AdamW steps (with gradient accumulation and clipping)
equal one process, the parameters within their rounding floors of a float64 run's (and SGD steps on placed rows:
tests/_placed_cases.py); packed documents stay apart; bad input raises on every rank.
"""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
import transformers
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, distribute_tensor

import seqpar
from seqpar.errors import SeqparInputError
from tests._dist import run_ranks, shard_index
from tests._floors import StepFloors, assert_near_float64, gradients
from tests._models import SEQ, VOCAB, build, tiny_config, tokens
from tests._placed_cases import check_placed_training
from tests._router_cases import check_router_loss

ATOL, RTOL = 2e-5, 1e-4


def strategies_for(world_size: int) -> list[str]:
    return ["ring", "allgather", "auto"] + (["ulysses"] if 4 % world_size == 0 else [])


AUTO_AT = {1: "local", 2: "ulysses", 3: "ring", 4: "ulysses"}


def _logits_and_loss(rank, world_size, mesh):
    hybrid = [("hybrid", seqpar.make_mesh(ulysses_size=2))] if world_size == 4 else []
    runs = [(s, mesh) for s in strategies_for(world_size)] + hybrid
    ids = tokens(2, SEQ, 1)
    for kind in ("llama", "qwen2", "mistral"):
        ref = build(kind)  # one build and one run of each model, shared by the strategies
        with torch.no_grad():
            want = ref(input_ids=ids, labels=ids)
        for strategy, run_mesh in runs:
            model = seqpar.prepare_model(copy.deepcopy(ref), run_mesh, strategy=strategy)
            assert seqpar.last_attention_choice(model) is None, "nothing has run yet"
            with torch.no_grad():
                shard = seqpar.shard_batch({"input_ids": ids}, run_mesh)
                logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
                loss = seqpar.sum_over(seqpar.cross_entropy(logits, shard["shift_labels"], run_mesh), run_mesh)
            idx = shard_index("zigzag", world_size, rank, SEQ)
            what = f"{kind} {strategy} P={world_size}"
            torch.testing.assert_close(
                logits, want.logits[:, idx], atol=ATOL, rtol=RTOL, msg=lambda m, w=what: f"{w}: {m}"
            )
            torch.testing.assert_close(loss, want.loss, atol=ATOL, rtol=RTOL, msg=lambda m, w=what: f"{w} loss: {m}")
            # what ran: "auto" with 4 query / 2 KV heads is ulysses where 4 heads split (P = 2, 4), else ring; but
            # mistral's window of 7 at P = 2 leaves a ring rank 6 of its 24 tokens to send, a quarter of ulysses'
            # bytes, so the mask-aware ring runs (Note [auto strategy])
            auto = "ring" if (kind, world_size) == ("mistral", 2) else AUTO_AT[world_size]
            ran = seqpar.last_attention_choice(model)
            assert ran.strategy == (auto if strategy == "auto" else strategy), (what, ran)
            assert ran.kernel.name == "torch_cpu_flash", (what, ran)
            if kind == "llama" and strategy == "ring":
                # the decoder alone (hidden states) and the loss made in pieces give the same loss and gradients
                logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
                seqpar.cross_entropy(logits, shard["shift_labels"], run_mesh).backward()
                grads = [p.grad.clone() for p in model.parameters()]
                model.zero_grad()
                hidden = model.get_decoder()(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
                chunked = seqpar.lm_head_cross_entropy(
                    hidden.last_hidden_state, model.lm_head, shard["shift_labels"], run_mesh, chunk_size=7
                )
                chunked.backward()
                torch.testing.assert_close(seqpar.sum_over(chunked, run_mesh), want.loss, atol=ATOL, rtol=RTOL)
                for g, p in zip(grads, model.parameters()):
                    torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=1e-5)
                # a DTensor head (tensor parallel or FSDP2 around it) is refused, not multiplied as a plain tensor
                sharded = copy.deepcopy(model.lm_head)
                replicated = distribute_tensor(
                    sharded.weight.detach(), DeviceMesh("cpu", list(range(world_size))), [Replicate()]
                )
                sharded.weight = torch.nn.Parameter(replicated)
                with pytest.raises(SeqparInputError, match="not a DTensor"):
                    seqpar.lm_head_cross_entropy(hidden.last_hidden_state, sharded, shard["shift_labels"], run_mesh)


def _packing(rank, world_size, mesh):
    lengths = (13, 21, 14)  # edges at 13 and 34: inside shards and chunks at every P
    starts = [0, 13, 34]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    ids = tokens(1, SEQ, 2)
    changed = ids.clone()
    changed[:, :13] = tokens(1, 13, 3)  # document A only
    idx = shard_index("zigzag", world_size, rank, SEQ)
    hybrid = [("hybrid", seqpar.make_mesh(ulysses_size=2))] if world_size == 4 else []
    runs = [(s, mesh) for s in strategies_for(world_size)] + hybrid
    for kind in ("llama", "mistral"):
        ref = build(kind)  # one build and one run of each model, shared by the strategies
        with torch.no_grad():
            alone = torch.cat(
                [ref(input_ids=ids[:, s : s + n]).logits for s, n in zip(starts, lengths)], dim=1
            )  # [1, SEQ, V]: each document run by itself
        for strategy, run_mesh in runs:
            model = seqpar.prepare_model(copy.deepcopy(ref), run_mesh, strategy=strategy)
            with torch.no_grad():
                outs = []
                for row in (ids, changed):
                    shard = seqpar.shard_batch({"input_ids": row, "position_ids": positions}, run_mesh)
                    outs.append(model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits)
            what = f"packing {kind} {strategy} P={world_size}"
            torch.testing.assert_close(outs[0], alone[:, idx], atol=ATOL, rtol=RTOL, msg=lambda m, w=what: f"{w}: {m}")
            not_a = idx >= 13
            assert not_a.any() and torch.equal(outs[0][:, not_a], outs[1][:, not_a]), what
            if (~not_a).any():
                assert not torch.allclose(outs[0][:, ~not_a], outs[1][:, ~not_a]), f"{what}: doc A did not change"


def _adamw(params) -> torch.optim.AdamW:
    # eps 1e-6: Adam divides by sqrt(v) + eps, which amplifies float rounding of near-zero gradients
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, eps=1e-6)


def _train(model, micro_batches, mesh, steps, accumulation, sharded, grads=None):
    """AdamW steps; returns per-step losses and gradient norms (pre-clip). ``grads``: a list that gets each step's
    gradients (summed, clipped) as the optimizer takes them."""
    opt = _adamw(model.parameters())
    losses, norms = [], []
    for step in range(steps):
        group = micro_batches[step * accumulation : (step + 1) * accumulation]
        if sharded:
            shards = [seqpar.shard_batch(b, mesh) for b in group]
            total = seqpar.count_valid_tokens([s["shift_labels"] for s in shards], mesh)
        else:
            total = sum(int((b["input_ids"][:, 1:] >= 0).sum()) for b in group)
        step_loss = torch.zeros(())
        for b, shard in zip(group, shards if sharded else group):
            if sharded:
                logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
                loss = seqpar.cross_entropy(logits, shard["shift_labels"], num_valid_tokens=total)
            else:
                logits = model(input_ids=b["input_ids"]).logits[:, :-1]
                labels = b["input_ids"][:, 1:]
                loss = (
                    torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / total
                )
            loss.backward()
            step_loss += loss.detach()
        if sharded:
            seqpar.reduce_gradients(model.parameters(), mesh)
            step_loss = seqpar.sum_over(step_loss, mesh)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5))
        losses.append(step_loss)
        if grads is not None:
            grads.append(gradients(model))
        opt.step()
        opt.zero_grad()
    return torch.stack(losses), torch.stack(norms)


def _training(rank, world_size, mesh):
    """5 AdamW steps with clipping, without and with gradient accumulation: every step's loss and gradient norm
    equal one process's, and after them every parameter entry is within ``FLOOR_FACTOR`` times its rounding floor
    of a float64 run's (Note [AdamW floors]: the gradients' rounding measured from one process and one whose
    attention sums otherwise, SDPA). Returns the least margin (bound / distance) of seqpar's entries."""
    steps, margin = 5, math.inf
    for accumulation in (1, 2):
        batches = [{"input_ids": tokens(2, SEQ, 10 + i)} for i in range(steps * accumulation)]
        ref = build("llama").train()
        model = seqpar.prepare_model(copy.deepcopy(ref), mesh, strategy="ring").train()
        twin, exact = copy.deepcopy(ref), copy.deepcopy(ref).double()
        twin.set_attn_implementation("sdpa")
        floors = StepFloors(exact, _adamw)
        runs = {"ref": [], "twin": [], "exact": []}
        want_losses, want_norms = _train(ref, batches, mesh, steps, accumulation, False, runs["ref"])
        _train(twin, batches, mesh, steps, accumulation, False, runs["twin"])
        _train(exact, batches, mesh, steps, accumulation, False, runs["exact"])
        for exact_grads, *fp32 in zip(runs["exact"], runs["ref"], runs["twin"], strict=True):
            floors.record(exact_grads, fp32)
        losses, norms = _train(model, batches, mesh, steps, accumulation, sharded=True)
        assert (want_norms > 0.5).all(), "clipping must be active for this test to mean anything"
        torch.testing.assert_close(losses, want_losses, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(norms, want_norms, atol=1e-5, rtol=1e-5)
        what = f"accum {accumulation} after {steps} AdamW steps"
        margin = min(margin, assert_near_float64(model.named_parameters(), exact, floors.floors(), what))
    return margin


def _bad_input(rank, world_size, mesh):
    model = seqpar.prepare_model(build("llama"), mesh)
    assert seqpar.prepare_model(model, mesh, strategy="ring") is model  # idempotent
    ids = tokens(1, SEQ, 4)
    shard = seqpar.shard_batch({"input_ids": ids}, mesh)
    with pytest.raises(SeqparInputError, match="needs position_ids"):
        model(input_ids=shard["input_ids"])
    # a mistake on one rank only raises on every rank (the other rank would otherwise wait in a collective)
    with pytest.raises(SeqparInputError, match="rank 1: a seqpar-prepared model needs position_ids"):
        model(input_ids=shard["input_ids"], position_ids=None if rank == 1 else shard["position_ids"])
    with pytest.raises(SeqparInputError, match="position_ids shapes differ across ranks"):
        cut = 2 if rank == 0 else shard["position_ids"].shape[1]
        model(input_ids=shard["input_ids"][:, :cut], position_ids=shard["position_ids"][:, :cut])
    with pytest.raises(SeqparInputError, match="do not pass labels"):
        model(input_ids=shard["input_ids"], position_ids=shard["position_ids"], labels=shard["input_ids"])
    with pytest.raises(SeqparInputError, match="labels look shifted already"):
        seqpar.shard_batch({"input_ids": ids, "labels": torch.roll(ids, -1, dims=1)}, mesh)
    with pytest.raises(SeqparInputError, match="max_position_embeddings"):
        long_ids = tokens(1, 64 + 2 * world_size, 5)
        long = seqpar.shard_batch({"input_ids": long_ids}, mesh)
        model(input_ids=long["input_ids"], position_ids=long["position_ids"])
    with pytest.raises(SeqparInputError, match="count up by 1"):
        bad = shard["position_ids"].clone()
        if rank == 0:
            bad[0, 1] = 5  # one rank's ids are broken: every rank raises
        model(input_ids=shard["input_ids"], position_ids=bad)
    with_dropout = transformers.Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        attention_dropout=0.1,  # soft-capped logits are served; attention dropout is not
    )
    with pytest.raises(SeqparInputError, match=r"its attention_dropout is 0\.1"):
        seqpar.prepare_model(transformers.AutoModelForCausalLM.from_config(with_dropout), mesh)
    jitter = tiny_config("mixtral")
    jitter.router_jitter_noise = 0.1  # noise each rank would draw for its own shard only
    with pytest.raises(SeqparInputError, match=r"its router_jitter_noise is 0\.1"):
        seqpar.prepare_model(transformers.AutoModelForCausalLM.from_config(jitter), mesh)
    _balanced_calls(rank, world_size, mesh, ids)
    # the group still works after every error
    out = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
    assert out.shape == (1, SEQ // world_size, VOCAB)


def _balanced_calls(rank, world_size, mesh, ids):
    """A model prepared with layout="balanced" takes each batch's layout as seqpar_layout=; without it (on any
    rank), or with the ranks' layouts different, every rank raises; with it, each packed document is kept apart."""
    ref = build("llama")
    model = seqpar.prepare_model(copy.deepcopy(ref), mesh, layout="balanced")
    lengths = (29, 5, 14)  # uneven documents: zigzag leaves rank 0 about 35% more visible area than the mean
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    shard = seqpar.shard_batch({"input_ids": ids, "position_ids": positions}, mesh, layout="balanced")
    assert shard.layout.chunk_ids != ((0, 3), (1, 2)), shard.layout  # not zigzag's chunks
    call = {"input_ids": shard["input_ids"], "position_ids": shard["position_ids"]}
    with pytest.raises(SeqparInputError, match="every rank: a model prepared with layout='balanced' needs"):
        model(**call)
    with pytest.raises(SeqparInputError, match="rank 1: a model prepared with layout='balanced' needs"):
        model(**call, **({} if rank == 1 else {"seqpar_layout": shard.layout}))
    with pytest.raises(SeqparInputError, match="the ranks passed different seqpar_layout values"):
        model(**call, seqpar_layout=shard.layout if rank == 0 else "zigzag")
    with torch.no_grad():
        got = model(**call, seqpar_layout=shard.layout).logits
        starts = [0, *itertools.accumulate(lengths)][:-1]
        alone = torch.cat([ref(input_ids=ids[:, s : s + n]).logits for s, n in zip(starts, lengths)], dim=1)
    idx = shard_index(shard.layout, world_size, rank, SEQ)
    torch.testing.assert_close(got, alone[:, idx], atol=ATOL, rtol=RTOL)


def _more_models(rank, world_size, mesh):
    """More architectures at sp 2: the logits of every strategy equal the unsharded model's."""
    idx = shard_index("zigzag", world_size, rank, SEQ)
    for kind, strategy in itertools.product(("qwen3", "gemma3", "phi3", "olmo2"), ("ring", "ulysses", "allgather")):
        ref = build(kind)
        model = seqpar.prepare_model(copy.deepcopy(ref), mesh, strategy=strategy)
        ids = tokens(2, SEQ, 5)
        with torch.no_grad():
            want = ref(input_ids=ids).logits
            shard = seqpar.shard_batch({"input_ids": ids}, mesh)
            got = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
        torch.testing.assert_close(
            got, want[:, idx], atol=ATOL, rtol=RTOL, msg=lambda m, w=(kind, strategy): f"{w}: {m}"
        )


def _mla(rank, world_size, mesh):
    """MLA attention (values of another head size than queries and keys: Note [value head size]) in DeepSeek-V2,
    DeepSeek-V3 (experts after a dense first layer) and MiniCPM3, packed documents: logits, loss and every
    parameter's summed gradient equal one process running each document alone."""
    idx = shard_index("zigzag", world_size, rank, SEQ)
    ids = tokens(1, SEQ, 7)
    lengths = (17, 9, SEQ - 26)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    for kind in ("deepseek_v2", "deepseek_v3", "minicpm3"):
        ref = build(kind)
        pieces, start, logits_alone = [], 0, []
        for n in lengths:  # each document alone: the one-process reference of packed rows
            out = ref(input_ids=ids[:, start : start + n], labels=ids[:, start : start + n])
            (out.loss * (n - 1) / (SEQ - len(lengths))).backward()
            pieces.append(out.loss.detach() * (n - 1))
            logits_alone.append(out.logits.detach())
            start += n
        want_loss, want_logits = sum(pieces) / (SEQ - len(lengths)), torch.cat(logits_alone, 1)
        for strategy in ("ring", "allgather") + (("ulysses",) if world_size == 2 else ()):
            model = seqpar.prepare_model(copy.deepcopy(ref), mesh, strategy=strategy)
            model.zero_grad()
            shard = seqpar.shard_batch({"input_ids": ids, "position_ids": positions}, mesh)
            logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
            loss = seqpar.cross_entropy(logits, shard["shift_labels"], mesh)
            loss.backward()
            seqpar.reduce_gradients(model.parameters(), mesh)
            what = f"{kind} {strategy} P={world_size}"
            torch.testing.assert_close(
                logits, want_logits[:, idx], atol=ATOL, rtol=RTOL, msg=lambda m, w=what: f"{w}: {m}"
            )
            torch.testing.assert_close(seqpar.sum_over(loss.detach(), mesh), want_loss, atol=ATOL, rtol=RTOL)
            for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                want = q.grad if q.grad is not None else torch.zeros_like(q)
                got = p.grad if p.grad is not None else torch.zeros_like(p)
                torch.testing.assert_close(
                    got, want, atol=1e-5, rtol=1e-4, msg=lambda m, n=name, w=what: f"{w} {n}: {m}"
                )


def _sinks_and_softcap(rank, world_size, mesh):
    """gpt-oss (a learned sink per head) and Gemma 2 (soft-capped logits), 4 layers with sliding and full layers
    alternating: logits, loss and every parameter's summed gradient (the sinks' too) equal the one-process model's."""
    idx = shard_index("zigzag", world_size, rank, SEQ)
    ids = tokens(2, SEQ, 6)
    for kind in ("gpt_oss", "gemma2"):
        ref = build(kind)
        want = ref(input_ids=ids, labels=ids)
        want.loss.backward()
        sinks = [p.grad for n, p in ref.named_parameters() if n.endswith("sinks")]
        assert len(sinks) == (4 if kind == "gpt_oss" else 0) and all(g.abs().max() > 1e-4 for g in sinks), kind
        for strategy in ("ring", "allgather") + (("ulysses",) if world_size == 2 else ()):
            model = seqpar.prepare_model(copy.deepcopy(ref), mesh, strategy=strategy)
            model.zero_grad()
            shard = seqpar.shard_batch({"input_ids": ids}, mesh)
            logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
            loss = seqpar.cross_entropy(logits, shard["shift_labels"], mesh)
            loss.backward()
            seqpar.reduce_gradients(model.parameters(), mesh)
            what = f"{kind} {strategy} P={world_size}"
            assert seqpar.last_attention_choice(model).kernel.name == (
                "reference" if kind == "gemma2" else "torch_cpu_flash"
            )
            torch.testing.assert_close(
                logits, want.logits[:, idx], atol=ATOL, rtol=RTOL, msg=lambda m, w=what: f"{w}: {m}"
            )
            torch.testing.assert_close(seqpar.sum_over(loss.detach(), mesh), want.loss, atol=ATOL, rtol=RTOL)
            for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                torch.testing.assert_close(
                    p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=name, w=what: f"{w} {n}: {m}"
                )


_PARTS = {
    "logits-and-loss": _logits_and_loss,
    "packing": _packing,
    "router-loss": check_router_loss,
    "sinks-and-softcap": _sinks_and_softcap,
    "mla": _mla,
    "placed-training": check_placed_training,  # the own loop under the placed layout
    "more-models": _more_models,
    "training": _training,
    "bad-input": _bad_input,
}
_WORLDS = {"router-loss": (2, 3), "sinks-and-softcap": (2, 3), "placed-training": (2, 3), "mla": (2, 3)}
_WORLDS.update({part: (2,) for part in ("more-models", "training", "bad-input")})


def _worker(rank, world_size, part):
    _PARTS[part](rank, world_size, seqpar.make_mesh())


@pytest.mark.parametrize(
    ("world_size", "part"),
    [pytest.param(w, p, id=f"P{w}-{p}") for w in (2, 3, 4) for p in _PARTS if w in _WORLDS.get(p, (2, 3, 4))],
)
def test_transformers_models_under_seqpar(world_size, part):
    run_ranks(world_size, _worker, part, fresh=part == "bad-input")  # bad input across ranks: fresh ranks
