"""Gradient compressors: what one rank puts on the wire for a flat fp32 gradient, and how it is read back.

Three families, told apart by the collective that is correct for their data (see :mod:`.collectives`):

- *Sparse* (:class:`TopKCompressor`): ``(values, indices)`` pairs. Two ranks' top-k sets differ, so the
  vectors cannot be summed element by element on the wire: they are all-gathered and scatter-added.
- *Quantized* (:class:`Int8Compressor`, :class:`OneBitCompressor`, and :class:`IdentityCompressor`, the fp32
  "no compression" codec of the same path): every element has a code, blocks of ``block_size`` share a scale.
  They are reduced with the two-phase compressed all-reduce (all-to-all of compressed chunks, local reduce,
  compress again, all-gather).
- *Low-rank* (:class:`PowerSGDCompressor`): each gradient matrix ``M`` (rows x cols) is sent as two thin factors,
  ``P = M Q`` and ``Q = M^T P``, each summed over ranks by a plain all-reduce (sums of ``M_i Q`` are ``(sum M_i) Q``,
  so the factors, unlike top-k sets, may be added on the wire).

A compressor is stateless; residuals (error feedback) and PowerSGD's warm-start ``Q`` live in the channels of
:mod:`.collectives`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from .. import kernels
from ..kernels import check_block_size

__all__ = [
    "Compressor",
    "IdentityCompressor",
    "Int8Compressor",
    "OneBitCompressor",
    "PowerSGDCompressor",
    "QuantizingCompressor",
    "TopKCompressor",
    "parse_compressor",
]


class Compressor(ABC):
    """Base of every compressor: a name, a wire format and its size."""

    name: str = ""
    lossless: bool = False
    """Whether decode(encode(x)) == x exactly (then error feedback has nothing to keep)."""

    @abstractmethod
    def wire_format(self) -> str:
        """What travels for ``n`` elements, in words (for reports and the README).

        Returns:
            A one-line description of the payload's tensors.
        """

    @abstractmethod
    def payload_bytes(self, n: int) -> int:
        """Bytes of one rank's compressed payload for ``n`` fp32 elements, scales and indices included.

        Args:
            n: Elements of the buffer compressed.

        Returns:
            The payload's size in bytes.
        """

    def bytes_per_element(self, n: int = 1 << 20) -> float:
        """``payload_bytes(n) / n`` (4.0 for uncompressed fp32).

        Args:
            n: Elements of the buffer compressed (1 Mi by default, where per-block overheads have settled).

        Returns:
            The average payload bytes per element.
        """
        return self.payload_bytes(n) / max(n, 1)

    def describe(self) -> dict:
        """A summary for reports.

        Returns:
            ``{"name": ..., "wire_format": ..., "bytes_per_element": ...}``.
        """
        return {"name": self.name, "wire_format": self.wire_format(), "bytes_per_element": self.bytes_per_element()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._args()})"

    def _args(self) -> str:
        return ""


class TopKCompressor(Compressor):
    """Keep the ``ratio x n`` largest-magnitude entries of ``grad + residual``; the rest stays in the residual.

    Wire: fp32 values and int32 indices, ``8 k`` bytes (top-k 1%: 2% of dense fp32). Both modes select on the device
    with no host sync (:func:`gpudist.kernels.topk_compress`): ``"exact"`` is the true top-k; ``"threshold"`` compares
    magnitudes to 16 mantissa bits (2^-16 relative), one pass over the candidates fewer on a GPU, and on the CPU a
    candidate pass instead of ranking all ``n``.

    Args:
        ratio: The fraction of entries sent, in (0, 1] (1.0 is lossless).
        mode: ``"exact"`` or ``"threshold"``.

    Raises:
        ValueError: When ``ratio`` is not a number in (0, 1], or ``mode`` is neither ``"exact"`` nor
            ``"threshold"``.
    """

    name = "topk"

    def __init__(self, ratio: float, mode: str = "exact"):
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"TopKCompressor: ratio={ratio!r} must be a fraction in (0, 1], e.g. 0.01 for top 1%")
        if mode not in ("exact", "threshold"):
            raise ValueError(f"TopKCompressor: mode={mode!r} must be 'exact' or 'threshold'")
        self.ratio, self.mode = float(ratio), mode
        self.lossless = self.ratio == 1.0

    def k(self, n: int) -> int:
        """Entries sent for an ``n``-element buffer: ``ceil(ratio x n)``, at least 1 when ``n > 0``.

        Args:
            n: Elements of the buffer.

        Returns:
            ``k``, at most ``n`` (0 for an empty buffer).
        """
        return min(n, max(1, math.ceil(self.ratio * n))) if n else 0

    def wire_format(self) -> str:
        return f"top {self.ratio:g}: fp32 values[k] + int32 indices[k], k = ceil({self.ratio:g} n)"

    def payload_bytes(self, n: int) -> int:
        return 8 * self.k(n)

    def _args(self) -> str:
        return f"ratio={self.ratio:g}, mode={self.mode!r}"


class QuantizingCompressor(Compressor):
    """A codec with one code per element and one fp32 scale per ``block_size`` elements (two-phase all-reduce)."""

    block_size: int = 256
    payload_dtypes: tuple[torch.dtype, ...] = ()

    @abstractmethod
    def payload_numels(self, n: int) -> tuple[int, ...]:
        """Sizes of the payload tensors for ``n`` elements (``n`` a multiple of ``block_size``).

        Args:
            n: Elements encoded, a multiple of ``block_size``.

        Returns:
            The element count of each payload tensor, in ``payload_dtypes`` order.
        """

    @abstractmethod
    def encode(self, acc: torch.Tensor, residual: torch.Tensor | None, seed: int) -> tuple[torch.Tensor, ...]:
        """Payload of ``acc + residual`` (``acc.numel()`` a multiple of ``block_size``); updates ``residual``.

        Args:
            acc: The flat values to encode.
            residual: Error feedback, ``acc``'s size: added before encoding and set to what the encoding lost, in
                place; None: no error feedback.
            seed: Seeds stochastic rounding (vary it per step and rank).

        Returns:
            The payload tensors, in ``payload_dtypes`` order.
        """

    @abstractmethod
    def decode(self, payload: tuple[torch.Tensor, ...], out: torch.Tensor, accumulate: bool) -> None:
        """Write (or add, with ``accumulate``) the values of ``payload`` into ``out``.

        Args:
            payload: Tensors from :meth:`encode`.
            out: The flat buffer to write into, as many elements as were encoded.
            accumulate: Add into ``out`` instead of overwriting it.
        """

    def payload_bytes(self, n: int) -> int:
        padded = -(-n // self.block_size) * self.block_size
        return sum(
            m * torch.empty(0, dtype=d).element_size()
            for m, d in zip(self.payload_numels(padded), self.payload_dtypes, strict=True)
        )

    def _args(self) -> str:
        return f"block_size={self.block_size}"


def _block_size(cls: str, block_size: object) -> int:
    try:
        return check_block_size(block_size)  # the kernels' own rule, checked before any kernel runs
    except (TypeError, ValueError) as e:
        raise type(e)(f"{cls}: {e}") from None


class Int8Compressor(QuantizingCompressor):
    """int8 codes with one fp32 scale (``absmax / 127``) per block: ``1 + 4 / block_size`` bytes per element
    (25.4% of fp32 at 256). Round to nearest even, or ``stochastic`` (unbiased; seeded per step and rank).

    Args:
        block_size: Elements per scale: a power of two from 32 to 4096.
        stochastic: Round stochastically instead of to nearest even.

    Raises:
        TypeError: When ``block_size`` is not an int.
        ValueError: When ``block_size`` is not a power of two from 32 to 4096.
    """

    name = "int8"
    payload_dtypes = (torch.int8, torch.float32)

    def __init__(self, block_size: int = 256, stochastic: bool = False):
        self.block_size = _block_size("Int8Compressor", block_size)
        self.stochastic = bool(stochastic)

    def wire_format(self) -> str:
        rounding = "stochastic" if self.stochastic else "nearest-even"
        return f"int8 q[n] ({rounding}) + fp32 scales[n / {self.block_size}], scale = absmax / 127"

    def payload_numels(self, n: int) -> tuple[int, ...]:
        return n, n // self.block_size

    def encode(self, acc, residual, seed):
        return kernels.quantize_int8(acc, residual, block_size=self.block_size, stochastic=self.stochastic, seed=seed)

    def decode(self, payload, out, accumulate):
        q, scales = payload
        if accumulate:
            kernels.dequantize_int8_accumulate(q, scales, out, block_size=self.block_size)
        else:
            kernels.dequantize_int8(q, scales, out, block_size=self.block_size)

    def _args(self) -> str:
        return f"block_size={self.block_size}, stochastic={self.stochastic}"


class OneBitCompressor(QuantizingCompressor):
    """Signs, 8 per byte, with one fp32 scale (``mean |acc|``) per block: ``1/8 + 4 / block_size`` bytes per
    element (3.5% of fp32 at 256). Needs error feedback to converge: the sign alone is a biased estimate.

    Args:
        block_size: Elements per scale: a power of two from 32 to 4096.

    Raises:
        TypeError: When ``block_size`` is not an int.
        ValueError: When ``block_size`` is not a power of two from 32 to 4096.
    """

    name = "1bit"
    payload_dtypes = (torch.uint8, torch.float32)

    def __init__(self, block_size: int = 256):
        self.block_size = _block_size("OneBitCompressor", block_size)

    def wire_format(self) -> str:
        return f"sign bits uint8[n / 8] + fp32 scales[n / {self.block_size}], scale = mean |acc|"

    def payload_numels(self, n: int) -> tuple[int, ...]:
        return n // 8, n // self.block_size

    def encode(self, acc, residual, seed):
        return kernels.quantize_1bit(acc, residual, block_size=self.block_size)

    def decode(self, payload, out, accumulate):
        bits, scales = payload
        if accumulate:
            kernels.dequantize_1bit_accumulate(bits, scales, out, block_size=self.block_size)
        else:
            kernels.dequantize_1bit(bits, scales, out.numel(), out, block_size=self.block_size)


class IdentityCompressor(QuantizingCompressor):
    """No compression through the two-phase path (fp32 values, 4 bytes per element): the lossless baseline that
    shows the compressed collective itself adds no error, and the reference the benchmarks compare against."""

    name = "none"
    lossless = True
    payload_dtypes = (torch.float32,)
    block_size = 32

    def wire_format(self) -> str:
        return "fp32 values[n] (uncompressed)"

    def payload_numels(self, n: int) -> tuple[int, ...]:
        return (n,)

    def encode(self, acc, residual, seed):
        return (acc.clone(),)

    def decode(self, payload, out, accumulate):
        if accumulate:
            out.add_(payload[0])
        else:
            out.copy_(payload[0])

    def _args(self) -> str:
        return ""


class PowerSGDCompressor(Compressor):
    """Rank-``r`` PowerSGD (Vogels et al. 2019, "PowerSGD: Practical Low-Rank Gradient Compression"): one step of
    subspace iteration per optimizer step, warm-started from the previous step's ``Q``.

    Each tensor of a bucket is viewed as a matrix ``M`` (``shape[0]`` rows, the other dimensions as columns, as torch's
    ``powerSGD_hook``). With ``Q`` (cols x r) orthonormal: ``P = sum_ranks M Q`` (all-reduce 1), ``P`` orthonormalized,
    ``Q = sum_ranks M^T P / N`` (all-reduce 2), and every rank applies ``P Q^T``. Wire: fp32 ``(rows + cols) r`` per
    matrix instead of ``rows x cols``. Tensors with fewer than 2 dimensions, and matrices where
    ``(rows + cols) r x min_compression_rate >= rows x cols`` (too small to gain), are summed uncompressed, batched
    into one dense all-reduce per bucket. Error feedback keeps ``M - P P^T M`` per rank (the paper's local residual).

    Args:
        rank: ``r``, the rank of the approximation (capped at ``min(rows, cols)`` per matrix).
        start_iter: Optimizer steps of plain all-reduces before PowerSGD starts (torch's ``start_powerSGD_iter``):
            :class:`gpudist.GradientCompressionOptimizer` warms up for ``max(warmup_steps, start_iter)`` steps.
        min_compression_rate: Compress a matrix only when its dense size is more than this many times its factors'
            (torch's default, 2); 0 compresses every matrix (at full rank PowerSGD then equals dense averaging).
        warm_start: Start each step's power iteration from the previous step's ``Q`` (False: a fresh random ``Q``
            every step, the same on every rank).

    Raises:
        ValueError: When ``rank`` is not an int >= 1, ``start_iter`` not an int >= 0, or ``min_compression_rate``
            not a number >= 0.
    """

    name = "powersgd"

    def __init__(self, rank: int, start_iter: int = 0, min_compression_rate: float = 2.0, warm_start: bool = True):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"PowerSGDCompressor: rank={rank!r} must be an int >= 1, e.g. 4")
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(
                f"PowerSGDCompressor: start_iter={start_iter!r} must be an int >= 0 (steps before it starts)"
            )
        rate = min_compression_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate >= 0:
            raise ValueError(f"PowerSGDCompressor: min_compression_rate={rate!r} must be a number >= 0, e.g. 2")
        self.rank, self.start_iter = rank, start_iter
        self.min_compression_rate, self.warm_start = float(rate), bool(warm_start)

    def matrix_rank(self, rows: int, cols: int) -> int:
        """The rank used for a ``rows x cols`` matrix: ``min(rows, cols, rank)``.

        Args:
            rows: Rows of the matrix.
            cols: Columns of the matrix.

        Returns:
            The rank of its approximation.
        """
        return min(rows, cols, self.rank)

    def compresses(self, rows: int, cols: int) -> bool:
        """Whether a ``rows x cols`` matrix is sent as factors: ``(rows + cols) r x min_compression_rate < rows cols``.

        Args:
            rows: Rows of the matrix.
            cols: Columns of the matrix.

        Returns:
            True to compress it, False to sum it uncompressed.
        """
        return (rows + cols) * self.matrix_rank(rows, cols) * self.min_compression_rate < rows * cols

    def wire_format(self) -> str:
        return (
            f"fp32 P[rows x {self.rank}] + Q[cols x {self.rank}] per matrix, two all-reduces; fp32 for tensors "
            f"with < 2 dims or (rows + cols) r x {self.min_compression_rate:g} >= rows cols"
        )

    def payload_bytes(self, n: int) -> int:
        """Bytes for ``n`` elements taken as a square matrix (``isqrt(n)`` rows and columns, the rest dense): a
        low-rank payload depends on the shapes, which a size alone does not give.

        Args:
            n: Elements of the buffer.

        Returns:
            The payload's size in bytes.
        """
        side = math.isqrt(n)
        if side and self.compresses(side, side):
            return 4 * (2 * side * self.matrix_rank(side, side) + n - side * side)
        return 4 * n

    def _args(self) -> str:
        return (
            f"rank={self.rank}, start_iter={self.start_iter}, min_compression_rate={self.min_compression_rate:g}, "
            f"warm_start={self.warm_start}"
        )


def parse_compressor(spec: str | Compressor) -> Compressor:
    """``"topk:0.01"``, ``"topk:0.01:threshold"``, ``"int8"``, ``"int8:128"``, ``"1bit"``, ``"1bit:512"``,
    ``"powersgd:4"``, ``"powersgd:4:100"`` (rank 4, plain all-reduces for the first 100 steps), ``"none"`` -> a
    compressor (the command-line form used by ``examples/train.py --compression``).

    Args:
        spec: A spec string (case-insensitive), or a compressor, returned as it is.

    Returns:
        The compressor.

    Raises:
        TypeError: When ``spec`` is neither a string nor a ``Compressor``.
        ValueError: When the spec is not one of those forms or its numbers are invalid (a ratio outside (0, 1], a
            block size that is not a power of two from 32 to 4096, an unknown top-k mode, a PowerSGD rank < 1).
    """
    if isinstance(spec, Compressor):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"compressor spec must be a str or a Compressor, got {type(spec).__name__}")
    name, *args = spec.strip().lower().split(":")
    try:
        if name == "topk" and 1 <= len(args) <= 2:
            return TopKCompressor(float(args[0]), *args[1:])
        if name == "int8" and len(args) <= 1:
            return Int8Compressor(*(int(a) for a in args))
        if name in ("1bit", "onebit") and len(args) <= 1:
            return OneBitCompressor(*(int(a) for a in args))
        if name == "powersgd" and 1 <= len(args) <= 2:
            return PowerSGDCompressor(*(int(a) for a in args))
        if name == "none" and not args:
            return IdentityCompressor()
    except ValueError as e:
        raise ValueError(f"compressor spec {spec!r}: {e}") from None
    raise ValueError(
        f"compressor spec {spec!r} is not one of topk:RATIO[:exact|threshold], int8[:BLOCK], "
        "1bit[:BLOCK], none (e.g. 'topk:0.01')"
    )
