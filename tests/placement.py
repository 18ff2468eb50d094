"""Catch host-memory tensors on the CPU tier: a tensor that gpudist creates without ``device=`` lands on the CPU,
which on NCCL (GPU memory only) fails at the first op, but on the CPU backends works. Under :func:`strays_on_meta`
such tensors are made on the ``meta`` device instead, so the CPU backends refuse them (``tensor on meta but
backend ... works on cpu tensors``) and compute with them fails, exactly where a GPU run would break.

Only factory calls made from gpudist's own code are redirected (not torch's, not the tests'); gpudist states
host memory explicitly (``device="cpu"``) where it means it.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.overrides import TorchFunctionMode

_FACTORIES = {
    torch.tensor,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.randn,
    torch.rand,
    torch.randint,
    torch.linspace,
    torch.eye,
    torch.as_tensor,
}


class _StraysOnMeta(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if (
            func in _FACTORIES
            and kwargs.get("device") is None
            and not (func is torch.as_tensor and isinstance(args[0] if args else None, torch.Tensor))
        ):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller == "gpudist" or caller.startswith("gpudist."):
                kwargs["device"] = "meta"
        return func(*args, **kwargs)


@contextlib.contextmanager
def strays_on_meta():
    """Within the block (on this thread), tensors gpudist creates without ``device=`` are on ``meta``."""
    with _StraysOnMeta():
        yield


def run_checked(comm, body, kwargs: dict):
    """``body(comm, **kwargs)`` under :func:`strays_on_meta` (for ``run_ranks``: each rank thread pushes its own)."""
    with strays_on_meta():
        return body(comm, **kwargs)
