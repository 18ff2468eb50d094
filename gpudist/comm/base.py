"""The communication contract every gpudist backend implements.

One contract, four transports. Every public method of :class:`CommunicationBackend` validates its
arguments locally (device, contiguity, dtype, sizes, rank range) *before* anything is sent, counts the
bytes it moves in :attr:`CommunicationBackend.stats`, and turns transport failures into
:class:`CommunicationError` naming the op, the group and the rank. Backends only implement the
transport (``_all_reduce`` and friends) and a cross-rank consistency check of the call signature.

Uneven sizes (``reduce_scatter`` / ``all_gather``): a flat buffer of ``n`` elements is split over
``N`` ranks into contiguous ranges in rank order; the first ``n % N`` ranks get ``n // N + 1``
elements, the rest ``n // N`` (the ``numpy.array_split`` rule). :func:`split_sizes` and
:func:`shard_range` are the single definition of that rule; ``gpudist.flat`` reuses them.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "DEFAULT_TIMEOUT",
    "AgreedOps",
    "CollectiveMismatchError",
    "CommStats",
    "CommunicationBackend",
    "CommunicationError",
    "CommunicationTimeoutError",
    "OpStats",
    "PlannedCollective",
    "ReductionOperation",
    "Work",
    "shard_range",
    "split_sizes",
    "stable_hash",
]

DEFAULT_TIMEOUT = 300.0
"""Seconds a collective may wait for its peers before raising :class:`CommunicationTimeoutError`."""


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


class ReductionOperation(enum.Enum):
    """How ``all_reduce`` and ``reduce_scatter`` combine the ranks' values."""

    SUM = "sum"
    AVERAGE = "average"
    MAX = "max"
    MIN = "min"
    PRODUCT = "product"

    @classmethod
    def parse(cls, op: ReductionOperation | str) -> ReductionOperation:
        """The reduction ``op`` names.

        Args:
            op: A ``ReductionOperation``, or a name: ``"sum"``, ``"average"`` (``"avg"``, ``"mean"``), ``"max"``,
                ``"min"`` or ``"product"`` (``"prod"``), in any case.

        Returns:
            The ``ReductionOperation``.

        Raises:
            ValueError: When ``op`` is neither a ``ReductionOperation`` nor one of those names.
        """
        if isinstance(op, cls):
            return op
        if isinstance(op, str):
            key = op.strip().upper()
            key = {"AVG": "AVERAGE", "MEAN": "AVERAGE", "PROD": "PRODUCT"}.get(key, key)
            if key in cls.__members__:
                return cls[key]
        raise ValueError(f"unknown reduction {op!r}; use one of {', '.join(cls.__members__)}")


def split_sizes(numel: int, world_size: int) -> list[int]:
    """Element counts of each rank's contiguous range when ``numel`` elements are split over ``world_size``.

    Args:
        numel: Elements of the flat buffer (>= 0).
        world_size: Ranks it is split over (>= 1).

    Returns:
        ``world_size`` counts in rank order: the first ``numel % world_size`` get ``numel // world_size + 1``.

    Raises:
        ValueError: When ``world_size < 1`` or ``numel < 0``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    base, extra = divmod(numel, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def _share(numel: int, world_size: int, rank: int) -> int:
    """``split_sizes(numel, world_size)[rank]`` without the list (checked on every collective)."""
    base, extra = divmod(numel, world_size)
    return base + (rank < extra)


def shard_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(start, end)`` of ``rank``'s range of a flat buffer of ``numel`` elements (see :func:`split_sizes`).

    Args:
        numel: Elements of the flat buffer.
        world_size: Ranks it is split over.
        rank: The rank whose range to return.

    Returns:
        ``(start, end)``, end exclusive.

    Raises:
        ValueError: When ``rank`` is not in ``0..world_size-1``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")
    base, extra = divmod(numel, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


# ---------------------------------------------------------------------------------------------------------------------
# Statistics


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0


@dataclass
class CommStats:
    """Per-op call and byte counters of one backend (one rank of one group).

    ``bytes`` is the op's payload as nccl-tests counts "size": the tensor for ``all_reduce``, ``broadcast``,
    ``send`` and ``recv``; the input of ``reduce_scatter`` and ``all_to_all``; the output of ``all_gather``.
    The consistency checks gpudist runs before ops are counted apart, in ``check_calls``/``check_bytes``.
    """

    ops: dict[str, OpStats] = field(default_factory=dict)
    check_calls: int = 0
    check_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, op: str, nbytes: int) -> None:
        with self._lock:
            entry = self.ops.get(op)
            if entry is None:
                entry = self.ops[op] = OpStats()
            entry.calls += 1
            entry.bytes += nbytes

    def record_check(self, nbytes: int) -> None:
        with self._lock:
            self.check_calls += 1
            self.check_bytes += nbytes

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.ops.values())

    @property
    def total_calls(self) -> int:
        return sum(s.calls for s in self.ops.values())

    def bytes_of(self, op: str) -> int:
        return self.ops[op].bytes if op in self.ops else 0

    def reset(self) -> None:
        with self._lock:
            self.ops.clear()
            self.check_calls = self.check_bytes = 0

    def as_dict(self) -> dict:
        with self._lock:
            return {
                "ops": {k: {"calls": v.calls, "bytes": v.bytes} for k, v in sorted(self.ops.items())},
                "total_bytes": sum(s.bytes for s in self.ops.values()),
                "check_calls": self.check_calls,
                "check_bytes": self.check_bytes,
            }


# ---------------------------------------------------------------------------------------------------------------------
# Async handles


class Work:
    """Handle of an op started with ``async_op=True``: ``wait()`` blocks until it completes (or raises its error).

    Args:
        wait_fn: Blocks until the op completes, raising its error; None: the op is already complete.
        done_fn: Whether the op has completed, without blocking; None: unknown until ``wait`` returns.
    """

    def __init__(self, wait_fn: Callable[[], None] | None = None, done_fn: Callable[[], bool] | None = None):
        self._wait_fn = wait_fn
        self._done_fn = done_fn
        self._finished = wait_fn is None
        self._error: BaseException | None = None

    def wait(self) -> None:
        """Block until the op completes; later calls return (or raise) at once.

        Raises:
            CommunicationError: The op's error (or its subclasses :class:`CommunicationTimeoutError` and
                :class:`CollectiveMismatchError`), raised again by every later call.
        """
        if self._error is not None:
            raise self._error
        if self._finished:
            return
        try:
            self._wait_fn()
        except BaseException as e:
            self._error = e
            raise
        finally:
            self._finished = True

    def is_completed(self) -> bool:
        """Whether the op has completed, without blocking.

        Returns:
            True once :meth:`wait` returned or raised, or when the transport reports the op done.
        """
        if self._finished:
            return True
        return bool(self._done_fn()) if self._done_fn is not None else False


class PlannedCollective:
    """One collective, checked when it was planned (``CommunicationBackend.plan_*``): :meth:`start` issues it and
    returns its :class:`Work`. What the backend's public op does on every call beyond the transport's own (argument
    checks, a signature, the unchecked context) happened once; what remains is the failure state, the byte counters
    and the transport's call. A plan on fixed buffers (:meth:`CommunicationBackend.plan_all_reduce`) starts with no
    argument; one of a fixed shape (:meth:`CommunicationBackend.plan_reduce_scatter`) takes its tensors per start."""

    __slots__ = ("_backend", "_launch", "_nbytes", "_op")

    def __init__(self, backend: CommunicationBackend, op: str, nbytes: int, launch: Callable[..., Work]):
        self._backend, self._op, self._nbytes, self._launch = backend, op, nbytes, launch

    def start(self, *tensors: torch.Tensor) -> Work:
        """Issue the collective (asynchronously, as ``async_op=True``).

        Args:
            *tensors: Nothing for a plan on fixed buffers; the tensors of this start for a plan of a fixed shape
                (as its ``plan_*`` method says: not checked here).

        Returns:
            Its :class:`Work`; ``wait()`` raises what the op's ``wait`` would.

        Raises:
            CommunicationError: When the group is unusable after an earlier failure, or the transport failed.
        """
        backend, op = self._backend, self._op
        if backend._broken is not None:
            backend._raise_if_broken(op)
        backend.stats.record(op, self._nbytes)
        try:
            work = self._launch(*tensors)
        except RuntimeError as e:
            raise backend._failed(e, op) from (None if isinstance(e, CommunicationError) else e)
        return Work(lambda: backend._wait(work, op), work.is_completed)


# ---------------------------------------------------------------------------------------------------------------------
# Call signatures: what every rank must agree on


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


# ---------------------------------------------------------------------------------------------------------------------
# The contract


class CommunicationBackend(ABC):
    """A group of ``world_size`` ranks that exchange torch tensors; this object is one rank's view of it.

    Every op takes contiguous tensors on the backend's device. Collective ops (all but ``send``/``recv``) must
    be called by every rank of the group in the same order with the same shape, dtype and root: a backend
    checks this and raises :class:`CommunicationError` on every rank, naming the rank that differed, before
    anything is sent. With ``async_op=True`` an op returns a :class:`Work` whose ``wait()`` completes it; the
    input must not be changed and the output not read before then. Without it, ops return ``None`` once done.
    An async op's errors that arise after it started (a timeout, a transport failure) are raised by ``wait()``.

    Args:
        rank: This rank in the group, ``0..world_size-1``.
        world_size: The number of ranks in the group (>= 1).
        group: The group's name, used in error messages.
        timeout: Seconds an op may wait for its peers (> 0).

    Raises:
        ValueError: When ``world_size < 1``, ``rank`` is out of range, or ``timeout`` is not positive.
    """

    #: Name of the transport ("inmemory", "gloo", "nccl", "mpi").
    name: str = "abstract"

    #: True where point-to-point ops execute in issue order and block what follows until their peer matches them
    #: (NCCL on a CUDA stream). There a receive posted ahead of time stalls this rank's later work, so schedules
    #: post receives only when needed and group crossing sends and receives with :meth:`batch_send_recv`.
    ordered_p2p: bool = False

    #: True where AVERAGE costs no more than SUM (the transport divides while it reduces: ncclAvg). Elsewhere it is
    #: SUM and then a division pass, so callers that touch the data anyway fold the 1/N into that pass and send SUM.
    averages_in_transport: bool = False

    #: Whether a strategy should send a large update in chunks, each while the next is computed. It pays where the
    #: transport progresses ops on its own threads and small ops are cheap (Gloo, MPI, in-memory); not on NCCL, where
    #: ZeRO's chunks of uneven shares become per-rank broadcasts, each a kernel launch, and one all-gather on the
    #: communication stream (which overlaps whatever compute is enqueued after it) is best.
    chunked_overlap: bool = True

    #: Whether the cross-rank signature check of a validated op stops the host until the device catches up (NCCL:
    #: an all-gather on the device, read back by the host). Per-step collectives whose shapes follow the data rather
    #: than a layout checked at wrap time (tensor-parallel activations) are checked only where this is False.
    check_syncs_host: bool = False

    #: Where the ranks sit (a ``gpudist.Topology``: node layout, intra- and inter-node groups). ``gpudist.init()``
    #: sets it on the world group's backend; None on backends built otherwise (build one with
    #: ``gpudist.Topology(comm, ranks_per_node=...)``).
    topology = None

    def __init__(self, rank: int, world_size: int, group: str, timeout: float):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}; ranks are 0..{world_size - 1}")
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.timeout = float(timeout)
        self.stats = CommStats()
        self._broken: CommunicationError | None = None

    # -- what a transport provides ---------------------------------------------------------------------------------

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Device type the tensors of this backend live on (``cpu`` or ``cuda``)."""

    @abstractmethod
    def _all_reduce(self, sig: Signature, tensor: torch.Tensor, op: ReductionOperation) -> Work: ...

    @abstractmethod
    def _reduce_scatter(
        self, sig: Signature, inp: torch.Tensor, out: torch.Tensor, op: ReductionOperation, scratch_input: bool = False
    ) -> Work: ...

    @abstractmethod
    def _all_gather(self, sig: Signature, inp: torch.Tensor, out: torch.Tensor) -> Work: ...

    @abstractmethod
    def _broadcast(self, sig: Signature, tensor: torch.Tensor, src: int) -> Work: ...

    @abstractmethod
    def _send(self, sig: Signature, tensor: torch.Tensor, dst: int) -> Work: ...

    @abstractmethod
    def _recv(self, sig: Signature, tensor: torch.Tensor, src: int) -> Work: ...

    @abstractmethod
    def _all_to_all(self, sig: Signature, inp: torch.Tensor, out: torch.Tensor) -> Work: ...

    @abstractmethod
    def _barrier(self, sig: Signature) -> Work: ...

    @abstractmethod
    def _new_group(self, sig: Signature, ranks: list[int]) -> CommunicationBackend | None: ...

    def _gather_signatures(self, op: str, mine: torch.Tensor, everyone: torch.Tensor) -> None:
        """All-gather ``mine`` (``SIGNATURE_LEN`` int64 on CPU) into ``everyone`` (world x that), within the timeout.
        Transports that check signatures with a round trip (:meth:`_check`) provide it."""
        raise NotImplementedError

    def _check(self, sig: Signature, validate: bool | None = None) -> None:
        """Raise CollectiveMismatchError on every rank unless all ranks pass the same signature (when validating;
        ``validate`` overrides ``self.validate``, for transports that run the check later on another thread)."""
        if not (self.validate if validate is None else validate) or self.world_size == 1:
            return
        mine = torch.tensor(sig.encode(), dtype=torch.int64)
        everyone = torch.empty(self.world_size * SIGNATURE_LEN, dtype=torch.int64)
        self._gather_signatures(sig.op, mine, everyone)
        self.stats.record_check(everyone.numel() * 8)
        rows = everyone.view(self.world_size, SIGNATURE_LEN)
        if not bool((rows == mine).all()):
            error = mismatch_error([Signature.decode(r) for r in rows.tolist()], group=self.group, rank=self.rank)
            if error is None:  # rows that decode alike (an unknown code): still a mismatch, named by the raw rows
                error = CollectiveMismatchError(
                    f"{sig.op} mismatch on group '{self.group}': the ranks' encoded signatures differ "
                    f"({rows.tolist()}); every rank must call the same op with the same shape, dtype and root "
                    f"(raised on rank {self.rank}, before anything was sent)",
                    op=sig.op,
                    group=self.group,
                    rank=self.rank,
                )
            raise error

    def _translate(self, error: BaseException, op: str) -> CommunicationError:
        """Map a transport's native exception to a CommunicationError (backends refine this)."""
        return self._error(f"{type(error).__name__}: {error}", op)

    # -- the public ops ----------------------------------------------------------------------------------------------

    def all_reduce(
        self, tensor: torch.Tensor, op: ReductionOperation | str = ReductionOperation.SUM, *, async_op: bool = False
    ) -> Work | None:
        """Combine ``tensor`` over all ranks with ``op``, in place, on every rank.

        Args:
            tensor: A contiguous tensor on the backend's device, overwritten with the result.
            op: The reduction (a name is parsed by :meth:`ReductionOperation.parse`); AVERAGE needs a floating-point
                tensor.
            async_op: Return a :class:`Work` at once instead of waiting for completion.

        Returns:
            A :class:`Work` with ``async_op=True``, else None once done.

        Raises:
            TypeError: When ``tensor`` is not a tensor, its dtype is not supported, or ``op`` is AVERAGE of an
                integer dtype.
            ValueError: When ``tensor`` is on another device or not contiguous, or ``op`` is not a reduction.
            CollectiveMismatchError: When the ranks' calls differ in shape, dtype or reduction (checked while
                :attr:`validate` is on; raised on every rank before anything is sent).
            CommunicationTimeoutError: When a rank did not take part within the backend's timeout.
            CommunicationError: When the transport failed, or the group is unusable after an earlier failure.
        """
        op = ReductionOperation.parse(op)
        self._check_tensor("all_reduce", tensor)
        self._check_reduction("all_reduce", op, tensor.dtype)
        sig = Signature("all_reduce", tensor.dtype, tuple(tensor.shape), op)
        nbytes = tensor.numel() * tensor.element_size()
        return self._run(sig, nbytes, async_op, lambda: self._all_reduce(sig, tensor, op))

    def plan_all_reduce(
        self, tensor: torch.Tensor, op: ReductionOperation | str = ReductionOperation.SUM
    ) -> PlannedCollective:
        """An all-reduce of ``tensor`` (in place, as :meth:`all_reduce`) checked now and issued later, as often as
        needed, by :meth:`PlannedCollective.start`: for a buffer that every step reduces (a gradient bucket), whose
        shape agrees on every rank by construction. A start does no argument check, builds nothing and skips the
        cross-rank signature check (as inside :meth:`unchecked`): the transport's call and its bookkeeping only.

        Args:
            tensor: A contiguous tensor on the backend's device, reduced in place at every start; it must keep its
                storage for the plan's life.
            op: The reduction, as for :meth:`all_reduce`.

        Returns:
            The plan.

        Raises:
            TypeError, ValueError: As :meth:`all_reduce`, now rather than at a start.
        """
        op = ReductionOperation.parse(op)
        self._check_tensor("all_reduce", tensor)
        self._check_reduction("all_reduce", op, tensor.dtype)
        return self._planned_all_reduce(tensor, op)

    def _planned_all_reduce(self, tensor: torch.Tensor, op: ReductionOperation) -> PlannedCollective:
        """The plan of a checked all-reduce: each start calls the transport's ``_all_reduce`` without the cross-rank
        signature check (agreed when planned); transports with a leaner call override this."""
        sig = Signature("all_reduce", tensor.dtype, tuple(tensor.shape), op)
        return self._planned(sig, tensor.numel() * tensor.element_size(), lambda: self._all_reduce(sig, tensor, op))

    def _planned(self, sig: Signature, nbytes: int, call: Callable[..., Work]) -> PlannedCollective:
        """The generic plan: each start runs the transport's ``call`` (its arguments bound, or passed per start)
        with the cross-rank signature check off, as inside :meth:`unchecked`."""

        def launch(*tensors: torch.Tensor) -> Work:
            previous, self.validate = self.validate, False
            try:
                return call(*tensors)
            finally:
                self.validate = previous

        return PlannedCollective(self, sig.op, nbytes, launch)

    def plan_reduce_scatter(
        self,
        numel: int,
        dtype: torch.dtype,
        op: ReductionOperation | str = ReductionOperation.SUM,
        *,
        scratch_input: bool = False,
    ) -> PlannedCollective:
        """A reduce-scatter of ``numel`` elements of ``dtype`` (as :meth:`reduce_scatter`) checked now and issued
        later by :meth:`PlannedCollective.start` ``(inp, out)``, on new buffers each time (ZeRO-2's send buffer of a
        bucket, made and freed every step). A start checks nothing about its tensors: ``inp`` must be a contiguous
        ``numel``-element tensor of ``dtype`` on the backend's device and ``out`` this rank's share
        (:func:`split_sizes`) of the same, as the caller's construction guarantees, and every rank's plan must
        agree (the cross-rank signature check is skipped, as inside :meth:`unchecked`).

        Args:
            numel: Elements of every start's ``inp`` (>= 0).
            dtype: Their dtype.
            op: The reduction, as for :meth:`reduce_scatter`.
            scratch_input: As for :meth:`reduce_scatter`, at every start.

        Returns:
            The plan.

        Raises:
            TypeError, ValueError: As :meth:`reduce_scatter` for such tensors, now rather than at a start.
        """
        op = ReductionOperation.parse(op)
        self._check_plan("reduce_scatter", numel, dtype)
        self._check_reduction("reduce_scatter", op, dtype)
        return self._planned_reduce_scatter(numel, dtype, op, scratch_input)

    def _planned_reduce_scatter(
        self, numel: int, dtype: torch.dtype, op: ReductionOperation, scratch_input: bool
    ) -> PlannedCollective:
        """The plan of a checked reduce-scatter: each start calls the transport's ``_reduce_scatter`` without the
        cross-rank signature check; transports with a leaner call override this."""
        sig = Signature("reduce_scatter", dtype, (numel,), op)
        return self._planned(
            sig, numel * dtype.itemsize, lambda inp, out: self._reduce_scatter(sig, inp, out, op, scratch_input)
        )

    def reduce_scatter(
        self,
        inp: torch.Tensor,
        out: torch.Tensor,
        op: ReductionOperation | str = ReductionOperation.SUM,
        *,
        async_op: bool = False,
        scratch_input: bool = False,
    ) -> Work | None:
        """Combine ``inp`` over all ranks; rank r gets range r of the result (:func:`split_sizes`) in ``out``.

        ``out`` may be ``inp``'s own range r (the in-place form, as NCCL defines it). ``scratch_input=True`` says the
        caller has no further use for ``inp``: a transport whose reduce-scatter is an all-reduce (Gloo) then reduces
        ``inp`` in place instead of a copy of it, and ``inp`` holds garbage after (but for ``out``).

        Args:
            inp: This rank's contribution, a contiguous tensor on the backend's device (read as flat).
            out: Receives this rank's range of the result: ``split_sizes(inp.numel(), world_size)[rank]`` elements
                of ``inp``'s dtype, on ``inp``'s device.
            op: The reduction (a name is parsed by :meth:`ReductionOperation.parse`); AVERAGE needs a floating-point
                dtype.
            async_op: Return a :class:`Work` at once instead of waiting for completion.
            scratch_input: The caller has no further use for ``inp``, as described above.

        Returns:
            A :class:`Work` with ``async_op=True``, else None once done.

        Raises:
            TypeError: When ``inp`` or ``out`` is not a tensor, their dtypes differ or are not supported, or
                ``op`` is AVERAGE of an integer dtype.
            ValueError: When a tensor is on another device (or they are on different ones) or not contiguous,
                ``out`` does not have this rank's share of elements, or ``op`` is not a reduction.
            CollectiveMismatchError: When the ranks' calls differ in shape, dtype or reduction (checked while
                :attr:`validate` is on; raised on every rank before anything is sent).
            CommunicationTimeoutError: When a rank did not take part within the backend's timeout.
            CommunicationError: When the transport failed, or the group is unusable after an earlier failure.
        """
        op = ReductionOperation.parse(op)
        self._check_pair("reduce_scatter", inp, out)
        self._check_reduction("reduce_scatter", op, inp.dtype)
        expected = _share(inp.numel(), self.world_size, self.rank)
        if out.numel() != expected:
            raise ValueError(
                f"reduce_scatter: out has {out.numel()} elements but rank {self.rank}'s share of {inp.numel()} "
                f"over {self.world_size} ranks is {expected} (first numel % world_size ranks get one more); "
                f"size out with gpudist.comm.split_sizes(inp.numel(), world_size)[rank]"
            )
        sig = Signature("reduce_scatter", inp.dtype, tuple(inp.shape), op)
        nbytes = inp.numel() * inp.element_size()
        return self._run(sig, nbytes, async_op, lambda: self._reduce_scatter(sig, inp, out, op, scratch_input))

    def all_gather(self, inp: torch.Tensor, out: torch.Tensor, *, async_op: bool = False) -> Work | None:
        """Concatenate every rank's ``inp`` in rank order into ``out`` (flat; uneven shares per :func:`split_sizes`).

        Args:
            inp: This rank's share: ``split_sizes(out.numel(), world_size)[rank]`` elements, contiguous, on the
                backend's device.
            out: Receives every rank's share in rank order (read as flat), of ``inp``'s dtype and device.
            async_op: Return a :class:`Work` at once instead of waiting for completion.

        Returns:
            A :class:`Work` with ``async_op=True``, else None once done.

        Raises:
            TypeError: When ``inp`` or ``out`` is not a tensor, or their dtypes differ or are not supported.
            ValueError: When a tensor is on another device (or they are on different ones) or not contiguous, or
                ``inp`` does not have this rank's share of ``out``'s elements.
            CollectiveMismatchError: When the ranks' calls differ in shape, dtype (checked while
                :attr:`validate` is on; raised on every rank before anything is sent).
            CommunicationTimeoutError: When a rank did not take part within the backend's timeout.
            CommunicationError: When the transport failed, or the group is unusable after an earlier failure.
        """
        self._check_pair("all_gather", inp, out)
        expected = _share(out.numel(), self.world_size, self.rank)
        if inp.numel() != expected:
            raise ValueError(
                f"all_gather: inp has {inp.numel()} elements but rank {self.rank}'s share of out ({out.numel()} "
                f"elements over {self.world_size} ranks) is {expected}; size inp with "
                f"gpudist.comm.split_sizes(out.numel(), world_size)[rank]"
            )
        sig = Signature("all_gather", out.dtype, tuple(out.shape))
        nbytes = out.numel() * out.element_size()
        return self._run(sig, nbytes, async_op, lambda: self._all_gather(sig, inp, out))

    def plan_all_gather(self, numel: int, dtype: torch.dtype) -> PlannedCollective:
        """An all-gather into ``numel`` elements of ``dtype`` (as :meth:`all_gather`) checked now and issued later by
        :meth:`PlannedCollective.start` ``(inp, out)``, on the same buffers every time (ZeRO's updated parameters)
        or new ones (FSDP's gathered unit). As :meth:`plan_reduce_scatter`, a start checks nothing about its tensors:
        ``out`` must be a contiguous ``numel``-element tensor of ``dtype`` on the backend's device and ``inp`` this
        rank's share of it (:func:`split_sizes`).

        Args:
            numel: Elements of every start's ``out`` (>= 0).
            dtype: Their dtype.

        Returns:
            The plan.

        Raises:
            TypeError, ValueError: As :meth:`all_gather` for such tensors, now rather than at a start.
        """
        self._check_plan("all_gather", numel, dtype)
        return self._planned_all_gather(numel, dtype)

    def _planned_all_gather(self, numel: int, dtype: torch.dtype) -> PlannedCollective:
        sig = Signature("all_gather", dtype, (numel,))
        return self._planned(sig, numel * dtype.itemsize, lambda inp, out: self._all_gather(sig, inp, out))

    def _check_plan(self, op: str, numel: int, dtype: torch.dtype) -> None:
        """A plan by shape: ``numel`` a count and ``dtype`` one this backend carries (checked before anything is
        sent)."""
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"plan_{op}: numel must be an int >= 0, got {numel!r}")
        self._check_tensor(op, torch.empty(0, dtype=dtype, device=self.device), "tensors")

    def plan_broadcast(self, tensor: torch.Tensor, src: int) -> PlannedCollective:
        """A broadcast of ``tensor`` from ``src`` (as :meth:`broadcast`) checked now and issued later, as often as
        needed, by :meth:`PlannedCollective.start` (ZeRO's updated parameters, sent chunk by chunk). As
        :meth:`plan_all_reduce`, a start checks nothing; ``tensor`` must keep its storage for the plan's life.

        Returns:
            The plan.

        Raises:
            TypeError, ValueError: As :meth:`broadcast`, now rather than at a start.
        """
        self._check_tensor("broadcast", tensor)
        self._check_peer("broadcast", src, "src", allow_self=True)
        return self._planned_broadcast(tensor, src)

    def _planned_broadcast(self, tensor: torch.Tensor, src: int) -> PlannedCollective:
        sig = Signature("broadcast", tensor.dtype, tuple(tensor.shape), root=src)
        return self._planned(sig, tensor.numel() * tensor.element_size(), lambda: self._broadcast(sig, tensor, src))

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False) -> Work | None:
        """Copy rank ``src``'s ``tensor`` into ``tensor`` on every rank.

        Args:
            tensor: A contiguous tensor on the backend's device: the data on ``src``, overwritten elsewhere.
            src: The rank whose tensor every rank receives.
            async_op: Return a :class:`Work` at once instead of waiting for completion.

        Returns:
            A :class:`Work` with ``async_op=True``, else None once done.

        Raises:
            TypeError: When ``tensor`` is not a tensor or its dtype is not supported, or ``src`` is not an int.
            ValueError: When ``tensor`` is on another device or not contiguous, or ``src`` is not a rank of the
                group.
            CollectiveMismatchError: When the ranks' calls differ in shape, dtype or root (checked while
                :attr:`validate` is on; raised on every rank before anything is sent).
            CommunicationTimeoutError: When a rank did not take part within the backend's timeout.
            CommunicationError: When the transport failed, or the group is unusable after an earlier failure.
        """
        self._check_tensor("broadcast", tensor)
        self._check_peer("broadcast", src, "src", allow_self=True)
        sig = Signature("broadcast", tensor.dtype, tuple(tensor.shape), root=src)
        nbytes = tensor.numel() * tensor.element_size()
        return self._run(sig, nbytes, async_op, lambda: self._broadcast(sig, tensor, src))

    def send(self, tensor: torch.Tensor, dst: int, *, async_op: bool = False) -> Work | None:
        """Send ``tensor`` to rank ``dst``, which must post a ``recv`` of the same shape and dtype.

        Not collective: only ``dst`` takes part.

        Args:
            tensor: A contiguous tensor on the backend's device; not to be changed before the send completes.
            dst: The receiving rank (not this one).
            async_op: Return a :class:`Work` at once instead of waiting for completion.

        Returns:
            A :class:`Work` with ``async_op=True``, else None once done.

        Raises:
            TypeError: When ``tensor`` is not a tensor or its dtype is not supported, or ``dst`` is not an int.
            ValueError: When ``tensor`` is on another device or not contiguous, or ``dst`` is not a rank of the
                group or is this rank.
            CollectiveMismatchError: When ``dst`` posted a receive of another shape or dtype (the payload is not
                delivered).
            CommunicationTimeoutError: When ``dst`` did not take part within the backend's timeout.
            CommunicationError: When the transport failed, or the group is unusable after an earlier failure.
        """
        self._check_tensor("send", tensor)
        self._check_peer("send", dst, "dst")
        sig = Signature("send", tensor.dtype, tuple(tensor.shape), root=dst)
        return self._run(sig, tensor.numel() * tensor.element_size(), async_op, lambda: self._send(sig, tensor, dst))

    def recv(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> Work | None:
        """Receive into ``tensor`` what rank ``src`` sends; a shape or dtype that differs from the send raises here.

        Not collective: only ``src`` takes part.

        Args:
            tensor: A contiguous tensor on the backend's device, shaped like the sent one; overwritten.
            src: The sending rank (not this one).
            async_op: Return a :class:`Work` at once instead of waiting for completion.

        Returns:
            A :class:`Work` with ``async_op=True``, else None once done.

        Raises:
            TypeError: When ``tensor`` is not a tensor or its dtype is not supported, or ``src`` is not an int.
            ValueError: When ``tensor`` is on another device or not contiguous, or ``src`` is not a rank of the
                group or is this rank.
            CollectiveMismatchError: When ``src`` sent a tensor of another shape or dtype.
            CommunicationTimeoutError: When ``src`` did not take part within the backend's timeout.
            CommunicationError: When the transport failed, or the group is unusable after an earlier failure.
        """
        self._check_tensor("recv", tensor)
        self._check_peer("recv", src, "src")
        # The signature is the one the matching send carries, so the two compare directly.
        sig = Signature("send", tensor.dtype, tuple(tensor.shape), root=self.rank)
        return self._run(
            sig,
            tensor.numel() * tensor.element_size(),
            async_op,
            lambda: self._recv(sig, tensor, src),
            stat_name="recv",
        )

    def batch_send_recv(
        self, sends: Sequence[tuple[torch.Tensor, int]] = (), recvs: Sequence[tuple[torch.Tensor, int]] = ()
    ) -> Work:
        """Post the ``(tensor, dst)`` sends and ``(tensor, src)`` receives together and return one :class:`Work`
        for all of them (wait on it before reading a received tensor or changing a sent one). They progress
        concurrently (on NCCL: one group call), so two ranks that each send to the other and receive from it in
        one batch cannot deadlock, as they can with separate blocking ops where p2p runs in issue order
        (:attr:`ordered_p2p`). Every tensor and peer is checked before anything is posted.

        Args:
            sends: ``(tensor, dst)`` pairs, as for :meth:`send`.
            recvs: ``(tensor, src)`` pairs, as for :meth:`recv`.

        Returns:
            One :class:`Work` for all of them; its ``wait()`` raises what :meth:`send` and :meth:`recv` raise once
            started (a mismatch, a timeout, a transport failure).

        Raises:
            TypeError: When a tensor is not a tensor or its dtype is not supported, or a peer is not an int.
            ValueError: When a tensor is on another device or not contiguous, or a peer is not a rank of the group
                or is this rank.
        """
        sends, recvs = [(t, int(d)) for t, d in sends], [(t, int(s)) for t, s in recvs]
        for tensor, dst in sends:
            self._check_tensor("send", tensor)
            self._check_peer("send", dst, "dst")
        for tensor, src in recvs:
            self._check_tensor("recv", tensor)
            self._check_peer("recv", src, "src")
        return self._batch_send_recv(sends, recvs)

    def _batch_send_recv(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> Work:
        """Transports where separately posted async ops already progress concurrently just post them all."""
        works = [self.send(t, dst, async_op=True) for t, dst in sends]
        works += [self.recv(t, src, async_op=True) for t, src in recvs]

        def wait() -> None:
            for work in works:
                work.wait()

        return Work(wait, lambda: all(w.is_completed() for w in works))

    def all_to_all(self, inp: torch.Tensor, out: torch.Tensor, *, async_op: bool = False) -> Work | None:
        """Split ``inp`` into ``world_size`` equal parts; part j goes to rank j; ``out``'s part i comes from rank i.

        Args:
            inp: A contiguous tensor on the backend's device (read as flat), its size a multiple of ``world_size``.
            out: Receives the parts; same size, dtype and device as ``inp``.
            async_op: Return a :class:`Work` at once instead of waiting for completion.

        Returns:
            A :class:`Work` with ``async_op=True``, else None once done.

        Raises:
            TypeError: When ``inp`` or ``out`` is not a tensor, or their dtypes differ or are not supported.
            ValueError: When a tensor is on another device (or they are on different ones) or not contiguous, or
                ``inp`` and ``out`` differ in size or their size is not a multiple of ``world_size``.
            CollectiveMismatchError: When the ranks' calls differ in shape, dtype (checked while
                :attr:`validate` is on; raised on every rank before anything is sent).
            CommunicationTimeoutError: When a rank did not take part within the backend's timeout.
            CommunicationError: When the transport failed, or the group is unusable after an earlier failure.
        """
        self._check_pair("all_to_all", inp, out)
        if inp.numel() != out.numel() or inp.numel() % self.world_size:
            raise ValueError(
                f"all_to_all: inp ({inp.numel()} elements) and out ({out.numel()}) must have the same size, "
                f"divisible by world_size {self.world_size}; pad both to a multiple of the world size"
            )
        sig = Signature("all_to_all", inp.dtype, tuple(inp.shape))
        nbytes = inp.numel() * inp.element_size()
        return self._run(sig, nbytes, async_op, lambda: self._all_to_all(sig, inp, out))

    def barrier(self) -> None:
        """Return once every rank of the group has entered the barrier.

        Raises:
            CollectiveMismatchError: When another rank called a different op at this point.
            CommunicationTimeoutError: When a rank did not enter within the backend's timeout.
            CommunicationError: When the transport failed, or the group is unusable after an earlier failure.
        """
        sig = Signature("barrier")
        self._run(sig, 0, False, lambda: self._barrier(sig))

    def new_group(self, ranks: Sequence[int]) -> CommunicationBackend | None:
        """A backend for the sub-group ``ranks`` (ranks of this group; rank i of the new group is ``ranks[i]``).

        Collective: every rank of this group calls it with the same list. Members get the sub-group's backend,
        the other ranks ``None``.

        Args:
            ranks: Distinct ranks of this group, in the new group's rank order.

        Returns:
            The sub-group's backend on its members (same transport, timeout and validation), else None.

        Raises:
            ValueError: When ``ranks`` is empty, has duplicates, or holds a rank outside this group.
            CollectiveMismatchError: When the ranks of this group passed different lists.
            CommunicationTimeoutError: When a rank did not take part within the backend's timeout.
            CommunicationError: When the transport failed, or the group is unusable after an earlier failure (or,
                Gloo, the backend wraps a process group whose store it does not know).
        """
        ranks = [int(r) for r in ranks]
        if not ranks:
            raise ValueError("new_group: ranks is empty; pass the ranks of this group that form the sub-group")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"new_group: ranks {ranks} contain duplicates")
        for r in ranks:
            self._check_peer("new_group", r, "ranks", allow_self=True)
        sig = Signature("new_group", extra=stable_hash(ranks))
        self._raise_if_broken("new_group")
        with self._failures("new_group"):
            group = self._new_group(sig, ranks)
        if group is not None:
            group.parent_ranks = tuple(ranks)
        return group

    # -- state -------------------------------------------------------------------------------------------------------

    #: This group's ranks in the group :meth:`new_group` made it from (rank i of this group is entry i); None for a
    #: group made otherwise (a world group).
    parent_ranks: tuple[int, ...] | None = None

    #: Whether collectives first check across ranks that all called the same op with the same shape/dtype/root.
    #: Backends where the check costs a round trip (Gloo) honour it; the in-memory backend checks for free always.
    validate: bool = True

    @contextlib.contextmanager
    def unchecked(self) -> Iterator[CommunicationBackend]:
        """Skip the cross-rank consistency check for ops issued inside the block.

        For code whose shapes agree on every rank by construction (gradient buckets laid out from the same model
        and checked once): saves one small-message round trip per op. A mismatch inside the block is not caught.

        Yields:
            This backend.
        """
        previous, self.validate = self.validate, False
        try:
            yield self
        finally:
            self.validate = previous

    @property
    def agreed(self) -> AgreedOps:
        """This group's ops for calls that agree on every rank by construction: a strategy's per-step traffic over
        buffers laid out from a model whose names, shapes and dtypes were checked across ranks when it was wrapped,
        or a scalar every rank reduces. Each op runs without the cross-rank signature check, as inside
        :meth:`unchecked` (saving its small-message round trip); a mismatch there is not caught. Anything else (the
        group's own attributes) reads through to the backend.

        Returns:
            The group's :class:`AgreedOps` (one per backend).
        """
        ops = self.__dict__.get("_agreed")
        if ops is None:
            ops = self.__dict__["_agreed"] = AgreedOps(self)
        return ops

    @property
    def healthy(self) -> bool:
        """False once an op failed in a way that leaves the group unusable (timeout, dead peer)."""
        return self._broken is None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, group={self.group!r}, "
            f"timeout={self.timeout:g})"
        )

    # -- helpers shared by all backends ------------------------------------------------------------------------------

    def _error(self, detail: str, op: str, cls: type[CommunicationError] = CommunicationError) -> CommunicationError:
        return op_error(detail, op, self.group, self.rank, cls)

    def _mark_broken(self, error: CommunicationError) -> CommunicationError:
        if self._broken is None and not isinstance(error, CollectiveMismatchError):
            self._broken = error
        return error

    def _raise_if_broken(self, op: str) -> None:
        if self._broken is not None:
            raise self._error(  # of the same class, so `except CommunicationTimeoutError` sees a watchdog's timeout
                f"the group is unusable since an earlier failure ({self._broken}); create a new backend/process group",
                op,
                type(self._broken),
            )

    def _run(
        self, sig: Signature, nbytes: int, async_op: bool, start: Callable[[], Work], stat_name: str | None = None
    ) -> Work | None:
        op = stat_name or sig.op
        if self._broken is not None:
            self._raise_if_broken(op)
        self.stats.record(op, nbytes)
        try:  # as _failures, inline: every collective passes here (not a generator context manager: more calls)
            work = start()
        except RuntimeError as e:
            raise self._failed(e, op) from (None if isinstance(e, CommunicationError) else e)
        if async_op:
            return Work(lambda: self._wait(work, op), work.is_completed)
        self._wait(work, op)
        return None

    def _wait(self, work: Work, op: str) -> None:
        try:  # as _failures, inline
            work.wait()
        except RuntimeError as e:
            raise self._failed(e, op) from (None if isinstance(e, CommunicationError) else e)

    def _failed(self, error: RuntimeError, op: str) -> CommunicationError:
        """The CommunicationError a transport's ``error`` stands for (translated unless it is one already),
        remembered where it leaves the group unusable."""
        return self._mark_broken(error if isinstance(error, CommunicationError) else self._translate(error, op))

    @contextlib.contextmanager
    def _failures(self, op: str) -> Iterator[None]:
        """Turn transport exceptions into CommunicationError and remember failures that break the group."""
        try:
            yield
        except RuntimeError as e:
            raise self._failed(e, op) from (None if isinstance(e, CommunicationError) else e)

    def _check_tensor(self, op: str, tensor: torch.Tensor, what: str = "tensor") -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{op}: {what} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != self.device.type:
            fix = (
                "move it to CPU (tensor.cpu()) or use NCCLCommunicationBackend"
                if tensor.device.type == "cuda"
                else f"move it to {self.device.type} (tensor.to('{self.device.type}'))"
            )
            raise ValueError(
                f"{op}: {what} on {tensor.device} but backend {type(self).__name__} works on {self.device.type} "
                f"tensors; {fix}"
            )
        if tensor.dtype not in _DTYPE_CODES:
            supported = ", ".join(str(d).removeprefix("torch.") for d in _DTYPE_CODES)
            raise TypeError(f"{op}: dtype {tensor.dtype} is not supported; use one of {supported}")
        if not tensor.is_contiguous():
            raise ValueError(f"{op}: {what} (shape {tuple(tensor.shape)}) is not contiguous; pass tensor.contiguous()")

    def _check_pair(self, op: str, inp: torch.Tensor, out: torch.Tensor) -> None:
        self._check_tensor(op, inp, "inp")
        self._check_tensor(op, out, "out")
        if inp.dtype != out.dtype:
            raise TypeError(f"{op}: inp is {inp.dtype} but out is {out.dtype}; both must have the same dtype")
        if inp.device != out.device:
            raise ValueError(f"{op}: inp is on {inp.device} but out on {out.device}; put both on one device")

    def _check_reduction(self, op_name: str, op: ReductionOperation, dtype: torch.dtype) -> None:
        if op is ReductionOperation.AVERAGE and not dtype.is_floating_point:
            raise TypeError(
                f"{op_name}: AVERAGE of {dtype} is not defined (integer division would truncate); "
                f"use SUM and divide, or a floating-point tensor"
            )

    def _check_peer(self, op: str, peer: int, what: str, allow_self: bool = False) -> None:
        if not isinstance(peer, int) or isinstance(peer, bool):
            raise TypeError(f"{op}: {what} must be an int rank, got {peer!r}")
        if not 0 <= peer < self.world_size:
            raise ValueError(
                f"{op}: {what}={peer} is out of range for group '{self.group}' of {self.world_size} ranks "
                f"(valid: 0..{self.world_size - 1})"
            )
        if peer == self.rank and not allow_self:
            raise ValueError(f"{op}: {what}={peer} is this rank itself; a rank cannot {op} to/from itself")


def op_error(
    detail: str, op: str, group: str, rank: int, cls: type[CommunicationError] = CommunicationError
) -> CommunicationError:
    """The error of ``op`` failing on ``rank`` of ``group``: its message names all three, then ``detail``."""
    return cls(f"{op} on group '{group}' failed on rank {rank}: {detail}", op=op, group=group, rank=rank)


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (transport errors carry long C++ traces), or its type's name."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


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


class AgreedOps:
    """A backend's ops without the cross-rank signature check (:attr:`CommunicationBackend.agreed`): the calls
    whose agreement the caller's construction guarantees, said once where the handle is taken instead of with an
    ``unchecked()`` block at every call."""

    __slots__ = ("_backend",)

    def __init__(self, backend: CommunicationBackend):
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
