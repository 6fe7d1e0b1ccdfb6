"""``seqpar train`` driven as a user would: subprocesses, real files, checkpoints, and bad input.

Small settings keep each run to seconds; the embedded default itself is timed in docs/guides/train.md, not here.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

import pytest
import torch

import seqpar
from seqpar.cli import main as cli_main
from seqpar.errors import SeqparInputError
from tests._commands import seqpar_command

TINY = "--seq-len 192 --batch-size 2 --grad-accum 2 --hidden-size 32 --layers 1 --heads 2 --eval-examples 4 "
TINY = (TINY + "--eval-lengths 192 --log-every 1 --warmup-steps 2").split()
PIPES = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}


def seqpar_train(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return seqpar_trains(args, timeout=timeout)[0]


def seqpar_trains(*runs: Sequence[str], timeout: int = 240, fresh: bool = False) -> list[subprocess.CompletedProcess]:
    """``seqpar train`` with each of ``runs``' arguments, started together (independent runs overlap on the
    machine's cores): forked from the session's command server (Note [forked commands]); with ``fresh``, the
    first of them in a new interpreter, as from a shell."""
    started = [
        subprocess.Popen([sys.executable, "-m", "seqpar.cli", "train", *args], **PIPES, text=True)
        if fresh and i == 0
        else seqpar_command(["train", *args], **PIPES)
        for i, args in enumerate(runs)
    ]
    done = []
    for process in started:
        out, err = process.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    return done


def losses(run_dir, key: str = "loss") -> dict[int, float]:
    """Per-step ``key`` ("loss", "grad_norm", ...) of the training records in ``run_dir``'s metrics."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: r[key] for r in records if r["kind"] == "train"}


def _plain_accuracy(checkpoint, step: int) -> tuple[float, float]:
    """Pass-key accuracy of a TINY run's checkpoint on its 4 eval examples, by one process: the prediction
    at each scored position p - 1 (the model's argmax) against the token at p; and the same with the
    prediction read one position off (p - 2), what a broken evaluation would report."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict

    from seqpar.train.checkpoint import load_checkpoint
    from seqpar.train.config import TrainConfig
    from seqpar.train.model import build_model
    from seqpar.train.passkey import PasskeyTask
    from seqpar.train.tokenizer import ByteTokenizer

    model = build_model(TrainConfig(hidden_size=32, layers=1, heads=2, seq_len=192), 258)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state, "scheduler": scheduler.state_dict()}
    assert load_checkpoint(str(checkpoint), state) == step
    set_model_state_dict(model, state["model"])
    ids, answers = PasskeyTask(ByteTokenizer(), 0).batch(192, list(range(4)), "eval")
    with torch.no_grad():
        argmax = model(input_ids=ids).logits.argmax(-1)
    assert answers.numel() == 4 * 63
    right, off = (argmax.gather(1, answers - k) == ids.gather(1, answers) for k in (1, 2))
    return float(right.double().mean()), float(off.double().mean())


def _checkpoint_model(checkpoint, run_dir) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The run's model with the weights of ``checkpoint`` read here by torch's own DCP converter (not seqpar's
    reader), and the same model as the run initialised it (its seed)."""
    from dataclasses import fields

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from seqpar.train.config import TrainConfig
    from seqpar.train.data import load_tokenizer
    from seqpar.train.model import build_model

    values = json.loads((run_dir / "config.json").read_text())
    config = TrainConfig(**{f.name: values[f.name] for f in fields(TrainConfig)})
    tokenizer = load_tokenizer(values["tokenizer_used"])
    vocab = getattr(tokenizer, "vocab_size", None) or len(tokenizer)
    whole = run_dir / f"{checkpoint.name}.pt"
    dcp_to_torch_save(str(checkpoint), str(whole))
    saved = torch.load(whole, weights_only=False)["model"]
    trained, initial = build_model(config, vocab), build_model(config, vocab)
    trained.load_state_dict(saved)  # strict: every tensor of the model is in the checkpoint
    trained.tie_weights()
    return trained.eval(), initial.eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids).logits


def assert_export_is_the_run(hf, checkpoint, run_dir, stale: dict[str, str]) -> None:
    """``from_pretrained(hf)`` in this process gives the logits of the run's model with the weights of its
    ``checkpoint`` (rel 1e-6); with the tensors named in ``stale`` partly left at their initial values (``"rows"``,
    ``"columns"``: the second half, as a shard not gathered; ``"all"``: as a pipeline stage not sent) the same
    comparison fails."""
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(str(hf)).eval()
    trained, initial = _checkpoint_model(checkpoint, run_dir)
    got, want = _logits(exported), _logits(trained)
    tolerance = {"rtol": 1e-6, "atol": 1e-6 * float(want.abs().max())}
    torch.testing.assert_close(got, want, **tolerance)
    state, start = trained.state_dict(), initial.state_dict()
    assert stale
    for name, part in stale.items():
        half = slice(state[name].shape[part == "columns"] // 2, None) if part != "all" else slice(None)
        index = (slice(None), half) if part == "columns" else (half,)
        kept = state[name].clone()
        with torch.no_grad():
            state[name][index] = start[name][index]
        with pytest.raises(AssertionError):
            torch.testing.assert_close(got, _logits(trained), **tolerance)
        with torch.no_grad():
            state[name].copy_(kept)


def assert_same_export(one, other) -> None:
    """Two Hugging Face model directories with the same files, the same config and the same tensors."""
    from safetensors.torch import load_file

    assert sorted(os.listdir(one)) == sorted(os.listdir(other))
    assert json.loads((one / "config.json").read_text()) == json.loads((other / "config.json").read_text())
    mine, theirs = load_file(one / "model.safetensors"), load_file(other / "model.safetensors")
    assert sorted(mine) == sorted(theirs)
    for name, tensor in mine.items():
        assert torch.equal(tensor, theirs[name]), name


def test_run_directory_evaluation_and_sp_degrees_agree(tmp_path):
    full, single, early = tmp_path / "full", tmp_path / "single", tmp_path / "early"
    done, first, one = seqpar_trains(
        [*TINY, "--steps", "6", "--run-dir", str(full)],
        [*TINY, "--steps", "1", "--run-dir", str(early), "--no-export-hf"],
        [*TINY, "--steps", "6", "--sp", "1", "--run-dir", str(single)],
        fresh=True,
    )
    assert done.returncode == 0, done.stderr
    assert f"run directory: {full}" in done.stdout
    for name in ("config.json", "metrics.jsonl", "loss.png", "tokens_per_s.png", "memory.png", "eval.json"):
        assert (full / name).is_file(), name
    assert any((full / "tensorboard").iterdir())
    assert sorted(os.listdir(full / "hf")) == ["config.json", "generation_config.json", "model.safetensors"]
    assert (full / "checkpoints" / "step_0000006" / "seqpar_complete.json").is_file()
    curve = losses(full)
    assert sorted(curve) == [1, 2, 3, 4, 5, 6] and curve[6] < curve[1]
    answer_curve = losses(full, "answer_loss")  # the loss on the scored recited letters
    assert sorted(answer_curve) == [1, 2, 3, 4, 5, 6]
    evaluation = json.loads((full / "eval.json").read_text())
    assert evaluation["task"] == "pass-key recitation" and evaluation["chance"] == pytest.approx(1 / 26)
    assert list(evaluation["accuracy"]) == ["192"] and 0 <= evaluation["accuracy"]["192"] <= 1
    assert evaluation["answers"] == {"192": 4 * 63}  # 4 examples, letters 129-191 of the first recitation
    # the trainer's accuracy against one plain forward of its checkpoint, read here; after one step the
    # model's argmax still varies along the sequence (after six it is one letter everywhere), so an
    # evaluation reading the prediction one position off would be caught: that count differs
    assert first.returncode == 0, first.stderr
    assert not (early / "hf").exists() and not (early / "hf.partial").exists()
    plain, one_off = _plain_accuracy(early / "checkpoints" / "step_0000001", 1)
    assert abs(plain - one_off) > 1 / (4 * 63)
    reported = json.loads((early / "eval.json").read_text())["accuracy"]["192"]
    assert abs(reported - plain) <= 1 / (4 * 63)  # at most one near-tie flipped by float rounding

    # stopped and resumed in place, the run repeats this one exactly: tests/test_resilience.py (by a signal)

    # one rank on the whole sequence gives the same curves and evaluation as two ranks sharing it (fp32)
    assert one.returncode == 0, one.stderr
    for step, loss in losses(single).items():
        assert loss == pytest.approx(curve[step], rel=1e-4), step
    for step, loss in losses(single, "answer_loss").items():
        assert loss == pytest.approx(answer_curve[step], rel=1e-4), step
    single_eval = json.loads((single / "eval.json").read_text())
    # the same argmax on every answer, but for at most one near-tie flipped by float rounding
    assert abs(single_eval["accuracy"]["192"] - evaluation["accuracy"]["192"]) <= 1 / (4 * 63)


def test_passkey_examples_are_deterministic_and_answered_from_another_rank():
    from seqpar.sequence_parallel.layouts.chunks import shard_for_rank
    from seqpar.train.config import TrainConfig
    from seqpar.train.passkey import BLOCK, PasskeyTask
    from seqpar.train.tokenizer import ByteTokenizer

    task = PasskeyTask(ByteTokenizer(), seed=0)
    length = TrainConfig().seq_len  # the default run's
    ids, answers = task.example(length, 5)
    assert len(ids) == length and (ids, answers) == task.example(length, 5)  # a function of its arguments
    assert PasskeyTask(ByteTokenizer(), seed=0).example(length, 5) == (ids, answers)
    for other in (
        task.example(length, 6),
        task.example(length, 5, "eval"),
        PasskeyTask(ByteTokenizer(), 1).example(length, 5),
    ):
        assert other[0] != ids
    assert len(answers) == 2 * (BLOCK - 1) and all(ids[p] == ids[p - BLOCK] for p in answers)
    assert all(97 <= t <= 122 for t in ids)
    # under the zigzag layout, each scored letter is predicted (at p - 1) on another rank than its key's letter
    for sp in (2, 4):
        owner = {}
        for rank in range(sp):
            for p in shard_for_rank(torch.arange(length)[None], rank, sp, 1, "zigzag")[0].tolist():
                owner[p] = rank
        assert all(owner[p - 1] != owner[p - BLOCK] for p in answers), sp
    with pytest.raises(SeqparInputError, match="too short for the passkey task"):
        task.example(BLOCK, 0)


def test_passkey_answers_follow_the_placed_row():
    """Under --layout placed the answer labels are laid out with their batch's placed (padded) row, also at a
    length where the placed row is padded otherwise than the layout's own multiple would pad it."""
    from types import SimpleNamespace

    from seqpar.train.config import TrainConfig
    from seqpar.train.state import TrainSource
    from seqpar.train.step import _micro_batches
    from seqpar.train.tokenizer import ByteTokenizer

    config = TrainConfig(seq_len=260, batch_size=2, grad_accum=1, layout="placed", sp=1)  # placed: 288 tokens
    run = SimpleNamespace(config=config, dp_rank=0, mesh=None, source=TrainSource(config, ByteTokenizer(), ""))
    (shard,), (answers,) = _micro_batches(run, 0)
    assert shard.layout.name == "placed" and answers.shape == shard["shift_labels"].shape == (2, 288)
    scored = answers != -100
    want = run.source.batch([0, 1])[1]  # the batch's answer labels, in the row's order
    assert int(scored.sum()) == int((want != -100).sum()) > 0
    assert torch.equal(answers[scored], shard["shift_labels"][scored])  # the next token, where it is scored


def test_real_data_files_and_local_model_config(tmp_path):
    docs = tmp_path / "docs.jsonl"
    with open(docs, "w") as f:
        for i in range(40):
            f.write(json.dumps({"body": f"Document {i}. " + "Long context matters. " * (1 + i % 11)}) + "\n")
    model = tmp_path / "model"
    model.mkdir()
    config = {  # a mixture of experts whose router loss is part of the loss (output_router_logits)
        "model_type": "qwen3_moe",
        "vocab_size": 260,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "output_router_logits": True,
        "router_aux_loss_coef": 0.1,
    }
    (model / "config.json").write_text(json.dumps(config))
    # a tokenizer directory as transformers saves one (a word-level tokenizer trained here, nothing downloaded)
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.train_from_iterator(
        ["Document 0 1 2 3 4 5 6 7 8 9. Long context matters."],
        trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]", "[EOS]"]),
    )
    PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]"
    ).save_pretrained(str(model))  # next to config.json: the default tokenizer for --data
    run, whole = tmp_path / "run", tmp_path / "whole"
    files = ["--data", str(docs), "--text-field", "body", "--model", str(model), "--seq-len", "100"]
    files += ["--batch-size", "2", "--grad-accum", "2", "--steps", "3"]  # micro-batches of one packed row
    # Parquet data, for a run with data parallel over 2 ranks, bf16 autocast and activation checkpointing, from a
    # YAML file; all four runs start together
    import datasets

    parquet = tmp_path / "docs.parquet"
    datasets.Dataset.from_dict({"text": [f"Parquet document {i}. " * (2 + i % 5) for i in range(30)]}).to_parquet(
        str(parquet)
    )
    settings = tmp_path / "settings.yaml"
    settings.write_text("dp: 2\nsp: 2\nprecision: bf16\nactivation_checkpointing: true\nsteps: 2\n")
    auto, run2 = tmp_path / "auto", tmp_path / "run2"
    # the packed rows of uneven documents at sp 2 under the balanced layout, under "auto" (the placed layout on
    # these rows: reordered and padded), and on one rank: the same run (the logged loss includes 0.1 x the
    # router's load-balancing loss, counted over both ranks' tokens)
    sharded = ((run, "ulysses", "balanced"), (auto, "ring", "auto"))
    *runs, one, parquet_run = seqpar_trains(
        *(
            [*files, "--run-dir", str(where), "--strategy", strategy, "--layout", layout]
            for where, strategy, layout in sharded
        ),
        [*files, "--run-dir", str(whole), "--sp", "1"],
        [*TINY, "--config", str(settings), "--data", str(parquet), "--run-dir", str(run2)],
    )
    for (where, strategy, layout), done in zip(sharded, runs, strict=True):
        assert done.returncode == 0, done.stderr
        assert f"; {layout} layout (solved per batch)" in done.stdout
        resolved = json.loads((where / "config.json").read_text())
        assert resolved["strategy"] == strategy and resolved["tokenizer_used"] == str(model)
        assert resolved["layout"] == layout
        # each step's record: the layout rank 0 cut each micro-batch with ("auto" placed every packed row)
        layouts = losses(where, "layouts")
        assert layouts == {s: 2 * ["balanced" if layout == "balanced" else "placed"] for s in (1, 2, 3)}, layouts
    assert one.returncode == 0, one.stderr
    for where, (key, rel) in itertools.product((run, auto), (("loss", 1e-4), ("grad_norm", 1e-5))):
        assert losses(where, key) == pytest.approx(losses(whole, key), rel=rel), (where.name, key)
    # the steps' batches (read back as the run read them) are laid out otherwise than zigzag, and placed in
    # another order than the row's, padded
    from seqpar.train.data import FileRows, load_tokenizer

    rows = FileRows([str(docs)], load_tokenizer(str(model)), 100, "body", 0, str(run / "data"))
    positions = [rows.batch([i])["position_ids"] for i in range(6)]
    assert any(seqpar.balanced_layout(p, 2).chunk_ids != ((0, 3), (1, 2)) for p in positions)
    placed = [seqpar.placed_layout(p, 2).order[0] for p in positions]
    assert all(o.shape[0] > 100 and not torch.equal(o[o >= 0], torch.arange(100)) for o in placed), placed
    # the Parquet run: data parallel over 2 ranks, bf16 autocast and activation checkpointing, from a YAML file
    assert parquet_run.returncode == 0, parquet_run.stderr
    resolved = json.loads((run2 / "config.json").read_text())
    assert (resolved["dp"], resolved["precision"], resolved["activation_checkpointing"]) == (2, "bf16", True)
    assert sorted(losses(run2)) == [1, 2]
    # the trained models as Hugging Face directories: dp 2 x sp 2, and the mixture of experts with its tokenizer
    stale = {"model.layers.0.self_attn.q_proj.weight": "rows"}
    assert_export_is_the_run(run2 / "hf", run2 / "checkpoints" / "step_0000002", run2, stale)
    assert_export_is_the_run(run / "hf", run / "checkpoints" / "step_0000003", run, stale)
    from transformers import AutoTokenizer

    text = "Document 7. Long context matters."
    exported, given = (AutoTokenizer.from_pretrained(str(where)) for where in (run / "hf", model))
    assert exported(text)["input_ids"] == given(text)["input_ids"] != []


def test_tensor_and_data_parallel_runs_match_the_sequence_parallel_run(tmp_path):
    common = [*TINY, "--heads", "4", "--steps", "2", "--eval-examples", "2"]
    part = tmp_path / "fsdp"
    tp, sp, ddp, fsdp_first = seqpar_trains(
        [*common, "--tp", "2", "--sp", "1", "--run-dir", str(tmp_path / "tp")],
        [*common, "--sp", "2", "--run-dir", str(tmp_path / "sp")],
        # parameters replicated over the 2 SP ranks by torch's DDP
        [*common, "--sp", "2", "--dp-mode", "ddp", "--run-dir", str(tmp_path / "ddp")],
        # parameters sharded by FSDP2 (step 1); its parameters and optimizer state go through the checkpoint and
        # resume into a run whose parameters, gradients and AdamW state live in host memory (Note [optimizer
        # offload]; step 2 below): CPU offload's code path (policy, AdamW on host DTensors, clip_grad_norm_, its
        # final checkpoint) gives the losses and gradient norms of the unsharded run
        [*common, "--sp", "2", "--dp-mode", "fsdp", "--run-dir", str(part), "--stop-at", "1"],
    )
    for done in (tp, sp, ddp, fsdp_first):
        assert done.returncode == 0, done.stderr
    # the same run started by torchrun instead of spawned by the command, with the output projection and loss
    # in pieces of 40 tokens instead of whole logits; beside the FSDP2 run's resumed step
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "seqpar.cli", "train"]
    launched = subprocess.Popen(
        [*torchrun, *common, "--sp", "2", "--loss-chunk", "40", "--run-dir", str(tmp_path / "torchrun")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    done = seqpar_train(
        *common, "--sp", "2", "--dp-mode", "fsdp", "--run-dir", str(part), "--resume", "auto", "--offload-optimizer"
    )
    assert done.returncode == 0, done.stderr
    assert "host memory" in done.stdout and json.loads((part / "config.json").read_text())["offload_optimizer"]
    assert (part / "checkpoints" / "step_0000002" / "seqpar_complete.json").is_file()
    _, err = launched.communicate(timeout=240)
    assert launched.returncode == 0, err
    assert json.loads((tmp_path / "torchrun" / "config.json").read_text())["launcher"] == "torchrun"
    # the Hugging Face directories of the tensor-parallel run and of the FSDP2 run (resumed, host-offloaded):
    # gathered from tp shards (q_proj by rows, o_proj by columns) and FSDP2 shards (by rows); seqpar export of the
    # final checkpoint writes the same directory
    tp_stale = {"model.layers.0.self_attn.q_proj.weight": "rows", "model.layers.0.self_attn.o_proj.weight": "columns"}
    tp_dir = tmp_path / "tp"
    assert_export_is_the_run(tp_dir / "hf", tp_dir / "checkpoints" / "step_0000002", tp_dir, tp_stale)
    fsdp_stale = {"model.layers.0.mlp.down_proj.weight": "rows", "model.embed_tokens.weight": "rows"}
    assert_export_is_the_run(part / "hf", part / "checkpoints" / "step_0000002", part, fsdp_stale)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert cli_main(["export", str(part / "checkpoints" / "step_0000002"), str(tmp_path / "exported")]) == 0
    assert_same_export(tmp_path / "exported", part / "hf")
    sp_losses = losses(tmp_path / "sp")
    # gradient accumulation 2 (TINY): the gradient norm before clipping sees a micro-batch counted twice, which
    # Adam's first updates would hide from the loss
    for other in ("fsdp", "ddp", "tp"):
        assert losses(tmp_path / other, "grad_norm") == pytest.approx(losses(tmp_path / "sp", "grad_norm"), rel=1e-5)
    for other in ("tp", "fsdp", "ddp", "torchrun"):
        got = losses(tmp_path / other)
        assert sorted(got) == [1, 2], other
        for step, loss in sp_losses.items():
            assert got[step] == pytest.approx(loss, rel=1e-4), (other, step)


def test_pipeline_runs_match_one_process_and_resume_across_layouts(tmp_path):
    """--pp 2 --sp 2 (4 ranks) and --pp 2 with GPipe give one process's losses, gradient norms and evaluation; a
    checkpoint written at pp 2 x sp 2 resumes at pp 1 x sp 1 with the uninterrupted run's next step."""
    common = [*TINY, "--layers", "2", "--batch-size", "4", "--steps", "2", "--eval-examples", "2"]
    split = tmp_path / "split"
    one, gpipe, first = seqpar_trains(
        [*common, "--sp", "1", "--run-dir", str(tmp_path / "one")],
        [*common, "--sp", "1", "--pp", "2", "--pp-schedule", "gpipe", "--run-dir", str(tmp_path / "gp")],
        # pp 2 x sp 2, stopped at step 1; resumed at sp 1 below
        [*common, "--pp", "2", "--sp", "2", "--pp-microbatches", "2", "--stop-at", "1", "--run-dir", str(split)],
    )
    for done in (one, gpipe, first):
        assert done.returncode == 0, done.stderr
    assert "mesh: pp 2 (gpipe, 2 micro-batches) x dp 1 x sp 1" in gpipe.stdout
    # the Hugging Face directory of a pipeline run: each stage's parameters under the whole model's names (the
    # second stage holds layer 1, the final norm and the head)
    stage = {name: "all" for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight")}
    stage["lm_head.weight"] = "all"
    gp = tmp_path / "gp"
    assert_export_is_the_run(gp / "hf", gp / "checkpoints" / "step_0000002", gp, stage)
    # the directory of step 1 at pp 2 x sp 2, and seqpar export's of that checkpoint
    step1 = split / "checkpoints" / "step_0000001"
    assert_export_is_the_run(split / "hf", step1, split, stage)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert cli_main(["export", str(step1), str(tmp_path / "exported")]) == 0
    assert_same_export(tmp_path / "exported", split / "hf")
    done = seqpar_train(*common, "--sp", "1", "--resume", "auto", "--run-dir", str(split))
    assert done.returncode == 0, done.stderr
    assert "written at pp 2 x dp 1 x sp 2 x tp 1, replicate; resharded to pp 1 x dp 1 x sp 1" in done.stdout
    for key in ("loss", "grad_norm"):
        want = losses(tmp_path / "one", key)
        assert sorted(want) == [1, 2]
        for run in ("gp", "split"):  # split: step 1 at pp 2 x sp 2, step 2 resumed from its checkpoint at sp 1
            assert losses(tmp_path / run, key) == pytest.approx(want, rel=1e-5), (run, key)
    accuracy = [json.loads((tmp_path / run / "eval.json").read_text())["accuracy"]["192"] for run in ("one", "gp")]
    assert abs(accuracy[0] - accuracy[1]) <= 1 / (2 * 63)  # the stages gathered into every rank's whole model


def test_bad_input_fails_clearly(tmp_path):
    short_model = tmp_path / "short.json"
    short_model.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 258,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "max_position_embeddings": 256,
            }
        )
    )
    wrong_column = tmp_path / "wrong.jsonl"
    wrong_column.write_text(json.dumps({"body": "text under another name"}) + "\n")
    cases = [
        (["--data", str(tmp_path / "missing.jsonl")], "file or directory not found"),
        (["--data", str(wrong_column)], "data has no column 'text'"),  # found by rank 0, raised on every rank
        (["--strategy", "spiral"], "unknown strategy 'spiral'"),
        (["--nproc", "3", "--sp", "2"], "does not match the 3 ranks"),
        (["--tp", "2", "--heads", "2"], "must divide the heads"),
        (["--loss-chunk", "64", "--dp-mode", "fsdp"], "--loss-chunk needs --dp-mode replicate"),
        (["--tokenizer", str(tmp_path)], "the passkey task uses seqpar's byte tokenizer"),
        (["--model", str(short_model), "--seq-len", "512"], "longer than the model takes"),
        (["--seq-len", "64"], "too short for the passkey task"),
        (["--config", str(tmp_path / "nope.yaml")], "config file not found"),
        (["--resume", str(tmp_path)], "not a complete seqpar checkpoint"),
        (["--pp", "2", "--layers", "1"], "needs 2 pipeline stages of at least one decoder layer each"),
        (["--pp", "2", "--pp-microbatches", "1"], "--pp-microbatches 1 is fewer than --pp 2"),
        (["--layout", "balanced", "--pp", "2"], "--layout balanced cannot be combined with --pp > 1"),
        (["--layout", "auto", "--pp", "2"], "--layout auto cannot be combined with --pp > 1"),
        (["--offload-activations"], "add --activation-checkpointing"),
    ]
    # the data problems are found by rank 0 after the ranks start, and one settings error goes through the
    # console script as a user meets it; the other settings are refused before any rank starts, so they run
    # in this process (an interpreter start each would cost the suite seconds apiece)
    in_subprocess = [i for i, (args, _) in enumerate(cases) if args[0] in ("--data", "--strategy")]
    runs = ([*cases[i][0], "--run-dir", str(tmp_path / f"bad{i}")] for i in in_subprocess)
    launched = dict(zip(in_subprocess, seqpar_trains(*runs), strict=True))
    for i, (args, message) in enumerate(cases):
        if i in launched:
            code, stderr = launched[i].returncode, launched[i].stderr
        else:
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                code = cli_main(["train", *args, "--run-dir", str(tmp_path / "bad")])
            stderr = err.getvalue()
        assert code != 0, args
        assert message in stderr, (args, stderr)


def test_damaged_and_half_written_checkpoints_are_refused(tmp_path):
    run = tmp_path / "run"
    done = seqpar_train(*TINY, "--steps", "2", "--run-dir", str(run), "--save-every", "1")
    assert done.returncode == 0, done.stderr
    ckpts = run / "checkpoints"
    # a half-written checkpoint (no completion marker) is never picked up as the latest
    os.rename(ckpts / "step_0000002", ckpts / "step_0000002.partial")
    os.remove(ckpts / "step_0000002.partial" / "seqpar_complete.json")
    resumed = seqpar_train(*TINY, "--steps", "3", "--run-dir", str(run), "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert "step_0000001 at step 1" in resumed.stdout
    # a complete checkpoint damaged afterwards: clear error, non-zero exit, no hang
    target = ckpts / "step_0000003"
    data_file = next(p for p in target.iterdir() if p.suffix == ".distcp")
    with open(data_file, "r+b") as f:
        f.truncate(10)
    broken = seqpar_train(*TINY, "--steps", "4", "--run-dir", str(run), "--resume", str(target))
    assert broken.returncode != 0
    assert "is damaged" in broken.stderr
    # seqpar export refuses the same checkpoints, a missing one, one without its run's settings, and an output
    # directory that holds files
    moved = tmp_path / "moved"
    shutil.copytree(ckpts / "step_0000001", moved / "step_0000001")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    cases = [
        ([str(ckpts / "step_0000002.partial"), str(tmp_path / "out")], "is not a complete seqpar checkpoint"),
        ([str(target), str(tmp_path / "out")], "is damaged"),
        ([str(ckpts / "step_0000009"), str(tmp_path / "out")], "checkpoint directory not found"),
        ([str(moved / "step_0000001"), str(tmp_path / "out")], "run settings not found"),
        ([str(ckpts / "step_0000001"), str(tmp_path / "full")], "exists and is not an empty directory"),
    ]
    for args, message in cases:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            assert cli_main(["export", *args]) == 2, args
        assert message in err.getvalue(), (args, err.getvalue())
        assert not (tmp_path / "out").exists()
    from seqpar.train.export import export_checkpoint

    with pytest.raises(SeqparInputError, match="exists and is not an empty directory"):
        export_checkpoint(str(ckpts / "step_0000001"), str(tmp_path / "full"))
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"


def test_a_local_hybrid_model_trains_at_sp_2_as_at_sp_1(tmp_path):
    """A hybrid (LFM2: short convolutions between attention layers) from a local config directory under
    ``seqpar train --model``: its convolutions exchange their halos (Note [halo convolution]), so sp 2 logs sp 1's
    losses and gradient norms on the same packed rows."""
    model = tmp_path / "model"
    model.mkdir()
    config = {
        "model_type": "lfm2",
        "vocab_size": 260,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "layer_types": ["conv", "full_attention", "conv"],
        "conv_L_cache": 3,
    }
    (model / "config.json").write_text(json.dumps(config))
    runs = {sp: tmp_path / f"sp{sp}" for sp in (1, 2)}
    for done in seqpar_trains(
        *(
            [*TINY, "--model", str(model), "--steps", "3", "--sp", str(sp), "--run-dir", str(where)]
            for sp, where in runs.items()
        )
    ):
        assert done.returncode == 0, done.stderr
    for key, rel in (("loss", 1e-4), ("grad_norm", 1e-4)):
        assert losses(runs[2], key) == pytest.approx(losses(runs[1], key), rel=rel), key
    # its tied embeddings in the Hugging Face directory as transformers keeps them: saved once, tied on loading
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    hf = runs[2] / "hf"
    assert_export_is_the_run(
        hf, runs[2] / "checkpoints" / "step_0000003", runs[2], {"model.embed_tokens.weight": "columns"}
    )
    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    exported = AutoModelForCausalLM.from_pretrained(str(hf))
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
