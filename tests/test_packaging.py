"""What a fresh machine installs is what the code imports: `bash dev.sh test` installs the dependencies and the test,
examples and hf extras of pyproject.toml, and nothing else may be needed at import time. Before, the benchmark gate's
test needed pytest-benchmark, which only the bench extra had, and CI passed because the package happened to be on
its machine (a fresh clone in a fresh virtual environment failed, 2026-11-28)."""

from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"gpudist", "kernels", "tests", "benchmarks", "examples", "lm", "train"}
DEV_SH_EXTRAS = ("test", "examples", "hf")  # dev.sh's default GPUDIST_EXTRAS


def _requirements() -> dict[str, list[str]]:
    """pyproject.toml's dependencies (key "") and extras, as lists of distribution names."""
    text = (REPO / "pyproject.toml").read_text()
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        pytest.skip("tomllib needs Python >= 3.11")
    project = tomllib.loads(text)["project"]
    groups = {"": project["dependencies"], **project["optional-dependencies"]}
    return {k: [re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].lower() for req in v] for k, v in groups.items()}


def _unguarded_imports(path: Path) -> set[str]:
    """Top-level module names imported at a module's top level (not inside a function, ``try`` or ``if``): the ones
    that fail at import time when missing."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_every_module_level_import_is_installed_by_dev_sh():
    """Catches a test, benchmark, example or library module importing, at its top level, a package that neither the
    dependencies nor dev.sh's extras install: a fresh clone's `bash dev.sh test` would fail to collect it. A package
    only some tests need must be imported inside them behind a skip naming its extra (``pytest.importorskip``)."""
    groups = _requirements()
    allowed = {d for key in ("", *DEV_SH_EXTRAS) for d in groups[key]}
    providers = metadata.packages_distributions()
    missing = {}
    for folder in ("gpudist", "kernels", "tests", "benchmarks", "examples"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for name in _unguarded_imports(path) - FIRST_PARTY - set(sys.stdlib_module_names):
                dists = {d.lower() for d in providers.get(name, [])}
                if not dists & allowed:
                    missing.setdefault(name, []).append(str(path.relative_to(REPO)))
    assert not missing, f"imported at module level but not installed by `bash dev.sh test`: {missing}"


def test_dev_sh_installs_the_extras_this_test_checks():
    """Catches dev.sh and this test drifting apart (the extras list is written in both)."""
    assert f"GPUDIST_EXTRAS:-{','.join(DEV_SH_EXTRAS)}" in (REPO / "dev.sh").read_text()
    assert "pytest-benchmark" in _requirements()["test"]
