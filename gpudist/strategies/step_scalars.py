"""A ZeRO step's scalars: the global gradient norm, the non-finite skip and the clipping coefficient, kept on the
device (no host sync) in buffers made once, and the norm's copy to the host read without stalling the device."""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

from .. import kernels
from ..comm import ReductionOperation

__all__ = ["StepScale"]


@dataclass(frozen=True)
class StepScale:
    """What a fused step multiplies the gradients by and whether it skips, as device tensors (no host sync): the
    flags :func:`~gpudist.kernels.clip_scalars` computed, or the global squared norm the kernels derive them from."""

    clip: torch.Tensor | None = None
    """The clipping coefficient ``min(1, max_norm / (norm + 1e-6))`` (1 element), or None: no clipping."""
    found_inf: torch.Tensor | None = None
    """1.0 when the global norm is not finite (every rank skips), else 0.0 (1 element); None: decided on the host."""
    squared_norm: torch.Tensor | None = None
    """The global squared norm (1 element), which the Triton steps read themselves (skip and clip in the kernel)."""
    max_norm: float | None = None
    """The clipping threshold that goes with ``squared_norm`` (None: no clipping)."""


class _Verdict:
    """A step's global gradient norm: its square (a float64 device tensor), copied to the host without blocking
    (pinned memory and an event on CUDA; on the CPU a plain copy), into a slot from ``slots``, so that reading it once
    the copy is done does not stall the device's queue; the host takes the square root (IEEE, as the device's). The
    slot goes back to ``slots`` once read, so a steady state allocates no host buffer and creates no event."""

    def __init__(self, squared_norm: torch.Tensor | None, slots: list | None = None):
        self._host, self._event, self._value, self._stepped = None, None, math.nan, squared_norm is not None
        self._slots = slots
        if squared_norm is None:
            return
        if slots:
            self._host, self._event = slots.pop()
        elif squared_norm.is_cuda:
            self._host, self._event = torch.empty(1, dtype=torch.float64, pin_memory=True), torch.cuda.Event()
        else:
            self._host = torch.empty(
                1, dtype=torch.float64, device="cpu"
            )  # the norm's buffer is the next step's too: a copy
        if self._event is not None:
            self._host.copy_(squared_norm.reshape(1), non_blocking=True)
            self._event.record()
        else:
            self._host.copy_(squared_norm.reshape(1))

    def ready(self) -> bool:
        """Whether the norm is on the host (so reading it does not wait)."""
        return self._host is None or self._event is None or self._event.query()

    def value(self) -> float:
        """The norm; waits for the device if the copy is not done yet."""
        if self._host is not None:
            if self._event is not None:
                self._event.synchronize()
            # Host memory (pinned on CUDA, the tensor itself on the CPU): a plain read, no device copy or dispatch.
            squared = ctypes.c_double.from_address(self._host.data_ptr()).value
            self._value = math.sqrt(squared) if squared >= 0 else math.nan  # NaN stays NaN; Inf stays Inf
            if self._slots is not None and len(self._slots) < _VERDICT_SLOTS:
                self._slots.append((self._host, self._event))
            self._host, self._event = None, None
        return self._value

    def skipped(self) -> bool:
        return self._stepped and not math.isfinite(self.value())


class _StepScalars:
    """The buffers a ZeRO step's scalars live in, kept from step to step: the global squared norm (its planned norm
    over ``numel`` owned gradients and its planned all-reduce), the norm, the skip flag and the clipping coefficient
    (0-dim views, as the fused steps take them; the Triton steps read ``total`` instead, ``in_kernel``), and the
    verdicts' host slots."""

    def __init__(self, comm, device: torch.device, numel: int):
        self.total = torch.zeros(1, dtype=torch.float64, device=device)
        self.squared_norm = kernels.SquaredNorm(numel, self.total)
        self.in_kernel = kernels.use_triton(self.total)
        self.norm = torch.zeros(1, dtype=torch.float64, device=device)
        self.flags = torch.zeros(2, dtype=torch.float32, device=device)
        self.found_inf, self.clip = self.flags[0], self.flags[1]
        self.all_reduce = comm.plan_all_reduce(self.total, ReductionOperation.SUM)
        self.slots: list = []


_VERDICT_SLOTS = 4
"""Pinned buffers and events kept for the verdicts of steps the host has not read yet (more while the device lags
further behind: allocated then, dropped when read)."""
