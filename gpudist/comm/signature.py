"""Call signatures: what every rank of a group must agree on for one op, encoded for a cross-rank check, and the
errors raised when the ranks' calls differ."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .errors import CollectiveMismatchError
from .reduction import ReductionOperation

__all__ = ["SIGNATURE_LEN", "Signature", "mismatch_error", "p2p_mismatch_error", "stable_hash"]


_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float64: 2,
    torch.float16: 3,
    torch.bfloat16: 4,
    torch.int64: 5,
    torch.int32: 6,
    torch.int8: 7,
    torch.uint8: 8,
}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}
_OP_CODES = {
    name: i + 1
    for i, name in enumerate(
        ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "send", "all_to_all", "barrier", "new_group"]
    )
}
_CODE_OPS = {v: k for k, v in _OP_CODES.items()}
_RED_CODES = {op: i + 1 for i, op in enumerate(ReductionOperation)}
_CODE_REDS = {v: k for k, v in _RED_CODES.items()}
_MAX_DIMS = 8
SIGNATURE_LEN = 5 + _MAX_DIMS + 1  # op, dtype, reduction, root, ndim, dims..., extra


class Signature:
    """What every rank of a group must agree on for one op: name, dtype, shape, reduction and root/peer.

    ``extra`` carries op-specific agreement data (a hash of the rank list for ``new_group``). Encoded as
    ``SIGNATURE_LEN`` int64 values so transports can exchange it in one small collective. ``ndim``: only in a decoded
    signature whose shape had more than ``_MAX_DIMS`` dimensions, how many (``shape`` then holds the first
    ``_MAX_DIMS - 1``), -1 otherwise; ``tail``: with ``ndim``, the hash ``encode`` folded the remaining dimensions into.

    Built for every op, so a plain class with slots (a frozen dataclass's ``__init__`` costs the host ~5x more per
    call); treat it as immutable.
    """

    __slots__ = ("dtype", "extra", "ndim", "op", "reduction", "root", "shape", "tail")

    def __init__(
        self,
        op: str,
        dtype: torch.dtype | None = None,
        shape: tuple[int, ...] = (),
        reduction: ReductionOperation | None = None,
        root: int = -1,
        extra: int = 0,
        ndim: int = -1,
        tail: int = 0,
    ):
        self.op, self.dtype, self.shape, self.reduction = op, dtype, shape, reduction
        self.root, self.extra, self.ndim, self.tail = root, extra, ndim, tail

    def _key(self) -> tuple:
        return (self.op, self.dtype, self.shape, self.reduction, self.root, self.extra, self.ndim, self.tail)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Signature) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        fields = ("op", "dtype", "shape", "reduction", "root", "extra", "ndim", "tail")
        return f"Signature({', '.join(f'{f}={getattr(self, f)!r}' for f in fields)})"

    def encode(self) -> list[int]:
        if self.ndim > len(self.shape):  # a decoded folded signature encodes back to what it was decoded from
            dims, ndim = [*self.shape, self.tail], self.ndim
        else:
            dims = list(self.shape[:_MAX_DIMS]) + [0] * (_MAX_DIMS - min(len(self.shape), _MAX_DIMS))
            ndim = len(self.shape)
            if ndim > _MAX_DIMS:  # fold the tail into the last slot so different tails still differ
                dims[-1] = stable_hash(self.shape[_MAX_DIMS - 1 :])
        return [
            _OP_CODES[self.op],
            _DTYPE_CODES.get(self.dtype, 0) if self.dtype is not None else 0,
            _RED_CODES[self.reduction] if self.reduction is not None else 0,
            self.root,
            ndim,
            *dims,
            self.extra,
        ]

    @classmethod
    def decode(cls, values: Sequence[int]) -> Signature:
        """The signature ``encode`` gave, except that a shape of more than ``_MAX_DIMS`` dimensions comes back with
        ``ndim`` and the hash of its tail in ``tail`` (its first ``_MAX_DIMS - 1`` sizes as they were): two such
        shapes that differ anywhere still decode unequal."""
        values = [int(v) for v in values]
        ndim = values[4]
        dims = values[5 : 5 + min(ndim, _MAX_DIMS)]
        folded = ndim > _MAX_DIMS
        return cls(
            op=_CODE_OPS.get(values[0], f"op#{values[0]}"),
            dtype=_CODE_DTYPES.get(values[1]),
            shape=tuple(dims[:-1] if folded else dims),
            reduction=_CODE_REDS.get(values[2]),
            root=values[3],
            extra=values[-1],
            ndim=ndim if folded else -1,
            tail=dims[-1] if folded else 0,
        )

    def describe(self) -> str:
        parts = []
        if self.dtype is not None:
            shape = tuple(self.shape)
            if self.ndim > len(shape):  # decoded from a folded encoding: the tail is known only by its hash
                shape_text = f"({', '.join(map(str, shape))}, ... {self.ndim} dims, tail hash {self.tail:x})"
            else:
                shape_text = str(shape)
            parts += [f"shape={shape_text}", f"dtype={str(self.dtype).removeprefix('torch.')}"]
        if self.reduction is not None:
            parts.append(f"op={self.reduction.name}")
        if self.root >= 0:
            parts.append(f"{'peer' if self.op == 'send' else 'root'}={self.root}")
        if self.op == "new_group":
            parts.append(f"ranks_hash={self.extra}")
        return f"{self.op}({', '.join(parts)})"


def mismatch_error(signatures: Sequence[Signature], *, group: str, rank: int) -> CollectiveMismatchError | None:
    """The error every rank raises when the ranks' signatures differ, or None when they agree."""
    reference = signatures[0]
    for other_rank, sig in enumerate(signatures):
        if sig != reference:
            return CollectiveMismatchError(
                f"{reference.op} mismatch on group '{group}': rank 0 called {reference.describe()} but rank "
                f"{other_rank} called {sig.describe()}; every rank must call the same op with the same shape, "
                f"dtype and root (raised on rank {rank}, before anything was sent)",
                op=reference.op,
                group=group,
                rank=rank,
            )
    return None


def p2p_mismatch_error(
    group: str, rank: int, peer: int, *, sent: Signature, posted: Signature, side: str
) -> CollectiveMismatchError:
    """The error both ends of a send/recv raise when the sent tensor and the posted buffer differ."""
    sender, receiver = (rank, peer) if side == "send" else (peer, rank)
    return CollectiveMismatchError(
        f"{side} mismatch on group '{group}': rank {sender} sent shape={tuple(sent.shape)}, dtype={sent.dtype} but "
        f"rank {receiver} posted recv(shape={tuple(posted.shape)}, dtype={posted.dtype}); size the receive buffer "
        f"like the sent tensor (raised on rank {rank}; the payload was not delivered)",
        op=side,
        group=group,
        rank=rank,
    )


def stable_hash(values: Sequence[int]) -> int:
    """A 62-bit FNV-style hash of a sequence of ints, the same in every process and run (for comparing a rank list
    or a parameter layout across ranks).

    Args:
        values: The ints to hash, in order.

    Returns:
        A non-negative int below ``2**62``.
    """
    h = 1469598103934665603
    for v in values:
        h = ((h ^ (v + 1)) * 1099511628211) & ((1 << 62) - 1)
    return h
