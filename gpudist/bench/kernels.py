"""Kernel benchmarks: each gpudist kernel against its PyTorch baseline, in the same run, on the same tensors.

For every op: time per call (median over interleaved rounds), GB/s counting the bytes the op must read
plus write, that bandwidth as a fraction of a device-to-device copy measured in the same run, and the
baseline's time with the ratio baseline/ours (> 1: gpudist is faster). On CUDA the Triton kernels run;
elsewhere the torch path runs (it must not be slower than the baselines).

Baselines (what a PyTorch user writes today): pack = ``torch.cat`` + ``mul_``; unpack =
``torch._foreach_copy_`` + ``torch._foreach_mul_``; Adam/SGD = ``torch.optim.Adam/SGD(fused=True)``;
squared norm = ``torch.linalg.vector_norm(x).square()``; top-k = ``torch.topk`` plus the elementwise
error-feedback ops; quantization = the same math in torch elementwise ops. gpudist's pack and unpack run through
a :class:`~gpudist.kernels.PackPlan` built once, as a strategy's bucket runs them every step (the functions
``pack``/``unpack`` validate and lay out their arguments on every call: ~100 us of host time on an H200's host).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from .. import kernels as K
from ..fileio import atomic_write_json
from .collectives import environment

__all__ = [
    "OPS",
    "copy_bandwidth",
    "default_elements",
    "default_sizes",
    "format_kernel_table",
    "measure_kernel",
    "round_times",
    "run_kernels",
    "time_variants",
]


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    def cpu(fn, iters):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters

    def cuda(fn, iters):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3 / iters

    return cuda if device.type == "cuda" else cpu


def round_times(
    variants: dict[str, Callable[[], object]], device, rounds: int = 7, target_s: float = 0.05
) -> tuple[dict[str, list[float]], int]:
    """Seconds per call of each variant in each of ``rounds`` rounds, and the calls per round. Round-robin (every
    variant once per round, the order reversed every other round), so machine noise hits all alike; the calls per
    round are chosen so that one round of the slowest variant takes about ``target_s`` (at most 100)."""
    timer = _timer(device)
    for fn in variants.values():  # warm-up: compilation, allocator, caches
        fn()
        fn()
    once = max(timer(fn, 1) for fn in variants.values())
    iters = int(min(100, max(1, target_s / max(once, 1e-6))))
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants.items())
    for r in range(rounds):
        for name, fn in order if r % 2 == 0 else reversed(order):  # A B, B A, ...: neither always runs first
            times[name].append(timer(fn, iters))
    return times, iters


def time_variants(variants: dict[str, Callable[[], object]], device, rounds: int = 7, target_s: float = 0.05):
    """Median seconds per call of each variant (over :func:`round_times`' rounds), and the calls per round."""
    times, iters = round_times(variants, device, rounds, target_s)
    return {name: statistics.median(t) for name, t in times.items()}, iters


def _model_like_sizes(total: int, count: int = 100) -> list[int]:
    """``count`` gradient sizes of a transformer (12 tensors per block: weights, biases, norms) holding about
    ``total`` parameters."""
    layers = -(-count // 12)
    d = max(8, int(math.sqrt(total / (12 * layers))))
    per_layer = [3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d, d, d]
    return (per_layer * layers)[:count]


# Each op builder returns (bytes read + written, {"gpudist": fn, "torch": fn}, extra info).


def _op_pack(n, device, bucket_dtype, count=100):
    tensors = [torch.randn(s, device=device) for s in _model_like_sizes(n, count)]
    out = torch.empty(sum(t.numel() for t in tensors), device=device, dtype=bucket_dtype)
    flat = [t.view(-1) for t in tensors]
    scale = 0.5

    def baseline():
        torch.cat(flat, out=out)
        out.mul_(scale)

    moved = out.numel() * (4 + out.element_size())
    plan = K.PackPlan(tensors, out)  # what a strategy's bucket runs every step (the function validates each call)
    return moved, {"gpudist": lambda: plan.pack(scale), "torch": baseline}, {"tensors": len(tensors), "via": "PackPlan"}


def _op_unpack(n, device, bucket_dtype, count=100):
    tensors = [torch.empty(s, device=device) for s in _model_like_sizes(n, count)]
    flat = torch.randn(sum(t.numel() for t in tensors), device=device).to(bucket_dtype)
    pieces = [p.view(t.shape) for p, t in zip(flat.split([t.numel() for t in tensors]), tensors, strict=True)]

    def baseline():
        torch._foreach_copy_(tensors, pieces)
        torch._foreach_mul_(tensors, 0.5)

    moved = flat.numel() * (4 + flat.element_size())
    plan = K.PackPlan(tensors, flat)
    return moved, {"gpudist": lambda: plan.unpack(0.5), "torch": baseline}, {"tensors": len(tensors), "via": "PackPlan"}


def _op_adam(n, device, lowp_copy):
    p = torch.randn(n, device=device)
    grad, m, v = torch.randn_like(p), torch.zeros_like(p), torch.zeros_like(p)
    out = torch.empty(n, device=device, dtype=torch.bfloat16) if lowp_copy else None
    ref = p.clone().requires_grad_()
    ref.grad = grad.clone()
    opt = torch.optim.Adam([ref], lr=1e-4, fused=True)

    def baseline():
        opt.step()
        if lowp_copy:
            out.copy_(ref.detach())

    ours = lambda: K.adam_step(p, grad, m, v, step=10, lr=1e-4, check_finite=False, param_out=out)
    moved = n * (4 * 4 + 3 * 4 + (2 if lowp_copy else 0))
    return moved, {"gpudist": ours, "torch": baseline}, {}


def _op_sgd(n, device):
    p = torch.randn(n, device=device)
    grad, buf = torch.randn_like(p), torch.zeros_like(p)
    ref = p.clone().requires_grad_()
    ref.grad = grad.clone()
    opt = torch.optim.SGD([ref], lr=1e-4, momentum=0.9, fused=True)
    ours = lambda: K.sgd_step(p, grad, buf, lr=1e-4, momentum=0.9, check_finite=False)
    return n * 20, {"gpudist": ours, "torch": opt.step}, {}


def _op_norm(n, device, dtype=torch.float32):
    x = torch.randn(n, device=device).to(dtype)
    baseline = lambda: torch.linalg.vector_norm(x, dtype=torch.float32).square()
    return n * x.element_size(), {"gpudist": lambda: K.squared_norm(x), "torch": baseline}, {}


def _op_topk(n, device, mode, ratio=0.01, dtype=torch.float32):
    from ..kernels.topk import topk_compress, topk_recall

    k = max(1, int(n * ratio))
    grad = torch.randn(n, device=device).to(dtype)
    residual = (torch.randn(n, device=device) * 0.1).to(dtype)
    r_torch = residual.clone()

    def baseline():
        r_torch.add_(grad)
        idx = r_torch.abs().topk(k, sorted=False).indices
        values = r_torch[idx]
        r_torch.index_fill_(0, idx, 0.0)
        return values, idx

    acc = grad + residual
    result = topk_compress(grad, residual.clone(), k, mode=mode)
    extra = {"k": k, "ratio": ratio, "recall": topk_recall(acc, result.indices, k)}
    ours = lambda: topk_compress(grad, residual, k, mode=mode)
    return n * 3 * grad.element_size(), {"gpudist": ours, "torch": baseline}, extra


def _op_quantize(n, device, bits, block=256, dtype=torch.float32):
    from ..kernels import quantize as Q

    n = n // block * block
    grad = torch.randn(n, device=device).to(dtype)
    residual = torch.zeros_like(grad)
    r_torch = residual.clone()
    shifts = torch.arange(8, device=device, dtype=torch.uint8)

    def baseline_int8():
        r_torch.add_(grad)
        blocks = r_torch.view(-1, block)
        scale = blocks.abs().amax(1, keepdim=True) / 127
        q = torch.round(blocks / scale).clamp_(-127, 127)
        blocks.sub_(q * scale)
        return q.to(torch.int8), scale

    def baseline_1bit():
        r_torch.add_(grad)
        blocks = r_torch.view(-1, block)
        scale = blocks.abs().mean(1, keepdim=True)
        negative = blocks < 0
        packed = (negative.view(-1, 8).to(torch.uint8) << shifts).sum(1, dtype=torch.uint8)
        blocks.sub_(torch.where(negative, -scale, scale))
        return packed, scale

    size = grad.element_size()  # grad and residual read, residual written; then the codes
    if bits == 8:
        ours = lambda: Q.quantize_int8(grad, residual, block_size=block)
        return n * (3 * size + 1), {"gpudist": ours, "torch": baseline_int8}, {"block_size": block}
    ours = lambda: Q.quantize_1bit(grad, residual, block_size=block)
    return n * 3 * size + n // 8, {"gpudist": ours, "torch": baseline_1bit}, {"block_size": block}


def _op_dequantize_accumulate(n, device, block=256):
    from ..kernels import quantize as Q

    n = n // block * block
    q, scales = Q.quantize_int8(torch.randn(n, device=device), block_size=block)
    out = torch.zeros(n, device=device)
    baseline = lambda: out.view(-1, block).add_(q.view(-1, block).float() * scales.view(-1, 1))
    ours = lambda: Q.dequantize_int8_accumulate(q, scales, out, block_size=block)
    return n * 9, {"gpudist": ours, "torch": baseline}, {"block_size": block}


OPS: dict[str, Callable] = {
    "pack_fp32": lambda n, d: _op_pack(n, d, torch.float32),
    "pack_bf16": lambda n, d: _op_pack(n, d, torch.bfloat16),
    "unpack_fp32": lambda n, d: _op_unpack(n, d, torch.float32),
    "unpack_bf16": lambda n, d: _op_unpack(n, d, torch.bfloat16),
    "pack_fp32_300": lambda n, d: _op_pack(n, d, torch.float32, 300),
    "pack_bf16_300": lambda n, d: _op_pack(n, d, torch.bfloat16, 300),
    "unpack_fp32_300": lambda n, d: _op_unpack(n, d, torch.float32, 300),
    "unpack_bf16_300": lambda n, d: _op_unpack(n, d, torch.bfloat16, 300),
    "adam": lambda n, d: _op_adam(n, d, lowp_copy=False),
    "adam_bf16_copy": lambda n, d: _op_adam(n, d, lowp_copy=True),
    "sgd_momentum": _op_sgd,
    "squared_norm": _op_norm,
    "squared_norm_bf16": lambda n, d: _op_norm(n, d, torch.bfloat16),
    "topk_exact_1pct": lambda n, d: _op_topk(n, d, "exact"),
    "topk_threshold_1pct": lambda n, d: _op_topk(n, d, "threshold"),
    "topk_exact_1pct_bf16": lambda n, d: _op_topk(n, d, "exact", dtype=torch.bfloat16),
    "topk_threshold_1pct_bf16": lambda n, d: _op_topk(n, d, "threshold", dtype=torch.bfloat16),
    "quantize_int8": lambda n, d: _op_quantize(n, d, 8),
    "quantize_1bit": lambda n, d: _op_quantize(n, d, 1),
    "quantize_int8_bf16": lambda n, d: _op_quantize(n, d, 8, dtype=torch.bfloat16),
    "quantize_1bit_bf16": lambda n, d: _op_quantize(n, d, 1, dtype=torch.bfloat16),
    "dequantize_int8_accumulate": _op_dequantize_accumulate,
}


def copy_bandwidth(n: int, device: torch.device, rounds: int = 7) -> float:
    """GB/s of ``dst.copy_(src)`` on ``n`` fp32 elements, counting read + write, as nvbandwidth-style D2D copy."""
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    times, _ = time_variants({"copy": lambda: dst.copy_(src)}, device, rounds)
    return 2 * src.numel() * 4 / times["copy"] / 1e9


def _targets(row: dict, device: torch.device, n: int) -> dict:
    """The issue's targets that apply to this row, each with whether it was met."""
    out = {}
    if device.type == "cuda":
        big = n >= (1 << 26)
        if big and row["op"].split("_")[0] in ("pack", "unpack", "quantize", "adam"):
            out["fraction_of_copy>=0.85"] = row["fraction_of_copy"] >= 0.85
        if row["op"] == "adam":
            out["speedup_vs_torch_fused>=1.1"] = row["speedup"] >= 1.1
        if row["op"] == "topk_threshold_1pct" and big:
            out["speedup_vs_torch_topk>=3"] = row["speedup"] >= 3.0
            out["recall>=0.99"] = row["recall"] >= 0.99
    else:
        # Timings on shared CPUs jitter by a few percent; 0.95 separates "as fast" from "slower".
        out["not_slower_than_torch(>=0.95)"] = row["speedup"] >= 0.95
    return out


def measure_kernel(
    op: str, n: int, device: torch.device, rounds: int, copy_gbps: float, target_s: float = 0.05
) -> dict:
    """One row of the kernel table: ``OPS[op]`` on ``n`` elements, gpudist against its torch baseline in interleaved
    rounds. ``rounds_s`` holds every round's seconds per call of both ("gpudist", "torch"); the other times are
    their medians; ``target_s``: about how long a variant runs per round. ``speedup`` = torch time / gpudist time
    (> 1: gpudist faster). What ``gpudist bench kernels`` and
    the pytest-benchmark tier (``benchmarks/test_kernels.py``) both measure."""
    moved, variants, extra = OPS[op](n, device)
    per_round, iters = round_times(variants, device, rounds, target_s)
    del variants
    if device.type == "cuda":
        torch.cuda.empty_cache()
    ours, base = statistics.median(per_round["gpudist"]), statistics.median(per_round["torch"])
    return {
        "op": op,
        "elements": n,
        "bytes_moved": moved,
        "iters": iters,
        "gpudist_s": ours,
        "torch_s": base,
        "gpudist_GBps": moved / ours / 1e9,
        "torch_GBps": moved / base / 1e9,
        "speedup": base / ours,
        **extra,
        "fraction_of_copy": moved / ours / 1e9 / copy_gbps,
        "rounds_s": per_round,
    }


def default_elements(device: torch.device) -> int:
    """Elements per op when none are asked for: 2^26 on CUDA (256 MiB of fp32, past every cache), 2^22 on CPU (16 MiB,
    past the CI machine's L2)."""
    return 1 << 26 if device.type == "cuda" else 1 << 22


def run_kernels(
    device: str = "auto",
    elements: int | Sequence[int] | None = None,
    ops: list[str] | None = None,
    rounds: int = 7,
    json_path: str | os.PathLike | None = None,
) -> dict:
    """Benchmark ``ops`` (default: all) at each size in ``elements`` (default :func:`default_sizes`: 4M, 16M and 64M
    on CUDA, 4M on CPU), against a device-to-device copy of each size."""
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    )
    sizes = default_sizes(dev) if elements is None else (elements,) if isinstance(elements, int) else tuple(elements)
    ops = ops or list(OPS)
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        raise ValueError(f"unknown kernel benchmark op(s) {unknown}; available: {', '.join(OPS)}")
    torch.manual_seed(0)
    rows, copies = [], {}
    for n in sizes:
        copies[n] = copy_gbps = copy_bandwidth(n, dev, rounds)
        for op in ops:
            row = measure_kernel(op, n, dev, rounds, copy_gbps)
            del row["rounds_s"]
            row["targets"] = _targets(row, dev, n)
            rows.append(row)
    doc = {
        "benchmark": "kernels",
        "device": str(dev),
        "implementation": "triton" if K.use_triton(torch.empty(0, device=dev)) else "torch",
        "elements": list(sizes),
        "copy_GBps": {str(n): gbps for n, gbps in copies.items()},
        "rounds": rounds,
        "environment": environment(),
        "rows": rows,
    }
    print(format_kernel_table(doc))
    if json_path is not None:
        print(f"# wrote {atomic_write_json(json_path, doc)}")
    return doc


def default_sizes(device: torch.device) -> tuple[int, ...]:
    """Sizes per op when none are asked for: 4M, 16M and 64M elements on CUDA (4M sits inside an H100's 50 MiB L2,
    where launch and host time show; the others are past it), 4M on CPU."""
    return (1 << 22, 1 << 24, 1 << 26) if device.type == "cuda" else (1 << 22,)


def _size_text(n: int) -> str:
    for unit, shift in (("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def format_kernel_table(doc: dict) -> str:
    env = doc["environment"]
    where = env["gpu"] if doc["device"].startswith("cuda") else env["cpu"]
    copies = ", ".join(f"{_size_text(int(n))}: {gbps:.1f}" for n, gbps in doc["copy_GBps"].items())
    lines = [
        f"# gpudist kernels ({doc['implementation']}) on {doc['device']} ({where}); copy bandwidth (read+write, "
        f"GB/s) {copies}; times: median of {doc['rounds']} rounds",
        f"{'op':>28} {'elements':>9} {'gpudist(us)':>12} {'GB/s':>8} {'of copy':>8} {'torch(us)':>10} {'GB/s':>8} "
        f"{'speedup':>8}  notes",
    ]
    for r in doc["rows"]:
        notes = [f"recall={r['recall']:.4f}"] if "recall" in r else []
        notes += [f"{k}:{'met' if v else 'NOT met'}" for k, v in r["targets"].items()]
        lines.append(
            f"{r['op']:>28} {r['elements']:>9} {r['gpudist_s'] * 1e6:>12.1f} {r['gpudist_GBps']:>8.1f} "
            f"{r['fraction_of_copy']:>8.2f} {r['torch_s'] * 1e6:>10.1f} {r['torch_GBps']:>8.1f} "
            f"{r['speedup']:>8.2f}  {' '.join(notes)}"
        )
    lines.append("# speedup = torch time / gpudist time on the same tensors (> 1: gpudist faster)")
    return "\n".join(lines)
