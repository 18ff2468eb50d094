"""Collective benchmarks: an nccl-tests-style sweep, with torch.distributed measured beside gpudist in one run.

algbw = size / time; busbw = algbw x the ring factor (all_reduce 2(n-1)/n, reduce_scatter and all_gather
(n-1)/n), as nccl-tests defines them, so numbers compare across world sizes. "size" is the all_reduce
tensor, the reduce_scatter input and the all_gather output.

On Gloo three variants run interleaved round by round on the same process group and buffers, so machine
noise hits all of them alike: raw ``torch.distributed`` calls, gpudist with the cross-rank consistency check
(the default) and gpudist with ``validate=False``. Each time is the median over rounds of the slowest rank.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..comm import CommunicationBackend, split_sizes
from ..fileio import atomic_write_json

__all__ = [
    "BASELINES",
    "BUS_FACTORS",
    "SWEEP_OPS",
    "collective_buffers",
    "collective_rank",
    "collective_variants",
    "environment",
    "format_table",
    "interleaved_round_times",
    "interleaved_times",
    "measure_collective",
    "parse_size",
    "run_collectives",
    "sweep",
]

BUS_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "all_to_all": lambda n: (n - 1) / n,
}
"""nccl-tests' bus bandwidth factors (busbw = algbw x factor), one per op every benchmark here measures."""
SWEEP_OPS = ("all_reduce", "reduce_scatter", "all_gather")
"""What ``gpudist bench collectives`` sweeps unless ``--ops`` says otherwise."""


def parse_size(text: str) -> int:
    """'64M', '1KiB', '4096' -> bytes."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if scale > 1 else t) * scale)
    except ValueError:
        raise ValueError(f"cannot read size {text!r}; write e.g. 1K, 64M or 4096") from None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment() -> dict:
    """Versions and hardware, recorded beside every benchmark number."""
    from importlib.metadata import PackageNotFoundError, version

    def ver(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpudist": ver("gpudist"),
        "torch": torch.__version__,
        "triton": ver("triton"),
        "numpy": ver("numpy"),
        "cupy": ver("cupy-cuda12x") or ver("cupy-cuda13x"),
        "mpi4py": ver("mpi4py"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    return env


def collective_buffers(comm: CommunicationBackend, op: str, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) of ``op`` on ``count`` fp32 elements (nccl-tests' size: the all-reduce, broadcast and all-to-all
    buffer, the reduce-scatter input, the all-gather output; ``count`` a multiple of the world size). Zeros, so that
    repeated sums stay finite."""
    n, dev = comm.world_size, comm.device
    if count % n:
        raise ValueError(f"count {count} is not a multiple of the world size {n}; round it down to {count // n * n}")
    if op == "all_gather":
        return torch.zeros(count // n, device=dev), torch.empty(count, device=dev)
    if op == "reduce_scatter":
        return torch.zeros(count, device=dev), torch.empty(count // n, device=dev)
    if op == "all_to_all":
        return torch.zeros(count, device=dev), torch.empty(count, device=dev)
    if op in ("all_reduce", "broadcast"):
        buf = torch.zeros(count, device=dev)
        return buf, buf
    raise ValueError(f"unknown collective {op!r}; use one of {', '.join(BUS_FACTORS)}")


def collective_variants(
    comm: CommunicationBackend, op: str, inp: torch.Tensor, out: torch.Tensor, baseline: bool = True
) -> dict[str, Callable[[], None]]:
    """name -> zero-argument callable running one ``op`` on these buffers: "baseline" (the transport's own library
    called directly, :data:`BASELINES`; absent where it has no such call or ``baseline`` is False), "gpudist_nocheck"
    (gpudist inside ``comm.unchecked()``, beside the baseline) and "gpudist" (the default, with the cross-rank check).
    """
    ours = {
        "all_reduce": lambda: comm.all_reduce(inp),
        "reduce_scatter": lambda: comm.reduce_scatter(inp, out),
        "all_gather": lambda: comm.all_gather(inp, out),
        "broadcast": lambda: comm.broadcast(inp, 0),
        "all_to_all": lambda: comm.all_to_all(inp, out),
    }[op]
    variants: dict[str, Callable[[], None]] = {}
    raw = _raw_call(comm, op, inp, out) if baseline else None
    if raw is not None:
        variants["baseline"] = raw

        def unchecked() -> None:
            with comm.unchecked():
                ours()

        variants["gpudist_nocheck"] = unchecked
    variants["gpudist"] = ours
    return variants


BASELINES = {"gloo": "torch.distributed", "mpi": "mpi4py", "nccl": "cupy.cuda.nccl"}
"""What each backend is compared with: the library's own call on the same group, in the same processes."""


def _raw_call(comm: CommunicationBackend, op: str, inp: torch.Tensor, out: torch.Tensor) -> Callable[[], None] | None:
    """The same op through the transport's own library on the same group (the overhead baseline), or None."""
    if comm.name == "gloo":
        import torch.distributed as dist

        # torch 2.13 renamed the tensor forms (*_single) and warns on the old names; 2.11 has only the old ones.
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return {
            "all_reduce": lambda: dist.all_reduce(inp),
            "reduce_scatter": lambda: reduce_scatter(out, inp),
            "all_gather": lambda: all_gather(out, inp),
            "broadcast": lambda: dist.broadcast(inp, src=0),
            "all_to_all": lambda: dist.all_to_all_single(out, inp),
        }[op]
    if comm.name == "mpi":
        from mpi4py import MPI

        mpi, a, b = comm._comm, inp.numpy(), out.numpy()
        counts = split_sizes(inp.numel() if op == "reduce_scatter" else out.numel(), comm.world_size)
        return {
            "all_reduce": lambda: mpi.Allreduce(MPI.IN_PLACE, a),
            "reduce_scatter": lambda: mpi.Reduce_scatter(a, b, counts),
            "all_gather": lambda: mpi.Allgather(a, b),
            "broadcast": lambda: mpi.Bcast(a, root=0),
            "all_to_all": lambda: mpi.Alltoall(a, b),
        }[op]
    if comm.name == "nccl":
        nccl, lib = comm._comm, comm._lib
        stream = comm._stream  # the backend's communication stream, as its own ops use
        calls = {
            "all_reduce": lambda: nccl.allReduce(
                inp.data_ptr(), inp.data_ptr(), inp.numel(), lib.NCCL_FLOAT32, lib.NCCL_SUM, stream()
            ),
            "reduce_scatter": lambda: nccl.reduceScatter(
                inp.data_ptr(), out.data_ptr(), out.numel(), lib.NCCL_FLOAT32, lib.NCCL_SUM, stream()
            ),
            "all_gather": lambda: nccl.allGather(
                inp.data_ptr(), out.data_ptr(), inp.numel(), lib.NCCL_FLOAT32, stream()
            ),
            "broadcast": lambda: nccl.broadcast(
                inp.data_ptr(), inp.data_ptr(), inp.numel(), lib.NCCL_FLOAT32, 0, stream()
            ),
        }
        call = calls.get(op)  # all_to_all: cupy.cuda.nccl has no call of its own (it is grouped send/recv)
        if call is None:
            return None
        rt = comm._rt

        def with_hand_back() -> None:
            # The same stream semantics as a blocking gpudist op: the communication stream waited for the current one
            # (stream()) before the call, and the current stream waits for an event after it (gpudist's Work.wait):
            # without this return hand-off the baseline left out a cost gpudist's call pays.
            call()
            rt.wait(rt.record())

        return with_hand_back
    return None


def interleaved_round_times(
    comm: CommunicationBackend, variants: dict[str, Callable[[], object]], steps: int, rounds: int, warmup: bool = True
) -> dict[str, list[float]]:
    """Seconds per call of each variant in each round, on every rank of ``comm``: one warm-up call each, then
    ``rounds`` rounds in which every variant runs ``steps`` times after a barrier, round-robin so machine noise hits
    all alike. Each round counts at its slowest rank's pace (every rank returns the same lists)."""
    cuda = comm.device.type == "cuda"
    for fn in variants.values() if warmup else ():
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            comm.barrier()
            if cuda:
                torch.cuda.synchronize(comm.device)
            start = time.perf_counter()
            for _ in range(steps):
                fn()
            if cuda:  # GPU ops are only enqueued: the round ends when the device is done
                torch.cuda.synchronize(comm.device)
            times[name].append((time.perf_counter() - start) / steps)
    return {name: _slowest(comm, ts) for name, ts in times.items()}


def interleaved_times(
    comm: CommunicationBackend, variants: dict[str, Callable[[], object]], steps: int, rounds: int, warmup: bool = True
) -> dict[str, float]:
    """The median round of :func:`interleaved_round_times`, per variant."""
    per_round = interleaved_round_times(comm, variants, steps, rounds, warmup)
    return {name: statistics.median(ts) for name, ts in per_round.items()}


def _slowest(comm: CommunicationBackend, seconds: list[float]) -> list[float]:
    t = torch.tensor(seconds, dtype=torch.float64, device=comm.device)
    comm.all_reduce(t, "max")
    return t.tolist()


def measure_collective(
    comm: CommunicationBackend,
    op: str,
    count: int,
    rounds: int = 5,
    target_seconds: float = 0.05,
    baseline: bool = True,
) -> dict:
    """On every rank: ``op`` on ``count`` fp32 elements (a multiple of the world size), every variant of
    :func:`collective_variants` in interleaved rounds. Returns the row: ``{name}_s`` the median round per variant,
    ``rounds_s`` every round's seconds per call (the slowest rank's). What ``gpudist bench collectives`` sweeps and
    the pytest-benchmark tier (``benchmarks/test_collectives.py``) times."""
    inp, out = collective_buffers(comm, op, count)
    variants = collective_variants(comm, op, inp, out, baseline)
    for fn in variants.values():  # warm up every variant
        fn()
    # Calibrate the number of iterations per round so one round of a variant takes ~target_seconds.
    start = time.perf_counter()
    variants["gpudist"]()
    if comm.device.type == "cuda":
        torch.cuda.synchronize(comm.device)
    once = _slowest(comm, [time.perf_counter() - start])[0]
    iters = int(min(200, max(2, target_seconds / max(once, 1e-6))))
    per_round = interleaved_round_times(comm, variants, iters, rounds, warmup=False)
    row = {"op": op, "bytes": count * 4, "count": count, "dtype": "float32", "iters": iters, "rounds": rounds}
    row.update({f"{name}_s": statistics.median(t) for name, t in per_round.items()})
    row["rounds_s"] = per_round
    return row


def sweep(
    comm: CommunicationBackend,
    ops: tuple[str, ...] = SWEEP_OPS,
    min_bytes: int = 1 << 10,
    max_bytes: int = 64 << 20,
    factor: int = 4,
    rounds: int = 5,
    target_seconds: float = 0.05,
    baseline: bool = True,
) -> list[dict]:
    """Run on every rank; returns one row per (op, size) with times (seconds per op) per variant."""
    n = comm.world_size
    rows = []
    size = min_bytes
    while size <= max_bytes:
        for op in ops:
            count = max(n, size // 4 // n * n)  # elements, a multiple of the world size
            row = measure_collective(comm, op, count, rounds, target_seconds, baseline)
            del row["rounds_s"]
            rows.append(row)
        size *= factor
    for row in rows:
        bus = BUS_FACTORS[row["op"]](n)
        for key in [k for k in row if k.endswith("_s")]:
            name = key[:-2]
            t = row[key]
            row[f"{name}_algbw_GBps"] = row["bytes"] / t / 1e9
            row[f"{name}_busbw_GBps"] = row["bytes"] / t / 1e9 * bus
        if "baseline_s" in row:
            row["ratio_busbw_vs_baseline"] = row["baseline_s"] / row["gpudist_s"]
            row["ratio_busbw_nocheck_vs_baseline"] = row["baseline_s"] / row["gpudist_nocheck_s"]
    return rows


def format_table(rows: list[dict], world_size: int, backend: str) -> str:
    has_base = any("baseline_s" in r for r in rows)
    base = BASELINES.get(backend, "baseline")
    head = f"# gpudist collectives: backend={backend} world_size={world_size} dtype=float32 (times: median of rounds)\n"
    cols = f"{'op':>15} {'size(B)':>11} {'count':>10} {'time(us)':>10} {'algbw':>8} {'busbw':>8}"
    if has_base:
        cols += f" {'raw(us)':>10} {'busbw':>8} {'ratio':>6} {'nocheck':>8} {'ratio':>6}"
    lines = [head + cols]
    for r in rows:
        line = (
            f"{r['op']:>15} {r['bytes']:>11} {r['count']:>10} {r['gpudist_s'] * 1e6:>10.1f} "
            f"{r['gpudist_algbw_GBps']:>8.3f} {r['gpudist_busbw_GBps']:>8.3f}"
        )
        if has_base:
            line += (
                f" {r['baseline_s'] * 1e6:>10.1f} {r['baseline_busbw_GBps']:>8.3f}"
                f" {r['ratio_busbw_vs_baseline']:>6.2f} {r['gpudist_nocheck_s'] * 1e6:>8.1f}"
                f" {r['ratio_busbw_nocheck_vs_baseline']:>6.2f}"
            )
        lines.append(line)
    if has_base:
        lines.append(
            f"# raw = {base} called directly on the same group; ratio = gpudist busbw / raw busbw (1.00 = no "
            "overhead); nocheck = validate=False"
        )
    return "\n".join(lines)


def _sweep_rank(comm: CommunicationBackend, **kwargs) -> list[dict]:
    torch.manual_seed(0)
    return sweep(comm, **kwargs)


def on_nccl(gloo: CommunicationBackend, body: Callable, **kwargs):
    """On a spawned Gloo rank: its GPU (rank modulo the GPUs; several ranks share one where NCCL allows it), the NCCL
    group of the same ranks, then ``body(gloo, nccl, **kwargs)``; the NCCL group is shut down after."""
    from ..comm.nccl import NCCLCommunicationBackend

    device = gloo.rank % torch.cuda.device_count()
    torch.cuda.set_device(device)
    nccl = NCCLCommunicationBackend.from_bootstrap(gloo, device=device)
    try:
        return body(gloo, nccl, **kwargs)
    finally:
        nccl.shutdown()


def _sweep_rank_nccl(comm: CommunicationBackend, **kwargs) -> list[dict]:
    return on_nccl(comm, lambda gloo, nccl: _sweep_rank(nccl, **kwargs))


def collective_rank(comm: CommunicationBackend, backend: str, op: str, count: int, rounds: int) -> dict:
    """A rank of the pytest-benchmark tier: :func:`measure_collective` over ``backend`` ("gloo": the pool's own
    group; "nccl": the NCCL group of the same ranks, built for this call)."""
    torch.manual_seed(0)
    if backend == "nccl":
        return on_nccl(comm, lambda gloo, nccl: measure_collective(nccl, op, count, rounds))
    return measure_collective(comm, op, count, rounds)


def _check_gpus(world_size: int) -> None:
    """NCCL wants one GPU per rank; from 2.30 it allows several with NCCL_MULTI_RANK_GPU_ENABLE=1 (experimental).
    Say so before spawning, instead of each rank failing in ncclCommInitRank."""
    from ..comm.nccl import nccl_version

    gpus = torch.cuda.device_count()
    if world_size <= gpus or os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1":
        return
    version = nccl_version() or (0, 0, 0)
    hint = (
        "set NCCL_MULTI_RANK_GPU_ENABLE=1 to let NCCL put several ranks on one GPU (experimental)"
        if version >= (2, 30)
        else "NCCL >= 2.30 can share a GPU between ranks (NCCL_MULTI_RANK_GPU_ENABLE=1)"
    )
    raise SystemExit(
        f"gpudist bench collectives: --world-size {world_size} needs {world_size} GPUs for NCCL "
        f"{'.'.join(map(str, version))}, this machine has {gpus}: use --world-size {max(gpus, 1)}, or "
        f"{hint}"
    )


def run_collectives(
    backend: str = "gloo", world_size: int = 2, json_path: str | os.PathLike | None = None, **kwargs
) -> dict:
    """Spawn ``world_size`` ranks, sweep, print the table, optionally write JSON; returns the result document."""
    from ..launch import available_backends, spawn
    from ..testing import run_ranks

    if backend == "inmemory":
        rows = run_ranks(_sweep_rank, world_size, "inmemory", timeout=600.0, **kwargs)[0]
    elif backend == "gloo":
        rows = spawn(_sweep_rank, world_size, timeout=600.0, **kwargs)[0]
    elif backend == "mpi" and available_backends()["mpi"] == "available":
        rows = run_ranks(_sweep_rank, world_size, "mpi", timeout=600.0, **kwargs)[0]
    elif backend == "nccl" and available_backends()["nccl"] == "available":
        _check_gpus(world_size)
        rows = spawn(_sweep_rank_nccl, world_size, timeout=600.0, **kwargs)[0]
    else:
        reason = available_backends().get(backend, "unknown backend")
        raise SystemExit(f"gpudist bench collectives: backend '{backend}' is unavailable here: {reason}")
    doc = {
        "benchmark": "collectives",
        "backend": backend,
        "world_size": world_size,
        "environment": environment(),
        "baseline": BASELINES.get(backend),
        "settings": {k: v for k, v in kwargs.items()},
        "rows": rows,
    }
    print(format_table(rows, world_size, backend))
    if json_path is not None:
        print(f"# wrote {atomic_write_json(json_path, doc)}")
    return doc
