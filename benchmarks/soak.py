"""Soak: a long ``seqpar train`` run of the default model, checking that no rank's resident memory creeps up.

Runs the real command (spawned ranks, checkpoints every 100 steps, metrics and plots) in a subprocess:

    python -m benchmarks.soak                          # 2,000 steps of the default run; RSS at step 100 vs the end
    python -m benchmarks.soak --steps 600 --mark 100   # shorter
    python -m benchmarks.soak --run-dir runs/soak -- --sp 4 --strategy ring   # flags after -- go to seqpar train

Every step's record in ``metrics.jsonl`` holds each rank's resident set (VmRSS) after the step; the bench
compares, per rank, the median over ``--window`` steps from ``--mark`` (after warm-up: optimizer state,
allocator pools and the first checkpoint exist) with the median over the last ``--window`` steps (one step's
resident set moves with the allocator's pools, so single steps are not compared), against the 2% growth the
soak allows (a run's figures: docs/guides/train.md, "Soak"). It also
prints the resident set every ``--every`` steps so a slow leak shows its slope, not just its end points.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

__all__ = ["main", "resident_growth"]

LIMIT_PERCENT = 2.0


def resident_growth(metrics_path: str, mark: int, window: int = 10) -> dict:
    """Each rank's resident set from step ``mark`` and at the end of a run's ``metrics.jsonl``.

    Args:
        metrics_path: the run's ``metrics.jsonl``.
        mark: the first step of the baseline window.
        window: steps per median (baseline: ``mark`` onwards; end: the last ``window`` steps).

    Returns:
        ``{"mark", "end", "at_mark_mb", "at_end_mb", "growth_percent", "series"}``: the medians and growth
        are per rank, ``series`` maps a step to the per-rank resident sets.

    Raises:
        ValueError: the file has no resident sets for the baseline window or none after it.
    """
    series = {}
    with open(metrics_path) as f:
        for line in f:
            record = json.loads(line)
            if record.get("kind") == "train" and "resident_mb" in record:
                series[record["step"]] = record["resident_mb"]
    steps = sorted(series)
    base = [s for s in steps if mark <= s < mark + window]
    last = steps[-window:]
    if len(base) < window or not steps or last[0] < mark + window:
        raise ValueError(f"{metrics_path}: no resident sets for steps {mark}-{mark + window - 1} and after them")

    def medians(chosen: list[int]) -> list[float]:
        return [statistics.median(series[s][r] for s in chosen) for r in range(len(series[chosen[0]]))]

    at_mark, at_end = medians(base), medians(last)
    return {
        "mark": mark,
        "end": steps[-1],
        "at_mark_mb": at_mark,
        "at_end_mb": at_end,
        "growth_percent": [round(100 * (b - a) / a, 2) for a, b in zip(at_mark, at_end)],
        "series": series,
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps of the run")
    parser.add_argument("--mark", type=int, default=100, help="the step whose resident set is the baseline")
    parser.add_argument("--window", type=int, default=10, help="steps per median, at the mark and at the end")
    parser.add_argument("--every", type=int, default=250, help="print the resident sets every this many steps")
    parser.add_argument("--run-dir", default=None, help="keep the run here (default: a temporary directory)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.run_dir or os.path.join(tmp, "run")
        command = [sys.executable, "-m", "seqpar.cli", "train", "--steps", str(args.steps), "--run-dir", run_dir]
        command += ["--no-progress", "--log-every", str(args.every), *extra]
        print(" ".join(command[1:]), flush=True)
        began = time.perf_counter()
        done = subprocess.run(command, check=False)
        seconds = time.perf_counter() - began
        if done.returncode != 0:
            print(f"seqpar train exited with {done.returncode}", file=sys.stderr)
            return done.returncode
        result = resident_growth(os.path.join(run_dir, "metrics.jsonl"), args.mark, args.window)
    for step in sorted(result["series"]):
        if step % args.every == 0 or step in (result["mark"], result["end"]):
            print(f"step {step:5d}: resident MiB per rank {result['series'][step]}")
    worst = max(abs(g) for g in result["growth_percent"])
    print(
        f"resident set per rank, median of steps {result['mark']}-{result['mark'] + args.window - 1}: "
        f"{result['at_mark_mb']} MiB; of the last {args.window} steps (to {result['end']}): {result['at_end_mb']} "
        f"MiB; growth {result['growth_percent']} % (limit {LIMIT_PERCENT} %); {args.steps} steps in {seconds:.0f} s"
    )
    print("soak: PASS" if worst < LIMIT_PERCENT else "soak: FAIL (resident memory grew)")
    return 0 if worst < LIMIT_PERCENT else 1


if __name__ == "__main__":
    sys.exit(main())
