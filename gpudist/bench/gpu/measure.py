"""The measuring parts of ``gpudist bench gpu`` that time one call at a time: kernel bandwidth, NCCL collectives, host
time per call."""

from __future__ import annotations

import torch

from ..collectives import (
    collective_buffers,
    collective_variants,
    interleaved_times,
    on_nccl,
)
from .common import (
    COMPUTE_BOUND,
    GOOD_FRACTION,
    GPUSettings,
    _cupy_nccl,
    _error_text,
    _world,
    bandwidth_GBps,
    bus_bandwidth,
    fraction_of_copy,
    part_rows,
)

# -- part: kernel bandwidth ---------------------------------------------------------------------------------------


def kernels_part(settings: GPUSettings, device: str = "cuda") -> dict:
    """Every kernel op at every size against the copy bandwidth of that size; an op that fails is a row with its
    error (a sticky CUDA error then fails the ops after it too, each recorded)."""
    from ... import kernels as K
    from ..kernels import OPS, copy_bandwidth, time_variants

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
    from ...comm.nccl import nccl_version
    from ...launch import spawn

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
    from ..host_calls import cuda_call_rows

    return cuda_call_rows(nccl, HOST_CALLS, settings.rounds)


def host_part(settings: GPUSettings) -> dict:
    """Host microseconds per call on the GPU (``gpudist.bench.host_calls``, CUDA and NCCL real): pack of
    30 and 300 tensors, the Adam step and one all-reduce, each through gpudist's function, its plan, and as torch
    or raw CuPy do it, interleaved. World size 1: only the host's time is measured."""
    _cupy_nccl()
    rows = part_rows(settings, "host", _host_body, 1)
    return {"world_size": 1, "calls": HOST_CALLS, "rounds": settings.rounds, "us_per_call": rows}
