"""Top-k gradient sparsification with error feedback.

``acc = grad + residual``; the ``k`` entries of largest ``|acc|`` are sent as ``(values, indices)`` with the
indices ascending (deterministic, and friendly to a later scatter-add); ``residual`` becomes ``acc`` with those
entries removed, in place, so what is not sent now is sent later. Invariant, exact in fp32:
``zeros(n).index_put_(indices, values) + new_residual == grad + old_residual``.

Two modes pick the same set (up to ties between equal magnitudes):

- ``"exact"``: one pass writes ``acc`` into the residual, ``torch.topk`` runs over all ``n`` magnitudes.
- ``"threshold"``: a random sample of ``acc`` estimates a magnitude threshold that about ``1.1 k`` entries pass;
  one pass computes ``acc``, compacts the entries at or above the threshold into a small candidate buffer
  and removes them from the residual; ``torch.topk`` then runs over the candidates only and the ones not
  kept go back into the residual. Every entry outside the buffer is below the threshold, hence below every
  candidate, so the result is the exact top-k. If fewer than ``k`` entries passed, or more than the buffer
  holds, the candidates are put back and the exact mode finishes the job: rare, and never loses anything.

Host syncs: none in ``"exact"`` mode. ``"threshold"`` mode makes one per call, reading the candidate count:
``torch.topk`` over the candidates needs their number on the host (a shape), and so does the overflow check.
The threshold itself stays on the device (the compaction kernel reads it from memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._triton import cast_rne, tl, triton
from .dispatch import use_triton
from .quantize import FLOAT_DTYPES, check_vector

__all__ = [
    "TopKResult",
    "topk_compress",
    "topk_compress_reference",
    "topk_compress_triton",
    "topk_recall",
]

MODES = ("exact", "threshold")
INDEX_DTYPES = (torch.int64, torch.int32)
# Elementwise passes: 1024 elements (4 warps x 8 per thread) per program. Not tuned on a GPU yet.
_BLOCK = 1024
# Threshold estimate. The sample is drawn with replacement; m0 = s * k / n of its entries are expected above
# the true k-th magnitude. Its size s: at least 4096 draws and 256 n / k (m0 >= 256, a 6% spread, unless
# capped), at most 2**16 (a gather and a kthvalue of 65536 fp32 are small next to a pass over a bucket).
_MIN_SAMPLE = 4096
_MAX_SAMPLE = 1 << 16
_SAMPLE_PER_K = 256


@dataclass(frozen=True)
class TopKResult:
    """What :func:`topk_compress` selected."""

    values: torch.Tensor
    """``acc`` at ``indices``, in the gradient's dtype."""
    indices: torch.Tensor
    """Positions of the selected entries, ascending (int64 unless ``index_dtype`` says otherwise)."""
    threshold: torch.Tensor | None
    """Magnitude threshold used in ``"threshold"`` mode (a 1-element float32 tensor on the gradient's device); None
    in ``"exact"`` mode or when nothing was selected."""
    candidates: int
    """How many entries passed the threshold (``"threshold"`` mode), else ``k``."""


# ------------------------------------------------------------------------------------------------ kernels


@triton.jit
def _accumulate_kernel(grad_ptr, residual_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    acc += tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(residual_ptr + offs, cast_rne(acc, residual_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _threshold_compact_kernel(
    grad_ptr,
    residual_ptr,
    cand_values_ptr,
    cand_indices_ptr,
    counter_ptr,
    n,
    threshold_ptr,
    capacity,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    threshold = tl.load(threshold_ptr)  # on the device: the estimate never goes through the host
    grad = tl.load(grad_ptr + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # acc is rounded to the residual's dtype first: candidates and residual then hold the same numbers.
        residual = tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        acc = cast_rne(grad.to(tl.float32) + residual, residual_ptr.dtype.element_ty)
    else:
        acc = grad
    magnitude = tl.abs(acc.to(tl.float32))
    # Zeros never pass, even at threshold 0 (a mostly-zero gradient): they would only crowd the buffer.
    hit = (mask & (magnitude >= threshold) & (magnitude > 0.0)).to(tl.int32)
    # One atomic per program reserves a contiguous range; the prefix sum places each hit inside it.
    start = tl.atomic_add(counter_ptr, tl.sum(hit, axis=0).to(tl.int64))
    slot = start + tl.cumsum(hit, axis=0) - hit
    taken = (hit != 0) & (slot < capacity)
    tl.store(cand_values_ptr + slot, acc, mask=taken)
    tl.store(cand_indices_ptr + slot, offs, mask=taken)
    if HAS_RESIDUAL:
        # Hits that did not fit stay in the residual, so an overflow loses nothing.
        tl.store(residual_ptr + offs, tl.where(taken, 0.0, acc), mask=mask)


@triton.jit
def _take_kernel(acc_ptr, indices_ptr, values_ptr, k, WRITE_BACK: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < k
    idx = tl.load(indices_ptr + offs, mask=mask, other=0)
    acc = tl.load(acc_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    value = cast_rne(acc, values_ptr.dtype.element_ty)
    tl.store(values_ptr + offs, value, mask=mask)
    if WRITE_BACK:
        # Zero when values and residual share a dtype; otherwise the rounding of the cast stays behind.
        tl.store(acc_ptr + idx, cast_rne(acc - value.to(tl.float32), acc_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- the three passes, both ways
# Each pass has a Triton launcher and a torch twin; the selection logic around them is shared.


def _grid(n: int) -> tuple[int]:
    return (-(-n // _BLOCK),)


def _accumulate_triton(grad: torch.Tensor, residual: torch.Tensor) -> None:
    _accumulate_kernel[_grid(grad.numel())](grad, residual, grad.numel(), BLOCK=_BLOCK)


def _accumulate_reference(grad: torch.Tensor, residual: torch.Tensor) -> None:
    residual.copy_(grad.float() + residual.float())


def _compact_triton(
    grad: torch.Tensor, residual: torch.Tensor | None, threshold: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    acc_dtype = grad.dtype if residual is None else residual.dtype
    values = torch.empty(capacity, dtype=acc_dtype, device=grad.device)
    indices = torch.empty(capacity, dtype=torch.int64, device=grad.device)
    counter = torch.zeros(1, dtype=torch.int64, device=grad.device)
    _threshold_compact_kernel[_grid(grad.numel())](
        grad,
        grad if residual is None else residual,  # never read when HAS_RESIDUAL is False
        values,
        indices,
        counter,
        grad.numel(),
        threshold,
        capacity,
        HAS_RESIDUAL=residual is not None,
        BLOCK=_BLOCK,
    )
    count = int(counter.item())  # the one host sync: torch.topk needs the candidate count
    taken = min(count, capacity)
    return values[:taken], indices[:taken], count


def _compact_reference(
    grad: torch.Tensor, residual: torch.Tensor | None, threshold: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    if residual is None:
        acc = grad
    else:
        _accumulate_reference(grad, residual)
        acc = residual
    magnitude = acc.float().abs()
    hits = ((magnitude >= threshold) & (magnitude > 0)).nonzero().squeeze(1)
    taken = hits[:capacity]
    values = acc[taken]
    if residual is not None:
        residual[taken] = 0
    return values, taken, hits.numel()


def _take_triton(acc: torch.Tensor, indices: torch.Tensor, values_dtype: torch.dtype, write_back: bool) -> torch.Tensor:
    values = torch.empty(indices.numel(), dtype=values_dtype, device=acc.device)
    if indices.numel():
        _take_kernel[_grid(indices.numel())](acc, indices, values, indices.numel(), WRITE_BACK=write_back, BLOCK=_BLOCK)
    return values


def _take_reference(
    acc: torch.Tensor, indices: torch.Tensor, values_dtype: torch.dtype, write_back: bool
) -> torch.Tensor:
    taken = acc[indices]
    values = taken.to(values_dtype)
    if write_back:
        acc[indices] = (taken.float() - values.float()).to(acc.dtype)
    return values


_TRITON_PASSES = (_accumulate_triton, _compact_triton, _take_triton)
_REFERENCE_PASSES = (_accumulate_reference, _compact_reference, _take_reference)


# ------------------------------------------------------------------------------------------- selection


def _estimate_threshold(
    grad: torch.Tensor, residual: torch.Tensor | None, k: int, generator: torch.Generator | None
) -> tuple[torch.Tensor, int]:
    """A magnitude that about ``1.1 k`` entries of ``acc`` reach (a 1-element tensor on the device: no host sync),
    and a candidate capacity that fits them.

    From the sample's r-th largest magnitude, with r = 1.1 m0 + 3 sqrt(m0) + 1: the number of entries at or
    above it is about ``r n / s`` with a relative spread of ``1 / sqrt(r)``, so it falls below k only
    ~3 standard deviations out, and the capacity, ``(r + 4 sqrt(r)) n / s + 256``, overflows ~4 out.
    """
    n = grad.numel()
    size = min(n, max(_MIN_SAMPLE, min(_MAX_SAMPLE, _SAMPLE_PER_K * n // k)))
    if size == n:  # small tensors: use every entry, and the threshold is exact
        positions = slice(None)
    else:
        positions = torch.randint(n, (size,), generator=generator, device=grad.device)
    sample = grad[positions].float()
    if residual is not None:
        sample = sample + residual[positions].float()
    expected = size * k / n
    rank = min(size, math.ceil(1.1 * expected + 3 * math.sqrt(expected)) + 1)
    threshold = torch.kthvalue(sample.abs(), size - rank + 1).values.reshape(1)
    capacity = min(n, math.ceil((rank + 4 * math.sqrt(rank)) * n / size) + 256)
    return threshold, capacity


def _topk_compress(
    grad: torch.Tensor,
    residual: torch.Tensor | None,
    k: int,
    mode: str,
    generator: torch.Generator | None,
    index_dtype: torch.dtype,
    passes: tuple,
) -> TopKResult:
    accumulate, compact, take = passes
    n = grad.numel()
    acc = grad if residual is None else residual  # after the first pass, acc lives in the residual
    threshold, count = None, k
    if mode == "threshold" and 0 < k < n:
        threshold, capacity = _estimate_threshold(grad, residual, k, generator)
        cand_values, cand_indices, count = compact(grad, residual, threshold, capacity)
        if residual is not None:  # every candidate goes back; `take` removes the k kept ones again
            residual[cand_indices] = cand_values
        if k <= count <= capacity:
            keep = torch.topk(cand_values.abs(), k, sorted=False).indices
            selected = cand_indices[keep]
        else:  # too few passed, or the buffer overflowed: residual == acc again, select exactly
            selected = torch.topk(acc.abs(), k, sorted=False).indices
    else:
        if residual is not None and n:
            accumulate(grad, residual)
        selected = torch.topk(acc.abs(), k, sorted=False).indices
    indices = selected.sort().values
    values = take(acc, indices, grad.dtype, residual is not None)
    return TopKResult(values, indices.to(index_dtype), threshold, count)


def topk_compress_triton(
    grad: torch.Tensor,
    residual: torch.Tensor | None,
    k: int,
    mode: str = "exact",
    *,
    generator: torch.Generator | None = None,
    index_dtype: torch.dtype = torch.int64,
) -> TopKResult:
    """Top-k with the elementwise passes as Triton kernels; the selection itself is ``torch.topk``."""
    return _topk_compress(grad, residual, k, mode, generator, index_dtype, _TRITON_PASSES)


def topk_compress_reference(
    grad: torch.Tensor,
    residual: torch.Tensor | None,
    k: int,
    mode: str = "exact",
    *,
    generator: torch.Generator | None = None,
    index_dtype: torch.dtype = torch.int64,
) -> TopKResult:
    """Torch version of :func:`topk_compress_triton`; the same generator state gives the same result."""
    return _topk_compress(grad, residual, k, mode, generator, index_dtype, _REFERENCE_PASSES)


def topk_compress(
    grad: torch.Tensor,
    residual: torch.Tensor | None,
    k: int,
    mode: str = "exact",
    *,
    generator: torch.Generator | None = None,
    index_dtype: torch.dtype = torch.int64,
) -> TopKResult:
    """Select the ``k`` largest-magnitude entries of ``grad + residual``; ``residual`` keeps the rest, in place.

    ``residual=None`` means no error feedback (``acc = grad``, nothing is written). ``mode="threshold"`` is the
    fast path (see the module docstring); ``generator`` drives its sampling. Values come back in
    ``grad.dtype``; if ``residual`` is wider, the rounding of that cast stays in the residual.

    Args:
        grad: The 1-D contiguous float32, bfloat16 or float16 values.
        residual: Error feedback, ``grad``'s size and device (float32, bfloat16 or float16); None: none.
        k: How many entries to select, ``0..grad.numel()``.
        mode: ``"exact"`` or ``"threshold"``.
        generator: A ``torch.Generator`` on ``grad``'s device type for the threshold's sampling; None: torch's
            default generator.
        index_dtype: ``torch.int64`` or ``torch.int32`` (enough for fewer than ``2**31`` elements).

    Returns:
        The selected values and their ascending indices, with the threshold used and the candidate count.

    Raises:
        TypeError: When ``grad`` or ``residual`` is not a tensor or not float32, bfloat16 or float16, ``k`` is not
            an int, or ``generator`` is not a ``torch.Generator``.
        ValueError: When ``grad`` or ``residual`` is not 1-D and contiguous, ``residual`` differs from ``grad`` in
            size or device, ``k`` is out of range, ``mode`` is unknown, ``generator`` is on another device type,
            or ``index_dtype`` is not int64 or int32 or is int32 for too many elements.
    """
    check_vector("grad", grad, FLOAT_DTYPES)
    n = grad.numel()
    if residual is not None:
        check_vector("residual", residual, FLOAT_DTYPES, numel=n, device=grad.device)
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if not 0 <= k <= n:
        raise ValueError(f"k={k} must be between 0 and grad.numel()={n}")
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {', '.join(map(repr, MODES))}")
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        if generator.device.type != grad.device.type:
            raise ValueError(
                f"generator is on {generator.device} but grad is on {grad.device}; "
                f"pass torch.Generator(device={str(grad.device)!r})"
            )
    if index_dtype not in INDEX_DTYPES:
        raise ValueError(f"index_dtype={index_dtype} must be torch.int64 or torch.int32")
    if index_dtype == torch.int32 and n > torch.iinfo(torch.int32).max:
        raise ValueError(f"index_dtype=torch.int32 cannot index {n} elements; use torch.int64")
    impl = topk_compress_triton if use_triton(grad if residual is None else residual) else topk_compress_reference
    return impl(grad, residual, k, mode, generator=generator, index_dtype=index_dtype)


def topk_recall(acc: torch.Tensor, indices: torch.Tensor, k: int) -> float:
    """Fraction of the true top-k of ``|acc|`` that ``indices`` holds.

    An index counts when its magnitude reaches the true k-th largest, so a different pick among tied
    magnitudes does not lower the recall. ``k = 0`` gives 1.0.

    Args:
        acc: The values the selection was made from.
        indices: The selected positions.
        k: The number of entries selected.

    Returns:
        The recall, in [0, 1].
    """
    if k == 0:
        return 1.0
    magnitude = acc.float().abs()
    kth = torch.topk(magnitude, k).values[-1]
    hits = int((magnitude[indices.long().unique()] >= kth).sum())
    return min(hits, k) / k
