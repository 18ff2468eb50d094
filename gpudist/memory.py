"""Memory measured, not declared: live tensor storages, the allocator's own count, and the process's RSS.

A wrapper's report (``model.memory_per_rank()``, ``opt.state_bytes()``) adds up the tensors it knows it holds, so it
cannot see a buffer held by accident: a cache of views keeps a whole flat copy of the model alive, and nothing that
reports memory knows about the cache. These functions look from outside instead:

- :func:`storage_census`: every tensor the garbage collector can reach (parameters, their ``.grad``, optimizer
  state, caches), each storage counted once, by device and dtype.
- :func:`allocated_bytes`: what the allocator itself has handed out (CUDA's caching allocator, or glibc's malloc on
  CPU). It also sees buffers that only C++ holds (autograd's saved tensors, a collective's in-flight buffers), which
  the census cannot; the difference between the two is memory no Python object accounts for.
- :func:`rss_bytes`, :func:`peak_rss_bytes`, :func:`reset_peak_rss`: what the operating system charges the process.

Compare measurements as differences from a baseline taken in the same process before building the model: the
census counts every tensor in the process (test data, the communication backend's own), the allocator every
``malloc``.
"""

from __future__ import annotations

import ctypes
import gc
import resource
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["Census", "allocated_bytes", "peak_rss_bytes", "reset_peak_rss", "rss_bytes", "storage_census"]


@dataclass(frozen=True)
class Census:
    """Bytes of distinct tensor storages, in all and by device and dtype (a storage's dtype: its first tensor's)."""

    total: int = 0
    storages: int = 0
    by_device: dict[str, int] = field(default_factory=dict)
    by_dtype: dict[str, int] = field(default_factory=dict)
    skipped: int = 0
    """Tensors seen whose memory could not be attributed to a storage (sparse, nested, ...): not counted."""


def storage_census(tensors: Iterable[torch.Tensor] | None = None, *, collect: bool = True) -> Census:
    """Bytes of the distinct storages behind ``tensors``, or behind every live tensor of the process (None).

    Each storage counts once and whole, however many tensors view it and whichever part they view: a 4-byte slice
    of a 100 MB buffer keeps 100 MB alive, and that is what it costs. So views need not be followed to their
    ``_base``, which shares the view's storage. Followed: the ``.grad`` of every leaf tensor that requires grad
    (autograd creates gradients in C++, and one that Python never touched has no Python object for the collector to
    find) and the inner tensors of wrapper subclasses such as ``DTensor`` (FSDP2's parameters), which have no
    storage of their own. Skipped: meta tensors and storages of 0 bytes (FSDP2 resizes freed parameters to 0).

    ``collect`` runs the garbage collector first, so unreachable cycles (an autograd graph kept by a hook) do not
    count. Objects frozen with ``gc.freeze()`` are not walked: freezing everything alive before a measurement makes
    later censuses count only what was made since, in milliseconds.

    What the walk cannot see: storages that only C++ holds and that never had a Python object, e.g. tensors autograd
    saved between forward and backward, torch DDP's gradient buckets before the first backward, library caches. A
    tensor that had one keeps it while C++ holds the tensor (PyTorch preserves it), so a buffer a finished Gloo work
    object still holds is seen. :func:`allocated_bytes` sees all of them.
    """
    if collect and tensors is None:
        gc.collect()
    found = _live_tensors() if tensors is None else tensors
    seen: dict[tuple[str, int], None] = {}
    by_device: dict[str, int] = {}
    by_dtype: dict[str, int] = {}
    skipped = 0
    stack = list(found)
    visited: dict[int, torch.Tensor] = {}  # holds what it names, so no id is reused during the walk
    while stack:
        t = stack.pop()
        if id(t) in visited:
            continue
        visited[id(t)] = t
        if t.is_leaf and t.requires_grad and t.grad is not None:
            stack.append(t.grad)
        if is_traceable_wrapper_subclass(t):
            inner, _ = t.__tensor_flatten__()
            stack.extend(v for v in (getattr(t, name) for name in inner) if isinstance(v, torch.Tensor))
            continue
        if t.is_meta:
            continue
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, functional: no plain storage
            skipped += 1
            continue
        nbytes = storage.nbytes()
        key = (str(t.device), storage.data_ptr())
        if nbytes == 0 or key in seen:
            continue
        seen[key] = None
        by_device[key[0]] = by_device.get(key[0], 0) + nbytes
        dtype = str(t.dtype).removeprefix("torch.")
        by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
    return Census(sum(by_device.values()), len(seen), by_device, by_dtype, skipped)


def _live_tensors() -> list[torch.Tensor]:
    # type() rather than isinstance(): isinstance may call an object's __class__, which proxies can make raise.
    return [obj for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)]


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (2.33+): size_t fields, unlike ``mallinfo``'s ints that wrap at 2 GiB."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None).mallinfo2  # None: the symbols already loaded into the process (its libc)
    except (OSError, AttributeError):  # musl, glibc < 2.33, or a malloc replacement without it
        return None
    fn.restype = _MallInfo2
    fn.argtypes = []
    return fn


_MALLINFO2 = _mallinfo2()


def allocated_bytes(device: torch.device | str | None = None) -> int | None:
    """Bytes the allocator has handed out and not taken back: ``torch.cuda.memory_allocated`` on a CUDA device; on
    the CPU, glibc's ``mallinfo2()`` (``uordblks``: heap chunks in use in every arena, + ``hblkhd``: chunks mapped on
    their own, which large tensors get). None where this cannot be known (not glibc, another device type).

    On the CPU this counts every ``malloc`` of the process, tensors or not (Python objects over 512 bytes, C++
    containers), with each chunk's header and alignment padding (PyTorch aligns CPU tensors to 64 bytes; a mapped
    chunk is rounded up to a page). So compare differences, and expect them to exceed a census of the same tensors
    by up to a page per large storage, plus whatever else the process allocated meanwhile.
    """
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    if device.type != "cpu" or _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd


def _status_kib(field_name: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])  # "VmHWM:   123456 kB"
    except (OSError, ValueError, IndexError):
        pass
    return None


def rss_bytes() -> int | None:
    """This process's resident set now (``VmRSS``), or None without /proc."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_rss_bytes() -> int:
    """This process's peak resident set (``VmHWM``: since start, or since :func:`reset_peak_rss`). Without /proc,
    ``getrusage``'s ``ru_maxrss`` (since start only; KiB on Linux, bytes on macOS)."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def reset_peak_rss() -> bool:
    """Set the peak resident set (``VmHWM``) to the current one, so :func:`peak_rss_bytes` measures from now.

    Writes ``5`` to ``/proc/self/clear_refs`` (Linux 4.0+). Returns whether that worked: False without /proc, when
    the kernel refuses the value, or when the file is not writable (some sandboxes); then the peak still counts from
    the start of the process, and measuring in a fresh process is the only clean way to separate two peaks.
    ``getrusage``'s ``ru_maxrss`` is never reset.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _status_kib("VmHWM") is not None
