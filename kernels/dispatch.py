"""Which implementation of an op runs: the Triton kernel or its torch reference.

Default (``GPUDIST_KERNELS`` unset or ``auto``): Triton for CUDA tensors, the torch reference for
everything else. ``GPUDIST_KERNELS=triton`` forces the kernels (on CPU tensors this needs Triton's
interpreter, ``TRITON_INTERPRET=1`` set before gpudist is imported: that is how CI tests the
kernels' logic); ``GPUDIST_KERNELS=torch`` forces the references everywhere.
"""

from __future__ import annotations

import os

import torch

from ._triton import HAS_TRITON, interpreter_active

__all__ = ["ENV_VAR", "implementation", "use_triton"]

ENV_VAR = "GPUDIST_KERNELS"
_CHOICES = ("auto", "triton", "torch")


def implementation() -> str:
    """The forced choice from ``GPUDIST_KERNELS``: ``"auto"``, ``"triton"`` or ``"torch"``.

    Returns:
        The choice, lower-cased (``"auto"`` when the variable is unset or empty).

    Raises:
        ValueError: When ``GPUDIST_KERNELS`` holds anything else.
    """
    choice = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"{ENV_VAR}={choice!r} is not one of {', '.join(_CHOICES)}; unset it to let gpudist choose")
    return choice


def use_triton(tensor: torch.Tensor) -> bool:
    """True when the op on ``tensor`` (the buffer it writes) should run as a Triton kernel.

    Args:
        tensor: The buffer the op writes.

    Returns:
        Whether to launch the Triton kernel (else the torch reference runs).

    Raises:
        ValueError: When ``GPUDIST_KERNELS`` is not ``auto``, ``triton`` or ``torch``.
        RuntimeError: When ``GPUDIST_KERNELS=triton`` but Triton is not installed, or ``tensor`` is not on CUDA
            and Triton's interpreter is off.
    """
    choice = implementation()
    if choice == "torch":
        return False
    on_cuda = tensor.device.type == "cuda"
    if choice == "auto":
        return on_cuda and HAS_TRITON
    if not HAS_TRITON:
        raise RuntimeError(f"{ENV_VAR}=triton but Triton is not installed; pip install triton, or unset {ENV_VAR}")
    if not on_cuda and not interpreter_active():
        raise RuntimeError(
            f"{ENV_VAR}=triton but the tensors are on {tensor.device} and Triton's interpreter is off; "
            f"set TRITON_INTERPRET=1 before importing gpudist, move the tensors to CUDA, or unset {ENV_VAR}"
        )
    return True
