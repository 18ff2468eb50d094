"""Gradient compression kernels (top-k, int8, 1-bit): Triton kernels against their torch references.

The ``device`` fixture runs every test with ``GPUDIST_KERNELS=torch`` and ``=triton`` (Triton's interpreter on
CPU, compiled on CUDA), so the public functions are exercised both ways and the Triton results are compared
with the ``*_reference`` functions called directly on clones of the same inputs. Sizes mix the empty tensor,
a single element, a partial block, and odd sizes that leave a ragged last block; 1000003 runs on the torch
path and on CUDA only (the interpreter would take minutes).

Tolerances: top-k, int8 and every dequantization are bit-exact in fp32 and bf16 alike (fp32 math, FMA
contraction disabled, bf16 stores rounded to nearest-even as torch does). Only the 1-bit scale, a sum of up to
``block_size`` magnitudes, depends on the summation order (Triton sums a block as a tree, torch in its own
vectorized order): both implementations' scales and residuals are compared with float64 ones, within the bound of
an fp32 sum in any order (tests/tolerances.py; see :func:`_assert_1bit_near_float64`).
"""

from __future__ import annotations

import pytest
import torch

import gpudist.kernels.topk as T
from gpudist.kernels.quantize import (
    dequantize_1bit,
    dequantize_1bit_accumulate,
    dequantize_1bit_accumulate_reference,
    dequantize_1bit_reference,
    dequantize_int8,
    dequantize_int8_accumulate,
    dequantize_int8_accumulate_reference,
    dequantize_int8_reference,
    quantize_1bit,
    quantize_1bit_reference,
    quantize_int8,
    quantize_int8_reference,
)
from gpudist.kernels.topk import TopKResult, topk_compress, topk_compress_reference, topk_recall

from .tolerances import sum_rtol, unit_roundoff

SIZES = [0, 1, 7, 1000, 12_345, 1_000_003]
DTYPES = [torch.float32, torch.bfloat16]
U32, U16 = unit_roundoff(torch.float32), unit_roundoff(torch.bfloat16)


def _skip_large_in_interpreter(n: int, device: torch.device, kernel_impl: str) -> None:
    if n > 100_000 and kernel_impl == "triton" and device.type == "cpu":
        pytest.skip("Triton's interpreter needs minutes for 10^6 elements; the torch and cuda cases cover it")


def _randn(n: int, dtype: torch.dtype, device: torch.device, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * scale).to(dtype).to(device)


def _dense(result: TopKResult, n: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(n, device=device).index_put_((result.indices.long(),), result.values.float())


def _assert_1bit_near_float64(
    acc: torch.Tensor, scales: torch.Tensor, residual: torch.Tensor | None = None, block_size: int = 256
) -> None:
    """1-bit ``scales`` (and the new ``residual``) of the fp32 accumulator ``acc`` against float64. A scale is an
    fp32 sum of ``block_size`` magnitudes in any order (positive terms: within sum_rtol(block_size) of the sum) divided
    by the count (one rounding): within delta = sum_rtol + 2u relative. The residual acc -/+ scale inherits that
    delta and rounds once to fp32, and once more to bf16 for a bf16 residual. A wrong sign, count or block is off by
    a whole scale."""
    n = acc.numel()
    a = acc.detach().double().cpu()
    blocks = torch.nn.functional.pad(a, (0, (-n) % block_size)).view(-1, block_size)
    counts = (n - torch.arange(blocks.shape[0]) * block_size).clamp(max=block_size)
    exact = blocks.abs().sum(dim=1) / counts
    delta = (sum_rtol(block_size) + 2 * U32) * exact
    err = (scales.double().cpu() - exact).abs()
    assert bool((err <= delta).all()), f"1-bit scale off by {float((err / exact.clamp_min(1e-300)).max()):.3g} relative"
    if residual is None:
        return
    per_element = delta.repeat_interleave(block_size)[:n]
    want = a - torch.where(a < 0, -1.0, 1.0) * exact.repeat_interleave(block_size)[:n]  # -0.0 counts as positive
    rounding = U32 + (U16 * (1 + U32) if residual.dtype == torch.bfloat16 else 0.0)
    err = (residual.double().cpu() - want).abs()
    assert bool((err <= per_element + rounding * (want.abs() + per_element)).all()), "1-bit residual"


# --------------------------------------------------------------------------------------------------- top-k


def _check_topk(result: TopKResult, grad, old_residual, new_residual, k: int, mode: str = "exact") -> None:
    """Exactly k entries, ascending indices, the top-k (exact; in "threshold" mode to 16 mantissa bits of the
    magnitude), and nothing lost (bitwise)."""
    acc = grad if old_residual is None else (grad.float() + old_residual.float()).to(old_residual.dtype)
    assert result.values.shape == (k,) and result.indices.shape == (k,)
    assert result.values.dtype == grad.dtype and result.indices.dtype == torch.int64
    assert bool((result.indices[1:] > result.indices[:-1]).all()), "indices must be strictly ascending"
    if mode == "exact":
        assert topk_recall(acc, result.indices, k) == 1.0
    elif k:  # every pick within 2^-16 relative of the true k-th magnitude or above it
        kth = torch.topk(acc.float().abs(), k).values[-1]
        assert bool((acc[result.indices].float().abs() >= kth * (1 - 2.0**-16)).all())
    if new_residual is None:  # no error feedback: the values are acc itself
        assert torch.equal(result.values, acc[result.indices])
    else:
        rebuilt = _dense(result, grad.numel(), grad.device) + new_residual.float()
        assert torch.equal(rebuilt, acc.float()), "values + residual must equal grad + old residual exactly"


@pytest.mark.parametrize("mode", ["exact", "threshold"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_topk_matches_reference(device, kernel_impl, n, dtype, mode):
    """Catches a radix pass that picks the wrong digit bin, a compaction that drops, duplicates or misplaces an
    entry (a wrong prefix sum over programs), a residual written wrong, and a fused add rounded differently from
    torch: both paths select the same entries in the same order, so everything is compared bitwise."""
    _skip_large_in_interpreter(n, device, kernel_impl)
    k = min(n, max(1, n // 100))
    grad, residual = _randn(n, dtype, device, 1), _randn(n, dtype, device, 2, scale=0.5)
    res = residual.clone()
    got = topk_compress(grad, res, k, mode)
    ref_res = residual.clone()
    want = topk_compress_reference(grad, ref_res, k, mode)
    _check_topk(got, grad, residual, res, k, mode)
    assert torch.equal(got.indices, want.indices) and torch.equal(got.values, want.values)
    assert torch.equal(res, ref_res)
    assert (got.threshold is None) == (want.threshold is None) == (k == 0)
    if k:
        assert torch.equal(got.threshold, want.threshold)


def test_topk_threshold_mode_compares_16_mantissa_bits(device, kernel_impl):
    """Catches the threshold mode taking an entry further below the k-th magnitude than its 2^-16 resolution (a
    pass too few, or a wrong shift), or reporting a threshold that is not the k-th magnitude rounded down to 16
    mantissa bits; on random normal data with k = 1% it still holds at least 99% of the true top-k."""
    n = 30_000 if kernel_impl == "triton" and device.type == "cpu" else 200_000
    k = n // 100
    grad, residual = _randn(n, torch.float32, device, 4), _randn(n, torch.float32, device, 5, scale=0.3)
    res = residual.clone()
    result = topk_compress(grad, res, k, "threshold")
    acc = grad + residual
    kth = torch.topk(acc.abs(), k).values[-1:]
    assert torch.equal(result.threshold, (kth.view(torch.int32) >> 7 << 7).view(torch.float32))
    assert topk_recall(acc, result.indices, k) >= 0.99
    _check_topk(result, grad, residual, res, k, "threshold")


@pytest.mark.parametrize("mode", ["exact", "threshold"])
@pytest.mark.parametrize("data", ["normal", "uniform"])
def test_topk_candidates_in_scratch_or_spilled(monkeypatch, device, kernel_impl, data, mode):
    """The later digits are counted over the entries of the first digit's bin (the candidates) copied to a scratch
    of n / 8, or over every entry when more matched. Catches a candidate lost or counted twice by the filter's
    slots, a spill read from the half-filled scratch, and the later passes not masking the entries off the prefix:
    normal data (k = 1%: about 5% of entries in the k-th's exponent bin) fits the scratch, uniform data (half of
    them in [0.5, 1)) spills it; both must select what the reference does."""
    monkeypatch.setattr(T, "_MIN_CANDIDATES", 64)
    n, k = 12_000, 120
    grad = _randn(n, torch.float32, device, 21)
    if data == "uniform":
        grad = torch.rand(n, generator=torch.Generator().manual_seed(22)).sub_(0.5).mul_(2).to(device)
    residual = _randn(n, torch.float32, device, 23, scale=0.01)
    acc = grad + residual
    magnitude_bits = acc.abs().view(torch.int32)
    kth_bits = torch.topk(acc.abs(), k).values[-1].view(torch.int32)
    candidates = int(((magnitude_bits >> 23) == (kth_bits >> 23)).sum())
    assert (candidates > n // T._CANDIDATE_SHARE) == (data == "uniform"), candidates
    res, ref_res = residual.clone(), residual.clone()
    result = topk_compress(grad, res, k, mode)
    expected = topk_compress_reference(grad, ref_res, k, mode)
    assert torch.equal(result.indices, expected.indices) and torch.equal(result.values, expected.values)
    assert torch.equal(res, ref_res) and torch.equal(result.threshold, expected.threshold)


@pytest.mark.parametrize("mode", ["exact", "threshold"])
@pytest.mark.parametrize("n", [0, 1, 1000])
def test_topk_k_zero_and_k_n(device, n, mode):
    """Catches k = 0 skipping the residual update (acc must still be folded in) and k = n leaving anything
    behind or indexing out of range."""
    grad, residual = _randn(n, torch.float32, device, 7), _randn(n, torch.float32, device, 8)
    acc = grad + residual
    res = residual.clone()
    none = topk_compress(grad, res, 0, mode)
    assert none.values.numel() == 0 and none.indices.numel() == 0 and torch.equal(res, acc)
    res = residual.clone()
    everything = topk_compress(grad, res, n, mode)
    assert torch.equal(everything.indices, torch.arange(n, device=device))
    assert torch.equal(everything.values, acc) and not res.any()


@pytest.mark.parametrize("mode", ["exact", "threshold"])
def test_topk_without_residual(device, mode):
    """Catches writing into grad when there is no residual (grad must stay untouched)."""
    grad = _randn(5000, torch.bfloat16, device, 9)
    before = grad.clone()
    result = topk_compress(grad, None, 50, mode)
    _check_topk(result, grad, None, None, 50, mode)
    assert torch.equal(grad, before)


@pytest.mark.parametrize("mode", ["exact", "threshold"])
def test_topk_ties_zeros_nan_and_inf_against_torch_topk(device, kernel_impl, mode):
    """Against ``torch.topk``: catches ties at the k-th magnitude not going to the lowest indices (all magnitudes
    tied, 5000 entries over several programs), fewer than k entries when fewer than k are nonzero (the zeros fill
    up, lowest indices first), and NaN or Inf not ranked first (torch.topk ranks NaN above Inf)."""
    n, k = 40_000 if not (kernel_impl == "triton" and device.type == "cpu") else 20_000, 50
    g = torch.Generator().manual_seed(10)
    tied = (torch.randint(0, 2, (n,), generator=g).float() * 2 - 1).to(device)
    res = torch.zeros(n, device=device)
    result = topk_compress(tied, res, k, mode)
    assert torch.equal(result.indices, torch.arange(k, device=device))
    _check_topk(result, tied, torch.zeros(n, device=device), res, k, mode)

    sparse = torch.zeros(n, device=device)
    where = torch.randperm(n, generator=g)[:30].to(device)
    sparse[where] = _randn(30, torch.float32, device, 11)
    res = torch.zeros(n, device=device)
    result = topk_compress(sparse, res, 100, mode)
    zeros = (sparse == 0).nonzero().squeeze(1)[:70]
    assert torch.equal(result.indices, torch.cat([where.sort().values, zeros]).sort().values)
    _check_topk(result, sparse, torch.zeros(n, device=device), res, 100, mode)

    odd = _randn(n, torch.float32, device, 12)
    odd[[5, n - 1]] = float("nan")
    odd[[7, n // 2]] = float("-inf")
    odd[9] = float("inf")
    result = topk_compress(odd, None, 5, mode)
    expected = torch.topk(odd.abs(), 5).indices.sort().values
    assert torch.equal(result.indices, expected) and torch.equal(
        expected, torch.tensor([5, 7, 9, n // 2, n - 1], device=device)
    )


@pytest.mark.parametrize("mode", ["exact", "threshold"])
@pytest.mark.parametrize("case", ["normal", "bf16", "tied", "sparse", "small-k", "nan"])
def test_topk_cpu_path_selects_as_the_reference(monkeypatch, case, mode):
    """The CPU's own paths (host reads where they cost nothing: exact mode's float ``torch.topk`` with a tie check,
    threshold mode's candidates above a sampled bound) against the reference: the same entries, values, residual
    and threshold, bitwise. Catches a bound that cuts off an entry of the top-k, a tie at the k-th magnitude split
    by torch.topk's own pick instead of the lowest indices, NaN compared as a float, and the fallbacks (all tied:
    every entry a candidate; mostly zero: fewer candidates than k) not taken."""
    monkeypatch.delenv("GPUDIST_KERNELS", raising=False)
    n, k = 60_000, 600
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    grad, residual = _randn(n, dtype, torch.device("cpu"), 21), _randn(n, dtype, torch.device("cpu"), 22, scale=0.5)
    if case == "tied":
        grad, residual = torch.ones(n), torch.zeros(n)
    elif case == "sparse":
        grad = torch.where(torch.arange(n) % 211 == 0, grad, torch.zeros(n))
    elif case == "small-k":
        k = 3
    elif case == "nan":
        grad[[11, 20_000]] = float("nan")
    res, ref_res = residual.clone(), residual.clone()
    got = topk_compress(grad, res, k, mode)
    want = topk_compress_reference(grad, ref_res, k, mode)
    assert torch.equal(got.indices, want.indices) and torch.equal(got.threshold, want.threshold)
    for a, b in ((got.values, want.values), (res, ref_res)):  # bitwise, NaN included
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    if case != "nan":
        _check_topk(got, grad, residual, res, k, mode)


def test_topk_makes_no_host_sync(monkeypatch):
    """Catches a host sync on the way to the collectives (a count read back, a data-dependent shape: nonzero,
    masked_select, .item()): counted on the torch path by the simulation's counter, and on the GPU's path with its
    kernel launches made no-ops (the host's own work; the kernels themselves read nothing back)."""
    from gpudist.kernels import topk as T

    from .fakenccl import count_host_syncs

    grad, residual = _randn(5000, torch.float32, torch.device("cpu"), 15), torch.zeros(5000)
    for mode in ("exact", "threshold"):
        with count_host_syncs() as syncs:
            topk_compress_reference(grad, residual, 50, mode)
        assert syncs.total == 0, syncs.sites

    class _NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    for name in ("_radix_histogram_kernel", "_radix_select_kernel", "_radix_filter_kernel", "_radix_count_kernel",
                 "_scan_kernel", "_radix_compact_kernel"):  # fmt: skip
        monkeypatch.setattr(T, name, _NoLaunch())
    for mode in ("exact", "threshold"):
        with count_host_syncs() as syncs:
            T.topk_compress_triton(grad, residual, 50, mode)
        assert syncs.total == 0, syncs.sites


@pytest.mark.parametrize("mode", ["exact", "threshold"])
def test_topk_bf16_values_fp32_residual(device, mode):
    """Catches dropping the bf16 rounding of the sent values: with an fp32 residual, it must stay behind in the
    residual, so values + residual equals the fp32 accumulator bitwise."""
    n, k = 4000, 40
    grad, residual = _randn(n, torch.bfloat16, device, 12), _randn(n, torch.float32, device, 13)
    res = residual.clone()
    result = topk_compress(grad, res, k, mode)
    acc = grad.float() + residual
    assert result.values.dtype == torch.bfloat16
    if mode == "exact":
        assert topk_recall(acc, result.indices, k) == 1.0
    assert torch.equal(_dense(result, n, device) + res, acc)
    left = res[result.indices].abs()  # rounding to bf16 (nearest) moves a value by at most u_bf16 = 2^-8 relative
    assert bool((left <= acc[result.indices].abs() * U16).all()) and left.any()


def test_topk_int32_indices(device):
    """Catches index_dtype being ignored (the wire format sends int32 indices to halve their bytes)."""
    grad = _randn(3000, torch.float32, device, 14)
    for mode in ("exact", "threshold"):
        result = topk_compress(grad, None, 30, mode, index_dtype=torch.int32)
        assert result.indices.dtype == torch.int32
        assert topk_recall(grad, result.indices, 30) == 1.0


def test_topk_recall_counts_ties_as_hits():
    """Catches a recall that punishes a different pick among equal magnitudes."""
    acc = torch.tensor([3.0, -3.0, 3.0, 1.0])
    assert topk_recall(acc, torch.tensor([1, 2]), 2) == 1.0
    assert topk_recall(acc, torch.tensor([0, 3]), 2) == 0.5
    assert topk_recall(acc, torch.tensor([], dtype=torch.int64), 0) == 1.0


_G = torch.zeros(10)
_META = torch.zeros(10, device="meta")
TOPK_BAD_INPUTS = [
    (dict(grad=_G.view(2, 5)), ValueError, "grad has shape (2, 5)"),
    (dict(grad=torch.zeros(10, dtype=torch.int32)), TypeError, "grad has dtype torch.int32"),
    (dict(grad=torch.zeros(20)[::2]), ValueError, "grad is not contiguous"),
    (dict(residual=torch.zeros(9)), ValueError, "residual has 9 elements; expected 10"),
    (dict(residual=_META), ValueError, "residual is on meta"),
    (dict(k=11), ValueError, "k=11 must be between 0 and grad.numel()=10"),
    (dict(k=-1), ValueError, "k=-1"),
    (dict(k=2.0), TypeError, "k must be an int, got float"),
    (dict(mode="approx"), ValueError, "mode='approx' is not one of"),
    (dict(index_dtype=torch.int16), ValueError, "index_dtype=torch.int16"),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), TOPK_BAD_INPUTS, ids=[m for *_, m in TOPK_BAD_INPUTS])
def test_topk_rejects_bad_inputs(kwargs, error, message):
    """Catches bad arguments reaching a kernel (garbage or a crash) instead of an error that names them."""
    args = dict(grad=_G, residual=torch.zeros(10), k=3, mode="exact") | kwargs
    residual = args["residual"]
    residual_before = residual.clone() if residual is not None and residual.device.type != "meta" else None
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        topk_compress(
            args["grad"],
            args["residual"],
            args["k"],
            args["mode"],
            index_dtype=kwargs.get("index_dtype", torch.int64),
        )
    if residual_before is not None:
        assert torch.equal(residual, residual_before), "a rejected call must not touch the residual"


# ---------------------------------------------------------------------------------------------------- int8


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_quantize_int8_matches_reference(device, kernel_impl, n, dtype):
    """Catches a wrong absmax, rounding (half-away vs half-even), tail-block masking or residual update in
    the kernel: q, scales and residual must equal the reference's bitwise."""
    _skip_large_in_interpreter(n, device, kernel_impl)
    grad, residual = _randn(n, dtype, device, 20), _randn(n, dtype, device, 21, scale=0.1)
    res, ref_res = residual.clone(), residual.clone()
    q, scales = quantize_int8(grad, res)
    want_q, want_scales = quantize_int8_reference(grad, ref_res)
    assert q.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == ((n + 255) // 256,)
    assert torch.equal(q, want_q) and torch.equal(scales, want_scales) and torch.equal(res, ref_res)


@pytest.mark.parametrize("block_size", [32, 64, 4096])
def test_quantize_block_sizes(device, block_size):
    """Catches a kernel that assumes the default block size or mishandles a ragged last block."""
    n = 1000 + block_size // 2
    grad, residual = _randn(n, torch.float32, device, 22), _randn(n, torch.float32, device, 23, scale=0.1)
    for quantize, reference in ((quantize_int8, quantize_int8_reference), (quantize_1bit, quantize_1bit_reference)):
        res, ref_res = residual.clone(), residual.clone()
        payload, scales = quantize(grad, res, block_size=block_size)
        want_payload, want_scales = reference(grad, ref_res, block_size=block_size)
        assert torch.equal(payload, want_payload) and scales.shape == ((n + block_size - 1) // block_size,)
        if quantize is quantize_int8:  # absmax / 127: the same correctly rounded ops in both
            assert torch.equal(scales, want_scales)
        else:
            for got in (scales, want_scales):
                _assert_1bit_near_float64(grad + residual, got, block_size=block_size)


@pytest.mark.parametrize("n", [1, 1000, 12_345])
def test_int8_error_bound_and_conservation(device, n):
    """Catches rounding that is not to nearest (error above half a step), a scale that is not absmax / 127
    (no element reaching +-127), and a residual that is not exactly acc - q * scale."""
    grad, residual = _randn(n, torch.float32, device, 24), _randn(n, torch.float32, device, 25, scale=0.1)
    acc = grad + residual
    res = residual.clone()
    q, scales = quantize_int8(grad, res)
    deq = dequantize_int8(q, scales)
    step = scales.repeat_interleave(256)[:n]
    # Half a step, plus roundings: q = round(fl(acc / s)) with |acc / s| <= 127 (1 + u) is within 1/2 + 127u (1 + u)
    # of acc / s, and deq = fl(q s) adds 127u s: under s/2 (1 + 512u).
    assert bool(((acc - deq).abs() <= step / 2 * (1 + 512 * U32)).all())
    assert torch.equal(deq + res, acc)
    assert all(int(block.abs().max()) == 127 for block in q.split(256))


def test_int8_zero_block(device):
    """Catches 0/0 in an all-zero block: its scale must be 0 and its q 0, with no NaN anywhere."""
    grad = torch.cat([torch.zeros(256), torch.randn(100, generator=torch.Generator().manual_seed(26))]).to(device)
    res = torch.zeros(356, device=device)
    q, scales = quantize_int8(grad, res)
    assert scales[0] == 0 and not q[:256].any() and q[256:].any()
    assert not res.isnan().any() and not dequantize_int8(q, scales).isnan().any()


def test_int8_stochastic_rounding_is_unbiased(device):
    """Catches biased stochastic rounding (plain floor, round-to-nearest, u used the wrong way round) and
    stochastic q outside {floor, ceil}: over 100 seeds, the mean of q * scale must approach acc."""
    n, seeds = 512, 100
    grad = _randn(n, torch.float32, device, 27)
    scale = grad.view(-1, 256).abs().amax(dim=1).repeat_interleave(256) / 127
    x = grad / scale
    total = torch.zeros(n, device=device)
    for seed in range(seeds):
        q, scales = quantize_int8(grad, stochastic=True, seed=seed)
        assert bool(((q.float() == x.floor()) | (q.float() == x.ceil())).all())
        total += dequantize_int8(q, scales)
    # One draw is off by < one step; the mean of 100 by sigma <= step / 20, so 5 sigma is a quarter step.
    # Round-to-nearest misses by up to half a step, floor by the fractional part (0.5 on average). A statistical
    # bound, not a rounding one: the 100 seeds are fixed, so the draws (and the result) are the same on any host.
    assert bool(((total / seeds - grad).abs() <= scale / 4).all())
    again, _ = quantize_int8(grad, stochastic=True, seed=seeds - 1)
    assert torch.equal(again, q), "the same seed must give the same rounding"
    other, _ = quantize_int8(grad, stochastic=True, seed=seeds)
    assert not torch.equal(other, q), "another seed must give another rounding"


def test_int8_stochastic_residual(device):
    """Catches a stochastic-mode residual that is not acc - q * scale (error feedback would drift)."""
    grad, residual = _randn(1000, torch.float32, device, 28), _randn(1000, torch.float32, device, 29, scale=0.1)
    res = residual.clone()
    q, scales = quantize_int8(grad, res, stochastic=True, seed=5)
    deq = dequantize_int8(q, scales)
    # res = fl(acc - deq) and fl(deq + res) round once each: |deq + res - acc| <= u (1 + u) |acc - deq| + u |acc|.
    # (Exact when deq is within a factor 2 of acc, as round-to-nearest makes it; a stochastic step up may not.)
    acc, d = (grad + residual).double(), deq.double()
    bound = U32 * (1 + U32) * (acc - d).abs() + U32 * acc.abs()
    assert bool(((deq + res).double() - acc).abs().le(bound).all())


# --------------------------------------------------------------------------------------------------- 1-bit


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_quantize_1bit_matches_reference(device, kernel_impl, n, dtype):
    """Catches a wrong sign bit, bit order or byte position, a scale averaged over the padding of the last
    block, or a residual that is not acc - dequant."""
    _skip_large_in_interpreter(n, device, kernel_impl)
    grad, residual = _randn(n, dtype, device, 30), _randn(n, dtype, device, 31, scale=0.1)
    res, ref_res = residual.clone(), residual.clone()
    bits, scales = quantize_1bit(grad, res)
    want_bits, want_scales = quantize_1bit_reference(grad, ref_res)
    assert bits.dtype == torch.uint8 and bits.shape == ((n + 7) // 8,)
    assert torch.equal(bits, want_bits)
    acc = grad.float() + residual.float()  # both implementations' fp32 accumulator
    for got_scales, got_res in ((scales, res), (want_scales, ref_res)):
        _assert_1bit_near_float64(acc, got_scales, got_res)


def test_1bit_hand_computed_layout(device):
    """Catches MSB-first packing, bit set for positive, or a mean over block_size instead of the valid count:
    checked against bytes and scales worked out by hand."""
    acc = torch.tensor([-1.0, 2, -3, 4, 0, -0.5, 6, -7, 8, -9], device=device)
    bits, scales = quantize_1bit(acc, block_size=32)
    # byte 0: negatives at 0, 2, 5, 7 -> 1 + 4 + 32 + 128; byte 1: element 9 is bit 1 -> 2.
    assert bits.tolist() == [165, 2]
    assert scales.tolist() == [torch.tensor(40.5 / 10).item()]
    tail = torch.cat([torch.ones(32), torch.full((8,), -2.0)]).to(device)
    bits, scales = quantize_1bit(tail, block_size=32)
    assert bits.tolist() == [0, 0, 0, 0, 255] and scales.tolist() == [1.0, 2.0]
    assert dequantize_1bit(bits, scales, 40, block_size=32).tolist() == tail.tolist()


@pytest.mark.parametrize("n", [7, 12_345])
def test_1bit_conservation(device, n):
    """Catches a residual update that uses another scale or sign than the one sent (error feedback would
    accumulate the difference): dequant + residual must give back acc to fp32 rounding."""
    grad, residual = _randn(n, torch.float32, device, 32), _randn(n, torch.float32, device, 33, scale=0.1)
    acc = grad + residual
    res = residual.clone()
    bits, scales = quantize_1bit(grad, res)
    deq = dequantize_1bit(bits, scales, n)
    assert bool((deq.abs() == scales.repeat_interleave(256)[:n]).all())
    # acc - d rounds once; adding d back rounds once more: within an ulp of the larger of |acc|, |d|.
    ulp = torch.maximum(acc.abs(), deq.abs()) * 2**-23
    assert bool(((deq + res - acc).abs() <= ulp).all())


# ----------------------------------------------------------------------------------------- dequantization


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", ["int8", "1bit"])
def test_dequantize_matches_reference(device, kernel_impl, kind, n, dtype):
    """Catches a dequantize or fused accumulate that reads the wrong scale for a block, unpacks bits in the
    wrong order, or rounds the bf16 output differently from torch (compared bitwise)."""
    _skip_large_in_interpreter(n, device, kernel_impl)
    grad = _randn(n, torch.float32, device, 40)
    base = _randn(n, dtype, device, 41)
    if kind == "int8":
        q, scales = quantize_int8_reference(grad)
        got = dequantize_int8(q, scales, dtype=dtype)
        want = dequantize_int8_reference(q, scales, dtype=dtype)
        values = dequantize_int8_reference(q, scales)
        acc, ref_acc = base.clone(), base.clone()
        dequantize_int8_accumulate(q, scales, acc)
        dequantize_int8_accumulate_reference(q, scales, ref_acc)
    else:
        bits, scales = quantize_1bit_reference(grad)
        got = dequantize_1bit(bits, scales, n, dtype=dtype)
        want = dequantize_1bit_reference(bits, scales, n, dtype=dtype)
        values = dequantize_1bit_reference(bits, scales, n)
        acc, ref_acc = base.clone(), base.clone()
        dequantize_1bit_accumulate(bits, scales, acc)
        dequantize_1bit_accumulate_reference(bits, scales, ref_acc)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(acc, ref_acc)
    assert torch.equal(acc, (base.float() + values).to(dtype)), "the sum must be rounded once, from fp32"


def test_dequantize_into_out(device):
    """Catches ``out`` being ignored (a fresh tensor returned) by the dequantize functions."""
    q, scales = quantize_int8(_randn(300, torch.float32, device, 42))
    out = torch.empty(300, dtype=torch.bfloat16, device=device)
    assert dequantize_int8(q, scales, out) is out
    bits, scales = quantize_1bit(_randn(300, torch.float32, device, 43))
    assert dequantize_1bit(bits, scales, 300, out, dtype=torch.bfloat16) is out


# ------------------------------------------------------------------------------ references vs plain torch


def _plain_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, (-x.numel()) % block_size)).view(-1, block_size)


def _plain_quantize(grad, residual, block_size, bits):
    """The straightforward padded formulation the references compute (bit for bit) in fewer passes."""
    n = grad.numel()
    acc = grad.float() if residual is None else grad.float() + residual.float()
    blocks = _plain_blocks(acc, block_size)
    if bits == 8:
        scales = blocks.abs().amax(dim=1) / 127
        q = torch.round(blocks / torch.where(scales > 0, scales, 1.0)[:, None]).clamp(-127, 127)
        payload, deq = q.view(-1)[:n].to(torch.int8), q * scales[:, None]  # q may be -0.0 here
        values = _plain_blocks(payload.float(), block_size) * scales[:, None]  # what the receiver gets
    else:
        counts = (n - torch.arange(blocks.shape[0]) * block_size).clamp(max=block_size)
        scales = blocks.abs().sum(dim=1) / counts
        negative = acc < 0
        weights = 1 << torch.arange(8, dtype=torch.int32)
        padded = torch.nn.functional.pad(negative, (0, (-n) % 8)).view(-1, 8).to(torch.int32)
        payload = (padded * weights).sum(dim=1).to(torch.uint8)
        deq = values = _plain_blocks(1.0 - 2.0 * negative.float(), block_size) * scales[:, None]
    new_residual = None if residual is None else (blocks - deq).view(-1)[:n].to(residual.dtype)
    return payload, scales, new_residual, values.view(-1)[:n]


def _bitwise(a: torch.Tensor) -> torch.Tensor:
    """Integer view of a float tensor, so that equality also tells -0.0 from 0.0."""
    return a.view({4: torch.int32, 2: torch.int16}[a.element_size()]) if a.is_floating_point() else a


@pytest.mark.parametrize("bits", [8, 1])
@pytest.mark.parametrize("residual_dtype", [None, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("n", "block_size"), [(1, 32), (263, 256), (8205, 4096), (600_007, 256)])
def test_references_match_plain_torch(n, block_size, residual_dtype, bits):
    """Catches the in-place, view-not-pad references drifting from the plain formulation: a ragged last block
    handled apart from the whole ones, the sum formed in the residual, -0.0 (not negative: bit 0, residual
    -0.0 - scale), an all-zero block, subnormals, the 1-bit bit tricks, and a dequantize-accumulate done in
    chunks (600_007 spans two). Compared bit for bit, signs of zeros included."""
    g = torch.Generator().manual_seed(50)
    grad = torch.randn(n, generator=g).to(torch.bfloat16 if residual_dtype is None else torch.float32)
    grad[: min(n, 256)] = 0.0  # an all-zero block
    specials = torch.tensor([-0.0, 0.0, 1e-41, -1e-41, 0.5, -2.5])
    where = torch.randint(0, n, (n // 7 + 1,), generator=g)
    grad[where] = specials[torch.randint(0, 6, where.shape, generator=g)].to(grad.dtype)
    residual = None if residual_dtype is None else (torch.randn(n, generator=g) * 0.1).to(residual_dtype)
    if residual is not None:
        residual[where] = -0.0  # -0.0 + -0.0 stays -0.0 in the accumulator
    before = grad.clone()
    res = None if residual is None else residual.clone()
    quantize = quantize_int8_reference if bits == 8 else quantize_1bit_reference
    payload, scales = quantize(grad, res, block_size=block_size)
    want_payload, want_scales, want_residual, want_values = _plain_quantize(grad, residual, block_size, bits)
    assert torch.equal(payload, want_payload) and torch.equal(_bitwise(scales), _bitwise(want_scales))
    assert torch.equal(grad, before)
    if residual is not None:
        assert torch.equal(_bitwise(res), _bitwise(want_residual))
    base = torch.randn(n, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        out = base.to(dtype, copy=True)
        if bits == 8:
            values = dequantize_int8_reference(q=payload, scales=scales, block_size=block_size)
            dequantize_int8_accumulate_reference(payload, scales, out, block_size=block_size)
        else:
            values = dequantize_1bit_reference(payload, scales, n, block_size=block_size)
            dequantize_1bit_accumulate_reference(payload, scales, out, block_size=block_size)
        assert torch.equal(_bitwise(values), _bitwise(want_values))
        assert torch.equal(_bitwise(out), _bitwise((base.to(dtype).float() + want_values).to(dtype)))


_Q = torch.zeros(300, dtype=torch.int8)
_S = torch.zeros(2)
_BITS = torch.zeros(38, dtype=torch.uint8)
_F = torch.zeros(300)
QUANTIZE_BAD_INPUTS = [
    (lambda: quantize_int8(_F, block_size=100), ValueError, "block_size=100 must be a power of two"),
    (lambda: quantize_1bit(_F, block_size=8192), ValueError, "block_size=8192 must be a power of two"),
    (lambda: quantize_int8(_F, block_size=16), ValueError, "block_size=16"),
    (lambda: quantize_int8(_F.to(torch.float64)), TypeError, "grad has dtype torch.float64"),
    (lambda: quantize_int8(_F, torch.zeros(299)), ValueError, "residual has 299 elements; expected 300"),
    (lambda: quantize_1bit(_F, torch.zeros(300, device="meta")), ValueError, "residual is on meta"),
    (lambda: quantize_int8(torch.zeros(600)[::2]), ValueError, "grad is not contiguous"),
    (lambda: quantize_int8(_F, stochastic=True, seed=-1), ValueError, "seed=-1 must be an int in"),
    (lambda: dequantize_int8(_Q.to(torch.uint8), _S), TypeError, "q has dtype torch.uint8; expected int8"),
    (lambda: dequantize_int8(_Q, torch.zeros(3)), ValueError, "scales has 3 elements; expected 2"),
    (lambda: dequantize_int8(_Q, _S.double()), TypeError, "scales has dtype torch.float64"),
    (lambda: dequantize_int8(_Q, _S, torch.zeros(299)), ValueError, "out has 299 elements; expected 300"),
    (lambda: dequantize_int8(_Q, _S, _F, dtype=torch.bfloat16), ValueError, "out has dtype torch.float32 but"),
    (lambda: dequantize_int8(_Q, _S, torch.zeros(300, device="meta")), ValueError, "out is on meta"),
    (lambda: dequantize_int8_accumulate(_Q, _S, _F.int()), TypeError, "out has dtype torch.int32"),
    (lambda: dequantize_1bit(_BITS.to(torch.int8), _S, 300), TypeError, "bits has dtype torch.int8"),
    (lambda: dequantize_1bit(_BITS, _S, 310), ValueError, "bits has 38 elements; expected 39"),
    (lambda: dequantize_1bit(_BITS, _S, -1), ValueError, "n=-1 must be a non-negative int"),
    (lambda: dequantize_1bit(_BITS, _S, 300, block_size=128), ValueError, "scales has 2 elements; expected 3"),
    (lambda: dequantize_1bit_accumulate(_BITS, _S, torch.zeros(400)), ValueError, "bits has 38 elements; expected 50"),
    (lambda: dequantize_1bit_accumulate(_BITS, _S, torch.zeros(10, 30)), ValueError, "out has shape"),
]


@pytest.mark.parametrize(("call", "error", "message"), QUANTIZE_BAD_INPUTS, ids=[m for *_, m in QUANTIZE_BAD_INPUTS])
def test_quantize_rejects_bad_inputs(call, error, message):
    """Catches a bad argument reaching a kernel (out-of-bounds reads, garbage output) instead of an error
    that names the argument, its value and the fix."""
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        call()
