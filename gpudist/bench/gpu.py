"""One command for a GPU runner: ``gpudist bench gpu`` (or ``python -m benchmarks.gpu``, run from the repository root)
runs the GPU test tier and measures every GPU number in one go, into one JSON file with the machine, the versions and
the date beside the numbers. It is made for a short slot (a GPU lent for about 15 minutes, its start included):
correctness first and cheapest first, every part and every test bounded, the whole run within ``--budget`` seconds
(default 450: under 8 minutes), the JSON rewritten after every part and one summary table at the end.

Parts, in this order, each in its own process (a pytest subprocess, or a spawned one), so that a crash, a sticky
CUDA error or a hang in one is recorded as that part's error and the parts after it still run:

- ``tests-kernels``: the Triton kernels' ``cuda`` test cases (tests/test_kernels.py, test_kernels_compression.py).
- ``tests-nccl``: every NCCL op at world size 1 and the compressed collectives on CUDA (tests/test_gpu.py).
- ``tests-host-sync``: the no-host-sync test of every data-parallel strategy on the real GPU.
- ``tests-strategies``: the rest of the GPU tier: every strategy on CUDA (in-memory ranks at world 2 and 4, NCCL
  at world 1, several NCCL ranks where NCCL allows them on one GPU).
- ``kernels``: each gpudist kernel (pack, unpack, Adam, SGD, squared norm, int8/1-bit quantize, int8 dequantize,
  top-k) at each size, timed with CUDA events after warm-up (median of rounds); its GB/s (bytes it must read plus
  write) as a fraction of ``dst.copy_(src)`` measured in the same process at the same size.
- ``collectives``: all-reduce, all-gather, reduce-scatter and broadcast through gpudist's NCCL backend (with its
  cross-rank check, and ``unchecked()``) against raw ``cupy.cuda.nccl`` calls on the same communicator and buffers;
  algbw and busbw as nccl-tests defines them. World size: every visible GPU, one spawned rank each.
- ``strategies``: step times of gpudist DDP and FSDP against torch DDP (``gradient_as_bucket_view=True``,
  ``static_graph=True``, fused AdamW) and FSDP2 (``fully_shard`` per unit and the root, fused AdamW) on the models of
  ``gpudist.bench.workloads``, gpudist over its NCCL backend and torch over its own NCCL process group, every GPU
  one rank.
- ``gate``: the pytest-benchmark tier's CUDA cases against ``benchmarks/baselines/<device kind>.json``
  (benchmarks/gate.py); a device kind without a baseline is measured and reported, not gated.

The test parts and ``gate`` run pytest in the repository (``--repo``, or found from the working directory); every
other part runs from the installed package alone.

``--parts tests`` stands for the four test parts. Each test runs under pytest-timeout (``--test-timeout``, where
pytest-timeout is installed), so a hanging test costs its own timeout; a part past its time limit gets SIGINT
(pytest still writes its report) and then SIGKILL. ``--quick`` measures fewer sizes and rounds.

Exit codes (what a CI runner acts on; the JSON is written in every case but a usage error):

- 0: every part ran and the GPU tests passed; also when there is no CUDA device at all, so that a CPU job which
  runs the command stays green (the JSON and the output say ``skipped`` and why).
- 1: a part failed, ran out of the budget, or the GPU test tier had failures; the other parts' numbers are in the
  JSON all the same.
- 2: usage error (bad option).
- 3: no CUDA device and ``--require-gpu`` was given: a GPU runner that lost its GPU must not pass as a skip.

``--check`` runs nothing: it prints which parts would run and what each lacks (imports, the repository), exiting 0
when nothing is missing, 1 otherwise (CUDA itself aside).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import multiprocessing as mp
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..fileio import atomic_write_json
from . import peers
from . import workloads as W
from .collectives import (
    BUS_FACTORS,
    collective_buffers,
    collective_variants,
    environment,
    interleaved_times,
    on_nccl,
    parse_size,
)

__all__ = [
    "BUS_FACTORS",
    "EXIT_NO_GPU",
    "EXIT_PART_FAILED",
    "NO_CUDA",
    "PARTS",
    "TEST_PARTS",
    "GPUSettings",
    "bandwidth_GBps",
    "bus_bandwidth",
    "check_plan",
    "collective_rows",
    "fraction_of_copy",
    "junit_counts",
    "main",
    "run_gpu",
    "run_parts",
    "strategy_rows",
]

NO_CUDA = "no CUDA device: torch.cuda.is_available() is False"
EXIT_OK, EXIT_PART_FAILED, EXIT_USAGE, EXIT_NO_GPU = 0, 1, 2, 3
# BUS_FACTORS (from .collectives): busbw = algbw x factor(n), as nccl-tests: all-reduce 2(n-1)/n, all-gather and
# reduce-scatter (n-1)/n, broadcast 1. At n = 1 the ring factors are 0: one rank moves nothing between GPUs, and its
# time is launch overhead.

GOOD_FRACTION = 0.8
"""A memory-bound kernel should reach this fraction of the copy bandwidth (one read and one write of each byte)."""
COMPUTE_BOUND = ("topk_exact_1pct", "topk_threshold_1pct")
"""Top-k selects (a sort or a threshold search) as well as streams: its fraction of copy is reported, not judged."""


def bandwidth_GBps(nbytes: float, seconds: float) -> float:
    """GB/s (10^9 bytes per second) of moving ``nbytes`` in ``seconds``."""
    return nbytes / seconds / 1e9


def fraction_of_copy(op_GBps: float, copy_GBps: float) -> float:
    """A kernel's GB/s over the device-to-device copy's, both counting bytes read plus written (1.0: as fast as a
    copy, the most a memory-bound kernel can do)."""
    return op_GBps / copy_GBps


def bus_bandwidth(op: str, nbytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s of one ``op`` of ``nbytes`` (nccl-tests' size: the all-reduce and broadcast buffer,
    the all-gather output, the reduce-scatter input) taking ``seconds`` on ``world_size`` ranks."""
    algbw = bandwidth_GBps(nbytes, seconds)
    return algbw, algbw * BUS_FACTORS[op](world_size)


# -- settings --------------------------------------------------------------------------------------------------------


@dataclass
class GPUSettings:
    """What ``gpudist bench gpu`` runs; every part gets it (it crosses into the part's process, so it pickles)."""

    parts: tuple[str, ...] = (
        "tests-kernels",
        "tests-nccl",
        "tests-host-sync",
        "tests-strategies",
        "kernels",
        "collectives",
        "host",
        "strategies",
        "profile",
        "gate",
    )
    """The parts to run, in order: correctness first, cheapest first."""
    tests: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(TEST_PARTS))
    """pytest's arguments (files, ``-k``) for each test part, run with ``-m gpu`` from the repository root."""
    test_timeout: float = 60.0
    """Seconds one test may take (pytest-timeout): a hang costs this, not the part."""
    budget: float = 450.0
    """Seconds for the whole run: each part's limit is cut to what is left, and a part with less than
    ``MIN_PART_SECONDS`` left is skipped (a short GPU slot must not end before the JSON is written)."""
    kernel_elements: tuple[int, ...] = (1 << 22, 1 << 24, 1 << 26)
    """Elements per kernel op: 4M (16 MiB of fp32, inside the H100's 50 MiB L2: where launch and host time show),
    16M and 64M (past it)."""
    kernel_ops: tuple[str, ...] | None = None
    """A subset of ``gpudist.bench.kernels.OPS``; None: all of them."""
    collective_bytes: tuple[int, ...] = (1 << 16, 1 << 20, 1 << 24, 1 << 28)
    """Collective sizes in bytes (fp32): 64 KiB is latency-bound, 256 MiB saturates NVLink."""
    workloads: tuple[str, ...] = ("mlp", "gpt", "gpt-d1024")
    """Models from ``gpudist.bench.workloads`` for the strategy step times."""
    batch: dict[str, int] = field(default_factory=lambda: {"mlp": 256, "gpt": 8, "gpt-deep": 8, "gpt-d1024": 8})
    """Samples per rank per step on the GPU (GPT: sequences of 128 tokens, gpt-d1024 of 512); the CPU benchmarks'
    batches (32, 2) leave an H100 idle between launches."""
    autocast: dict[str, str] = field(default_factory=lambda: {"gpt-d1024": "bfloat16"})
    """Workloads trained under ``torch.autocast`` to that dtype (the 185M GPT as such models are trained: there the
    kernels finish sooner and the host's share of a step shows, 2026-11-28's H200 run)."""
    model_overrides: dict = field(default_factory=dict)
    """Keyword arguments for ``workloads.make``/``batch`` (the CPU tests shrink the model)."""
    rounds: int = 7
    """Interleaved rounds per measurement; the median is reported."""
    steps: int = 5
    """Training steps per variant per round."""
    world_size: int | None = None
    """Ranks for collectives and strategies; None: ``torch.cuda.device_count()``."""
    timeouts: dict[str, float] = field(
        default_factory=lambda: {
            "tests-kernels": 180.0,
            "tests-nccl": 90.0,
            "tests-host-sync": 90.0,
            "tests-strategies": 180.0,
            "kernels": 150.0,
            "collectives": 90.0,
            "host": 60.0,
            "strategies": 240.0,
            "profile": 120.0,
            "gate": 120.0,
        }
    )
    """Seconds each part may take before its process is stopped and the part recorded as timed out (measured on an
    H200, 2026-11-28: the whole GPU tier 41 s, kernels 25 s, collectives 13 s, strategies 20 s, the benchmark tier
    16 s; each limit leaves room for Triton's first compiles). The strategies part has had the 185M GPT under bf16
    autocast since (six variants of 185M parameters, each with its Adam state: about 25 GB; its time on a GPU is not
    measured yet, hence the wider limit)."""
    repo: str | None = None
    """The repository root (holding ``tests/`` and ``benchmarks/``), where the test parts and the gate run pytest;
    None: found from the working directory."""


def find_repo(start: Path | None = None) -> Path | None:
    """The gpudist checkout: the working directory or the one this editable install lives in, whichever holds
    ``tests/test_gpu.py`` and ``benchmarks/workloads.py``."""
    for root in (start or Path.cwd(), Path(__file__).resolve().parents[2]):
        if (root / "tests" / "test_gpu.py").is_file() and (root / "benchmarks" / "workloads.py").is_file():
            return root.resolve()
    return None


def _repo(settings: GPUSettings) -> Path:
    """The checkout a part runs pytest in (the test parts, the gate); nothing of it is imported here."""
    if settings.repo is None:
        raise RuntimeError(
            "this part needs the gpudist repository (tests/, benchmarks/); run from its root or pass --repo"
        )
    return Path(settings.repo)


def _world(settings: GPUSettings) -> int:
    return settings.world_size or torch.cuda.device_count()


def _cupy_nccl() -> None:
    """Raise, naming the extra to install, when CuPy's NCCL (what gpudist's NCCL backend drives) is missing."""
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        raise RuntimeError(
            f"{e}; install the extra matching your CUDA: pip install 'gpudist[cuda13]' (or [cuda12])"
        ) from e
    if not getattr(nccl, "available", True):
        raise RuntimeError("CuPy is installed but libnccl was not found: pip install 'gpudist[cuda13]' (or [cuda12])")


def _error_text(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__))[-4000:]


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


TEST_PARTS: dict[str, tuple[str, ...]] = {
    "tests-kernels": ("tests/test_kernels.py", "tests/test_kernels_compression.py"),
    "tests-nccl": ("tests/test_gpu.py", "-k", "nccl_world_one_every_op or compressed_collectives"),
    "tests-host-sync": ("tests/test_gpu.py", "-k", "no_host_sync"),
    "tests-strategies": (
        "tests/test_gpu.py",
        "-k",
        "not (nccl_world_one_every_op or compressed_collectives or no_host_sync)",
    ),
}
"""pytest's arguments for each part of the GPU test tier (each run with ``-m gpu``); together the whole tier."""

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


# -- part: kernel bandwidth ---------------------------------------------------------------------------------------


def kernels_part(settings: GPUSettings, device: str = "cuda") -> dict:
    """Every kernel op at every size against the copy bandwidth of that size; an op that fails is a row with its
    error (a sticky CUDA error then fails the ops after it too, each recorded)."""
    from .. import kernels as K
    from .kernels import OPS, copy_bandwidth, time_variants

    dev = torch.device(device)
    implementation = "triton" if K.use_triton(torch.empty(0, device=dev)) else "torch"
    ops = list(settings.kernel_ops or OPS)
    rows, copies = [], {}
    for n in settings.kernel_elements:
        torch.manual_seed(0)
        try:
            copies[str(n)] = copy = copy_bandwidth(n, dev, settings.rounds)
        except Exception as e:  # e.g. out of memory at this size: the other sizes still run
            copies[str(n)] = None
            rows.append({"op": "copy", "elements": n, "error": _error_text(e)})
            continue
        for op in ops:
            try:
                moved, variants, extra = OPS[op](n, dev)
                times, iters = time_variants(variants, dev, settings.rounds)
            except Exception as e:
                rows.append({"op": op, "elements": n, "error": _error_text(e)})
                continue
            finally:
                variants = None
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            gbps = bandwidth_GBps(moved, times["gpudist"])
            frac = fraction_of_copy(gbps, copy)
            rows.append(
                {
                    "op": op,
                    "elements": n,
                    "bytes_moved": moved,
                    "iters": iters,
                    "gpudist_us": times["gpudist"] * 1e6,
                    "gpudist_GBps": gbps,
                    "copy_GBps": copy,
                    "fraction_of_copy": frac,
                    "torch_us": times["torch"] * 1e6,
                    "speedup_vs_torch": times["torch"] / times["gpudist"],
                    "memory_bound": op not in COMPUTE_BOUND,
                    "good": frac >= GOOD_FRACTION if op not in COMPUTE_BOUND else None,
                    **{k: v for k, v in extra.items() if isinstance(v, (int, float, str))},
                }
            )
    return {
        "implementation": implementation,
        "device": str(dev),
        "copy_GBps": copies,
        "good_fraction": GOOD_FRACTION,
        "rounds": settings.rounds,
        "rows": rows,
    }


# -- part: NCCL collectives -------------------------------------------------------------------------------------------

COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def collective_rows(
    comm, sizes: tuple[int, ...], rounds: int, ops: tuple[str, ...] = COLLECTIVE_OPS, target_s: float = 0.05
) -> list[dict]:
    """On every rank of an NCCL backend: per op and size, seconds per call of each variant (median of interleaved
    rounds, each at its slowest rank), algbw, busbw and raw time / gpudist time (1.0: no overhead)."""
    n = comm.world_size
    rows = []
    for nbytes in sizes:
        count = max(n, nbytes // 4 // n * n)  # fp32 elements, a multiple of the world size
        for op in ops:
            row = {"op": op, "bytes": count * 4, "count": count, "world_size": n, "rounds": rounds}
            try:  # a failure the ranks share (a bad call) leaves the other rows to run; a one-sided one times out
                inp, out = collective_buffers(comm, op, count)
                # raw cupy.cuda.nccl, gpudist without and with its cross-rank check: the same op on the same buffers
                ours = collective_variants(comm, op, inp, out)
                variants = {"raw" if k == "baseline" else k: v for k, v in ours.items()}
                once = interleaved_times(comm, {"gpudist": variants["gpudist"]}, 1, 1)["gpudist"]
                row["iters"] = iters = int(min(200, max(2, target_s / max(once, 1e-6))))
                times = interleaved_times(comm, variants, iters, rounds)
            except Exception as e:
                rows.append({**row, "error": _error_text(e)})
                continue
            for name, seconds in times.items():
                algbw, busbw = bus_bandwidth(op, count * 4, seconds, n)
                row.update({f"{name}_us": seconds * 1e6, f"{name}_algbw_GBps": algbw, f"{name}_busbw_GBps": busbw})
            row["raw_over_gpudist"] = times["raw"] / times["gpudist"]
            row["raw_over_gpudist_nocheck"] = times["raw"] / times["gpudist_nocheck"]
            rows.append(row)
    return rows


def _collectives_body(gloo, nccl, sizes, rounds):
    return collective_rows(nccl, sizes, rounds)


def collectives_part(settings: GPUSettings) -> dict:
    from ..comm.nccl import nccl_version
    from ..launch import spawn

    _cupy_nccl()  # missing: one clear line here rather than the same traceback from every rank
    world = _world(settings)
    timeout = settings.timeouts["collectives"]
    rows = spawn(
        on_nccl,
        world,
        body=_collectives_body,
        sizes=settings.collective_bytes,
        rounds=settings.rounds,
        timeout=timeout,
    )[0]
    version = nccl_version()
    return {
        "world_size": world,
        "nccl": ".".join(map(str, version)) if version else None,
        "baseline": "cupy.cuda.nccl on the same communicator, stream and buffers",
        "note": (
            "world size 1: NCCL moves nothing between GPUs, so busbw is 0 by definition and each time is launch "
            "and bookkeeping overhead; raw_over_gpudist is the meaningful number here"
            if world == 1
            else None
        ),
        "rows": rows,
    }


# -- part: host time per call ----------------------------------------------------------------------------------------

HOST_CALLS = 200
"""Calls per host-time measurement (tiny tensors: the device finishes each before the host issues the next)."""


def _host_body(gloo, nccl, settings: GPUSettings) -> dict[str, dict]:
    from .host_calls import cuda_call_rows

    return cuda_call_rows(nccl, HOST_CALLS, settings.rounds)


def host_part(settings: GPUSettings) -> dict:
    """Host microseconds per call on the GPU (``gpudist.bench.host_calls``, CUDA and NCCL real): pack of
    30 and 300 tensors, the Adam step and one all-reduce, each through gpudist's function, its plan, and as torch
    or raw CuPy do it, interleaved. World size 1: only the host's time is measured."""
    from ..launch import spawn

    _cupy_nccl()
    rows = spawn(on_nccl, 1, body=_host_body, settings=settings, timeout=settings.timeouts["host"])[0]
    return {"world_size": 1, "calls": HOST_CALLS, "rounds": settings.rounds, "us_per_call": rows}


# -- part: strategy step times ---------------------------------------------------------------------------------------


def _strategy_variants(
    comm,
    torch_group,
    device: torch.device,
    workload: str,
    batch: int,
    overrides: dict,
    autocast: torch.dtype | None = None,
) -> tuple[dict[str, Callable[[], None]], dict[str, torch.Tensor], dict[str, str]]:
    """(name -> one training step, name -> its last loss, name -> why it could not be built): gpudist DDP, ZeRO-2 and
    FSDP over ``comm``, torch DDP, DDP + ZeroRedundancyOptimizer and FSDP2 over ``torch_group``, each from the same
    seeded model with fused AdamW, stepping on the same ``batch`` samples (each rank its own, seeded by its rank, as
    benchmarks/peers.py; forward and loss under ``autocast`` to that dtype when given, as such models are trained).
    A variant that fails to build on any rank is left out on every rank."""
    generator = torch.Generator().manual_seed(1234 + comm.rank)
    x, y = (t.to(device) for t in W.batch(workload, batch, generator, **overrides))
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from ..config import ShardingConfiguration
    from ..strategies import DATA_PARALLEL_PAIRS

    def net():
        return W.make(workload, **overrides).to(device)

    def gpudist_pair(strategy: str):
        config = ShardingConfiguration(comm, bucket_cap_mb=25.0)
        model_cls, opt_cls = DATA_PARALLEL_PAIRS[strategy]
        wrap = {"auto_wrap_policy": peers.gpudist_units(workload)} if strategy == "fsdp" else {}
        model = model_cls(net(), config, **wrap)
        return model, opt_cls(peers.adamw(model.parameters(), fused=True), config)

    def ddp_module():
        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(
            net(),
            device_ids=ids,
            process_group=torch_group,
            bucket_cap_mb=25.0,
            gradient_as_bucket_view=True,
            static_graph=True,
        )

    def torch_ddp():
        model = ddp_module()
        return model, peers.adamw(model.parameters(), fused=True)

    def torch_zero():
        model = ddp_module()
        opt = ZeroRedundancyOptimizer(
            model.parameters(),
            optimizer_class=torch.optim.AdamW,
            process_group=torch_group,
            lr=peers.LR,
            fused=True,
            parameters_as_bucket_view=True,
        )
        return model, opt

    def fsdp2():
        model, mesh = net(), DeviceMesh.from_group(torch_group, device.type)
        for unit in peers.fsdp_units(workload, model):
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, peers.adamw(model.parameters(), fused=True)

    builders = {
        "gpudist_ddp": lambda: gpudist_pair("ddp"),
        "torch_ddp": torch_ddp,
        "gpudist_zero2": lambda: gpudist_pair("zero2"),
        "torch_zero": torch_zero,
        "gpudist_fsdp": lambda: gpudist_pair("fsdp"),
        "fsdp2": fsdp2,
    }
    built, errors = {}, {}
    for name, build in builders.items():
        try:
            built[name] = build()
        except Exception as e:
            errors[name] = _error_text(e)
    # Every rank must time the same variants, or their collectives would pair up wrongly.
    ok = torch.tensor([name in built for name in builders], dtype=torch.float32, device=comm.device)
    comm.all_reduce(ok, "min")
    for name, flag in zip(builders, ok.tolist(), strict=True):
        if not flag and name in built:
            del built[name]
            errors[name] = "failed on another rank"

    losses: dict[str, torch.Tensor] = {}

    def forward(model) -> torch.Tensor:
        if autocast is None:
            return W.loss(workload, model, x, y)
        with torch.autocast(device.type, dtype=autocast):
            return W.loss(workload, model, x, y)

    def step_of(name, model, opt):
        def step(phases: dict[str, float] | None = None) -> None:
            """One step; ``phases``: add the host seconds of each phase (nothing waits for the device, so on a
            host-bound step these are where the step's time goes)."""
            t0 = time.perf_counter()
            loss = forward(model)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            opt.zero_grad()
            t4 = time.perf_counter()
            losses[name] = loss.detach()
            if phases is not None:
                for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                    phases[phase] = phases.get(phase, 0.0) + seconds

        return step

    return {name: step_of(name, *pair) for name, pair in built.items()}, losses, errors


PHASES = ("forward", "backward", "step", "zero_grad")
"""The phases of a training step whose host time the profile part reports."""

PEERS = (("gpudist_ddp", "torch_ddp"), ("gpudist_zero2", "torch_zero"), ("gpudist_fsdp", "fsdp2"))


def strategy_rows(
    comm,
    torch_group,
    device: torch.device,
    workload: str,
    batch: int,
    steps: int,
    rounds: int,
    overrides: dict,
    autocast: torch.dtype | None = None,
) -> dict:
    """On every rank: median step time of each variant (interleaved rounds, each at its slowest rank), the loss each
    reached after the same number of steps (the variants train the same function, so these agree to rounding),
    and peer time / gpudist time (> 1: gpudist faster). ``autocast``: forward and loss under that dtype."""
    steps_by_name, losses, errors = _strategy_variants(comm, torch_group, device, workload, batch, overrides, autocast)
    times = interleaved_times(comm, steps_by_name, steps, rounds) if steps_by_name else {}
    final = {name: float(loss) for name, loss in losses.items()}
    spread = (max(final.values()) - min(final.values())) / abs(statistics.mean(final.values())) if final else None
    return {
        "workload": workload,
        "model": W.describe(W.make(workload, **overrides)),
        "batch_per_rank": batch,
        "autocast": None if autocast is None else str(autocast).removeprefix("torch."),
        "world_size": comm.world_size,
        "step_ms": {name: t * 1e3 for name, t in times.items()},
        "final_loss": final,
        "final_loss_relative_spread": spread,
        "peer_over_gpudist": {
            f"{peer}/{ours}": times[peer] / times[ours] for ours, peer in PEERS if {ours, peer} <= set(times)
        },
        "errors": errors,
    }


def _strategies_body(gloo, nccl, settings: GPUSettings) -> list[dict]:
    import torch.distributed as dist

    group = dist.new_group(backend="nccl", device_id=nccl.device)
    rows = []
    for workload in settings.workloads:
        batch = settings.batch.get(workload, 8)
        overrides = settings.model_overrides
        autocast = settings.autocast.get(workload)
        try:
            rows.append(
                strategy_rows(
                    nccl,
                    group,
                    nccl.device,
                    workload,
                    batch,
                    settings.steps,
                    settings.rounds,
                    overrides,
                    None if autocast is None else getattr(torch, autocast),
                )
            )
        except Exception as e:  # the next workload still runs (unless the groups are broken: then it fails too)
            rows.append({"workload": workload, "error": _error_text(e)})
    return rows


def strategies_part(settings: GPUSettings) -> dict:
    from ..launch import spawn

    world = _world(settings)
    timeout = settings.timeouts["strategies"]
    rows = spawn(on_nccl, world, body=_strategies_body, settings=settings, timeout=timeout)[0]
    return {
        "world_size": world,
        "peers": {
            "torch_ddp": "DistributedDataParallel(gradient_as_bucket_view=True, static_graph=True, bucket_cap_mb=25) "
            "over torch's NCCL group, AdamW(fused=True)",
            "fsdp2": "fully_shard per unit (each Linear of the MLP, each GPT block) and the root, AdamW(fused=True)",
            "torch_zero": "the same DDP + ZeroRedundancyOptimizer(AdamW, fused=True, parameters_as_bucket_view=True)",
            "gpudist_ddp": "DDPModel + DDPOptimizer(AdamW(fused=True)), 25 MiB buckets, gpudist's NCCL backend",
            "gpudist_zero2": "ZeRO2Model + ZeRO2Optimizer(AdamW), 25 MiB buckets, gpudist's NCCL backend",
            "gpudist_fsdp": "FSDPModel (same units) + ZeRO3Optimizer, gpudist's NCCL backend",
        },
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "steps_per_round": settings.steps,
        "rounds": settings.rounds,
        "rows": rows,
    }


# -- part: where a step's time goes -----------------------------------------------------------------------------------

PROFILE_WORKLOAD = "gpt-d1024"
ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"
"""The profiled model: the 185M GPT under bf16 autocast, where the host's share of a step shows."""


def _busy_share(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """The share of ``[start, end]`` covered by the union of ``intervals`` (a GPU's kernels: its busy time)."""
    covered, reach = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end)
        if b > a:
            covered += b - a
            reach = b
    return covered / (end - start) if end > start else 0.0


def profile_rows(
    comm,
    torch_group,
    device: torch.device,
    workload: str,
    batch: int,
    steps: int,
    overrides: dict,
    autocast: torch.dtype | None = None,
) -> dict:
    """Per variant of the strategies part: milliseconds per step wall (synchronized) and to issue (the host's loop
    alone, nothing waited for), CPU milliseconds per step inside ``AccumulateGrad`` (where per-parameter hooks run,
    on the thread that launches backward), the GPU's busy share of a profiled step (union of kernel intervals over
    the wall), and the operators with the most self CPU time. One variant after the other, ``steps`` each."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    steps_by_name, _, errors = _strategy_variants(comm, torch_group, device, workload, batch, overrides, autocast)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    rows = {}
    for name, step in steps_by_name.items():
        for _ in range(2):
            step()
        sync()
        phases: dict[str, float] = {}
        start = time.perf_counter()
        for _ in range(steps):
            step(phases)
        issued = time.perf_counter()
        sync()
        done = time.perf_counter()
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            sync()
        events = list(prof.events())
        host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
        kernels = [
            (e.time_range.start, e.time_range.end) for e in events if e.device_type == torch.autograd.DeviceType.CUDA
        ]
        first = min(e.time_range.start for e in host)
        last = max(e.time_range.end for e in host)
        top = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:12]
        accumulate = [e for e in host if e.name == ACCUMULATE_GRAD]  # not the engine's evaluate_function around it
        rows[name] = {
            "wall_ms": (done - start) / steps * 1e3,
            "issue_ms": (issued - start) / steps * 1e3,
            "host_ms": {phase: seconds / steps * 1e3 for phase, seconds in phases.items()},
            "profiled_wall_ms": (last - first) / steps / 1e3,
            "accumulate_grad_cpu_ms": sum(e.cpu_time_total for e in accumulate) / steps / 1e3,
            "accumulate_grad_calls": len(accumulate) / steps,
            "gpu_busy_share": _busy_share(kernels, first, last) if kernels else None,
            "top_self_cpu_ms": {a.key: round(a.self_cpu_time_total / steps / 1e3, 3) for a in top},
        }
    return {
        "workload": workload,
        "batch_per_rank": batch,
        "autocast": None if autocast is None else str(autocast).removeprefix("torch."),
        "steps": steps,
        "variants": rows,
        "errors": errors,
    }


def _profile_body(gloo, nccl, settings: GPUSettings) -> dict:
    import torch.distributed as dist

    group = dist.new_group(backend="nccl", device_id=nccl.device)
    autocast = settings.autocast.get(PROFILE_WORKLOAD)
    return profile_rows(
        nccl,
        group,
        nccl.device,
        PROFILE_WORKLOAD,
        settings.batch.get(PROFILE_WORKLOAD, 8),
        settings.steps,
        settings.model_overrides,
        None if autocast is None else getattr(torch, autocast),
    )


def profile_part(settings: GPUSettings) -> dict:
    """One profiled run of each strategy variant on the 185M GPT under bf16 autocast (world 1 over NCCL): where a
    step's host time goes, and how much of the step the GPU is busy."""
    from ..launch import spawn

    _cupy_nccl()
    return spawn(on_nccl, 1, body=_profile_body, settings=settings, timeout=settings.timeouts["profile"])[0]


# -- part: the benchmark gate ----------------------------------------------------------------------------------------


def gate_part(settings: GPUSettings) -> dict:
    """The pytest-benchmark tier's CUDA cases (``benchmarks/``, each gpudist kernel against its torch peer), gated
    against this device kind's stored baseline when there is one (a regression fails the part), else measured only
    (``--gate-write`` into a scratch folder: the ratios are reported, nothing in the repository changes)."""
    import json
    import tempfile

    from .gate import device_kind, records_from_json

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
    "profile": profile_part,
    "gate": gate_part,
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
            inner = dataclasses.replace(settings, timeouts={**settings.timeouts, name: limit - PART_RESERVE})
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
        from .kernels import OPS

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
    from ..comm.nccl import nccl_version

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


# -- tables -----------------------------------------------------------------------------------------------------------


def _safely(render: Callable[..., str], *args) -> str:
    """``render(*args)``, or why it could not draw its table: printing must never cost the numbers (the JSON has
    them all)."""
    try:
        return render(*args)
    except Exception as e:
        return f"(table not printed: {type(e).__name__}: {e}; the numbers are in the JSON)"


def _part_summary(name: str, r: dict) -> str:
    if r["status"] == "skipped":
        return r["reason"]
    if r["status"] == "error":
        return "ERROR: " + (r["error"].strip().splitlines() or [""])[-1][:100]
    if name in TEST_PARTS:
        stopped = "; stopped at its time limit" if r.get("timed_out") else ""
        return f"{r['passed']} passed, {r['failed']} failed, {r['errors']} errors, {r['skipped']} skipped{stopped}"
    if name == "gate":
        ratios = r["ratios"].values()
        verdict = ("passed" if r["passed"] else "FAILED") if r["gated"] else f"no baseline for {r['device_kind']}"
        return f"{len(r['ratios'])} cases, gpudist/peer {min(ratios):.2f}-{max(ratios):.2f}; gate {verdict}"
    if name == "kernels":
        good = [row for row in r["rows"] if row.get("good") is not None]
        errs = sum("error" in row for row in r["rows"])
        copy = ", ".join(f"{v:.0f}" if v is not None else "failed" for v in r["copy_GBps"].values())
        return (
            f"{len(r['rows'])} rows; copy {copy} GB/s; memory-bound >= {GOOD_FRACTION} of copy: "
            f"{sum(row['good'] for row in good)}/{len(good)}" + (f"; {errs} errors" if errs else "")
        )
    done = [row for row in r.get("rows", ()) if "error" not in row]
    errs = f"; {len(r['rows']) - len(done)} rows failed" if len(done) < len(r.get("rows", ())) else ""
    if name == "collectives":
        big = [row for row in done if row["bytes"] == max(x["bytes"] for x in done)]
        return (
            f"world {r['world_size']}, NCCL {r['nccl']}; largest size: "
            + ", ".join(
                f"{row['op']} "
                + (
                    f"{row['gpudist_us']:.1f} us"
                    if r["world_size"] == 1
                    else f"busbw {row['gpudist_busbw_GBps']:.1f} GB/s"
                )
                + f" (raw/ours {row['raw_over_gpudist']:.2f})"
                for row in big
            )
            + errs
        )
    if name == "profile":
        return "GPU busy share: " + ", ".join(
            f"{k} {v['gpu_busy_share']:.2f}" for k, v in r["variants"].items() if v["gpu_busy_share"] is not None
        )
    if name == "host":
        us = {k: v["median"] for k, v in r["us_per_call"].items()}
        pairs = [
            ("all_reduce_planned", "all_reduce_raw_handed_off"),
            ("pack_300_plan", "pack_300_torch_cat_mul"),
            ("adam_step_plan", "adam_step_torch_fused_adamw"),
        ]
        return "host us per call, gpudist plan / peer: " + ", ".join(
            f"{a} {us[a]:.1f} / {us[b]:.1f}" for a, b in pairs if a in us and b in us
        )
    if name == "strategies":
        ratios = "; ".join(
            f"{row['workload']}: " + ", ".join(f"{k} {v:.2f}" for k, v in row["peer_over_gpudist"].items())
            for row in done
        )
        return f"world {r['world_size']}; peer time / gpudist time: {ratios}{errs}"
    return "ok"


def _part_table(name: str, r: dict) -> str:
    """The detail table of one finished part."""
    if r["status"] != "ok":
        return f"# {name}: {r['status']}\n{r.get('error') or r.get('reason')}"
    lines = [f"# {name}: {_part_summary(name, r)} ({r['seconds']:.0f}s)"]
    if name in TEST_PARTS:
        lines += [f"  FAILED {t}" for t in r["failed_tests"]]
    elif name == "gate":
        lines += [f"  {ratio:6.2f}  {key}" for key, ratio in r["ratios"].items()]
    elif name == "kernels":
        lines.append(f"{'op':>28} {'elements':>10} {'us':>9} {'GB/s':>8} {'of copy':>8} {'vs torch':>8}")
        for row in r["rows"]:
            if "error" in row:
                lines.append(f"{row['op']:>28} {row['elements']:>10}  ERROR {row['error'].strip().splitlines()[-1]}")
                continue
            mark = {True: "", False: "  < " + str(GOOD_FRACTION), None: "  (not memory-bound)"}[row["good"]]
            lines.append(
                f"{row['op']:>28} {row['elements']:>10} {row['gpudist_us']:>9.1f} {row['gpudist_GBps']:>8.1f} "
                f"{row['fraction_of_copy']:>8.2f} {row['speedup_vs_torch']:>8.2f}{mark}"
            )
    elif name == "collectives":
        lines.append(
            f"{'op':>15} {'bytes':>11} {'ours(us)':>9} {'algbw':>8} {'busbw':>8} {'nocheck':>8} {'raw(us)':>9} "
            f"{'busbw':>8} {'raw/ours':>8} {'raw/nocheck':>11}"
        )
        for row in r["rows"]:
            if "error" in row:
                lines.append(f"{row['op']:>15} {row['bytes']:>11}  ERROR {row['error'].strip().splitlines()[-1]}")
                continue
            lines.append(
                f"{row['op']:>15} {row['bytes']:>11} {row['gpudist_us']:>9.1f} {row['gpudist_algbw_GBps']:>8.2f} "
                f"{row['gpudist_busbw_GBps']:>8.2f} {row['gpudist_nocheck_us']:>8.1f} {row['raw_us']:>9.1f} "
                f"{row['raw_busbw_GBps']:>8.2f} {row['raw_over_gpudist']:>8.2f} "
                f"{row['raw_over_gpudist_nocheck']:>11.2f}"
            )
        if r["note"]:
            lines.append(f"# {r['note']}")
    elif name == "host":
        lines += [f"{k:>40} {v['median']:>9.1f} us (min {v['min']:.1f})" for k, v in r["us_per_call"].items()]
    elif name == "profile":
        lines.append(f"  {r['workload']} autocast {r['autocast']}, batch {r['batch_per_rank']}, {r['steps']} steps")
        lines.append(
            f"{'variant':>15} {'wall ms':>8} {'issue ms':>8} {'fwd':>6} {'bwd':>6} {'step':>6} {'zero':>6} "
            f"{'AccGrad ms':>10} {'calls':>6} {'GPU busy':>8}"
        )
        for k, v in r["variants"].items():
            busy = "-" if v["gpu_busy_share"] is None else f"{v['gpu_busy_share']:.2f}"
            host = " ".join(f"{v['host_ms'].get(p, 0.0):>6.2f}" for p in PHASES)
            lines.append(
                f"{k:>15} {v['wall_ms']:>8.2f} {v['issue_ms']:>8.2f} {host} {v['accumulate_grad_cpu_ms']:>10.2f} "
                f"{v['accumulate_grad_calls']:>6.0f} {busy:>8}"
            )
        lines += [f"  {k} FAILED: {v.strip().splitlines()[-1]}" for k, v in r["errors"].items()]
    elif name == "strategies":
        for row in r["rows"]:
            failures = {"all": row["error"]} if "error" in row else row["errors"]
            if "step_ms" in row:
                times = ", ".join(f"{k} {v:.2f} ms" for k, v in row["step_ms"].items())
                spread = row["final_loss_relative_spread"]
                lines.append(
                    f"  {row['workload']} ({row['model']['parameters'] / 1e6:.1f}M parameters, batch "
                    f"{row['batch_per_rank']}/rank): {times}; final losses agree to {spread or 0:.1e}"
                )
            lines += [f"  {row['workload']} {k} FAILED: {v.strip().splitlines()[-1]}" for k, v in failures.items()]
    return "\n".join(lines)


def format_summary(doc: dict) -> str:
    v, gpus = doc["versions"], doc["machine"]["gpus"]
    where = f"{gpus[0]['name']} x{len(gpus)}" if gpus else "no GPU"
    lines = [
        f"# gpudist bench gpu: {where}; torch {v['torch']}, CUDA {v['cuda']}, triton {v['triton']}, cupy {v['cupy']}, "
        f"NCCL {v['nccl_cupy']} (torch's {v['nccl_torch']}); {doc['date']}",
        f"{'part':<17} {'status':<8} {'seconds':>8}  summary",
    ]
    for name, r in doc["parts"].items():
        lines.append(f"{name:<17} {r['status']:<8} {r.get('seconds', 0):>8.1f}  {_safely(_part_summary, name, r)}")
    total = sum(r.get("seconds", 0) for r in doc["parts"].values())
    lines.append(f"{'total':<17} {'':<8} {total:>8.1f}  (budget {doc['settings']['budget']:g}s)")
    for name, p in (doc.get("plan") or {}).items():
        lines += [f"# plan: {name} would need {problem}" for problem in p["problems"]]
    return "\n".join(lines)


# -- command line -----------------------------------------------------------------------------------------------------


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(parse_size(t) for t in text.split(","))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = GPUSettings()
    parser.add_argument(
        "--parts",
        default=",".join(d.parts),
        help=f"comma-separated subset of {', '.join(PARTS)} ('tests': the four test parts)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer sizes and rounds: " + QUICK_HELP)
    parser.add_argument(
        "--budget", type=float, default=d.budget, help="seconds for the whole run (default %(default)s)"
    )
    parser.add_argument(
        "--test-timeout", type=float, default=d.test_timeout, help="seconds one test may take (default %(default)s)"
    )
    parser.add_argument(
        "--out", default=None, help="JSON file or folder (default benchmarks/results/gpu_<device>.json)"
    )
    parser.add_argument(
        "--check", action="store_true", help="print which parts would run and what they lack; run nothing"
    )
    parser.add_argument("--require-gpu", action="store_true", help=f"exit {EXIT_NO_GPU} instead of 0 without CUDA")
    parser.add_argument("--elements", default=None, help="kernel sizes in elements (default 4M,16M,64M)")
    parser.add_argument("--kernel-ops", default=None, help="subset of the kernel ops (default all)")
    parser.add_argument("--bytes", default=None, help="collective sizes in bytes (default 64K,1M,16M,256M)")
    parser.add_argument("--workloads", default=None, help=f"gpudist.bench.workloads models (default {d.workloads})")
    parser.add_argument("--rounds", type=int, default=None, help=f"interleaved rounds (default {d.rounds})")
    parser.add_argument("--steps", type=int, default=None, help=f"training steps per round (default {d.steps})")
    parser.add_argument("--world-size", type=int, default=None, help="ranks (default: every visible GPU)")
    parser.add_argument("--repo", default=None, help="the repository root (default: found from the working dir)")
    parser.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every part's time limit")


QUICK = {"elements": "16M", "bytes": "1M,64M", "workloads": "mlp,gpt", "rounds": 3, "steps": 3}
"""What ``--quick`` measures (an option given explicitly wins)."""
QUICK_HELP = ", ".join(f"{k} {v}" for k, v in QUICK.items())


def settings_from(args: argparse.Namespace) -> GPUSettings:
    parts: list[str] = []
    for p in (p for p in args.parts.split(",") if p):
        parts += PART_GROUPS.get(p, (p,))
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown part(s) {unknown}; available: {', '.join([*PARTS, *PART_GROUPS])}")
    defaults = GPUSettings()
    full = {
        "elements": "4M,16M,64M",
        "bytes": "64K,1M,16M,256M",
        "workloads": ",".join(defaults.workloads),
        "rounds": defaults.rounds,
        "steps": defaults.steps,
    }
    chosen = {k: getattr(args, k) if getattr(args, k) is not None else (QUICK if args.quick else full)[k] for k in full}
    world = args.world_size
    if chosen["rounds"] < 1 or chosen["steps"] < 1 or (world is not None and world < 1):
        raise ValueError(f"--rounds ({chosen['rounds']}), --steps ({chosen['steps']}) and --world-size must be >= 1")
    if args.budget <= 0 or args.test_timeout <= 0:
        raise ValueError(f"--budget ({args.budget}) and --test-timeout ({args.test_timeout}) must be > 0")
    repo = Path(args.repo).resolve() if args.repo else find_repo()
    return GPUSettings(
        parts=tuple(dict.fromkeys(parts)),
        kernel_elements=_sizes(chosen["elements"]),
        kernel_ops=tuple(args.kernel_ops.split(",")) if args.kernel_ops else None,
        collective_bytes=_sizes(chosen["bytes"]),
        workloads=tuple(chosen["workloads"].split(",")),
        rounds=chosen["rounds"],
        steps=chosen["steps"],
        world_size=world,
        timeouts={k: v * args.timeout_scale for k, v in defaults.timeouts.items()},
        test_timeout=args.test_timeout,
        budget=args.budget,
        repo=str(repo) if repo else None,
    )


def main(argv: list[str] | None = None, prog: str = "gpudist bench gpu") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


def run_from_args(args: argparse.Namespace) -> int:
    try:
        settings = settings_from(args)
    except ValueError as e:
        print(f"gpudist bench gpu: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.check:
        plan = check_plan(settings)
        for name, p in plan.items():
            state = "would run" if p["would_run"] else f"would skip ({p['reason']})"
            lack = "; ".join(p["problems"]) or "imports resolve"
            print(f"{name:<17} {state}: {lack}")
        return EXIT_OK if not any(p["problems"] for p in plan.values()) else EXIT_PART_FAILED
    _, _, code = run_gpu(settings, args.out, args.require_gpu)
    return code


if __name__ == "__main__":
    sys.exit(main())
