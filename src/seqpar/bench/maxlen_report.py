"""Report of ``seqpar bench maxlen``: its records as a Markdown table and as a plot of max length against sp.

The records come from ``seqpar.bench.maxlen`` (one per sp degree and rung of ``LADDER``).
"""

from __future__ import annotations

from seqpar.memory import FEATURES

LADDER = ("none", *FEATURES)
"""Rungs of the ladder: none, then each memory feature added to the ones before it."""

__all__ = ["LADDER", "plot", "table"]


def table(records: list[dict]) -> str:
    """The Markdown table of ``seqpar bench maxlen`` records: max length, ratios, measured and estimated peaks."""
    lines = [
        "| features | sp | max seq | vs sp 1 | vs rung below | measured peak (MB) | estimate (MB) | est / measured |",
        "|---|---|---|---|---|---|---|---|",
    ]
    first = {r["features"]: r["max_seq"] for r in records if r["sp"] == min(x["sp"] for x in records)}
    by_key = {(r["features"], r["sp"]): r["max_seq"] for r in records}
    for r in records:
        rung = LADDER.index(r["features"])
        prev = by_key.get((LADDER[rung - 1], r["sp"])) if rung else None
        ratio = f"{r['max_seq'] / first[r['features']]:.2f}x" if first.get(r["features"]) else "-"
        step = f"{r['max_seq'] / prev:.2f}x" if prev else "-"
        est = f"{r['estimate_mb'] / r['peak_mb']:.2f}" if r["peak_mb"] else "-"
        more = "" if r["bracketed"] else " (not bracketed)"
        lines.append(
            f"| {r['features']} | {r['sp']} | {r['max_seq']}{more} | {ratio} | {step} | {r['peak_mb']} | "
            f"{r['estimate_mb']} | {est} |"
        )
    return "\n".join(lines)


def plot(records: list[dict], path: str, title: str) -> None:
    """Draw the longest sequence against the SP degree, one line per rung, into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for rung in dict.fromkeys(r["features"] for r in records):
        points = [(r["sp"], r["max_seq"]) for r in records if r["features"] == rung]
        ax.plot(*zip(*points), marker="o", label=rung if rung == "none" else f"+ {rung}")
    ax.set_xlabel("sequence-parallel degree (ranks)")
    ax.set_ylabel("longest sequence within the budget (tokens)")
    ax.set_xticks(sorted({r["sp"] for r in records}))
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
