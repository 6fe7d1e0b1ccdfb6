"""Several examples/ scripts run one after the other in one torchrun launch, each as ``torchrun SCRIPT`` runs it.

Run as ``torchrun --nproc-per-node 2 -m tests.hf_scripts.examples OUT STEPS SCRIPT...``; each script writes
OUT/<script stem>/result.json. One launch instead of one per script: the interpreter, torch and transformers
start once. Every example ends by tearing its process group down (``end_training``), as a script should
before its interpreter exits; here the group is kept for the next example (the teardown is deferred to the
end of the launch) and accelerate's per-run state is reset between examples.
"""

from __future__ import annotations

import os
import pathlib
import runpy
import sys

import torch.distributed as dist

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent.parent / "examples"


def main(out: str, steps: str, scripts: list[str]) -> None:
    from accelerate.state import AcceleratorState

    teardown = dist.destroy_process_group
    dist.destroy_process_group = lambda group=None: None  # kept for the next example; torn down below
    try:
        for script in scripts:
            AcceleratorState._reset_state()  # the process group (PartialState) stays
            where = os.path.join(out, pathlib.Path(script).stem)
            sys.argv = [str(EXAMPLES / script), "--max-steps", steps, "--output-dir", where]
            runpy.run_path(str(EXAMPLES / script), run_name="__main__")
            dist.barrier()
    finally:
        dist.destroy_process_group = teardown
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    from tests.hf_scripts import import_stacks

    import_stacks()  # Note [frozen imports]
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
