"""gpudist.kernels: Triton kernels with torch references of the same signature (DESIGN.md, "Kernels").

Every op dispatches on the tensor it writes: Triton for CUDA tensors, the torch reference
otherwise; ``GPUDIST_KERNELS=triton|torch`` forces either (see :mod:`gpudist.kernels.dispatch`).
Knows nothing of communication or ``nn.Module``s.
"""

from .bucket import pack, unpack
from .dispatch import implementation, use_triton
from .layout import FlatLayout
from .norm import squared_norm
from .optim import adam_step, sgd_step

__all__ = [
    "FlatLayout",
    "adam_step",
    "implementation",
    "pack",
    "sgd_step",
    "squared_norm",
    "unpack",
    "use_triton",
]
