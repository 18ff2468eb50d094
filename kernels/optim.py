"""Fused optimizer steps on a flat shard: Adam, AdamW and SGD (momentum, Nesterov) in one pass.

The ZeRO/FSDP optimizers keep each rank's slice of the parameters, gradients and optimizer state
as flat buffers; one kernel launch then updates the whole slice, reading each element of
param/grad/state once and writing param/state (and, optionally, a bf16 copy of the new
parameters for the next all-gather) once.

Every step takes:
- ``grad_scale`` (a number) and ``grad_scale_tensor`` (an optional 1-element device tensor, e.g.
  a clipping coefficient computed on the device, so clipping needs no host sync); the gradient is
  multiplied by both before use: 1/world, an inverse loss scale, a clip coefficient.
- ``found_inf``: an optional 1-element tensor, nonzero means "skip this step" (typically the
  non-finite flag all-reduced across ranks so that every rank skips together). When it is None and
  ``check_finite`` is True the step computes it from ``squared_norm(grad)`` (one extra read of the
  gradient). A skipped step writes nothing.
- ``squared_norm`` (and ``max_norm``): the global squared gradient norm as a 1-element device tensor; the kernel
  derives the skip flag and the clipping coefficient from it itself (``global_norm_scalars``), so a ZeRO step is
  the norm (one launch), its all-reduce and the step, with no launch for the scalars in between.
The return value is that flag as an fp32 0-dim tensor (1.0 = skipped). Reading it with
``.item()`` synchronizes with the device; the kernel itself never does. The caller owns the step
count: increment it only for steps that were applied.

The arithmetic follows ``torch.optim.Adam/AdamW/SGD`` (single-tensor path) operation for
operation, with IEEE division and square root, so results agree with torch to a few fp32 ulps.
"""

from __future__ import annotations

import functools
import math

import torch

from ._triton import cast_rne, tl, triton
from .dispatch import use_triton
from .norm import CLIP_EPS, clip_scalars, global_norm_scalars, split_f64, squared_norm

__all__ = [
    "adam_step",
    "adam_step_reference",
    "adam_step_triton",
    "sgd_step",
    "sgd_step_reference",
    "sgd_step_triton",
]

# Memory-bound: 1024 elements x 4 warps = 8 fp32 per thread per buffer, five buffers in flight.
# (Tuned on GPU by benchmarks/kernels.py.)
BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _load_grad(
    g_ptr, offs, mask, grad_scale, scale_ptr, clip, HAS_SCALE_TENSOR: tl.constexpr, HAS_CLIP: tl.constexpr,
    MAXIMIZE: tl.constexpr,
):  # fmt: skip
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * grad_scale
    if HAS_SCALE_TENSOR:
        g = g * tl.load(scale_ptr).to(tl.float32)
    if HAS_CLIP:
        g = g * clip
    if MAXIMIZE:
        g = -g
    return g


@triton.jit
def _step_mask(
    pid, n, skip_ptr, total_ptr, max_norm_hi, max_norm_lo, HAS_SKIP: tl.constexpr, HAS_NORM: tl.constexpr,
    HAS_CLIP: tl.constexpr, CLIP_EPS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The program's offsets and mask (all off when the step is skipped), and the clipping coefficient."""
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if HAS_SKIP:
        # A skipped step masks every load and store: nothing is read or written.
        n = tl.where(tl.load(skip_ptr) == 0, n, 0)
    clip = 1.0
    if HAS_NORM:  # the step's scalars from the global squared norm, here rather than in a launch of their own
        _, finite, clip = global_norm_scalars(total_ptr, max_norm_hi, max_norm_lo, HAS_CLIP, CLIP_EPS)
        n = tl.where(finite, n, 0)
    return offs, offs < n, clip


@triton.jit
def _adam_kernel(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    out_ptr,
    scale_ptr,
    skip_ptr,
    total_ptr,
    n,
    grad_scale,
    max_norm_hi,
    max_norm_lo,
    weight_decay,
    decay,
    beta1_weight,
    beta2,
    one_minus_beta2,
    neg_step_size,
    bias_correction2_sqrt,
    eps,
    coeff_ptr,
    table_ptr,
    DECOUPLED: tl.constexpr,
    HAS_WEIGHT_DECAY: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    HAS_SCALE_TENSOR: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_CLIP: tl.constexpr,
    CLIP_EPS: tl.constexpr,
    HAS_OUT: tl.constexpr,
    HAS_COEFFS: tl.constexpr,
    SEGMENTED: tl.constexpr,
    OWNED_ALIGN: tl.constexpr,
    PARAM_ALIGN: tl.constexpr,
    LENGTH_ALIGN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    if HAS_COEFFS:  # a device step (capturable): -lr / bias_correction1, sqrt(bias_correction2), 1 - lr * weight_decay
        neg_step_size = tl.load(coeff_ptr)
        bias_correction2_sqrt = tl.load(coeff_ptr + 1)
        decay = tl.load(coeff_ptr + 2)
    pid = tl.program_id(0)
    if SEGMENTED:  # one program per table row: (owned offset, parameter offset, length <= BLOCK) of a piece's chunk
        row = pid.to(tl.int64) * 3
        at = tl.multiple_of(tl.load(table_ptr + row), OWNED_ALIGN)  # (the plan checked these alignments)
        p_at = tl.multiple_of(tl.load(table_ptr + row + 1), PARAM_ALIGN)
        n = tl.multiple_of(tl.load(table_ptr + row + 2), LENGTH_ALIGN)
        p_ptr += p_at
        out_ptr += p_at
        g_ptr += at
        m_ptr += at
        v_ptr += at
        pid = pid * 0
    offs, mask, clip = _step_mask(
        pid, n, skip_ptr, total_ptr, max_norm_hi, max_norm_lo, HAS_SKIP, HAS_NORM, HAS_CLIP, CLIP_EPS, BLOCK
    )
    g = _load_grad(g_ptr, offs, mask, grad_scale, scale_ptr, clip, HAS_SCALE_TENSOR, HAS_CLIP, MAXIMIZE)
    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
    if HAS_WEIGHT_DECAY:
        if DECOUPLED:
            p = p * decay  # AdamW: param.mul_(1 - lr * weight_decay)
        else:
            g = g + weight_decay * p  # Adam: grad.add(param, alpha=weight_decay)
    m = m + beta1_weight * (g - m)  # exp_avg.lerp_(grad, 1 - beta1), torch's formula for weight < 0.5
    v = v * beta2
    v = v + one_minus_beta2 * g * g  # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p + tl.div_rn(neg_step_size * m, denom)  # param.addcdiv_(exp_avg, denom, value=-step_size)
    tl.store(p_ptr + offs, cast_rne(p, p_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offs, cast_rne(m, m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, cast_rne(v, v_ptr.dtype.element_ty), mask=mask)
    if HAS_OUT:
        tl.store(out_ptr + offs, cast_rne(p, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sgd_kernel(
    p_ptr,
    g_ptr,
    buf_ptr,
    out_ptr,
    scale_ptr,
    skip_ptr,
    total_ptr,
    n,
    grad_scale,
    max_norm_hi,
    max_norm_lo,
    weight_decay,
    momentum,
    one_minus_dampening,
    neg_lr,
    lr_ptr,
    HAS_WEIGHT_DECAY: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr,
    FIRST: tl.constexpr,
    NESTEROV: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    HAS_SCALE_TENSOR: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_CLIP: tl.constexpr,
    CLIP_EPS: tl.constexpr,
    HAS_OUT: tl.constexpr,
    HAS_LR_PTR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    if HAS_LR_PTR:  # a learning rate held on the device (a scheduler fills it; a captured graph reads it)
        neg_lr = -tl.load(lr_ptr).to(tl.float32)
    offs, mask, clip = _step_mask(
        tl.program_id(0), n, skip_ptr, total_ptr, max_norm_hi, max_norm_lo, HAS_SKIP, HAS_NORM, HAS_CLIP, CLIP_EPS,
        BLOCK,
    )  # fmt: skip
    g = _load_grad(g_ptr, offs, mask, grad_scale, scale_ptr, clip, HAS_SCALE_TENSOR, HAS_CLIP, MAXIMIZE)
    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    if HAS_WEIGHT_DECAY:
        g = g + weight_decay * p  # grad.add(param, alpha=weight_decay)
    if HAS_MOMENTUM:
        if FIRST:
            buf = g  # torch.clone(grad) on the first step
        else:
            buf = tl.load(buf_ptr + offs, mask=mask).to(tl.float32) * momentum
            buf = buf + one_minus_dampening * g  # buf.mul_(momentum).add_(grad, alpha=1 - dampening)
        tl.store(buf_ptr + offs, cast_rne(buf, buf_ptr.dtype.element_ty), mask=mask)
        if NESTEROV:
            g = g + momentum * buf
        else:
            g = buf
    p = p + neg_lr * g  # param.add_(grad, alpha=-lr)
    tl.store(p_ptr + offs, cast_rne(p, p_ptr.dtype.element_ty), mask=mask)
    if HAS_OUT:
        tl.store(out_ptr + offs, cast_rne(p, out_ptr.dtype.element_ty), mask=mask)


def _skip_flag(grad, found_inf, check_finite) -> torch.Tensor | None:
    if found_inf is not None:
        return found_inf
    if check_finite:
        return (~torch.isfinite(squared_norm(grad))).float()
    return None


def _result(flag: torch.Tensor | None, device, squared_norm: torch.Tensor | None = None) -> torch.Tensor:
    result = torch.zeros((), dtype=torch.float32, device=device) if flag is None else (flag.reshape(()) != 0).float()
    if squared_norm is not None:  # skipped as well when the global norm is not finite
        result = torch.maximum(result, (~torch.isfinite(squared_norm.reshape(()))).float())
    return result


def _norm_flags(squared_norm: torch.Tensor, max_norm: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The skip flag and (with ``max_norm``) the clipping coefficient from the global squared norm, as new
    1-element tensors: what the kernels compute in place, for the torch paths."""
    norm = torch.empty(1, dtype=torch.float64, device=squared_norm.device)
    flags = torch.empty(2, dtype=torch.float32, device=squared_norm.device)
    clip_scalars(squared_norm, norm, flags, max_norm)
    return flags[0:1], flags[1:2] if max_norm is not None else None


def _adam_scalars(step, lr, beta1, beta2, weight_decay):
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    return {
        "decay": 1 - lr * weight_decay,
        "beta1_weight": 1 - beta1,
        "one_minus_beta2": 1 - beta2,
        "neg_step_size": -(lr / bias_correction1),
        "bias_correction2_sqrt": math.sqrt(bias_correction2),
    }


def adam_step_triton(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    *,
    step,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    decoupled_weight_decay,
    maximize,
    grad_scale,
    grad_scale_tensor,
    found_inf,
    check_finite,
    param_out,
    squared_norm,
    max_norm,
):
    """Triton launcher of :func:`adam_step` (inputs already validated)."""
    skip = _skip_flag(grad, found_inf, check_finite and squared_norm is None)
    _adam_launch(
        param, grad, exp_avg, exp_avg_sq, param_out, grad_scale_tensor, skip, squared_norm, max_norm, step=step,
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
        decoupled_weight_decay=decoupled_weight_decay, maximize=maximize, grad_scale=grad_scale,
    )  # fmt: skip
    return _result(skip, param.device, squared_norm)


def _adam_launch(
    param, grad, exp_avg, exp_avg_sq, param_out, grad_scale_tensor, skip, squared_norm, max_norm, *, step, lr, beta1,
    beta2, eps, weight_decay, decoupled_weight_decay, maximize, grad_scale, coefficients=None, segments=None,
):  # fmt: skip
    """The Adam kernel's launch (:func:`adam_step_triton`'s and :class:`AdamStep`'s): nothing for an empty shard.
    With ``coefficients`` (3 fp32 on the device: ``-lr / bias_correction1``, ``sqrt(bias_correction2)``,
    ``1 - lr * weight_decay``), the kernel reads the step's scalars there and ``step`` and ``lr`` are not used.
    With ``segments`` (:class:`AdamSegments`' table, its rows and alignments), one program per row steps a piece's
    chunk: ``param`` is the whole parameter buffer, the other buffers the whole owned ones."""
    n = param.numel()
    programs = -(-n // BLOCK) if segments is None else segments[1]  # (not triton.cdiv: a jit function, ~5 us)
    if not programs:
        return
    if coefficients is None:
        s = _adam_scalars(step, lr, beta1, beta2, weight_decay)
    else:  # the betas' terms (constant); the ones that move with the step or lr are read in the kernel
        s = _adam_scalars(1, 0.0, beta1, beta2, 0.0)
    max_norm_hi, max_norm_lo = split_f64(max_norm) if max_norm is not None else (0.0, 0.0)
    table, _, owned_align, param_align, length_align = segments if segments is not None else (param, 0, 1, 1, 1)
    _adam_kernel[(programs,)](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        param_out if param_out is not None else param,
        grad_scale_tensor if grad_scale_tensor is not None else param,
        skip if skip is not None else param,
        squared_norm if squared_norm is not None else param,
        n,
        float(grad_scale),
        max_norm_hi,
        max_norm_lo,
        weight_decay,
        s["decay"],
        s["beta1_weight"],
        beta2,
        s["one_minus_beta2"],
        s["neg_step_size"],
        s["bias_correction2_sqrt"],
        eps,
        coefficients if coefficients is not None else param,
        table,
        DECOUPLED=decoupled_weight_decay,
        HAS_WEIGHT_DECAY=weight_decay != 0,
        MAXIMIZE=maximize,
        HAS_SCALE_TENSOR=grad_scale_tensor is not None,
        HAS_SKIP=skip is not None,
        HAS_NORM=squared_norm is not None,
        HAS_CLIP=max_norm is not None,
        CLIP_EPS=CLIP_EPS,
        HAS_OUT=param_out is not None,
        HAS_COEFFS=coefficients is not None,
        SEGMENTED=segments is not None,
        OWNED_ALIGN=owned_align,
        PARAM_ALIGN=param_align,
        LENGTH_ALIGN=length_align,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )


def _torch_step(body):
    """The frame every torch-path step shares: the skip check, the update, the low-precision copy, the flag.

    A body that returns True honoured the skip flag itself, on the device (torch's fused kernels take
    ``found_inf``), so the step makes no host sync; otherwise the frame reads the flag on the host first."""

    @functools.wraps(body)
    def step(param, grad, *buffers, found_inf, check_finite, param_out, squared_norm=None, max_norm=None, **hyper):
        if squared_norm is not None:  # the skip flag and clip coefficient as new tensors (one launch)
            flag, hyper["clip"] = _norm_flags(squared_norm, max_norm)
            found_inf = flag if found_inf is None else torch.maximum((found_inf.reshape(1) != 0).float(), flag)
        skip = _skip_flag(grad, found_inf, check_finite)
        on_device = getattr(body, "skips_on_device", None)
        if on_device is not None and on_device(param, *buffers):
            body(param, grad, *buffers, found_inf=skip, **hyper)
        elif not _skipped(skip):
            body(param, grad, *buffers, **hyper)
        else:
            return _result(skip, param.device)
        if param_out is not None:
            param_out.copy_(param)  # after a skip on the device: the unchanged values, as the skip leaves them
        return _result(skip, param.device)

    return step


@_torch_step
def adam_step_reference(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    *,
    step,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    decoupled_weight_decay,
    maximize,
    grad_scale,
    grad_scale_tensor,
    clip=None,
):
    """torch reference of :func:`adam_step`: torch.optim.Adam's single-tensor arithmetic, in place (the oracle)."""
    s = _adam_scalars(step, lr, beta1, beta2, weight_decay)
    g = _scaled_grad(grad, grad_scale, grad_scale_tensor, maximize, param.dtype, clip)
    if weight_decay != 0:
        if decoupled_weight_decay:
            param.mul_(s["decay"])
        else:
            g = g.add(param, alpha=weight_decay)
    exp_avg.lerp_(g, s["beta1_weight"])
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=s["one_minus_beta2"])
    denom = exp_avg_sq.sqrt().div_(s["bias_correction2_sqrt"]).add_(eps)
    param.addcdiv_(exp_avg, denom, value=s["neg_step_size"])


def _same_dtype(param, *buffers) -> bool:
    """Whether torch's fused kernel takes these buffers (every one in the parameter's dtype, or absent)."""
    return all(b is None or b.dtype == param.dtype for b in buffers)


def _adam_step_torch_body(param, grad, exp_avg, exp_avg_sq, found_inf=None, **hyper):
    """The torch path of :func:`adam_step` off the GPU: torch's own fused CPU kernel when the buffers allow.

    ``torch._fused_adam_`` makes one pass where the single-tensor reference makes seven (several times faster on
    CPU: docs/results.md, "Kernels"). It takes the skip flag as
    a tensor (``found_inf``), so a skipped step costs no host sync here either.
    """
    if not _same_dtype(param, exp_avg, exp_avg_sq):
        return adam_step_reference.__wrapped__(param, grad, exp_avg, exp_avg_sq, **hyper)
    fused = torch._fused_adamw_ if hyper["decoupled_weight_decay"] else torch._fused_adam_
    g = _scaled_grad(grad, hyper["grad_scale"], hyper["grad_scale_tensor"], False, param.dtype, hyper.get("clip"))
    step_tensor = torch.tensor(float(hyper["step"]), device=param.device)
    fused(
        [param],
        [g],
        [exp_avg],
        [exp_avg_sq],
        [],
        [step_tensor],
        lr=hyper["lr"],
        beta1=hyper["beta1"],
        beta2=hyper["beta2"],
        weight_decay=hyper["weight_decay"],
        eps=hyper["eps"],
        amsgrad=False,
        maximize=hyper["maximize"],
        found_inf=None if found_inf is None else found_inf.reshape(()).float(),
    )
    return None


_adam_step_torch_body.skips_on_device = _same_dtype
_adam_step_torch = _torch_step(_adam_step_torch_body)


def sgd_step_triton(
    param,
    grad,
    momentum_buffer,
    *,
    lr,
    momentum,
    dampening,
    nesterov,
    weight_decay,
    maximize,
    first_step,
    grad_scale,
    grad_scale_tensor,
    found_inf,
    check_finite,
    param_out,
    squared_norm,
    max_norm,
):
    """Triton launcher of :func:`sgd_step` (inputs already validated)."""
    skip = _skip_flag(grad, found_inf, check_finite and squared_norm is None)
    _sgd_launch(
        param, grad, momentum_buffer, param_out, grad_scale_tensor, skip, squared_norm, max_norm, lr=lr,
        momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=weight_decay, maximize=maximize,
        first_step=first_step, grad_scale=grad_scale,
    )  # fmt: skip
    return _result(skip, param.device, squared_norm)


def _sgd_launch(
    param, grad, momentum_buffer, param_out, grad_scale_tensor, skip, squared_norm, max_norm, *, lr, momentum,
    dampening, nesterov, weight_decay, maximize, first_step, grad_scale,
):  # fmt: skip
    """The SGD kernel's launch (:func:`sgd_step_triton`'s and :class:`SGDStep`'s): nothing for an empty shard. ``lr``
    may be a one-element device tensor, which the kernel reads."""
    n = param.numel()
    if not n:
        return
    lr_tensor = lr if isinstance(lr, torch.Tensor) else None
    max_norm_hi, max_norm_lo = split_f64(max_norm) if max_norm is not None else (0.0, 0.0)
    _sgd_kernel[(-(-n // BLOCK),)](
        param,
        grad,
        momentum_buffer if momentum_buffer is not None else param,
        param_out if param_out is not None else param,
        grad_scale_tensor if grad_scale_tensor is not None else param,
        skip if skip is not None else param,
        squared_norm if squared_norm is not None else param,
        n,
        float(grad_scale),
        max_norm_hi,
        max_norm_lo,
        weight_decay,
        momentum,
        1 - dampening,
        -lr if lr_tensor is None else 0.0,
        lr_tensor if lr_tensor is not None else param,
        HAS_WEIGHT_DECAY=weight_decay != 0,
        HAS_MOMENTUM=momentum != 0,
        FIRST=first_step,
        NESTEROV=nesterov,
        MAXIMIZE=maximize,
        HAS_SCALE_TENSOR=grad_scale_tensor is not None,
        HAS_SKIP=skip is not None,
        HAS_NORM=squared_norm is not None,
        HAS_CLIP=max_norm is not None,
        CLIP_EPS=CLIP_EPS,
        HAS_OUT=param_out is not None,
        HAS_LR_PTR=lr_tensor is not None,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )


@_torch_step
def sgd_step_reference(
    param,
    grad,
    momentum_buffer,
    *,
    lr,
    momentum,
    dampening,
    nesterov,
    weight_decay,
    maximize,
    first_step,
    grad_scale,
    grad_scale_tensor,
    clip=None,
):
    """torch reference of :func:`sgd_step`: torch.optim.SGD's single-tensor arithmetic, in place (the oracle)."""
    g = _scaled_grad(grad, grad_scale, grad_scale_tensor, maximize, param.dtype, clip)
    if weight_decay != 0:
        g = g.add(param, alpha=weight_decay)
    if momentum != 0:
        if first_step:
            momentum_buffer.copy_(g)
        else:
            momentum_buffer.mul_(momentum).add_(g, alpha=1 - dampening)
        g = g.add(momentum_buffer, alpha=momentum) if nesterov else momentum_buffer
    param.add_(g, alpha=-lr)


def _sgd_step_torch_body(param, grad, momentum_buffer, found_inf=None, **hyper):
    """The torch path of :func:`sgd_step` off the GPU: torch's fused CPU kernel (one pass, where the single-tensor ops
    make several) when the buffers allow; it takes the skip flag as a tensor."""
    if not _same_dtype(param, momentum_buffer):
        return sgd_step_reference.__wrapped__(param, grad, momentum_buffer, **hyper)
    g = _scaled_grad(grad, hyper["grad_scale"], hyper["grad_scale_tensor"], False, param.dtype, hyper.get("clip"))
    momentum = hyper["momentum"]
    torch._fused_sgd_(
        [param],
        [g],
        [momentum_buffer] if momentum != 0 else [],
        weight_decay=hyper["weight_decay"],
        momentum=momentum,
        lr=hyper["lr"],
        dampening=hyper["dampening"],
        nesterov=hyper["nesterov"],
        maximize=hyper["maximize"],
        is_first_step=hyper["first_step"],
        found_inf=None if found_inf is None else found_inf.reshape(()).float(),
    )
    return None


_sgd_step_torch_body.skips_on_device = _same_dtype
_sgd_step_torch = _torch_step(_sgd_step_torch_body)


def _scaled_grad(grad, grad_scale, grad_scale_tensor, maximize, dtype, clip=None) -> torch.Tensor:
    """The gradient the update uses, in the parameter's dtype; a new tensor only when something changes it. The
    factors apply in the kernels' order (number, scale tensor, clipping coefficient), so the rounding agrees."""
    g = grad.to(dtype)
    if grad_scale != 1.0:
        g = g * grad_scale
    for factor in (grad_scale_tensor, clip):
        if factor is not None:
            g = g * factor.reshape(()).to(dtype)
    return -g if maximize else g


def _skipped(flag: torch.Tensor | None) -> bool:
    return flag is not None and bool(flag.reshape(()) != 0)


def _check_buffers(param: torch.Tensor, buffers: dict[str, torch.Tensor | None]) -> None:
    if not isinstance(param, torch.Tensor) or param.dim() != 1 or not param.is_contiguous():
        shape = tuple(param.shape) if isinstance(param, torch.Tensor) else type(param).__name__
        raise ValueError(f"param must be a 1-D contiguous flat shard, got {shape}; use a FlatLayout buffer")
    if not param.is_floating_point():
        raise TypeError(f"param has dtype {param.dtype}; fused steps update float shards")
    for name, t in buffers.items():
        if t is None:
            continue
        if name in ("grad_scale_tensor", "found_inf", "squared_norm"):
            if t.numel() != 1 or t.device != param.device:
                raise ValueError(
                    f"{name} must be a 1-element tensor on {param.device}, got {tuple(t.shape)} on {t.device}"
                )
            continue
        if t.shape != param.shape or not t.is_contiguous():
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} (contiguous={t.is_contiguous()}) "
                f"but param is {tuple(param.shape)}; "
                "every buffer of a fused step is a contiguous slice of the same length"
            )
        if t.device != param.device:
            raise ValueError(f"{name} is on {t.device} but param is on {param.device}; keep the shard on one device")
        if not t.is_floating_point():
            raise TypeError(f"{name} has dtype {t.dtype}; fused steps take float buffers")


def _check_clip(squared_norm: torch.Tensor | None, max_norm: float | None) -> None:
    if max_norm is None:
        return
    if squared_norm is None:
        raise ValueError(f"max_norm={max_norm!r} clips by the global norm: pass squared_norm (its square) too")
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"max_norm={max_norm!r} must be a number > 0")


def _check_hyper(**values) -> None:
    for name, value in values.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name}={value!r} must be a finite number >= 0")


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
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
    check_finite: bool = True,
    param_out: torch.Tensor | None = None,
    squared_norm: torch.Tensor | None = None,
    max_norm: float | None = None,
) -> torch.Tensor:
    """One Adam (or, with ``decoupled_weight_decay``, AdamW) step on a flat shard, in place.

    ``step`` is the 1-based number of this step (bias correction). Returns the skip flag (see the
    module docstring). Matches ``torch.optim.Adam``/``AdamW`` (amsgrad off) stepping the same values.

    Args:
        param: The flat shard of parameters (1-D, contiguous, floating point), updated in place.
        grad: Its gradient, same shape and device.
        exp_avg: Adam's first moment, same shape and device; updated in place.
        exp_avg_sq: Adam's second moment, same shape and device; updated in place.
        step: The 1-based number of this step; the caller increments it only for steps that were applied.
        lr: The learning rate (>= 0).
        beta1: The first moment's decay, in [0, 1).
        beta2: The second moment's decay, in [0, 1).
        eps: Added to the denominator (>= 0).
        weight_decay: L2 penalty (Adam) or decoupled decay (AdamW) (>= 0).
        decoupled_weight_decay: AdamW's decoupled weight decay instead of Adam's L2 penalty.
        maximize: Maximize the objective (step along the gradient).
        grad_scale: A number the gradient is multiplied by before use (1/world, an inverse loss scale, a clip
            coefficient).
        grad_scale_tensor: An optional 1-element tensor on ``param``'s device the gradient is also multiplied by
            (a coefficient computed on the device, with no host sync).
        found_inf: An optional 1-element tensor on ``param``'s device; nonzero skips the step (nothing is
            written).
        check_finite: With ``found_inf`` None, skip the step when ``grad`` holds a NaN or Inf (one extra read of
            the gradient).
        param_out: Also receives the new parameters, cast to its dtype (e.g. a bf16 copy for the next
            all-gather); None: not written.
        squared_norm: An optional 1-element tensor on ``param``'s device holding the global squared gradient norm
            (e.g. all-reduced across ranks): the kernel itself skips the step when its square root is not finite
            (in place of ``check_finite``) and, with ``max_norm``, multiplies the gradient by the clipping
            coefficient ``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``; so norm,
            non-finite check and clip take no launch of their own.
        max_norm: The clipping threshold (> 0) for ``squared_norm``; None: no clipping.

    Returns:
        The skip flag, an fp32 0-dim tensor on ``param``'s device: 1.0 when the step was skipped, else 0.0.

    Raises:
        TypeError: When ``param`` or a buffer is not floating point.
        ValueError: When ``param`` is not a 1-D contiguous tensor, a buffer differs from it in shape or device or
            is not contiguous, ``grad_scale_tensor`` or ``found_inf`` is not a 1-element tensor on its device,
            ``step`` is not an int >= 1, ``lr``, ``eps``, ``weight_decay`` or ``grad_scale`` is not a finite
            number >= 0, ``beta1`` or ``beta2`` is not in [0, 1), or ``max_norm`` is not > 0 or comes without
            ``squared_norm``.
    """
    _check_buffers(
        param,
        {
            "grad": grad,
            "exp_avg": exp_avg,
            "exp_avg_sq": exp_avg_sq,
            "param_out": param_out,
            "grad_scale_tensor": grad_scale_tensor,
            "found_inf": found_inf,
            "squared_norm": squared_norm,
        },
    )
    _check_clip(squared_norm, max_norm)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"step={step!r} must be the 1-based number of this step (an int >= 1)")
    _check_hyper(lr=lr, eps=eps, weight_decay=weight_decay, grad_scale=grad_scale)
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{name}={beta!r} must be in [0, 1)")
    impl = adam_step_triton if use_triton(param) else _adam_step_torch
    return impl(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        step=step,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        decoupled_weight_decay=decoupled_weight_decay,
        maximize=maximize,
        grad_scale=grad_scale,
        grad_scale_tensor=grad_scale_tensor,
        found_inf=found_inf,
        check_finite=check_finite,
        param_out=param_out,
        squared_norm=squared_norm,
        max_norm=max_norm,
    )


def sgd_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None = None,
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
    check_finite: bool = True,
    param_out: torch.Tensor | None = None,
    squared_norm: torch.Tensor | None = None,
    max_norm: float | None = None,
) -> torch.Tensor:
    """One SGD step (momentum, dampening, Nesterov, weight decay) on a flat shard, in place.

    ``first_step`` initializes the momentum buffer from the gradient, as torch.optim.SGD does when
    a parameter has no buffer yet. Returns the skip flag (see the module docstring).

    Args:
        param: The flat shard of parameters (1-D, contiguous, floating point), updated in place.
        grad: Its gradient, same shape and device.
        momentum_buffer: The momentum, same shape and device, updated in place; needed when ``momentum`` is
            not 0.
        lr: The learning rate (>= 0).
        momentum: The momentum factor (>= 0; 0: plain SGD).
        dampening: Dampening of the momentum (>= 0).
        nesterov: Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
        weight_decay: L2 penalty (>= 0).
        maximize: Maximize the objective (step along the gradient).
        first_step: Initialize ``momentum_buffer`` from the gradient, as described above.
        grad_scale: A number the gradient is multiplied by before use (1/world, an inverse loss scale, a clip
            coefficient).
        grad_scale_tensor: An optional 1-element tensor on ``param``'s device the gradient is also multiplied by
            (a coefficient computed on the device, with no host sync).
        found_inf: An optional 1-element tensor on ``param``'s device; nonzero skips the step (nothing is
            written).
        check_finite: With ``found_inf`` None, skip the step when ``grad`` holds a NaN or Inf (one extra read of
            the gradient).
        param_out: Also receives the new parameters, cast to its dtype (e.g. a bf16 copy for the next
            all-gather); None: not written.
        squared_norm, max_norm: The global squared gradient norm and the clipping threshold, as
            :func:`adam_step` takes them.

    Returns:
        The skip flag, an fp32 0-dim tensor on ``param``'s device: 1.0 when the step was skipped, else 0.0.

    Raises:
        TypeError: When ``param`` or a buffer is not floating point.
        ValueError: When ``param`` is not a 1-D contiguous tensor, a buffer differs from it in shape or device or
            is not contiguous, ``grad_scale_tensor`` or ``found_inf`` is not a 1-element tensor on its device,
            ``lr``, ``momentum``, ``dampening``, ``weight_decay`` or ``grad_scale`` is not a finite number >= 0,
            ``momentum`` is not 0 without a ``momentum_buffer``, ``nesterov`` is set without ``momentum > 0``
            and ``dampening == 0``, or ``max_norm`` is not > 0 or comes without ``squared_norm``.
    """
    _check_buffers(
        param,
        {
            "grad": grad,
            "momentum_buffer": momentum_buffer,
            "param_out": param_out,
            "grad_scale_tensor": grad_scale_tensor,
            "found_inf": found_inf,
            "squared_norm": squared_norm,
        },
    )
    _check_clip(squared_norm, max_norm)
    _check_hyper(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, grad_scale=grad_scale)
    if momentum != 0 and momentum_buffer is None:
        raise ValueError(f"momentum={momentum} needs a momentum_buffer of the shard's size (torch.zeros_like(param))")
    if nesterov and (momentum == 0 or dampening != 0):
        raise ValueError(
            f"nesterov needs momentum > 0 and dampening = 0 (got momentum={momentum}, dampening={dampening})"
        )
    impl = sgd_step_triton if use_triton(param) else _sgd_step_torch
    return impl(
        param,
        grad,
        momentum_buffer,
        lr=lr,
        momentum=momentum,
        dampening=dampening,
        nesterov=nesterov,
        weight_decay=weight_decay,
        maximize=maximize,
        first_step=first_step,
        grad_scale=grad_scale,
        grad_scale_tensor=grad_scale_tensor,
        found_inf=found_inf,
        check_finite=check_finite,
        param_out=param_out,
        squared_norm=squared_norm,
        max_norm=max_norm,
    )
