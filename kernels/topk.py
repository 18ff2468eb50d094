"""Top-k gradient sparsification with error feedback, selected on the device with no host sync.

``acc = grad + residual``; the ``k`` entries of largest ``|acc|`` are sent as ``(values, indices)`` with the
indices ascending (deterministic, and friendly to a later scatter-add); ``residual`` becomes ``acc`` with those
entries removed, in place, so what is not sent now is sent later. Invariant, exact in fp32:
``zeros(n).index_put_(indices, values) + new_residual == grad + old_residual``.

The selection is a radix select over the magnitudes' bit patterns (a non-negative float orders as its bits, and a
NaN above Inf, as ``torch.topk`` puts it), 8-bit digits from the top, each histogram pass followed by a
one-program kernel that picks the bin holding the k-th largest key and keeps the prefix and the remaining count on
the device:

1. a histogram of the exponents (bits 30..23) over every entry (with error feedback, ``acc`` is formed here);
2. a filter pass copies the entries in the chosen exponent bin (the candidates: about 5% of a Gaussian gradient at
   k = 1%) to a scratch buffer of ``n / 8``; the later digits are histogrammed over the candidates only (when
   more than ``n / 8`` match, say for uniform data, they are histogrammed over every entry instead, same result);
3. a count pass, a scan of the per-program counts, and one compaction pass write exactly ``k`` entries in index
   order.

Every shape is known on the host before anything runs (``k``, and the scratch's size), so nothing is read back:
no host sync in either mode, and the output stays valid for the collectives that follow. Passes over the whole
gradient: four (histogram, filter, count, compaction), whatever the mode. 8-bit digits because Triton 3.6 builds
``tl.histogram`` from warp ballots, at a cost that grows with bins / 32 per element: 4096 bins made the earlier
11-bit select 10x slower than ``torch.topk`` on an H200 (2026-11-28).

- ``"exact"``: all 31 bits of the magnitude (four digits): the true top-k. Ties at the k-th magnitude go to the
  lowest indices.
- ``"threshold"``: the top 24 bits (three digits; exponent and 16 mantissa bits): magnitudes are compared to
  2^-16 relative, so an entry within that of the k-th magnitude may stand in for one just above it (ties, lowest
  indices first). One histogram pass over the candidates fewer; the passes over every entry are the same.

The torch twin (the CPU path, and the oracle) selects the same keys with ``torch.topk`` over the integer keys and
places them with cumulative sums and a scatter, also without a host sync, so both paths pick the same entries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._triton import cast_rne, tl, triton
from .dispatch import implementation, use_triton
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
# Elementwise work: 1024 elements (4 warps x 8 per thread) per block, 16 blocks per program.
_BLOCK = 1024
_ITERS = 16
_CHUNK = _BLOCK * _ITERS
_DIGIT = 8
_BINS = 1 << _DIGIT
# (shift, width) of each radix pass: bits 30..23 (the exponent; sign cleared), 22..15, 14..7, 6..0.
_PASSES = {"exact": ((23, 8), (15, 8), (7, 8), (0, 7)), "threshold": ((23, 8), (15, 8), (7, 8))}
# The candidates' scratch: an eighth of the gradient (no fewer than 64K entries, or all of a smaller one).
_CANDIDATE_SHARE = 8
_MIN_CANDIDATES = 1 << 16


@dataclass(frozen=True)
class TopKResult:
    """What :func:`topk_compress` selected."""

    values: torch.Tensor
    """``acc`` at ``indices``, in the gradient's dtype."""
    indices: torch.Tensor
    """Positions of the selected entries, ascending (int64 unless ``index_dtype`` says otherwise)."""
    threshold: torch.Tensor | None
    """The k-th largest magnitude as the selection saw it (exact; in ``"threshold"`` mode rounded down to 16
    mantissa bits), a 1-element float32 tensor on the gradient's device; None when nothing was selected."""


# ------------------------------------------------------------------------------------------------ kernels


@triton.jit
def _magnitude_key(acc):
    """The sort key of ``|acc|``: its fp32 bit pattern with the sign cleared (an int32 >= 0; NaN above Inf)."""
    return acc.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _radix_histogram_kernel(
    grad_ptr, acc_ptr, cand_ptr, state_ptr, hist_ptr, n, cap, SHIFT: tl.constexpr, WIDTH: tl.constexpr,
    FIRST: tl.constexpr, FUSE_ADD: tl.constexpr, BINS: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
):  # fmt: skip
    """Add the histogram of digit ``bits[SHIFT : SHIFT + WIDTH]`` of the keys whose higher bits match the prefix so
    far (``state[0]``) into ``hist``. ``FIRST``: over every entry of ``acc``, formed first as ``grad + acc`` with
    ``FUSE_ADD`` (rounded to ``acc``'s dtype and stored); otherwise over the ``state[2]`` candidates in ``cand``,
    or over every entry again when more matched than the scratch holds (``cap``)."""
    if FIRST:
        prefix = tl.zeros([], dtype=tl.int32)
        limit = n
    else:
        prefix = tl.load(state_ptr).to(tl.int32)
        count = tl.load(state_ptr + 2)
        from_cand = count <= cap
        limit = tl.where(from_cand, count, n)
        in_cand = tl.where(from_cand, count, 0)  # the entries to read from cand, and from acc
        in_acc = tl.where(from_cand, 0, n)
    local = tl.zeros([BINS], dtype=tl.int32)
    start = tl.program_id(0).to(tl.int64) * ITERS * BLOCK
    if start < limit:  # programs past the candidates have nothing to count
        for i in range(ITERS):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            mask = offs < limit
            if FIRST:
                acc = tl.load(acc_ptr + offs, mask=mask, other=0.0)
                if FUSE_ADD:
                    acc = cast_rne(tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32) + acc.to(tl.float32),
                                   acc_ptr.dtype.element_ty)  # fmt: skip
                    tl.store(acc_ptr + offs, acc, mask=mask)
            else:
                acc = tl.where(
                    from_cand,
                    tl.load(cand_ptr + offs, mask=offs < in_cand, other=0.0),
                    tl.load(acc_ptr + offs, mask=offs < in_acc, other=0.0),
                )
            key = _magnitude_key(acc)
            match = mask & ((key >> (SHIFT + WIDTH)) == (prefix >> (SHIFT + WIDTH)))
            local += tl.histogram((key >> SHIFT) & ((1 << WIDTH) - 1), BINS, mask=match)
        tl.atomic_add(hist_ptr + tl.arange(0, BINS), local.to(tl.int64), sem="relaxed")


@triton.jit
def _radix_filter_kernel(acc_ptr, cand_ptr, state_ptr, n, cap, SHIFT: tl.constexpr, BLOCK: tl.constexpr,
                         ITERS: tl.constexpr):  # fmt: skip
    """Copy the entries whose key matches the prefix from bit ``SHIFT`` up (the first pass's bin) to ``cand``, in
    any order (the histograms that read them only count), at most ``cap`` of them; ``state[2]`` counts every match,
    so a count past ``cap`` tells the later passes to read ``acc`` instead. One atomic per program: a first loop
    counts, a second (its reads from L2) writes."""
    prefix = tl.load(state_ptr).to(tl.int32) >> SHIFT
    start = tl.program_id(0).to(tl.int64) * ITERS * BLOCK
    total = tl.zeros([], dtype=tl.int32)
    for i in range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        key = _magnitude_key(tl.load(acc_ptr + offs, mask=mask, other=0.0))
        total += tl.sum((mask & ((key >> SHIFT) == prefix)).to(tl.int32), axis=0)
    slot = tl.atomic_add(state_ptr + 2, total.to(tl.int64), sem="relaxed")
    for i in range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        acc = tl.load(acc_ptr + offs, mask=mask, other=0.0)
        match = (mask & ((_magnitude_key(acc) >> SHIFT) == prefix)).to(tl.int32)
        at = slot + (tl.cumsum(match, axis=0) - match)
        tl.store(cand_ptr + at, acc, mask=(match != 0) & (at < cap))
        slot += tl.sum(match, axis=0)


@triton.jit
def _radix_select_kernel(hist_ptr, state_ptr, k, SHIFT: tl.constexpr, FIRST: tl.constexpr, BINS: tl.constexpr):
    """One program: the bin of the digit histogram that holds the k-th largest remaining key; its digit joins the
    prefix (``state[0]``), the keys in higher bins leave the count still wanted (``state[1]``), and the histogram
    is cleared for the next pass."""
    bins = tl.arange(0, BINS)
    counts = tl.load(hist_ptr + bins)
    above = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0)  # keys in strictly higher bins
    if FIRST:
        prefix, wanted = tl.zeros([], dtype=tl.int64), k
    else:
        prefix, wanted = tl.load(state_ptr), tl.load(state_ptr + 1)
    holds = (above < wanted) & (above + counts >= wanted)  # exactly one bin (1 <= wanted <= keys matching)
    digit = tl.max(tl.where(holds, bins, -1), axis=0)
    tl.store(state_ptr, prefix | (digit.to(tl.int64) << SHIFT))
    tl.store(state_ptr + 1, wanted - tl.sum(tl.where(bins == digit, above, 0), axis=0))
    tl.store(hist_ptr + bins, tl.zeros([BINS], dtype=tl.int64))


@triton.jit
def _radix_count_kernel(acc_ptr, state_ptr, counts_ptr, n, SHIFT: tl.constexpr, BLOCK: tl.constexpr,
                        ITERS: tl.constexpr):  # fmt: skip
    """Per program: how many keys are above the selected one and how many equal it (compared from bit SHIFT up)."""
    kth = tl.load(state_ptr).to(tl.int32) >> SHIFT
    above = tl.zeros([], dtype=tl.int32)
    equal = tl.zeros([], dtype=tl.int32)
    for i in range(ITERS):
        offs = (tl.program_id(0).to(tl.int64) * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        key = _magnitude_key(tl.load(acc_ptr + offs, mask=mask, other=0.0)) >> SHIFT
        above += tl.sum((mask & (key > kth)).to(tl.int32), axis=0)
        equal += tl.sum((mask & (key == kth)).to(tl.int32), axis=0)
    tl.store(counts_ptr + 2 * tl.program_id(0), above)
    tl.store(counts_ptr + 2 * tl.program_id(0) + 1, equal)


@triton.jit
def _scan_kernel(counts_ptr, before_ptr, programs, BLOCK: tl.constexpr):
    """One program: exclusive prefix sums over the programs of both counts (above, equal), in int64."""
    above = tl.zeros([], dtype=tl.int64)
    equal = tl.zeros([], dtype=tl.int64)
    for start in range(0, programs, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        mask = idx < programs
        a = tl.load(counts_ptr + 2 * idx, mask=mask, other=0).to(tl.int64)
        e = tl.load(counts_ptr + 2 * idx + 1, mask=mask, other=0).to(tl.int64)
        tl.store(before_ptr + 2 * idx, above + tl.cumsum(a, axis=0) - a, mask=mask)
        tl.store(before_ptr + 2 * idx + 1, equal + tl.cumsum(e, axis=0) - e, mask=mask)
        above += tl.sum(a, axis=0)
        equal += tl.sum(e, axis=0)


@triton.jit
def _radix_compact_kernel(
    acc_ptr, state_ptr, before_ptr, values_ptr, indices_ptr, n, SHIFT: tl.constexpr, WRITE_BACK: tl.constexpr,
    BLOCK: tl.constexpr, ITERS: tl.constexpr,
):  # fmt: skip
    """Write the selected entries at their places in the output (index order): every key above the selected one,
    and the first ``state[1]`` keys equal to it. With ``WRITE_BACK`` the residual keeps what the value's cast to
    its dtype rounded off (zero when they share a dtype)."""
    kth = tl.load(state_ptr).to(tl.int32) >> SHIFT
    wanted = tl.load(state_ptr + 1)
    above_run = tl.load(before_ptr + 2 * tl.program_id(0))
    equal_run = tl.load(before_ptr + 2 * tl.program_id(0) + 1)
    for i in range(ITERS):
        offs = (tl.program_id(0).to(tl.int64) * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        acc = tl.load(acc_ptr + offs, mask=mask, other=0.0)
        key = _magnitude_key(acc) >> SHIFT
        above = (mask & (key > kth)).to(tl.int32)
        equal = (mask & (key == kth)).to(tl.int32)
        # ranks inside the block in int32 (at most BLOCK), added to the program's int64 running counts
        equal_rank = equal_run + (tl.cumsum(equal, axis=0) - equal)
        taken = (above != 0) | ((equal != 0) & (equal_rank < wanted))
        slot = above_run + (tl.cumsum(above, axis=0) - above) + tl.minimum(equal_rank, wanted)
        value = cast_rne(acc.to(tl.float32), values_ptr.dtype.element_ty)
        tl.store(values_ptr + slot, value, mask=taken)
        tl.store(indices_ptr + slot, offs.to(indices_ptr.dtype.element_ty), mask=taken)
        if WRITE_BACK:
            left = acc.to(tl.float32) - value.to(tl.float32)
            tl.store(acc_ptr + offs, cast_rne(left, acc_ptr.dtype.element_ty), mask=taken)
        above_run += tl.sum(above, axis=0)
        equal_run += tl.sum(equal, axis=0)


# --------------------------------------------------------------------------------------------- both paths


def _outputs(acc: torch.Tensor, k: int, values_dtype: torch.dtype, index_dtype: torch.dtype):
    return (
        torch.empty(k, dtype=values_dtype, device=acc.device),
        torch.empty(k, dtype=index_dtype, device=acc.device),
    )


def _select_triton(grad, residual, k, mode, index_dtype) -> TopKResult:
    """The radix select's launches (``0 < k <= n``): the first digit's histogram and select, the candidates'
    filter, the later digits' histograms and selects, then count, scan and compact."""
    n = grad.numel()
    acc = grad if residual is None else residual
    programs = -(-n // _CHUNK)
    device = grad.device
    # the key's prefix so far, the count still wanted, the candidates that matched the first digit
    state = torch.zeros(3, dtype=torch.int64, device=device)
    hist = torch.zeros(_BINS, dtype=torch.int64, device=device)
    cap = n if n <= _MIN_CANDIDATES else max(_MIN_CANDIDATES, n // _CANDIDATE_SHARE)
    cand = torch.empty(cap, dtype=acc.dtype, device=device)
    passes = _PASSES[mode]
    for i, (shift, width) in enumerate(passes):
        _radix_histogram_kernel[(programs,)](
            grad, acc, cand, state, hist, n, cap, SHIFT=shift, WIDTH=width, FIRST=i == 0,
            FUSE_ADD=i == 0 and residual is not None, BINS=_BINS, BLOCK=_BLOCK, ITERS=_ITERS,
        )  # fmt: skip
        _radix_select_kernel[(1,)](hist, state, k, SHIFT=shift, FIRST=i == 0, BINS=_BINS, num_warps=4)
        if i == 0:
            _radix_filter_kernel[(programs,)](acc, cand, state, n, cap, SHIFT=shift, BLOCK=_BLOCK, ITERS=_ITERS)
    shift = passes[-1][0]
    counts = torch.empty(2 * programs, dtype=torch.int32, device=device)
    before = torch.empty(2 * programs, dtype=torch.int64, device=device)
    _radix_count_kernel[(programs,)](acc, state, counts, n, SHIFT=shift, BLOCK=_BLOCK, ITERS=_ITERS)
    _scan_kernel[(1,)](counts, before, programs, BLOCK=_BLOCK, num_warps=16)
    values, indices = _outputs(acc, k, grad.dtype, index_dtype)
    _radix_compact_kernel[(programs,)](
        acc, state, before, values, indices, n, SHIFT=shift, WRITE_BACK=residual is not None, BLOCK=_BLOCK,
        ITERS=_ITERS, num_warps=8,
    )  # fmt: skip
    return TopKResult(values, indices, _magnitude(state[:1], 0))  # the state's prefix holds the key's bits


def _keys(acc: torch.Tensor, shift: int) -> torch.Tensor:
    """The magnitude keys the kernels compare (int32 >= 0): fp32 bits of ``|acc|``, from bit ``shift`` up."""
    return (acc.float().abs().view(torch.int32) & 0x7FFFFFFF) >> shift


def _magnitude(key: torch.Tensor, shift: int) -> torch.Tensor:
    """The float32 magnitude whose key (from bit ``shift`` up) is ``key``, the bits below ``shift`` zero."""
    return (key << shift).to(torch.int32).view(torch.float32)


def _ranked(keys: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Keys that order as the kernels select, as int64: the key, then the lower position first (ties)."""
    ranked = keys.long() << 32
    return ranked.sub_(positions if positions is not None else torch.arange(keys.numel(), device=keys.device))


def _key_of(ranked: torch.Tensor) -> torch.Tensor:
    """The key back from a :func:`_ranked` value (its position subtracted from the low 32 bits)."""
    return (ranked + 0xFFFFFFFF) >> 32


def _finish(grad, residual, acc, indices, kth, shift, index_dtype) -> TopKResult:
    """Values at the (ascending) ``indices``, the residual's write-back, the threshold."""
    taken = acc[indices]
    values = taken.to(grad.dtype)
    if residual is not None:
        residual[indices] = (taken.float() - values.float()).to(residual.dtype)
    return TopKResult(values, indices.to(index_dtype), _magnitude(kth.reshape(1), shift))


def _fold(grad: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """``acc = grad + residual``, into the residual (rounded to its dtype); ``grad`` itself without one."""
    if residual is None:
        return grad
    if residual.dtype == torch.float32:  # one fp32 add, rounded once, in place
        return residual.add_(grad)
    residual.copy_(grad.float() + residual.float())
    return residual


def _select_reference(grad, residual, k, mode, index_dtype) -> TopKResult:
    """The same selection in torch ops, with no host sync: ``torch.topk`` over keys ranked as the kernels rank them
    (magnitude bits, then the lower index), the k positions sorted."""
    acc, shift = _fold(grad, residual), _PASSES[mode][-1][0]
    return _ranked_top(grad, residual, acc, _keys(acc, shift), k, shift, index_dtype)


def _ranked_top(grad, residual, acc, keys, k, shift, index_dtype, positions=None) -> TopKResult:
    """The top-k of ``keys`` (of ``acc`` at ``positions``, or all of it) ranked as the kernels rank them."""
    best = torch.topk(_ranked(keys, positions), k, sorted=False)
    indices = (best.indices if positions is None else positions[best.indices]).sort().values
    return _finish(grad, residual, acc, indices, _key_of(best.values.min()), shift, index_dtype)


# The CPU path's sample (threshold mode): at least 4096 draws and 256 n / k (so about 256 of them above the k-th key,
# a 6% spread), at most 2**16.
_MIN_SAMPLE = 4096
_MAX_SAMPLE = 1 << 16
_SAMPLE_PER_K = 256


def _select_cpu(grad, residual, k, mode, index_dtype) -> TopKResult:
    """The CPU's path: as :func:`_select_reference` (the same entries), with host reads where they cost nothing:
    ``"exact"`` by :func:`_exact_cpu`; ``"threshold"`` over candidates only: a sample's high quantile bounds the k-th
    key from below, the entries at or above it are found with ``nonzero``, and the ranked top-k is taken among them
    (every entry left out is below every candidate). Too few candidates, or more than the buffer bound: all entries
    ranked. 4.2M elements, k = 1%, one thread: see docs/results.md."""
    n = grad.numel()
    if mode == "exact":
        return _exact_cpu(grad, residual, k, index_dtype)
    if n < 4 * _MIN_SAMPLE:
        return _select_reference(grad, residual, k, mode, index_dtype)
    acc, shift = _fold(grad, residual), _PASSES[mode][-1][0]
    size = max(_MIN_SAMPLE, min(_MAX_SAMPLE, _SAMPLE_PER_K * n // k))
    sample = acc[torch.randint(n, (size,), generator=torch.Generator().manual_seed(n), device=acc.device)]
    expected = size * k / n
    rank = min(size, math.ceil(1.1 * expected + 3 * math.sqrt(expected)) + 1)
    bound = torch.kthvalue(_keys(sample, shift), size - rank + 1).values
    # key >= bound, compared as floats (the bound's bits, low bits zero): one pass, and NaN (above every key) passes
    below = acc.abs() < _magnitude(bound, shift)
    positions = below.logical_not_().nonzero().squeeze(1)
    if not k <= positions.numel() <= 8 * k + 4096:  # an unlucky sample, or ties: the full ranking
        return _ranked_top(grad, residual, acc, _keys(acc, shift), k, shift, index_dtype)
    return _ranked_top(grad, residual, acc, _keys(acc[positions], shift), k, shift, index_dtype, positions)


def _exact_cpu(grad, residual, k, index_dtype) -> TopKResult:
    """``"exact"`` on the CPU: ``torch.topk`` of ``k + 1`` over the float magnitudes (what the peer runs; ranking int64
    keys with the index costs ~40% more). When the smallest of them is strictly below the next, no tie at the k-th
    magnitude was split and the other ``k`` are the selection; otherwise (a tie, a NaN, ``k = n``) the ranked keys
    decide."""
    acc = _fold(grad, residual)
    if k < acc.numel():
        magnitude = acc.float().abs()
        best = torch.topk(magnitude, k + 1, sorted=False)
        low = torch.topk(best.values, 2, largest=False)  # ascending: the (k+1)-th magnitude, then the k-th
        if bool(low.values[0] < low.values[1]):
            kept = torch.ones(k + 1, dtype=torch.bool).index_fill_(0, low.indices[:1], False)
            indices = best.indices[kept].sort().values
            return _finish(grad, residual, acc, indices, low.values[1].view(torch.int32), 0, index_dtype)
    return _ranked_top(grad, residual, acc, _keys(acc, 0), k, 0, index_dtype)


def _topk_compress(grad, residual, k, mode, index_dtype, select) -> TopKResult:
    if k == 0:
        acc = _fold(grad, residual)
        values, indices = _outputs(acc, 0, grad.dtype, index_dtype)
        return TopKResult(values, indices, None)
    return select(grad, residual, k, mode, index_dtype)


def topk_compress_triton(
    grad: torch.Tensor,
    residual: torch.Tensor | None,
    k: int,
    mode: str = "exact",
    *,
    index_dtype: torch.dtype = torch.int64,
) -> TopKResult:
    """Top-k as the radix select's Triton kernels (inputs already validated)."""
    return _topk_compress(grad, residual, k, mode, index_dtype, _select_triton)


def topk_compress_reference(
    grad: torch.Tensor,
    residual: torch.Tensor | None,
    k: int,
    mode: str = "exact",
    *,
    index_dtype: torch.dtype = torch.int64,
) -> TopKResult:
    """Torch version of :func:`topk_compress_triton`: the same entries, in the same order."""
    return _topk_compress(grad, residual, k, mode, index_dtype, _select_reference)


def topk_compress(
    grad: torch.Tensor,
    residual: torch.Tensor | None,
    k: int,
    mode: str = "exact",
    *,
    index_dtype: torch.dtype = torch.int64,
) -> TopKResult:
    """Select the ``k`` largest-magnitude entries of ``grad + residual``; ``residual`` keeps the rest, in place.

    ``residual=None`` means no error feedback (``acc = grad``, nothing is written). ``mode="threshold"``
    compares magnitudes to 16 mantissa bits, one histogram of the candidates fewer (see the module docstring).
    Values come back in ``grad.dtype``; if ``residual`` is wider, the rounding of that cast stays in the residual.
    Nothing is read back to the host.

    Args:
        grad: The 1-D contiguous float32, bfloat16 or float16 values.
        residual: Error feedback, ``grad``'s size and device (float32, bfloat16 or float16); None: none.
        k: How many entries to select, ``0..grad.numel()``.
        mode: ``"exact"`` or ``"threshold"``.
        index_dtype: ``torch.int64`` or ``torch.int32`` (enough for fewer than ``2**31`` elements).

    Returns:
        The selected values and their ascending indices, with the k-th magnitude as the selection saw it.

    Raises:
        TypeError: When ``grad`` or ``residual`` is not a tensor or not float32, bfloat16 or float16, or ``k`` is
            not an int.
        ValueError: When ``grad`` or ``residual`` is not 1-D and contiguous, ``residual`` differs from ``grad`` in
            size or device, ``k`` is out of range, ``mode`` is unknown, or ``index_dtype`` is not int64 or int32
            or is int32 for too many elements.
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
    if index_dtype not in INDEX_DTYPES:
        raise ValueError(f"index_dtype={index_dtype} must be torch.int64 or torch.int32")
    if index_dtype == torch.int32 and n > torch.iinfo(torch.int32).max:
        raise ValueError(f"index_dtype=torch.int32 cannot index {n} elements; use torch.int64")
    if use_triton(grad if residual is None else residual):
        return topk_compress_triton(grad, residual, k, mode, index_dtype=index_dtype)
    # GPUDIST_KERNELS=torch: the reference (no host read, as on a GPU); otherwise on the CPU its faster path
    select = _select_cpu if grad.device.type == "cpu" and implementation() == "auto" else _select_reference
    return _topk_compress(grad, residual, k, mode, index_dtype, select)


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
