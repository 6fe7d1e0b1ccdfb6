"""What importing seqpar and running ``seqpar plan`` cost on top of ``import torch``, each in a fresh process.

    python -m benchmarks.imports                          # 5 rounds; the cases take turns, so drift hits them alike
    python -m benchmarks.imports --repeats 9 --json imports.json
    python -m benchmarks.imports --model ./llama-8b/config.json   # plan a config.json instead of the llama-8b preset

Each case is a new interpreter (``sys.executable``), timed from start to exit on the wall clock and by its
CPU time (user + system, from the parent's child accounting): on a shared machine the wall clock says how much
of a core the process got, CPU time what it costs on a core of its own. The table gives the median of each and
the median minus ``import torch``'s, which is what seqpar adds: its package faces import their names on first
use (``seqpar.lazy``), the command line loads a subcommand's modules only when it runs, and the planner imports
no torch at all (Note [torch-free planning] in seqpar.planning): the whole ``seqpar plan`` run then takes less
than ``import torch``, and its "over import torch" is below zero.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

from benchmarks import save_records

COMMON_NAMES = ("make_mesh", "attention", "shard_batch", "cross_entropy")
"""The names most scripts touch first; each resolves its module on first use."""


def cases(model: str, seq_len: int, gpus: int) -> dict[str, list[str]]:
    """The timed processes: name -> argv after the interpreter.

    Args:
        model: ``seqpar plan``'s ``--model`` (a preset or a config.json).
        seq_len: ``seqpar plan``'s ``--seq-len``.
        gpus: ``seqpar plan``'s ``--gpus``.

    Returns:
        ``python`` alone, ``import torch``, ``import torch; import seqpar``, the same touching the common names,
        ``import seqpar.hf``, ``seqpar --help`` and the ``seqpar plan`` run.
    """
    touch = "; ".join(f"seqpar.{name}" for name in COMMON_NAMES)
    return {
        "python": ["-c", "pass"],
        "import torch": ["-c", "import torch"],
        "import torch; import seqpar": ["-c", "import torch; import seqpar"],
        "import seqpar + common names": ["-c", f"import torch; import seqpar; {touch}"],
        "import seqpar.hf": ["-c", "import torch; import seqpar.hf"],
        "seqpar --help": ["-m", "seqpar.cli", "--help"],
        "seqpar plan": ["-m", "seqpar.cli", "plan", "--model", model, "--seq-len", str(seq_len), "--gpus", str(gpus)],
    }


def run_once(argv: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds of one fresh interpreter running ``argv`` (its output discarded).

    Args:
        argv: the arguments after ``sys.executable``.

    Returns:
        (wall seconds from start to exit, the child's user + system CPU seconds).

    Raises:
        RuntimeError: the process failed (its stderr in the message).
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)} exited with {done.returncode}:\n{done.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def measure(named: dict[str, list[str]], repeats: int) -> list[dict]:
    """Run every case ``repeats`` times, the cases taking turns; one record per case with its medians.

    Args:
        named: name -> argv, as ``cases`` returns.
        repeats: rounds (each case once per round).

    Returns:
        Records: ``case``, ``argv``, ``repeats``, ``wall_s`` / ``cpu_s`` (medians), ``wall_over_torch_s`` /
        ``cpu_over_torch_s`` (the median minus ``import torch``'s), ``walls_s`` (every run).
    """
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in named}
    for _ in range(repeats):
        for name, argv in named.items():
            runs[name].append(run_once(argv))
    medians = {name: tuple(statistics.median(r[i] for r in got) for i in (0, 1)) for name, got in runs.items()}
    torch_wall, torch_cpu = medians["import torch"]
    return [
        {
            "case": name,
            "argv": named[name],
            "repeats": repeats,
            "wall_s": round(medians[name][0], 3),
            "cpu_s": round(medians[name][1], 3),
            "wall_over_torch_s": round(medians[name][0] - torch_wall, 3),
            "cpu_over_torch_s": round(medians[name][1] - torch_cpu, 3),
            "walls_s": [round(w, 3) for w, _ in runs[name]],
            "cores": os.cpu_count() or 1,
        }
        for name in named
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.imports", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5, help="rounds; the table shows medians")
    parser.add_argument("--model", default="llama-8b", help="seqpar plan's --model: a preset or a config.json")
    parser.add_argument("--seq-len", type=int, default=16 * 2**20, help="seqpar plan's --seq-len")
    parser.add_argument("--gpus", type=int, default=1024, help="seqpar plan's --gpus")
    parser.add_argument("--json", metavar="FILE", help="also save the records")
    args = parser.parse_args(argv)
    records = measure(cases(args.model, args.seq_len, args.gpus), args.repeats)
    print(f"medians of {args.repeats} fresh processes each, on {os.cpu_count()} cores")
    print("| case | wall (s) | over import torch | CPU time (s) | over import torch |")
    print("|---|---|---|---|---|")
    for r in records:
        print(
            f"| {r['case']} | {r['wall_s']:.2f} | {r['wall_over_torch_s']:+.2f} | {r['cpu_s']:.2f} | "
            f"{r['cpu_over_torch_s']:+.2f} |"
        )
    if args.json:
        save_records(args.json, "imports", argv, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
