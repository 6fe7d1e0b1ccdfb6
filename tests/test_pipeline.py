"""Pipeline parallel on the mesh's "pp" axis, alone and with sp, dp (FSDP2) and tp, trains like one process.

Gloo ranks (the session's pools; the 8 ranks forked from the test process where that is safe), every rank
building the model from the same seed: a 4-layer tiny model on packed documents, SGD with gradient clipping and
accumulation (two ``step`` calls per optimizer step, each cut into micro-batches), compared per step (loss and
pre-clipping gradient norm, rel 1e-5) and in its parameters after the steps (rel 1e-4) with one process running the
whole model on the whole batch, each document alone.
Also: the balanced split, and bad input raising the same error on every rank before anything can hang.
World sizes 2, 4 and 8 (pp x sp x dp with FSDP2, pp x tp x sp); at 4 and 8 ranks the one-process reference
is computed once in the test process and handed to the ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import DTensor

import seqpar
from seqpar.errors import SeqparInputError
from seqpar.pipeline_parallel.balance import balanced_split
from seqpar.runtime.spawn import spawn_ranks, start_method_for
from tests._dist import COLLECTIVE_TIMEOUT, run_ranks
from tests._models import SEQ, documents_alone_history, tiny_config, tokens

# 8 packed rows; documents restart their position ids, edges inside shards and micro-batches.
DOCUMENTS = [(13, 21, 14), (30, 18), (48,), (7, 7, 34), (20, 28), (48,), (5, 43), (24, 24)]
STEPS, LR, MAX_NORM = 3, 2.0, 0.5  # the gradient norm is about 0.7: every step is clipped
ACCUMULATION = 2  # step calls per optimizer step
LOSS_TOL = dict(atol=1e-6, rtol=1e-5)
# parameters after the SGD steps, whose steps are linear in the gradient (no Adam: Note [AdamW floors]): one fp32
# process (eager or SDPA attention) is 7.2 times inside this bound of the same steps in float64, entry by entry
# (the embedding rows of the clipped steps at lr 2)
PARAM_TOL = dict(atol=1e-6, rtol=1e-4)


def build(kind: str = "llama", *, tied: bool = False) -> torch.nn.Module:
    """A 4-layer tiny model from the seed every rank uses (Gemma 3: sliding and full layers mixed)."""
    config = tiny_config(kind)
    config.num_hidden_layers, config.tie_word_embeddings = 4, tied
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
        if kind != "gemma3":
            config.layer_types = ["full_attention"] * 4
    if kind == "gemma3":
        config.final_logit_softcapping = 3.0
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").train()


def packed_rows(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = tokens(len(DOCUMENTS), SEQ, 20 + step)
    positions = torch.stack([torch.cat([torch.arange(n) for n in docs]) for docs in DOCUMENTS])
    return ids, positions


def reference(model: torch.nn.Module) -> torch.Tensor:
    """One process, every document alone, the whole batch per step: per-step (loss, gradient norm)."""
    return documents_alone_history(model, lambda step: packed_rows(step)[0], DOCUMENTS, STEPS, LR, MAX_NORM)


def train(pipe: seqpar.PipelineParallel, mesh: seqpar.SequenceParallelMesh) -> torch.Tensor:
    """The same steps through the pipeline: this replica's rows, ACCUMULATION step calls, then one update."""
    dp_size, dp_rank = mesh.device_mesh["dp"].size(), mesh.device_mesh.get_local_rank("dp")
    group = seqpar.data_parallel_group(mesh)
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    history = []
    for step in range(STEPS):
        ids, positions = packed_rows(step)
        mine = [t.chunk(dp_size)[dp_rank] for t in (ids, positions)]
        shards = [
            seqpar.shard_batch({"input_ids": i, "position_ids": p}, mesh)
            for i, p in zip(mine[0].chunk(ACCUMULATION), mine[1].chunk(ACCUMULATION))
        ]
        total = seqpar.count_valid_tokens([s["shift_labels"] for s in shards], group)
        loss = sum(pipe.step(shard, num_valid_tokens=total) for shard in shards)
        pipe.reduce_gradients()
        norm = pipe.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
        history.append(torch.stack([loss, norm]))
    return torch.stack(history)


def assert_trains_like_reference(pipe, mesh, want, trained, what: str) -> None:
    got = train(pipe, mesh)
    torch.testing.assert_close(got, want, **LOSS_TOL, msg=lambda m: f"{what} (loss, grad norm) per step: {m}")
    expected = dict(trained.named_parameters(remove_duplicate=False))
    names = []
    for name, p in pipe.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        torch.testing.assert_close(
            full.detach(), expected[name].detach(), **PARAM_TOL, msg=lambda m, n=name: f"{what} {n}: {m}"
        )
        names.append(name)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, names)
    assert set().union(*everyone) == set(expected), f"{what}: the stages do not hold every parameter once"


def _cases(kind: str, tied: bool = False, done: tuple | None = None):
    """The untrained model, the reference history and the trained reference; ``done``: ``_reference``'s
    result, computed once in the test process instead of on every rank."""
    model = build(kind, tied=tied)
    trained = copy.deepcopy(model)
    if done is None:
        return model, reference(trained), trained
    history, state = done
    trained.load_state_dict(state)
    return model, history, trained


def _reference(kind: str, tied: bool = False) -> tuple[torch.Tensor, dict]:
    """The one-process reference (history, trained parameters) at one thread, as every rank would compute it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _, history, trained = _cases(kind, tied)
    finally:
        torch.set_num_threads(threads)
    return history, trained.state_dict()


def test_balanced_split_evens_parameters_and_keeps_every_stage_non_empty():
    assert balanced_split([10] * 4, 2) == [2, 2]
    assert balanced_split([10] * 4, 4) == [1, 1, 1, 1]
    assert balanced_split([10] * 8, 2, first_extra=40) == [2, 6]  # the embedding takes the place of layers
    assert balanced_split([10] * 8, 3, first_extra=15, last_extra=15) == [2, 4, 2]
    assert balanced_split([10, 10, 40, 10], 2) == [2, 2]
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3 stages"):
        balanced_split([10, 10], 3)


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor, num_valid_tokens: int) -> torch.Tensor:
    return seqpar.cross_entropy(logits, labels, num_valid_tokens=num_valid_tokens)


def _pp2_worker(rank, world_size):
    mesh = seqpar.make_mesh(pp_size=2)
    assert mesh.device_mesh.mesh_dim_names == ("pp", "dp", "ring", "ulysses")
    assert (mesh.pp_size, mesh.pp_rank, mesh.sp_size) == (2, rank, 1)
    llama, want, trained = _cases("llama")
    cases = [  # (schedule, micro-batches, stages per rank, further arguments)
        ("gpipe", 2, 1, {}),
        ("1f1b", 2, 1, {"loss_fn": _cross_entropy}),
        ("1f1b", 2, 1, {"loss_chunk_size": 16}),
        ("interleaved", 2, 2, {}),
    ]
    for schedule, microbatches, per_rank, extra in cases:
        model = seqpar.prepare_model(copy.deepcopy(llama), mesh)
        pipe = seqpar.apply_pipeline_parallel(
            model, mesh, schedule=schedule, microbatches=microbatches, stages_per_rank=per_rank, **extra
        )
        assert pipe.stage_indices == [rank + 2 * k for k in range(per_rank)]
        assert pipe.layers_per_stage == [4 // (2 * per_rank)] * (2 * per_rank)
        assert_trains_like_reference(pipe, mesh, want, trained, f"pp 2 {schedule} {sorted(extra)}")
    for kind, tied, schedule, per_rank in [
        ("llama", True, "1f1b", 1),
        ("qwen3", True, "interleaved", 2),
        ("mistral", False, "gpipe", 1),  # sliding window
        ("gemma3", False, "1f1b", 1),  # layer types per stage, final logit soft-capping
    ]:
        model, want, trained = _cases(kind, tied)
        seqpar.prepare_model(model, mesh)
        pipe = seqpar.apply_pipeline_parallel(model, mesh, schedule=schedule, microbatches=2, stages_per_rank=per_rank)
        assert_trains_like_reference(pipe, mesh, want, trained, f"pp 2 {kind} tied={tied} {schedule}")
    _bad_input(rank, mesh, llama)


def _bad_input(rank, mesh, llama):
    """Every rank raises the same error, before any pipeline communication."""
    prepared = seqpar.prepare_model(copy.deepcopy(llama), mesh)

    def refused(match, model=prepared, on=mesh, **kwargs):
        kwargs.setdefault("microbatches", 2)
        with pytest.raises(SeqparInputError, match=match):
            seqpar.apply_pipeline_parallel(model, on, **kwargs)

    refused(r"every rank: 1 micro-batches cannot fill 2 pipeline stages", microbatches=1)
    refused(r"4 decoder layers cannot fill 6 pipeline stages", schedule="interleaved", stages_per_rank=3)
    refused(r"the gpipe schedule runs one stage per rank", schedule="gpipe", stages_per_rank=2)
    refused(r"the interleaved schedule needs stages_per_rank of 2", schedule="interleaved")
    refused(r"unknown pipeline schedule", schedule="zero-bubble")
    refused(r"different arguments or models on different ranks", microbatches=2 + 2 * rank)
    refused(r"call seqpar.prepare_model", model=build("llama"))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=96))
    refused(r"decoder layers cannot be found.*GPT2LMHeadModel", model=gpt2)
    gemma = seqpar.prepare_model(build("gemma3"), mesh)
    refused(r"chunked loss does not apply the model's final logit soft-capping", model=gemma, loss_chunk_size=8)
    refused(r"pp_size of 2 or more", on=seqpar.make_mesh(sp_size=2))
    with pytest.raises(SeqparInputError, match=r"pp_size 3 x tp_size 1 must divide the world size 2"):
        seqpar.make_mesh(pp_size=3)
    pipe = seqpar.apply_pipeline_parallel(prepared, mesh, microbatches=2)
    ids, positions = packed_rows(0)
    shard = seqpar.shard_batch({"input_ids": ids[:3], "position_ids": positions[:3]}, mesh)
    with pytest.raises(SeqparInputError, match=r"every rank: 3 rows do not cut into 2 equal micro-batches"):
        pipe.step(shard)
    shard = seqpar.shard_batch({"input_ids": ids[: 2 + 2 * rank], "position_ids": positions[: 2 + 2 * rank]}, mesh)
    with pytest.raises(SeqparInputError, match=r"every rank's shard must have one shape"):
        pipe.step(shard)
    with pytest.raises(SeqparInputError, match=r"needs a shard with"):
        pipe.step({"input_ids": ids[:2]})
    shard = seqpar.shard_batch({"input_ids": ids[:2], "position_ids": positions[:2]}, mesh)
    pipe.step(shard)  # still usable after refusing


def test_pp2_trains_like_one_process():
    run_ranks(2, _pp2_worker)


def _pp2_x4_worker(rank, world_size, references, only=None):
    llama, want, trained = _cases("llama", done=references[0])
    tied, want_tied, trained_tied = _cases("llama", tied=True, done=references[1])
    sp_mesh = seqpar.make_mesh(pp_size=2, sp_size=2)
    dp_mesh = seqpar.make_mesh(pp_size=2, dp_size=2)
    tp_mesh = seqpar.make_mesh(pp_size=2, tp_size=2, sp_size=1)
    assert sp_mesh.device_mesh.mesh_dim_names == ("pp", "dp", "ring", "ulysses")
    assert (sp_mesh.pp_rank, sp_mesh.sp_rank, dp_mesh.pp_rank, dp_mesh.sp_size) == (rank // 2, rank % 2, rank // 2, 1)
    assert tp_mesh.device_mesh.mesh_dim_names == ("pp", "dp", "ring", "ulysses", "tp")
    cases = [  # (what, mesh, model, schedule, stages per rank, strategy, data parallel)
        ("pp2 sp2", sp_mesh, llama, "gpipe", 1, "ring", None),
        ("pp2 sp2 tied", sp_mesh, tied, "1f1b", 1, "ulysses", None),  # tied embeddings and Ulysses in one run
        ("pp2 sp2", sp_mesh, llama, "interleaved", 2, "ring", None),
        ("pp2 dp2", dp_mesh, llama, "1f1b", 1, "ring", None),
        ("pp2 dp2 fsdp", dp_mesh, llama, "1f1b", 1, "ring", "fsdp"),
        ("pp2 dp2 fsdp tied", dp_mesh, tied, "interleaved", 2, "ring", "fsdp"),
        ("pp2 tp2", tp_mesh, llama, "1f1b", 1, "ring", "tp"),
    ]
    for what, mesh, base, schedule, per_rank, strategy, wrap in cases:
        if only is not None and what not in only:
            continue
        model = copy.deepcopy(base)
        if wrap == "tp":
            seqpar.apply_tensor_parallel(model, mesh)
        seqpar.prepare_model(model, mesh, strategy=strategy)
        pipe = seqpar.apply_pipeline_parallel(model, mesh, schedule=schedule, microbatches=2, stages_per_rank=per_rank)
        if wrap == "fsdp":
            for stage in pipe.stages:
                seqpar.apply_data_parallel(stage, mesh, "fsdp")
        sharded = [isinstance(p, DTensor) for p in pipe.parameters()]
        assert all(sharded) if wrap == "fsdp" else any(sharded) == (wrap == "tp"), what
        reference_history, reference_model = (want_tied, trained_tied) if base is tied else (want, trained)
        assert_trains_like_reference(pipe, mesh, reference_history, reference_model, f"{what} {schedule} {strategy}")


def test_pp2_with_sp2_dp2_tp2_trains_like_one_process():
    run_ranks(4, _pp2_x4_worker, [_reference("llama"), _reference("llama", tied=True)])


def _pp2_x8_worker(rank, world_size, done):
    llama, want, trained = _cases("llama", done=done)
    for what, mesh, wrap in [
        ("pp2 sp2 dp2 fsdp", seqpar.make_mesh(pp_size=2, sp_size=2, dp_size=2), "fsdp"),
        ("pp2 tp2 sp2", seqpar.make_mesh(pp_size=2, sp_size=2, tp_size=2), "tp"),
    ]:
        model = copy.deepcopy(llama)
        if wrap == "tp":
            seqpar.apply_tensor_parallel(model, mesh)
        seqpar.prepare_model(model, mesh, strategy="ring")
        pipe = seqpar.apply_pipeline_parallel(model, mesh, schedule="1f1b", microbatches=2)
        if wrap == "fsdp":
            for stage in pipe.stages:
                seqpar.apply_data_parallel(stage, mesh, "fsdp")
        assert_trains_like_reference(pipe, mesh, want, trained, what)


# The reference is computed once here, not on each of 8 ranks sharing 2 cores (that alone made it 54-78 s). The ranks
# are forked from this process where that is safe (Note [forked ranks]), as seqpar's launcher starts them: spawning 8
# ranks that each import torch, transformers and seqpar took about 15 of this test's 21 s on the 2-core machine, and
# as the session's pool they closed the pools of 2, 3 and 4 ranks (MAX_POOLED_RANKS), which later tests started again.
def test_pp2_sp2_with_dp2_or_tp2_trains_like_one_process():
    spawn_ranks(
        _pp2_x8_worker, 8, _reference("llama"), timeout=COLLECTIVE_TIMEOUT, start_method=start_method_for("gloo")
    )


def test_bench_pipeline_prints_each_schedule_beside_the_prediction(capsys):
    """``python -m benchmarks.pipeline`` at toy size (timings meaningless here): one row per schedule, both sides, a
    verdict. The memory run (a second spawn) is left to the bench itself; its model is checked in test_estimate."""
    from benchmarks.pipeline import main

    argv = ["--seq", "64", "--hidden", "64", "--heads", "4", "--vocab", "256", "--repeats", "1"]
    assert main([*argv, "--no-memory"]) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r[1].strip() for r in rows[1:]] == ["gpipe", "1f1b", "interleaved"]
    assert {r[6].strip() for r in rows[1:]} <= {"yes", "NO"}
    assert [r[8].strip() for r in rows[1:]] == ["20%", "20%", "11%"]  # (p - 1) / (m + p - 1), / (2 m + p - 1)
