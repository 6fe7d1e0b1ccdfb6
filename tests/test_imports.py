"""What ``import seqpar``, its common names and the command line load: no trainer stacks where they are not used.

Behavioural checks on ``sys.modules`` of fresh interpreters; how long they take is ``python -m benchmarks.imports``.
"""

from __future__ import annotations

import json
import subprocess
import sys

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


def _loaded(code: str) -> set[str]:
    """The names in ``sys.modules`` after a fresh interpreter runs ``code``."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return set(json.loads(done.stdout.splitlines()[-1]))


def _heavy(loaded: set[str]) -> list[str]:
    return [name for name in HEAVY if name in loaded]


def test_import_seqpar_and_its_common_names_load_no_trainer_stack():
    loaded = _loaded("import seqpar\nseqpar.make_mesh, seqpar.attention, seqpar.shard_batch, seqpar.cross_entropy")
    assert _heavy(loaded) == []
    assert "seqpar.sequence_parallel.api" in loaded  # the names did resolve


def test_import_seqpar_hf_loads_the_trainer_stacks_only_when_a_name_needs_them():
    assert _heavy(_loaded("import seqpar.hf\nseqpar.hf.SequenceParallelConfig")) == []
    loaded = _loaded("import seqpar.hf\nseqpar.hf.SequenceParallelTrainer")
    assert "transformers" in loaded and "trl" not in loaded  # TRL waits for its own trainers


def test_import_seqpar_alone_loads_no_torch():
    assert "torch" not in _loaded("import seqpar")


def test_cli_help_and_plan_load_no_transformers_or_pipelining():
    help_only = _loaded("from seqpar.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass")
    assert "torch" not in help_only
    plan = _loaded(
        "import contextlib, io\nfrom seqpar.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['plan', '--model', 'llama-8b', '--seq-len', '128K', '--gpus', '8']) == 0"
    )
    assert _heavy(plan) == []
    assert "seqpar.planning.search" in plan


@pytest.mark.fast
def test_plan_loads_no_torch():
    """Planning is arithmetic on sizes (Note [torch-free planning]): the planner and ``seqpar plan`` load no torch."""
    loaded = _loaded(
        "import contextlib, io\nfrom seqpar.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['plan', '--model', 'llama-8b', '--seq-len', '16M', '--gpus', '1024']) == 0\n"
        "import seqpar.planning\n"
        "found = seqpar.planning.plan('llama-8b', 1 << 20, seqpar.planning.Cluster(gpus=64))\n"
        "assert found.candidates and found.candidates[0].peak_bytes > 0"
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
