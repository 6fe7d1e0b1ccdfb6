"""Soak: a long ``seqpar train`` run of the default model, checking that no rank's resident memory creeps up.

Runs the real command (spawned ranks, checkpoints every 100 steps, metrics and plots) in a subprocess:

    seqpar bench soak                          # 2,000 steps of the default run; compare RSS at step 100 and end
    seqpar bench soak --steps 600 --mark 100   # shorter
    seqpar bench soak --run-dir runs/soak -- --sp 4 --strategy ring   # flags after -- go to seqpar train

Every step's record in ``metrics.jsonl`` holds each rank's resident set (VmRSS) after the step; the bench
reports it at ``--mark`` (after warm-up: optimizer state, allocator pools and the first checkpoint exist)
and at the last step, per rank, and the growth in percent against the 2% the soak allows. It also prints the
resident set every ``--every`` steps so a slow leak shows its slope, not just its end points.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

__all__ = ["main", "resident_growth"]

LIMIT_PERCENT = 2.0


def resident_growth(metrics_path: str, mark: int) -> dict:
    """Each rank's resident set at step ``mark`` and at the last step of a run's ``metrics.jsonl``.

    Args:
        metrics_path: the run's ``metrics.jsonl``.
        mark: the step to compare the end against.

    Returns:
        ``{"mark", "end", "at_mark_mb", "at_end_mb", "growth_percent", "series"}``; the lists are per rank,
        ``series`` maps a step to the per-rank resident sets.

    Raises:
        ValueError: the file has no resident sets for ``mark`` or holds no steps after it.
    """
    series = {}
    with open(metrics_path) as f:
        for line in f:
            record = json.loads(line)
            if record.get("kind") == "train" and "resident_mb" in record:
                series[record["step"]] = record["resident_mb"]
    if mark not in series or max(series) <= mark:
        raise ValueError(f"{metrics_path}: no resident sets at step {mark} and after it")
    end = max(series)
    growth = [100 * (b - a) / a for a, b in zip(series[mark], series[end])]
    return {
        "mark": mark,
        "end": end,
        "at_mark_mb": series[mark],
        "at_end_mb": series[end],
        "growth_percent": [round(g, 2) for g in growth],
        "series": series,
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        prog="seqpar bench soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps of the run")
    parser.add_argument("--mark", type=int, default=100, help="the step whose resident set is the baseline")
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
        result = resident_growth(os.path.join(run_dir, "metrics.jsonl"), args.mark)
    for step in sorted(result["series"]):
        if step % args.every == 0 or step in (result["mark"], result["end"]):
            print(f"step {step:5d}: resident MiB per rank {result['series'][step]}")
    worst = max(abs(g) for g in result["growth_percent"])
    print(
        f"resident set per rank at step {result['mark']}: {result['at_mark_mb']} MiB; at step {result['end']}: "
        f"{result['at_end_mb']} MiB; growth {result['growth_percent']} % (limit {LIMIT_PERCENT} %); "
        f"{args.steps} steps in {seconds:.0f} s"
    )
    print("soak: PASS" if worst < LIMIT_PERCENT else "soak: FAIL (resident memory grew)")
    return 0 if worst < LIMIT_PERCENT else 1
