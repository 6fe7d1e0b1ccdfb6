"""The ``benchmarks.placement`` table: per (P, row kind), the placed layout against zigzag and balanced.

scripts/records.py loads this beside record_tables.py; it summarises the per-row records as the bench prints them.
"""

from __future__ import annotations

import math
import statistics

KIND_NAMES = {
    "documents": "uneven documents",
    "log-normal": "log-normal, median S/16",
    "log-normal-short": "log-normal, median S/32",
    "rl": "RL groups",
    "short": "short documents (< S/2P)",
}
HEADER = [
    "P",
    "seq",
    "rows",
    "row kind",
    "placed / zigzag bytes: geo mean / median / max",
    "placed / balanced bytes: geo mean / median / max",
    "floor / zigzag bytes: median / max",
    "placed / floor bytes: geo mean / max (rows with a floor)",
    "placed planned work max/mean, worst (zigzag's)",
    "placed tokens max/mean, worst",
    "rows with no K/V",
    "solve ms, median",
]


def _ratios(rows: list[dict], other: str) -> str:
    """Placed's largest-rank needed bytes over ``other``'s, per row: geometric mean / median / max."""
    ratios = [r["needed_bytes_max"]["placed"] / r["needed_bytes_max"][other] for r in rows]
    geo = math.exp(statistics.mean(math.log(x) for x in ratios))
    return f"{geo:.2f} / {statistics.median(ratios):.2f} / {max(ratios):.2f}"


def _floor(rows: list[dict]) -> list[str]:
    """The floor (Note [traffic floor]) over zigzag's bytes, and placed's over the floor on the rows whose floor
    holds K/V (``floor_kv``): two cells, dashes for a run before the floor was reported."""
    if any("floor_kv" not in r for r in rows):
        return ["–", "–"]
    under = [r["floor_bytes"] / r["needed_bytes_max"]["zigzag"] for r in rows]
    over = [r["needed_bytes_max"]["placed"] / r["floor_bytes"] for r in rows if r["floor_kv"]]
    if not over:
        return [f"{statistics.median(under):.2f} / {max(under):.2f}", "– (0)"]
    geo = math.exp(statistics.mean(math.log(x) for x in over))
    return [f"{statistics.median(under):.2f} / {max(under):.2f}", f"{geo:.2f} / {max(over):.2f} ({len(over)})"]


def placement_cells(records: list[dict]) -> tuple[list[str], list[list[str]], list[dict]]:
    """The header, one row of cells per (run, P, kind) in record order, and the first record of each such row."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["command"], r["measured"], r["ranks"], r["kind"]), []).append(r)
    cells = []
    for (_, _, ranks, kind), rows in groups.items():
        planned = [r["planned_max_over_mean"] for r in rows]
        cells.append(
            [
                str(ranks),
                str(rows[0]["seq"]),
                str(len(rows)),
                KIND_NAMES.get(kind, kind),
                _ratios(rows, "zigzag"),
                _ratios(rows, "balanced"),
                *_floor(rows),
                f"{max(p['placed'] for p in planned):.3f} ({max(p['zigzag'] for p in planned):.3f})",
                f"{max(r['tokens_max_over_mean'] for r in rows):.3f}",
                f"{sum(r['placed_no_kv'] for r in rows)}/{len(rows)}",
                f"{1e3 * statistics.median(r['placed_solve_s'] for r in rows):.0f}",
            ]
        )
    return HEADER, cells, [rows[0] for rows in groups.values()]
