"""Tables of the documentation built from the benchmark records (benchmarks/*.json), so no page copies a number.

`python scripts/records.py` writes them into the Markdown sources between begin/end markers; `--check` fails on stale.
"""

# The tables live in README.md and docs/**/*.md, each between `<!-- begin records: NAME ... -->` and
# `<!-- end records: NAME -->`, so they read the same on a code host as on the site; a bare
# `<!-- records: NAME -->` becomes such a block when the script runs. The mkdocs hook (mkdocs.yml `hooks:`)
# fails the build while a block is stale or a bare placeholder is left.

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import re
import shlex
import sys


def _sibling(name: str):
    """scripts/NAME.py, loaded by path as mkdocs loads this hook (so neither needs scripts/ on sys.path)."""
    spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tables = _sibling("record_tables")
placement = _sibling("record_placement")
RecordError = tables.RecordError

ROOT = pathlib.Path(__file__).resolve().parent.parent
RECORDS = ROOT / "benchmarks"
README = ROOT / "README.md"
PLACEHOLDER = re.compile(r"(^[ \t]*)?<!-- records: ([a-z_]+) -->", re.MULTILINE)
BLOCK = re.compile(
    r"^([ \t]*)<!-- begin records: ([a-z_]+) \(generated[^\n]*-->\n.*?^[ \t]*<!-- end records: \2 -->",
    re.MULTILINE | re.DOTALL,
)


def begin(name: str) -> str:
    """The line that opens NAME's generated table in a Markdown source."""
    return f"<!-- begin records: {name} (generated from benchmarks/*.json by scripts/records.py; do not edit) -->"


def end(name: str) -> str:
    """The line that closes NAME's generated table."""
    return f"<!-- end records: {name} -->"


BEGIN, END = begin("headline"), end("headline")
PROVENANCE = ("command", "measured")
PLAIN_RING = ("causal", "ring", "zigzag")


def load(name: str, records_dir: pathlib.Path = RECORDS) -> list[dict]:
    """The rows of ``benchmarks/NAME.json``, each checked for the command and date that produced it.

    Args:
        name: The record's file name without ``.json``.
        records_dir: Where the records live (the repository's ``benchmarks/`` unless a test points elsewhere).

    Returns:
        The record's rows, in the order the benchmark wrote them.

    Raises:
        RecordError: The file is missing, is not a non-empty JSON list, or a row lacks ``command``/``measured``.
    """
    path = pathlib.Path(records_dir) / f"{name}.json"
    if not path.is_file():
        raise RecordError(f"benchmarks/{name}.json is missing ({path}): a documentation table is generated from it")
    try:
        rows = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RecordError(f"benchmarks/{name}.json is not valid JSON: {e}") from e
    if not isinstance(rows, list) or not rows:
        raise RecordError(f"benchmarks/{name}.json should hold a non-empty list of records")
    for i, row in enumerate(rows):
        missing = [k for k in PROVENANCE if k not in row]
        if missing:
            raise RecordError(f"benchmarks/{name}.json record {i} lacks {missing}: say how and when it was measured")
    return rows


def _sent_over_needed(r: dict) -> float:
    return sum(r["bytes_sent_per_rank"]) / sum(r["bytes_needed_per_rank"])


def _layout_cell(r: dict) -> str:
    """A record's layout, with what it resolved to when that differs ("auto (placed)")."""
    resolved = r.get("resolved_layout", r["layout"])  # records written before "auto" have none
    return r["layout"] if resolved == r["layout"] else f"{r['layout']} ({resolved})"


def masks_table(records: list[dict]) -> str:
    """The ``benchmarks.masks`` table: step, visible area and bytes against plain causal, balance per rank."""
    causal = {(r["strategy"], r["layout"]): r["step_s"] for r in records if r["mask"] == "causal"}
    cells = []
    for r in records:
        base = causal.get((r["strategy"], r["layout"]))
        cells.append(
            [
                r["strategy"],
                _layout_cell(r),
                r["mask"],
                f"{r['step_s']:.2f}",
                f"{r['step_s'] / base:.2f}" if base else "-",
                f"{r['visible_vs_causal']:.2f}",
                f"{_sent_over_needed(r):.2f}",
                f"{r['rank_time_max_over_mean']:.3f}",
                f"{r['visible_max_over_mean']:.3f}",
            ]
        )
    header = ["strategy", "layout", "mask", "step (s)", "vs causal", "visible vs causal", "sent / needed"]
    header += ["rank compute max/mean", "visible area max/mean"]
    return tables.with_runs("masks_cpu", records, header, cells)


def maxlen_table(records: list[dict]) -> str:
    """The ``seqpar bench maxlen`` table: longest sequence per rung and sp, its ratios, measured and estimated peak."""
    rungs = list(dict.fromkeys(r["features"] for r in records))  # the bench writes them in ladder order
    low_sp = min(r["sp"] for r in records)
    first = {r["features"]: r["max_seq"] for r in records if r["sp"] == low_sp}
    by_key = {(r["features"], r["sp"]): r["max_seq"] for r in records}
    cells = []
    for r in records:
        rung = rungs.index(r["features"])
        below = by_key.get((rungs[rung - 1], r["sp"])) if rung else None
        cells.append(
            [
                r["features"],
                r["sp"],
                f"{r['max_seq']}" + ("" if r["bracketed"] else " (not bracketed)"),
                f"{r['max_seq'] / first[r['features']]:.2f}x" if first.get(r["features"]) else "-",
                f"{r['max_seq'] / below:.2f}x" if below else "-",
                r["peak_mb"],
                r["estimate_mb"],
                f"{r['estimate_mb'] / r['peak_mb']:.2f}" if r["peak_mb"] else "-",
            ]
        )
    header = ["features", "sp", "max seq", f"vs sp {low_sp}", "vs rung below", "measured peak (MB)", "estimate (MB)"]
    return tables.with_runs("maxlen_cpu", records, [*header, "est / measured"], cells)


def masks_bytes_table(records: list[dict]) -> str:
    """Bytes each rank needs under ring per masked row and layout (mean, largest), and the placed layout's balance."""
    ring = [r for r in records if r["strategy"] == "ring" and r["mask"] != "causal"]
    layouts = list(dict.fromkeys(r["layout"] for r in ring))
    by = {(r["mask"], r["layout"]): r for r in ring}
    cells = []
    for mask in dict.fromkeys(r["mask"] for r in ring):
        row = [mask]
        for layout in layouts:
            r = by.get((mask, layout))
            needed = r["bytes_needed_per_rank"] if r else None
            cell = f"{sum(needed) / len(needed) / 1e6:.2f} ({max(needed) / 1e6:.2f})" if needed else "-"
            row.append(cell + (f", {_layout_cell(r)}" if r and _layout_cell(r) != layout else ""))
        floors = [r["floor_bytes"] for r in ring if r["mask"] == mask and r.get("floor_bytes") is not None]
        row.append(f"{floors[0] / 1e6:.2f}" if floors else "-")
        placed = by.get((mask, "placed"), {})
        row += [f"{placed[k]:.3f}" if k in placed else "-" for k in ("planned_max_over_mean", "tokens_max_over_mean")]
        cells.append(row)
    header = [
        "mask",
        *layouts,
        "floor (Note [traffic floor])",
        "placed planned work max/mean",
        "placed tokens max/mean",
    ]
    return tables.with_runs("masks_cpu", ring, header, cells)


def placement_table(records: list[dict]) -> str:
    """The ``benchmarks.placement`` table: per P and row kind, placed against zigzag and balanced over the rows."""
    header, cells, firsts = placement.placement_cells(records)
    return tables.with_runs("placement_cpu", firsts, header, cells)


def rl_memory_table(records: list[dict]) -> str:
    """The ``benchmarks.rl_memory`` table: a DPO / GRPO step's peak growth per rank, its share of sp 1's, estimate."""
    low_sp = min(r["sp"] for r in records)
    runs = list(dict.fromkeys(r["command"] for r in records))
    base = {(r["command"], r["trainer"], r["completion"]): r["peak_mb"] for r in records if r["sp"] == low_sp}
    ordered = sorted(records, key=lambda r: (runs.index(r["command"]), r["trainer"], r["completion"], r["sp"]))
    cells = []
    for r in ordered:
        first = base.get((r["command"], r["trainer"], r["completion"]))
        cells.append(
            [
                r["trainer"].upper(),
                f"{r['completion']:,}",
                r["sp"],
                f"{r['tokens_per_rank']:,}",
                r["peak_mb"],
                f"{r['peak_mb'] / first:.2f}" if first else "-",
                r["estimate_mb"],
                f"{r['estimate_mb'] / r['peak_mb']:.2f}",
            ]
        )
    header = ["trainer", "completion tokens", "sp", "tokens per rank", "measured peak (MB)", f"vs sp {low_sp}"]
    return tables.with_runs("rl_memory_cpu", ordered, [*header, "estimate (MB)", "est / measured"], cells)


def vlm_memory_table(records: list[dict]) -> str:
    """The ``benchmarks.vlm_memory`` table: a VLM step's per-rank peak growth by sp and vision split, estimate."""
    base = min(records, key=lambda r: r["sp"])["growth_mb"]
    cells = [
        [
            r["sp"],
            "on" if r["split_vision"] else "off",
            f"{r['growth_mb']:.0f}",
            f"{r['growth_mb'] / base:.2f}",
            f"{r['predicted_mb']:.0f}",
            f"{r['predicted_mb'] / r['growth_mb']:.2f}",
            f"{r['step_s']:.2f}",
        ]
        for r in records
    ]
    header = ["sp", "vision split", "per-rank peak growth (MB)", "vs the lowest sp", "estimate (MB)"]
    return tables.with_runs("vlm_memory_cpu", records, [*header, "est / measured", "step (s)"], cells)


def video_dit_table(records: list[dict]) -> str:
    """The ``benchmarks.video_dit`` table: a Wan-shaped step's per-rank peak growth, its estimate and time by sp,
    for each clip size."""
    cells = []
    for tokens in sorted({r["tokens"] for r in records}):
        rows = sorted((r for r in records if r["tokens"] == tokens), key=lambda r: r["sp"])
        base = rows[0]
        cells += [
            [
                f"{tokens:,}",
                r["sp"],
                f"{r['tokens'] // r['sp']:,}",
                f"{r['growth_mb']:.0f}",
                f"{r['growth_mb'] / base['growth_mb']:.2f}",
                f"{r['estimate_mb']:.0f}" if "estimate_mb" in r else "-",
                f"{r['estimate_mb'] / r['growth_mb']:.2f}" if "estimate_mb" in r else "-",
                f"{r['step_s']:.2f}",
                f"{r['step_s'] / base['step_s']:.2f}",
            ]
            for r in rows
        ]
    header = ["latent tokens", "sp", "per rank", "per-rank peak growth (MB)", "vs the lowest sp", "estimate (MB)"]
    return tables.with_runs("video_dit_cpu", records, [*header, "est / measured", "step (s)", "vs it"], cells)


MIXER_NAMES = {
    "gated_deltanet": "gated DeltaNet",
    "mamba2": "Mamba2 (SSD)",
    "kda": "KDA",
    "short_conv": "short conv",
    "mamba1": "Mamba1",
    "lightning": "lightning attention",
}


def mixers_table(records: list[dict]) -> str:
    """The ``python -m benchmarks.mixers`` table: each mixer layer's bytes a rank sent (measured, analytical, what a
    head-parallel all-to-all would move) and its adapted step against the shard alone, by sp."""
    cells = [
        [
            MIXER_NAMES[r["mixer"]],
            r["sp"],
            f"{r['sent_bytes'] / 2**10:.0f} KiB",
            f"{r['exchange_bytes_gloo'] / 2**10:.0f} / {r['exchange_bytes'] / 2**10:.0f} KiB",
            f"{r['all_to_all_bytes'] / 2**10:.0f} KiB ({r['all_to_all_bytes'] / r['exchange_bytes']:.0f}x)",
            f"{r['adapted_s']:.3f} s / {r['local_s']:.3f} s ({r['adapted_s'] / r['local_s']:.2f}x)",
        ]
        for r in records
    ]
    header = ["mixer", "sp", "bytes a rank sent (gloo, measured)", "analytical on gloo / on NCCL"]
    header += ["a head-parallel all-to-all would send", "adapted step / the shard alone"]
    return tables.with_runs("mixers_cpu", records, header, cells)


def mixer_models_table(records: list[dict]) -> str:
    """The ``python -m benchmarks.mixers --models`` table: each mixer's one-layer model's training step against a
    one-layer Llama's as wide, by sp."""
    cells = [
        [
            MIXER_NAMES[r["mixer"]],
            r["sp"],
            f"{r['model_step_s']:.3f} s",
            f"{r['llama_step_s']:.3f} s",
            f"{r['model_step_s'] / r['llama_step_s']:.2f}x",
        ]
        for r in records
    ]
    header = ["mixer", "sp", "one-layer model's step", "one-layer Llama's step", "model / Llama"]
    return tables.with_runs("mixer_models_cpu", records, header, cells)


def _maxlen_row(maxlen: list[dict]) -> list[str]:
    rungs = list(dict.fromkeys(r["features"] for r in maxlen))
    top = sorted((r for r in maxlen if r["features"] == rungs[-1]), key=lambda r: r["sp"])
    options = shlex.split(maxlen[-1]["command"])
    budget = f"{options[options.index('--budget-mb') + 1]} MB" if "--budget-mb" in options else "the default"
    lengths = " / ".join(f"{r['max_seq']:,}" for r in top)
    degrees = " / ".join(str(r["sp"]) for r in top)
    what = f"longest sequence in a {budget} step budget, {' + '.join(rungs[1:]) or 'no memory features'} (CPU)"
    return [what, f"{lengths} tokens at sp {degrees}", *tables.run_cells("maxlen_cpu", maxlen)]


def _masks_rows(masks: list[dict]) -> list[list[str]]:
    ranks = masks[0]["ranks"]
    masked = [r for r in masks if r["mask"] != "causal"]
    plain = [_sent_over_needed(r) for r in masks if (r["mask"], r["strategy"], r["layout"]) == PLAIN_RING]
    kinds = ", ".join(dict.fromkeys(r["mask"] for r in masked))
    sent = f"{tables.span([_sent_over_needed(r) for r in masked])}x"
    sent += f" (plain causal ring: {plain[0]:.2f}x)" if plain else ""
    # Ulysses' ranks attend over the whole sequence for their heads, so no layout unbalances them: left out.
    lognormal = [r for r in masks if r["mask"] == "log-normal documents" and r["strategy"] != "ulysses"]
    if not lognormal or {r["layout"] for r in lognormal} < {"balanced", "zigzag"}:
        raise RecordError("benchmarks/masks_cpu.json lacks 'log-normal documents' records in both layouts")
    balance = {
        layout: tables.span([r["rank_time_max_over_mean"] for r in lognormal if r["layout"] == layout])
        for layout in ("balanced", "zigzag")
    }
    strategies = ", ".join(dict.fromkeys(r["strategy"] for r in lognormal))
    return [
        [f"bytes sent per rank vs what the mask makes necessary ({kinds}; P = {ranks})", sent],
        [
            f"slowest rank's attention compute / mean, packed documents of log-normal lengths, P = {ranks} "
            f"({strategies})",
            f"balanced layout {balance['balanced']} (zigzag {balance['zigzag']})",
        ],
    ]


def headline_table(records_dir: pathlib.Path = RECORDS) -> str:
    """The README's headline rows that have a record, each with the command and date that measured it.

    Args:
        records_dir: Where the records live.

    Returns:
        A Markdown table: the longest sequence in a budget, what masks cost in bytes and in balance, attention
            and a Llama step against one process, the strategies' bytes against their volume, the Trainer's step.

    Raises:
        RecordError: A record it needs is missing or lacks the rows it reads.
    """
    maxlen, masks = load("maxlen_cpu", records_dir), load("masks_cpu", records_dir)
    rows = [_maxlen_row(maxlen)] + [[*row, *tables.run_cells("masks_cpu", masks)] for row in _masks_rows(masks)]
    measured = ("attention_cpu", "llama_step_cpu", "strategies_cpu", "hf_trainer_cpu")
    rows += tables.measured_rows(*(load(name, records_dir) for name in measured))
    return tables.table(["what", "result", "command", "measured"], rows)


TABLES = {
    "masks": lambda d: masks_table(load("masks_cpu", d)),
    "masks_bytes": lambda d: masks_bytes_table(load("masks_cpu", d)),
    "placement": lambda d: placement_table(load("placement_cpu", d)),
    "rl_memory": lambda d: rl_memory_table(load("rl_memory_cpu", d)),
    "vlm_memory": lambda d: vlm_memory_table(load("vlm_memory_cpu", d)),
    "video_dit": lambda d: video_dit_table(load("video_dit_cpu", d)),
    "mixers": lambda d: mixers_table(load("mixers_cpu", d)),
    "mixer_models": lambda d: mixer_models_table(load("mixer_models_cpu", d)),
    "maxlen": lambda d: maxlen_table(load("maxlen_cpu", d)),
    "headline": headline_table,
    "attention": lambda d: tables.attention_table(load("attention_cpu", d)),
    "strategies": lambda d: tables.strategies_table(load("strategies_cpu", d)),
    "llama_step": lambda d: tables.llama_step_table(load("llama_step_cpu", d)),
    "features": lambda d: tables.features_table(load("features_cpu", d)),
    "hf_trainer": lambda d: tables.hf_trainer_table(load("hf_trainer_cpu", d)),
    "context_parallel_overhead": lambda d: tables.context_parallel_overhead_table(load("context_parallel_cpu", d)),
    "context_parallel_memory": lambda d: tables.context_parallel_memory_table(load("context_parallel_cpu", d)),
    "pipeline_time": lambda d: tables.pipeline_time_table(load("pipeline_cpu", d)),
    "pipeline_memory": lambda d: tables.pipeline_memory_table(load("pipeline_cpu", d)),
    "imports": lambda d: tables.imports_table(load("imports_cpu", d)),
    "zoo_summary": lambda d: tables.zoo_summary_table(load("zoo_cpu", d), load("zoo_images_cpu", d)),
    "zoo": lambda d: tables.zoo_table(load("zoo_cpu", d), load("zoo_images_cpu", d)),
    "dit_zoo": lambda d: tables.dit_zoo_table(load("dit_zoo_cpu", d)),
}


def expand(markdown: str, records_dir: pathlib.Path = RECORDS, where: str = "page") -> str:
    """Replace each ``<!-- records: NAME -->`` in ``markdown`` with NAME's table, built from the records now.

    A placeholder alone on its line (after spaces, as in a list item) gives a table indented as that line is.

    Args:
        markdown: A page's text.
        records_dir: Where the records live.
        where: The page's name, for the error message.

    Returns:
        The page with every placeholder expanded.

    Raises:
        RecordError: An unknown table name, or a record it needs is missing or incomplete.
    """

    def one(match: re.Match) -> str:
        indent, name = match.group(1) or "", match.group(2)
        if name not in TABLES:
            raise RecordError(f"{where}: no records table '{name}' (known: {', '.join(TABLES)})")
        return indent + TABLES[name](records_dir).replace("\n", "\n" + indent)  # a placeholder in a list item

    return PLACEHOLDER.sub(one, markdown)


def _table(name: str, records_dir: pathlib.Path, where: str) -> str:
    if name not in TABLES:
        raise RecordError(f"{where}: no records table '{name}' (known: {', '.join(TABLES)})")
    return TABLES[name](records_dir)


def _block(indent: str, name: str, table: str) -> str:
    # blank lines around the table: Markdown then reads the markers as HTML comments and the table as a table
    body = "\n".join(indent + line if line else line for line in table.splitlines())
    return f"{indent}{begin(name)}\n\n{body}\n\n{indent}{end(name)}"


def update_blocks(markdown: str, records_dir: pathlib.Path = RECORDS, where: str = "page") -> str:
    """``markdown`` with each generated block rebuilt from the records, and each bare placeholder made a block.

    A block (or placeholder) indented as in a list item keeps that indentation on every line of its table.

    Raises:
        RecordError: An unknown table name, or a record it needs is missing or incomplete.
    """
    rebuilt = BLOCK.sub(lambda m: _block(m.group(1), m.group(2), _table(m.group(2), records_dir, where)), markdown)
    return PLACEHOLDER.sub(
        lambda m: _block(m.group(1) or "", m.group(2), _table(m.group(2), records_dir, where)), rebuilt
    )


def pages(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """The Markdown sources that may hold generated tables: README.md and every page under docs/."""
    return [pathlib.Path(root) / "README.md", *sorted((pathlib.Path(root) / "docs").rglob("*.md"))]


def stale_pages(root: pathlib.Path = ROOT, records_dir: pathlib.Path = RECORDS) -> dict[pathlib.Path, str]:
    """Each source whose generated tables differ from the records now (or that holds a bare placeholder), with
    the text it should hold."""
    stale = {}
    for path in pages(root):
        text = path.read_text()
        new = update_blocks(text, records_dir, where=str(path.relative_to(root)))
        if new != text:
            stale[path] = new
    return stale


def check_pages(root: pathlib.Path = ROOT, records_dir: pathlib.Path = RECORDS) -> None:
    """Raise ``RecordError`` naming every source whose generated tables are stale (README.md's block included)."""
    update_readme((pathlib.Path(root) / "README.md").read_text(), records_dir)  # its markers must be there
    stale = stale_pages(root, records_dir)
    if stale:
        names = ", ".join(str(p.relative_to(root)) for p in stale)
        raise RecordError(f"generated tables are stale in {names}: run `python scripts/records.py` and commit them")


def update_readme(text: str, records_dir: pathlib.Path = RECORDS) -> str:
    """README.md's text with the block between its headline markers rebuilt from the records.

    Raises:
        RecordError: The markers are missing, or a record is.
    """
    if BLOCK.search(text) is None or BEGIN not in text:
        raise RecordError(f"README.md lacks the generated block's markers:\n{BEGIN}\n...\n{END}")
    return update_blocks(text, records_dir, where="README.md")


def check_readme(readme: pathlib.Path = README, records_dir: pathlib.Path = RECORDS) -> None:
    """Raise ``RecordError`` when README.md's generated block differs from what the records give now."""
    text = pathlib.Path(readme).read_text()
    if update_readme(text, records_dir) != text:
        raise RecordError(f"{readme.name}'s headline block is stale: run `python scripts/records.py` and commit it")


def on_pre_build(config, **kwargs) -> None:
    """mkdocs hook: fail the build while a generated table (README.md's or a page's) no longer matches the records."""
    from mkdocs.exceptions import PluginError

    try:
        check_pages(ROOT, RECORDS)  # the module's paths as they are now, so a test can point them elsewhere
    except RecordError as e:
        raise PluginError(str(e)) from e


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Rewrite (or --check) the generated tables from the records.")
    parser.add_argument("--check", action="store_true", help="only check; exit 1 when a table is stale")
    args = parser.parse_args(argv)
    try:
        if args.check:
            check_pages(ROOT, RECORDS)
        else:
            for path, text in stale_pages(ROOT, RECORDS).items():
                path.write_text(text)
    except RecordError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
