"""The documentation's generated tables: built from benchmarks/*.json, following a changed record, failing without one.

No process groups: this reads the records and the pages only (scripts/records.py, the mkdocs hook).
"""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import shutil
import statistics

import pytest
from mkdocs.exceptions import PluginError

pytestmark = pytest.mark.fast  # the quick tier: scripts/test.sh --fast

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("docs_records", ROOT / "scripts" / "records.py")
records = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(records)


def _copy_records(tmp_path: pathlib.Path) -> pathlib.Path:
    target = tmp_path / "benchmarks"
    shutil.copytree(ROOT / "benchmarks", target)
    return target


def _edit(path: pathlib.Path, change) -> None:
    rows = json.loads(path.read_text())
    change(rows)
    path.write_text(json.dumps(rows, indent=1))


def _row(table: str, *cells: str) -> str:
    """The one table line that starts with these cells."""
    found = [line for line in table.splitlines() if line.startswith("| " + " | ".join(cells) + " |")]
    assert len(found) == 1, (cells, found)
    return found[0]


def test_tables_render_every_record_with_its_command_and_date():
    masks, maxlen = records.load("masks_cpu"), records.load("maxlen_cpu")
    page = records.expand("<!-- records: masks -->\n\n<!-- records: maxlen -->\n\n<!-- records: headline -->")
    assert "<!-- records:" not in page
    for r in masks:
        line = _row(page, r["strategy"], r["layout"], r["mask"])
        assert f"| {r['step_s']:.2f} |" in line and f"| {r['rank_time_max_over_mean']:.3f} |" in line
    for r in maxlen:
        assert f"| {r['estimate_mb']} |" in _row(page, r["features"], str(r["sp"]), str(r["max_seq"]))
    for name, rows in (("masks_cpu", masks), ("maxlen_cpu", maxlen)):
        said = f"`{rows[0]['command']}`, measured {rows[0]['measured']}."
        assert f"Generated from `benchmarks/{name}.json`: {said}" in page
    headline = records.headline_table()
    assert headline.count("| `python -m benchmarks.masks") == 2 and headline.count("| `seqpar bench maxlen") == 1
    masks_lines = [line for line in headline.splitlines() if "benchmarks.masks" in line]
    assert all(line.endswith(f" | {masks[0]['measured']} |") for line in masks_lines)


def _rl_line(table: str, r: dict) -> str:
    """The rl_memory table's line of record ``r``: its trainer, length and sp, then its measured peak."""
    cells = (r["trainer"].upper(), f"{r['completion']:,}", str(r["sp"]), f"{r['tokens_per_rank']:,}", str(r["peak_mb"]))
    return _row(table, *cells)


def test_rl_memory_table_renders_every_step_with_its_share_of_sp_1(tmp_path):
    rows = records.load("rl_memory_cpu")
    page = records.expand("<!-- records: rl_memory -->")
    for r in rows:
        assert f"| {r['estimate_mb']} | {r['estimate_mb'] / r['peak_mb']:.2f} |" in _rl_line(page, r)
    assert f"Generated from `benchmarks/rl_memory_cpu.json`: run 1: `{rows[0]['command']}`" in page
    target = _copy_records(tmp_path)  # a changed measurement changes its share of sp 1's
    i = next(i for i, r in enumerate(rows) if r["sp"] == 2)
    key = (rows[i]["command"], rows[i]["trainer"], rows[i]["completion"], 1)
    base = next(r for r in rows if (r["command"], r["trainer"], r["completion"], r["sp"]) == key)
    _edit(target / "rl_memory_cpu.json", lambda rs: rs[i].update(peak_mb=base["peak_mb"] / 4))
    changed = records.expand("<!-- records: rl_memory -->", target)
    assert f"| {base['peak_mb'] / 4} | 0.25 |" in _rl_line(changed, {**rows[i], "peak_mb": base["peak_mb"] / 4})
    guide = (ROOT / "docs" / "guides" / "preference-and-rl.md").read_text()
    assert records.begin("rl_memory") in guide and _rl_line(guide, rows[0])  # the table, in the page's source


def test_a_changed_record_changes_the_tables(tmp_path):
    target = _copy_records(tmp_path)

    def longer(rows):
        rows[-1].update(max_seq=40960, command="seqpar bench maxlen --budget-mb 150", measured="2030-01-02")

    picked = {"log-normal documents": "placed", "causal": "balanced"}

    def slower(rows):
        for r in rows:
            if (r["strategy"], r["layout"], r["mask"]) == ("ring", "zigzag", "log-normal documents"):
                r["rank_time_max_over_mean"] = 9.9  # above every recorded one: it ends the headline's span
        # a run with --layouts auto: each record says what its mask resolved to
        auto = [r for r in rows if r["strategy"] == "ring" and r["layout"] == picked.get(r["mask"])]
        rows += [{**r, "layout": "auto", "resolved_layout": picked[r["mask"]]} for r in auto]

    _edit(target / "maxlen_cpu.json", longer)
    _edit(target / "masks_cpu.json", slower)
    page = records.expand("<!-- records: masks -->\n<!-- records: maxlen -->", target)
    before = records.expand("<!-- records: masks_bytes -->")
    _edit(target / "masks_cpu.json", lambda rows: [r.update(bytes_needed_per_rank=[1e6, 1e6, 1e6, 3e6]) for r in rows])
    after = records.expand("<!-- records: masks_bytes -->", target)
    assert "| 1.50 (3.00) |" in after and after != before
    assert "| 1.50 (3.00), auto (placed) |" in _row(after, "log-normal documents")

    def floor(rows):  # the floor column: the row's floor_bytes, a dash where there is none
        for r in rows:
            r["floor_bytes"] = 2.5e6 if r["mask"] == "log-normal documents" else None

    _edit(target / "masks_cpu.json", floor)
    floors = records.expand("<!-- records: masks_bytes -->", target)
    assert "| 2.50 |" in _row(floors, "log-normal documents") and "| 2.50 |" not in _row(floors, "RL groups")
    for mask, layout in picked.items():  # the auto row: its layout's numbers, under "auto (placed)"
        step = _row(page, "ring", layout, mask).split(" | ")[3]
        assert _row(page, "ring", f"auto ({layout})", mask).split(" | ")[3] == step, mask
    assert "| 9.900 |" in _row(page, "ring", "zigzag", "log-normal documents")
    assert "| 40960 | 4.92x |" in _row(page, "tiled_mlp", "4")
    assert "run 2: `seqpar bench maxlen --budget-mb 150`, measured 2030-01-02" in page  # two runs now
    assert _row(page, "tiled_mlp", "4").endswith("| 2 |") and _row(page, "none", "1").endswith("| 1 |")
    headline = records.headline_table(target)
    assert "40,960 tokens at sp 1 / 2 / 4" in headline and "in a 150 MB step budget" in headline
    assert "9.90)" in headline.split("(zigzag ")[1]  # the zigzag span now ends at the changed row's 9.90
    assert headline != records.headline_table()


def test_a_missing_or_incomplete_record_fails_naming_the_file(tmp_path, monkeypatch):
    target = _copy_records(tmp_path)
    (target / "maxlen_cpu.json").unlink()
    with pytest.raises(records.RecordError, match=r"benchmarks/maxlen_cpu\.json is missing"):
        records.expand("text <!-- records: maxlen -->", target)
    with pytest.raises(records.RecordError, match=r"benchmarks/maxlen_cpu\.json is missing"):
        records.headline_table(target)
    _edit(target / "masks_cpu.json", lambda rows: rows[3].pop("measured"))
    with pytest.raises(records.RecordError, match=r"benchmarks/masks_cpu\.json record 3 lacks \['measured'\]"):
        records.expand("<!-- records: masks -->", target)
    with pytest.raises(records.RecordError, match="no records table 'speed'"):
        records.expand("<!-- records: speed -->", target)
    # Through the mkdocs hook the same failure is a PluginError, which aborts `mkdocs build`.
    monkeypatch.setattr(records, "RECORDS", target)
    with pytest.raises(PluginError, match="is missing"):
        records.on_pre_build(config=None)


def test_readme_block_is_current_and_a_stale_one_fails(tmp_path):
    records.check_readme()  # README.md as committed matches the records
    target = _copy_records(tmp_path)
    _edit(target / "masks_cpu.json", lambda rows: rows[0].update(measured="2030-01-02"))
    readme = tmp_path / "README.md"
    readme.write_text(records.README.read_text())
    with pytest.raises(records.RecordError, match="stale"):
        records.check_readme(readme, target)
    readme.write_text(records.update_readme(readme.read_text(), target))
    records.check_readme(readme, target)
    assert "2030-01-02" in readme.read_text()


def test_the_docs_use_the_hook_and_hold_the_tables():
    assert "scripts/records.py" in (ROOT / "mkdocs.yml").read_text()
    pages = {
        "benchmarks.md": ("attention", "strategies", "llama_step", "masks", "masks_bytes", "placement", "maxlen"),
        "guides/memory.md": ("features",),
        "guides/hf.md": ("hf_trainer",),
        "guides/context-parallel.md": ("context_parallel_overhead", "context_parallel_memory"),
        "guides/pipeline.md": ("pipeline_time", "pipeline_memory"),
        "guides/hybrid-models.md": ("mixers",),
        "guides/preference-and-rl.md": ("rl_memory",),
        "guides/vision-language.md": ("vlm_memory",),
        "guides/video-dits.md": ("video_dit",),
    }
    for page, names in pages.items():
        text = (ROOT / "docs" / page).read_text()
        for name in names:  # the table itself, between its markers, in the Markdown source
            inside = text.split(records.begin(name), 1)[-1].split(records.end(name), 1)[0]
            assert records.begin(name) in text and "|---|" in inside, (page, name)
    # In a list item the table keeps the item's indentation, or Markdown would end the item before it.
    item = records.update_blocks("- speed:\n\n  <!-- records: hf_trainer -->\n")
    assert all(line.startswith("  ") for line in item.splitlines()[2:] if line), item
    assert records.update_blocks(item) == item  # a block rebuilt from the same records is unchanged


def test_the_sources_hold_current_tables_and_no_bare_placeholder():
    records.check_pages()  # README.md and docs/ as committed match the records
    for page in records.pages():
        assert not records.PLACEHOLDER.search(page.read_text()), f"{page}: run python scripts/records.py"


def test_a_stale_table_or_a_bare_placeholder_fails(tmp_path, monkeypatch):
    target = _copy_records(tmp_path)
    root = tmp_path / "repo"
    (root / "docs" / "guides").mkdir(parents=True)
    (root / "README.md").write_text(records.README.read_text())
    page = root / "docs" / "guides" / "hf.md"
    page.write_text((ROOT / "docs" / "guides" / "hf.md").read_text())
    records.check_pages(root, target)
    _edit(target / "hf_trainer_cpu.json", lambda rows: rows[0].update(measured="2030-01-02"))
    with pytest.raises(records.RecordError, match=r"stale in README\.md, docs/guides/hf\.md: run"):
        records.check_pages(root, target)
    page.write_text(records.update_blocks(page.read_text(), target))
    (root / "README.md").write_text(records.update_readme((root / "README.md").read_text(), target))
    records.check_pages(root, target)
    assert "2030-01-02" in page.read_text()
    (root / "docs" / "new.md").write_text("# New\n\n<!-- records: hf_trainer -->\n")
    with pytest.raises(records.RecordError, match=r"stale in docs/new\.md: run"):
        records.check_pages(root, target)
    # the mkdocs hook fails the build the same way
    monkeypatch.setattr(records, "ROOT", root)
    monkeypatch.setattr(records, "RECORDS", target)
    with pytest.raises(PluginError, match=r"stale in docs/new\.md"):
        records.on_pre_build(config=None)
    assert records.main([]) == 0 and records.main(["--check"]) == 0
    assert "<!-- begin records: hf_trainer" in (root / "docs" / "new.md").read_text()


# The measured tables: for each record, a cell text each of its rows must show (formatted as the table does).
MEASURED = {
    "attention": (
        "attention_cpu",
        lambda r: (
            f"| {r['seq']} | {r['strategy']} | {r['ranks']} | {r['single_s']:.2f} | {r['parallel_s']:.2f} | "
            f"{r['speedup']:.2f}x |"
        ),
    ),
    "strategies": (
        "strategies_cpu",
        lambda r: f"| {r['sent_bytes_per_rank'] / 2**20:.2f} MiB | {r['analytical_bytes'] / 2**20:.2f} MiB |",
    ),
    "llama_step": ("llama_step_cpu", lambda r: f"| {r['sp']} | {r['step_s']:.2f} | {r['seq'] / r['step_s']:.0f} |"),
    "features": (
        "features_cpu",
        lambda r: f"| {r['tokens_per_s']:.0f} | {r['vs_first_wall']:.3f}x | {r['vs_first_cpu']:.3f}x |",
    ),
    "hf_trainer": ("hf_trainer_cpu", lambda r: f"| {r['step_s']:.2f} | {r['growth_mb']:.0f} |"),
    "context_parallel_overhead": ("context_parallel_cpu", lambda r: f"| {r['step_s']:.4f} | {r['vs_direct']:.3f} |"),
    "context_parallel_memory": ("context_parallel_cpu", lambda r: f"| {r['tokens']} | {r['single_s']:.3f} |"),
    "mixers": ("mixers_cpu", lambda r: f"| {r['sp']} | {r['sent_bytes'] / 2**10:.0f} KiB |"),
}


def _pipeline_cells(run: dict) -> list[str]:
    cells = [f"| {t['schedule']} | {t['microbatches']} | {t['step_s'] * 1e3:.0f} |" for t in run["time"]]
    return cells + [f"| {m['measured']['peak_mb']:.0f} / {m['estimated']['peak_mb']:.0f} (" for m in run["memory"]]


def test_measured_tables_render_every_record_with_its_command():
    for placeholder, (name, cell) in MEASURED.items():
        page = records.expand(f"<!-- records: {placeholder} -->")
        rows = records.load(name)
        part = [r for r in rows if "part" not in r or (r["part"] == "memory") == placeholder.endswith("memory")]
        assert part and all(cell(r) in page for r in part), placeholder
        assert f"Generated from `benchmarks/{name}.json`" in page and f"`{rows[0]['command']}`" in page
    page = records.expand("<!-- records: pipeline_time -->\n<!-- records: pipeline_memory -->")
    for run in records.load("pipeline_cpu"):
        assert all(c in page for c in _pipeline_cells(run)) and f"`{run['command']}`" in page
    headline = records.headline_table()
    lab = ("llama_step", "strategies", "hf_trainer")  # python -m benchmarks.NAME; attention is a seqpar bench
    for name, command in (("attention", "seqpar bench attention"), *((n, f"python -m benchmarks.{n}") for n in lab)):
        assert f"| `{command}" in headline or f"runs in `benchmarks/{name}_cpu.json` |" in headline


def test_a_changed_measurement_changes_its_table(tmp_path):
    target = _copy_records(tmp_path)
    _edit(target / "attention_cpu.json", lambda rows: rows[0].update(speedup=9.99, memory_ratio=0.11))
    _edit(
        target / "strategies_cpu.json", lambda rows: rows[0].update(sent_bytes_per_rank=2 * rows[0]["analytical_bytes"])
    )
    _edit(target / "llama_step_cpu.json", lambda rows: rows[-1].update(growth_mb=rows[0]["growth_mb"] * 0.3))
    _edit(target / "features_cpu.json", lambda rows: rows[-1].update(vs_first_cpu=0.123))
    _edit(target / "hf_trainer_cpu.json", lambda rows: rows[0].update(vs_own_step_pairs=[1.5, 1.7, 1.9]))
    _edit(target / "context_parallel_cpu.json", lambda rows: rows[2].update(vs_direct=4.321))
    _edit(target / "pipeline_cpu.json", lambda runs: runs[0]["time"][0].update(time_within_25pct=False))
    names = [*MEASURED, "pipeline_time"]
    page = records.expand("\n".join(f"<!-- records: {n} -->" for n in names), target)
    assert "| 9.99x |" in page and "| 2.0000 |" in page and "| 0.30 |" in page and "| 0.123x |" in page
    assert "| 4.321 |" in page and "median 1.700x over 3 interleaved pairs (1.500 to 1.900 per pair)" in page
    assert " | NO | " in page
    headline = records.headline_table(target)
    assert "| 0.11-" in headline and "within 100.00%" in headline and "| 1.700x |" in headline


def _placement_cells(table: str, ranks: int, kind: str) -> list[str]:
    """The placement table's cells on the line of (P, row kind), the kind named as the table names it."""
    name = records.placement.KIND_NAMES[kind]
    found = [line for line in table.splitlines() if line.startswith(f"| {ranks} |") and f"| {name} |" in line]
    assert len(found) == 1, (ranks, kind, found)
    return [c.strip() for c in found[0].split("|")[1:-1]]


def test_placement_table_summarises_the_rows_of_each_p_and_kind(tmp_path):
    rows = records.load("placement_cpu")
    page = records.expand("<!-- records: placement -->")
    groups = {}
    for r in rows:
        groups.setdefault((r["ranks"], r["kind"]), []).append(r)
    assert len([line for line in page.splitlines() if line.startswith("| ") and line[2].isdigit()]) == len(groups)
    for (ranks, kind), rs in groups.items():  # worked out here from the rows, as the column headers say
        cells = _placement_cells(page, ranks, kind)
        ratios = sorted(r["needed_bytes_max"]["placed"] / r["needed_bytes_max"]["zigzag"] for r in rs)
        geo = math.prod(ratios) ** (1 / len(ratios))
        assert cells[:3] == [str(ranks), str(rs[0]["seq"]), str(len(rs))]
        assert cells[4] == f"{geo:.2f} / {statistics.median(ratios):.2f} / {ratios[-1]:.2f}"
        under = [r["floor_bytes"] / r["needed_bytes_max"]["zigzag"] for r in rs]
        assert cells[6] == f"{statistics.median(under):.2f} / {max(under):.2f}"
        floored = [r["needed_bytes_max"]["placed"] / r["floor_bytes"] for r in rs if r["floor_kv"]]
        assert cells[7].endswith(f"({len(floored)})")
        if floored:
            assert cells[7].startswith(f"{math.prod(floored) ** (1 / len(floored)):.2f} / {max(floored):.2f} ")
        assert cells[10] == f"{sum(r['placed_no_kv'] for r in rs)}/{len(rs)}"
        assert cells[8].startswith(f"{max(r['planned_max_over_mean']['placed'] for r in rs):.3f} (")
    assert f"Generated from `benchmarks/placement_cpu.json`: `{rows[0]['command']}`, measured" in page
    target = _copy_records(tmp_path)  # one row's placed bytes at 3x balanced's, moving no K/V elsewhere
    first = rows[0]

    def worse(rs):
        rs[0]["needed_bytes_max"]["placed"] = 3 * rs[0]["needed_bytes_max"]["balanced"]
        rs[0]["tokens_max_over_mean"] = 1.25

    _edit(target / "placement_cpu.json", worse)
    cells = _placement_cells(records.expand("<!-- records: placement -->", target), first["ranks"], first["kind"])
    assert cells[5].endswith(" / 3.00") and cells[9] == "1.250"
    (target / "placement_cpu.json").unlink()
    with pytest.raises(records.RecordError, match=r"benchmarks/placement_cpu\.json is missing"):
        records.expand("<!-- records: placement -->", target)
