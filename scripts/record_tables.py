"""Markdown tables of the benchmark records that scripts/records.py expands into the pages and the README.

Each renderer takes a record's rows (as ``seqpar bench NAME --json`` wrote them); it returns the table and its source.
"""

from __future__ import annotations

import statistics


class RecordError(Exception):
    """A table's record is missing, unreadable or lacks a field, or the README's generated block is stale."""


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def runs_of(records: list[dict]) -> list[tuple[str, str]]:
    """The distinct (command, date) runs in a record, in the order they appear."""
    return list(dict.fromkeys((r["command"], r["measured"]) for r in records))


def source(name: str, records: list[dict]) -> str:
    runs = runs_of(records)
    said = "; ".join(
        f"{f'run {i + 1}: ' if len(runs) > 1 else ''}`{cmd}`, measured {date}" for i, (cmd, date) in enumerate(runs)
    )
    return f"Generated from `benchmarks/{name}.json`: {said}."


def with_runs(name: str, records: list[dict], header: list[str], cells: list[list[str]]) -> str:
    """The table, then where it comes from; with several runs in one record a column names each row's run."""
    runs = runs_of(records)
    if len(runs) > 1:
        header = [*header, "run"]
        cells = [[*c, str(runs.index((r["command"], r["measured"])) + 1)] for c, r in zip(cells, records)]
    return f"{table(header, cells)}\n\n{source(name, records)}"


def span(values: list[float], fmt: str = "{:.2f}") -> str:
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def attention_table(records: list[dict]) -> str:
    """``seqpar bench attention``: one process against P ranks, time and per-rank peak growth."""
    header = ["seq", "strategy", "ranks", "1 process (s)", "ranks (s)", "speed-up", "1 process peak growth"]
    cells = [
        [
            r["seq"],
            r["strategy"],
            r["ranks"],
            f"{r['single_s']:.2f}",
            f"{r['parallel_s']:.2f}",
            f"{r['speedup']:.2f}x",
            f"{r['single_growth_mb']:.0f} MB",
            f"{r['rank_growth_mb']:.0f} MB",
            f"{r['memory_ratio']:.2f}",
        ]
        for r in records
    ]
    return with_runs("attention_cpu", records, [*header, "per-rank peak growth", "ratio"], cells)


def _strategy_label(r: dict) -> str:
    shares = r.get("heads_per_rank") or []
    uneven = f" (heads {', '.join(map(str, shares))})" if len(set(shares)) > 1 else ""  # Note [uneven heads]
    if r["strategy"] == "hybrid":
        return f"hybrid {r['ranks'] // r['ulysses']}x{r['ulysses']}{uneven}"
    if uneven:  # all heads at once, no head groups
        return f"ulysses{uneven}"
    if r["strategy"] == "ulysses":  # KV heads below the degree are copied up to it; above, one group per KV head a rank
        kv = r["kv_heads"] if r["kv_heads"] % r["ranks"] == 0 else r["ranks"]
        return f"ulysses ({kv // r['ranks']} head groups)" if kv > r["ranks"] else "ulysses"
    return r["strategy"]


def strategies_table(records: list[dict]) -> str:
    """``benchmarks.strategies``: step against ring in the same run, bytes sent per rank against the analytical."""
    ring = {r["command"]: r["step_s"] for r in records if r["strategy"] == "ring"}
    cells = [
        [
            f"{r['heads']}/{r['kv_heads']}",
            _strategy_label(r),
            f"{r['step_s']:.2f}",
            f"{r['step_s'] / ring[r['command']]:.2f}x" if r["command"] in ring else "-",
            f"{r['sent_bytes_per_rank'] / 2**20:.2f} MiB",
            f"{r['analytical_bytes'] / 2**20:.2f} MiB",
            f"{r['sent_bytes_per_rank'] / r['analytical_bytes']:.4f}",
        ]
        for r in records
    ]
    header = ["heads", "strategy", "step (s)", "vs ring", "sent per rank", "analytical", "measured / analytical"]
    return with_runs("strategies_cpu", records, header, cells)


def llama_step_table(records: list[dict]) -> str:
    """``benchmarks.llama_step``: tokens/s and per-rank peak growth per sp degree, against the lowest degree."""
    base = {}
    for r in records:
        if r["command"] not in base or r["sp"] < base[r["command"]]["sp"]:
            base[r["command"]] = r
    cells = []
    for r in records:
        b = base[r["command"]]
        cells.append(
            [
                r["sp"],
                f"{r['step_s']:.2f}",
                f"{r['seq'] / r['step_s']:.0f}",
                f"{b['step_s'] / r['step_s']:.2f}x",
                f"{r['growth_mb']:.0f}",
                f"{r['growth_mb'] / b['growth_mb']:.2f}",
            ]
        )
    low = min(r["sp"] for r in records)
    header = ["sp", "step (s)", "tokens/s", f"tokens/s vs sp {low}", "per-rank peak growth (MB)", f"memory vs sp {low}"]
    return with_runs("llama_step_cpu", records, header, cells)


def features_table(records: list[dict]) -> str:
    """``benchmarks.features``: tokens/s per rung and against the first rung, one column group per run."""
    runs = runs_of(records)
    rungs = list(dict.fromkeys(r["features"] for r in records))
    by_key = {((r["command"], r["measured"]), r["features"]): r for r in records}
    header = ["features"]
    for run in runs:
        chunk = next(r["loss_chunk"] for r in records if (r["command"], r["measured"]) == run)
        header += [f"tokens/s, loss chunk {chunk}", f"vs {rungs[0]} (wall)", f"vs {rungs[0]} (CPU time)"]
    cells = []
    for i, rung in enumerate(rungs):
        row = [rung if i == 0 else f"+ {rung}"]
        for run in runs:
            r = by_key.get((run, rung))
            cols = [f"{r['tokens_per_s']:.0f}", f"{r['vs_first_wall']:.3f}x", f"{r['vs_first_cpu']:.3f}x"] if r else []
            row += cols or ["-"] * 3
        cells.append(row)
    return f"{table(header, cells)}\n\n{source('features_cpu', records)}"


def _pairs(records: list[dict]) -> list[float]:
    pairs = [r["vs_own_step_pairs"] for r in records if "vs_own_step_pairs" in r]
    if not pairs:
        raise RecordError("benchmarks/hf_trainer_cpu.json has no record with 'vs_own_step_pairs'")
    return pairs[0]


def hf_trainer_table(records: list[dict]) -> str:
    """``benchmarks.hf_trainer``: each run's step and memory against one process, then the Trainer/own ratio."""
    one = next(r for r in records if r["ranks"] == 1)
    cells = [
        [
            r["run"] + (f", sp {r['ranks']}" if r["ranks"] > 1 else ""),
            f"{r['step_s']:.2f}",
            f"{r['growth_mb']:.0f}",
            f"{r['growth_mb'] / one['growth_mb']:.2f}",
        ]
        for r in records
    ]
    pairs = _pairs(records)
    ratio = (
        f"Trainer step / own step: median {statistics.median(pairs):.3f}x over {len(pairs)} interleaved pairs "
        f"({min(pairs):.3f} to {max(pairs):.3f} per pair)."
    )
    header = ["run", "step (s)", "per-rank peak growth (MB)", "memory vs one process"]
    return f"{table(header, cells)}\n\n{ratio} {source('hf_trainer_cpu', records)}"


CP_WAYS = {
    "seqpar.attention": "`seqpar.attention` on the shards",
    "context_parallel, shards in hand": "SDPA under `context_parallel`, shards in hand",
    "torch snippet (shards full leaves)": "PyTorch's snippet as written (full leaves sharded on entry)",
    "seqpar.attention in the block": "a video block calling `seqpar.attention`",
    "block under context_parallel": "the same block calling SDPA under `context_parallel`",
}


def context_parallel_overhead_table(records: list[dict]) -> str:
    """``benchmarks.context_parallel`` (a): each way's step against the direct call in its group."""
    rows = [r for r in records if r["part"] != "memory"]
    if not rows:
        raise RecordError("benchmarks/context_parallel_cpu.json has no overhead records (run without --skip overhead)")
    cells = [[CP_WAYS.get(r["way"], r["way"]), f"{r['step_s']:.4f}", f"{r['vs_direct']:.3f}"] for r in rows]
    return with_runs("context_parallel_cpu", rows, ["way", "step (s)", "vs `seqpar.attention`"], cells)


def context_parallel_memory_table(records: list[dict]) -> str:
    """``benchmarks.context_parallel`` (b): a video block's per-rank peak growth against one process."""
    rows = [r for r in records if r["part"] == "memory"]
    if not rows:
        raise RecordError("benchmarks/context_parallel_cpu.json has no memory records (run without --skip memory)")
    ranks = " / ".join(str(r) for r in dict.fromkeys(r["ranks"] for r in rows))
    header = ["patch tokens", "1 process (s)", f"{ranks} ranks (s)", "1 process peak growth (MB)", "per rank (MB)"]
    cells = [
        [
            r["tokens"],
            f"{r['single_s']:.3f}",
            f"{r['ranks_s']:.3f}",
            f"{r['single_growth_mb']:.0f}",
            f"{r['rank_growth_mb']:.0f}",
            f"{r['rank_growth_mb'] / r['single_growth_mb']:.2f}",
        ]
        for r in rows
    ]
    return with_runs("context_parallel_cpu", rows, [*header, "ratio"], cells)


def pipeline_time_table(runs: list[dict]) -> str:
    """``benchmarks.pipeline``: each schedule's measured step beside the planner's, every run of the record."""
    cells, owners = [], []
    for run in runs:
        for r in run["time"]:
            cells.append(
                [
                    r["schedule"],
                    r["microbatches"],
                    f"{r['step_s'] * 1e3:.0f}",
                    f"{r['predicted_s'] * 1e3:.0f}",
                    f"{r['predicted_vs_measured']:+.0%}",
                    "yes" if r["time_within_25pct"] else "NO",
                    f"{r['measured_bubble']:.0%}",
                    f"{r['predicted_bubble']:.0%}",
                    f"{r['stage_alone_s'] * 1e3:.0f}",
                ]
            )
            owners.append(run)
    header = ["schedule", "m", "measured step (ms)", "predicted (ms)", "predicted / measured - 1", "within 25%"]
    header += ["measured bubble", "predicted bubble", "stage micro-batch alone (ms)"]
    return with_runs("pipeline_cpu", owners, header, cells)


def pipeline_memory_table(runs: list[dict]) -> str:
    """``benchmarks.pipeline``: each rank's memory, measured / estimated (estimated / measured), MiB."""
    keys = ("state_mb", "in_flight_mb", "growth_mb", "peak_mb")
    cells, owners = [], []
    for run in runs:
        for r in run["memory"]:
            got, est, ratio = r["measured"], r["estimated"], r["estimated_vs_measured"]
            where = f"{r['rank']} ({'first' if r['rank'] == 0 else 'last'})"
            cells.append(
                [
                    r["schedule"],
                    r["microbatches"],
                    where,
                    *(f"{got[k]:.0f} / {est[k]:.0f} ({ratio[k]:.2f})" for k in keys),
                    "yes" if r["memory_within_15pct"] else "NO",
                ]
            )
            owners.append(run)
    if not cells:
        raise RecordError("benchmarks/pipeline_cpu.json has no memory records (a run without --no-memory)")
    header = ["schedule", "m", "rank", "params + grads + AdamW + buffers", "activations in flight", "step growth"]
    return with_runs("pipeline_cpu", owners, [*header, "peak", "within 15%"], cells)


def imports_table(records: list[dict]) -> str:
    """``benchmarks.imports``: each case's fresh process, medians on the wall clock and in CPU time."""
    header = ["case", "wall (s)", "over import torch", "CPU time (s)", "over import torch"]
    cells = [
        [
            f"`{r['case']}`",
            f"{r['wall_s']:.2f}",
            f"{r['wall_over_torch_s']:+.2f}",
            f"{r['cpu_s']:.2f}",
            f"{r['cpu_over_torch_s']:+.2f}",
        ]
        for r in records
    ]
    return with_runs("imports_cpu", records, header, cells)


def run_cells(name: str, records: list[dict]) -> list[str]:
    """The command and date cells of a headline row drawn from one record file."""
    runs = runs_of(records)
    command = f"`{runs[0][0]}`" if len(runs) == 1 else f"{len(runs)} runs in `benchmarks/{name}.json`"
    return [command, " / ".join(dict.fromkeys(date for _, date in runs))]


def measured_rows(attention: list[dict], llama: list[dict], strategies: list[dict], hf: list[dict]) -> list[list]:
    """The README headline rows of attention, the Llama step, the strategies' bytes and the Trainer's step."""
    # the run with the fewest ranks (one core each on the 2-core machine); its memory, which the load does not move
    attention = [r for r in attention if r["ranks"] == min(r["ranks"] for r in attention)]
    seqs = " / ".join(f"{s // 1024}K" for s in dict.fromkeys(r["seq"] for r in attention))
    base = min(llama, key=lambda r: r["sp"])
    memory = ", ".join(f"{r['growth_mb'] / base['growth_mb']:.2f} at sp {r['sp']}" for r in llama if r is not base)
    off = max(abs(r["sent_bytes_per_rank"] / r["analytical_bytes"] - 1) for r in strategies)
    pairs = _pairs(hf)
    return [
        [
            f"attention, per-rank peak memory growth of {attention[0]['ranks']} CPU ranks vs 1 process ({seqs} "
            "tokens, causal fwd+bwd)",
            span([r["memory_ratio"] for r in attention]),
            *run_cells("attention_cpu", attention),
        ],
        [
            f"Llama step at {base['seq']} tokens, per-rank memory vs sp {base['sp']}",
            memory,
            *run_cells("llama_step_cpu", llama),
        ],
        [
            "bytes sent per rank vs each strategy's analytical volume",
            f"within {off:.2%}",
            *run_cells("strategies_cpu", strategies),
        ],
        [
            "Trainer step under seqpar vs seqpar's own loop (median of interleaved pairs)",
            f"{statistics.median(pairs):.3f}x",
            *run_cells("hf_trainer_cpu", hf),
        ],
    ]


def _zoo_why(row: dict) -> str:
    from seqpar.models.zoo import short_reason

    first = short_reason(row.get("reason", "")).split(" | ")[0]  # a refusal on every rank names each problem
    return first.removeprefix("every rank: ")


def zoo_summary_table(records: list[dict], images: list[dict]) -> str:
    """The sweep's totals per mapping (how many families are exact, refused, and so on), and the image sweep's."""
    record = records[-1]
    statuses = list(next(iter(record["totals"].values())))
    rows = [[mapping, *(str(counts[s]) for s in statuses)] for mapping, counts in record["totals"].items()]
    said = f"transformers {record['transformers']}, sp {record['sp']}, {record['rows']} rows of {record['seq']} tokens"
    seen = images[-1]["totals"]
    with_images = ", ".join(f"{count} {status}" for status, count in seen.items() if count)
    return (
        f"{table(['mapping', *statuses], rows)}\n\n{said}. {source('zoo_cpu', records)}\n\n"
        f"With their images, image-text-to-text families at sp {images[-1]['sp']}: {with_images}. "
        f"{source('zoo_images_cpu', images)}"
    )


def zoo_table(records: list[dict], images: list[dict]) -> str:
    """Every model type of the sweep: its status, where seqpar got its anatomy, its status with images (an
    image-text-to-text family), and why it is refused."""
    record, seen = records[-1], images[-1]["models"]
    rows = []
    for model_type, row in record["models"].items():
        pictured = seen.get(model_type, {})
        why = "; ".join(filter(None, (_zoo_why(row), _zoo_why(pictured) if pictured.get("status") != "EXACT" else "")))
        status = [row["status"], row.get("anatomy", ""), pictured.get("status", "")]
        rows.append([f"`{model_type}`", ", ".join(row["mappings"]), *status, why])
    header = ["model type", "mappings", "status", "anatomy", "with images", "why"]
    return f"{table(header, rows)}\n\n{source('zoo_cpu', records)} {source('zoo_images_cpu', images)}"


def _dit_why(name: str, row: dict) -> str:
    """A DiT refusal without the words every refusal shares, at most 200 characters."""
    why = row.get("reason", "").removeprefix("seqpar.prepare_diffusers: ")
    why = why.removeprefix(f"seqpar cannot serve {name} exactly: ").removeprefix(f"the model is a {name}: ")
    if "cannot derive one" in why:
        why = "no plan: it declares no _cp_plan and is not one list of blocks followed by proj_out"
    why = why.replace("|", "/")
    return why if len(why) <= 200 else why[:197] + "..."


def dit_zoo_table(records: list[dict]) -> str:
    """Every diffusers transformer class of the DiT sweep: its status, where its plan comes from, and why not."""
    record = records[-1]
    plan = {"entry": "entry", "derived": "derived"}
    rows = [
        [f"`{name}`", row["status"], plan.get(row.get("plan", ""), ""), _dit_why(name, row)]
        for name, row in sorted(record["models"].items())
    ]
    totals = ", ".join(f"{count} {status}" for status, count in record["totals"].items() if count)
    said = f"diffusers {record['diffusers']}, sp {record['sp']} ({record['strategy']}): {totals}"
    return f"{table(['class', 'status', 'plan', 'why'], rows)}\n\n{said}. {source('dit_zoo_cpu', records)}"
