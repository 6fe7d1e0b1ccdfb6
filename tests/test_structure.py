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
    "sequence_parallel.layouts.chunks": 4,
    "sequence_parallel.masks": 5,
    "sequence_parallel.tiling": 5,
    "sequence_parallel.strategies": 5,
    "sequence_parallel.selection": 5,
    "sequence_parallel.checks": 6,
    "sequence_parallel.api": 7,
    "sequence_parallel.layouts": 7,
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


def test_top_level_packages_import_each_other_without_a_cycle():
    """The module layers can be acyclic while two packages import each other (a low module of one under a high
    module of the other); the top-level packages and root modules of seqpar must form a DAG as well."""
    modules = _modules()
    edges: dict[str, dict[str, str]] = {}  # package -> imported package -> one import that makes the edge
    for module, path in modules.items():
        if module == "seqpar":
            continue  # the package face imports from every package
        package = module.split(".")[1]
        for target, names, line in _imports(module, path):
            candidates = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules] or [target]
            for imported in candidates:
                other = imported.split(".")[1] if imported.count(".") else None
                if other is not None and other != package:
                    edges.setdefault(package, {}).setdefault(other, f"{module}:{line} imports {imported}")
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, {})):
            if state.get(nxt) == 1:
                cycle = [*trail[trail.index(nxt) :], nxt]
                pytest.fail("package import cycle:\n" + "\n".join(edges[a][b] for a, b in zip(cycle, cycle[1:])))
            if nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for package in sorted(edges):
        if package not in state:
            visit(package, [package])


# The modules that hold a registry: only they may compare a value with the names they register.
NAME_REGISTRIES = {"seqpar.sequence_parallel.strategies.registry", "seqpar.sequence_parallel.layouts.chunks"}


def _registered_names() -> set[str]:
    from seqpar.sequence_parallel.layouts.chunks import NAMED_LAYOUTS
    from seqpar.sequence_parallel.strategies.registry import STRATEGIES, STRATEGY_ROWS

    return {*STRATEGY_ROWS, *STRATEGIES, *NAMED_LAYOUTS}


def _names_compared(node: ast.AST, names: set[str]) -> tuple[list[str], list[ast.expr]]:
    """(registered names, the other operands) of a comparison or ``match``; ([], []) for any other node."""
    if isinstance(node, ast.Compare):
        operands, cases = [node.left, *node.comparators], []
    elif isinstance(node, ast.Match):
        operands, cases = [node.subject], [c.pattern for c in node.cases]
    else:
        return [], []
    found, others = [], []
    for operand in operands:
        constants = operand.elts if isinstance(operand, (ast.Tuple, ast.Set, ast.List)) else [operand]
        strings = [c.value for c in constants if isinstance(c, ast.Constant) and isinstance(c.value, str)]
        if strings:
            found += strings
        else:
            others.append(operand)
    found += [p.value.value for c in cases for p in ast.walk(c) if isinstance(p, ast.MatchValue)]
    return sorted(set(found) & names), others


def test_no_module_branches_on_a_strategy_or_layout_name_outside_its_registry():
    """Behaviour that differs by strategy or layout lives on the registry's rows; a consumer asks its row.

    A comparison (``==``, ``in``, a ``match``) of a strategy or layout, an operand whose expression names one
    (``strategy``, ``config.layout``, ``row.strategy`` ...), with a registered name, outside the registry modules, is
    a branch on the name. Other vocabularies that share a word ("auto" kernels, "ring" mesh axes) are not matched.
    """
    names = _registered_names()
    offenders = []
    for module, path in _modules().items():
        if module in NAME_REGISTRIES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            found, others = _names_compared(node, names)
            if found and any(w in ast.unparse(o).lower() for o in others for w in ("strategy", "layout")):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno} compares with {found}")
    assert not offenders, "ask the strategy or layout row instead:\n" + "\n".join(offenders)


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


def _string_constants(node: ast.AST) -> list[str]:
    """The strings a comparison side or a dict key spells out: a constant, or those of a tuple, list or set."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [s for element in node.elts for s in _string_constants(element)]
    return []


def test_registered_names_are_never_compared_rows_answer_instead():
    """Note [model families], Note [mixer rows]: no module compares a value with a registered model type (a family's,
    a vision tower's) or mixer kind, or keys a dict by one: the family entry, the tower row or the mixer row answers
    for it. In models/ and memory/ no literal names a mixer kind, or a config's word for its layers, outside the
    registries (the mixer rows and the family entries)."""
    from seqpar.memory.vision import TOWERS
    from seqpar.models import FAMILIES, MIXER_KINDS
    from seqpar.models.mixers import mixer_layer_types

    registered = set(FAMILIES) | set(TOWERS) | set(MIXER_KINDS)
    mixer_words = set(MIXER_KINDS) | set(mixer_layer_types())
    registries = ("seqpar.models.families", "seqpar.models.mixers")
    scoped = ("seqpar.models", "seqpar.memory")
    found = []
    for module, path in _modules().items():
        tree = ast.parse(path.read_text())
        where = path.relative_to(PACKAGE)
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                spelled = [s for side in (node.left, *node.comparators) for s in _string_constants(side)]
            elif isinstance(node, ast.Dict):
                spelled = [s for key in node.keys if key is not None for s in _string_constants(key)]
            else:
                continue
            found += [f"{where}:{node.lineno} compares or keys by {s!r}" for s in spelled if s in registered]
        if module.startswith(scoped) and not module.startswith(registries):
            found += [
                f"{where}:{node.lineno} names the mixer word {node.value!r}"
                for node in ast.walk(tree)
                if isinstance(node, ast.Constant) and node.value in mixer_words
            ]
    assert not found, "\n".join(sorted(found))
