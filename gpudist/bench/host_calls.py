"""Host microseconds per call: gpudist's pack, unpack and Adam step (through the function and through a plan built
once) and one all-reduce through the NCCL backend, each interleaved round by round with the torch (or raw CuPy) call
that does the same job, on tiny tensors so that what is timed is the host's part.

``gpudist bench gpu``'s ``host`` part measures these rows on a GPU (:func:`cuda_call_rows`); the CPU benchmark
``benchmarks/host_overhead.py`` imports them from here for its ``calls`` section.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import statistics
import threading
import time
from collections.abc import Callable, Iterator

import torch

from .. import kernels as K

__all__ = ["adam_variants", "cuda_call_rows", "interleaved", "pack_variants", "per_call_us", "triton_launches_stubbed"]


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    """Host microseconds per call of ``fn``, issued ``calls`` times back to back after a warm-up. On CUDA the device
    is synchronized before and after, outside the timed loop: what is timed is issuing the work, the host's part."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    for _ in range(min(50, calls)):
        fn()
    if sync is not None:
        sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    if sync is not None:
        sync()
    return elapsed / calls * 1e6


def interleaved(variants: dict[str, Callable[[], float]], rounds: int) -> dict[str, dict]:
    """Each variant's measurement, ``rounds`` times in rotating order; median, min and max."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            samples[name].append(variants[name]())
    return {n: {"median": statistics.median(s), "min": min(s), "max": max(s)} for n, s in samples.items()}


def pack_variants(n: int, calls: int, device: str = "cpu") -> dict[str, Callable[[], float]]:
    """Measurements of packing and unpacking ``n`` tensors of 4 elements by name: gpudist's function, its
    :class:`~gpudist.kernels.PackPlan`, and torch's ``cat(out=)`` + ``mul_`` / ``_foreach_copy_`` beside; on the CPU
    also the plan on the GPU's path with its launch stubbed (:func:`triton_launches_stubbed`)."""
    tensors = [torch.randn(4, device=device) for _ in range(n)]
    out = torch.empty(4 * n, device=device)
    views = list(out.split(4))
    rows = {
        f"pack_{n}": lambda: per_call_us(lambda: K.pack(tensors, out, 0.5), calls),
        f"pack_{n}_torch_cat_mul": lambda: per_call_us(lambda: torch.cat(tensors, out=out).mul_(0.5), calls),
        f"unpack_{n}": lambda: per_call_us(lambda: K.unpack(out, tensors, 0.5), calls),
        f"unpack_{n}_torch_foreach": lambda: per_call_us(
            lambda: (torch._foreach_copy_(tensors, views), torch._foreach_mul_(tensors, 0.5)), calls
        ),
    }
    plan = K.PackPlan(tensors, out)
    rows[f"pack_{n}_plan"] = lambda: per_call_us(lambda: plan.pack(0.5), calls)
    rows[f"unpack_{n}_plan"] = lambda: per_call_us(lambda: plan.unpack(0.5), calls)
    if device == "cpu" and K.HAS_TRITON:  # (the GPU's path, its launch stubbed)
        with triton_launches_stubbed():
            planned = K.PackPlan(tensors, out)  # the GPU's path: its tables built, its launch a no-op
        rows[f"pack_{n}_plan_launch_stubbed"] = _stubbed(lambda: per_call_us(lambda: planned.pack(0.5), calls))
        rows[f"unpack_{n}_plan_launch_stubbed"] = _stubbed(lambda: per_call_us(lambda: planned.unpack(0.5), calls))
    return rows


class _NullKernel:
    """A Triton kernel whose launch returns at once (``kernel[grid](*args, **kwargs)`` does nothing), counting its
    launches by name."""

    def __init__(self, name: str, launches: collections.Counter, lock: threading.Lock):
        self.name, self.launches, self.lock = name, launches, lock

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **kwargs) -> None:
        with self.lock:  # (rank threads launch at once: a Counter's += is not atomic)
            self.launches[self.name] += 1


_KERNEL_MODULES = ("bucket", "norm", "optim", "optim_plan", "quantize", "topk")
"""The modules of :mod:`gpudist.kernels` that launch Triton kernels (each imports ``use_triton`` by name)."""


@contextlib.contextmanager
def triton_launches_stubbed() -> Iterator[collections.Counter]:
    """Every gpudist Triton kernel's launch made a no-op and the Triton path chosen for any tensor (CPU ones too):
    what remains of a plan's call, or of a whole step, is gpudist's own host work on the GPU's path, without Triton's
    launcher (measured on the GPU itself by ``gpudist bench gpu``: ~20 us per launch on the H200's host). Yields the
    launches made, by kernel name.

    Raises:
        RuntimeError: Without Triton (there is no Triton path to take).
    """
    if not K.HAS_TRITON:
        raise RuntimeError("the GPU's path is the Triton kernels': install triton (Linux x86_64) to stub its launches")
    from triton.runtime.jit import KernelInterface

    launches: collections.Counter = collections.Counter()
    lock = threading.Lock()
    modules = [K, *(importlib.import_module(f"{K.__name__}.{m}") for m in _KERNEL_MODULES)]
    saved = [
        (module, name, obj)
        for module in modules
        for name, obj in vars(module).items()
        if isinstance(obj, KernelInterface) or name == "use_triton"
    ]
    for module, name, _ in saved:
        setattr(module, name, _always if name == "use_triton" else _NullKernel(name, launches, lock))
    try:
        yield launches
    finally:
        for module, name, obj in saved:
            setattr(module, name, obj)


def _always(tensor: torch.Tensor) -> bool:
    return True


def _stubbed(measure: Callable[[], float]) -> Callable[[], float]:
    def run() -> float:
        with triton_launches_stubbed():
            return measure()

    return run


def adam_variants(calls: int, device: str = "cpu") -> dict[str, Callable[[], float]]:
    """Measurements of one Adam step on a 1,024-element shard by name: gpudist's function, its
    :class:`~gpudist.kernels.AdamStep`, and ``torch._fused_adamw_`` beside; on the CPU also the plan on the GPU's
    path with its launch stubbed, called as ZeRO calls it (global norm and clip)."""
    p, g, m, v = (torch.randn(1024, device=device) for _ in range(4))
    v.abs_()
    step = torch.tensor(1.0, device=device)

    def torch_fused() -> None:
        torch._fused_adamw_(
            [p], [g], [m], [v], [], [step], lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8,
            amsgrad=False, maximize=False,
        )  # fmt: skip

    rows = {
        "adam_step": lambda: per_call_us(
            lambda: K.adam_step(p, g, m, v, step=1, lr=1e-3, weight_decay=0.01, decoupled_weight_decay=True), calls
        ),
        "adam_step_torch_fused_adamw": lambda: per_call_us(torch_fused, calls),
    }
    plan = K.AdamStep(p, g, m, v)
    hyper = {"step": 1, "lr": 1e-3, "weight_decay": 0.01, "decoupled_weight_decay": True}
    rows["adam_step_plan"] = lambda: per_call_us(lambda: plan(g, **hyper), calls)
    if device == "cpu" and K.HAS_TRITON:  # (the GPU's path, its launch stubbed)
        with triton_launches_stubbed():
            planned = K.AdamStep(p, g, m, v)
        total = torch.ones(1, dtype=torch.float64)  # ZeRO's call: skip and clip from the global squared norm
        rows["adam_step_plan_launch_stubbed"] = _stubbed(
            lambda: per_call_us(lambda: planned(g, **hyper, squared_norm=total, max_norm=1.0), calls)
        )
        # capturable=True as ZeRO steps it: the count and coefficients advanced on the device, then the step
        counts, owned, coefficients = torch.zeros(1), torch.ones(1), torch.zeros(1, 3)
        scalars = torch.tensor([[1e-3, 0.01, 0.9, 0.999]], dtype=torch.float64)
        device_step = K.DeviceStep(counts[0], coefficients[0])

        def capturable() -> None:
            K.advance_steps(total, counts, owned, scalars, coefficients)
            planned(g, **hyper | {"step": device_step}, squared_norm=total, max_norm=1.0)

        rows["adam_plan_capturable_stubbed"] = _stubbed(lambda: per_call_us(capturable, calls))
    return rows


def cuda_call_rows(comm, calls: int, rounds: int, device: str = "cuda") -> dict[str, dict]:
    """On a GPU, over a real NCCL backend (``comm``): host microseconds per call of pack (30 and 300 tensors), the
    Adam step and one all-reduce, each through gpudist's function, through its plan, and as torch or raw CuPy do
    it, interleaved. The raw all-reduce is timed bare and with the same stream hand-off a gpudist op makes (the
    communication stream waits for the current one, the current one for an event recorded after the call).
    (``device="cpu"``: the same rows over the simulated NCCL, with no hand-off, for the CPU tier's tests.)"""
    rows: dict[str, dict] = {}
    for n in (30, 300):
        rows.update(interleaved(pack_variants(n, calls, device), rounds))
    rows.update(interleaved(adam_variants(calls, device), rounds))
    x = torch.ones(256, device=device)
    lib, raw = comm._lib, comm._comm
    planned = comm.plan_all_reduce(x)
    cuda = device == "cuda"
    comm_stream = torch.cuda.Stream() if cuda else None
    current = torch.cuda.current_stream() if cuda else None

    def raw_call() -> None:
        stream = comm_stream.cuda_stream if cuda else 0
        raw.allReduce(x.data_ptr(), x.data_ptr(), 256, lib.NCCL_FLOAT32, lib.NCCL_SUM, stream)

    def raw_handed_off() -> None:
        if not cuda:
            return raw_call()
        comm_stream.wait_stream(current)
        raw_call()
        event = torch.cuda.Event()
        event.record(comm_stream)
        current.wait_event(event)

    def unchecked() -> None:
        with comm.unchecked():
            comm.all_reduce(x)

    rows.update(
        interleaved(
            {
                "all_reduce_raw": lambda: per_call_us(raw_call, calls),
                "all_reduce_raw_handed_off": lambda: per_call_us(raw_handed_off, calls),
                "all_reduce_unchecked": lambda: per_call_us(unchecked, calls),
                "all_reduce_planned": lambda: per_call_us(lambda: planned.start().wait(), calls),
            },
            rounds,
        )
    )
    return rows
