"""Triton, when it is installed, and the helpers every kernel file shares.

Triton is a dependency on Linux x86_64 only. Elsewhere the kernel files still import (their
``@triton.jit`` bodies are never called) and every op runs its torch reference.
"""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

    class _Stub:
        """Stands in for ``triton`` / ``triton.language`` so kernel definitions still parse."""

        constexpr = object

        @staticmethod
        def jit(fn=None, **_):
            return fn if fn is not None else (lambda f: f)

        def __getattr__(self, name):
            raise RuntimeError(f"triton.{name} is unavailable: Triton is not installed (pip install triton)")

    triton = tl = _Stub()

__all__ = ["HAS_TRITON", "cast_rne", "interpreter_active", "tl", "triton"]


def interpreter_active() -> bool:
    """True when Triton kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


@triton.jit
def cast_rne(x, dtype: tl.constexpr):
    """Cast ``x`` to ``dtype``, rounding fp32 -> bf16 to nearest-even explicitly.

    The compiled fp32 -> bf16 conversion on sm_80+ already rounds to nearest-even, but Triton's
    interpreter truncates (seen with triton 3.9: half of 10^6 random values came out one bf16 ulp
    low). Doing the rounding with integer ops makes both paths agree bit for bit with torch's
    ``.to(torch.bfloat16)``, which the tests rely on; it costs three integer ops per element of a
    kernel that is bound by memory bandwidth.
    """
    if dtype == tl.bfloat16:
        if x.dtype == tl.float32:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + (0x7FFF + ((bits >> 16) & 1))
            # A NaN payload can carry into the exponent and become Inf: write torch's canonical NaN.
            bits = tl.where(x != x, 0x7FC00000, bits & 0xFFFF0000)
            return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    return x.to(dtype)
