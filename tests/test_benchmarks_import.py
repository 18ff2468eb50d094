"""Every benchmark script imports (its helpers and peers resolve), so ``python -m benchmarks.<name>`` starts.

Catches a benchmark left behind by a refactor (benchmarks/pipeline.py and benchmarks/compression.py imported a
``make_model`` that benchmarks/ddp.py no longer had; no test ran them, so it went unnoticed)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

NAMES = sorted(
    p.stem for p in (Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py") if p.stem != "__init__"
)


@pytest.mark.parametrize("name", NAMES)
def test_benchmark_imports(name):
    importlib.import_module(f"benchmarks.{name}")
