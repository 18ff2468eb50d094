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
    probable = lam * math.sqrt(n) * u
    if (n - 1) * u >= 1:  # gamma(n - 1) is a bound only while (n - 1) u < 1 (past 2^24 fp32 terms it turns negative)
        return probable
    return min((n - 1) * u / (1 - (n - 1) * u), probable)


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


def assert_matches_reference(
    got, ref32, ref64, *, factor: float = REFERENCE_FACTOR, what: str = "values", slack: float = 0.0
) -> None:
    """``got`` (a float32 result of the strategy under test) is within :func:`reference_bound` of ``ref64``, plus
    ``slack``: a known, separately derived difference of the computation under test (e.g. its hyperparameters held
    in float32, :func:`float32_hyper_slack`)."""
    g, r64 = _as64(got), _as64(ref64)
    if g.shape != r64.shape:
        raise AssertionError(f"{what}: shape {tuple(g.shape)} differs from the reference's {tuple(r64.shape)}")
    if not torch.isfinite(g).all():
        raise AssertionError(f"{what}: non-finite values {g[~torch.isfinite(g)][:5].tolist()}")
    bound = reference_bound(ref32, r64, factor) + slack
    g, r64 = g.reshape(-1), r64.reshape(-1)
    err = (g - r64).abs()
    worst = int(err.argmax()) if err.numel() else 0
    if err.numel() and float(err[worst]) > bound:
        own = float((_as64(ref32).reshape(-1) - r64).abs().max())
        raise AssertionError(
            f"{what}: max |got - float64 reference| = {float(err[worst]):.3g} at index {worst} (got "
            f"{float(g[worst]):.9g}, reference {float(r64[worst]):.9g}) exceeds {bound:.3g} = "
            f"{factor:g} x the float32 reference's own error {own:.3g}" + (f" + slack {slack:.3g}" if slack else "")
        )


def as_float32(x: float) -> float:
    """``x`` rounded to the nearest float32 (as a kernel that takes its scalars in float32 holds it)."""
    return float(torch.tensor(x, dtype=torch.float32))


def float32_hyper_slack(run, exact: dict, names) -> list[float]:
    """How far rounding the hyperparameters to float32 moves each result: ``max |run(rounded) - run(exact)|`` per
    output, both runs in float64 (``run(hyper, dtype=...)`` returns a list of tensors).

    A kernel that holds its scalars in float32, as torch's fused CUDA Adam does, computes a slightly different
    problem: beta2 = 0.999 becomes 0.99900001287, so ``1 - beta2`` is 1.29e-5 too small and Adam's second moment
    comes out 1.3e-5 low in relative terms (7.6e-7 absolute after 20 steps on an H200, 2026-11-28), far more than
    float32 rounding of the computation itself. That shift is exact arithmetic on rounded inputs, so it is
    measured in float64 and added to the rounding bound, not hidden in a looser factor.
    """
    rounded = {
        k: (tuple(map(as_float32, v)) if isinstance(v, tuple) else as_float32(v)) if k in names else v
        for k, v in exact.items()
    }
    a, b = run(exact, dtype=torch.float64), run(rounded, dtype=torch.float64)
    return [float((x - y).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b, strict=True)]
