"""Int8 and 1-bit gradient quantization with per-block scales and error feedback.

Sending side: ``acc = grad + residual`` is quantized block by block (``block_size`` elements share one fp32
scale) and the residual keeps what the quantization lost, ``residual = acc - dequant(quant(acc))``, in the
same pass, so nothing is dropped for good: it is sent with a later step. Receiving side: ``dequantize_*``
writes the values, ``dequantize_*_accumulate`` adds them into a running sum in one pass.

Formats (what travels over the wire):

- int8: ``q`` int8[n] and ``scales`` float32[ceil(n / block_size)]; ``scale = absmax(block) / 127``,
  ``value = q * scale``; q is ``acc / scale`` rounded to nearest-even (``torch.round``) or stochastically.
- 1-bit: ``bits`` uint8[ceil(n / 8)] and ``scales`` float32[nblocks]; ``scale = mean(|acc|)`` over the
  block's elements; element ``8j + i`` is bit ``i`` (LSB first) of byte ``j``, a set bit means negative, so
  ``value = scale * (1 - 2 * bit)`` and the zero padding of the last byte reads as bit 0.

All arithmetic is fp32 whatever the storage dtype (fp32, bf16 or fp16). The int8 kernels divide with IEEE
rounding and run with FMA contraction off, so ``acc - q * scale`` rounds exactly as the torch reference does:
int8 results are bit-for-bit equal, and ``dequant + residual == acc`` exactly in fp32 for round-to-nearest.
1-bit results equal the reference up to the summation order of the block's scale.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._triton import cast_rne, tl, triton
from .dispatch import use_triton

__all__ = [
    "check_block_size",
    "dequantize_1bit",
    "dequantize_1bit_accumulate",
    "dequantize_1bit_accumulate_reference",
    "dequantize_1bit_accumulate_triton",
    "dequantize_1bit_reference",
    "dequantize_1bit_triton",
    "dequantize_int8",
    "dequantize_int8_accumulate",
    "dequantize_int8_accumulate_reference",
    "dequantize_int8_accumulate_triton",
    "dequantize_int8_reference",
    "dequantize_int8_triton",
    "quantize_1bit",
    "quantize_1bit_reference",
    "quantize_1bit_triton",
    "quantize_int8",
    "quantize_int8_reference",
    "quantize_int8_triton",
]

#: Storage dtypes accepted for gradients, residuals and dequantized outputs.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT8_MAX = 127
# Triton fuses ``a - b * c`` into one FMA by default; the torch reference rounds the product first. Turning
# contraction off keeps both paths bit-identical (the interpreter ignores the option).
_NO_FMA = {"enable_fp_fusion": False}


def _num_warps(block_size: int, element_size: int) -> int:
    """Warps for a program of one quantization block: enough that each thread holds 16 bytes of float data.

    One program quantizes one block, so the block's elements are all there is to spread over the threads. With
    Triton's default 4 warps a 256-element block left each thread 2 elements: 64-bit loads of fp32, 32-bit of
    bf16 (tests/kernel_compile.py's SASS report, sm_90, triton 3.9). 16 bytes per thread is one 128-bit access:
    2 warps for fp32 and 1 for bf16 at the default block of 256 (at most 32 blocks per SM, so 1 warp per
    program caps occupancy at 50%, with the same bytes in flight per SM as 2 warps of 64-bit loads), at most 8.
    """
    return max(1, min(8, block_size * element_size // (16 * 32)))


# ----------------------------------------------------------------------------------------------- validation


def check_vector(
    name: str,
    tensor: object,
    dtypes: tuple[torch.dtype, ...],
    *,
    numel: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Raise a TypeError/ValueError naming ``name`` unless ``tensor`` is a contiguous 1-D tensor as required."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} has dtype {tensor.dtype}; expected {allowed}")
    if tensor.dim() != 1:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; pass a 1-D tensor ({name}.view(-1))")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} is not contiguous (stride {tensor.stride()}); pass {name}.contiguous()")
    if numel is not None and tensor.numel() != numel:
        raise ValueError(f"{name} has {tensor.numel()} elements; expected {numel}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but the other inputs are on {device}; move it to {device}")
    return tensor


def check_block_size(block_size: object) -> int:
    """Validate a quantization block size (elements per scale), the rule every quantize/dequantize op applies.

    Args:
        block_size: The candidate block size.

    Returns:
        ``block_size``, unchanged.

    Raises:
        TypeError: When ``block_size`` is not an int (a bool is not one).
        ValueError: When ``block_size`` is not a power of two from 32 to 4096.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if not (32 <= block_size <= 4096 and block_size & (block_size - 1) == 0):
        raise ValueError(f"block_size={block_size} must be a power of two between 32 and 4096 (e.g. 256)")
    return block_size


def _num_blocks(n: int, block_size: int) -> int:
    return (n + block_size - 1) // block_size


def _check_grad_residual(grad: object, residual: object, block_size: object) -> None:
    check_vector("grad", grad, FLOAT_DTYPES)
    if residual is not None:
        check_vector("residual", residual, FLOAT_DTYPES, numel=grad.numel(), device=grad.device)
    check_block_size(block_size)


def _check_out(out: object, n: int, device: torch.device, dtype: torch.dtype | None) -> None:
    check_vector("out", out, FLOAT_DTYPES, numel=n, device=device)
    if dtype is not None and out.dtype != dtype:
        raise ValueError(f"out has dtype {out.dtype} but dtype={dtype}; pass one of them, or make them agree")


def _new_out(out: torch.Tensor | None, n: int, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
    """``out`` itself, or a new buffer of ``dtype`` (default float32)."""
    if out is not None:
        return out
    return torch.empty(n, dtype=dtype or torch.float32, device=device)


def _check_int8_payload(q: object, scales: object, block_size: object) -> None:
    check_vector("q", q, (torch.int8,))
    check_block_size(block_size)
    check_vector("scales", scales, (torch.float32,), numel=_num_blocks(q.numel(), block_size), device=q.device)


def _check_1bit_payload(bits: object, scales: object, n: object, block_size: object) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n={n!r} must be a non-negative int: the number of elements that were quantized")
    check_vector("bits", bits, (torch.uint8,), numel=(n + 7) // 8)
    check_block_size(block_size)
    check_vector("scales", scales, (torch.float32,), numel=_num_blocks(n, block_size), device=bits.device)


def _check_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
        raise ValueError(f"seed={seed!r} must be an int in [0, 2**31); pass e.g. the step number")
    return seed


# ------------------------------------------------------------------------------------------------------ int8


@triton.jit
def _round_half_even(x):
    """``torch.round`` (half to even) for |x| < 2**22 with plain tl ops: libdevice's rint is CUDA-only."""
    f = tl.floor(x)
    frac = x - f  # exact: f and x share their exponent range
    fi = f.to(tl.int32)
    up = (frac > 0.5) | ((frac == 0.5) & ((fi & 1) == 1))
    return fi + up.to(tl.int32)


@triton.jit
def _quantize_int8_kernel(
    grad_ptr,
    residual_ptr,
    q_ptr,
    scales_ptr,
    n,
    seed,
    HAS_RESIDUAL: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per quantization block: the absmax reduction never crosses programs.
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        acc += tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # div_rn, not `/`: compiled for CUDA, fp32 `/` is div.full.f32 (up to 2 ulp off, triton-lang/triton#10661)
    # and q would then differ from torch's wherever acc / scale lands next to a rounding boundary.
    scale = tl.div_rn(tl.max(tl.abs(acc), axis=0), 127.0)
    # An all-zero block has scale 0: dividing by 1 instead keeps q = 0 and avoids 0/0.
    x = tl.div_rn(acc, tl.where(scale > 0.0, scale, 1.0))
    if STOCHASTIC:
        # floor + Bernoulli(frac) rather than floor(x + u): x + u can round up to x + 1 when x is an integer.
        f = tl.floor(x)
        u = tl.rand(seed, offs)
        q = f.to(tl.int32) + (u < x - f).to(tl.int32)
    else:
        q = _round_half_even(x)
    q = tl.minimum(tl.maximum(q, -127), 127)
    tl.store(q_ptr + offs, q.to(tl.int8), mask=mask)
    tl.store(scales_ptr + pid, scale)
    if HAS_RESIDUAL:
        err = acc - q.to(tl.float32) * scale
        tl.store(residual_ptr + offs, cast_rne(err, residual_ptr.dtype.element_ty), mask=mask)


def quantize_int8_triton(
    grad: torch.Tensor,
    residual: torch.Tensor | None = None,
    *,
    block_size: int = 256,
    stochastic: bool = False,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch :func:`_quantize_int8_kernel`: one program per block of ``block_size`` elements."""
    n = grad.numel()
    nblocks = _num_blocks(n, block_size)
    q = torch.empty(n, dtype=torch.int8, device=grad.device)
    scales = torch.empty(nblocks, dtype=torch.float32, device=grad.device)
    if n:
        _quantize_int8_kernel[(nblocks,)](
            grad,
            grad if residual is None else residual,  # never read when HAS_RESIDUAL is False
            q,
            scales,
            n,
            seed,
            HAS_RESIDUAL=residual is not None,
            STOCHASTIC=stochastic,
            BLOCK=block_size,
            num_warps=_num_warps(block_size, grad.element_size()),
            **_NO_FMA,
        )
    return q, scales


# The torch references are the CPU fallback, so they must not be slower than plain torch elementwise code
# (gpudist.bench.kernels's baselines). Timings in the comments below: 4M elements, block 256, fp32, 2-core CPU,
# torch 2.13, ``python -m benchmarks.kernels``. Two things make the difference. (1) No padding copy: the whole
# blocks are a zero-copy ``view(-1, block_size)`` of the input, and only the ragged last block (< block_size
# elements) is copied into a zero-padded row; ``F.pad`` of the whole tensor cost a full copy each time.
# (2) In-place ops and ``out=`` into one scratch buffer instead of a new full-size temporary per op. Every
# value is still computed by the same torch op on the same fp32 operands as before (same roundings), so the
# results are bit-for-bit those of the straightforward formulation the Triton kernels are tested against.


def _accumulate(grad: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """``grad + residual`` in fp32, computed once.

    With an fp32 residual the sum is formed in the residual itself (``residual.add_(grad)`` adds in fp32 for
    a bf16/fp16 grad too): it becomes ``acc``, and the quantizers then turn it into ``acc - dequant`` in
    place, saving a full-size temporary and the final copy back. A bf16/fp16 residual gets an fp32 copy
    (the math is fp32 whatever the storage). Without a residual, an fp32 grad is used as is (read only).
    """
    if residual is None:
        return grad.float()
    if residual.dtype == torch.float32:
        return residual.add_(grad)
    return grad.to(torch.float32, copy=True).add_(residual)


def _split_blocks(n: int, block_size: int) -> tuple[int, int]:
    """``(m, nfull)``: ``m`` elements in the ``nfull`` whole blocks; ``n - m`` are left for the ragged block."""
    nfull = n // block_size
    return nfull * block_size, nfull


def _padded_row(tail: torch.Tensor, block_size: int) -> torch.Tensor:
    """The ragged last block (``tail``, under ``block_size`` elements) zero-padded to a (1, block_size) row."""
    row = torch.zeros(1, block_size, dtype=tail.dtype, device=tail.device)
    row[0, : tail.numel()] = tail
    return row


def _quantize_int8_rows(
    acc: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, u: torch.Tensor | None, update: bool
) -> None:
    """Quantize the (rows, block_size) fp32 ``acc`` into ``q`` (int8, same shape) and ``scales`` (rows,).

    ``u`` holds stochastic-rounding uniforms (None: round to nearest-even). With ``update`` ``acc`` becomes
    ``acc - q * scale`` in place (product rounded to fp32 first, then the subtraction, as the kernel does).
    """
    # One scratch buffer for |acc|, then acc / scale, then q, then q * scale, instead of four temporaries.
    # abs(out=) + amax(out=) also beat aminmax on CPU and keep the exact same absmax.
    work = torch.abs(acc, out=torch.empty_like(acc))
    torch.amax(work, dim=1, out=scales)
    # A 0-dim tensor divisor on the scales' device, not a Python number: CUDA divides by a CPU scalar as a
    # multiply by its reciprocal, which can differ by an ulp from the kernel's IEEE division (div_rn).
    scales.div_(torch.tensor(float(_INT8_MAX), device=scales.device))
    # An all-zero block has scale 0: dividing by 1 instead keeps q = 0 and avoids 0/0.
    x = torch.div(acc, torch.where(scales > 0, scales, 1.0)[:, None], out=work)
    if u is not None:
        floor = torch.floor(x)
        x = floor.add_(torch.lt(u, x.sub_(floor)))  # floor + (u < x - floor): up with probability frac
    else:
        x.round_()  # half to even, in place
    x.clamp_(-_INT8_MAX, _INT8_MAX)  # needed: stochastic q can reach 128, and so can q for a subnormal absmax
    q.copy_(x)
    if update:
        acc.sub_(x.mul_(scales[:, None]))


def quantize_int8_reference(
    grad: torch.Tensor,
    residual: torch.Tensor | None = None,
    *,
    block_size: int = 256,
    stochastic: bool = False,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch version of :func:`quantize_int8_triton` (same results in round-to-nearest mode).

    Stochastic mode draws its uniforms from ``torch.Generator().manual_seed(seed)`` instead of Triton's
    Philox stream, so the two implementations agree in distribution, not bit for bit.
    """
    # The add forms acc in the residual, the whole blocks are viewed rather than padded, and every step runs in
    # place in one scratch buffer (see above); a good part of what is left is the first touch of that buffer.
    n = grad.numel()
    q = torch.empty(n, dtype=torch.int8, device=grad.device)
    scales = torch.empty(_num_blocks(n, block_size), dtype=torch.float32, device=grad.device)
    if n == 0:
        return q, scales
    u = None
    if stochastic:
        gen = torch.Generator(device=grad.device).manual_seed(seed)
        u = torch.rand(n, generator=gen, device=grad.device)
    acc = _accumulate(grad, residual)
    update = residual is not None
    m, nfull = _split_blocks(n, block_size)
    if nfull:
        rows = (acc[:m].view(-1, block_size), q[:m].view(-1, block_size))
        main_u = None if u is None else u[:m].view(-1, block_size)
        _quantize_int8_rows(*rows, scales[:nfull], main_u, update)
    if m < n:
        row = _padded_row(acc[m:], block_size)
        row_q = torch.empty_like(row, dtype=torch.int8)
        row_u = None if u is None else _padded_row(u[m:], block_size)
        _quantize_int8_rows(row, row_q, scales[nfull:], row_u, update)
        q[m:] = row_q[0, : n - m]
        if update:
            acc[m:] = row[0, : n - m]
    if update and acc is not residual:
        residual.copy_(acc)  # fp32 -> bf16/fp16 rounds to nearest-even
    return q, scales


def quantize_int8(
    grad: torch.Tensor,
    residual: torch.Tensor | None = None,
    *,
    block_size: int = 256,
    stochastic: bool = False,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``grad + residual`` to int8 with one fp32 scale per ``block_size`` elements.

    Returns ``(q, scales)``; ``residual`` (if given) becomes ``acc - q * scale`` in place. ``stochastic``
    rounds up with probability equal to the fractional part (unbiased); vary ``seed`` between steps,
    otherwise every step draws the same uniforms.

    Args:
        grad: The 1-D contiguous float32, bfloat16 or float16 values to send.
        residual: Error feedback, ``grad``'s size and device (float32, bfloat16 or float16); None: none.
        block_size: Elements per scale: a power of two from 32 to 4096.
        stochastic: Round stochastically instead of to nearest even.
        seed: Seeds the stochastic rounding, an int in ``[0, 2**31)``.

    Returns:
        ``(q, scales)``: int8 codes of ``grad``'s size and one float32 scale per block.

    Raises:
        TypeError: When ``grad`` or ``residual`` is not a tensor or not float32, bfloat16 or float16, or
            ``block_size`` is not an int.
        ValueError: When ``grad`` or ``residual`` is not 1-D and contiguous, ``residual`` differs from ``grad`` in
            size or device, or ``block_size`` is not a power of two from 32 to 4096, or ``seed`` is not an
            int in ``[0, 2**31)``.
    """
    _check_grad_residual(grad, residual, block_size)
    seed = _check_seed(seed)
    impl = quantize_int8_triton if use_triton(grad) else quantize_int8_reference
    return impl(grad, residual, block_size=block_size, stochastic=bool(stochastic), seed=seed)


@triton.jit
def _dequantize_int8_kernel(q_ptr, scales_ptr, out_ptr, n, ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    value = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float32) * tl.load(scales_ptr + pid)
    if ACCUMULATE:
        value += tl.load(out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, cast_rne(value, out_ptr.dtype.element_ty), mask=mask)


def _launch_dequantize_int8(
    q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block_size: int, accumulate: bool
) -> torch.Tensor:
    if q.numel():
        grid = (_num_blocks(q.numel(), block_size),)
        warps = _num_warps(block_size, out.element_size())
        _dequantize_int8_kernel[grid](
            q, scales, out, q.numel(), ACCUMULATE=accumulate, BLOCK=block_size, num_warps=warps, **_NO_FMA
        )
    return out


def _int8_values_into(values: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    """``values`` (fp32, q's size) = ``q * scale`` per block, in two in-place passes and no temporary."""
    values.copy_(q)  # int8 -> fp32 is exact
    m, nfull = _split_blocks(q.numel(), block_size)
    values[:m].view(-1, block_size).mul_(scales[:nfull, None])
    values[m:].mul_(scales[nfull:])  # the ragged last block: one scale (or none when n % block_size == 0)
    return values


# Elements per pass of the dequantize-accumulate references: 2 MiB of fp32 scratch, a multiple of every block
# size. Filling the scratch and adding it into out chunk by chunk keeps it in the cores' L2 between the passes
# (smaller chunks pay their per-chunk overhead, larger ones fall out of cache).
_ACCUMULATE_CHUNK = 1 << 19


def _accumulate_chunks(out: torch.Tensor, values: Callable[[torch.Tensor, int, int], torch.Tensor]) -> torch.Tensor:
    """``out += values(work, start, stop)`` chunk by chunk, the sum formed in fp32 and rounded once to out's dtype.

    ``values`` fills ``work`` (fp32, ``stop - start`` elements) with the dequantized values of that range.
    """
    n = out.numel()
    work = torch.empty(min(n, _ACCUMULATE_CHUNK), dtype=torch.float32, device=out.device)
    for start in range(0, n, _ACCUMULATE_CHUNK):
        stop = min(n, start + _ACCUMULATE_CHUNK)
        chunk, dst = values(work[: stop - start], start, stop), out[start:stop]
        if out.dtype == torch.float32:
            dst.add_(chunk)
        else:
            dst.copy_(chunk.add_(dst))
    return out


def dequantize_int8_triton(
    q: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    block_size: int = 256,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Launch :func:`_dequantize_int8_kernel` writing ``q * scale`` into ``out`` (new if None)."""
    out = _new_out(out, q.numel(), q.device, dtype)
    return _launch_dequantize_int8(q, scales, out, block_size, accumulate=False)


def dequantize_int8_reference(
    q: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    block_size: int = 256,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Torch version of :func:`dequantize_int8_triton`."""
    out = _new_out(out, q.numel(), q.device, dtype)
    if out.dtype == torch.float32:  # the fp32 products go straight into out
        return _int8_values_into(out, q, scales, block_size)
    return out.copy_(_int8_values_into(torch.empty_like(out, dtype=torch.float32), q, scales, block_size))


def dequantize_int8(
    q: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    block_size: int = 256,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``q * scale`` per block, into ``out`` or a new tensor of ``dtype`` (default float32).

    Args:
        q: The 1-D contiguous int8 codes.
        scales: One float32 scale per block of ``q``, on ``q``'s device.
        out: Receives the values (float32, bfloat16 or float16, ``q``'s size and device); None: a new tensor.
        block_size: Elements per scale, as used when quantizing.
        dtype: The new tensor's dtype (None: float32); with ``out``, it must be ``out``'s dtype.

    Returns:
        ``out``, or the new tensor.

    Raises:
        TypeError: When a tensor is not one or has the wrong dtype, or ``block_size`` is not an int.
        ValueError: When a tensor is not 1-D and contiguous or has the wrong size or device, ``block_size`` is not
            a power of two from 32 to 4096, or ``out`` and ``dtype`` disagree.
    """
    _check_int8_payload(q, scales, block_size)
    if out is not None:
        _check_out(out, q.numel(), q.device, dtype)
    out = _new_out(out, q.numel(), q.device, dtype)
    impl = dequantize_int8_triton if use_triton(out) else dequantize_int8_reference
    return impl(q, scales, out, block_size=block_size)


def dequantize_int8_accumulate_triton(
    q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, block_size: int = 256
) -> torch.Tensor:
    """Launch :func:`_dequantize_int8_kernel` adding ``q * scale`` into ``out``."""
    return _launch_dequantize_int8(q, scales, out, block_size, accumulate=True)


def dequantize_int8_accumulate_reference(
    q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, block_size: int = 256
) -> torch.Tensor:
    """Torch version of :func:`dequantize_int8_accumulate_triton` (the sum is rounded once, from fp32)."""

    # q * scale into a chunk-sized fp32 scratch buffer (cast + mul_, no pad copy), then one add_. Not addcmul_:
    # torch's CPU addcmul contracts to an FMA (the product is not rounded before the add; 10% of the sums came
    # out different), and the kernel rounds the product first.
    def values(work: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return _int8_values_into(work, q[start:stop], scales[start // block_size : -(-stop // block_size)], block_size)

    return _accumulate_chunks(out, values)


def dequantize_int8_accumulate(
    q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, block_size: int = 256
) -> torch.Tensor:
    """``out += q * scale`` in one pass (receiving side of an int8 all-gather).

    Args:
        q: The 1-D contiguous int8 codes.
        scales: One float32 scale per block of ``q``, on ``q``'s device.
        out: The float32, bfloat16 or float16 running sum, ``q``'s size and device; added to in place.
        block_size: Elements per scale, as used when quantizing.

    Returns:
        ``out``.

    Raises:
        TypeError: When a tensor is not one or has the wrong dtype, or ``block_size`` is not an int.
        ValueError: When a tensor is not 1-D and contiguous or has the wrong size or device, or ``block_size`` is
            not a power of two from 32 to 4096.
    """
    _check_int8_payload(q, scales, block_size)
    _check_out(out, q.numel(), q.device, None)
    impl = dequantize_int8_accumulate_triton if use_triton(out) else dequantize_int8_accumulate_reference
    return impl(q, scales, out, block_size=block_size)


# ----------------------------------------------------------------------------------------------------- 1-bit
# Kernels view a block as (BLOCK // 8) rows of 8 elements: row j of the block is byte j of its bits.


@triton.jit
def _quantize_1bit_kernel(
    grad_ptr, residual_ptr, bits_ptr, scales_ptr, n, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr
):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK // 8)
    lanes = tl.arange(0, 8)
    start = pid.to(tl.int64) * BLOCK
    offs = start + rows[:, None] * 8 + lanes[None, :]
    mask = offs < n
    acc = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        acc += tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    count = tl.minimum(n - start, BLOCK).to(tl.float32)
    scale = tl.div_rn(tl.sum(tl.sum(tl.abs(acc), axis=1), axis=0), count)  # IEEE division, as in the int8 kernel
    negative = acc < 0.0  # padding is 0.0, so its bits stay 0
    byte = tl.sum(negative.to(tl.int32) << lanes[None, :], axis=1)
    byte_offs = pid.to(tl.int64) * (BLOCK // 8) + rows
    tl.store(bits_ptr + byte_offs, byte.to(tl.uint8), mask=byte_offs < (n + 7) // 8)
    tl.store(scales_ptr + pid, scale)
    if HAS_RESIDUAL:
        err = acc - tl.where(negative, -scale, scale)
        tl.store(residual_ptr + offs, cast_rne(err, residual_ptr.dtype.element_ty), mask=mask)


def quantize_1bit_triton(
    grad: torch.Tensor, residual: torch.Tensor | None = None, *, block_size: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch :func:`_quantize_1bit_kernel`: one program per block of ``block_size`` elements."""
    n = grad.numel()
    nblocks = _num_blocks(n, block_size)
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8, device=grad.device)
    scales = torch.empty(nblocks, dtype=torch.float32, device=grad.device)
    if n:
        _quantize_1bit_kernel[(nblocks,)](
            grad,
            grad if residual is None else residual,  # never read when HAS_RESIDUAL is False
            bits,
            scales,
            n,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block_size,
            num_warps=_num_warps(block_size, grad.element_size()),
        )
    return bits, scales


# Packing: the (n,) bool mask viewed as int64 holds 8 consecutive elements, element 8j + i in byte i (0 or
# 1). Multiplying by this constant moves byte i's bit to bit 56 + i: the shifted copies land on distinct bit
# positions, so nothing carries, and bits 56-63 are exactly the packed byte (read with >> 56, keeping the low
# byte). 3 passes over n bytes, where an int32 multiply-and-sum or a uint8 shift-and-sum per byte took many.
_PACK_BITS = 0x0102040810204080
# Unpacking: row b holds the 8 sign words of byte b (bit i set -> 0x80000000 at column i). XOR-ing a scale's
# bit pattern into them gives scale * (1 - 2 * bit) exactly (a sign flip), as the int32 view of fp32 values
# (only a NaN scale can come out with another sign bit than -1.0 * NaN gives).
# index_select + one xor_ run in 1.2 ms where the int32 mask, float signs and padded product took 8.8 ms.
_SIGN_WORDS = (((torch.arange(256)[:, None] >> torch.arange(8)) & 1) * -(2**31)).to(torch.int32)


def _1bit_values_into(values: torch.Tensor, bits: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    """``values`` (fp32) = ``scale * (1 - 2 * bit)`` for its first ``values.numel()`` signs, no fp32 temporary."""
    n = values.numel()
    words = values.view(torch.int32)
    table = _SIGN_WORDS.to(bits.device)
    whole = n // 8 * 8
    torch.index_select(table, 0, bits[: n // 8].long(), out=words[:whole].view(-1, 8))
    if whole < n:  # the last, partial byte
        words[whole:] = torch.index_select(table, 0, bits[n // 8 :].long())[0, : n - whole]
    m, nfull = _split_blocks(n, block_size)
    scale_words = scales.view(torch.int32)
    words[:m].view(-1, block_size).bitwise_xor_(scale_words[:nfull, None])
    words[m:].bitwise_xor_(scale_words[nfull:])
    return values


def _1bit_signs_rows(acc: torch.Tensor, bits: torch.Tensor, sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row sums of ``|acc|`` (rows, block_size) into ``sums`` and the packed signs into ``bits`` (rows,
    block_size // 8); returns the sign mask and the scratch buffer for :func:`_1bit_residual_rows`."""
    work = torch.abs(acc, out=torch.empty_like(acc))
    torch.sum(work, dim=1, out=sums)  # same reduction, same order, as abs().sum(dim=1) on the padded blocks
    negative = torch.lt(acc, 0)  # padding is 0.0, so its bits stay 0
    bits.copy_(negative.view(torch.int64).mul(_PACK_BITS).bitwise_right_shift_(56))
    return negative, work


def _1bit_residual_rows(acc: torch.Tensor, negative: torch.Tensor, scales: torch.Tensor, work: torch.Tensor) -> None:
    """``acc -= scale * (1 - 2 * negative)`` in place (the subtraction rounds once; the signed scale is exact)."""
    # The signed scale is built as int32 bits in the scratch buffer (bool -> int32, << 31, xor the scale):
    # cheaper on CPU than torch.where(negative, -scale, scale) or a float 1 - 2 * negative.
    signed = work.view(torch.int32)
    signed.copy_(negative)
    signed.bitwise_left_shift_(31)
    signed.bitwise_xor_(scales.view(torch.int32)[:, None])
    acc.sub_(work)


def quantize_1bit_reference(
    grad: torch.Tensor, residual: torch.Tensor | None = None, *, block_size: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch version of :func:`quantize_1bit_triton`.

    Same bits; the scales (a sum of up to 4096 terms) differ from the kernel's by the summation order,
    a few fp32 ulps.
    """
    # acc formed in the residual, whole blocks viewed rather than padded, the int64 bit packing and the int32
    # signed scales above, all in one scratch buffer.
    n = grad.numel()
    nbytes = (n + 7) // 8
    nblocks = _num_blocks(n, block_size)
    bits = torch.empty(nbytes, dtype=torch.uint8, device=grad.device)
    scales = torch.empty(nblocks, dtype=torch.float32, device=grad.device)
    if n == 0:
        return bits, scales
    acc = _accumulate(grad, residual)
    m, nfull = _split_blocks(n, block_size)
    parts = []  # (rows of acc, their scales, sign mask, scratch) for the residual update
    if nfull:
        rows = acc[:m].view(-1, block_size)
        signs = _1bit_signs_rows(rows, bits[: m // 8].view(-1, block_size // 8), scales[:nfull])
        parts.append((rows, scales[:nfull], *signs))
    if m < n:
        row = _padded_row(acc[m:], block_size)
        row_bits = torch.empty(1, block_size // 8, dtype=torch.uint8, device=grad.device)
        parts.append((row, scales[nfull:], *_1bit_signs_rows(row, row_bits, scales[nfull:])))
        bits[m // 8 :] = row_bits[0, : nbytes - m // 8]
    counts = (n - torch.arange(nblocks, device=grad.device) * block_size).clamp(max=block_size)
    scales.div_(counts)  # mean over the block's valid elements (fp32 / int64 divides in fp32)
    if residual is not None:
        for rows, row_scales, negative, work in parts:
            _1bit_residual_rows(rows, negative, row_scales, work)
        if m < n:
            acc[m:] = row[0, : n - m]
        if acc is not residual:
            residual.copy_(acc)  # fp32 -> bf16/fp16 rounds to nearest-even
    return bits, scales


def quantize_1bit(
    grad: torch.Tensor, residual: torch.Tensor | None = None, *, block_size: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``grad + residual`` to signs (8 per byte) and one fp32 scale, ``mean(|acc|)``, per block.

    ``residual`` (if given) becomes ``acc - dequant`` in place.

    Args:
        grad: The 1-D contiguous float32, bfloat16 or float16 values to send.
        residual: Error feedback, ``grad``'s size and device (float32, bfloat16 or float16); None: none.
        block_size: Elements per scale: a power of two from 32 to 4096.

    Returns:
        ``(bits, scales)``: uint8 signs, 8 per byte (``ceil(n / 8)`` bytes), and one float32 scale per block.

    Raises:
        TypeError: When ``grad`` or ``residual`` is not a tensor or not float32, bfloat16 or float16, or
            ``block_size`` is not an int.
        ValueError: When ``grad`` or ``residual`` is not 1-D and contiguous, ``residual`` differs from ``grad`` in
            size or device, or ``block_size`` is not a power of two from 32 to 4096.
    """
    _check_grad_residual(grad, residual, block_size)
    impl = quantize_1bit_triton if use_triton(grad) else quantize_1bit_reference
    return impl(grad, residual, block_size=block_size)


@triton.jit
def _dequantize_1bit_kernel(bits_ptr, scales_ptr, out_ptr, n, ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK // 8)
    lanes = tl.arange(0, 8)
    byte_offs = pid.to(tl.int64) * (BLOCK // 8) + rows
    byte = tl.load(bits_ptr + byte_offs, mask=byte_offs < (n + 7) // 8, other=0).to(tl.int32)
    negative = ((byte[:, None] >> lanes[None, :]) & 1) != 0
    scale = tl.load(scales_ptr + pid)
    value = tl.where(negative, -scale, scale)
    offs = pid.to(tl.int64) * BLOCK + rows[:, None] * 8 + lanes[None, :]
    mask = offs < n
    if ACCUMULATE:
        value += tl.load(out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, cast_rne(value, out_ptr.dtype.element_ty), mask=mask)


def _launch_dequantize_1bit(
    bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block_size: int, accumulate: bool
) -> torch.Tensor:
    if out.numel():
        grid = (scales.numel(),)
        warps = _num_warps(block_size, out.element_size())
        _dequantize_1bit_kernel[grid](
            bits, scales, out, out.numel(), ACCUMULATE=accumulate, BLOCK=block_size, num_warps=warps
        )
    return out


def dequantize_1bit_triton(
    bits: torch.Tensor,
    scales: torch.Tensor,
    n: int,
    out: torch.Tensor | None = None,
    *,
    block_size: int = 256,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Launch :func:`_dequantize_1bit_kernel` writing ``scale * (1 - 2 * bit)`` into ``out`` (new if None)."""
    out = _new_out(out, n, bits.device, dtype)
    return _launch_dequantize_1bit(bits, scales, out, block_size, accumulate=False)


def dequantize_1bit_reference(
    bits: torch.Tensor,
    scales: torch.Tensor,
    n: int,
    out: torch.Tensor | None = None,
    *,
    block_size: int = 256,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Torch version of :func:`dequantize_1bit_triton`."""
    out = _new_out(out, n, bits.device, dtype)
    if out.dtype == torch.float32:  # the signed scales go straight into out
        return _1bit_values_into(out, bits, scales, block_size)
    return out.copy_(_1bit_values_into(torch.empty_like(out, dtype=torch.float32), bits, scales, block_size))


def dequantize_1bit(
    bits: torch.Tensor,
    scales: torch.Tensor,
    n: int,
    out: torch.Tensor | None = None,
    *,
    block_size: int = 256,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``scale * (1 - 2 * bit)`` for the first ``n`` signs, into ``out`` or a new tensor of ``dtype`` (float32).

    Args:
        bits: The 1-D contiguous uint8 signs, ``ceil(n / 8)`` bytes.
        scales: One float32 scale per block of ``n`` elements, on ``bits``' device.
        n: The number of elements that were quantized (>= 0).
        out: Receives the values (float32, bfloat16 or float16, ``n`` elements on ``bits``' device); None: a new
            tensor.
        block_size: Elements per scale, as used when quantizing.
        dtype: The new tensor's dtype (None: float32); with ``out``, it must be ``out``'s dtype.

    Returns:
        ``out``, or the new tensor.

    Raises:
        TypeError: When a tensor is not one or has the wrong dtype, or ``block_size`` is not an int.
        ValueError: When ``n`` is not an int >= 0, a tensor is not 1-D and contiguous or has the wrong size or
            device, ``block_size`` is not a power of two from 32 to 4096, or ``out`` and ``dtype`` disagree.
    """
    _check_1bit_payload(bits, scales, n, block_size)
    if out is not None:
        _check_out(out, n, bits.device, dtype)
    out = _new_out(out, n, bits.device, dtype)
    impl = dequantize_1bit_triton if use_triton(out) else dequantize_1bit_reference
    return impl(bits, scales, n, out, block_size=block_size)


def dequantize_1bit_accumulate_triton(
    bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, block_size: int = 256
) -> torch.Tensor:
    """Launch :func:`_dequantize_1bit_kernel` adding ``scale * (1 - 2 * bit)`` into ``out``."""
    return _launch_dequantize_1bit(bits, scales, out, block_size, accumulate=True)


def dequantize_1bit_accumulate_reference(
    bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, block_size: int = 256
) -> torch.Tensor:
    """Torch version of :func:`dequantize_1bit_accumulate_triton` (the sum is rounded once, from fp32)."""

    def values(work: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        chunk_bits = bits[start // 8 : (stop + 7) // 8]  # start is a multiple of block_size, hence of 8
        return _1bit_values_into(work, chunk_bits, scales[start // block_size : -(-stop // block_size)], block_size)

    return _accumulate_chunks(out, values)


def dequantize_1bit_accumulate(
    bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, block_size: int = 256
) -> torch.Tensor:
    """``out += scale * (1 - 2 * bit)`` in one pass; ``out.numel()`` is the number of quantized elements.

    Args:
        bits: The 1-D contiguous uint8 signs, ``ceil(out.numel() / 8)`` bytes.
        scales: One float32 scale per block, on ``bits``' device.
        out: The float32, bfloat16 or float16 running sum, on ``bits``' device; added to in place.
        block_size: Elements per scale, as used when quantizing.

    Returns:
        ``out``.

    Raises:
        TypeError: When a tensor is not one or has the wrong dtype, or ``block_size`` is not an int.
        ValueError: When a tensor is not 1-D and contiguous or has the wrong size or device, or ``block_size`` is
            not a power of two from 32 to 4096.
    """
    check_vector("out", out, FLOAT_DTYPES)
    _check_1bit_payload(bits, scales, out.numel(), block_size)
    _check_out(out, out.numel(), bits.device, None)
    impl = dequantize_1bit_accumulate_triton if use_triton(out) else dequantize_1bit_accumulate_reference
    return impl(bits, scales, out, block_size=block_size)
