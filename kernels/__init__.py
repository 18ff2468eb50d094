"""gpudist.kernels: Triton kernels with torch references of the same signature.

The contract: docs/architecture.md, "The kernel contract".

Every op dispatches on the tensor it writes: Triton for CUDA tensors, the torch reference
otherwise; ``GPUDIST_KERNELS=triton|torch`` forces either (see :mod:`gpudist.kernels.dispatch`).
Knows nothing of communication or ``nn.Module``s.
"""

from ._triton import HAS_TRITON
from .bucket import PackPlan, pack, unpack
from .dispatch import implementation, use_triton
from .layout import FlatLayout
from .norm import SquaredNorm, clip_scalars, squared_norm
from .optim import adam_step, sgd_step
from .optim_plan import AdamSegments, AdamStep, DeviceStep, SGDStep, advance_steps
from .quantize import (
    check_block_size,
    dequantize_1bit,
    dequantize_1bit_accumulate,
    dequantize_int8,
    dequantize_int8_accumulate,
    quantize_1bit,
    quantize_int8,
)
from .topk import TopKResult, topk_compress, topk_recall

__all__ = [
    "HAS_TRITON",
    "AdamSegments",
    "AdamStep",
    "DeviceStep",
    "FlatLayout",
    "PackPlan",
    "SGDStep",
    "SquaredNorm",
    "TopKResult",
    "adam_step",
    "advance_steps",
    "check_block_size",
    "clip_scalars",
    "dequantize_1bit",
    "dequantize_1bit_accumulate",
    "dequantize_int8",
    "dequantize_int8_accumulate",
    "implementation",
    "pack",
    "quantize_1bit",
    "quantize_int8",
    "sgd_step",
    "squared_norm",
    "topk_compress",
    "topk_recall",
    "unpack",
    "use_triton",
]
