"""Gradient compressors: what one rank puts on the wire for a flat fp32 gradient, and how it is read back.

Two families, told apart by the collective that is correct for their data (see :mod:`.collectives`):

- *Sparse* (:class:`TopKCompressor`): ``(values, indices)`` pairs. Two ranks' top-k sets differ, so the
  vectors cannot be summed element by element on the wire: they are all-gathered and scatter-added.
- *Quantized* (:class:`Int8Compressor`, :class:`OneBitCompressor`, and :class:`IdentityCompressor`, the fp32
  "no compression" codec of the same path): every element has a code, blocks of ``block_size`` share a scale.
  They are reduced with the two-phase compressed all-reduce (all-to-all of compressed chunks, local reduce,
  compress again, all-gather).

A compressor is stateless; residuals (error feedback) live in :class:`.collectives.CompressedChannel`.
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

    Wire: fp32 values and int32 indices, ``8 k`` bytes (top-k 1%: 2% of dense fp32). ``mode="threshold"`` selects
    the same set with a sampled threshold and one compaction pass (fast on a GPU); ``"exact"`` runs ``torch.topk``
    over all ``n`` magnitudes.

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


def parse_compressor(spec: str | Compressor) -> Compressor:
    """``"topk:0.01"``, ``"topk:0.01:threshold"``, ``"int8"``, ``"int8:128"``, ``"1bit"``, ``"1bit:512"``,
    ``"none"`` -> a compressor (the command-line form used by ``examples/train.py --compression``).

    Args:
        spec: A spec string (case-insensitive), or a compressor, returned as it is.

    Returns:
        The compressor.

    Raises:
        TypeError: When ``spec`` is neither a string nor a ``Compressor``.
        ValueError: When the spec is not one of those forms or its numbers are invalid (a ratio outside (0, 1], a
            block size that is not a power of two from 32 to 4096, an unknown top-k mode).
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
        if name == "none" and not args:
            return IdentityCompressor()
    except ValueError as e:
        raise ValueError(f"compressor spec {spec!r}: {e}") from None
    raise ValueError(
        f"compressor spec {spec!r} is not one of topk:RATIO[:exact|threshold], int8[:BLOCK], "
        "1bit[:BLOCK], none (e.g. 'topk:0.01')"
    )
