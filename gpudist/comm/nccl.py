"""NCCL backend: CUDA tensors, NCCL driven directly through CuPy's bindings (``cupy.cuda.nccl``).

Every op runs on the backend's own *communication stream*, with the tensors' ``data_ptr()``: that stream first waits
for everything enqueued so far on torch's current stream (the op's inputs are made there), so compute enqueued after
the op runs beside it. The op's tensors stay referenced by its in-flight entry until the current stream waited for
the op (``Work.wait()``) or the op completed, so torch's caching allocator never hands their memory out while the op
still uses it (as ``record_stream`` would, without a host call per tensor; as torch's
``TORCH_NCCL_AVOID_RECORD_STREAMS``, memory freed after ``wait()`` is reused in the order of the stream that
waited). ``async_op=True`` returns a :class:`Work` whose ``wait()`` makes the *current stream* wait on a CUDA event
recorded after the op (the host does not block); a blocking op does the same before it returns, so code after it
sees its result in stream order. Only ``barrier()`` blocks the host. Events come from a pool: an op's event goes
back once the op completed and its Work was waited for, so a steady-state step creates no CUDA event.

The unique id travels through torch's ``TCPStore`` (:meth:`NCCLCommunicationBackend.create`, from ``MASTER_ADDR``
and ``MASTER_PORT``) or through any bootstrap backend (:meth:`NCCLCommunicationBackend.from_bootstrap`, e.g. the
Gloo or MPI backend of the same processes).

- Uneven reduce-scatter / all-gather (the :func:`split_sizes` rule): one ``ncclReduce`` / ``ncclBroadcast`` per
  rank's range inside one NCCL group call, straight from and into the caller's buffers (no padding); even sizes
  use ``ncclReduceScatter`` / ``ncclAllGather`` (in place when ``inp`` already is ``out``'s own range).
- AVERAGE: ``ncclAvg`` where the NCCL library has it (>= 2.10), otherwise SUM and one scaling kernel. gpudist's
  strategies fold the 1/N into a pass they make anyway (DDP's bucket pack or low-precision cast, ZeRO's pack
  for the reduce-scatter) and send SUM; only DDP's gradient views on an fp32 wire, which have no such pass, ask
  for AVERAGE.
- dtypes: fp32, fp64, fp16, int64, int32, int8, uint8, and bf16 where CuPy exposes ``NCCL_BFLOAT16``.
- Timeouts: every 50 ms a watchdog thread retires the completed ops from the oldest on (one stream completes them
  in issue order, so it queries the oldest op's event, not every op's); one that has not completed after
  ``timeout`` seconds (or ``ncclCommGetAsyncError`` reporting an error) makes it abort the communicator
  (``ncclCommAbort``, which releases kernels stuck waiting for a dead peer) and mark the backend broken: the
  next op or ``wait()`` raises :class:`CommunicationTimeoutError` naming op, group and rank, instead of hanging.
  The watchdog runs with the backend's device selected, takes no lock an op takes (ops register themselves
  lock-free), and an exception of its own breaks the group with its text. ``shutdown()`` (also registered at
  interpreter exit) joins the watchdog and destroys the communicator once this rank's ops have completed, or aborts
  it when they have not by their deadline: it never waits on the device unbounded.
- Captured graphs (``gpudist.capture``): inside :meth:`~NCCLCommunicationBackend.graph_capture` the watchdog
  queries nothing (an event query from any thread invalidates a capture in CUDA's global mode) and the ops' events
  are the graph's, kept in ``graph_events``, never pooled or watched; after each replay
  :meth:`~NCCLCommunicationBackend.watch_graph` times the whole replay as one op, so a replay that hangs times out
  with an error naming it. (Designed and tested on the CPU tier's simulated NCCL and graph; not yet run on a GPU.)
- Rebuilding after a failure, without leaving Python: a survivor calls :meth:`~NCCLCommunicationBackend.abort` on
  the old group (``ncclCommAbort``: local, it never waits for the dead peer; the watchdog does the same when an op
  times out), then every member of the next group calls :meth:`~NCCLCommunicationBackend.join_group` with a fresh
  name: rank 0 publishes a new unique id through a ``torch.distributed`` store, and a rank that never arrives is
  reported after ``connect_timeout``. An NCCL communicator cannot drop a rank, so a new one is the only way on.
- Consistency check (``validate=True``): one all-gather of the 14-int64 signature, read on the host, so it
  costs a device synchronization per op; gpudist's strategies turn it off around ops that agree by construction
  (``comm.unchecked()``). ``send``/``recv`` shapes are not cross-checked on NCCL (the handshake the CPU backends
  use would serialize on the stream); a mismatched pair times out.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import datetime
import threading
import time
import weakref
from collections.abc import Sequence

import torch

from .base import DEFAULT_TIMEOUT, CommunicationBackend
from .cuda_runtime import CudaRuntime
from .errors import CommunicationError, CommunicationTimeoutError, first_line
from .reduction import ReductionOperation
from .shards import shard_range
from .signature import Signature
from .work import CoalescedCollectives, PlannedCollective, Work

__all__ = ["NCCLCommunicationBackend", "nccl_version"]

_ID_BYTES = 128


def _nccl():
    """CuPy's NCCL module, or a CommunicationError saying which extra to install."""
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        raise CommunicationError(
            f"the NCCL backend needs CuPy with NCCL ({e}); install the extra matching your CUDA: "
            "pip install 'gpudist[cuda12]' or 'gpudist[cuda13]'",
            op="init",
            group="world",
        ) from e
    if not getattr(nccl, "available", True):
        raise CommunicationError(
            "CuPy is installed but libnccl was not found; install the nvidia-nccl-cu12/-cu13 "
            "wheel (pip install 'gpudist[cuda12]' or 'gpudist[cuda13]' brings it) or a system "
            "NCCL",
            op="init",
            group="world",
        )
    return nccl


def nccl_version() -> tuple[int, int, int] | None:
    """The NCCL runtime version as (major, minor, patch), or None when CuPy/NCCL is missing."""
    try:
        code = _nccl().get_version()
    except (CommunicationError, RuntimeError):
        return None
    return (
        (code // 10000, code // 100 % 100, code % 100)
        if code >= 10000
        else (code // 1000, code // 100 % 10, code % 100)
    )


def _id_bytes(unique_id: bytes | Sequence[int]) -> bytes:
    """An NCCL unique id as 128 bytes, from bytes (CuPy >= 14) or ints, signed (CuPy < 14) or not."""
    raw = unique_id if isinstance(unique_id, bytes) else bytes(int(b) & 0xFF for b in unique_id)
    if len(raw) != _ID_BYTES:
        raise ValueError(
            f"an NCCL unique id has {_ID_BYTES} bytes, got {len(raw)}: pass what "
            "NCCLCommunicationBackend.unique_id() returned on rank 0"
        )
    return raw


def _communicator(lib, world_size: int, unique_id: bytes, rank: int):
    """``NcclCommunicator`` in the id form the installed CuPy takes: bytes from CuPy 14 on, before that a tuple of
    128 signed chars (each version refuses the other's form with a TypeError before calling NCCL)."""
    try:
        return lib.NcclCommunicator(world_size, unique_id, rank)
    except TypeError as first:
        try:
            return lib.NcclCommunicator(world_size, tuple(b - 256 if b > 127 else b for b in unique_id), rank)
        except TypeError:
            raise first from None


def _runtime(device: int | torch.device | None, group: str, rank: int) -> CudaRuntime:
    return CudaRuntime(device, group, rank)


class _InFlight(Work):
    """One op on the communication stream and its :class:`Work` in one object (one allocation per op): its event,
    its deadline and the tensors it reads and writes (kept referenced, so their memory is not reused before the op
    ran), from its issue until it completed (the watchdog retires it) and it was waited for. Whichever of the two
    comes second gives the event back to the pool: each takes from ``_token`` (a one-item list; ``pop`` is atomic),
    and the one that finds it empty recycles, with no lock on the issuing thread."""

    def __init__(self, backend: NCCLCommunicationBackend, event, op: str, tensors, then):
        self._backend, self.event, self.op, self.tensors, self._then = backend, event, op, tensors, then
        self.deadline = time.monotonic() + backend.timeout
        self._token = [True]
        self._finished = False
        self._error: BaseException | None = None

    def _wait_fn(self) -> None:  # Work.wait runs it once
        self._backend._finish(self)

    def _done_fn(self) -> bool:  # Work.is_completed asks it until the wait
        return self.event.query()

    def settled(self) -> None:
        """One of the two ends of the op's life (completed, waited for) was reached: at the second, the event is
        free."""
        try:
            self._token.pop()
        except IndexError:
            self._backend._rt.recycle(self.event)


class _PlannedNccl(PlannedCollective):
    """A planned NCCL call: the communicator's method and its arguments bound once (a fixed buffer's pointers with
    them, or each start's ``(inp, out)`` pointers passed first), one call on the communication stream per start, the
    scaling of the output for an AVERAGE where NCCL has no ncclAvg, and the op's Work returned as it is (its errors
    are CommunicationErrors already)."""

    __slots__ = ("_args", "_call", "_held", "_scale")

    def __init__(
        self,
        backend: NCCLCommunicationBackend,
        op: str,
        nbytes: int,
        call: str,
        args: tuple,
        held: tuple = (),
        scale: float | None = None,
    ):
        super().__init__(backend, op, nbytes, None)
        self._call, self._args, self._held, self._scale = getattr(backend._comm, call), args, held, scale

    def start(self, *tensors: torch.Tensor) -> Work:
        backend = self._backend
        if backend._broken is not None:
            backend._raise_if_broken(self._op)
        backend.stats.record(self._op, self._nbytes)
        try:
            return self.issue(*tensors)
        except RuntimeError as e:
            raise backend._failed(e, self._op) from e

    def issue(self, *tensors: torch.Tensor) -> Work:
        """The call, the scaling and the event (also what the backend's unplanned all-reduce runs, after its
        checks)."""
        backend = self._backend
        rt = backend._rt
        if tensors:
            self._call(*[t.data_ptr() for t in tensors], *self._args, rt.stream())
        else:
            self._call(*self._args, rt.stream())
        held = tensors or self._held
        if self._scale is not None:
            with rt.on_comm():
                held[-1].mul_(self._scale)
        return backend._enqueued(self._op, held)


class _CoalescedNccl(CoalescedCollectives):
    """Planned NCCL calls issued as one group: one join of the communication stream, their calls (pointers bound
    once) inside one ncclGroupStart/End, the AVERAGE scalings after it, and one event whose Work, named
    ``op x count``, is the group's (errors name it, the group and the rank)."""

    __slots__ = ("_calls", "_held", "_nbytes", "_op")

    def __init__(self, backend: NCCLCommunicationBackend, plans: list[tuple[_PlannedNccl, tuple[torch.Tensor, ...]]]):
        super().__init__(backend, plans)
        self._calls = [
            (plan._call, (*[t.data_ptr() for t in tensors], *plan._args), plan._scale, tensors or plan._held)
            for plan, tensors in plans
        ]
        self._held = tuple(t for *_, held in self._calls for t in held)
        self._nbytes = [(plan._op, plan._nbytes) for plan, _ in plans]
        self._op = f"{'+'.join(dict.fromkeys(op for op, _ in self._nbytes))} x{len(plans)}"

    def start(self) -> Work:
        backend = self._backend
        if backend._broken is not None:
            backend._raise_if_broken(self._op)
        for op, nbytes in self._nbytes:
            backend.stats.record(op, nbytes)
        rt = backend._rt
        try:
            stream = rt.stream()
            backend._lib.groupStart()
            try:
                for call, args, _, _ in self._calls:
                    call(*args, stream)
            finally:
                backend._lib.groupEnd()
            for _, _, scale, held in self._calls:
                if scale is not None:
                    with rt.on_comm():
                        held[-1].mul_(scale)
            return backend._enqueued(self._op, self._held)
        except RuntimeError as e:
            raise backend._failed(e, self._op) from e


def _planned_all_reduce(backend: NCCLCommunicationBackend, tensor: torch.Tensor, op: ReductionOperation):
    """An all-reduce of ``tensor`` in place, pointer, count and codes bound once."""
    nccl_op, scale = backend._reduce_op(op)
    ptr, numel = tensor.data_ptr(), tensor.numel()
    args = (ptr, ptr, numel, backend._dtype(tensor, "all_reduce"), nccl_op)
    return _PlannedNccl(backend, "all_reduce", numel * tensor.element_size(), "allReduce", args, (tensor,), scale)


def _shutdown_at_exit(ref: weakref.ref) -> None:
    """Shut a backend still alive at interpreter exit down while the interpreter is whole (bounded by its timeout)."""
    backend = ref()
    if backend is not None:
        with contextlib.suppress(Exception):
            backend.shutdown()


class NCCLCommunicationBackend(CommunicationBackend):
    """One rank of an NCCL communicator on one CUDA device; build it with :meth:`create`, :meth:`from_bootstrap`
    or ``gpudist.init("nccl")``.

    Args:
        rank: This rank, ``0..world_size-1``.
        world_size: The number of ranks.
        unique_id: The id from :meth:`unique_id` on rank 0, the same on every rank (128 bytes, or 128 ints).
        device: This rank's CUDA device; None: the current one.
        timeout: Seconds every op may take (> 0).
        validate: Check across ranks, before each collective, that all called the same op with the same shape,
            dtype and root.
        group: The group's name, used in error messages.

    Raises:
        ValueError: When ``world_size < 1``, ``rank`` is out of range, ``timeout`` is not positive, or
            ``unique_id`` is not 128 bytes.
        CommunicationError: When there is no CUDA device, CuPy or libnccl is missing, or ``ncclCommInitRank``
            failed.
    """

    name = "nccl"
    ordered_p2p = True  # sends and receives run in issue order on the communication stream
    chunked_overlap = False  # one collective per region: per-rank pieces would each be a launch
    check_syncs_host = True  # the signature all-gather is read back by the host

    def __init__(
        self,
        rank: int,
        world_size: int,
        unique_id: bytes | Sequence[int],
        *,
        device: int | torch.device | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        validate: bool = True,
        group: str = "world",
    ):
        super().__init__(rank, world_size, group, timeout)
        self._rt = _runtime(device, group, rank)
        self._lib = _nccl()
        self._device = self._rt.device
        self.validate = validate
        self._types = {
            torch.float32: self._lib.NCCL_FLOAT32,
            torch.float64: self._lib.NCCL_FLOAT64,
            torch.float16: self._lib.NCCL_FLOAT16,
            torch.int64: self._lib.NCCL_INT64,
            torch.int32: self._lib.NCCL_INT32,
            torch.int8: self._lib.NCCL_INT8,
            torch.uint8: self._lib.NCCL_UINT8,
        }
        # CuPy defines NCCL_BFLOAT16 and NCCL_AVG whatever NCCL it loads; the library has them from 2.10 on.
        modern = (nccl_version() or (0, 0, 0)) >= (2, 10, 0)
        if modern and hasattr(self._lib, "NCCL_BFLOAT16"):
            self._types[torch.bfloat16] = self._lib.NCCL_BFLOAT16
        self._avg = getattr(self._lib, "NCCL_AVG", None) if modern else None
        self._ops = {
            ReductionOperation.SUM: self._lib.NCCL_SUM,
            ReductionOperation.MAX: self._lib.NCCL_MAX,
            ReductionOperation.MIN: self._lib.NCCL_MIN,
            ReductionOperation.PRODUCT: self._lib.NCCL_PROD,
        }
        with self._rt.selected():
            try:
                self._comm = _communicator(self._lib, world_size, _id_bytes(unique_id), rank)
            except RuntimeError as e:
                raise CommunicationError(f"ncclCommInitRank failed: {e}", op="init", group=group, rank=rank) from e
        self._subgroups = 0
        self._inflight: collections.deque[_InFlight] = collections.deque()
        """Ops in issue order: one communication stream runs them in that order, so the oldest completes first."""
        self._comm_lock = threading.Lock()  # the watchdog's async-error check vs. freeing the communicator
        self._graph_events: list | None = None
        self.graph_events: list[list] = []
        """The events of the ops each captured graph recorded (the graph's hand-overs), kept as long as the backend."""
        self._comm_gone = False  # destroyed or aborted: the handle must not be passed to NCCL again
        self._stop = threading.Event()
        self._shut = False
        self._watchdog = threading.Thread(target=self._watch, name=f"gpudist-nccl-watchdog-r{rank}", daemon=True)
        self._watchdog.start()
        atexit.register(_shutdown_at_exit, weakref.ref(self))

    # -- construction ------------------------------------------------------------------------------------------------

    @staticmethod
    def unique_id() -> bytes:
        """A fresh NCCL unique id (128 bytes): rank 0 makes it, every rank passes it to ``__init__``.

        Returns:
            The id's 128 bytes.

        Raises:
            CommunicationError: When CuPy or libnccl is missing.
        """
        return _id_bytes(_nccl().get_unique_id())

    @classmethod
    def from_bootstrap(
        cls,
        bootstrap: CommunicationBackend,
        *,
        device: int | torch.device | None = None,
        timeout: float | None = None,
        validate: bool = True,
    ) -> NCCLCommunicationBackend:
        """The NCCL group of the same ranks as ``bootstrap`` (a CPU backend), whose rank 0 broadcasts the id.

        Collective on ``bootstrap``.

        Args:
            bootstrap: A backend of the same ranks, e.g. Gloo's.
            device: This rank's CUDA device; None: the current one.
            timeout: Seconds every op may take; None: ``bootstrap``'s timeout.
            validate: Check every collective's call signature across ranks.

        Returns:
            This rank's NCCL backend.

        Raises:
            CommunicationError: As the constructor raises, or when the broadcast of the id fails.
        """
        ident = torch.zeros(_ID_BYTES, dtype=torch.int64)
        if bootstrap.rank == 0:
            ident.copy_(torch.tensor(list(cls.unique_id()), dtype=torch.int64))
        bootstrap.broadcast(ident, src=0)
        return cls(
            bootstrap.rank,
            bootstrap.world_size,
            ident.tolist(),
            device=device,
            timeout=bootstrap.timeout if timeout is None else timeout,
            validate=validate,
        )

    @classmethod
    def create(
        cls,
        rank: int,
        world_size: int,
        master_addr: str = "127.0.0.1",
        master_port: int = 29500,
        *,
        device: int | torch.device | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        validate: bool = True,
        store: torch.distributed.Store | None = None,
        connect_timeout: float | None = None,
    ) -> NCCLCommunicationBackend:
        """Join through torch's TCPStore at ``master_addr:master_port`` (rank 0 hosts it and publishes the id).
        ``connect_timeout`` bounds the join as in :meth:`GlooCommunicationBackend.create`.

        Args:
            rank: This process's rank.
            world_size: The number of processes.
            master_addr: The address rank 0 hosts the store on.
            master_port: The store's port.
            device: This rank's CUDA device; None: the current one.
            timeout: Seconds every op may take.
            validate: Check every collective's call signature across ranks.
            store: An existing ``torch.distributed`` store to rendezvous through; None: create one.
            connect_timeout: Seconds to wait for every rank to join.

        Returns:
            This rank's NCCL backend.

        Raises:
            CommunicationError: When the store could not be opened, there is no CUDA device, CuPy or libnccl is
                missing, or ``ncclCommInitRank`` failed.
            CommunicationTimeoutError: When the other ranks did not join within ``connect_timeout``.
            ValueError: When ``rank`` is out of range, or ``connect_timeout`` or ``timeout`` is not positive.
        """
        from .gloo import create_store, join_timeout

        if store is None:
            store = create_store(master_addr, master_port, rank, world_size, join_timeout(timeout, connect_timeout))
        return cls.join_group(
            store,
            rank,
            world_size,
            name="world",
            device=device,
            timeout=timeout,
            validate=validate,
            connect_timeout=connect_timeout,
        )

    @classmethod
    def join_group(
        cls,
        store: torch.distributed.Store,
        rank: int,
        world_size: int,
        *,
        name: str,
        device: int | torch.device | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        validate: bool = True,
        connect_timeout: float | None = None,
    ) -> NCCLCommunicationBackend:
        """Form a new NCCL group of ``world_size`` ranks meeting on ``store``: rank 0 publishes a fresh unique id under
        the group's name, every rank marks its arrival and waits (at most ``connect_timeout``) for the id and for
        every other rank's arrival, then all call ``ncclCommInitRank``. A survivor of a failed group calls this after
        :meth:`abort` on the old one (live elastic training forms one group per membership generation).

        The arrival marks are there because ``ncclCommInitRank`` waits for every rank without a timeout (CuPy offers
        no non-blocking init): a member that died before joining is reported here, by rank, instead of hanging the
        init. One that dies between its arrival and the end of the init still hangs it (bound it from outside, as
        :meth:`gpudist.live.Membership.while_alive` does). Names must not repeat on one store: a rank would read the
        earlier group's id (give each group its own name, or its own ``dist.PrefixStore``).

        Args:
            store: Where the ranks exchange the id (every rank passes the same one).
            rank: This process's rank in the new group.
            world_size: The number of ranks in the new group.
            name: The group's name in the store's keys and in errors (e.g. ``"live-gen-3"``).
            device: This rank's CUDA device; None: the current one.
            timeout: Seconds every op may take.
            validate: Check every collective's call signature across ranks.
            connect_timeout: Seconds to wait for every rank to arrive (default: as :meth:`create`).

        Returns:
            This rank's backend of the new group.

        Raises:
            CommunicationTimeoutError: When a rank did not arrive within ``connect_timeout`` (it died, or never called
                this); the message lists the missing ranks.
            CommunicationError: As the constructor raises.
            ValueError: When ``rank`` is not in ``0..world_size-1`` or a timeout is not positive.
        """
        from .gloo import join_timeout

        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} out of range for world_size={world_size}")
        join = join_timeout(timeout, connect_timeout)
        ident, arrived = (
            f"gpudist/nccl/{name}/unique_id",
            [f"gpudist/nccl/{name}/arrived/{r}" for r in range(world_size)],
        )
        if rank == 0:
            store.set(ident, cls.unique_id())
        store.set(arrived[rank], b"1")
        try:
            store.wait([ident, *arrived], datetime.timedelta(seconds=join))
        except RuntimeError as e:  # DistStoreError: a rank never arrived
            missing = [r for r, key in enumerate(arrived) if not store.check([key])]
            raise CommunicationTimeoutError(
                f"rank {rank}: NCCL group {name!r} of {world_size} did not form within {join:g}s: rank(s) {missing} "
                f"never arrived (died, or never called join_group) ({first_line(e)})",
                op="init",
                group=name,
                rank=rank,
            ) from e
        return cls(rank, world_size, store.get(ident), device=device, timeout=timeout, validate=validate, group=name)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def averages_in_transport(self) -> bool:
        return self._avg is not None  # ncclAvg (NCCL >= 2.10); older NCCL averages as SUM and a scaling kernel

    # -- machinery ---------------------------------------------------------------------------------------------------

    def _stream(self) -> int:
        return self._rt.stream()

    def _dtype(self, t: torch.Tensor, op: str) -> int:
        if t.dtype not in self._types:
            raise TypeError(
                f"{op}: {t.dtype} is not supported by this CuPy/NCCL build (bf16 needs CuPy with "
                "NCCL_BFLOAT16 and NCCL >= 2.10); cast to float32 or upgrade cupy"
            )
        return self._types[t.dtype]

    def _check_tensor(self, op: str, tensor: torch.Tensor, what: str = "tensor") -> None:
        super()._check_tensor(op, tensor, what)
        if tensor.device != self._device:
            raise ValueError(
                f"{op}: {what} is on {tensor.device} but this NCCL rank drives {self._device}; move it "
                f"there (tensor.to('{self._device}'))"
            )
        self._dtype(tensor, op)

    def _enqueued(self, op: str, tensors=(), then=None) -> Work:
        """Record an event after the op just enqueued and hand it to the watchdog; keep ``tensors`` referenced until
        the current stream waited for the op (or it completed). The Work makes the current stream wait on the event;
        its errors are already CommunicationErrors naming op, group and rank (a planned op returns it as it is)."""
        rt = self._rt
        rt.hold(tensors)
        entry = _InFlight(self, rt.record(), op, tensors, then)
        if self._graph_events is not None:  # inside capture: the event belongs to the graph, the watchdog never sees it
            entry._token = [True, True]  # (never recycled into the pool)
            self._graph_events.append(entry.event)
            return entry
        self._inflight.append(entry)  # (a deque: append and the watchdog's popleft are atomic)
        return entry

    @contextlib.contextmanager
    def graph_capture(self):
        """Capture on the current stream (see the contract): the ops' events are the graph's, kept with this backend
        (``graph_events``) and never queried, pooled or handed to the watchdog; the watchdog skips its polls, which
        would query events (and would invalidate a capture in CUDA's global mode) until capture ends."""
        if self._graph_events is not None:
            raise RuntimeError(f"group {self.group!r}, rank {self.rank}: a graph capture is already under way")
        events: list = []
        self._graph_events = events
        try:
            yield
        finally:
            self._graph_events = None
            self.graph_events.append(events)

    def watch_graph(self, what: str) -> None:
        """Time the replay just enqueued on the current stream as one op named ``what`` (the watchdog retires it when
        it completes, and aborts the group with a timeout naming it when it does not)."""
        entry = _InFlight(self, self._rt.record_current(), what, (), None)
        entry._token = [True, True, True]  # (retired by the watchdog, never waited for: recycled by neither)
        self._inflight.append(entry)

    def _finish(self, entry: _InFlight) -> None:
        """The wait of an op's Work: the current stream waits for its event (no host sync). From here the stream that
        will reuse the tensors' memory is ordered after the op, so they are let go."""
        op = entry.op
        if self._broken is not None:
            self._raise_if_broken(op)
        try:
            self._rt.wait(entry.event)
        except RuntimeError as e:
            raise self._failed(e, op) from e
        entry.tensors = None
        entry.settled()
        if self._broken is not None:  # aborted while pending: the kernel was released with its output unfinished
            self._raise_if_broken(op)
        if entry._then is not None:
            entry._then()

    def _watch(self) -> None:
        """Watchdog: abort the communicator when an op outlives the timeout or NCCL reports an async error.

        It runs with the backend's device selected (its CUDA calls must not create a context on device 0), and an
        exception of its own breaks the group with that exception's text instead of ending the thread silently
        (after which nothing would time out)."""
        try:
            with self._rt.selected():
                while not self._stop.wait(0.05):
                    problem = self._poll()
                    if problem is not None:
                        self._abort(problem)
                        return
        except BaseException as e:
            self._abort(self._error(f"the NCCL watchdog failed ({type(e).__name__}: {e})", "watchdog"))

    def _poll(self) -> CommunicationError | None:
        """One look at the ops in flight: retire the completed ones from the oldest on (one stream completes them in
        issue order, so the first that has not completed is the only one that can be late); the error to abort with,
        if any. Nothing here holds a lock an op needs, so a slow query never delays an op being issued."""
        if self._graph_events is not None:  # a capture is under way: query nothing (module docstring)
            return None
        inflight = self._inflight
        while True:
            head = inflight[0] if inflight else None
            if head is None or not head.event.query():
                break
            inflight.popleft()  # only this thread (the watchdog, or shutdown after joining it) takes from the left
            head.tensors = None
            head.settled()
        late = head if head is not None and time.monotonic() > head.deadline else None
        with self._comm_lock:
            try:
                if not self._comm_gone:
                    self._comm.check_async_error()
            except RuntimeError as e:
                return self._error(f"NCCL reported an asynchronous error: {e}", "async")
        if late is not None:
            return self._error(
                f"timed out after {self.timeout:g}s: a peer never called {late.op}, hangs, or died; the NCCL "
                "communicator was aborted",
                late.op,
                CommunicationTimeoutError,
            )
        return None

    def _abort(self, problem: CommunicationError) -> None:
        """Mark the group broken with ``problem`` and abort the communicator (``ncclCommAbort`` releases kernels
        stuck waiting for a dead peer)."""
        self._mark_broken(problem)
        self._stop.set()
        self._close(abort=True)

    def _close(self, abort: bool) -> None:
        """``ncclCommAbort`` (``abort``) or ``ncclCommDestroy``, once, under the lock the watchdog's async-error check
        takes: CuPy frees the communicator in both, and a check running beside it would read freed memory."""
        with self._comm_lock:
            if self._comm_gone:
                return
            self._comm_gone = True
            if not abort:
                self._comm.destroy()
                return
            with contextlib.suppress(Exception):  # an abort is best effort: there is nothing left to release it with
                self._comm.abort()

    def abort(self, reason: str | None = None) -> None:
        """Abort the communicator now (``ncclCommAbort``): what a survivor calls on its group once a peer died, before
        forming the next group with :meth:`join_group`.

        It is local: it never waits for the dead peer, and releases this rank's kernels stuck waiting for it. The
        backend is unusable afterwards: every later op, and the ``wait()`` of every op still pending, raises
        :class:`CommunicationError` naming this group, rank and the first failure (a watchdog timeout that came first
        stays the reason). Peers are not told: each aborts its own communicator (or its watchdog does at its op
        timeout). Idempotent; :meth:`shutdown` after it only stops the watchdog.

        Args:
            reason: Why, quoted in this rank's errors (default: "e.g. because a peer died").
        """
        self._abort(
            self._error(
                f"the communicator was aborted (ncclCommAbort) on this rank, {reason or 'e.g. because a peer died'}; "
                "form a new group with NCCLCommunicationBackend.join_group",
                "abort",
            )
        )

    def _gather_signatures(self, op: str, mine: torch.Tensor, everyone: torch.Tensor) -> None:
        src, dst = mine.to(self._device), torch.empty(everyone.numel(), dtype=torch.int64, device=self._device)
        self._comm.allGather(src.data_ptr(), dst.data_ptr(), src.numel(), self._lib.NCCL_INT64, self._stream())
        self._enqueued(op, (src, dst)).wait()  # the current stream waits for the gather
        everyone.copy_(dst.cpu())  # waits for the device: the check needs the values on the host
        self._raise_if_broken(op)

    def _translate(self, error: BaseException, op: str) -> CommunicationError:
        text = first_line(error)
        return self._error(f"NCCL error: {text}", op)

    def _reduce_op(self, op: ReductionOperation):
        """(NCCL op, post-scale or None) for ``op``: AVERAGE is ncclAvg when available, else SUM then divide."""
        if op is not ReductionOperation.AVERAGE:
            return self._ops[op], None
        if self._avg is not None:
            return self._avg, None
        return self._ops[ReductionOperation.SUM], 1.0 / self.world_size

    # -- the ops -----------------------------------------------------------------------------------------------------

    def _all_reduce(self, sig: Signature, tensor: torch.Tensor, op: ReductionOperation) -> Work:
        self._check(sig)
        return _planned_all_reduce(self, tensor, op).issue()

    def _planned_reduce_scatter(
        self, numel: int, dtype: torch.dtype, op: ReductionOperation, scratch_input: bool
    ) -> PlannedCollective:
        """Even sizes: one bound ``ncclReduceScatter`` (its Work returned as it is); uneven ones: the generic plan."""
        if numel % self.world_size:
            return super()._planned_reduce_scatter(numel, dtype, op, scratch_input)
        nccl_op, scale = self._reduce_op(op)
        codes = (numel // self.world_size, self._types[dtype], nccl_op)
        return _PlannedNccl(self, "reduce_scatter", numel * dtype.itemsize, "reduceScatter", codes, scale=scale)

    def _planned_all_gather(self, numel: int, dtype: torch.dtype) -> PlannedCollective:
        """Even sizes: one ``ncclAllGather`` with its count and dtype code bound; uneven ones: the generic plan."""
        if numel % self.world_size:
            return super()._planned_all_gather(numel, dtype)
        codes = (numel // self.world_size, self._types[dtype])
        return _PlannedNccl(self, "all_gather", numel * dtype.itemsize, "allGather", codes)

    def _planned_broadcast(self, tensor: torch.Tensor, src: int) -> PlannedCollective:
        """One bound ``ncclBroadcast`` (in place)."""
        ptr, dtype = tensor.data_ptr(), self._dtype(tensor, "broadcast")
        args = (ptr, ptr, tensor.numel(), dtype, src)
        return _PlannedNccl(self, "broadcast", tensor.numel() * tensor.element_size(), "broadcast", args, (tensor,))

    def _planned_all_reduce(self, tensor: torch.Tensor, op: ReductionOperation) -> PlannedCollective:
        """Pointer, count, dtype and op codes bound once, and the event's Work returned as it is (its errors are
        CommunicationErrors already)."""
        return _planned_all_reduce(self, tensor, op)

    def _coalesced(self, plans: list) -> CoalescedCollectives:
        if all(isinstance(plan, _PlannedNccl) for plan, _ in plans):
            return _CoalescedNccl(self, plans)
        return super()._coalesced(plans)

    def _reduce_scatter(
        self, sig: Signature, inp: torch.Tensor, out: torch.Tensor, op: ReductionOperation, scratch_input: bool = False
    ) -> Work:
        self._check(sig)
        nccl_op, scale = self._reduce_op(op)
        dtype, stream, n, size = self._dtype(inp, "reduce_scatter"), self._stream(), inp.numel(), inp.element_size()
        if n % self.world_size == 0:
            self._comm.reduceScatter(inp.data_ptr(), out.data_ptr(), out.numel(), dtype, nccl_op, stream)
        else:  # uneven shares: one reduce to each rank of its range, fused into one group call
            self._lib.groupStart()
            try:
                for r in range(self.world_size):
                    start, end = shard_range(n, self.world_size, r)
                    if end > start:
                        self._comm.reduce(
                            inp.data_ptr() + start * size, out.data_ptr(), end - start, dtype, nccl_op, r, stream
                        )
            finally:
                self._lib.groupEnd()
        if scale is not None:
            with self._rt.on_comm():
                out.mul_(scale)
        return self._enqueued("reduce_scatter", (inp, out))

    def _all_gather(self, sig: Signature, inp: torch.Tensor, out: torch.Tensor) -> Work:
        self._check(sig)
        dtype, stream, n, size = self._dtype(out, "all_gather"), self._stream(), out.numel(), out.element_size()
        if n % self.world_size == 0:  # in place when inp is out's own range (NCCL allows exactly that alias)
            self._comm.allGather(inp.data_ptr(), out.data_ptr(), inp.numel(), dtype, stream)
            return self._enqueued("all_gather", (inp, out))
        self._lib.groupStart()  # uneven shares: one broadcast of each rank's range straight into out
        try:
            for r in range(self.world_size):
                start, end = shard_range(n, self.world_size, r)
                if end > start:
                    src = inp.data_ptr() if r == self.rank else out.data_ptr() + start * size
                    self._comm.broadcast(src, out.data_ptr() + start * size, end - start, dtype, r, stream)
        finally:
            self._lib.groupEnd()
        return self._enqueued("all_gather", (inp, out))

    def _broadcast(self, sig: Signature, tensor: torch.Tensor, src: int) -> Work:
        self._check(sig)
        self._comm.broadcast(
            tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), self._dtype(tensor, "broadcast"), src, self._stream()
        )
        return self._enqueued("broadcast", (tensor,))

    def _all_to_all(self, sig: Signature, inp: torch.Tensor, out: torch.Tensor) -> Work:
        self._check(sig)
        dtype, stream = self._dtype(inp, "all_to_all"), self._stream()
        part, size = inp.numel() // self.world_size, inp.element_size()
        self._lib.groupStart()
        try:
            for r in range(self.world_size):
                self._comm.send(inp.data_ptr() + r * part * size, part, dtype, r, stream)
                self._comm.recv(out.data_ptr() + r * part * size, part, dtype, r, stream)
        finally:
            self._lib.groupEnd()
        return self._enqueued("all_to_all", (inp, out))

    def _barrier(self, sig: Signature) -> Work:
        self._check(sig)
        token = torch.zeros(1, device=self._device)
        self._comm.allReduce(
            token.data_ptr(), token.data_ptr(), 1, self._lib.NCCL_FLOAT32, self._lib.NCCL_SUM, self._stream()
        )
        work = self._enqueued("barrier", (token,))
        return Work(lambda: (work.wait(), self._rt.synchronize()), work.is_completed)

    def _send(self, sig: Signature, tensor: torch.Tensor, dst: int) -> Work:
        self._comm.send(tensor.data_ptr(), tensor.numel(), self._dtype(tensor, "send"), dst, self._stream())
        return self._enqueued("send", (tensor,))

    def _recv(self, sig: Signature, tensor: torch.Tensor, src: int) -> Work:
        self._comm.recv(tensor.data_ptr(), tensor.numel(), self._dtype(tensor, "recv"), src, self._stream())
        return self._enqueued("recv", (tensor,))

    def _batch_send_recv(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> Work:
        """All of them in one NCCL group call: they progress together, so crossing pairs cannot deadlock."""
        self._raise_if_broken("send_recv")
        for (tensor, _), op in [(x, "send") for x in sends] + [(x, "recv") for x in recvs]:
            self.stats.record(op, tensor.numel() * tensor.element_size())
        with self._failures("send_recv"):
            stream = self._stream()
            self._lib.groupStart()
            try:
                for tensor, dst in sends:
                    self._comm.send(tensor.data_ptr(), tensor.numel(), self._dtype(tensor, "send"), dst, stream)
                for tensor, src in recvs:
                    self._comm.recv(tensor.data_ptr(), tensor.numel(), self._dtype(tensor, "recv"), src, stream)
            finally:
                self._lib.groupEnd()
            work = self._enqueued("send_recv", [t for t, _ in (*sends, *recvs)])
        return Work(lambda: self._wait(work, "send_recv"), work.is_completed)

    def _new_group(self, sig: Signature, ranks: list[int]) -> CommunicationBackend | None:
        self._check(sig)
        self._subgroups += 1
        ident = torch.zeros(_ID_BYTES, dtype=torch.int64, device=self._device)
        if self.rank == ranks[0]:
            ident.copy_(torch.tensor(list(self.unique_id()), dtype=torch.int64))
        self._comm.broadcast(
            ident.data_ptr(), ident.data_ptr(), _ID_BYTES, self._lib.NCCL_INT64, ranks[0], self._stream()
        )
        self._enqueued("new_group", (ident,)).wait()  # the current stream waits for the broadcast
        values = ident.tolist()
        self._raise_if_broken("new_group")
        if self.rank not in ranks:
            return None
        name = f"{self.group}/{self._subgroups}[{','.join(map(str, ranks))}]"
        return NCCLCommunicationBackend(
            ranks.index(self.rank),
            len(ranks),
            values,
            device=self._device,
            timeout=self.timeout,
            validate=self.validate,
            group=name,
        )

    def shutdown(self) -> None:
        """Stop the watchdog, then destroy the communicator once this rank's ops in flight have completed, or abort it
        if they have not by their deadline (a dead or stuck peer) or the group is already broken (``ncclCommDestroy``
        could wait for the failed peer): it returns within the op timeout, never waits on the device unbounded. Later
        ops raise :class:`CommunicationError`. Idempotent; also called at interpreter exit."""
        if self._shut:
            return
        self._shut = True
        self._stop.set()
        if self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=max(1.0, self.timeout))
        with self._rt.selected():
            while self.healthy:
                problem = self._poll()
                if problem is not None:
                    self._abort(problem)
                elif not self._inflight:
                    self._close(abort=False)
                    break
                else:
                    time.sleep(0.01)
            # Broken by an op's error (no abort yet): abort. After the watchdog's abort or the destroy above: a no-op.
            self._close(abort=True)
        super().shutdown()  # later ops raise here, before reaching the freed communicator
