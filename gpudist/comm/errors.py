"""The errors every transport raises: each names the op, the group and the rank."""

from __future__ import annotations

__all__ = [
    "CollectiveMismatchError",
    "CommunicationError",
    "CommunicationTimeoutError",
    "first_line",
    "op_error",
]


class CommunicationError(RuntimeError):
    """A collective or point-to-point op could not complete. Names the op, the group and the rank.

    Args:
        message: What failed and what to do about it.
        op: The op that failed (``"all_reduce"``, ``"init"``, ...), kept as ``self.op``.
        group: The group's name, kept as ``self.group``.
        rank: The rank that raised (-1: unknown), kept as ``self.rank``.
    """

    def __init__(self, message: str, *, op: str = "", group: str = "", rank: int = -1):
        super().__init__(message)
        self.op, self.group, self.rank = op, group, rank


class CommunicationTimeoutError(CommunicationError):
    """A peer did not take part in an op within the backend's timeout (it never joined, hangs, or died)."""


class CollectiveMismatchError(CommunicationError):
    """Ranks called an op with different names, shapes, dtypes or roots. Raised before anything was sent, so the
    group stays usable."""


def op_error(
    detail: str, op: str, group: str, rank: int, cls: type[CommunicationError] = CommunicationError
) -> CommunicationError:
    """The error of ``op`` failing on ``rank`` of ``group``: its message names all three, then ``detail``."""
    return cls(f"{op} on group '{group}' failed on rank {rank}: {detail}", op=op, group=group, rank=rank)


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (transport errors carry long C++ traces), or its type's name."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
