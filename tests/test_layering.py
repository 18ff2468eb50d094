"""The import graph of gpudist follows the layer order of docs/architecture.md, has no cycle, and no module imports a
private name from another package.

Read from the source (every ``import`` statement, at any depth: a function-level import that reaches upward is as much
a layering break as a module-level one), so the test needs nothing importable and fails before anything runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS = [
    ["gpudist.kernels"],
    ["gpudist.comm", "gpudist.topology"],
    ["gpudist.config", "gpudist.fileio", "gpudist.memory", "gpudist.flat", "gpudist.compression"],
    ["gpudist.checkpoint"],
    ["gpudist.strategies"],
    ["gpudist.elastic", "gpudist.live", "gpudist.launch"],
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
