"""The documentation's generated tables: built from benchmarks/*.json, following a changed record, failing without one.

No process groups: this reads the records and the pages only (scripts/records.py, the mkdocs hook).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil
import types

import pytest
from mkdocs.exceptions import PluginError

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
    assert headline.count("| `seqpar bench masks") == 2 and headline.count("| `seqpar bench maxlen") == 1
    for line in headline.splitlines()[2:]:  # each headline row carries its own record's date
        rows = masks if "| `seqpar bench masks" in line else maxlen
        assert line.endswith(f" | {rows[0]['measured']} |"), line


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
    assert "<!-- records: rl_memory -->" in guide


def test_a_changed_record_changes_the_tables(tmp_path):
    target = _copy_records(tmp_path)

    def longer(rows):
        rows[-1].update(max_seq=40960, command="seqpar bench maxlen --budget-mb 150", measured="2030-01-02")

    def slower(rows):
        for r in rows:
            if (r["strategy"], r["layout"], r["mask"]) == ("ring", "zigzag", "log-normal documents"):
                r["rank_time_max_over_mean"] = 1.9

    _edit(target / "maxlen_cpu.json", longer)
    _edit(target / "masks_cpu.json", slower)
    page = records.expand("<!-- records: masks -->\n<!-- records: maxlen -->", target)
    before = records.expand("<!-- records: masks_bytes -->")
    _edit(target / "masks_cpu.json", lambda rows: [r.update(bytes_needed_per_rank=[1e6, 1e6, 1e6, 3e6]) for r in rows])
    after = records.expand("<!-- records: masks_bytes -->", target)
    assert "| 1.50 (3.00) |" in after and after != before
    assert "| 1.900 |" in _row(page, "ring", "zigzag", "log-normal documents")
    assert "| 40960 | 4.92x |" in _row(page, "tiled_mlp", "4")
    assert "run 2: `seqpar bench maxlen --budget-mb 150`, measured 2030-01-02" in page  # two runs now
    assert _row(page, "tiled_mlp", "4").endswith("| 2 |") and _row(page, "none", "1").endswith("| 1 |")
    headline = records.headline_table(target)
    assert "40,960 tokens at sp 1 / 2 / 4" in headline and "in a 150 MB step budget" in headline
    assert "1.90)" in headline.split("(zigzag ")[1]  # the zigzag span now ends at the changed row's 1.90
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
    page = types.SimpleNamespace(file=types.SimpleNamespace(src_path="benchmarks.md"))
    with pytest.raises(PluginError, match=r"maxlen_cpu\.json is missing"):
        records.on_page_markdown("<!-- records: maxlen -->", page=page, config=None, files=None)
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


def test_the_docs_use_the_hook_and_the_placeholders():
    assert "scripts/records.py" in (ROOT / "mkdocs.yml").read_text()
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text()
    assert "<!-- records: masks -->" in benchmarks and "<!-- records: maxlen -->" in benchmarks
