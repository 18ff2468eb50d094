"""Every Triton kernel compiled for Hopper (sm_90) and Ampere (sm_80), ahead of time, on this GPU-less machine.

Triton's interpreter runs a kernel's Python body with numpy: it checks the logic but none of what the compiler
checks (types, constexpr use, layouts, what lowers to PTX). Triton's own compiler needs no GPU to do that: it
takes a kernel and a launch signature to a cubin for a named target, through ``ptxas``. So these tests
1. call every public op in ``gpudist.kernels`` with the Triton path forced, in the interpreter, across the
   variants the library uses (dtypes, residual or none, flags such as weight decay, maximize, skip, AMP scale
   tensor, low-precision copy, stochastic rounding), and record each launch's kernel, arguments and options;
2. compile each distinct launch signature for sm_90 and sm_80 in a subprocess with the interpreter off
   (tests/kernel_compile.py) and expect a cubin from every one;
3. compile the aligned specialization of the hot kernels' launches (what aligned data gets from Triton's
   launcher) for sm_90 and read the SASS with the ``cuobjdump`` inside Triton's wheel: 128-bit global accesses,
   no local memory, registers under a ceiling per kernel (``test_aligned_kernels_vectorize``).
Steps 1-2 catch a kernel that the interpreter accepts and the compiler rejects (a dtype mismatch in ``tl.where``,
a non-constexpr shape, a pointer cast the compiler cannot lower, a constexpr branch that only breaks in one
variant); step 3 a kernel that compiles to scalar accesses, spills or loses occupancy. What they cannot show:
that the compiled code gives the right numbers, or its speed (tests/test_gpu.py and ``gpudist bench kernels`` on
a GPU).
"""

from __future__ import annotations

import json
import os
import struct
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


def _divisible(value) -> bool:
    """Whether Triton's launcher marks this argument divisible by 16 ("D": a 16-byte aligned data pointer, an int
    that is a multiple of 16), by the launcher's own rule."""
    from triton.backends.compiler import BaseBackend

    if isinstance(value, torch.Tensor):
        return BaseBackend.get_tensor_specialization(value, align=True) == "D"
    if isinstance(value, int) and not isinstance(value, bool):
        return BaseBackend.get_int_specialization(value, align=True) == "D"
    return False


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
                "divisible": sorted(k for k, v in given.items() if _divisible(v)),
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
    for max_norm in (None, 1.0):  # a ZeRO step's scalars, with and without clipping
        K.clip_scalars(
            torch.tensor([4.0], dtype=torch.float64), torch.empty(1, dtype=torch.float64), torch.empty(2), max_norm
        )
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
    norm = {"squared_norm": torch.tensor([4.0], dtype=torch.float64)}
    adam += [norm, {**norm, "max_norm": 1.0}]  # the step reads the global norm: skip flag and clip in the kernel
    for kw in adam:
        grad = _randn(N, bf16 if kw.pop("bf16_grad", False) else f32, 3)
        K.adam_step(_randn(N, f32), grad, torch.zeros(N), torch.zeros(N), step=1, lr=1e-2, **kw)
    # Adam over several pieces in one launch (ZeRO-2's every bucket), unaligned offsets (the alignment the plan found)
    grad, state = _randn(3 * N, f32, 3), (torch.zeros(3 * N), torch.zeros(3 * N))
    K.AdamSegments(_randn(3 * N + 8, f32), grad, *state, [(1, 0, N), (N + 5, N, 7)])(grad, step=1, lr=1e-2)
    # SGD with its learning rate a device tensor (a scheduler's; a captured graph reads it)
    grad = _randn(N, f32, 3)
    K.SGDStep(_randn(N, f32), grad, torch.zeros(N))(grad, lr=torch.tensor(0.1), momentum=0.9, **norm, max_norm=1.0)
    # A capturable step: its count and coefficients advanced on the device (3 groups), then the step reading them
    counts, hyper = torch.zeros(3), torch.tensor([[1e-2, 0.1, 0.9, 0.999]] * 3, dtype=torch.float64)
    K.advance_steps(norm["squared_norm"], counts, torch.ones(3), hyper, torch.empty(3, 3))
    grad = _randn(N, f32, 3)
    device_step = K.DeviceStep(torch.ones(()), torch.tensor([-1e-2, 1.0, 1.0]))
    K.AdamStep(_randn(N, f32), grad, torch.zeros(N), torch.zeros(N))(
        grad, step=device_step, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True, **norm, max_norm=1.0
    )
    sgd = [
        {},
        {"momentum": 0.9, "first_step": True},
        {"momentum": 0.9, "nesterov": True},
        {"weight_decay": 0.1},
        {"maximize": True, "grad_scale_tensor": torch.tensor([2.0])},
        {"found_inf": torch.zeros(1)},
        {"param_out": torch.empty(N, dtype=bf16)},
        {"squared_norm": torch.tensor([4.0], dtype=torch.float64), "max_norm": 1.0},
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
        K.quantize_int8(_randn(N, dtype, 6), torch.zeros(N), block_size=64, stochastic=True, seed=3)
    # The radix select's passes: each grad dtype, no residual, a residual of each dtype, both modes (their digit
    # shifts), int32 indices; not every product of these (the compile cost is per specialization).
    for dtype, residual, mode in (
        (f32, None, "exact"),
        (f32, f32, "threshold"),
        (bf16, bf16, "exact"),
        (bf16, f32, "threshold"),
    ):
        K.topk_compress(_randn(N, dtype, 5), None if residual is None else torch.zeros(N, dtype=residual), 10, mode)
    K.topk_compress(_randn(N, f32, 7), torch.zeros(N), 10, "exact", index_dtype=torch.int32)


def _launched_kernels() -> set[str]:
    """Every kernel a launcher in kernels/ starts (``_name_kernel[grid](...)``)."""
    import re

    root = Path(K.__file__).parent
    return {m for f in root.glob("*.py") for m in re.findall(r"(\w+_kernel)\[", f.read_text())}


@pytest.mark.slow  # (12 s of ptxas: in CI's slow tier, with the SASS checks)
def test_every_kernel_compiles_for_hopper_and_ampere(monkeypatch, tmp_path):
    """Catches kernels that pass in the interpreter and fail in Triton's compiler (see the module docstring):
    each distinct launch signature the public ops make must compile to a cubin for sm_90 and sm_80."""
    monkeypatch.setenv("GPUDIST_KERNELS", "triton")
    launches = _record(monkeypatch)
    _drive_every_op()
    assert {s["kernel"] for s in launches} == _launched_kernels(), "a kernel went unlaunched: extend _drive_every_op"
    specs = list({json.dumps(s, sort_keys=True): s for s in launches}.values())
    rows = _compile(specs, tmp_path, targets=TARGETS)
    failed = [f"{r['kernel']} @ {r['target']} {r['args']}: {r.get('error')}" for r in rows if not r["ok"]]
    assert not failed, "\n".join(failed)
    # The clipping epsilon reaches every kernel that clips as the float64 1e-6, a constant (a Python float launch
    # argument would arrive rounded to fp32): the interpreter keeps Python floats in float64, so only the compiled
    # code shows this.
    eps = struct.pack(">d", 1e-6).hex().upper()
    clipping = [r for r in rows if r["args"].get("HAS_CLIP") is True]
    assert {r["kernel"] for r in clipping} == {"_clip_scalars_kernel", "_adam_kernel", "_sgd_kernel"}
    assert all(eps in r["f64_constants"] for r in clipping), [(r["kernel"], r["f64_constants"]) for r in clipping]


# ------------------------------------------------------------------------------------ the aligned specializations
# A multiple of 16, so that the launches get Triton's "D" specialization for their sizes (their fresh tensors get
# it for their pointers); no other size matters to what compiles, so a small one keeps the interpreter quick.
ALIGNED_N = 1024


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _drive_hot_ops(launches: list[dict]) -> None:
    """Launch each hot kernel the way the library does on aligned shards, naming each launch's variant.

    Default block sizes and warps, one dtype per pack/unpack call and a mixed fp32/bf16 list (one launch each),
    ``found_inf`` (or the global
    squared norm, as ZeRO's step passes it) given to the optimizer steps so that they launch no ``squared_norm`` of
    their own.
    """
    f32, bf16 = torch.float32, torch.bfloat16
    n = ALIGNED_N

    def named(variant: str, op, *args, **kwargs) -> None:
        first = len(launches)
        op(*args, **kwargs)
        for launch in launches[first:]:
            launch["variant"] = variant

    for tensor_dtype, bucket in ((f32, f32), (bf16, f32), (f32, bf16)):
        name = f"{_dtype_name(tensor_dtype)}->{_dtype_name(bucket)}"
        tensors = [_randn(n, tensor_dtype), _randn(n // 2, tensor_dtype, 1)]
        flat = torch.empty(n + n // 2, dtype=bucket)
        named(f"pack {name}", K.pack, tensors, flat, scale=0.5)
        named(f"unpack {name}", K.unpack, flat, tensors, scale=2.0)
    mixed = [_randn(n, f32), _randn(n, bf16, 1)]  # one launch for both: a branch per dtype
    flat = torch.empty(2 * n, dtype=f32)
    named("pack float32+bfloat16->float32", K.pack, mixed, flat, scale=0.5)
    named("unpack float32->float32+bfloat16", K.unpack, flat, mixed, scale=2.0)
    for dtype in (f32, bf16):
        named(f"squared_norm {_dtype_name(dtype)}", K.squared_norm, _randn(n, dtype))
    no_skip = {"found_inf": torch.zeros(1)}
    adam = {
        "adam": {},
        "adamw": {"weight_decay": 0.1, "decoupled_weight_decay": True},
        "adam bf16 grad": {"bf16_grad": True},
        "adam bf16 param_out, scale tensor": {"param_out": torch.empty(n, dtype=bf16), "grad_scale_tensor": 2.0},
        "adamw global norm, clip": {"weight_decay": 0.1, "decoupled_weight_decay": True, "clip": True},
    }
    for variant, kw in adam.items():
        grad = _randn(n, bf16 if kw.pop("bf16_grad", False) else f32, 3)
        if "grad_scale_tensor" in kw:
            kw["grad_scale_tensor"] = torch.tensor([kw["grad_scale_tensor"]])
        state = (torch.zeros(n), torch.zeros(n))
        if kw.pop("clip", False):  # ZeRO's step: the skip flag and clip coefficient from the global norm, in-kernel
            kw.update(squared_norm=torch.tensor([4.0], dtype=torch.float64), max_norm=1.0)
        else:
            kw.update(no_skip)
        named(variant, K.adam_step, _randn(n, f32), grad, *state, step=1, lr=1e-2, **kw)
    # ZeRO-2's step: every bucket's owned piece in one launch (a table of chunks; 16-element aligned offsets, as the
    # shards are), with the count and coefficients on the device and the global norm read in the kernel
    grad, state = _randn(4 * n, f32, 3), (torch.zeros(4 * n), torch.zeros(4 * n))
    pieces = [(0, 0, n), (2 * n, n, n), (3 * n + 16, 2 * n, n)]  # (parameter offset, owned offset, length)
    device_step = K.DeviceStep(torch.ones(()), torch.tensor([-1e-2, 1.0, 1.0]))
    named("adamw segments, device step, global norm", K.AdamSegments(_randn(4 * n + 32, f32), grad, *state, pieces),
          grad, step=device_step, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True,
          squared_norm=torch.tensor([4.0], dtype=torch.float64), max_norm=1.0)  # fmt: skip
    sgd = {
        "sgd": {},
        "sgd momentum": {"momentum": 0.9},
        "sgd nesterov bf16 param_out": {"momentum": 0.9, "nesterov": True, "param_out": torch.empty(n, dtype=bf16)},
        "sgd momentum global norm, clip": {"momentum": 0.9, "clip": True},
    }
    for variant, kw in sgd.items():
        buf = torch.zeros(n) if kw.get("momentum") else None
        if kw.pop("clip", False):  # as ZeRO's step calls it
            kw.update(squared_norm=torch.tensor([4.0], dtype=torch.float64), max_norm=1.0)
        else:
            kw.update(no_skip)
        named(variant, K.sgd_step, _randn(n, f32), _randn(n, f32, 4), buf, lr=1e-2, **kw)
    for dtype, residual in ((f32, None), (f32, f32), (bf16, bf16)):
        name = _dtype_name(dtype) + (f", {_dtype_name(residual)} residual" if residual else "")
        grad = _randn(n, dtype, 5)
        named(f"quantize_int8 {name}", K.quantize_int8, grad, residual and torch.zeros(n, dtype=residual))
        named(f"quantize_1bit {name}", K.quantize_1bit, grad, residual and torch.zeros(n, dtype=residual))
    named("quantize_int8 stochastic", K.quantize_int8, _randn(n, f32, 6), torch.zeros(n), stochastic=True, seed=3)
    q, scales = K.quantize_int8(_randn(n, f32, 7))
    named("dequantize_int8_accumulate f32", K.dequantize_int8_accumulate, q, scales, torch.zeros(n))
    bits, scales = K.quantize_1bit(_randn(n, f32, 7))
    named("dequantize_1bit_accumulate f32", K.dequantize_1bit_accumulate, bits, scales, torch.zeros(n))
    for mode, dtype in (("exact", f32), ("threshold", bf16)):  # the radix select's passes, with error feedback
        grad = _randn(n, dtype, 8)
        named(f"topk {mode} {_dtype_name(dtype)}", K.topk_compress, grad, torch.zeros(n, dtype=dtype), 10, mode)


def _compile(specs: list[dict], tmp_path: Path, *flags: str, targets=("cuda:90",)) -> list[dict]:
    """Compile ``specs`` in one subprocess (tests/kernel_compile.py, interpreter off): one row per spec and target."""
    (tmp_path / "specs.json").write_text(json.dumps(specs))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # today's default, stated: silences triton 3.9's warning
    script = Path(__file__).with_name("kernel_compile.py")
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "specs.json"), *targets, *flags],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and len(rows) == len(specs) * len(targets), done.stderr[-3000:]
    return rows


# Per kernel: the most registers per thread it may use, and whether its hot loop must store 128 bits per thread
# per instruction. The ceilings sit a few registers above what triton 3.9 and 3.6 give today (the measured
# range in the comment) and protect occupancy on sm_90 (64K registers per SM, allocated 256 per warp): at 48
# registers a 4-warp program still fits 10 blocks per SM (62% occupancy); the bucket kernel's masked copy of a
# whole 4096-element chunk took 160 registers, 3 blocks (19%).
REGISTER_CEILING = {
    "_bucket_copy_kernel": 48,  # 32-40, 4 warps
    "_adam_kernel": 72,  # 59-64, 4 warps: five fp32 streams, 8 elements each per thread
    "_sgd_kernel": 48,  # 26-38, 4 warps
    "_squared_norm_kernel": 48,  # 27-34, 8 warps
    "_quantize_int8_kernel": 48,  # 25-39, 1-2 warps
    "_quantize_1bit_kernel": 56,  # 20-42, 1-2 warps
    "_dequantize_int8_kernel": 32,  # 17, 2 warps
    "_dequantize_1bit_kernel": 32,  # 14-16, 2 warps
    "_radix_histogram_kernel": 48,  # 30-32 on triton 3.9 (3.6: below), 4 warps: the 256-bin histogram, 2 per thread
    "_radix_filter_kernel": 96,  # 71-80, 4 warps: block-wide int32 ranks of the candidates' slots
    "_radix_count_kernel": 40,  # 22-29, 4 warps
    "_radix_compact_kernel": 96,  # 75-80 on triton 3.9, 8 warps: block-wide int32 ranks plus int64 slots (38%)
    # One program each (occupancy is moot; the ceiling still catches a spill on the way): the 256-bin select
    # (4 warps) and the scan over the programs' counts (16 warps).
    "_radix_select_kernel": 48,  # 32
    "_scan_kernel": 112,  # 92
}


TRITON_36_CEILING = {"_radix_histogram_kernel": 64}
"""Where triton 3.6 (the lent GPU machine's) needs more than :data:`REGISTER_CEILING`: its ``tl.histogram`` with
a mask takes 48-63 registers in the radix histogram (50-62% occupancy on sm_90, measured 2026-11-29), 3.9's 30-32.
The top-k timings on the H200 (docs/results.md#on-a-gpu) were taken with the 3.6 build."""


def _register_ceiling(kernel: str) -> int:
    import triton

    old = tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7)
    return TRITON_36_CEILING.get(kernel, REGISTER_CEILING[kernel]) if old else REGISTER_CEILING[kernel]


def _needs_wide_store(row: dict) -> bool:
    """Whether a launch's SASS must hold a 128-bit global store; the exceptions cannot, by what they write.

    - squared_norm writes one fp32 partial sum per program;
    - quantize without a residual writes only codes and one scale per block: int8 codes are 4 per thread (a
      32-bit store; 16 per thread would leave a 256-element block to 16 threads), 1-bit codes one byte per 8
      elements. With a residual, the residual's store is 128-bit;
    - the radix select's histogram passes store nothing but the first one's ``acc`` (128-bit); its filter and its
      compaction scatter each entry to its slot, its count pass writes two counts per program, and the scan is one
      program over the programs' interleaved counts.
    """
    variant, kernel = row["variant"], row["kernel"]
    scattered = ("_radix_filter_kernel", "_radix_count_kernel", "_radix_compact_kernel", "_scan_kernel")
    if variant.startswith("squared_norm") or kernel in scattered:
        return False
    if kernel == "_radix_histogram_kernel":
        return row["args"]["FUSE_ADD"]
    return not (variant.startswith("quantize") and "residual" not in variant and "stochastic" not in variant)


def _needs_wide_load(row: dict) -> bool:
    """Whether a launch's SASS must hold a 128-bit global load: all but the radix select's scan (one program over
    interleaved pairs of counts), its compaction of 16-bit data (4 elements per thread at 8 warps), and its
    histograms of the candidates (masked by a count read on the device, which no alignment hint covers)."""
    if row["kernel"] == "_scan_kernel":
        return False
    if row["kernel"] == "_radix_histogram_kernel" and not row["args"]["FIRST"]:
        return False
    return not (row["kernel"] == "_radix_compact_kernel" and "bfloat16" in row["variant"])


def _hands_over_partials(ordering: list[str]) -> bool:
    """Whether the norm's ticket is taken as the one-launch sum needs: a block barrier (every thread's partial is
    stored), a GPU-scope fence, the GPU-scope atomic add (the release), then an L1 invalidation (the acquire, before
    the last program reads the partials), in that order."""
    want = [lambda op: op.startswith("BAR.SYNC"), lambda op: op.startswith("MEMBAR") and op.endswith("GPU")]
    want += [lambda op: op.startswith("ATOMG") and ".ADD" in op and "GPU" in op, lambda op: op == "CCTL.IVALL"]
    for op in ordering:
        if want and want[0](op):
            want.pop(0)
    return not want


@pytest.mark.slow
def test_aligned_kernels_vectorize(monkeypatch, tmp_path):
    """Catches a hot kernel that loses its 128-bit global accesses, spills, or grows past its register ceiling.

    Real launches on aligned data (ZeRO/FSDP shards are padded to 16 elements and 64-byte starts, buckets are
    fresh allocations) get Triton's divisibility-16 specialization; this test compiles that specialization of
    each hot kernel's launches (recorded as the library makes them: default block sizes and warps, the
    variants of dtype, residual, momentum, low-precision copy) for sm_90 and reads the SASS:
    - at least one LDG.E.128 in every variant (``_needs_wide_load``), and an STG.E.128 in each one that writes a
      full-size stream (``_needs_wide_store``); for bf16 data a 128-bit access is 8 elements. Scalar accesses are what a
      lost alignment hint, a mask the compiler cannot prove uniform over 16 bytes, or too few elements per
      thread produce (the bucket kernel's masked 4096-element copy compiled to 32-bit LDG.E/STG.E only);
    - no local memory: no LDL/STL, no stack (a spill);
    - registers at most ``REGISTER_CEILING`` (occupancy, see there);
    - the squared norm's one-launch sum: the partials handed to the last program through a release/acquire ticket
      (``_hands_over_partials``); without the fence the last program could sum partials not yet visible to it.
    It cannot show the speed these buy (``gpudist bench kernels`` on a GPU). With ``GPUDIST_SASS_ROWS`` set it
    also writes its rows there (``python -m tests.kernel_compile --write``).
    """
    monkeypatch.setenv("GPUDIST_KERNELS", "triton")
    launches = _record(monkeypatch)
    _drive_hot_ops(launches)
    specs = {}
    for launch in launches:
        if "variant" in launch:  # not the launches that only make inputs (quantize before dequantize)
            specs.setdefault(json.dumps({k: v for k, v in launch.items() if k != "variant"}, sort_keys=True), launch)
    rows = _compile(list(specs.values()), tmp_path, "--aligned", "--sass")
    if os.environ.get("GPUDIST_SASS_ROWS"):
        Path(os.environ["GPUDIST_SASS_ROWS"]).write_text(json.dumps(rows))
    assert {r["kernel"] for r in rows} == set(REGISTER_CEILING), "a hot kernel went unlaunched or is new"
    problems = []
    for row in rows:
        name, sass = f"{row['variant']} ({row['kernel']})", row.get("sass")
        if sass is None:
            problems.append(f"{name}: did not compile: {row.get('error')}")
            continue
        if _needs_wide_load(row) and not sass["loads"].get("128"):
            problems.append(f"{name}: no 128-bit global load; loads by width {sass['loads']}")
        if _needs_wide_store(row) and not sass["stores"].get("128"):
            problems.append(f"{name}: no 128-bit global store; stores by width {sass['stores']}")
        if sass["local_accesses"] or sass["local_bytes"] or sass["stack_bytes"]:
            problems.append(f"{name}: local memory (spills): {sass['local_accesses']} LDL/STL, {sass['local_bytes']} B")
        if row["kernel"] == "_squared_norm_kernel" and not _hands_over_partials(sass["ordering"]):
            problems.append(f"{name}: no release/acquire around the ticket: {sass['ordering']}")
        if sass["registers"] > _register_ceiling(row["kernel"]):
            problems.append(
                f"{name}: {sass['registers']} registers > ceiling {_register_ceiling(row['kernel'])} "
                f"(occupancy {sass['occupancy']:.0%} on sm_90)"
            )
    assert not problems, "\n".join(problems)
