"""The GPU test tier as parts of ``gpudist bench gpu``: pytest subprocesses, bounded, their JUnit counts read back."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import xml.etree.ElementTree as ET
from collections import Counter, deque
from pathlib import Path

from .common import GPUSettings, _repo

# -- part: the GPU test tier ------------------------------------------------------------------------------------------


def junit_counts(path: str | os.PathLike) -> dict:
    """Pass/fail/error/skip counts, the failing test ids and the commonest skip reasons from a pytest JUnit XML."""
    counts: Counter = Counter()
    failed, skips = [], Counter()
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        kind = {"failure": "failed", "error": "errors", "skipped": "skipped"}.get(getattr(outcome, "tag", ""), "passed")
        counts[kind] += 1
        if kind in ("failed", "errors"):
            failed.append(name)
        elif kind == "skipped":
            skips[(outcome.get("message") or "").strip()[:200]] += 1
    return {
        "total": sum(counts.values()),
        **{k: counts[k] for k in ("passed", "failed", "errors", "skipped")},
        "failed_tests": failed,
        "skip_reasons": dict(skips.most_common(10)),
    }


def _run_streaming(
    cmd: list[str], cwd: Path, timeout: float, tail_lines: int = 200, grace: float = 15.0
) -> tuple[int | None, str]:
    """Run ``cmd``, echoing its output as it comes (a runner's log shows progress); (return code, or None when it was
    stopped at ``timeout``: SIGINT first, so pytest still writes its report, SIGKILL ``grace`` seconds later; the
    last ``tail_lines`` lines)."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stopped = threading.Event()

    def stop() -> None:
        stopped.set()
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()

    killer = threading.Timer(timeout, stop)
    killer.start()
    tail: deque[str] = deque(maxlen=tail_lines)
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            tail.append(line)
        proc.wait()
    finally:
        killer.cancel()
    return (None if stopped.is_set() else proc.returncode), "".join(tail)


MIN_PART_SECONDS = 20.0
"""A part with less time than this left in the budget is skipped: it could not start CUDA and finish anything."""
PART_RESERVE = 10.0
"""Seconds between a part's own time limit (pytest stopped, ranks timed out) and the kill of its process: the part
still reports what it has."""


def pytest_part(settings: GPUSettings, name: str) -> dict:
    """One part of the GPU test tier: pytest in the repository with ``-m gpu`` and the part's arguments, each test
    under pytest-timeout; its counts from the JUnit report (written even when the part is stopped: SIGINT first)."""
    import tempfile

    repo = _repo(settings)
    limit = settings.timeouts[name]
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", *settings.tests[name], "-q", "-p", "no:cacheprovider"]
        if importlib.util.find_spec("pytest_timeout") is not None:
            cmd.append(f"--timeout={settings.test_timeout:g}")
        code, tail = _run_streaming([*cmd, f"--junitxml={report}"], repo, max(1.0, limit - 5), grace=5)
        counts = junit_counts(report) if report.is_file() else None
    if counts is None:
        raise RuntimeError(
            f"pytest {'was stopped at the part limit' if code is None else f'exited with {code}'} and wrote no "
            f"report:\n{tail}"
        )
    # pytest exits 5 when nothing was collected: a runner where the marker selects nothing has tested nothing.
    return {
        "command": " ".join(cmd),
        "returncode": code,
        "timed_out": code is None,
        **counts,
        "output_tail": tail[-6000:],
    }
