"""Running the parts of ``gpudist bench gpu``: the benchmark gate, the part table, each part in a process of its own
under its time limit, the plan, the machine and versions, and the run that writes the JSON."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ...fileio import atomic_write_json
from .. import workloads as W
from ..collectives import (
    environment,
)
from .common import (
    EXIT_NO_GPU,
    EXIT_OK,
    EXIT_PART_FAILED,
    NO_CUDA,
    TEST_PARTS,
    GPUSettings,
    _cupy_nccl,
    _error_text,
    _repo,
)
from .graphs import capture_part, capture_torch_part
from .measure import collectives_part, host_part, kernels_part
from .pytest_part import MIN_PART_SECONDS, PART_RESERVE, _run_streaming, pytest_part
from .report import _part_table, _safely, format_summary
from .steps import profile_part, strategies_part

# -- part: the benchmark gate ----------------------------------------------------------------------------------------


def gate_part(settings: GPUSettings) -> dict:
    """The pytest-benchmark tier's CUDA cases (``benchmarks/``, each gpudist kernel against its torch peer), gated
    against this device kind's stored baseline when there is one (a regression fails the part), else measured only
    (``--gate-write`` into a scratch folder: the ratios are reported, nothing in the repository changes)."""
    import json
    import tempfile

    from ..gate import device_kind, records_from_json

    repo = _repo(settings)  # pytest runs benchmarks/ there, gated against the baselines stored beside it
    kind = device_kind(torch.device("cuda"))
    gated = (repo / "benchmarks" / "baselines" / f"{kind}.json").is_file()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        cmd = [sys.executable, "-m", "pytest", "benchmarks/", "--benchmark-only", "-k", "cuda", "-q"]
        cmd += ["-p", "no:cacheprovider", f"--benchmark-json={out}"]
        cmd += ["--gate"] if gated else ["--gate-write", f"--gate-baselines={tmp}"]
        code, tail = _run_streaming(cmd, repo, max(1.0, settings.timeouts["gate"] - 5), grace=5)
        records = records_from_json(json.loads(out.read_text())) if out.is_file() else []
    if code is None or not records:
        raise RuntimeError(
            f"the benchmark tier {'was stopped at the part limit' if code is None else 'measured nothing'}:\n{tail}"
        )
    return {
        "command": " ".join(cmd),
        "device_kind": kind,
        "gated": gated,
        "returncode": code,
        "passed": code == 0,
        "ratios": {r["key"]: round(r["ratio"], 3) for r in records},
        "output_tail": tail[-3000:],
    }


PARTS: dict[str, Callable[[GPUSettings], dict]] = {
    **{name: functools.partial(pytest_part, name=name) for name in TEST_PARTS},
    "kernels": kernels_part,
    "collectives": collectives_part,
    "host": host_part,
    "strategies": strategies_part,
    "capture": capture_part,
    "profile": profile_part,
    "gate": gate_part,
    "capture-torch": capture_torch_part,
}
PART_GROUPS = {"tests": tuple(TEST_PARTS)}
"""Names that stand for several parts in ``--parts``."""


# -- running the parts ------------------------------------------------------------------------------------------------


def _part_child(fn: Callable, settings: GPUSettings, conn) -> None:
    try:
        reply = ("ok", fn(settings))
    except BaseException as e:
        reply = ("error", _error_text(e))
    try:
        conn.send(reply)
    except Exception as e:  # a result that does not pickle is the part's error, not a silent death
        conn.send(("error", f"the part's result could not be sent back: {_error_text(e)}"))
    conn.close()


def _isolated(fn: Callable, settings: GPUSettings, timeout: float, name: str) -> tuple[str, object]:
    """``fn(settings)`` in a spawned process: ("ok", result) or ("error", traceback / how the process ended)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_part_child, args=(fn, settings, child), name=f"gpudist-bench-{name}")
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout):
            return "error", f"timed out after {timeout:.0f}s (process killed)"
        try:
            return parent.recv()
        except EOFError:
            proc.join(10)
            code = proc.exitcode
            how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            return "error", f"the part's process died ({how}) before reporting: a crash in native code or os._exit"
    finally:
        if proc.is_alive():
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
        parent.close()


def run_parts(
    settings: GPUSettings,
    parts: dict[str, Callable[[GPUSettings], dict]] | None = None,
    isolate: bool = True,
    on_result: Callable[[dict[str, dict]], None] | None = None,
) -> dict[str, dict]:
    """Run ``settings.parts`` one after the other; each result is ``{"status": "ok", "seconds", **numbers}`` or
    ``{"status": "error", "seconds", "error"}``. A failing part never stops the ones after it. ``on_result`` gets
    the results so far after each part (``run_gpu`` rewrites the JSON, so a killed run keeps what it measured)."""
    parts = PARTS if parts is None else parts
    results = {}
    deadline = time.monotonic() + settings.budget
    for name in settings.parts:
        left = deadline - time.monotonic()
        limit = min(settings.timeouts.get(name, 600.0), left)
        start = time.perf_counter()
        if limit < MIN_PART_SECONDS:
            status, value = (
                "skipped",
                f"out of the time budget (--budget {settings.budget:g}s; {max(left, 0):.0f}s left)",
            )
        else:
            print(f"# --- {name} (at most {limit:.0f}s) ---", flush=True)
            # The part's own work stops PART_RESERVE seconds before its process is killed, so it can still report.
            inner = dataclasses.replace(
                settings, timeouts={**settings.timeouts, name: limit - PART_RESERVE}, part_started=time.monotonic()
            )
            if isolate:
                status, value = _isolated(parts[name], inner, limit, name)
            else:
                try:
                    status, value = "ok", parts[name](inner)
                except Exception as e:
                    status, value = "error", _error_text(e)
        seconds = round(time.perf_counter() - start, 1)
        key = {"ok": None, "error": "error", "skipped": "reason"}[status]
        results[name] = {"status": status, "seconds": seconds, **(value if key is None else {key: value})}
        print(_safely(_part_table, name, results[name]), flush=True)
        if on_result is not None:
            on_result(results)
    return results


# -- plan, machine, versions ------------------------------------------------------------------------------------------


def check_plan(settings: GPUSettings) -> dict[str, dict]:
    """Per part: whether it would run here and what it needs that is missing (imports, the repository, CUDA).
    Imports only; nothing touches a GPU."""
    import importlib

    def need(problems: list[str], what: str, check: Callable[[], object]) -> None:
        try:
            check()
        except Exception as e:
            problems.append(f"{what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")

    def repo_file(rel: str) -> Callable[[], None]:
        def check() -> None:
            if settings.repo is None or not (Path(settings.repo) / rel).is_file():
                raise FileNotFoundError(f"{rel} not found; run from the repository root or pass --repo")

        return check

    def kernel_ops() -> None:
        from ..kernels import OPS

        unknown = [o for o in settings.kernel_ops or () if o not in OPS]
        if unknown:
            raise ValueError(f"unknown kernel op(s) {unknown}; available: {', '.join(OPS)}")

    def workloads() -> None:
        unknown = [w for w in settings.workloads if w not in W.WORKLOADS]
        if unknown:
            raise ValueError(f"unknown workload(s) {unknown}; available: {', '.join(W.WORKLOADS)}")

    def torch_nccl() -> None:
        import torch.distributed as dist

        if not dist.is_nccl_available():
            raise RuntimeError(f"torch {torch.__version__} is built without NCCL")

    def pytest_checks(name: str) -> list[tuple[str, Callable[[], object]]]:
        files = [a for a in settings.tests.get(name, ()) if a.endswith(".py")]
        return [
            ("pytest", lambda: importlib.import_module("pytest")),
            ("pytest-timeout", lambda: importlib.import_module("pytest_timeout")),
            *((f, repo_file(f)) for f in files),
        ]

    checks: dict[str, list[tuple[str, Callable[[], object]]]] = {
        **{name: pytest_checks(name) for name in TEST_PARTS},
        "gate": [
            ("pytest-benchmark", lambda: importlib.import_module("pytest_benchmark")),
            ("benchmarks/test_kernels.py", repo_file("benchmarks/test_kernels.py")),
        ],
        "kernels": [
            ("gpudist.kernels", lambda: importlib.import_module("gpudist.kernels")),
            ("triton", lambda: importlib.import_module("triton")),
            ("kernel ops", kernel_ops),
        ],
        "collectives": [("cupy.cuda.nccl", _cupy_nccl)],
        "host": [("cupy.cuda.nccl", _cupy_nccl)],
        "strategies": [
            ("cupy.cuda.nccl", _cupy_nccl),
            ("torch NCCL", torch_nccl),
            ("fully_shard", lambda: importlib.import_module("torch.distributed.fsdp").fully_shard),
            (
                "DeviceMesh.from_group",
                lambda: importlib.import_module("torch.distributed.device_mesh").DeviceMesh.from_group,
            ),
            ("workloads", workloads),
        ],
    }
    checks["capture"] = [
        ("cupy.cuda.nccl", _cupy_nccl),
        ("torch NCCL", torch_nccl),
        ("CUDAGraph", lambda: torch.cuda.CUDAGraph),
        ("workloads", workloads),
    ]
    checks["capture-torch"] = checks["capture"]
    checks["profile"] = [*checks["strategies"], ("torch.profiler", lambda: importlib.import_module("torch.profiler"))]
    cuda = torch.cuda.is_available()
    plan = {}
    for name in settings.parts:
        problems: list[str] = []
        for what, check in checks[name]:
            need(problems, what, check)
        plan[name] = {"would_run": cuda, "problems": problems}
        if not cuda:
            plan[name]["reason"] = NO_CUDA
    return plan


def _nvidia_smi() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else None


def versions() -> dict:
    """torch, CUDA, triton, cupy, NCCL (CuPy's libnccl, which gpudist drives, and torch's own), the driver."""
    from ...comm.nccl import nccl_version

    env = environment()
    cupy_nccl = nccl_version()
    torch_nccl = None
    with contextlib.suppress(Exception):
        v = torch.cuda.nccl.version()
        torch_nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return {
        "gpudist": env["gpudist"],
        "torch": env["torch"],
        "cuda": env["cuda"],
        "triton": env["triton"],
        "cupy": env["cupy"],
        "nccl_cupy": ".".join(map(str, cupy_nccl)) if cupy_nccl else None,
        "nccl_torch": torch_nccl if torch.cuda.is_available() else None,
        "driver": _nvidia_smi() if torch.cuda.is_available() else None,
        "python": env["python"],
    }


def machine() -> dict:
    env = environment()
    info = {"platform": env["platform"], "cpu": env["cpu"], "cpu_count": env["cpu_count"], "gpus": []}
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        p = torch.cuda.get_device_properties(i)
        info["gpus"].append(
            {
                "name": p.name,
                "capability": f"{p.major}.{p.minor}",
                "memory_GiB": round(p.total_memory / 2**30, 1),
                "multiprocessors": p.multi_processor_count,
            }
        )
    return info


def default_out(repo: str | None, device_name: str | None) -> Path:
    """``<repo>/benchmarks/results/gpu_<device>.json`` (the working directory without a repository); ``no_cuda``
    stands for the device when there is none."""
    slug = re.sub(r"[^a-z0-9]+", "_", (device_name or "no cuda").lower()).strip("_")
    folder = Path(repo) / "benchmarks" / "results" if repo else Path.cwd()
    return folder / f"gpu_{slug}.json"


# -- the command --------------------------------------------------------------------------------------------------


def run_gpu(
    settings: GPUSettings, out: str | os.PathLike | None = None, require_gpu: bool = False
) -> tuple[dict, Path, int]:
    """Run every part (or record the skip), print the tables, write the JSON; (document, its path, exit code)."""
    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if cuda else None
    path = Path(out) if out is not None else default_out(settings.repo, name)
    if path.is_dir() or not path.suffix:  # a folder: the default file name inside it
        path = path / default_out(None, name).name
    doc = {
        "benchmark": "gpu",
        "date": environment()["date"],
        "machine": machine(),
        "versions": versions(),
        "settings": dataclasses.asdict(settings),
        "command": " ".join(sys.argv),
    }
    if not cuda:
        doc.update(status="skipped", reason=NO_CUDA, plan=check_plan(settings))
        doc["parts"] = {p: {"status": "skipped", "reason": NO_CUDA} for p in settings.parts}
        code = EXIT_NO_GPU if require_gpu else EXIT_OK
        print(f"# skipped: {NO_CUDA} (exit {code}{'' if require_gpu else f'; {EXIT_NO_GPU} with --require-gpu'})")
    else:
        doc["status"] = "running"
        doc["parts"] = run_parts(settings, on_result=lambda so_far: atomic_write_json(path, {**doc, "parts": so_far}))
        failed = [p for p, r in doc["parts"].items() if r["status"] != "ok"]
        for name, r in doc["parts"].items():
            if name in TEST_PARTS and r["status"] == "ok" and (r["failed"] or r["errors"] or r["returncode"] != 0):
                failed.append(f"{name} (failures)")
        if doc["parts"].get("gate", {}).get("passed") is False:
            failed.append("gate (a ratio fell below its baseline)")
        doc.update(status="failed" if failed else "ok", failed_parts=failed)
        code = EXIT_PART_FAILED if failed else EXIT_OK
    written = atomic_write_json(path, doc)
    print(_safely(format_summary, doc))
    print(f"# wrote {written}")
    return doc, path, code
