"""The Hugging Face doors' runs that tests/test_hf.py compares, each a program launched as users launch theirs.

Note [frozen imports]
    transformers' Trainer ends each ``train()`` with accelerate's ``free_memory``, a full ``gc.collect()``
    whose cost grows with every object alive, and the imports of torch, transformers and TRL leave millions:
    about 0.3 s a call here, 45% of a tiny case's time. The launches run many cases in one interpreter, so
    after importing the stacks they move what the imports left out of the collector's reach
    (``import_stacks``), and a collection walks only what the runs made. Upstream's example scripts
    themselves are left as written.

Note [DeepSpeed's shared-memory op]
    DeepSpeed's communication backend compiles a C++ extension when it starts (``deepspeed_shm_comm``, torch's
    JIT build, cached per environment), which it uses for its inference all-reduce only: training's collectives
    go through torch.distributed. The build took 140 CPU-seconds here, once per fresh environment, so every CI run
    paid it. The launches mark the op as not buildable (``deepspeed.ops.__compatible_ops__``, the probe's cached
    result, which DeepSpeed keeps editable for this) before DeepSpeed starts, and its training runs as before.
"""

from __future__ import annotations

import gc
import importlib.util


def import_stacks() -> None:
    """Import what every launch's cases build (the lazy modules load on access), then freeze it (Note [frozen
    imports])."""
    import transformers
    import trl

    transformers.Trainer, trl.SFTTrainer, trl.GRPOTrainer, trl.DPOTrainer  # noqa: B018
    if importlib.util.find_spec("deepspeed") is not None:  # Note [DeepSpeed's shared-memory op]
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    gc.freeze()
