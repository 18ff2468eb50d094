"""Planned optimizer steps: :func:`~gpudist.kernels.optim.adam_step` and ``sgd_step`` on fixed buffers (a ZeRO
shard's piece), the buffers checked and the launch decided once, so that a call only launches one kernel (Triton) or
torch's fused step (CPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton import tl, triton
from .dispatch import use_triton
from .optim import (
    BLOCK,
    _adam_launch,
    _check_buffers,
    _check_clip,
    _same_dtype,
    _scaled_grad,
    _sgd_launch,
    adam_step,
    sgd_step,
)

__all__ = ["AdamSegments", "AdamStep", "DeviceStep", "SGDStep", "advance_steps"]


@dataclass(frozen=True)
class DeviceStep:
    """An Adam step whose count and bias corrections live on the device, so that a captured graph replays every step
    with its own (torch's ``capturable=True``). The caller advances them on the device before each call.

    Attributes:
        count: The 1-based number of this step, a 0-dim fp32 tensor (torch's fused Adam reads it, as its
            ``state_steps``).
        coefficients: 3 fp32 on the device, what the Triton kernel reads instead of host numbers:
            ``-lr / (1 - beta1**count)``, ``sqrt(1 - beta2**count)`` and ``1 - lr * weight_decay``.
    """

    count: torch.Tensor
    coefficients: torch.Tensor


_POW_BITS = 25
"""Bits of a step count the kernel's pow reads: fp32 counts are exact integers up to 2**24 (as torch's)."""


@triton.jit
def _advance_kernel(total_ptr, counts_ptr, owned_ptr, hyper_ptr, coeff_ptr, groups, BITS: tl.constexpr,
                    BLOCK: tl.constexpr):  # fmt: skip
    g = tl.arange(0, BLOCK)
    mask = g < groups
    total = tl.load(total_ptr).to(tl.float64)
    counts = tl.load(counts_ptr + g, mask=mask, other=0.0)
    owned = tl.load(owned_ptr + g, mask=mask, other=0.0)
    counts = tl.where(total - total == 0, counts + owned, counts)  # NaN and Inf give NaN: not counted
    tl.store(counts_ptr + g, counts, mask=mask)
    lr = tl.load(hyper_ptr + 4 * g, mask=mask, other=0.0)
    weight_decay = tl.load(hyper_ptr + 4 * g + 1, mask=mask, other=0.0)
    beta1 = tl.load(hyper_ptr + 4 * g + 2, mask=mask, other=0.0)
    beta2 = tl.load(hyper_ptr + 4 * g + 3, mask=mask, other=0.0)
    # beta ** count in fp64 by squaring (at most BITS roundings: ~1e-14 relative, invisible once cast to fp32)
    n = counts.to(tl.int32)
    pow1 = tl.full([BLOCK], 1.0, tl.float64)
    pow2 = tl.full([BLOCK], 1.0, tl.float64)
    for _ in tl.static_range(BITS):
        odd = (n & 1) != 0
        pow1 = tl.where(odd, pow1 * beta1, pow1)
        pow2 = tl.where(odd, pow2 * beta2, pow2)
        beta1 = beta1 * beta1
        beta2 = beta2 * beta2
        n = n >> 1
    # fp64 division and square root are IEEE (div.rn.f64, sqrt.rn.f64), as the host's. A count of 0 (a group this
    # rank does not step, or no step taken yet) has no bias correction: its coefficients are never read; 1 avoids 0/0.
    correction1 = 1.0 - pow1
    correction1 = tl.where(correction1 == 0, 1.0, correction1)
    tl.store(coeff_ptr + 3 * g, (-(lr / correction1)).to(tl.float32), mask=mask)
    tl.store(coeff_ptr + 3 * g + 1, tl.sqrt(1.0 - pow2).to(tl.float32), mask=mask)
    tl.store(coeff_ptr + 3 * g + 2, (1.0 - lr * weight_decay).to(tl.float32), mask=mask)


def advance_steps(
    squared_norm: torch.Tensor,
    counts: torch.Tensor,
    owned: torch.Tensor,
    hyper: torch.Tensor | None = None,
    coefficients: torch.Tensor | None = None,
) -> None:
    """Count a step on the device, and compute the next Adam step's coefficients there (what :class:`DeviceStep`
    holds), with no host sync: one launch on the GPU.

    Args:
        squared_norm: The step's global squared gradient norm (1 float64); a step whose norm is not finite is not
            counted (it is skipped).
        counts: Per parameter group, the steps taken (fp32), advanced in place by ``owned``.
        owned: Per group, 1.0 where this rank steps the group, else 0.0 (fp32).
        hyper: Per group, ``(lr, weight_decay, beta1, beta2)`` (fp64, ``groups x 4``), or None: counts only.
        coefficients: Per group, written with ``-lr / (1 - beta1**count)``, ``sqrt(1 - beta2**count)`` and
            ``1 - lr * weight_decay`` (fp32, ``groups x 3``); with ``hyper``.
    """
    if hyper is not None and use_triton(counts):
        groups = counts.numel()
        block = max(16, 1 << (groups - 1).bit_length())
        _advance_kernel[(1,)](squared_norm, counts, owned, hyper, coefficients, groups, BITS=_POW_BITS, BLOCK=block,
                              num_warps=1)  # fmt: skip
        return
    counts.add_(owned * torch.isfinite(squared_norm))
    if hyper is None:
        return
    lr, weight_decay = hyper[:, 0], hyper[:, 1]
    corrections = torch.pow(hyper[:, 2:4], counts.double().unsqueeze(1)).neg_().add_(1)  # 1 - beta**count
    corrections[:, 0].masked_fill_(corrections[:, 0] == 0, 1.0)  # count 0: never read (as the kernel)
    # As the host computes them for a count it holds (fp64, then fp32): -lr / bc1, sqrt(bc2), 1 - lr * wd.
    coefficients.copy_(
        torch.stack((lr.div(corrections[:, 0]).neg_(), corrections[:, 1].sqrt(), 1 - lr * weight_decay), 1)
    )


def _flag(found_inf: torch.Tensor | None) -> torch.Tensor | None:
    """``found_inf`` as torch's fused kernels take it (a 0-dim float32 tensor): as it is when it already is."""
    if found_inf is None or (found_inf.dim() == 0 and found_inf.dtype == torch.float32):
        return found_inf
    return found_inf.reshape(()).float()


class AdamStep:
    """:func:`adam_step` on fixed buffers (a ZeRO shard's piece): what the function checks and decides on every call
    is checked and decided once, here; a call launches one kernel (Triton), or torch's fused Adam (CPU), and
    allocates nothing, reads nothing back and returns nothing: the skip flag (``found_inf``) and the gradient scale
    are device tensors the caller owns. ``adam_step`` costs the host many times ``torch._fused_adamw_``'s time per
    call, mostly in those checks and the skip flag's own ops (``benchmarks/host_overhead.py`` times the two).

    The gradient comes with each call, unchecked (a slice of the caller's gradient buffer, like ``grad`` here):
    ZeRO-3 frees its gradients at ``zero_grad``, and a plan holding them would keep them alive.

    Args:
        param, exp_avg, exp_avg_sq: As :func:`adam_step`; they must keep their storage for the plan's life.
        grad: A gradient of the kind every call passes (same shape, device; its dtype may differ from ``param``'s),
            checked here and not kept.
        param_out: As :func:`adam_step`.

    Raises:
        TypeError, ValueError: As :func:`adam_step`, for the buffers.
    """

    _segments: tuple | None = None
    """:class:`AdamSegments`' table for the kernel; None: one contiguous piece."""
    _one_piece = True
    """Whether :func:`adam_step` (one buffer per call) can stand in on the torch path."""

    def __init__(self, param, grad, exp_avg, exp_avg_sq, *, param_out: torch.Tensor | None = None):
        _check_buffers(param, {"grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "param_out": param_out})
        self.buffers, self.param_out = (param, exp_avg, exp_avg_sq), param_out
        self._triton = use_triton(param)
        self._fused = not self._triton and _same_dtype(param, exp_avg, exp_avg_sq)
        self._step = torch.zeros((), dtype=torch.float32, device=param.device)  # torch's fused Adam reads it here

    def __call__(
        self,
        grad: torch.Tensor,
        *,
        step: int | DeviceStep,
        lr: float | torch.Tensor,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = False,
        maximize: bool = False,
        grad_scale: float = 1.0,
        grad_scale_tensor: torch.Tensor | None = None,
        found_inf: torch.Tensor | None = None,
        squared_norm: torch.Tensor | None = None,
        max_norm: float | None = None,
    ) -> None:
        """One step with ``grad``, as :func:`adam_step` with ``check_finite=False`` (nothing is checked here). The
        Triton path reads ``squared_norm`` in the kernel; the torch path computes the flags first (the function's
        path, which allocates them). ``step`` a :class:`DeviceStep`: the count and coefficients are read on the device
        (``lr`` may then be a device tensor, which the torch path reads; the Triton path reads the coefficients)."""
        param, exp_avg, exp_avg_sq = self.buffers
        if max_norm is not None and squared_norm is None:
            _check_clip(squared_norm, max_norm)  # raises: a threshold without the norm would clip nothing
        device_step = isinstance(step, DeviceStep)
        if self._triton:
            _adam_launch(
                param, grad, exp_avg, exp_avg_sq, self.param_out, grad_scale_tensor, found_inf, squared_norm,
                max_norm, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                decoupled_weight_decay=decoupled_weight_decay, maximize=maximize, grad_scale=grad_scale,
                coefficients=step.coefficients if device_step else None, segments=self._segments,
            )  # fmt: skip
            return
        hyper = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay}
        if not self._fused or squared_norm is not None:  # mixed dtypes, or flags to compute: the function's path
            if device_step or not self._one_piece:
                raise ValueError(
                    f"{type(self).__name__}: a DeviceStep or several pieces on the torch path need param and state "
                    "in one dtype, and the skip flag and clip coefficient as tensors (kernels.clip_scalars), not "
                    "squared_norm (torch's fused Adam reads the count; the function's path takes an int)"
                )
            adam_step(
                param, grad, exp_avg, exp_avg_sq, step=step, **hyper, decoupled_weight_decay=decoupled_weight_decay,
                maximize=maximize, grad_scale=grad_scale, grad_scale_tensor=grad_scale_tensor, found_inf=found_inf,
                check_finite=False, param_out=self.param_out, squared_norm=squared_norm, max_norm=max_norm,
            )  # fmt: skip
            return
        scaled = grad_scale != 1.0 or grad_scale_tensor is not None or grad.dtype != param.dtype
        g = _scaled_grad(grad, grad_scale, grad_scale_tensor, False, param.dtype) if scaled else grad
        if device_step:
            count = step.count
        else:
            count = self._step
            count.fill_(float(step))
        params, grads, exp_avgs, exp_avg_sqs = self._lists(g)
        fused = torch._fused_adamw_ if decoupled_weight_decay else torch._fused_adam_
        fused(
            params, grads, exp_avgs, exp_avg_sqs, [], [count] * len(params), **hyper, amsgrad=False,
            maximize=maximize, found_inf=_flag(found_inf),
        )  # fmt: skip
        if self.param_out is not None:
            self.param_out.copy_(param)

    def _lists(self, grad: torch.Tensor) -> tuple[list, list, list, list]:
        """The torch fused step's tensor lists: this plan's buffers and ``grad``."""
        param, exp_avg, exp_avg_sq = self.buffers
        return [param], [grad], [exp_avg], [exp_avg_sq]


def _alignment(offsets) -> int:
    """The largest of 16, 8, 4, 2, 1 that divides every offset (elements): what the kernel may assume of them."""
    align = 16
    for offset in offsets:
        while offset % align:
            align //= 2
    return align


class AdamSegments(AdamStep):
    """:class:`AdamStep` over several pieces of one parameter buffer at once (ZeRO-2's owned piece of every bucket),
    their gradients and state at their own offsets in the owned buffers: one launch for all of them (Triton: one
    program per chunk of at most ``BLOCK`` elements of a piece, from a table made here, the offsets' alignment
    checked here so the kernel keeps its 128-bit accesses) or one torch fused call over the pieces' lists (CPU),
    instead of one per piece. Calls take what :meth:`AdamStep.__call__` takes, ``grad`` the whole owned gradient;
    on the torch path the skip flag and clip coefficient come as tensors, not ``squared_norm``.

    Args:
        param: The whole 1-D parameter buffer the pieces are slices of; it must keep its storage.
        grad: An owned gradient buffer of the kind every call passes (checked here, not kept).
        exp_avg, exp_avg_sq: The whole owned state buffers; they must keep their storage.
        pieces: ``(parameter offset, owned offset, length)`` of each piece.

    Raises:
        TypeError, ValueError: As :class:`AdamStep`, for the buffers; ValueError for a piece outside them.
    """

    _one_piece = False

    def __init__(self, param, grad, exp_avg, exp_avg_sq, pieces: list[tuple[int, int, int]]):
        _check_buffers(exp_avg, {"grad": grad, "exp_avg_sq": exp_avg_sq})
        _check_buffers(param, {})
        if param.device != exp_avg.device:
            raise ValueError(f"param is on {param.device} but exp_avg on {exp_avg.device}; keep them on one device")
        for p_at, at, n in pieces:
            if min(p_at, at, n) < 0 or p_at + n > param.numel() or at + n > exp_avg.numel():
                raise ValueError(
                    f"AdamSegments: piece (param offset {p_at}, owned offset {at}, length {n}) is outside the buffers "
                    f"({param.numel()} parameters, {exp_avg.numel()} owned)"
                )
        self.buffers, self.param_out, self.pieces = (param, exp_avg, exp_avg_sq), None, list(pieces)
        self._triton = use_triton(param)
        self._fused = not self._triton and _same_dtype(param, exp_avg, exp_avg_sq)
        self._step = torch.zeros((), dtype=torch.float32, device=param.device)
        self.aligned = True
        """Whether every chunk's offsets and length keep 16-byte accesses (the kernel's 128-bit loads and stores);
        a caller may step unaligned pieces one launch each instead, so one odd piece does not slow all of them."""
        if self._triton:
            rows = [(at + c, p_at + c, min(BLOCK, n - c)) for p_at, at, n in pieces for c in range(0, n, BLOCK)]
            table = torch.tensor(rows or [(0, 0, 0)], dtype=torch.int64).to(param.device)
            aligns = [_alignment(r[column] for r in rows) for column in range(3)]
            self._segments = (table, len(rows), *aligns)
            sizes = (exp_avg.element_size(), param.element_size(), min(exp_avg.element_size(), param.element_size()))
            self.aligned = all(a * size >= 16 for a, size in zip(aligns, sizes, strict=True))
        else:
            self._views = (
                [param[p_at : p_at + n] for p_at, _, n in pieces],
                [exp_avg[at : at + n] for _, at, n in pieces],
                [exp_avg_sq[at : at + n] for _, at, n in pieces],
            )

    def _lists(self, grad: torch.Tensor) -> tuple[list, list, list, list]:
        params, exp_avgs, exp_avg_sqs = self._views
        return params, [grad[at : at + n] for _, at, n in self.pieces], exp_avgs, exp_avg_sqs


class SGDStep:
    """:func:`sgd_step` on fixed buffers, as :class:`AdamStep` is to :func:`adam_step`.

    Args:
        param, momentum_buffer: As :func:`sgd_step` (``momentum_buffer`` None for plain SGD); they must keep their
            storage for the plan's life.
        grad: A gradient of the kind every call passes, checked here and not kept (as :class:`AdamStep`).
        param_out: As :func:`sgd_step`.

    Raises:
        TypeError, ValueError: As :func:`sgd_step`, for the buffers.
    """

    def __init__(self, param, grad, momentum_buffer=None, *, param_out: torch.Tensor | None = None):
        _check_buffers(param, {"grad": grad, "momentum_buffer": momentum_buffer, "param_out": param_out})
        self.buffers, self.param_out = (param, momentum_buffer), param_out
        self._triton = use_triton(param)
        self._fused = not self._triton and _same_dtype(param, momentum_buffer)

    def __call__(
        self,
        grad: torch.Tensor,
        *,
        lr: float | torch.Tensor,
        momentum: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        maximize: bool = False,
        first_step: bool = False,
        grad_scale: float = 1.0,
        grad_scale_tensor: torch.Tensor | None = None,
        found_inf: torch.Tensor | None = None,
        squared_norm: torch.Tensor | None = None,
        max_norm: float | None = None,
    ) -> None:
        """One step with ``grad``, as :func:`sgd_step` with ``check_finite=False`` (nothing is checked here), and
        ``squared_norm`` as :meth:`AdamStep.__call__` takes it. ``lr`` may be a one-element device tensor (a
        scheduler fills it in place; a captured graph reads it at every replay)."""
        param, buf = self.buffers
        if momentum != 0 and buf is None:
            raise ValueError(f"momentum={momentum} needs the plan built with a momentum_buffer")
        if max_norm is not None and squared_norm is None:
            _check_clip(squared_norm, max_norm)  # raises: a threshold without the norm would clip nothing
        if self._triton:
            _sgd_launch(
                param, grad, buf, self.param_out, grad_scale_tensor, found_inf, squared_norm, max_norm, lr=lr,
                momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=weight_decay,
                maximize=maximize, first_step=first_step, grad_scale=grad_scale,
            )  # fmt: skip
            return
        hyper = {"lr": lr, "momentum": momentum, "dampening": dampening, "nesterov": nesterov}
        if not self._fused or squared_norm is not None:
            if isinstance(lr, torch.Tensor):
                raise ValueError(
                    "SGDStep: a tensor lr on the torch path needs param and momentum_buffer in one dtype and no "
                    "squared_norm (torch's fused SGD reads it; the function's path takes a number)"
                )
            sgd_step(
                param, grad, buf, **hyper, weight_decay=weight_decay, maximize=maximize, first_step=first_step,
                grad_scale=grad_scale, grad_scale_tensor=grad_scale_tensor, found_inf=found_inf, check_finite=False,
                param_out=self.param_out, squared_norm=squared_norm, max_norm=max_norm,
            )  # fmt: skip
            return
        scaled = grad_scale != 1.0 or grad_scale_tensor is not None or grad.dtype != param.dtype
        g = _scaled_grad(grad, grad_scale, grad_scale_tensor, False, param.dtype) if scaled else grad
        torch._fused_sgd_(
            [param], [g], [buf] if momentum != 0 else [], weight_decay=weight_decay, **hyper, maximize=maximize,
            is_first_step=first_step, found_inf=_flag(found_inf),
        )  # fmt: skip
        if self.param_out is not None:
            self.param_out.copy_(param)
