"""The suite's background stages (Note [background launches]): the Trainer doors' launches and the zoo sweeps, each
named by the fixture that reads it, and which of them a session's selected tests read.
"""

from __future__ import annotations

import inspect
import pathlib
import sys
from collections.abc import Collection

from tests._background import Stage
from tests.hf_scripts import launches as hf

ZOO_STAGES = ("zoo", "with_images")
STAGES = {*hf.STAGES, *ZOO_STAGES}
PATHS = ("hf", "examples", "sft_example", "zoo")
"""The directories the stages write, by name."""


def used_by(items: Collection) -> set[str]:
    """The fixtures pytest ``items`` read: those they name, and the runs of tests/test_hf.py's tests that pick
    theirs with ``request.getfixturevalue`` (by the case's world size)."""
    used = set()
    for item in items:
        names = set(item.fixturenames)
        asks = "request" in inspect.signature(item.function).parameters if hasattr(item, "function") else False
        if asks and item.path.name == "test_hf.py":
            names.update(hf.RUNS)
        used |= names
    return used


def zoo_record(paths: dict[str, pathlib.Path], stage: str) -> pathlib.Path:
    """Where the zoo sweep ``stage`` writes its record."""
    return paths["zoo"] / f"{stage}.json"


def _zoo_stages(paths: dict[str, pathlib.Path]) -> list[Stage]:
    """The sweeps of tests/test_zoo.py at sp 2 on ranks of their own, with their negative controls."""
    from tests.test_zoo import CONTROLS, IMAGES_CONTROLS

    sweeps = {"zoo": ("benchmarks.zoo", CONTROLS), "with_images": ("benchmarks.zoo_images", IMAGES_CONTROLS)}
    return [
        Stage(
            name,
            [[sys.executable, "-m", module, "--controls", ",".join(controls), "--out", str(zoo_record(paths, name))]],
        )
        for name, (module, controls) in sweeps.items()
    ]


def stages(used: Collection[str], paths: dict[str, pathlib.Path]) -> list[Stage]:
    """The stages a session whose tests read ``used`` (fixture names) needs, in the order they run."""
    chain = hf.stages(used, paths["hf"], paths["examples"], paths["sft_example"]) + _zoo_stages(paths)
    return [s for s in chain if s.name in used or s.name not in STAGES]
