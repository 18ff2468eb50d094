"""A backend's ops without the cross-rank signature check: :class:`AgreedOps` (``comm.agreed``)."""

from __future__ import annotations

from collections.abc import Callable

from .work import Work

__all__ = ["AgreedOps"]


class AgreedOps:
    """A backend's ops without the cross-rank signature check (:attr:`CommunicationBackend.agreed`): the calls
    whose agreement the caller's construction guarantees, said once where the handle is taken instead of with an
    ``unchecked()`` block at every call.

    Args:
        backend: The :class:`~gpudist.comm.base.CommunicationBackend` whose ops these are (not annotated: ``base``
            imports this module, and the import graph has no cycle).
    """

    __slots__ = ("_backend",)

    def __init__(self, backend):
        self._backend = backend

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    def __repr__(self) -> str:
        return f"{self._backend!r}.agreed"


def _agreed_op(name: str) -> Callable[..., Work | None]:
    def op(self: AgreedOps, *args, **kwargs):
        backend = self._backend
        previous, backend.validate = backend.validate, False
        try:
            return getattr(backend, name)(*args, **kwargs)
        finally:
            backend.validate = previous

    op.__name__ = op.__qualname__ = name
    op.__doc__ = f":meth:`CommunicationBackend.{name}` without the cross-rank signature check."
    return op


for _name in (
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "send",
    "recv",
    "batch_send_recv",
    "all_to_all",
):
    setattr(AgreedOps, _name, _agreed_op(_name))
