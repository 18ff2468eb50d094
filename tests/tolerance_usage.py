"""Diagnostic pytest plugin: how much of its tolerance each comparison in the suite uses.

``GPUDIST_TOLERANCE_REPORT=path.jsonl python -m pytest -p tests.tolerance_usage`` wraps
``torch.testing.assert_close`` and ``pytest.approx`` and appends one line per comparison site (test, file:line,
largest ``|actual - expected| / (atol + rtol * |expected|)`` seen there, 1.0 meaning "at the limit"). Running the
suite under different thread counts and cores (``OMP_NUM_THREADS=1``, ``taskset -c 0``) and sorting by usage shows
which tolerances are host-dependent. Not loaded by default; nothing in the suite depends on it.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict

import pytest
import torch

_DEFAULTS = {  # torch.testing.assert_close's defaults
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
}
_usage: dict[tuple[str, str], float] = defaultdict(float)
_current = ["?"]


def _site() -> str:
    frame = sys._getframe(2)
    while frame is not None and "tests" not in frame.f_code.co_filename.split(os.sep)[-2:-1]:
        frame = frame.f_back
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}" if frame else "?"


def _ratio(actual, expected, rtol, atol) -> float:
    try:
        a = torch.as_tensor(actual).detach().double().cpu()
        e = torch.as_tensor(expected).detach().double().cpu()
        if a.numel() == 0:
            return 0.0
        diff = (a - e).abs()
        finite = torch.isfinite(e)
        diff = torch.where(finite, diff, torch.zeros_like(diff))
        limit = atol + rtol * e.abs()
        if float(limit.max()) == 0.0:
            return 0.0 if float(diff.max()) == 0.0 else float("inf")
        return float((diff / limit.clamp_min(1e-300)).max())
    except Exception:
        return -1.0


def _record(site: str, value: float) -> None:
    key = (_current[0], site)
    _usage[key] = max(_usage[key], value)


def pytest_configure(config):
    if not os.environ.get("GPUDIST_TOLERANCE_REPORT"):
        return
    real_close, real_approx = torch.testing.assert_close, pytest.approx

    def assert_close(actual, expected, *args, rtol=None, atol=None, **kwargs):
        site = _site()
        try:
            dtype = torch.as_tensor(expected).dtype
        except Exception:
            dtype = torch.float32
        r, a = (rtol, atol) if rtol is not None else _DEFAULTS.get(dtype, (0.0, 0.0))
        if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor):
            _record(site, _ratio(actual, expected, r, a))
        return real_close(actual, expected, *args, rtol=rtol, atol=atol, **kwargs)

    def approx(expected, rel=None, abs=None, **kwargs):
        site = _site()
        real = real_approx(expected, rel=rel, abs=abs, **kwargs)

        class Recorded:
            def __eq__(self, actual):
                r = 1e-6 if rel is None else rel
                a = 1e-12 if abs is None else abs
                try:
                    _record(site, _ratio(actual, expected, r, a))
                except Exception:
                    pass
                return real == actual

            __hash__ = None

            def __repr__(self):
                return repr(real)

        return Recorded()

    torch.testing.assert_close = assert_close
    pytest.approx = approx


def pytest_runtest_setup(item):
    _current[0] = item.nodeid


def pytest_unconfigure(config):
    path = os.environ.get("GPUDIST_TOLERANCE_REPORT")
    if not path:
        return
    with open(path, "a") as f:
        for (test, site), value in sorted(_usage.items(), key=lambda kv: -kv[1]):
            f.write(json.dumps({"test": test, "site": site, "usage": value}) + "\n")
