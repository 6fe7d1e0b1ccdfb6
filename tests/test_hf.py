"""seqpar.hf (Trainer, SFTTrainer, accelerate loop) on 2-4 ranks against the one-process Trainer, on CPU with gloo.

Per step loss (rel 1e-5) and grad_norm (rel 1e-4), evaluation loss and final parameters; bad input on every rank.
"""

from __future__ import annotations

import json
import math
import pathlib

import pytest
import torch
import transformers

from tests._background import Chain
from tests.hf_scripts.common import CASES, DEEPSPEED_CASES, METRICS, STEPS, documents, model
from tests.hf_scripts.dpo import BETA, DPO_CASES, DPO_METRICS, PEFT
from tests.hf_scripts.grpo import COMPARED, GRPO_CASES, GRPO_STEPS
from tests.hf_scripts.launches import DEEPSPEED, EXAMPLE_STEPS, TORCHRUN_EXAMPLES
from tests.hf_scripts.upstream import DEEPSPEED_EXAMPLES, UPSTREAM, YAML_LAUNCHED

LOSS_RTOL, GRAD_NORM_RTOL, PARAM_RTOL = 1e-5, 1e-5, 1e-4  # measured: loss <= 2.2e-7, grad_norm <= 1.2e-6
PARAM_ATOL = 1e-9
# SGD's steps are linear in the gradient: the one-process fp32 Trainer's parameters (sp2) are 420 times inside
# PARAM_RTOL of a float64 Trainer run's. After AdamW steps its grad_norm is 3.4e-6 (relative) from float64's (Adam's
# rounding in the parameters); seqpar's may be as far on the other side: 4 x 2 x 3.4e-6, rounded up
ADAMW_GRAD_NORM_RTOL = 3e-5


def _runs(launches: Chain, stage: str) -> pathlib.Path:
    """The directory of background stage ``stage``'s runs and of every reference, once both have ended."""
    launches.wait(stage)
    launches.wait("references")
    return launches.paths["hf"]


@pytest.fixture(scope="module")
def two_ranks(launches: Chain) -> pathlib.Path:
    return _runs(launches, "two_ranks")


@pytest.fixture(scope="module")
def more_ranks(launches: Chain) -> pathlib.Path:
    return _runs(launches, "more_ranks")


@pytest.fixture(scope="module")
def yaml_runs(launches: Chain) -> pathlib.Path:
    """TRL's accelerate YAMLs (tests/accelerate_configs) launching its snippets, which name no parallel settings."""
    return _runs(launches, "yaml_runs")


def _load(path: pathlib.Path) -> dict:
    return torch.load(path, weights_only=False)


def assert_matches(
    found: dict,
    want: dict,
    param_rtol: float | None = PARAM_RTOL,
    loss_rtol: float = LOSS_RTOL,
    norm_rtol: float = GRAD_NORM_RTOL,
) -> None:
    """Per-step loss and grad_norm, evaluation losses and final parameters (unless ``param_rtol`` is None) of two
    runs agree."""
    assert [s for s, _, _ in found["log"]] == [s for s, _, _ in want["log"]] == list(range(1, STEPS + 1))
    for i, (what, rtol) in enumerate((("loss", loss_rtol), ("grad_norm", norm_rtol)), start=1):
        got, ref = (torch.tensor([row[i] for row in run["log"]], dtype=torch.float64) for run in (found, want))
        torch.testing.assert_close(got, ref, rtol=rtol, atol=0, msg=lambda m, w=what: f"{w}: {m}")
    assert [s for s, _ in found["eval"]] == [s for s, _ in want["eval"]]
    if want["eval"]:
        got, ref = (torch.tensor([v for _, v in run["eval"]], dtype=torch.float64) for run in (found, want))
        torch.testing.assert_close(got, ref, rtol=LOSS_RTOL, atol=0, msg=lambda m: f"eval_loss: {m}")
    assert found["params"].keys() == want["params"].keys()
    if param_rtol is None:
        return
    for name, ref in want["params"].items():
        # relative to the tensor's largest entry, with a floor for tensors that only rounding moves (a key bias:
        # softmax ignores it, its exact gradient is zero)
        scale = float(ref.abs().max())
        torch.testing.assert_close(
            found["params"][name], ref, rtol=0, atol=param_rtol * scale + PARAM_ATOL, msg=lambda m, n=name: f"{n}: {m}"
        )


def _compare(root: pathlib.Path, name: str, **tolerances) -> dict:
    found, case = _load(root / f"{name}.pt"), CASES[name]
    want = _load(root / "reference" / f"{case.reference or name}.pt")
    assert_matches(found, want | ({} if case.eval_batch else {"eval": []}), **tolerances)
    return found


def test_reference_isolates_packed_documents():
    """The one-process reference (sdpa, position ids restarting) keeps packed documents apart; a full mask does not."""
    ref = model("llama").eval()
    docs = [torch.tensor(d["input_ids"]) for d in documents(3, 7)]
    ids = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    # without a KV cache, as the Trainer runs it (TrainingArguments.use_cache=False): transformers reads packed
    # documents from restarting position ids only then
    with torch.no_grad():
        alone = torch.cat([ref(input_ids=d[None], use_cache=False).logits for d in docs], dim=1)
        packed = ref(input_ids=ids, position_ids=positions, use_cache=False).logits
        ones = torch.ones_like(ids)
        leaking = ref(input_ids=ids, position_ids=positions, attention_mask=ones, use_cache=False).logits
    torch.testing.assert_close(packed, alone, atol=2e-5, rtol=1e-4)
    assert (leaking - alone).abs().max() > 1e-2


def test_pipeline_parallel_models_are_refused():
    """The Trainer door takes no pipeline parallel: a model that transformers loaded with pp_size is refused."""
    from types import SimpleNamespace

    from seqpar.errors import SeqparInputError
    from seqpar.hf.config import check_data_parallel_engine

    sizes = SimpleNamespace(pp_size=2, tp_size=None, ep_size=None, fsdp_size=None, dp_replicate_size=None)
    config = SimpleNamespace(distributed_config=sizes)
    loaded = SimpleNamespace(is_distributed_loading_by_transformers=True, config=config)
    with pytest.raises(SeqparInputError, match="for pipeline parallel use seqpar train --pp"):
        check_data_parallel_engine(SimpleNamespace(args=None, model=loaded), 2)


@pytest.mark.parametrize(
    "name",
    [
        "sp2",
        "sp2_balanced",
        "sp2_placed",
        "sp2_padded",
        "sft_packing",
        "sft_padding_free",
        "sft_gpt_oss",
        "sft_hybrid_qwen3_next",
    ],
)
def test_two_ranks_equal_one_process(two_ranks, name):
    found = _compare(two_ranks, name)
    assert found["setup"]["wrapper"] == "DistributedDataParallel"
    layouts = found["setup"]["layouts"]
    assert len(layouts) == 2 * STEPS  # every micro-batch was sharded once (gradient accumulation 2)
    if CASES[name].layout == "balanced":  # each shard carried its own layout, and some are not zigzag's
        zigzag = ((0, 3), (1, 2))
        assert all(layout is not None for layout in layouts) and any(layout != zigzag for layout in layouts)
    elif CASES[name].layout == "placed":  # each shard carried its placed row's layout: equal chunks per rank
        assert all(layout is not None and len({len(ids) for ids in layout}) == 1 for layout in layouts), layouts
    else:
        assert layouts == [None] * len(layouts)
    want = _load(two_ranks / "reference" / f"{CASES[name].reference or name}.pt")
    # TRL's metrics (Note [SFT metrics over shards]); the packing case evaluates, so its eval metrics too
    expected = {"sft_packing": 5, "sft_padding_free": 3, "sft_gpt_oss": 7, "sft_hybrid_qwen3_next": 7}.get(name, 0)
    # the MoE cases (gpt-oss, Qwen3-Next): TRL's aux_loss
    assert sum(bool(v) for v in want["metrics"].values()) == expected, want["metrics"]
    assert found["metrics"].keys() == want["metrics"].keys()
    for key, rows in want["metrics"].items():
        assert [s for s, _ in found["metrics"][key]] == [s for s, _ in rows], key
        got, ref = (torch.tensor([v for _, v in r], dtype=torch.float64) for r in (found["metrics"][key], rows))
        torch.testing.assert_close(got, ref, rtol=0 if key == "num_tokens" else LOSS_RTOL, atol=0, msg=key)


def test_adamw(two_ranks):
    """The Trainer's own AdamW (optim="adamw_torch") under seqpar follows one process: every step's loss and
    grad_norm, which from the second step on are taken at the parameters AdamW made. Its parameters are not
    compared entry by entry: Adam turns the rounding of a near-zero gradient into a step of up to lr (Note [AdamW
    floors]), so against the one-process fp32 Trainer a parameter bound measures the CPU's summation order (one
    fp32 process, with SDPA or eager attention, is up to 1e-3 of a tensor's largest entry from a float64 Trainer
    run's after these 4 steps: Qwen2's o_proj), and the Trainer runs here record no per-step gradients to measure
    a float64 floor from. Parameter parity through the Trainer is every SGD case's (steps linear in the gradient);
    AdamW's is tests/test_transformers.py's."""
    _compare(two_ranks, "sp2_adamw", param_rtol=None, norm_rtol=ADAMW_GRAD_NORM_RTOL)


def _loss_change(root: pathlib.Path, name: str, other: str) -> float:
    """The largest relative difference of the per-step logged losses of two one-process references."""
    got, ref = (torch.tensor([row[1] for row in _load(root / "reference" / f"{n}.pt")["log"]]) for n in (name, other))
    return float(((got - ref) / ref).abs().max())


@pytest.mark.parametrize("name", ["sp2_label_smoothing", "sp2_neftune"])
def test_label_smoothing_and_neftune_equal_one_process(two_ranks, name):
    """Note [label smoothing per token], Note [NEFTune over shards]: loss, grad_norm, (smoothed) evaluation loss
    and parameters equal one process's; the option changes the one-process losses by far more than the tolerance
    (measured: smoothing 0.1 by 6.9e-4, NEFTune alpha 5 by 4.8e-3), so a run that ignored it would fail."""
    _compare(two_ranks, name)
    assert _loss_change(two_ranks, name, "sp2") > 10 * LOSS_RTOL


@pytest.mark.parametrize("name", ["sp2_metrics", "dp2_sp2_metrics"])
def test_compute_metrics_equal_one_process(request, name):
    """Note [metrics over shards]: compute_metrics on argmax predictions (preprocess_logits_for_metrics) and labels
    gets one process's arrays: the same accuracy, shapes, order and -100 padding across batches."""
    root = request.getfixturevalue("two_ranks" if CASES[name].world == 2 else "more_ranks")
    found = _compare(root, name)
    want = _load(root / "reference" / f"{name}.pt")
    for metric in METRICS:
        rows = want["metrics"][f"eval_{metric}"]
        assert rows and len(rows) == len(want["eval"]) and found["metrics"][f"eval_{metric}"] == rows, metric
    assert all(v > 0 for _, v in want["metrics"]["eval_padded_preds"])  # batches of different widths were padded


def test_gradient_checkpointing_and_bf16(two_ranks):
    """gradient_checkpointing=True is exact; bf16 autocast stays within one bf16 rounding (2^-8) of fp32."""
    assert _compare(two_ranks, "sp2_checkpointing")["setup"]["checkpointing"]
    found = _load(two_ranks / "sp2_bf16.pt")
    assert found["setup"]["mixed_precision"] == "bf16"
    want = _load(two_ranks / "reference" / "sp2.pt")
    for i, what in ((1, "loss"), (2, "grad_norm")):
        got, ref = (torch.tensor([row[i] for row in run["log"]], dtype=torch.float64) for run in (found, want))
        # measured: loss 3.6e-5, grad_norm 8.3e-4 (the one-process bf16 Trainer: 2.4e-5, 1.2e-3)
        torch.testing.assert_close(got, ref, rtol=2**-8, atol=0, msg=lambda m, w=what: f"{w}: {m}")
        if what == "loss":  # autocast did run: fp32 runs agree to ~2e-7
            assert float(((got - ref) / ref).abs().max()) > 2e-6


@pytest.mark.parametrize("dp", [1, 2])
def test_accelerate_loop_recipe(request, dp):
    """accelerate's documented loop with the README's seqpar additions, 2 epochs without drop_last, equals one
    process: every step's loss and grad_norm, the held-out token accuracy and loss reduced over the processes
    after each epoch, and the final parameters."""
    root = request.getfixturevalue("two_ranks" if dp == 1 else "more_ranks")
    found, want = _load(root / f"accelerate_dp{dp}.pt"), _load(root / "reference" / f"accelerate_dp{dp}.pt")
    steps = {1: 12, 2: 6}[dp]  # 21 rows in batches of 2 x dp, 2 micro-batches a step, 2 epochs
    assert [s for s, _, _ in found["log"]] == [s for s, _, _ in want["log"]] == list(range(1, steps + 1))
    for i, rtol in ((1, LOSS_RTOL), (2, GRAD_NORM_RTOL)):
        got, ref = (torch.tensor([row[i] for row in run["log"]], dtype=torch.float64) for run in (found, want))
        torch.testing.assert_close(got, ref, rtol=rtol, atol=0)
    torch.testing.assert_close(torch.tensor(found["metrics"]), torch.tensor(want["metrics"]), rtol=LOSS_RTOL, atol=0)
    for n, ref in want["params"].items():
        torch.testing.assert_close(found["params"][n], ref, rtol=0, atol=PARAM_RTOL * float(ref.abs().max()))


def _compare_guide(root: pathlib.Path, name: str) -> dict:
    found, want = _load(root / f"{name}.pt"), _load(root / "reference" / f"{name}.pt")
    for key, rtol in (("loss", LOSS_RTOL), ("norm", GRAD_NORM_RTOL)):
        got, ref = (torch.tensor(run[key], dtype=torch.float64) for run in (found, want))
        torch.testing.assert_close(got, ref, rtol=rtol, atol=0, msg=lambda m, k=key: f"{k}: {m}")
    for n, ref in want["params"].items():
        torch.testing.assert_close(found["params"][n], ref, rtol=0, atol=PARAM_RTOL * float(ref.abs().max()))
    return found


@pytest.mark.parametrize("dp", [1, 2])
def test_accelerate_sequence_parallel_guide(request, dp):
    """accelerate's sequence-parallelism guide loop as written (``from seqpar.hf import Accelerator``; model,
    optimizer, dl, rank, move_to_device filled in), ParallelismConfig(sp_size=2, dp_replicate_size=dp) as the guide
    builds it, 2 epochs of 11 rows without drop_last, packed documents: every step's logged loss and the
    gradient norm, the final SGD parameters, and a held-out loss summed with gather_for_metrics (every token once).

    dp 1 equals one process training the same batches. dp 2 equals what the guide's loop means without SP on 2
    processes: DDP's average of the 2 replicas' token means each step (replica j: batch j of every 2; the last
    round one full batch and one short one), here one process averaging the two means. One batch packs a masked
    prompt, so one SP rank's shard has no valid token (the guide skips it; its loss is 0, not NaN). At dp 2 on
    gloo torch's differentiable all_gather cannot run its backward on the SP group {2, 3}; the run serves that one
    call with an equivalent (tests/hf_scripts/accelerate_guides.py)."""
    root = request.getfixturevalue("two_ranks" if dp == 1 else "more_ranks")
    found = _compare_guide(root, f"guide_sp_dp{dp}")
    want = _load(root / "reference" / f"guide_sp_dp{dp}.pt")
    assert found["batches"] == {1: 6, 2: 3}[dp] and len(found["loss"]) == 2 * found["batches"]
    assert found["empty_shards"] == 2  # the masked batch, once per epoch
    assert found["held_out"][1] == want["held_out"][1]  # counted once, not once per SP rank
    torch.testing.assert_close(found["held_out"][0], want["held_out"][0], rtol=LOSS_RTOL, atol=0)


@pytest.mark.parametrize("comm", ["allgather", "alltoall"])
def test_accelerate_context_parallel_guide(two_ranks, comm):
    """ParallelismConfig(cp_size=2, cp_handler=TorchContextParallelConfig(cp_comm_strategy=comm)) as accelerate's
    context-parallelism guide builds it, with ``seqpar.hf.Accelerator``. "allgather": nd_parallel.py's step as
    written (labels and shift_labels one tensor, some labels masked so the shards differ in valid tokens), the
    dp_cp-averaged loss and the gradients equal one process's token mean (Note [loss under seqpar.hf.Accelerator]).
    "alltoall" (seqpar's ring): packed documents with restarting position ids and right padding with an
    attention_mask, under accelerator.accumulate (2 micro-batches a step), equal one process's."""
    _compare_guide(two_ranks, f"guide_cp_{comm}")


def test_a_loss_that_forgets_the_data_parallel_average_fails(two_ranks):
    """Control: a user's mixin subclass that drops the W factor halves the gradients, and the comparison sees it."""
    found = _load(two_ranks / "control_unscaled.pt")
    with pytest.raises(AssertionError, match=r"loss|grad_norm"):
        assert_matches(found, _load(two_ranks / "reference" / "sp2.pt") | {"eval": []})


def test_resume_and_save_model(two_ranks):
    resumed, whole = _load(two_ranks / "resume.pt"), _load(two_ranks / "sp2.pt")
    assert_matches(resumed, whole | {"eval": []}, param_rtol=1e-6, loss_rtol=1e-6)
    saved = two_ranks / "saved_model"
    assert "seqpar" not in (saved / "config.json").read_text()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(saved)  # no seqpar attention registered here
    for name, p in loaded.named_parameters():
        torch.testing.assert_close(p.detach(), resumed["params"][name], rtol=0, atol=0)


def test_bad_input_raises_on_every_rank(two_ranks):
    per_rank = _load(two_ranks / "refusals.pt")
    assert per_rank[0] == per_rank[1], "the ranks raised different messages"
    got = per_rank[0]
    expected = {
        "flattening without position ids": "return_position_ids=True",
        "varlen keys without position ids": "ranks 0, 1: the batch packs several documents",
        "left padding on one rank": "rank 1: attention_mask has padding before real tokens",
        "sp larger than the sequence": "a sequence of 1 tokens cannot be split over sp_size=2",
        "world not divisible by sp": "world size 2 is not divisible by sp_size 3",
        "neftune over replicas": "neftune_noise_alpha=5.0 with 2 data-parallel replicas",
        "per-batch metrics": "batch_eval_metrics: seqpar gathers",
        "sft neftune with label smoothing": "two training forwards per micro-batch",
        "sft liger": "use_liger_kernel",
        "sft dft loss": "loss_type='dft'",
        "unknown strategy": "unknown strategy 'zigzag'",
        "parallelism sizes": "= 4 processes, but the job has 2",
        "parallelism disagrees": "SequenceParallelConfig(sp_size=2, ulysses_size=1) and parallelism_config",
        "parallelism tp": "tp_size=2: tensor parallel is not part of the Hugging Face doors",
        "parallelism fixed width": "ranks 0, 1: a batch 26 tokens wide, but the width is fixed at 64",
        "loader by process": "loaded different batches",
        "fsdp plugin on the cpu": "DistributedConfig(fsdp_size=2)",
        "model seqpar cannot serve": "cannot serve this model's attention: its attention_dropout is 0.1",
        "grpo vllm": "use_vllm=True (vllm_mode='colocate') is not supported under sequence parallelism",
        "grpo vllm server": "or pass rollout_func= to call your own vLLM server",
        "grpo generation batch": "= 3 is not divisible by num_generations (2)",
        "grpo placed layout": "layout='placed' reorders packed documents",
        "grpo vision dataset": "vision datasets (images): seqpar's GRPO samples and scores text token rows only",
    }
    assert got.keys() == expected.keys()
    for what, text in expected.items():
        assert text in got[what], f"{what}: {got[what]}"


@pytest.mark.parametrize("name", ["sp3_ring", "dp2_sp2", "ulysses2_ring2"])
def test_more_ranks_equal_one_process(more_ranks, name):
    setup = _compare(more_ranks, name)["setup"]
    assert setup["wrapper"] == "DistributedDataParallel"
    # dp2_sp2 trains with layout="balanced": every shard brought its layout to the model
    assert all((layout is not None) == (CASES[name].layout == "balanced") for layout in setup["layouts"])


HYBRID_CASES = [f"{kind}_sp{sp}" for kind in ("lfm2", "qwen3_next", "granitemoehybrid") for sp in (2, 3)]
HYBRID_CASES += ["qwen3_next_dp2_sp2", "qwen3_next_sp2_fsdp2"]


@pytest.mark.parametrize("name", HYBRID_CASES)
def test_hybrid_models_through_the_trainer(request, name):
    """LFM2 (short convolutions), Qwen3-Next (gated DeltaNet, experts) and GraniteMoeHybrid (Mamba2) at sp 2 and at
    sp 3 (ring), and Qwen3-Next at dp 2 x sp 2 (DDP) and FSDP2-sharded at sp 2, through ``SequenceParallelTrainer``:
    every step's loss and grad_norm and every parameter as one process's Trainer."""
    root = request.getfixturevalue("two_ranks" if CASES[name].world == 2 else "more_ranks")
    found = _compare(root, name)
    assert any(piece in n for n in found["params"] for piece in (".conv.", "linear_attn", ".mamba."))
    assert found["setup"]["fsdp2"] == CASES[name].fsdp


VLM_CASES = [
    "vlm_sp2",
    "vlm_gemma3_dp2_sp2",
    "vlm_gemma4_sp2",
    *(f"vlm_qwen_patch2_{s}" for s in ("sp2", "sp3_ring", "dp2_sp2")),
]


@pytest.mark.parametrize("name", VLM_CASES)
def test_vision_language_trainer_equals_one_process(request, name):
    """A multimodal collator's batches (pixels, grids, token types; 1-2 images of different sizes per row) train a
    vision-language model through the Trainer door over 2 epochs as one process does: every step's loss and
    grad_norm, the evaluation loss and every parameter, the vision tower's included (Note [whole-row calls]).
    The ``vlm_qwen_patch2`` cases (4 epochs) accumulate two micro-batches a step, which Qwen2.5-VL's one-process
    Trainer averages as their own means (Note [micro-batch means])."""
    root = request.getfixturevalue("two_ranks" if CASES[name].world == 2 else "more_ranks")
    found = _compare(root, name)
    want = _load(root / "reference" / f"{name}.pt")
    assert any(n.startswith("model.visual.") or "vision_tower" in n for n in want["params"])
    assert found["setup"]["wrapper"] == "DistributedDataParallel"


def test_step_counts_each_micro_batch():
    """``shard_step(per_micro_batch=True)`` also counts each micro-batch's valid (shifted) tokens, the normaliser
    of a model that takes no ``num_items_in_batch`` (Note [micro-batch means]); not asked, it does not."""
    from seqpar.hf.batches import shard_step
    from seqpar.mesh import as_sp_mesh

    ids = torch.arange(2, 14).reshape(2, 6)
    first = {"input_ids": ids, "labels": ids.masked_fill(ids % 3 == 0, -100)}
    second = {"input_ids": ids[:1], "attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0]])}
    step = shard_step([first, second], as_sp_mesh(None), per_micro_batch=True)
    assert step.micro_batch_tokens == [6, 3] and step.num_valid_tokens == 9  # 3 of 5 in each row; 3 of 4 real
    assert shard_step([first, second], as_sp_mesh(None)).micro_batch_tokens is None


@pytest.mark.parametrize("name", ["sft_vlm_sp2", "sft_vlm_dp2_sp2"])
def test_vision_sft_equals_one_process(request, name):
    """TRL's VLM SFT as documented (a dataset of messages + images, a processor as ``processing_class``, TRL's
    vision collator and defaults) under ``SequenceParallelSFTTrainer`` trains Gemma 3 as one ``SFTTrainer`` does
    over 2 epochs: loss, grad_norm, parameters (vision tower included) and TRL's metrics, ``num_tokens`` exactly."""
    root = request.getfixturevalue("two_ranks" if CASES[name].world == 2 else "more_ranks")
    found = _compare(root, name)
    want = _load(root / "reference" / f"{name}.pt")
    assert any("vision_tower" in n for n in want["params"])
    assert found["setup"]["wrapper"] == "DistributedDataParallel" and found["setup"]["checkpointing"]
    expected = 5 if CASES[name].eval_batch else 3  # entropy, accuracy, num_tokens (and the eval pair)
    assert sum(bool(v) for v in want["metrics"].values()) == expected, want["metrics"]
    for key, rows in want["metrics"].items():
        assert [s for s, _ in found["metrics"][key]] == [s for s, _ in rows], key
        got, ref = (torch.tensor([v for _, v in r], dtype=torch.float64) for r in (found["metrics"][key], rows))
        torch.testing.assert_close(got, ref, rtol=0 if key == "num_tokens" else LOSS_RTOL, atol=0, msg=key)


@pytest.mark.parametrize("name", ["sp2_fsdp2", "dp2_sp2_fsdp2"])
def test_fsdp2_equals_one_process(request, name):
    """A model loaded FSDP2-sharded (DistributedConfig) trains exactly, with evaluation, at sp 2 and dp 2 x sp 2."""
    root = request.getfixturevalue("two_ranks" if CASES[name].world == 2 else "more_ranks")
    setup = _compare(root, name)["setup"]
    assert setup["fsdp2"] and setup["wrapper"].startswith("FSDP")
    assert setup["checkpointing"] == (name == "dp2_sp2_fsdp2")


@pytest.mark.parametrize(
    "name,strategy",
    [
        ("gemma3_sp2", "ulysses"),  # sliding-window and full layers alternating, packed documents
        ("gemma2_sp2", "ring"),  # attention logits soft-capped (seqpar's reference kernel), final logits too
        ("kv1_sp2", "ulysses"),  # 1 KV head over 2 ranks: the KV head is copied
        ("kv1_ulysses2_ring2", "hybrid"),
    ],
)
def test_models_equal_one_process(request, name, strategy):
    root = request.getfixturevalue("two_ranks" if CASES[name].world == 2 else "more_ranks")
    assert _compare(root, name)["setup"]["strategy"] == strategy


@pytest.mark.parametrize("name", ["olmo3_sp2", "starcoder2_sp2", "glm4_moe_sp2", "llama4_sp2", "deepseek_v32_sp2"])
def test_families_without_an_entry_equal_one_process(two_ranks, name):
    """OLMo 3, StarCoder2, GLM-4.5-style experts, Llama 4 and DeepSeek-V3.2 (both over 2 epochs, DeepSeek's indexer
    ranking the rows' width before the layout's padding): no registry entry, their anatomy read from the model."""
    _compare(two_ranks, name)


@pytest.mark.parametrize("name", ["mixtral_sp2", "mixtral_dp2_sp2"])
def test_router_loss_equals_one_process(request, name):
    """Mixtral (4 layers, 4 experts, top-2) with output_router_logits: the load-balancing loss over every process's
    tokens (padding left out at sp 2, packed rows of both replicas at dp 2 x sp 2) makes the logged loss, grad_norm,
    evaluation loss (router loss included, sp 2) and final parameters one process's (measured: loss 8e-8,
    grad_norm 7e-7, parameters 2e-7; per-rank or per-group statistics, or padding counted, miss by 7e-3 to 8e-2)."""
    root = request.getfixturevalue("two_ranks" if CASES[name].world == 2 else "more_ranks")
    assert _compare(root, name)["setup"]["wrapper"] == "DistributedDataParallel"


@pytest.mark.parametrize(
    "name,strategy,ulysses",
    [
        ("pc_sp2", "ulysses", 2),  # ParallelismConfig(sp_backend="deepspeed", sp_size=2, sp_handler=...)
        ("pc_cp2_alltoall", "ring", 1),  # cp_comm_strategy="alltoall": key/value shards rotate around the ranks
        ("pc_dp2_sp2", "ulysses", 2),  # dp_replicate_size=2 x sp_size=2
        ("pc_dp2_cp2", "ring", 1),  # dp_shard_size=2 x cp_size=2, alltoall; with evaluation
    ],
)
def test_accelerate_parallelism_config_equals_one_process(request, name, strategy, ulysses):
    """accelerate's ParallelismConfig in TrainingArguments, as its guides write it, trains as one process does."""
    root = request.getfixturevalue("two_ranks" if CASES[name].world == 2 else "more_ranks")
    setup = _compare(root, name)["setup"]
    assert (setup["strategy"], setup["sp_size"], setup["ulysses_size"]) == (strategy, 2, ulysses)
    assert setup["accelerate_parallelism"] is None  # accelerate ran plain DDP; seqpar split the sequence


@pytest.mark.skipif(not DEEPSPEED, reason="DeepSpeed is the optional extra seqpar[deepspeed]")
@pytest.mark.parametrize("name", DEEPSPEED_CASES)
def test_deepspeed_zero_equals_one_process(two_ranks, name):
    """ZeRO 1, 2 and 3 as the Trainer's data-parallel engine at sp 2 (Ulysses on 2 CPU ranks over gloo): per-step
    loss and grad_norm, ZeRO-3's evaluation loss and the final parameters equal one process's."""
    assert _compare(two_ranks, name)["setup"]["deepspeed"] == int(name[-1])  # the engine's ZeRO stage


@pytest.mark.skipif(not DEEPSPEED, reason="DeepSpeed is the optional extra seqpar[deepspeed]")
def test_deepspeed_sequence_parallel_is_refused(two_ranks):
    """DeepSpeed's own sequence_parallel_size would split what seqpar splits: refused on every rank."""
    per_rank = _load(two_ranks / "deepspeed_refusal.pt")
    assert per_rank[0] == per_rank[1] and "sequence_parallel_size=2: seqpar splits the sequence itself" in per_rank[0]


GRPO_METRIC_RTOL, GRPO_METRIC_ATOL = 1e-5, 1e-7  # atol: metrics that are 0 (kl at the first step, clip ratios)


@pytest.mark.parametrize("name", list(GRPO_CASES))
def test_grpo_equals_one_process(request, name):
    """SequenceParallelGRPOTrainer against TRL's GRPOTrainer on one process with every replica's rows, 3 steps.

    At one replica (sp 2, sp 3 on a ring) the group samples for itself and must draw exactly the reference's
    completions (same prompts, same random stream). With two replicas (dp 2 x sp 2) each replica samples with
    its own seed, as TRL's processes do, which one process cannot reproduce: that run replays the reference's
    completions through TRL's documented generation hook ``rollout_func`` (``tests.hf_scripts.grpo.replay``).
    Per step: loss (rel 1e-5 of the run's largest loss: GRPO's loss on fresh completions is 0 up to rounding),
    grad_norm (rel 1e-5) and the logged metrics (rel 1e-5); final parameters (rel 1e-4 of each tensor's max).
    """
    case = GRPO_CASES[name]
    root = request.getfixturevalue("two_ranks" if case.world == 2 else "more_ranks")
    found, want = _load(root / f"{name}.pt"), _load(root / "reference" / f"{name}.pt")
    assert (found["sp_size"], found["dp_size"]) == (case.sp_size, case.dp)
    assert case.strategy == "auto" or found["strategy"] == case.strategy
    groups = [found["calls_per_rank"][r - r % case.sp_size] for r in range(case.world)]
    assert found["calls_per_rank"] == groups, "the ranks of a group scored different completions"
    if not case.replay:
        assert found["calls"] == want["calls"], "the group sampled other completions than one process"
    assert [h["step"] for h in found["log"]] == [h["step"] for h in want["log"]] == list(range(1, GRPO_STEPS + 1))
    scale = max(abs(h["loss"]) for h in want["log"])
    for key, rtol, atol in (("loss", 0, LOSS_RTOL * scale), ("grad_norm", GRAD_NORM_RTOL, 0)):
        got, ref = (torch.tensor([h[key] for h in run["log"]], dtype=torch.float64) for run in (found, want))
        torch.testing.assert_close(got, ref, rtol=rtol, atol=atol, msg=lambda m, k=key: f"{k}: {m}")
    for key in COMPARED:
        got, ref = ([h.get(key) for h in run["log"]] for run in (found, want))
        assert [v is None for v in got] == [v is None for v in ref], f"{key} logged at other steps"
        got, ref = (torch.tensor([v for v in x if v is not None], dtype=torch.float64) for x in (got, ref))
        torch.testing.assert_close(
            got, ref, rtol=GRPO_METRIC_RTOL, atol=GRPO_METRIC_ATOL, msg=lambda m, k=key: f"{k}: {m}"
        )
    assert any(h["clip_ratio/region_mean"] > 0 for h in want["log"]), "no step clipped: the clip branch is untested"
    for n, ref in want["params"].items():
        scale = float(ref.abs().max())
        torch.testing.assert_close(
            found["params"][n], ref, rtol=0, atol=PARAM_RTOL * scale, msg=lambda m, n=n: f"{n}: {m}"
        )


def test_grpo_loss_types_equal_one_process(two_ranks):
    """Every GRPO loss_type (and the sequence-level ratio, delta, the off-policy and entropy masks) on one
    micro-batch with off-policy ratios: loss (rel 1e-5, abs 1e-8 for losses that cancel), gradient (rel 1e-5
    in norm) and the loss metrics (rel 1e-5) of sp 2 equal TRL's one process on the same inputs."""
    found = _load(two_ranks / "grpo_loss_types.pt")["variants"]
    want = _load(two_ranks / "reference" / "grpo_loss_types.pt")["variants"]
    assert found.keys() == want.keys()
    for name, ref in want.items():
        got = found[name]
        torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-5, atol=1e-8, msg=lambda m, n=name: f"{n}: {m}")
        error = float((got["grad"] - ref["grad"]).norm() / ref["grad"].norm())
        assert error <= GRAD_NORM_RTOL, f"{name}: gradient off by {error:.2e} (relative, in norm)"
        assert got["metrics"].keys() == ref["metrics"].keys(), name
        for key, value in ref["metrics"].items():
            torch.testing.assert_close(got["metrics"][key], value, rtol=GRPO_METRIC_RTOL, atol=GRPO_METRIC_ATOL)
    assert len({round(v["loss"], 9) for v in want.values()}) == len(want), "two variants computed the same loss"
    assert max(v["metrics"].get("clip_ratio/region_mean", 0.0) for v in want.values()) > 0


def _dpo_tolerances(key: str, want: dict, beta: float) -> tuple[float, float]:
    """(rtol, atol) for one of TRL's DPO metrics. rewards/* are beta x differences of completion log-probabilities
    of some tens, near zero at the start: their error is the log-probabilities' rounding (measured <= 2.4e-6 with
    log-probabilities near 57), so atol is 1e-6 of beta x the largest log-probability. logits/* are vocabulary
    means of logits near zero: atol 1e-7 (measured <= 5e-9). The token count is exact."""
    if key.endswith("num_tokens"):
        return 0.0, 0.0
    if "rewards/" in key and "accuracies" not in key:
        largest = max(abs(v) for k, rows in want.items() if "logps/" in k for _, v in rows)
        return LOSS_RTOL, 1e-6 * beta * largest
    return LOSS_RTOL, 1e-7 if "logits/" in key else 0.0


@pytest.mark.parametrize("name", list(DPO_CASES))
def test_dpo_equals_one_process(request, name):
    """Note [DPO over shards]: TRL's DPOTrainer in one process on dp x the pairs against SequenceParallelDPOTrainer,
    3 steps of 2 micro-batches: per-step loss and grad_norm, TRL's metrics (rewards/*, logps/*, logits/*, entropy,
    mean_token_accuracy, num_tokens), evaluation loss and metrics, and the final parameters. The cases cover sigmoid,
    ipo / sigmoid_norm / robust with ld_alpha and WPO weights, hinge / bco_pair / sft over a ring of 3, a LoRA
    adapter whose reference is its base model, accelerate's ParallelismConfig(sp_size=2) in the DPOConfig, and
    precomputed reference log-probabilities at dp 2 x sp 2 with activation checkpointing (measured: loss <= 2.0e-6,
    grad_norm <= 1.1e-6, parameters <= 1.7e-6)."""
    case = DPO_CASES[name]
    if case.peft and not PEFT:
        pytest.skip("peft is not installed")
    root = request.getfixturevalue("two_ranks" if case.world == 2 else "more_ranks")
    found, want = _load(root / f"{name}.pt"), _load(root / "reference" / f"{case.reference or name}.pt")
    assert (found["strategy"], found["sp_size"]) == ("ring" if case.strategy == "ring" else "ulysses", case.sp_size)
    assert [s for s, _, _ in found["log"]] == [s for s, _, _ in want["log"]] == [1, 2, 3]
    for i, (what, rtol) in enumerate((("loss", LOSS_RTOL), ("grad_norm", GRAD_NORM_RTOL)), start=1):
        got, ref = (torch.tensor([row[i] for row in run["log"]], dtype=torch.float64) for run in (found, want))
        torch.testing.assert_close(got, ref, rtol=rtol, atol=0, msg=lambda m, w=what: f"{w}: {m}")
    rows = want["metrics"] | want["eval"]
    assert all(rows[k] for k in DPO_METRICS) and bool(rows["eval_loss"]) == case.evaluate
    for key, ref_rows in rows.items():
        got_rows = (found["metrics"] | found["eval"])[key]
        assert [s for s, _ in got_rows] == [s for s, _ in ref_rows], key
        got, ref = (torch.tensor([v for _, v in r], dtype=torch.float64) for r in (got_rows, ref_rows))
        rtol, atol = _dpo_tolerances(key, rows, BETA)
        if key.endswith("rewards/accuracies"):  # the share of pairs whose chosen reward beats the rejected one:
            # where both rewards are rounding-level (the first step, whose policy is still its reference) that
            # comparison is rounding noise (measured: 0 vs 2.4e-7), so only steps with real rewards are compared
            _, reward_atol = _dpo_tolerances(key.replace("accuracies", "chosen"), rows, BETA)
            sides = [rows[key.replace("accuracies", side)] for side in ("chosen", "rejected")]
            real = [i for i in range(len(ref_rows)) if max(abs(side[i][1]) for side in sides) > reward_atol]
            assert len(real) >= len(ref_rows) - 1, (key, sides)  # at most the first step is skipped
            got, ref = got[real], ref[real]
        torch.testing.assert_close(got, ref, rtol=rtol, atol=atol, msg=lambda m, k=key: f"{k}: {m}")
    assert found["params"].keys() == want["params"].keys()
    for n, ref in want["params"].items():
        torch.testing.assert_close(found["params"][n], ref, rtol=0, atol=PARAM_RTOL * float(ref.abs().max()))


def test_dpo_refusals_on_every_rank(two_ranks):
    """DPO settings and batches seqpar cannot serve raise SeqparInputError on every rank, each with its reason."""
    per_rank = _load(two_ranks / "dpo_refusals.pt")
    assert per_rank[0] == per_rank[1], "the ranks raised different messages"
    expected = {
        "compute_metrics": "compute_metrics: DPOTrainer builds whole-sequence logits",
        "uneven replicas": "23 pairs, not a multiple of 2 data-parallel replicas x 2 pairs",
        "left padding on one rank": "rank 1: attention_mask has padding before real tokens",
        "router loss": "DPOConfig(router_aux_loss_coef=0.0)",
        "vision dataset": "vision datasets (images)",
    }
    assert per_rank[0].keys() == expected.keys()
    for what, text in expected.items():
        assert text in per_rank[0][what], f"{what}: {per_rank[0][what]}"


@pytest.fixture(scope="module")
def examples_run(launches: Chain) -> pathlib.Path:
    launches.wait("examples_run")
    return launches.paths["examples"]


@pytest.fixture(scope="module")
def sft_example(launches: Chain) -> pathlib.Path:
    launches.wait("sft_example")
    return launches.paths["sft_example"]


def _check_example(record: dict) -> None:
    assert record["sp"] == 2 and record["steps"] == EXAMPLE_STEPS  # both processes share each sequence
    if "first_reward" in record:  # GRPO: rewards of the sampled completions, and the loss
        assert all(math.isfinite(record[k]) for k in ("first_reward", "last_reward", "last_loss")), record
        return
    losses = [record["first_loss"], record["last_loss"], record.get("eval_loss", 1.0)]
    assert all(0 < v < 10 for v in losses), record  # finite, and near ln(256) or below (DPO: near ln 2)


@pytest.mark.parametrize("script", TORCHRUN_EXAMPLES)
def test_examples_train(examples_run, script):
    """Each example, as its docstring runs it under torchrun on 2 CPU ranks, trains and writes its result."""
    _check_example(json.loads((examples_run / pathlib.Path(script).stem / "result.json").read_text()))


def test_example_under_accelerate_launch(sft_example):
    """examples/sft_trainer.py under ``accelerate launch --multi_gpu --num_processes 2`` (CPU)."""
    _check_example(json.loads((sft_example / "result.json").read_text()))


@pytest.mark.parametrize("name", list(UPSTREAM))
def test_upstream_examples_equal_one_process(request, name):
    """TRL's packing quick start and the Trainer's DataCollatorWithFlattening example, as documented but for the
    import, over several epochs without drop_last: every step's loss and grad_norm (and TRL's entropy, token
    accuracy and token count), and the final SGD parameters, equal one process's at dp 1 and dp 2."""
    if name in DEEPSPEED_EXAMPLES and not DEEPSPEED:
        pytest.skip("DeepSpeed is the optional extra seqpar[deepspeed]")
    example, batch, dp = UPSTREAM[name]
    fixture = "yaml_runs" if name in YAML_LAUNCHED else "two_ranks" if dp == 1 else "more_ranks"
    root = request.getfixturevalue(fixture)
    found, want = _load(root / f"{name}.pt"), _load(root / "reference" / f"{name}.pt")
    # the data exercise an epoch end: a short last batch, and at dp 2 a last round where one replica has a short
    # batch (the Trainer example) or none at all (TRL's); TRL's distributed-training snippets take 1 row a batch
    rows, last = want["rows"], want["rows"] % (batch * dp)
    if batch > 1:
        assert last > 0 and rows % batch, f"{name}: {rows} rows fill every batch"
    if dp == 2:
        no_row = example.startswith(("trl_", "alst_"))  # one replica has no row left in the last round
        assert last > 0 and (last <= batch) == no_row, f"{name}: {last} rows in the last round"
    # TRL's YAMLs set the degrees: context parallel 2 (accelerate's all-gather), Ulysses 2 x 2 replicas
    expected = {"trl_cp_yaml": (2, 1, "allgather"), "trl_alst_yaml": (2, 2, "ulysses")}
    expected |= dict.fromkeys(DEEPSPEED_EXAMPLES, (2, 2, "ulysses"))
    assert found["sequence"] == expected.get(name, (2, 1, "auto"))
    # TRL's ALST YAML runs DeepSpeed ZeRO-3 (Note [DeepSpeed under the Trainer]); the others DDP
    engines = {"trl_alst_yaml": "DeepSpeedEngine ZeRO-3"} | dict.fromkeys(DEEPSPEED_EXAMPLES, "DeepSpeedEngine ZeRO-2")
    assert found["engine"] == engines.get(name, "DistributedDataParallel")
    assert want["log"][-1][1] >= 2 and [row[:2] for row in found["log"]] == [row[:2] for row in want["log"]]
    tolerances = {"loss": LOSS_RTOL, "grad_norm": GRAD_NORM_RTOL, "num_tokens": 0.0}
    if name == "trl_alst_yaml":  # num_tokens counts the pad_to_multiple_of padding, added per replica's row at dp 2
        tolerances["num_tokens"] = 1e-2  # (as TRL's own DDP run adds it), per batch of dp rows in one process
    assert found["keys"] == want["keys"]
    for i, key in enumerate(want["keys"], start=2):
        got, ref = (torch.tensor([row[i] for row in run["log"]], dtype=torch.float64) for run in (found, want))
        torch.testing.assert_close(
            got, ref, rtol=tolerances.get(key, LOSS_RTOL), atol=0, msg=lambda m, k=key: f"{k}: {m}"
        )
    for n, ref in want["params"].items():
        torch.testing.assert_close(found["params"][n], ref, rtol=0, atol=PARAM_RTOL * float(ref.abs().max()))


def _replica_batches(rows: int, batch: int, dp: int, drop_last: bool = False, **options) -> list[list[list[int]]]:
    """Each replica's batches of a loader that accelerate prepared for dp x sp 2 processes, sharded by replica."""
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader

    from seqpar.hf.loaders import shard_by_replica

    out = []
    for replica in range(dp):
        ids = {"collate_fn": lambda f: {"input_ids": torch.tensor(f)[None]}}
        loader = DataLoader(list(range(rows)), batch_size=batch, drop_last=drop_last, **ids)
        rank = 2 * replica  # the first rank of the replica's sp group
        loader = prepare_data_loader(loader, num_processes=2 * dp, process_index=rank, put_on_device=False, **options)
        loader = shard_by_replica(loader, dp, replica, world_size=2 * dp)
        assert len(loader) == len(list(loader))
        out.append([b["input_ids"].flatten().tolist() for b in loader])
    return out


@pytest.mark.parametrize("rows", [20, 21, 23, 24, 3])
def test_replica_batches_are_one_process_batches(rows):
    """Note [epoch ends]: every replica gets as many batches, none repeats a row, and each round's rows are one
    process's batch of dp x B rows (empty batches where a replica has none left)."""
    for dp in (1, 2, 3):
        batches = _replica_batches(rows, 4, dp)
        assert len({len(b) for b in batches}) == 1
        one_process = [list(range(i, min(i + 4 * dp, rows))) for i in range(0, rows, 4 * dp)]
        rounds = [[row for b in batches for row in b[k]] for k in range(len(batches[0]))]
        assert rounds == one_process
        split = _replica_batches(rows, 4 * dp, dp, split_batches=True)  # one batch of dp x B rows shared out
        assert [[row for b in split for row in b[k]] for k in range(len(split[0]))] == one_process
        dropped = _replica_batches(rows, 4, dp, drop_last=True)  # one process drops its short last batch
        assert [[row for b in dropped for row in b[k]] for k in range(len(dropped[0]))] == [
            b for b in one_process if len(b) == 4 * dp
        ]
