"""The import graph of gpudist follows the layer order of docs/architecture.md, has no cycle, and no module imports a
private name from another package; no module under tests/ imports a test module (shared helpers live in
tests/helpers*.py). No gpudist module imports the repository's own packages (benchmarks/, tests/, examples/), which an
installed gpudist does not have.

Read from the source (every ``import`` statement, at any depth: a function-level import that reaches upward is as much
a layering break as a module-level one), so the test needs nothing importable and fails before anything runs.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS = [
    ["gpudist.kernels"],
    ["gpudist.comm", "gpudist.topology"],
    ["gpudist.config", "gpudist.fileio", "gpudist.memory", "gpudist.flat", "gpudist.compression"],
    ["gpudist.checkpoint"],
    ["gpudist.strategies"],
    ["gpudist.elastic", "gpudist.live", "gpudist.launch", "gpudist.capture"],
    ["gpudist.testing", "gpudist.bench"],
    [
        "gpudist.cli",
        "gpudist.testing.elastic_job",
        "gpudist.testing.live_job",
        "gpudist.testing.multihost_job",
        "gpudist.plan",
        "gpudist",
    ],
]
"""Lowest first; a module may import from its own layer or below. ``gpudist`` itself (the package's __init__, the
public facade) is on top, with the command line and the elastic demo job, which use it as any training script does."""


def _modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name (kernels/ is installed as gpudist.kernels)."""
    found = {}
    for base, prefix in ((ROOT / "gpudist", "gpudist"), (ROOT / "kernels", "gpudist.kernels")):
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = path
    return found


MODULES = _modules()


def _package(name: str) -> str:
    """The package a module belongs to (a package's __init__ belongs to itself)."""
    return name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]


def _imports(name: str) -> list[tuple[str, str, int]]:
    """(imported gpudist module, imported name or '', line) for every import statement in module ``name``."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, "", node.lineno) for alias in node.names if alias.name.startswith("gpudist")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package(name).split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not source.startswith("gpudist"):
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                out.append((sub, "", node.lineno) if sub in MODULES else (source, alias.name, node.lineno))
    return out


REPOSITORY_ONLY = ("benchmarks", "examples", "tests")
"""Top-level packages of the checkout that pip does not install: a gpudist module importing one works in the checkout
and fails once installed."""
IMPORT_CALLS = ("import_module", "__import__")
"""Calls that import the module named by their first argument (``importlib.import_module("benchmarks.workloads")``)."""


def _repository_imports(name: str) -> list[tuple[str, int]]:
    """(the import, as written, line) for every import of a REPOSITORY_ONLY package in module ``name``: import
    statements at any depth, and the calls of IMPORT_CALLS with the module's name spelled out."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    found = []  # (imported module, the import as written, line)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, f"import {alias.name}", node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = ", ".join(alias.name for alias in node.names)
            found.append((node.module or "", f"from {node.module} import {names}", node.lineno))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in IMPORT_CALLS and isinstance(node.args[0].value, str):
                found.append((node.args[0].value, f"{called}({node.args[0].value!r})", node.lineno))
    return [(text, line) for module, text, line in found if module.partition(".")[0] in REPOSITORY_ONLY]


def _layer(name: str) -> int:
    """The layer of the most specific prefix of ``name`` listed in LAYERS."""
    best, layer = -1, None
    for index, members in enumerate(LAYERS):
        for member in members:
            if (name == member or name.startswith(member + ".")) and len(member) > best:
                best, layer = len(member), index
    assert layer is not None, f"{name} is in no layer: add it to LAYERS (and to docs/architecture.md)"
    return layer


def test_every_module_has_a_layer():
    """Catches a new module that nobody placed in the layer order (and so that nothing here would check)."""
    for name in MODULES:
        _layer(name)


def test_imports_only_reach_down():
    """Catches an upward import, such as a strategy importing the elastic driver, or the checkpoint format importing a
    strategy class (which is how the old checkpoint.py reached into ZeRO's private optimizer)."""
    upward = [
        f"{MODULES[name].relative_to(ROOT)}:{line} imports {target} ({LAYERS[_layer(target)][0]} layer) from the "
        f"{LAYERS[_layer(name)][0]} layer"
        for name in MODULES
        for target, _, line in _imports(name)
        if target in MODULES and _layer(target) > _layer(name)
    ]
    assert not upward, "imports that reach up the layer order:\n" + "\n".join(upward)


def test_import_graph_is_acyclic():
    """Catches two modules importing each other (as optim/elastic.py and checkpoint.py once did), directly or
    through others: a package's __init__ importing its own submodules is not a cycle unless one imports it back."""
    graph = {name: sorted({t for t, _, _ in _imports(name) if t in MODULES and t != name}) for name in MODULES}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_no_private_name_crosses_a_package():
    """Catches a module importing another package's private helper (``from ..comm.base import _stable_hash``), the
    reach-in that makes a refactor of one package break another silently."""
    crossings = []
    for name in MODULES:
        for target, imported, line in _imports(name):
            private = imported.startswith("_") or any(
                part.startswith("_") and part != "__init__" for part in target.split(".")
            )
            home = _package(target) if target in MODULES else target
            if private and home != _package(name) and not home.startswith(_package(name) + "."):
                crossings.append(f"{MODULES[name].relative_to(ROOT)}:{line} imports {imported or target} from {home}")
    assert not crossings, "private names imported across packages:\n" + "\n".join(crossings)


def test_no_module_imports_the_repository():
    """Catches gpudist importing the repository's benchmarks/ (or tests/, examples/), which ``pip install gpudist``
    does not install: ``gpudist bench gpu`` imported benchmarks.workloads, .peers, .gate and .host_overhead inside its
    parts, after putting the checkout on sys.path, so an installed copy could not run them. What the package needs
    lives in it (gpudist/bench/workloads.py, peers.py, host_calls.py, gate.py); benchmarks/ imports from there."""
    found = [
        f"{MODULES[name].relative_to(ROOT)}:{line}: {text}"
        for name in MODULES
        for text, line in _repository_imports(name)
    ]
    assert not found, (
        "gpudist modules importing the repository's own packages (not installed with gpudist; move what they need "
        "into the package):\n" + "\n".join(found)
    )


def _test_modules_imported(path: Path) -> list[tuple[str, int]]:
    """(imported test module, line) for every import in ``path`` (a file under tests/) that names a ``test_*``
    module: ``from .test_x import``, ``from . import test_x``, ``from tests.test_x import``, ``import tests.test_x``."""
    package = list(path.parent.relative_to(ROOT).parts)

    def is_test_module(dotted: str) -> bool:
        parts = dotted.split(".")
        return parts[0] == "tests" and any(part.startswith("test_") for part in parts[1:])

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names if is_test_module(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            if is_test_module(source):
                found.append((source, node.lineno))
            elif (ROOT / source.replace(".", "/")).is_dir():  # ``from . import test_x``: a module of a package
                found += [
                    (f"{source}.{a.name}", node.lineno) for a in node.names if is_test_module(f"{source}.{a.name}")
                ]
    return found


def test_test_modules_do_not_import_one_another():
    """Catches a module under tests/ importing a test module (``from .test_pipeline import lm``, as the interleaved
    and zero-bubble pipeline tests and the live elastic tests once did) instead of sharing through tests/helpers*.py:
    running one test file then runs another's module-level code (its imports, the models it builds at import), a
    helper private to one file becomes another's dependency that a rename there breaks, and an imported ``test_*``
    function is collected and run twice."""
    crossings = [
        f"{path.relative_to(ROOT)}:{line} imports {target}; move what it shares into tests/helpers*.py"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for target, line in _test_modules_imported(path)
    ]
    assert not crossings, "test modules imported by other modules under tests/:\n" + "\n".join(crossings)


def _documented_layers() -> list[set[str]]:
    """The modules column of docs/architecture.md's layer table, lowest first, as dotted names: ``kernels/`` is
    ``gpudist.kernels``, a bare name (``flat.py``, ``compression/``) is in ``gpudist/``, ``gpudist/__init__.py`` is
    the package itself, and a dotted name is taken as it is."""
    rows = [line for line in (ROOT / "docs" / "architecture.md").read_text().splitlines() if re.match(r"\| \d ", line)]
    layers = []
    for row in rows:
        names = set()
        for path in re.findall(r"`([^`]+)`", row.split("|")[2]):
            if "/" not in path and not path.endswith(".py"):  # a dotted name already ("installed as gpudist.kernels")
                names.add(path)
                continue
            path = path.removeprefix("gpudist/").removesuffix("/").removesuffix(".py")
            names.add("gpudist" if path == "__init__" else f"gpudist.{path.replace('/', '.')}")
        layers.append(names)
    return layers


def test_the_architecture_doc_lists_the_layers_this_test_enforces():
    """docs/architecture.md's layer table, row by row, names the same modules as ``LAYERS``. Catches the doc and the
    enforced order drifting apart: a module moved to another layer, a new package (the live mode's, the planner's)
    enforced here but missing from the table, or a row of the table that no longer exists in the code."""
    documented = _documented_layers()
    assert len(documented) == len(LAYERS), f"the doc has {len(documented)} layers, LAYERS {len(LAYERS)}"
    for k, (doc, enforced) in enumerate(zip(documented, LAYERS, strict=True), start=1):
        assert doc == set(enforced), f"layer {k}: the doc lists {sorted(doc)}, the test enforces {sorted(enforced)}"
    missing = [name for layer in documented for name in layer if name not in MODULES]
    assert not missing, f"the doc names modules that do not exist: {missing}"
