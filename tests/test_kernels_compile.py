"""Every Triton kernel compiled for Hopper (sm_90) and Ampere (sm_80), ahead of time, on this GPU-less machine.

Triton's interpreter runs a kernel's Python body with numpy: it checks the logic but none of what the compiler
checks (types, constexpr use, layouts, what lowers to PTX). Triton's own compiler needs no GPU to do that: it
takes a kernel and a launch signature to a cubin for a named target, through ``ptxas``. So this test
1. calls every public op in ``gpudist.kernels`` with the Triton path forced, in the interpreter, across the
   variants the library uses (dtypes, residual or none, flags such as weight decay, maximize, skip, AMP scale
   tensor, low-precision copy, stochastic rounding), and records each launch's kernel, arguments and options;
2. compiles each distinct launch signature for sm_90 and sm_80 in a subprocess with the interpreter off
   (tests/kernel_compile.py) and expects a cubin from every one.
It would catch a kernel that the interpreter accepts and the compiler rejects (a dtype mismatch in ``tl.where``,
a non-constexpr shape, a pointer cast the compiler cannot lower, a constexpr branch that only breaks in one
variant). What it cannot show: that the compiled code gives the right numbers, or its speed (tests/test_gpu.py
and ``gpudist bench kernels`` on a GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpudist import kernels as K
from gpudist.kernels import _triton

pytestmark = pytest.mark.skipif(
    not (_triton.HAS_TRITON and _triton.interpreter_active()),
    reason="records launches in Triton's interpreter (set in tests/conftest.py without "
    "CUDA); the GPU tier runs the compiled kernels themselves",
)

TARGETS = ["cuda:90", "cuda:80"]
N = 300  # more than one block of the small kernels, cheap in the interpreter


def _encode(value):
    """A launch argument as JSON: tensors by dtype (they become pointers), Triton dtype constants by name."""
    import triton.language as tl

    if isinstance(value, torch.Tensor):
        return {"pointer": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, tl.dtype):
        names = ("float32", "bfloat16", "float16", "float64", "int64", "int32", "int8", "uint8")
        return {"tl": next(name for name in names if getattr(tl, name) == value)}
    return value


def _record(monkeypatch) -> list[dict]:
    """Patch the interpreter's launch so every launch is also written down."""
    from triton.runtime.interpreter import InterpretedFunction

    launches, run = [], InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        names = self.arg_names
        given = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
        launches.append(
            {
                "module": self.fn.__module__,
                "kernel": self.fn.__name__,
                "args": {k: _encode(v) for k, v in given.items()},
                "options": {k: v for k, v in kwargs.items() if k not in names},
            }
        )
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    return launches


def _randn(n, dtype, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _drive_every_op() -> None:
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    for bucket in (f32, bf16):  # pack/unpack: mixed tensor dtypes in one bucket, both directions
        tensors = [_randn(7, f32), _randn(N, bf16, 1), _randn(5, f16, 2)]
        flat = torch.empty(sum(t.numel() for t in tensors), dtype=bucket)
        K.pack(tensors, flat, scale=0.5)
        K.unpack(flat, tensors, scale=2.0)
    for dtype in (f32, bf16):
        K.squared_norm(_randn(N, dtype))
    adam = [
        {},
        {"weight_decay": 0.1},
        {"weight_decay": 0.1, "decoupled_weight_decay": True},
        {"maximize": True},
        {"grad_scale_tensor": torch.tensor([2.0])},
        {"found_inf": torch.zeros(1)},
        {"param_out": torch.empty(N, dtype=bf16)},
        {"bf16_grad": True},
    ]
    for kw in adam:
        grad = _randn(N, bf16 if kw.pop("bf16_grad", False) else f32, 3)
        K.adam_step(_randn(N, f32), grad, torch.zeros(N), torch.zeros(N), step=1, lr=1e-2, **kw)
    sgd = [
        {},
        {"momentum": 0.9, "first_step": True},
        {"momentum": 0.9, "nesterov": True},
        {"weight_decay": 0.1},
        {"maximize": True, "grad_scale_tensor": torch.tensor([2.0])},
        {"found_inf": torch.zeros(1)},
        {"param_out": torch.empty(N, dtype=bf16)},
    ]
    for kw in sgd:
        buf = torch.zeros(N) if kw.get("momentum") else None
        K.sgd_step(_randn(N, f32), _randn(N, f32, 4), buf, lr=1e-2, **kw)
    for dtype in (f32, bf16):
        for residual in (None, torch.zeros(N), torch.zeros(N, dtype=bf16)):
            grad = _randn(N, dtype, 5)
            q, scales = K.quantize_int8(grad, None if residual is None else residual.clone(), block_size=64)
            K.dequantize_int8(q, scales, block_size=64, dtype=dtype)
            K.dequantize_int8_accumulate(q, scales, torch.zeros(N, dtype=dtype), block_size=64)
            bits, scales = K.quantize_1bit(grad, None if residual is None else residual.clone(), block_size=64)
            K.dequantize_1bit(bits, scales, N, block_size=64, dtype=dtype)
            K.dequantize_1bit_accumulate(bits, scales, torch.zeros(N, dtype=dtype), block_size=64)
            for mode in ("exact", "threshold"):
                K.topk_compress(
                    grad,
                    None if residual is None else residual.clone(),
                    10,
                    mode,
                    generator=torch.Generator().manual_seed(0),
                )
        K.quantize_int8(_randn(N, dtype, 6), torch.zeros(N), block_size=64, stochastic=True, seed=3)
    K.topk_compress(_randn(N, f32, 7), torch.zeros(N), 10, "exact", index_dtype=torch.int32)


def _launched_kernels() -> set[str]:
    """Every kernel a launcher in kernels/ starts (``_name_kernel[grid](...)``)."""
    import re

    root = Path(K.__file__).parent
    return {m for f in root.glob("*.py") for m in re.findall(r"(\w+_kernel)\[", f.read_text())}


def test_every_kernel_compiles_for_hopper_and_ampere(monkeypatch, tmp_path):
    """Catches kernels that pass in the interpreter and fail in Triton's compiler (see the module docstring):
    each distinct launch signature the public ops make must compile to a cubin for sm_90 and sm_80."""
    monkeypatch.setenv("GPUDIST_KERNELS", "triton")
    launches = _record(monkeypatch)
    _drive_every_op()
    assert {s["kernel"] for s in launches} == _launched_kernels(), "a kernel went unlaunched: extend _drive_every_op"
    specs = list({json.dumps(s, sort_keys=True): s for s in launches}.values())
    (tmp_path / "specs.json").write_text(json.dumps(specs))

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # today's default, stated: silences triton 3.9's warning
    script = Path(__file__).with_name("kernel_compile.py")
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "specs.json"), *TARGETS],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and len(rows) == len(specs) * len(TARGETS), done.stderr[-3000:]
    failed = [f"{r['kernel']} @ {r['target']} {r['args']}: {r.get('error')}" for r in rows if not r["ok"]]
    assert not failed, "\n".join(failed)
