"""The benchmark regression gate (benchmarks/gate.py, benchmarks/conftest.py): it passes on an unchanged run and fails
when a kernel is made slower; its edge cases say what to do. Sizes are tiny: these check the gate, not speed."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

import gpudist.kernels as K
from benchmarks import gate
from gpudist.bench.kernels import copy_bandwidth, measure_kernel

REPO = Path(__file__).resolve().parents[1]


def _slowed(monkeypatch) -> None:
    """sgd_step 2 ms slower per call (it takes tens of microseconds at these sizes): the regression a change could
    bring, large enough that the load of a shared machine cannot hide it or fake it. (Not squared_norm: its CPU path,
    MKL's threaded dot, swings 100x on a loaded machine.)"""
    fast = K.sgd_step

    def slow(x, *args, **kwargs):
        time.sleep(0.002)
        return fast(x, *args, **kwargs)

    monkeypatch.setattr(K, "sgd_step", slow)


@pytest.fixture
def one_thread():
    """As the tier runs on CPU (benchmarks/conftest.py says why: two threads on a loaded machine time at random)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _sgd_record(n: int = 1 << 14) -> dict:
    row = measure_kernel("sgd_momentum", n, torch.device("cpu"), 5, copy_bandwidth(n, torch.device("cpu"), 3), 0.01)
    summary = gate.ratio_summary(row["rounds_s"]["gpudist"], row["rounds_s"]["torch"])
    return {"key": "test_kernel[cpu-sgd_momentum]", "device_kind": "cpu", "size": f"{n} elements", **summary}


def test_gate_passes_unchanged_and_fails_a_kernel_made_slower(tmp_path, monkeypatch, one_thread):
    """The issue's acceptance test, on real measurements: catches a gate that compares the wrong direction, reads
    another case's baseline, or cannot see an SGD step made 2 ms slower per call (its ratio to torch's fused SGD,
    measured in the same rounds, drops tens of times); the unchanged case is gated against its own stored ratio."""
    before = _sgd_record()
    gate.write_baselines([before], tmp_path, env={"note": "test"})
    assert gate.check([before], tmp_path).ok
    _slowed(monkeypatch)
    after = _sgd_record()
    report = gate.check([after], tmp_path)
    assert not report.ok and "test_kernel[cpu-sgd_momentum]" in report.failures[0], report.format()
    assert "slower against its peer" in report.failures[0]


def test_pytest_tier_gate_fails_the_session_on_a_slower_kernel(tmp_path, monkeypatch, capsys):
    """End to end through the pytest-benchmark tier: catches ``--gate-write``/``--gate`` not wired to the session's
    exit status, ratios not reaching pytest's stash, and pytest-benchmark no longer taking the replayed per-round
    times (its private timer attribute). The tier runs in this process so that the slowed kernel is the one timed."""
    pytest.importorskip("pytest_benchmark", reason="pytest-benchmark is not installed (the test extra has it)")
    args = [
        str(REPO / "benchmarks" / "test_kernels.py"),
        "-k",
        "cpu-sgd_momentum",
        "--benchmark-only",
        "--bench-elements=16K",
        "--bench-round-ms=10",
        "--bench-rounds=5",
        f"--gate-baselines={tmp_path}",
        f"--rootdir={REPO}",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:timeout",  # the outer session's alarm stays the only one
        "-q",
    ]
    threads = torch.get_num_threads()
    assert pytest.main([*args, "--gate-write"]) == 0
    stored = json.loads((tmp_path / "cpu.json").read_text())
    assert list(stored["entries"]) == ["benchmarks/test_kernels.py::test_kernel[cpu-sgd_momentum]"]
    _slowed(monkeypatch)
    capsys.readouterr()
    assert pytest.main([*args, "--gate"]) == pytest.ExitCode.TESTS_FAILED
    out = capsys.readouterr().out
    assert "gpudist benchmark gate: FAILED" in out and "cpu-sgd_momentum" in out
    assert torch.get_num_threads() == threads, "the tier's session must give back torch's thread count"


def _record(key: str, ratio: float, kind: str = "cpu", size: str = "1024 elements") -> dict:
    return {"key": key, "device_kind": kind, "size": size, "ratio": ratio}


def test_gate_edge_cases_say_what_to_do(tmp_path):
    """Catches a new device kind passing silently (no baseline must fail and name --gate-write), a new case failing
    the gate (it is a note), a noisy case's tolerance not widened to its own spread (or widened without bound), a
    size change compared as if it were a regression or a pass, and a ratio at the floor failing."""
    gate.write_baselines([_record("a", 2.0), _record("b", 1.0)], tmp_path, env={}, tolerance=0.25)
    report = gate.check([_record("a", 1.5), _record("new", 0.1)], tmp_path)
    assert report.ok, report.format()
    assert any("new: not gated" in n and "--gate-write" in n for n in report.notes)

    report = gate.check([_record("a", 1.49)], tmp_path)
    assert not report.ok and "1.34x slower" in report.failures[0]

    noisy = {**_record("noisy", 1.0), "ratio_q1": 0.7, "ratio_q3": 1.3}  # its own rounds spread 60%
    gate.write_baselines([noisy], tmp_path, env={})
    assert gate.check([_record("noisy", 0.45)], tmp_path).ok
    assert not gate.check([_record("noisy", 0.35)], tmp_path).ok

    report = gate.check([_record("b", 1.0, size="2048 elements")], tmp_path)
    assert not report.ok and "ratios at different sizes do not compare" in report.failures[0]

    report = gate.check([_record("a", 2.0, kind="cuda-nvidia-h100")], tmp_path)
    assert not report.ok
    assert "no baseline for device kind 'cuda-nvidia-h100'" in report.failures[0]
    assert "--gate-write" in report.failures[0]


def test_gate_cli_reads_pytest_benchmark_json(tmp_path, capsys):
    """Catches ``python -m benchmarks.gate`` reading the wrong fields of pytest-benchmark's --benchmark-json (cases
    keyed by something other than their node id) or exiting 0 on a regression."""

    def results(r: float) -> str:
        path = tmp_path / f"run{r}.json"
        bench = {"fullname": "benchmarks/test_kernels.py::test_kernel[cpu-adam]", "extra_info": _record("x", r)}
        other = {"fullname": "other", "extra_info": {}}
        path.write_text(json.dumps({"machine_info": {}, "benchmarks": [bench, other]}))
        return str(path)

    base = ["--baselines", str(tmp_path / "baselines")]
    assert gate.main([results(1.0), *base, "--write"]) == 0
    stored = json.loads((tmp_path / "baselines" / "cpu.json").read_text())
    assert list(stored["entries"]) == ["benchmarks/test_kernels.py::test_kernel[cpu-adam]"]
    assert stored["tolerance"] == gate.DEFAULT_TOLERANCE["cpu"]
    assert gate.main([results(0.95), *base]) == 0
    assert gate.main([results(0.5), *base]) == 1
    assert "FAIL benchmarks/test_kernels.py::test_kernel[cpu-adam]" in capsys.readouterr().out


def test_ratio_summary_pairs_rounds():
    """Catches the ratio inverted (gpudist / peer) or taken across rounds instead of within each: a round where both
    slowed down alike must not move the ratio."""
    s = gate.ratio_summary([1.0, 10.0, 1.0], [2.0, 20.0, 2.0])
    assert s["ratio"] == 2.0 and s["gpudist_s"] == 1.0 and s["peer_s"] == 2.0
    with pytest.raises(ValueError, match="as many rounds"):
        gate.ratio_summary([1.0], [1.0, 2.0])
