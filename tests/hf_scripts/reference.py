"""One-process Trainer runs (no seqpar imported): the references tests/test_hf.py compares seqpar's runs with.

Run as ``python -m tests.hf_scripts.reference OUT CASE...``; writes OUT/reference/CASE.pt (names of
``tests.hf_scripts.upstream`` run there, in this interpreter).
"""

from __future__ import annotations

import os
import sys

import transformers

from tests.hf_scripts.common import CASES, build_trainer, results, save


def main(out: str, names: list[str]) -> None:
    from tests.hf_scripts import dpo, grpo, upstream

    grpo.reference(out, [n for n in names if n in grpo.GRPO_CASES])
    if "grpo_loss_types" in names:
        from tests.hf_scripts import grpo_losses

        grpo_losses.reference(out)
    for name in (n for n in names if n in dpo.DPO_CASES):  # TRL's DPOTrainer
        dpo.reference(out, name)
    # upstream's examples and the accelerate loops
    others = [n for n in names if n not in CASES and n not in dpo.DPO_CASES and not n.startswith("grpo_")]
    if others:
        upstream.main(out, others)
    for name in (n for n in names if n in CASES):
        case = CASES[name]
        if case.sft:
            from trl import SFTTrainer as cls
        else:
            cls = transformers.Trainer
        trainer = build_trainer(name, case, os.path.join(out, "reference", name), cls, reference=True)
        trainer.train()
        save(os.path.join(out, "reference", f"{name}.pt"), results(trainer))


if __name__ == "__main__":
    from tests.hf_scripts import import_stacks

    import_stacks()  # Note [frozen imports]
    main(sys.argv[1], sys.argv[2:])
