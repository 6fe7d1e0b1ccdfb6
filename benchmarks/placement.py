"""The placed layout over many packed rows: its K/V bytes, work balance and tokens against zigzag and balanced.

    python -m benchmarks.placement                         # ranks 3 4 8, seq 8192, 8 seeded rows per kind, one thread
    python -m benchmarks.placement --ranks 4 --kinds log-normal rl --seeds 16
    python -m benchmarks.placement --json placement.json   # one record per (ranks, kind, seed)

The placed layout's solver (Note [placed layout]) is a heuristic, so ``python -m benchmarks.masks``' one row per mask
says little about it; this runs it on ``--seeds`` seeded rows of each kind and each P, in one process (no
ranks are spawned, nothing is timed but the solver). Row kinds (``benchmarks.rows``): ``documents``, 8 + 2
x seed documents of uneven lengths; ``log-normal``, SFT-like log-normal lengths of median S/16;
``log-normal-short``, median S/32; ``rl``, groups of 8 similar completions after one prompt; ``short``,
log-normal documents all shorter than S/(2P). Per row it computes, for the zigzag, balanced and placed
layouts: the bytes each rank must send under ring in one fwd+bwd step (``masks_bytes.needed_bytes``: the K/V
some peer's query sees, forward and backward, the dK/dV sent home and the input check; 8/2 heads of 64,
fp32) and the planned work of the slowest rank over the mean (``seqpar.layout_balance``), plus the placed
row's tokens per rank, padding included, over S/P and the solver's seconds (one torch thread). A P whose
layouts do not divide ``--seq`` (the balanced solver tries up to 16 chunks per rank) runs on the longest row
they divide: 8160 tokens at P = 3; ``seq`` in each record is the length used. It prints, per (P, kind), the
geometric mean, median and largest of placed / zigzag and placed / balanced (largest rank's bytes), the
floor no placement even within 1.05 can go below (``placement.traffic_floor``) over zigzag's bytes and placed
over it, the worst
planned balance, the worst tokens ratio, the rows whose placed layout moves no K/V at all, and the median
solve time. Results are not checked here; tests/test_placement.py checks the solver.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

import seqpar
from benchmarks import save_records
from benchmarks.masks_bytes import check_bytes, floor_bytes, needed_bytes
from benchmarks.rows import log_normal_documents, rl_groups, short_documents, uneven_documents
from seqpar.sequence_parallel.layouts.balanced import CHUNKS_PER_RANK
from seqpar.sequence_parallel.masks.sequence_mask import SequenceMask

__all__ = ["KINDS", "LAYOUTS", "kind_row", "main", "measure_row", "row_length", "summarize"]

KINDS = ("documents", "log-normal", "log-normal-short", "rl", "short")
"""The row kinds, in the order they run (see the module docstring)."""
LAYOUTS = ("zigzag", "balanced", "placed")
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64  # as python -m benchmarks.masks; the ratios between layouts do not depend on them


def row_length(seq: int, ranks: int) -> int:
    """The longest row of at most ``seq`` tokens that zigzag and every balanced chunk count divide over ``ranks``.

    Args:
        seq: the wanted row length.
        ranks: the sequence-parallel degree P.

    Returns:
        ``seq`` rounded down to a multiple of ``max(CHUNKS_PER_RANK) * P`` (zigzag needs ``2P``).
    """
    return seq - seq % (max(CHUNKS_PER_RANK) * ranks)


def kind_row(kind: str, seq: int, ranks: int, seed: int) -> torch.Tensor:
    """The ``[seq]`` global position ids of row ``seed`` of ``kind`` (one of ``KINDS``) for ``ranks`` ranks.

    Raises:
        ValueError: an unknown kind.
    """
    if kind == "documents":
        return uneven_documents(seq, 8 + 2 * seed)
    if kind == "log-normal":
        return log_normal_documents(seq, seed, max(100, seq // 16))
    if kind == "log-normal-short":
        return log_normal_documents(seq, seed, max(100, seq // 32))
    if kind == "rl":
        return rl_groups(seq, seed)
    if kind == "short":
        return short_documents(seq, ranks, seed)
    raise ValueError(f"unknown row kind {kind!r} (known: {', '.join(KINDS)})")


def _bytes_per_rank(ids: torch.Tensor, layout, ranks: int) -> list[float]:
    """Bytes each rank must send under ring in one fwd+bwd step of row ``ids`` cut by ``layout``."""
    cfg = {"ranks": ranks, "ulysses": 1, "seq": len(ids), "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM}
    mask = SequenceMask((torch.arange(len(ids)) - ids)[None], None, int(ids.max()))
    return [needed_bytes("ring", cfg, mask, layout, r) for r in range(ranks)]


def measure_row(ids: torch.Tensor, ranks: int) -> dict:
    """The three layouts of one row: largest and mean needed bytes, planned balance, and the placed row's tokens.

    Args:
        ids: ``[S]`` global position ids of a packed row (S divisible as ``row_length`` makes it).
        ranks: the sequence-parallel degree P.

    Returns:
        ``needed_bytes_max`` / ``needed_bytes_mean`` / ``planned_max_over_mean``: per layout; ``floor_bytes``:
        the least any placement even within 1.05 (work and tokens) can need on its busiest rank (Note [traffic
        floor], the input check included); ``floor_kv``: whether that floor holds any K/V beyond the input check;
        ``tokens_max_over_mean``: the placed row's local length over S/P; ``placed_no_kv``: whether the placed
        layout needs nothing but the input check; ``placed_solve_s`` / ``balanced_solve_s``: solver seconds.
    """
    start = time.perf_counter()
    placement = seqpar.placed_layout(ids, ranks)
    placed_s = time.perf_counter() - start
    start = time.perf_counter()
    balanced = seqpar.balanced_layout(ids, ranks)
    balanced_s = time.perf_counter() - start
    rows = {"zigzag": (ids, "zigzag"), "balanced": (ids, balanced)}
    rows["placed"] = (placement.position_ids[0], placement.layout)
    need = {name: _bytes_per_rank(row, layout, ranks) for name, (row, layout) in rows.items()}
    floor = floor_bytes(ids, ranks, KV_HEADS, HEAD_DIM)
    return {
        "needed_bytes_max": {name: max(b) for name, b in need.items()},
        "floor_bytes": floor,
        "floor_kv": floor > check_bytes(ranks),
        "needed_bytes_mean": {name: statistics.mean(b) for name, b in need.items()},
        "planned_max_over_mean": {
            name: seqpar.layout_balance(row, layout, ranks).planned_max_over_mean
            for name, (row, layout) in rows.items()
        },
        "tokens_max_over_mean": placement.seq_len / len(ids),
        "placed_no_kv": max(need["placed"]) <= check_bytes(ranks),
        "placed_solve_s": placed_s,
        "balanced_solve_s": balanced_s,
    }


def _geomean(values: list[float]) -> float:
    return math.exp(statistics.mean(math.log(v) for v in values))


def summarize(records: list[dict]) -> list[dict]:
    """Per (ranks, kind), in run order: the placed layout against zigzag and balanced over the seeded rows.

    Args:
        records: the records ``main`` writes.

    Returns:
        One dict per (ranks, kind): ``rows``, ``seq``, ``vs_zigzag`` / ``vs_balanced`` (geometric mean, median and
        max of placed's largest-rank bytes over theirs), ``floor_vs_zigzag`` (median and max of the floor over
        zigzag's bytes), ``vs_floor`` (geometric mean and max of placed over the floor, on the rows whose floor
        is more than the input check, and how many), ``planned_worst`` (and ``zigzag_planned_worst``),
        ``tokens_worst``, ``no_kv`` (rows) and ``solve_ms`` (the median).
    """
    groups: dict[tuple[int, str], list[dict]] = {}
    for r in records:
        groups.setdefault((r["ranks"], r["kind"]), []).append(r)
    out = []
    for (ranks, kind), rs in groups.items():
        ratio = {o: [r["needed_bytes_max"]["placed"] / r["needed_bytes_max"][o] for r in rs] for o in LAYOUTS[:2]}
        over = [r["needed_bytes_max"]["placed"] / r["floor_bytes"] for r in rs if r["floor_kv"]]
        under = [r["floor_bytes"] / r["needed_bytes_max"]["zigzag"] for r in rs]
        out.append({
            "ranks": ranks, "kind": kind, "seq": rs[0]["seq"], "rows": len(rs),
            **{f"vs_{o}": (_geomean(ratio[o]), statistics.median(ratio[o]), max(ratio[o])) for o in ratio},
            "floor_vs_zigzag": (statistics.median(under), max(under)),
            "vs_floor": (_geomean(over), max(over), len(over)) if over else (math.nan, math.nan, 0),
            "planned_worst": max(r["planned_max_over_mean"]["placed"] for r in rs),
            "zigzag_planned_worst": max(r["planned_max_over_mean"]["zigzag"] for r in rs),
            "tokens_worst": max(r["tokens_max_over_mean"] for r in rs),
            "no_kv": sum(r["placed_no_kv"] for r in rs),
            "solve_ms": 1e3 * statistics.median(r["placed_solve_s"] for r in rs),
        })  # fmt: skip
    return out


def _print(records: list[dict]) -> None:
    print("\nplaced layout over seeded rows, ring: largest rank's needed bytes over zigzag's and balanced's")
    print("| P | seq | rows | kind | placed / zigzag: geo mean / median / max | placed / balanced: same | floor / "
          "zigzag: median / max | placed / floor: geo mean / max (rows) | placed planned max/mean, worst (zigzag) "
          "| tokens max/mean, worst | no K/V | solve ms (median) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in summarize(records):
        z, b = ("{:.2f} / {:.2f} / {:.2f}".format(*s[f"vs_{o}"]) for o in ("zigzag", "balanced"))
        f = "{:.2f} / {:.2f} | ".format(*s["floor_vs_zigzag"])
        f += "{:.2f} / {:.2f} ({})".format(*s["vs_floor"]) if s["vs_floor"][2] else "– (0)"
        print(
            f"| {s['ranks']} | {s['seq']} | {s['rows']} | {s['kind']} | {z} | {b} | {f} | "
            f"{s['planned_worst']:.3f} ({s['zigzag_planned_worst']:.3f}) | {s['tokens_worst']:.3f} | "
            f"{s['no_kv']}/{s['rows']} | {s['solve_ms']:.0f} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.placement", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[3, 4, 8], help="sequence-parallel degrees P")
    parser.add_argument("--seq", type=int, default=8192, help="tokens per row (rounded down where P needs it)")
    parser.add_argument("--seeds", type=int, default=8, help="seeded rows per (P, kind)")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS, help="row kinds")
    parser.add_argument("--json", metavar="FILE", help="write one record per (ranks, kind, seed) here")
    args = parser.parse_args(argv)
    if min(args.ranks) < 1 or args.seeds < 1 or any(row_length(args.seq, p) == 0 for p in args.ranks):
        parser.error(f"--ranks and --seeds must be positive, and --seq ({args.seq}) at least 16 tokens per rank")
    torch.set_num_threads(1)  # the solver's seconds as on one core of a training job's data loader
    records = []
    for ranks in args.ranks:
        seq = row_length(args.seq, ranks)
        for kind in args.kinds:
            for seed in range(args.seeds):
                ids = kind_row(kind, seq, ranks, seed)
                documents = int((ids == 0).sum())
                record = {"seq": seq, "ranks": ranks, "kind": kind, "seed": seed, "documents": documents}
                records.append({**record, "strategy": "ring", "heads": HEADS, "kv_heads": KV_HEADS,
                                "head_dim": HEAD_DIM, **measure_row(ids, ranks)})  # fmt: skip
            print(f"P = {ranks}, {kind}: {args.seeds} rows done", file=sys.stderr, flush=True)
    _print(records)
    if args.json:
        save_records(args.json, "placement", argv, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
