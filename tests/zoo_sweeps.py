"""``python -m tests.zoo_sweeps OUT``: the sp 2 zoo sweeps tests/test_zoo.py reads, as a background stage.

Every causal-LM and image-text-to-text family, and every image family with its images, each judged once on one pool
of 2 ranks with the negative control of a few from the same runs; written to ``OUT/zoo.json`` and
``OUT/images.json``. The session starts it beside the other launches (Note [background launches]).
"""

from __future__ import annotations

import json
import pathlib
import sys

from tests._background import Stage

ZOO_STAGE = "zoo_sweeps"
"""The background stage's name, and its directory's in the chain's paths."""
CONTROLS = ("llama", "gemma3_text", "qwen3_next", "olmo3")
"""Families whose negative control the sp 2 sweep judges too, from the same runs."""
IMAGES_CONTROLS = ("llava", "qwen2_vl", "idefics3")
"""Image families whose negative control the sp 2 image sweep judges too, from the same runs."""
READERS = {"zoo", "with_images"}
"""tests/test_zoo.py's fixtures that read the sweeps."""


def stages(used: set[str], out: pathlib.Path) -> list[Stage]:
    """The sweeps' stage when a selected test reads them (``used``: the fixture names the tests read), run beside
    the chain (``side``): its pool of ranks and the chain's launches share what the tests leave idle."""
    if not used & READERS:
        return []
    return [Stage(ZOO_STAGE, [[sys.executable, "-m", "tests.zoo_sweeps", str(out)]], side=True)]


def main(out: pathlib.Path) -> None:
    import os

    import torch

    # the ranks inherit these: the sweeps' warnings go to a file, not to a pipe nobody reads until the tests wait
    with open(out / "log.txt", "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)

    from benchmarks import zoo, zoo_images
    from tests._dist import COLLECTIVE_TIMEOUT
    from tests._pool import RankPool

    torch.set_num_threads(1)
    pool = RankPool(2, timeout=COLLECTIVE_TIMEOUT)  # as the session's pools
    try:
        outcomes = {
            "zoo": zoo.sweep(2, controls=CONTROLS, pool=pool),
            "images": zoo_images.sweep(2, controls=IMAGES_CONTROLS, pool=pool),
        }
    finally:
        pool.close()
    for name, found in outcomes.items():
        (out / f"{name}.json").write_text(json.dumps(found))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
