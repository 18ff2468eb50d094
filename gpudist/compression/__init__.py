"""gpudist.compression: gradient compressors and the collectives that are correct for their data.

Layering (docs/architecture.md): built on ``gpudist.kernels`` and ``gpudist.comm``; knows nothing of models or
optimizers.
:class:`gpudist.GradientCompressionOptimizer` plugs these channels into DDP, ZeRO-1 and ZeRO-2.
"""

from .collectives import CompressedChannel, PendingReduction, PowerSGDChannel, dense_bytes, make_channel
from .compressors import (
    Compressor,
    IdentityCompressor,
    Int8Compressor,
    OneBitCompressor,
    PowerSGDCompressor,
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
    "PendingReduction",
    "PowerSGDChannel",
    "PowerSGDCompressor",
    "QuantizingCompressor",
    "TopKCompressor",
    "dense_bytes",
    "make_channel",
    "parse_compressor",
]
