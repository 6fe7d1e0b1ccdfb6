"""Benchmarks behind ``seqpar bench NAME``: each module has a ``main(argv)`` and a docstring on how to run it.

They measure, in one run, ratios against a single process or between strategies; they never assert speed.
"""

BENCHMARKS = (
    "attention",
    "strategies",
    "masks",
    "llama_step",
    "cuda",
    "context_parallel",
    "hf_trainer",
    "maxlen",
    "features",
    "plan_check",
    "soak",
    "pipeline",
)

__all__ = ["BENCHMARKS"]
