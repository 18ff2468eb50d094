"""Planned optimizer steps: :func:`~gpudist.kernels.optim.adam_step` and ``sgd_step`` on fixed buffers (a ZeRO
shard's piece), the buffers checked and the launch decided once, so that a call only launches one kernel (Triton) or
torch's fused step (CPU)."""

from __future__ import annotations

import torch

from .dispatch import use_triton
from .optim import (
    _adam_launch,
    _check_buffers,
    _check_clip,
    _same_dtype,
    _scaled_grad,
    _sgd_launch,
    adam_step,
    sgd_step,
)

__all__ = ["AdamStep", "SGDStep"]


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
        step: int,
        lr: float,
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
        path, which allocates them)."""
        param, exp_avg, exp_avg_sq = self.buffers
        if max_norm is not None and squared_norm is None:
            _check_clip(squared_norm, max_norm)  # raises: a threshold without the norm would clip nothing
        if self._triton:
            _adam_launch(
                param, grad, exp_avg, exp_avg_sq, self.param_out, grad_scale_tensor, found_inf, squared_norm,
                max_norm, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                decoupled_weight_decay=decoupled_weight_decay, maximize=maximize, grad_scale=grad_scale,
            )  # fmt: skip
            return
        hyper = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay}
        if not self._fused or squared_norm is not None:  # mixed dtypes, or flags to compute: the function's path
            adam_step(
                param, grad, exp_avg, exp_avg_sq, step=step, **hyper, decoupled_weight_decay=decoupled_weight_decay,
                maximize=maximize, grad_scale=grad_scale, grad_scale_tensor=grad_scale_tensor, found_inf=found_inf,
                check_finite=False, param_out=self.param_out, squared_norm=squared_norm, max_norm=max_norm,
            )  # fmt: skip
            return
        scaled = grad_scale != 1.0 or grad_scale_tensor is not None or grad.dtype != param.dtype
        g = _scaled_grad(grad, grad_scale, grad_scale_tensor, False, param.dtype) if scaled else grad
        self._step.fill_(float(step))
        fused = torch._fused_adamw_ if decoupled_weight_decay else torch._fused_adam_
        fused(
            [param], [g], [exp_avg], [exp_avg_sq], [], [self._step], **hyper, amsgrad=False, maximize=maximize,
            found_inf=_flag(found_inf),
        )  # fmt: skip
        if self.param_out is not None:
            self.param_out.copy_(param)


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
        lr: float,
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
        ``squared_norm`` as :meth:`AdamStep.__call__` takes it."""
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
