"""The documentation stays true: its marked snippets run, its sample outputs and quoted messages are seqpar's own.

Cited names exist, and figures tied to a record (or to the test count) are what it gives (Note [docs tests]).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]
_FENCE = re.compile(r"^```([a-z]*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
_MARKED = re.compile(r"<!-- docs-test: (run|output) -->\n```([a-z]*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
FIGURE = re.compile(r"<!-- figure (\w+)((?: [\w.]+=[^ :]+)*): (.*?) -->")
# Note [docs tests]
# Conventions in the Markdown sources (HTML comments: invisible on the site and on a code host):
# - ``<!-- docs-test: run -->`` on the line before a ```python block: the block runs as written, alone, in one
#   CPU process (a subprocess), and must not raise.
# - ``<!-- docs-test: output -->`` before a ``` block that opens with ``$ seqpar ...``: the command runs and the
#   block's other lines must be the first lines it prints.
# - ``FIGURE<!-- figure RECORD [key=value ...]: TEMPLATE -->``: the text before the comment must end with
#   TEMPLATE, an f-string over the rows of ``benchmarks/RECORD.json`` whose fields match every ``key=value``
#   (``a|b`` for either; ``rows``, and with one row its fields by name). RECORD ``tests`` is the suite itself:
#   ``collected`` and ``fast`` test counts. Avoid ``][`` in a template: mkdocs-autorefs reads it as a link.
_SAFE = {"min": min, "max": max, "sum": sum, "len": len, "abs": abs, "round": round, "zip": zip, "sorted": sorted}


def _name(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


def _marked(kind: str) -> list[tuple[str, str]]:
    """(page, block text) of every block marked ``<!-- docs-test: KIND -->``."""
    return [(_name(p), m.group(3)) for p in PAGES for m in _MARKED.finditer(p.read_text()) if m.group(1) == kind]


def _env() -> dict[str, str]:
    # the checkout's seqpar, one thread (the machine's cores are shared with other tests)
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}


@pytest.mark.fast
def test_every_page_marks_runnable_snippets_and_outputs():
    # the conventions stay in use: a typo in a marker would silently check nothing
    for text in (p.read_text() for p in PAGES):
        for marker in re.findall(r"<!-- docs-test:[^>]*-->", text):
            assert re.fullmatch(r"<!-- docs-test: (run|output) -->", marker), marker
    assert len(_marked("run")) >= 3 and len(_marked("output")) >= 2


@pytest.mark.parametrize(("page", "code"), _marked("run"), ids=lambda v: v if v.endswith(".md") else "")
def test_runnable_snippets_run(page, code):
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{page}: the snippet failed:\n{code}\n{done.stderr[-3000:]}"


def _command_and_lines(block: str) -> tuple[list[str], list[str]]:
    """A console block's command (its ``\\`` continuations joined) and the lines it shows after it."""
    lines = block.splitlines()
    command = lines.pop(0)
    while command.endswith("\\"):
        command = command[:-1] + " " + lines.pop(0).strip()
    assert command.startswith("$ seqpar "), command
    return shlex.split(command)[2:], lines


@pytest.mark.parametrize(("page", "block"), _marked("output"), ids=lambda v: v if v.endswith(".md") else "")
def test_sample_outputs_are_what_the_commands_print(page, block):
    from seqpar.cli import main

    argv, shown = _command_and_lines(block)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    printed = out.getvalue().splitlines()
    assert shown, f"{page}: an output block with no output"
    assert printed[: len(shown)] == shown, f"{page}: `seqpar {' '.join(argv)}` now prints:\n" + "\n".join(
        printed[: len(shown) + 2]
    )


def _resolves(dotted: str) -> bool:
    """Whether ``seqpar.a.b`` names an attribute or module of seqpar (the first names may be modules)."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(".".join(parts[: i + 1]))
        except ImportError:
            return False
    return True


@pytest.mark.fast
def test_every_seqpar_name_the_pages_cite_exists():
    cited = re.compile(r"\bseqpar(?:\.[A-Za-z_]\w*)+")
    missing = set()
    for page in PAGES:
        text = page.read_text()
        # inline code in prose, and Python blocks (console blocks hold file names such as seqpar.log)
        code = [m.group(2) for m in _FENCE.finditer(text) if m.group(1) == "python"]
        prose = " ".join(re.findall(r"`([^`\n]+)`", _FENCE.sub("", text)))
        for dotted in cited.findall(" ".join([prose, *code])):
            if not _resolves(dotted.rstrip(".")):
                missing.add(f"{_name(page)}: {dotted}")
    assert not missing, sorted(missing)


def _source_text() -> str:
    """seqpar's source with adjacent string literals joined and f-string fields blanked (any value fits)."""
    text = "\n".join(p.read_text() for p in sorted((ROOT / "src" / "seqpar").rglob("*.py")))
    text = re.sub(r"\"\s*\n\s*[rfb]*\"", "", text)
    return re.sub(r"\{[^{}\n]*\}", "\x00", text)


@pytest.mark.fast
def test_troubleshooting_quotes_messages_seqpar_raises():
    # A quoted message is cut at its variable parts (`...`, one-capital placeholders) and where seqpar joins
    # messages (": "); every piece of two words or more must be in the source, so a removed message fails.
    source = _source_text()
    stale = []
    for line in (DOCS / "troubleshooting.md").read_text().splitlines():
        if not line.startswith("| `"):
            continue
        for quote in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
            pieces = re.split(r"\.\.\.|\b[A-Z]\b|'[A-Z]'|: ", quote)
            stale += [f"{quote!r}: {p.strip()!r}" for p in pieces if len(p.split()) >= 2 and p.strip() not in source]
    assert not stale, stale


def _rows(record: str, selectors: str) -> list[dict]:
    rows = json.loads((ROOT / "benchmarks" / f"{record}.json").read_text())
    wanted = dict(s.split("=", 1) for s in selectors.split())
    return [r for r in rows if all(str(r.get(k)) in v.split("|") for k, v in wanted.items())]


def _figures(record: str | None = None) -> list[tuple[str, str, str, str, str]]:
    """(page, record, selectors, template, the text before the comment) of every tied figure."""
    found = []
    for page in PAGES:
        text = page.read_text()
        # code spans blanked (same length, so positions hold): a page may show the syntax itself
        scanned = re.sub(r"`[^`\n]*`", lambda c: " " * len(c.group(0)), text)
        for m in FIGURE.finditer(scanned):
            if record is None or (m.group(1) == "tests") == (record == "tests"):
                found.append((_name(page), m.group(1), m.group(2), m.group(3), text[: m.start()]))
    return found


def _render(template: str, names: dict) -> str:
    return eval("f" + repr(template), {"__builtins__": _SAFE}, names)  # the project's own pages, not input


@pytest.mark.fast
def test_figures_in_prose_are_their_records():
    figures = _figures("records")
    assert len(figures) >= 10, "the pages tie their figures to records with <!-- figure RECORD ...: ... -->"
    wrong = []
    for page, record, selectors, template, before in figures:
        rows = _rows(record, selectors)
        assert rows, f"{page}: no row of {record} has {selectors.strip()}"
        names = {"rows": rows, **(rows[0] if len(rows) == 1 else {})}
        want = _render(template, names)
        if not before.endswith(want):
            wrong.append(f"{page}: {record}{selectors} gives {want!r}, the page says {before[-len(want) - 10 :]!r}")
    assert not wrong, wrong


_COUNT = """
import json, sys, pytest
class Count:
    def pytest_collection_finish(self, session):
        fast = sum(1 for item in session.items if item.get_closest_marker("fast"))
        print("COUNTS " + json.dumps({"collected": len(session.items), "fast": fast}))
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests"], plugins=[Count()]))
"""


def _counts(request: pytest.FixtureRequest) -> dict[str, int]:
    """The suite's test counts: this session's when it collected the whole suite, else a collection run."""
    session, config = request.session, request.config
    whole = [str(a).rstrip("/") for a in config.args] in ([], ["tests"], [str(ROOT / "tests")])
    if whole and not config.option.keyword and not config.option.markexpr and not config.option.deselect:
        items = session.items
        return {"collected": len(items), "fast": sum(1 for i in items if i.get_closest_marker("fast"))}
    done = subprocess.run(
        [sys.executable, "-c", _COUNT], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600
    )
    line = [x for x in done.stdout.splitlines() if x.startswith("COUNTS ")]
    assert line, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(line[0][len("COUNTS ") :])


def test_test_counts_are_what_pytest_collects(request):
    figures = _figures("tests")
    assert figures, "docs/testing.md ties its test counts to <!-- figure tests: ... -->"
    counts = _counts(request)
    for page, _, _, template, before in figures:
        want = _render(template, counts)
        assert before.endswith(want), f"{page}: pytest collects {want}, the page says {before[-20:]!r}"


@pytest.mark.fast
def test_the_hybrid_guide_names_the_fused_kernels_the_adapters_reach():
    # transformers decorates some kernel functions the adapters call with a dispatcher to a fused package's
    # kernel (fla, mamba_ssm) where it is installed; the guide must say where the GPU path goes
    import transformers

    from seqpar.sequence_parallel.mixers import ADAPTERS

    kernels = {a.kernel for a in ADAPTERS.values() if a.kernel is not None}
    sources = pathlib.Path(transformers.__file__).parent.glob("models/*/modeling_*.py")
    fused = set()
    for source in sources:
        text = source.read_text()
        for kernel in kernels:
            dispatched = rf'@use_kernel_func_from_hub_with_fallback\("(\w+)", "(\w+)"\)\ndef {kernel}\('
            fused.update(re.findall(dispatched, text))
    guide = (DOCS / "guides" / "hybrid-models.md").read_text()
    assert fused, "no dispatched kernel found: transformers' decorator changed, so check the guide by hand"
    missing = [f"{package}'s {name}" for name, package in sorted(fused) if f"`{name}`" not in guide]
    assert not missing, f"docs/guides/hybrid-models.md does not say the GPU path reaches {missing}"


@pytest.mark.fast
def test_the_planning_guide_leaves_out_nothing_the_time_model_holds():
    # Note [plan time model] has one bullet per part it models ("- Pipeline parallel (pp > 1, ...): ...");
    # the guide's "Left out:" list must name none of them
    source = (ROOT / "src" / "seqpar" / "planning" / "timing.py").read_text()
    note = source.split("# Note [plan time model]", 1)[1].split("\n\n", 1)[0]
    modelled = [" ".join(h.lower().split()[:2]) for h in re.findall(r"^# - ([\w -]+)", note, re.MULTILINE)]
    assert "pipeline parallel" in modelled, modelled
    guide = " ".join((DOCS / "guides" / "planning.md").read_text().split())
    left_out = re.search(r"Left out: ([^.]*)\.", guide)
    assert left_out, "docs/guides/planning.md no longer says what the time model leaves out"
    items = [re.sub(r"^the ", "", i.strip()) for i in left_out.group(1).split(",")]
    wrong = [i for i in items if any(i.lower().startswith(m) for m in modelled)]
    assert not wrong, f"docs/guides/planning.md says the time model leaves out {wrong}; its Note holds them"
