"""gpudist.compression: gradient compressors and the collectives that are correct for their data.

Layering (docs/architecture.md): built on ``gpudist.kernels`` and ``gpudist.comm``; knows nothing of models or
optimizers.
:class:`gpudist.GradientCompressionOptimizer` plugs these channels into DDP, ZeRO-1 and ZeRO-2.
"""

from .collectives import CompressedChannel, dense_bytes
from .compressors import (
    Compressor,
    IdentityCompressor,
    Int8Compressor,
    OneBitCompressor,
    QuantizingCompressor,
    TopKCompressor,
    parse_compressor,
)

__all__ = [
    "CompressedChannel",
    "Compressor",
    "IdentityCompressor",
    "Int8Compressor",
    "OneBitCompressor",
    "QuantizingCompressor",
    "TopKCompressor",
    "dense_bytes",
    "parse_compressor",
]
