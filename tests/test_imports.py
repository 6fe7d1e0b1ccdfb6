"""What ``import seqpar``, its common names and the command line load: no trainer stacks where they are not used.

Behavioural checks on ``sys.modules`` of fresh interpreters; how long they take is ``python -m benchmarks.imports``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

HEAVY = (
    "transformers",
    "torch.distributed.pipelining",
    "accelerate",
    "trl",
    "datasets",
    "matplotlib",
    "tensorboard",
    "seqpar.diagnosis",
    "seqpar.bench.attention",
)
"""Modules that only the doors, the doctor and the benches need."""


HELP = "from seqpar.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass"
PLAN = (
    "import contextlib, io\nfrom seqpar.cli import main\n"
    "with contextlib.redirect_stdout(io.StringIO()):\n"
    "    assert main(['plan', '--model', 'llama-8b', '--seq-len', '128K', '--gpus', '8']) == 0"
)
NAMES = "import seqpar\nseqpar.make_mesh, seqpar.attention, seqpar.shard_batch, seqpar.cross_entropy"
HF_CONFIG = "import seqpar.hf\nseqpar.hf.SequenceParallelConfig"
HF_TRAINER = "import seqpar.hf\nseqpar.hf.SequenceParallelTrainer"
TOGETHER = (NAMES, HF_CONFIG, HF_TRAINER, "import seqpar", HELP, PLAN)
"""What the slower tests below run, each in a fresh interpreter, started together (their imports fill both cores)."""


def _start(code: str) -> subprocess.Popen:
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _loaded(process: subprocess.Popen) -> set[str]:
    """The names in ``sys.modules`` after the fresh interpreter ``process`` ran its code."""
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    return set(json.loads(out.splitlines()[-1]))


@pytest.fixture(scope="module")
def started() -> Iterator[dict[str, subprocess.Popen]]:
    """The scripts of ``TOGETHER``, each started in a fresh interpreter, by script (each test reads its own)."""
    processes = {code: _start(code) for code in TOGETHER}
    yield processes
    for process in processes.values():
        if process.returncode is None:  # no selected test read it
            process.kill()
            process.communicate()


def _heavy(loaded: set[str]) -> list[str]:
    return [name for name in HEAVY if name in loaded]


def test_import_seqpar_and_its_common_names_load_no_trainer_stack(started):
    loaded = _loaded(started[NAMES])
    assert _heavy(loaded) == []
    assert "seqpar.sequence_parallel.api" in loaded  # the names did resolve


def test_import_seqpar_hf_loads_the_trainer_stacks_only_when_a_name_needs_them(started):
    assert _heavy(_loaded(started[HF_CONFIG])) == []
    trainer = _loaded(started[HF_TRAINER])
    assert "transformers" in trainer and "trl" not in trainer  # TRL waits for its own trainers


def test_import_seqpar_alone_loads_no_torch(started):
    assert "torch" not in _loaded(started["import seqpar"])


def test_cli_help_and_plan_load_no_transformers_or_pipelining(started):
    assert "torch" not in _loaded(started[HELP])
    plan = _loaded(started[PLAN])
    assert _heavy(plan) == []
    assert "seqpar.planning.search" in plan


@pytest.mark.fast
def test_plan_loads_no_torch():
    """Planning is arithmetic on sizes (Note [torch-free planning]): the planner and ``seqpar plan`` load no torch."""
    loaded = _loaded(
        _start(
            "import contextlib, io\nfrom seqpar.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert main(['plan', '--model', 'llama-8b', '--seq-len', '16M', '--gpus', '1024']) == 0\n"
            "import seqpar.planning\n"
            "found = seqpar.planning.plan('llama-8b', 1 << 20, seqpar.planning.Cluster(gpus=64))\n"
            "assert found.candidates and found.candidates[0].peak_bytes > 0"
        )
    )
    assert "torch" not in loaded
    assert {"seqpar.planning.search", "seqpar.memory.estimate"} <= loaded  # the plan did run


@pytest.mark.fast
def test_import_seqpar_adds_no_import_hook_and_old_module_names_are_gone():
    """The package faces resolve names (PEP 562); no finder on ``sys.meta_path`` answers for moved modules."""
    code = (
        "import importlib, sys\n"
        "before = list(sys.meta_path)\n"
        "import seqpar, seqpar.hf, seqpar.sequence_parallel.layouts\n"
        "assert sys.meta_path == before, sys.meta_path\n"
        "for old in ('seqpar.api', 'seqpar.strategies', 'seqpar.placement', 'seqpar.hf.grpo_loss'):\n"
        "    try:\n"
        "        importlib.import_module(old)\n"
        "    except ModuleNotFoundError:\n"
        "        continue\n"
        "    raise AssertionError(old)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
