"""Squared L2 norm of a flat buffer, for global-norm gradient clipping across shards.

Each rank computes the squared norm of its own shard; the sum over ranks (one all-reduce of a
single float) is the squared global norm. The result is an fp32 0-dim tensor on the buffer's
device, so clipping needs no host synchronization. A NaN or Inf anywhere in the buffer makes it
non-finite, which is how the fused optimizer steps detect non-finite gradients.
"""

from __future__ import annotations

import functools
import math
import struct

import torch

from ._triton import tl, triton
from .dispatch import use_triton

__all__ = [
    "SquaredNorm",
    "clip_scalars",
    "clip_scalars_reference",
    "clip_scalars_triton",
    "global_norm_scalars",
    "split_f64",
    "squared_norm",
    "squared_norm_reference",
    "squared_norm_triton",
]

# One partial sum per 8192 elements; the program that finishes last (a ticket counter) sums the partials in a fixed
# order, in the output's dtype: one launch, and a deterministic result (no floating-point atomics), which identical
# replicas across ranks need. 64M elements give 8192 partials, which the last program reads in 8 blocks of FINAL.
BLOCK = 8192
FINAL = 1024


@triton.jit
def _squared_norm_kernel(x_ptr, partial_ptr, ticket_ptr, out_ptr, n, BLOCK: tl.constexpr, FINAL: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(partial_ptr + pid, tl.sum(x * x, axis=0))
    # Every thread's part of the partial is stored before the ticket is taken; the ticket's release (acq_rel, GPU
    # scope) makes the partial visible to the program that takes the last ticket, whose acquire orders its reads.
    tl.debug_barrier()
    programs = tl.num_programs(0)
    if tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == programs - 1:
        acc = tl.zeros([FINAL], dtype=out_ptr.dtype.element_ty)
        for start in range(0, programs, FINAL):
            idx = start + tl.arange(0, FINAL)
            # volatile: read from L2, past any stale copy in this SM's L1
            acc += tl.load(partial_ptr + idx, mask=idx < programs, other=0.0, volatile=True).to(acc.dtype)
        tl.store(out_ptr, tl.sum(acc, axis=0))
        tl.atomic_xchg(ticket_ptr, 0)  # every program has taken its ticket: ready for the next launch


def squared_norm_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton launcher of :func:`squared_norm`: a one-off :class:`SquaredNorm` into a new fp32 scalar."""
    n = x.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return SquaredNorm(n, torch.empty((), dtype=torch.float32, device=x.device))._triton(x, n)


def squared_norm_reference(x: torch.Tensor) -> torch.Tensor:
    """torch reference of :func:`squared_norm`: accumulates in fp32 like the kernel.

    ``dot(x, x)``, not ``vector_norm(x).square()``: on CPU the dot is both faster and about a hundred times closer
    to the float64 value (the norm's square root and square round twice).
    """
    x = x.float()
    return torch.dot(x, x) if x.numel() else torch.zeros((), dtype=torch.float32, device=x.device)


def squared_norm(x: torch.Tensor) -> torch.Tensor:
    """Sum of squares of a 1-D contiguous float buffer, as an fp32 0-dim tensor on its device.

    Args:
        x: A 1-D contiguous floating-point tensor.

    Returns:
        ``sum(x * x)`` accumulated in fp32, a 0-dim tensor (0 for an empty buffer; non-finite if ``x`` holds a
        NaN or Inf).

    Raises:
        TypeError: When ``x`` is not a tensor or not floating point.
        ValueError: When ``x`` is not 1-D and contiguous.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"squared_norm takes a tensor, got {type(x).__name__}")
    if x.dim() != 1 or not x.is_contiguous():
        raise ValueError(f"squared_norm takes a 1-D contiguous buffer, got shape {tuple(x.shape)}; flatten it first")
    if not x.is_floating_point():
        raise TypeError(f"squared_norm takes a float buffer, got {x.dtype}")
    return (squared_norm_triton if use_triton(x) else squared_norm_reference)(x)


class SquaredNorm:
    """:func:`squared_norm` planned for buffers of up to ``numel`` elements, written into ``out``: the Triton path is
    one launch whose partial sums and ticket counter live here (so calls on one plan must not run concurrently on
    two streams), and the torch reference's dot goes into ``out`` too, so a call allocates nothing (a ZeRO step's
    norm, every step). The buffer comes with each call and is not checked (the caller passes its own fixed
    gradient buffer).

    Args:
        numel: The most elements a call's buffer holds.
        out: One float32 or float64 element, written by every call (the squared norm, accumulated in fp32 per
            block of :data:`BLOCK` elements and summed in ``out``'s dtype).

    Raises:
        ValueError: When ``numel`` is negative or ``out`` is not one float32 or float64 element.
    """

    def __init__(self, numel: int, out: torch.Tensor):
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"SquaredNorm: numel={numel!r} must be an int >= 0")
        if not isinstance(out, torch.Tensor) or out.numel() != 1 or out.dtype not in (torch.float32, torch.float64):
            got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"SquaredNorm writes one float32 or float64 element, got out {got}")
        self.numel, self.out = numel, out.view(())
        self._partials = torch.empty(-(-numel // BLOCK), dtype=torch.float32, device=out.device)
        self._ticket = torch.zeros(1, dtype=torch.int32, device=out.device)  # reset by the last program of each call
        self._dot = self.out if out.dtype == torch.float32 else torch.empty((), dtype=torch.float32, device=out.device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Write the squared norm of ``x`` (1-D, contiguous, at most ``numel`` elements, on ``out``'s device) into
        ``out`` and return ``out``."""
        n = x.numel()
        if n > self.numel:
            raise ValueError(f"SquaredNorm was planned for {self.numel} elements, got a buffer of {n}; plan it again")
        if n == 0:
            return self.out.zero_()
        if use_triton(x):
            return self._triton(x, n)
        if x.dtype == torch.float32:
            torch.dot(x, x, out=self._dot)
        else:  # the reference widens a 16-bit buffer first (a copy; the CPU path only)
            self._dot.copy_(squared_norm_reference(x))
        return self.out if self._dot is self.out else self.out.copy_(self._dot)

    def _triton(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """One launch: the partial sums of ``x``'s ``n`` (> 0) elements, and their sum into ``out``."""
        grid = (-(-n // BLOCK),)
        _squared_norm_kernel[grid](x, self._partials, self._ticket, self.out, n, BLOCK=BLOCK, FINAL=FINAL, num_warps=8)
        return self.out


# -- the step's scalars from the global squared norm ---------------------------------------------------------------

CLIP_EPS = 1e-6
"""Added to the norm before dividing (torch.nn.utils.clip_grad_norm_'s constant)."""


@functools.lru_cache(maxsize=64)
def split_f64(x: float) -> tuple[float, float]:
    """``x`` as two fp32 numbers whose fp64 sum is ``x`` to 48 bits: a Triton launch passes Python floats as fp32,
    so a float64 constant (the clipping threshold) travels in two parts and :func:`global_norm_scalars` adds them
    back in fp64. Beyond fp32's range the high part is fp32's largest finite value (the low part 0). Cached: a
    training run clips by one threshold, and the step's host time counts."""
    hi = _F32.unpack(_F32.pack(x))[0]  # rounded to nearest (C's double -> float); beyond fp32's range: Inf
    if not math.isfinite(hi):
        return math.copysign(_F32_MAX, x), 0.0
    return hi, _F32.unpack(_F32.pack(x - hi))[0]


_F32 = struct.Struct("f")
_F32_MAX = _F32.unpack(bytes.fromhex("ffff7f7f"))[0]


@triton.jit
def global_norm_scalars(total_ptr, max_norm_hi, max_norm_lo, HAS_CLIP: tl.constexpr, EPS: tl.constexpr):
    """From the global squared norm at ``total_ptr``: the norm (fp64), whether it is finite, and (``HAS_CLIP``) the
    clipping coefficient ``min(1, max_norm / (norm + EPS))`` in fp32, else 1.0 (``EPS`` is :data:`CLIP_EPS`). What
    :func:`clip_scalars` writes and what a fused step reads in place of its flags, so both decide alike."""
    norm = tl.sqrt(tl.load(total_ptr).to(tl.float64))
    finite = norm - norm == 0  # NaN and Inf give NaN here
    clip = 1.0
    if HAS_CLIP:
        max_norm = tl.cast(max_norm_hi, tl.float64) + tl.cast(max_norm_lo, tl.float64)
        clip = tl.minimum(max_norm / (norm + EPS), 1.0).to(tl.float32)
    return norm, finite, clip


@triton.jit
def _clip_scalars_kernel(
    total_ptr, norm_ptr, flags_ptr, max_norm_hi, max_norm_lo, HAS_CLIP: tl.constexpr, EPS: tl.constexpr
):
    norm, finite, clip = global_norm_scalars(total_ptr, max_norm_hi, max_norm_lo, HAS_CLIP, EPS)
    tl.store(norm_ptr, norm)
    tl.store(flags_ptr, tl.where(finite, 0.0, 1.0).to(tl.float32))
    if HAS_CLIP:
        tl.store(flags_ptr + 1, clip)


def clip_scalars_triton(total: torch.Tensor, norm: torch.Tensor, flags: torch.Tensor, max_norm: float | None) -> None:
    """Triton launcher of :func:`clip_scalars`."""
    hi, lo = split_f64(max_norm or 0.0)
    _clip_scalars_kernel[(1,)](total, norm, flags, hi, lo, HAS_CLIP=max_norm is not None, EPS=CLIP_EPS, num_warps=1)


def clip_scalars_reference(
    total: torch.Tensor, norm: torch.Tensor, flags: torch.Tensor, max_norm: float | None
) -> None:
    """torch reference of :func:`clip_scalars` (float64 arithmetic, as torch.nn.utils.clip_grad_norm_ in float64)."""
    torch.sqrt(total.reshape(1).double(), out=norm.view(1))
    flags[0] = (~torch.isfinite(norm.view(1))).float()[0]
    if max_norm is not None:
        flags[1] = (max_norm / (norm.view(1) + CLIP_EPS)).clamp_(max=1.0).float()[0]


def clip_scalars(total: torch.Tensor, norm: torch.Tensor, flags: torch.Tensor, max_norm: float | None = None) -> None:
    """The step's scalars from the global squared gradient norm, in one launch and with no host sync: ``norm`` gets
    its square root (float64), ``flags[0]`` 1.0 if that is not finite (every rank then skips the step) else 0.0, and
    with ``max_norm`` ``flags[1]`` the clipping coefficient ``min(1, max_norm / (norm + 1e-6))`` (float32), as
    torch.nn.utils.clip_grad_norm_ computes it. What a ZeRO step ran as six small ops.

    Args:
        total: The squared norm, one element (float32 or float64).
        norm: One float64 element, written.
        flags: Two float32 elements (one without ``max_norm``), written; ``flags[0:1]`` and ``flags[1:2]`` are what
            the fused steps take as ``found_inf`` and ``grad_scale_tensor``.
        max_norm: The clipping threshold (> 0), or None: no clipping coefficient.

    Raises:
        ValueError: When a buffer has the wrong size, dtype or device, or ``max_norm`` is not positive.
    """
    if total.numel() != 1 or norm.numel() != 1 or norm.dtype != torch.float64:
        raise ValueError(
            f"clip_scalars takes a 1-element total and a 1-element float64 norm, got {tuple(total.shape)} and "
            f"{tuple(norm.shape)} {norm.dtype}"
        )
    if flags.dtype != torch.float32 or flags.numel() < (2 if max_norm is not None else 1):
        raise ValueError(
            f"clip_scalars: flags must be float32 with room for 2 values, got {flags.numel()} {flags.dtype}"
        )
    if len({total.device, norm.device, flags.device}) != 1:
        raise ValueError(f"clip_scalars: total, norm and flags on {total.device}, {norm.device}, {flags.device}")
    if max_norm is not None and not max_norm > 0:
        raise ValueError(f"max_norm={max_norm!r} must be > 0")
    (clip_scalars_triton if use_triton(norm) else clip_scalars_reference)(total, norm, flags, max_norm)
