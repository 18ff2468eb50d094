"""The benchmark regression gate: each case's speed *ratio* to its PyTorch peer, measured in the same run, against a
stored baseline per device kind.

    python -m benchmarks.gate RESULTS.json [--write] [--baselines benchmarks/baselines] [--tolerance 0.3]

``RESULTS.json`` is pytest-benchmark's ``--benchmark-json`` output of ``pytest benchmarks/ --benchmark-only``; the
same check runs inside that pytest session with ``--gate`` (``--gate-write`` stores a baseline) through
``benchmarks/conftest.py``. Exit status 0: every gated case is within tolerance; 1: a case regressed, a baseline is
missing for a device kind in the run, or a case was measured at another size than its baseline.

Why ratios: an absolute time moves with the machine's load (the CPU runners here share two cores with other jobs;
a GPU runner shares its host, its clocks and its PCIe switch), but gpudist and its peer run round-robin in the same
rounds on the same buffers, so load slows both alike and ``peer time / gpudist time`` stays put. Each case's ratio is
the median over rounds of that round's ratio.

Why the tolerances (:data:`DEFAULT_TOLERANCE`): a case fails when its ratio falls below ``baseline x (1 -
tolerance)``. On the shared 2-core CPU machine, re-running the kernel tier unchanged moved single ratios by up to
about 20% (collectives on loopback Gloo, whose small messages are scheduling-bound, by more), so the CPU tolerance is
0.30: a kernel made 1.5x slower fails, run-to-run noise does not. A GPU runner has a device to itself and times with
CUDA events; 0.15 there (a 1.2x slowdown fails) until a GPU's own repeat runs say otherwise (then set ``tolerance`` in
its baseline file, which overrides the default). A case noisier than that in its own baseline run is given its own
spread instead (the interquartile range of its per-round ratios over their median, at most 0.9): Gloo collectives of
64 KiB on the loaded CPU machine spread 0.3-0.6 within a run and moved 1.5-1.7x between two unchanged runs, so they
can only catch a large regression; the kernels spread 0.05-0.2 and keep 0.30.

:func:`device_kind` and :func:`records_from_json` are ``gpudist.bench.gate``'s (re-exported here): the installed
``gpudist bench gpu`` needs them without the repository.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gpudist.bench import environment
from gpudist.bench.gate import device_kind, records_from_json
from gpudist.fileio import atomic_write_json

__all__ = [
    "BASELINES",
    "DEFAULT_TOLERANCE",
    "GateReport",
    "check",
    "device_kind",
    "main",
    "ratio_summary",
    "records_from_json",
    "write_baselines",
]

BASELINES = Path(__file__).resolve().parent / "baselines"
"""One JSON file per device kind: ``cpu.json``, ``cuda-nvidia-h100-80gb-hbm3.json``, ..."""
DEFAULT_TOLERANCE = {"cpu": 0.30, "cuda": 0.15}
"""Allowed relative drop of a ratio below its baseline, by device type (the module docstring says why)."""


def ratio_summary(ours: list[float], peer: list[float]) -> dict:
    """From per-round seconds of gpudist and its peer (the same rounds, round-robin): ``ratio`` = the median of each
    round's peer / gpudist (> 1: gpudist faster), its quartiles, and both medians."""
    if len(ours) != len(peer) or not ours:
        raise ValueError(f"need as many rounds of gpudist as of its peer (and some), got {len(ours)} and {len(peer)}")
    per_round = [p / o for o, p in zip(ours, peer, strict=True)]
    q1, _, q3 = statistics.quantiles(per_round, n=4, method="inclusive") if len(per_round) > 1 else per_round * 3
    return {
        "ratio": statistics.median(per_round),
        "ratio_q1": q1,
        "ratio_q3": q3,
        "gpudist_s": statistics.median(ours),
        "peer_s": statistics.median(peer),
        "rounds": len(per_round),
    }


@dataclass
class GateReport:
    """What the gate found: ``failures`` (each fails the gate), ``notes`` (new cases, improvements, what was not
    compared) and ``passed`` (cases within tolerance), each a line naming the case."""

    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    passed: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def format(self) -> str:
        lines = [f"gpudist benchmark gate: {'PASSED' if self.ok else 'FAILED'} ({len(self.passed)} within tolerance, "]
        lines[0] += f"{len(self.failures)} failed, {len(self.notes)} notes)"
        lines += [f"  FAIL {line}" for line in self.failures]
        lines += [f"  note {line}" for line in self.notes]
        return "\n".join(lines)


def _baseline_path(directory: Path, kind: str) -> Path:
    return Path(directory) / f"{kind}.json"


def _tolerance(kind: str, stored: dict | None, override: float | None) -> float:
    if override is not None:
        return override
    if stored is not None and "tolerance" in stored:
        return float(stored["tolerance"])
    return DEFAULT_TOLERANCE["cpu" if kind == "cpu" else "cuda"]


def _spread(base: dict) -> float:
    """A baseline entry's own noise: the interquartile range of its per-round ratios relative to their median."""
    if "ratio_q1" not in base or "ratio_q3" not in base:
        return 0.0
    return min(0.9, (base["ratio_q3"] - base["ratio_q1"]) / base["ratio"])


def check(records: list[dict], directory: Path | str = BASELINES, tolerance: float | None = None) -> GateReport:
    """Gate ``records`` (each: ``key``, ``device_kind``, ``ratio``, ``size``; as :func:`records_from_json` makes them)
    against the baselines in ``directory``. A case's tolerance is its baseline file's, widened to the case's own
    spread (the interquartile range of its per-round ratios over their median) where that is larger;
    ``tolerance`` replaces both."""
    report = GateReport()
    by_kind: dict[str, list[dict]] = {}
    for r in records:
        by_kind.setdefault(r["device_kind"], []).append(r)
    for kind, rows in sorted(by_kind.items()):
        path = _baseline_path(Path(directory), kind)
        if not path.exists():
            report.failures.append(
                f"no baseline for device kind '{kind}' ({len(rows)} cases measured): {path} does not exist. On this "
                f"machine, run the tier once with --gate-write (or `python -m benchmarks.gate RESULTS.json --write`) "
                f"and commit {path.name}"
            )
            continue
        stored = json.loads(path.read_text())
        tol = _tolerance(kind, stored, tolerance)
        entries = stored.get("entries", {})
        for r in rows:
            base = entries.get(r["key"])
            if base is None:
                report.notes.append(
                    f"{r['key']}: not gated, no baseline entry in {path.name} (a new case); --gate-write adds it"
                )
                continue
            if base.get("size") != r.get("size"):
                report.failures.append(
                    f"{r['key']}: measured at size {r.get('size')}, its baseline at {base.get('size')}: ratios at "
                    f"different sizes do not compare; run at the baseline's size or rewrite it with --gate-write"
                )
                continue
            case_tol = tol if tolerance is not None else max(tol, _spread(base))
            floor = base["ratio"] * (1 - case_tol)
            line = (
                f"{r['key']}: ratio {r['ratio']:.3f} (peer time / gpudist time), baseline {base['ratio']:.3f}, "
                f"floor {floor:.3f} (tolerance {case_tol:.0%})"
            )
            if r["ratio"] < floor:
                report.failures.append(line + f": gpudist is {base['ratio'] / r['ratio']:.2f}x slower against its peer")
            else:
                report.passed.append(line)
                if r["ratio"] > base["ratio"] * (1 + case_tol):
                    report.notes.append(line + ": faster than its baseline beyond tolerance; --gate-write locks it in")
    return report


def write_baselines(
    records: list[dict], directory: Path | str = BASELINES, env: dict | None = None, tolerance: float | None = None
) -> list[Path]:
    """Store ``records``' ratios as the baselines of their device kinds (entries of cases not in ``records`` are kept;
    a file's tolerance is kept unless ``tolerance`` is given). Returns the files written."""
    env = env if env is not None else environment()
    written = []
    by_kind: dict[str, list[dict]] = {}
    for r in records:
        by_kind.setdefault(r["device_kind"], []).append(r)
    for kind, rows in sorted(by_kind.items()):
        path = _baseline_path(Path(directory), kind)
        doc = json.loads(path.read_text()) if path.exists() else {}
        doc["device_kind"] = kind
        doc["tolerance"] = _tolerance(kind, doc or None, tolerance)
        doc["tolerance_why"] = (
            "a ratio below baseline x (1 - tolerance) fails; see benchmarks/gate.py for how the value was chosen"
        )
        doc["environment"] = env
        entries = doc.setdefault("entries", {})
        for r in rows:
            entries[r["key"]] = {
                k: r[k] for k in ("ratio", "ratio_q1", "ratio_q3", "size", "peer", "gpudist_s", "peer_s") if k in r
            }
        doc["entries"] = dict(sorted(entries.items()))
        written.append(atomic_write_json(path, doc))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="pytest-benchmark --benchmark-json output")
    parser.add_argument("--baselines", default=str(BASELINES), help="folder of <device kind>.json baselines")
    parser.add_argument("--tolerance", type=float, default=None, help="override every baseline's own tolerance")
    parser.add_argument("--write", action="store_true", help="store these ratios as the baselines instead of gating")
    args = parser.parse_args(argv)
    doc = json.loads(Path(args.results).read_text())
    records = records_from_json(doc)
    if not records:
        print(f"{args.results}: no gpudist benchmark ratios in it (was it written by pytest benchmarks/?)")
        return 1
    if args.write:
        env = doc.get("machine_info", {}).get("gpudist_environment")
        for path in write_baselines(records, args.baselines, env, args.tolerance):
            print(f"wrote {path}")
        return 0
    report = check(records, args.baselines, args.tolerance)
    print(report.format())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
