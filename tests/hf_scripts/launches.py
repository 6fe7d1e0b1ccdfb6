"""The launches tests/test_hf.py reads, as background stages (Note [background launches]): the one-process
references, then seqpar's runs on 2 to 4 forked ranks, upstream's examples under torchrun and accelerate's launcher.
"""

from __future__ import annotations

import importlib.util
import inspect
import pathlib
import sys
from collections.abc import Collection

from tests._background import ROOT, Stage
from tests.hf_scripts.accelerate_references import GUIDES
from tests.hf_scripts.common import CASES, DEEPSPEED_CASES
from tests.hf_scripts.dpo import DPO_CASES, PEFT
from tests.hf_scripts.grpo import GRPO_CASES
from tests.hf_scripts.upstream import DEEPSPEED_EXAMPLES, UPSTREAM, YAML_LAUNCHED

BIN = pathlib.Path(sys.executable).parent
DEEPSPEED = importlib.util.find_spec("deepspeed") is not None  # the optional extra seqpar[deepspeed]
DPO_RUNS = [n for n, c in DPO_CASES.items() if PEFT or not c.peft]  # the PEFT case needs peft installed
BY_TORCHRUN = {n: v for n, v in UPSTREAM.items() if n not in YAML_LAUNCHED and n not in DEEPSPEED_EXAMPLES}
# examples/ run by torchrun in one launch (tests.hf_scripts.examples); sft_trainer.py by accelerate's launcher
TORCHRUN_EXAMPLES = ["hf_trainer.py", "accelerate_loop.py", "dpo_trainer.py", "grpo_trainer.py", "vlm_trainer.py"]
EXAMPLE_STEPS = 2
RUNS = ("two_ranks", "more_ranks", "yaml_runs")
"""The stages whose runs the references are read beside (each needs ``out`` first)."""
STAGES = {*RUNS, "examples_run", "sft_example"}
"""The stages tests read, by the name of the fixture that waits for each."""


def _reference(out: pathlib.Path, *names: str) -> list[str]:
    return [sys.executable, "-m", "tests.hf_scripts.reference", str(out), *names]


def _forked(world: int, out: pathlib.Path, *names: str) -> list[str]:
    """``tests.hf_scripts.parallel`` on ``world`` ranks forked after one import of the stacks (torchrun's would
    import them once per rank; the examples below run under torchrun and accelerate's launcher themselves)."""
    return [sys.executable, "-m", "tests.hf_scripts.forked", str(world), str(out), *names]


def _two_ranks(out: pathlib.Path) -> list[str]:
    return _forked(
        2,
        out,
        *(n for n, c in CASES.items() if c.world == 2 and n not in DEEPSPEED_CASES),
        "refusals",
        "resume",
        "accelerate_dp1",
        "control_unscaled",
        *(n for n, (_, _, dp) in BY_TORCHRUN.items() if dp == 1),
        *(n for n, (world, _, _) in GUIDES.items() if world == 2),
        *(n for n, c in GRPO_CASES.items() if c.world == 2),
        "grpo_loss_types",
        *(n for n in DPO_RUNS if DPO_CASES[n].world == 2),
        "dpo_refusals",
        # last: DeepSpeed's settings stay in the process once a DeepSpeed Trainer was built
        *([*DEEPSPEED_CASES, "alst_trainer_dp1", "deepspeed_refusal"] if DEEPSPEED else []),
    )


def _more_ranks(out: pathlib.Path, world: int) -> list[str]:
    names = [n for n, c in CASES.items() if c.world == world]
    names += [n for n, c in GRPO_CASES.items() if c.world == world]
    names += [n for n in DPO_RUNS if DPO_CASES[n].world == world]
    if world == 4:  # dp 2 x sp 2
        names += [*(n for n, (_, _, dp) in BY_TORCHRUN.items() if dp == 2), "accelerate_dp2"]
        names += [n for n, (w, _, _) in GUIDES.items() if w == 4]
        names += ["alst_trainer_dp2"] if DEEPSPEED else []  # last: DeepSpeed's settings stay in the process
    return _forked(world, out, *names)


def _yaml_run(out: pathlib.Path, name: str) -> list[str]:
    """TRL's accelerate YAML (tests/accelerate_configs) launching its snippet, which names no parallel settings."""
    yaml = str(ROOT / "tests" / "accelerate_configs" / YAML_LAUNCHED[name])
    launcher = [str(BIN / "accelerate"), "launch", "--config_file", yaml, "--main_process_port", "0"]
    return [*launcher, "-m", "tests.hf_scripts.parallel", str(out), name]


def used_by(items: Collection) -> set[str]:
    """The fixtures pytest ``items`` read: those they name, and the runs of tests/test_hf.py's tests that pick
    theirs with ``request.getfixturevalue`` (by the case's world size)."""
    used = set()
    for item in items:
        names = set(item.fixturenames)
        asks = "request" in inspect.signature(item.function).parameters if hasattr(item, "function") else False
        if asks and item.path.name == "test_hf.py":
            names.update(RUNS)
        used |= names
    return used


def stages(used: Collection[str], out: pathlib.Path, examples: pathlib.Path, sft: pathlib.Path) -> list[Stage]:
    """The stages a session whose tests read ``used`` (fixture names) needs, in the order they run: the
    references the launches read first (TRL's GRPO runs replay their completions, TRL's pages load the model
    they saved), the other references beside the launches, then the launches."""
    steps = str(EXAMPLE_STEPS)
    sft_example = [str(ROOT / "examples" / "sft_trainer.py"), "--max-steps", steps, "--output-dir", str(sft)]
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]
    accelerate = [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", "0"]
    others = [
        *(n for n, c in CASES.items() if not c.reference),
        "accelerate_dp1",
        "accelerate_dp2",
        *GUIDES,
        *(n for n in DPO_RUNS if not DPO_CASES[n].reference),
    ]
    runs = any(name in used for name in RUNS)
    chain = [
        Stage("out", [_reference(out, *UPSTREAM, *GRPO_CASES, "grpo_loss_types")]) if runs else None,
        Stage("references", [_reference(out, *others)], side=True) if runs else None,
        Stage("two_ranks", [_two_ranks(out)]),
        Stage("more_ranks", [_more_ranks(out, 3), _more_ranks(out, 4)]),
        Stage(
            "examples_run", [[*torchrun, "-m", "tests.hf_scripts.examples", str(examples), steps, *TORCHRUN_EXAMPLES]]
        ),
        Stage("sft_example", [[*accelerate, *sft_example]]),
        Stage("yaml_runs", [_yaml_run(out, name) for name in YAML_LAUNCHED]),
    ]
    return [s for s in chain if s is not None and (s.name in used or s.name not in STAGES)]
