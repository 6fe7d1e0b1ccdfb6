"""The package's shape, read from its syntax trees: layers as folders, imports only downward, small pieces.

No process groups here: these checks read the source files only.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

pytestmark = pytest.mark.fast  # the quick tier: scripts/test.sh --fast

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "src" / "seqpar"

# Lower numbers are lower layers; a module may import its own layer or any layer below, never one above. A key is
# a dotted path below seqpar; a module takes the layer of its longest matching key (a package face is its __init__).
LAYERS = {
    "errors": 0,
    "lazy": 0,
    "mesh": 1,
    "models": 1,
    "sequence_parallel.kernels": 2,
    "sequence_parallel.comm": 3,
    "layouts.chunks": 4,
    "sequence_parallel.masks": 5,
    "sequence_parallel.plans": 5,
    "sequence_parallel.strategies": 5,
    "sequence_parallel.selection": 5,
    "sequence_parallel.checks": 6,
    "sequence_parallel.api": 7,
    "layouts": 7,
    "data": 8,
    "loss": 8,
    "gradients": 8,
    "data_parallel": 9,
    "tensor_parallel": 9,
    "integrations": 9,
    "sequence_parallel": 9,
    "hf": 9,
    "memory": 9,
    "parallel": 9,
    "pipeline_parallel": 10,
    "planning": 10,
    "diagnosis": 10,
    "runtime": 10,
    "train": 11,
    "bench": 11,
    "cli": 11,
}
MAX_ROOT_MODULES = 8
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 500


def _modules() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(module: str, path: pathlib.Path) -> list[tuple[str, list[str], int]]:
    """(imported seqpar module, imported names, line) for every import in the file, nested ones included."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    result = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            result += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "seqpar"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target.split(".")[0] == "seqpar":
                result.append((target, [a.name for a in node.names], node.lineno))
    return result


def _layer(module: str) -> int | None:
    parts = module.split(".")[1:]
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return LAYERS[".".join(parts[:n])]
    return None


def test_package_root_holds_few_modules_and_every_module_has_a_layer():
    root = sorted(p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules in src/seqpar/: {root}"
    unplaced = [m for m in _modules() if m != "seqpar" and _layer(m) is None]
    assert not unplaced, f"modules outside the known layers (add them to LAYERS): {unplaced}"


def _package_of(module: str, path: pathlib.Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _owner(target: str) -> str:
    """The package whose privates ``target`` names: the part of the dotted path before its first private part."""
    parts = target.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and part != "__init__":
            return ".".join(parts[:i])
    return target.rpartition(".")[0]


def test_no_module_reaches_into_another_packages_private_names():
    """A private module (``_name.py``) or name (``_name``) serves its own package; other packages use its face."""
    modules = _modules()
    offenders = []
    for module, path in modules.items():
        package = _package_of(module, path)
        for target, names, line in _imports(module, path):
            private = [n for n in names if n.startswith("_") and n != "__version__"]
            has_private_module = any(p.startswith("_") and p != "__init__" for p in target.split("."))
            if target == module or not (private or has_private_module):
                continue
            owner = _owner(target) if has_private_module else _package_of(target, modules.get(target, pathlib.Path()))
            if not (package == owner or package.startswith(owner + ".")):
                offenders.append(f"{path.relative_to(PACKAGE)}:{line} imports {private or target} from {target}")
    assert not offenders, "\n".join(offenders)


def test_imports_go_downward_and_have_no_cycles():
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    upward = []
    for module, path in modules.items():
        if module == "seqpar":
            continue  # the package face imports from every layer
        for target, names, line in _imports(module, path):
            # "from seqpar.x import y" may name a submodule y: resolve to the most specific module
            candidates = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules] or [target]
            for imported in candidates:
                if imported == "seqpar":  # the package face sits above every library layer
                    if _layer(module) < LAYERS["runtime"]:
                        upward.append(f"{module}:{line} imports the package face 'seqpar'")
                    continue
                graph[module].add(imported)
                if _layer(imported) is not None and _layer(imported) > _layer(module):
                    upward.append(f"{module}:{line} (layer {_layer(module)}) imports {imported} ({_layer(imported)})")
    assert not upward, "\n".join(upward)
    # a cycle between modules (packages count as their __init__ only)
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph or nxt == node:
                continue
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join([*trail[trail.index(nxt) :], nxt]))
            if nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])


def test_functions_and_files_stay_small():
    too_long = []
    for path in _modules().values():
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(PACKAGE)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = node.body
            if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]  # the docstring does not count
            if body and body[-1].end_lineno - body[0].lineno + 1 > MAX_FUNCTION_LINES:
                lines = body[-1].end_lineno - body[0].lineno + 1
                too_long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {lines} lines")
    assert not too_long, "\n".join(too_long)


@pytest.mark.parametrize("face", ["seqpar", "seqpar.hf"])
def test_every_public_name_resolves(face):
    module = importlib.import_module(face)
    missing = [name for name in module.__all__ if getattr(module, name, None) is None]
    assert not missing, f"{face}.__all__ names that do not resolve: {missing}"
    assert len(set(module.__all__)) == len(module.__all__), f"{face}.__all__ repeats a name"
