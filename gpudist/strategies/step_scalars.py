"""A ZeRO step's scalars: the global gradient norm, the non-finite skip and the clipping coefficient, kept on the
device (no host sync) in buffers made once, and the norm's copy to the host read without stalling the device."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Iterable
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


class _LiveVerdict(_Verdict):
    """The verdict of a captured step: the global squared norm's own buffer, which every replay rewrites, read when
    asked (a host sync then). Inside a graph nothing is copied to the host or recorded for the host to query."""

    def __init__(self, squared_norm: torch.Tensor):
        self._total, self._stepped = squared_norm, True

    def ready(self) -> bool:
        return True

    def value(self) -> float:
        squared = self._total.item()
        return math.sqrt(squared) if squared >= 0 else math.nan


class _DeviceSteps:
    """The step counts of a ZeRO optimizer's parameter groups on the device (fp32, as torch's ``capturable=True``
    Adam keeps them), with each group's Adam coefficients (:class:`~gpudist.kernels.DeviceStep`): a step advances the
    counts of the groups this rank steps by whether the global squared norm is finite, on the device, so a skipped
    step is not counted and the host reads nothing; a captured graph replays every step with its own count.

    A group's learning rate may be a device tensor (read at every step, so a scheduler that fills it in place moves
    a captured graph too); numbers (lr, weight decay, betas) are refilled on the device when the host sees them
    change."""

    def __init__(self, steps: list[int], owned: Iterable[int], device: torch.device):
        owned = set(owned)
        self.counts = torch.tensor([float(s) for s in steps], dtype=torch.float32, device=device)
        self._owned = torch.tensor(
            [1.0 if g in owned else 0.0 for g in range(len(steps))], dtype=torch.float32, device=device
        )
        self.coefficients = torch.zeros(len(steps), 3, dtype=torch.float32, device=device)
        self._hyper = torch.zeros(len(steps), 4, dtype=torch.float64, device=device)
        """Per group: lr, weight decay, beta1, beta2."""
        self._seen: list[tuple | None] = [None] * len(steps)
        self.steps = [kernels.DeviceStep(self.counts[g], self.coefficients[g]) for g in range(len(steps))]

    def host_counts(self) -> list[int]:
        """The counts, read on the host (a sync: for checkpoints)."""
        return [int(c) for c in self.counts.tolist()]

    def load(self, steps: list[int]) -> None:
        self.counts.copy_(torch.tensor([float(s) for s in steps], dtype=torch.float32))

    def advance(self, squared_norm: torch.Tensor, groups: list[dict] | None) -> None:
        """Count this step in the groups this rank steps unless ``squared_norm`` is not finite, and (with
        ``groups``, their hyper-parameters) compute each group's coefficients for the Triton kernel: one launch on
        the GPU (:func:`~gpudist.kernels.advance_steps`), after a copy per tensor learning rate."""
        if groups is None:
            kernels.advance_steps(squared_norm, self.counts, self._owned)
            return
        for g, group in enumerate(groups):
            self._follow(g, group)
        kernels.advance_steps(squared_norm, self.counts, self._owned, self._hyper, self.coefficients)

    def _follow(self, g: int, group: dict) -> None:
        lr = group["lr"]
        beta1, beta2 = group["betas"]
        key = (None if isinstance(lr, torch.Tensor) else lr, group.get("weight_decay", 0.0), beta1, beta2)
        if isinstance(lr, torch.Tensor):
            self._hyper[g, 0].copy_(lr.reshape(()))  # read on the device at every step (and every replay)
        seen = self._seen[g]
        if key != seen:
            for column, value in enumerate(key):
                if value is not None and (seen is None or seen[column] != value):
                    self._hyper[g, column].fill_(float(value))
            self._seen[g] = key


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
