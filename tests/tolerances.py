"""Tolerances derived from rounding-error bounds, for comparisons whose exact result depends on summation order.

A floating-point sum's value depends on the order of its additions: BLAS picks an order by CPU (AVX2 or AVX-512
lanes) and thread count, a Triton kernel by its block size, a distributed reduction by the number of ranks. A
tolerance that happened to pass on one CPU fails on another, so the ones here come from error analysis instead:

- ``u`` is the unit roundoff of the accumulation dtype (2^-24 for float32).
- Any order of summing n terms gives each term a path of at most n - 1 roundings, so the computed sum differs
  from the exact one by at most ``gamma(n - 1) * sum |x_i|`` (deterministic; Higham, *Accuracy and Stability of
  Numerical Algorithms*, 2nd ed., section 4.2), with ``gamma(k) = k u / (1 - k u)``.
- That worst case needs every rounding to go the same way. Modelling roundings as independent, mean-zero random
  variables (Higham and Mary, "A New Approach to Probabilistic Rounding Error Analysis", SIAM J. Sci. Comput. 41(5),
  2019, Theorem 2.4), the error is at most ``lam * sqrt(n) * u * sum |x_i|`` with probability at least
  ``1 - 2 n exp(-lam^2 / 2)``; ``LAMBDA = 8`` makes that failure probability < 3e-8 up to n = 10^6.

Results are compared against a float64 reference, whose own error is negligible at these sizes (2^-53 relative).
"""

from __future__ import annotations

import math

import torch

LAMBDA = 8.0
"""Confidence parameter of the probabilistic bound (see the module docstring)."""


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = 2^-p for a dtype with a p-bit significand (the relative error of one rounding to nearest)."""
    return float(torch.finfo(dtype).eps) / 2


def sum_rtol(n: int, dtype: torch.dtype = torch.float32, lam: float = LAMBDA) -> float:
    """Relative error bound (against ``sum |x_i|``) for a sum of ``n`` terms accumulated in ``dtype``, any order.

    Probabilistic (Higham and Mary 2019) at confidence ``lam``, capped by the deterministic worst case.
    """
    if n <= 1:
        return 0.0
    u = unit_roundoff(dtype)
    worst = (n - 1) * u / (1 - (n - 1) * u)
    return min(worst, lam * math.sqrt(n) * u)


# ---------------------------------------------------------------------------------------------------------------------
# Training against single-process training

REFERENCE_FACTOR = 8.0
"""How far (in max-norm) a strategy's result may be from the float64 reference, in units of the float32 reference's
own distance from it. Both are float32 computations of the same training run that differ only in summation order
(per-rank micro-batch means averaged across ranks, sharded matmuls summed across ranks, BLAS's blocking on this
CPU): their rounding errors have the same source and size, and the largest of thousands of them is a stable
statistic. Measured ratios on DDP, tensor-parallel and pipeline runs: 0.8-1.9 (2-4 ranks, Adam and SGD, AMD EPYC
and 1 thread). The bound scales with the host's own rounding (BLAS order, thread count), so it holds on any CPU;
any real bug (a sum instead of an average, a stale or missing gradient, a wrong shard) moves results by orders of
magnitude more than rounding."""


def reference_pair(fn, *args, **kwargs) -> tuple:
    """``fn(*args, dtype=torch.float32, **kwargs)`` and the same with ``torch.float64``."""
    return fn(*args, dtype=torch.float32, **kwargs), fn(*args, dtype=torch.float64, **kwargs)


def _as64(values) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.detach().to(torch.float64).cpu()
    return torch.as_tensor(values, dtype=torch.float64)


def reference_bound(ref32, ref64, factor: float = REFERENCE_FACTOR) -> float:
    """``factor`` x the float32 reference's max-norm error against the float64 one (at least one float32 rounding
    of the largest value: a run with no visible error still has that much)."""
    r32, r64 = _as64(ref32), _as64(ref64)
    if r32.shape != r64.shape:
        raise ValueError(f"references differ in shape: {tuple(r32.shape)} vs {tuple(r64.shape)}")
    own = float((r32 - r64).abs().max()) if r64.numel() else 0.0
    floor = unit_roundoff(torch.float32) * (float(r64.abs().max()) if r64.numel() else 0.0)
    return factor * max(own, floor)


def assert_matches_reference(got, ref32, ref64, *, factor: float = REFERENCE_FACTOR, what: str = "values") -> None:
    """``got`` (a float32 result of the strategy under test) is within :func:`reference_bound` of ``ref64``."""
    g, r64 = _as64(got), _as64(ref64)
    if g.shape != r64.shape:
        raise AssertionError(f"{what}: shape {tuple(g.shape)} differs from the reference's {tuple(r64.shape)}")
    if not torch.isfinite(g).all():
        raise AssertionError(f"{what}: non-finite values {g[~torch.isfinite(g)][:5].tolist()}")
    bound = reference_bound(ref32, r64, factor)
    g, r64 = g.reshape(-1), r64.reshape(-1)
    err = (g - r64).abs()
    worst = int(err.argmax()) if err.numel() else 0
    if err.numel() and float(err[worst]) > bound:
        own = float((_as64(ref32).reshape(-1) - r64).abs().max())
        raise AssertionError(
            f"{what}: max |got - float64 reference| = {float(err[worst]):.3g} at index {worst} (got "
            f"{float(g[worst]):.9g}, reference {float(r64[worst]):.9g}) exceeds {bound:.3g} = "
            f"{factor:g} x the float32 reference's own error {own:.3g}"
        )
