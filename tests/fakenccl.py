"""A simulated NCCL for the CPU tier: the part of CuPy's ``cupy.cuda.nccl`` that gpudist calls (its names, argument
order, constants and error type, read from CuPy's nccl.pyx/nccl.pxd), executing on CPU memory, ranks as threads.

It lets the real :class:`gpudist.NCCLCommunicationBackend` code (pointer offsets, dtype and op codes, group calls,
id exchange, sub-groups, error paths) and every strategy on top of it run in CI, where there is no GPU. It is
strict where NCCL is unforgiving:

- Every call runs in issue order and returns only once its peers have matched it, like NCCL kernels on one
  CUDA stream seen with ``CUDA_LAUNCH_BLOCKING=1``: a schedule that posts a receive its peer cannot match yet
  deadlocks here (and times out with an error) exactly where it would stall a GPU stream. A send completes only
  when received (NCCL may buffer small ones; code must not rely on it).
- Calls between ``groupStart()`` and ``groupEnd()`` are posted together and progress concurrently.
- A call whose peer never posts (a dead rank) waits until this rank's communicator is aborted, then fails
  (``ncclCommAbort`` releases the kernels); the abort is local and never waits for the peer, and a communicator
  built from a fresh unique id then works. The fake's own ``timeout`` only bounds the wait as a test's safety net.
- Collectives are matched by order on each communicator; ranks that disagree on kind, count, dtype, op or root
  get an error (real NCCL would hang or corrupt memory). In-place calls must use NCCL's exact aliasing
  (all-gather: ``send == recv + rank * count``; reduce-scatter: ``recv == send + rank * recvcount``); any
  other overlap of send and receive buffers is an error.
- ``NCCL_BFLOAT16``/``NCCL_AVG`` exist as constants whatever ``get_version()`` says, as in CuPy.
- The unique id has CuPy's two forms: ``bytes`` from CuPy 14 on, a tuple of 128 signed chars before
  (``cupy_version``); each refuses the other with CuPy's TypeError. Checked against the real CuPy 14.2.0
  (cupy-cuda13x with NCCL 2.32.3, imported without a GPU): its names and argument lists are the ones here.

The device: :class:`HostRuntime` runs every call at once (events are always complete). :class:`AsyncRuntime`
behaves like a GPU where correctness depends on it: NCCL calls are enqueued on per-backend communication-stream
queues and run in order only when something waits for an event after them (``Work.wait()``, ``synchronize()``,
shutdown), so output read before the wait is stale and training misses the single-process result; an op issued
without joining the current stream, a send buffer changed or a receive buffer written while its op is in flight,
and a buffer not held (or freed) before the op ran raise an error naming the op. :func:`count_host_syncs` counts a
rank thread's host syncs with their code locations, and :func:`stream_trace` records the order in which it enqueues
compute and NCCL calls (overlap). What it still cannot show: compute is synchronous on the host, so a race between
two device streams that the host never observes (compute enqueued after an op, writing its buffer on the current
stream while the op still reads it) is only caught once the op runs, not at the moment it would race; the device is
modelled as infinitely slow until observed, never as partially done; ``.cpu()``/``.tolist()`` are counted as
device-to-host copies even on tensors that live on the host on a GPU; speed, device placement and NCCL's own bugs.
Those need the GPU tier (tests/test_gpu.py).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = 0, 1, 2, 3, 4, 5
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
_TORCH = {
    NCCL_INT8: torch.int8,
    NCCL_UINT8: torch.uint8,
    NCCL_INT32: torch.int32,
    NCCL_INT64: torch.int64,
    NCCL_FLOAT16: torch.float16,
    NCCL_FLOAT32: torch.float32,
    NCCL_FLOAT64: torch.float64,
    NCCL_BFLOAT16: torch.bfloat16,
}


class NcclError(RuntimeError):
    """CuPy's error type for a failed NCCL call (a RuntimeError)."""


def _view(ptr: int, count: int, datatype: int) -> torch.Tensor:
    """The ``count`` elements at address ``ptr`` as a tensor sharing that memory."""
    dtype = _TORCH[datatype]
    if count == 0:
        return torch.empty(0, dtype=dtype)
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_char * (count * size)).from_address(ptr), dtype=dtype)


def _span(ptr: int, count: int, datatype: int) -> tuple[int, int]:
    return ptr, ptr + count * torch.empty(0, dtype=_TORCH[datatype]).element_size()


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[0] != a[1] and b[0] != b[1]


def _reduce(values: list[torch.Tensor], op: int) -> torch.Tensor:
    stacked = torch.stack(values)
    wide = stacked.double() if stacked.is_floating_point() else stacked
    result = {
        NCCL_SUM: lambda: wide.sum(0),
        NCCL_PROD: lambda: wide.prod(0),
        NCCL_MAX: lambda: wide.amax(0),
        NCCL_MIN: lambda: wide.amin(0),
        NCCL_AVG: lambda: wide.sum(0) / len(values),
    }[op]()
    return result.to(stacked.dtype)


class _Call:
    __slots__ = ("args", "done", "kind", "msg")

    def __init__(self, kind: str, **args):
        self.kind, self.args, self.done, self.msg = kind, args, False, None


class _Clique:
    """The shared state of one communicator (one unique id): its ranks' pending collectives and messages."""

    def __init__(self, world: int):
        self.world = world
        self.cond = threading.Condition()
        self.members: set[int] = set()
        self.slots: dict[int, dict[int, _Call]] = collections.defaultdict(dict)
        self.results: dict[int, str | None] = {}
        self.channels: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
        self.aborted: str | None = None


class FakeNccl:
    """Stands in for the ``cupy.cuda.nccl`` module. ``version`` is what ``get_version()`` reports (NCCL's code,
    e.g. 23003 for 2.30.3); ``timeout`` bounds every wait, after which the call raises (a hang on a GPU)."""

    available = True
    NcclError = NcclError

    def __init__(self, version: int = 23003, timeout: float = 30.0, cupy_version: int = 14):
        self.version, self.timeout, self.cupy_version = version, timeout, cupy_version
        for name, value in globals().items():
            if name.startswith("NCCL_"):
                setattr(self, name, value)
        self._cliques: dict[tuple[int, ...], _Clique] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self.calls = collections.Counter()  # kind -> how often it ran, for tests that check the path taken
        self.streams: collections.Counter = collections.Counter()  # calls per stream handle
        self.reductions = collections.Counter()  # NCCL op code -> how often a reduction used it
        self.stream_errors: list[str] = []  # what AsyncRuntime streams failed with, for tests to assert none
        fake = self

        class NcclCommunicator(_Communicator):
            _fake = fake

        self.NcclCommunicator = NcclCommunicator

    # -- module functions ---------------------------------------------------------------------------------------------

    def get_version(self) -> int:
        return self.version

    def get_unique_id(self) -> bytes | tuple[int, ...]:
        raw = os.urandom(128)
        return raw if self.cupy_version >= 14 else tuple(b - 256 if b > 127 else b for b in raw)

    def groupStart(self) -> None:
        self._local.depth = getattr(self._local, "depth", 0) + 1
        if self._local.depth == 1:
            self._local.queued = []

    def groupEnd(self) -> None:
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            raise NcclError("NCCL_ERROR_INVALID_USAGE: groupEnd without groupStart")
        self._local.depth = depth - 1
        if depth == 1:
            queued, self._local.queued = self._local.queued, []
            if queued:
                self._dispatch(queued)

    def abort_all(self, reason: str) -> None:
        """Release every rank waiting anywhere (a test rank failed; the others should not wait for the timeout)."""
        with self._lock:
            cliques = list(self._cliques.values())
        for clique in cliques:
            with clique.cond:
                clique.aborted = clique.aborted or reason
                clique.cond.notify_all()

    # -- machinery ----------------------------------------------------------------------------------------------------

    def _clique(self, ident: tuple[int, ...], world: int) -> _Clique:
        with self._lock:
            clique = self._cliques.setdefault(ident, _Clique(world))
        if clique.world != world:
            raise NcclError(
                f"NCCL_ERROR_INVALID_ARGUMENT: ranks disagree on the size of communicator ({clique.world} vs {world})"
            )
        return clique

    def _submit(self, comm: _Communicator, call: _Call) -> None:
        comm._usable()
        if not isinstance(call.args.get("stream"), int):
            raise TypeError(f"stream must be an int handle, got {call.args.get('stream')!r}")
        self.calls[call.kind] += 1
        self.streams[call.args["stream"]] += 1
        if "op" in call.args:
            self.reductions[call.args["op"]] += 1
        if getattr(self._local, "depth", 0):
            self._local.queued.append((comm, call))
        else:
            self._dispatch([(comm, call)])

    def _dispatch(self, queued: list[tuple[_Communicator, _Call]]) -> None:
        """Run the calls now, or hand them to the :class:`AsyncRuntime` whose communication stream they were issued on
        (which runs them when something waits for them)."""
        streams = {call.args["stream"] for _, call in queued}
        runtime = _ASYNC_STREAMS.get(next(iter(streams)))
        if runtime is None:
            self._execute(queued)
            return
        if len(streams) != 1:
            raise NcclError(f"fake NCCL: one group call issued on several streams {sorted(streams)}")
        runtime._enqueue_calls(self, queued)

    def _wait(self, comm: _Communicator, ready, what: str) -> None:
        clique, deadline = comm._clique, time.monotonic() + self.timeout
        while not ready():
            if comm._abort_reason() is not None:
                raise NcclError(
                    f"NCCL_ERROR_SYSTEM_ERROR: communicator aborted while rank {comm._rank} waited in "
                    f"{what} ({comm._abort_reason()})"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise NcclError(
                    f"fake NCCL: rank {comm._rank} waited {self.timeout:g}s in {what} and its peers "
                    "never matched it; on a GPU this call would hang"
                )
            clique.cond.wait(min(left, 0.5))

    def _execute(self, queued: list[tuple[_Communicator, _Call]]) -> None:
        """Post the sends of the group, then run its other calls in order, then wait for the sends to be taken."""
        for comm, call in queued:
            if call.kind == "send":
                clique = comm._clique
                with clique.cond:
                    clique.channels[(comm._rank, call.args["peer"])].append(call)
                    clique.cond.notify_all()
        for comm, call in queued:
            clique = comm._clique
            with clique.cond:
                if call.kind == "recv":
                    channel = clique.channels[(call.args["peer"], comm._rank)]
                    self._wait(comm, lambda ch=channel: bool(ch), f"recv from {call.args['peer']}")
                    sent = channel.popleft()
                    self._deliver(comm, sent, call)
                    clique.cond.notify_all()
                elif call.kind != "send":
                    self._collective(comm, call)
        for comm, call in queued:
            if call.kind == "send":
                with comm._clique.cond:
                    self._wait(comm, lambda c=call: c.done, f"send to {call.args['peer']}")
                    if call.msg:
                        raise NcclError(call.msg)

    def _deliver(self, comm: _Communicator, sent: _Call, call: _Call) -> None:
        a, b = sent.args, call.args
        if (a["count"], a["datatype"]) != (b["count"], b["datatype"]):
            sent.msg = (
                f"fake NCCL: send of {a['count']} x type {a['datatype']} matched a recv of {b['count']} x "
                f"type {b['datatype']} on rank {comm._rank}; on a GPU this corrupts memory or hangs"
            )
            sent.done = True
            raise NcclError(sent.msg)
        _view(b["recvbuf"], b["count"], b["datatype"]).copy_(_view(a["sendbuf"], a["count"], a["datatype"]))
        sent.done = True

    def _collective(self, comm: _Communicator, call: _Call) -> None:
        clique, seq = comm._clique, comm._seq
        comm._seq += 1
        slot = clique.slots[seq]
        slot[comm._rank] = call
        if len(slot) == clique.world:
            try:
                self._run_collective(slot, clique.world)
                clique.results[seq] = None
            except NcclError as e:
                clique.results[seq] = str(e)
            clique.cond.notify_all()
        self._wait(comm, lambda: seq in clique.results, f"{call.kind} #{seq}")
        if clique.results[seq] is not None:
            raise NcclError(clique.results[seq])

    @staticmethod
    def _run_collective(slot: dict[int, _Call], world: int) -> None:
        calls = [slot[r] for r in range(world)]
        keys = [(c.kind, c.args["count"], c.args["datatype"], c.args.get("op"), c.args.get("root")) for c in calls]
        if len(set(keys)) != 1:
            raise NcclError(
                f"fake NCCL: ranks issued different collectives at the same position: {keys} "
                "(kind, count, type, op, root per rank); on a GPU this hangs or corrupts memory"
            )
        kind, count, dtype, op, root = keys[0]
        if root is not None and not 0 <= root < world:
            raise NcclError(f"NCCL_ERROR_INVALID_ARGUMENT: root {root} of {world} ranks")
        n_in, n_out = {
            "allReduce": (1, 1),
            "reduce": (1, 1),
            "broadcast": (1, 1),
            "allGather": (1, world),
            "reduceScatter": (world, 1),
        }[kind]
        for r, c in enumerate(calls):
            send, recv = _span(c.args["sendbuf"], count * n_in, dtype), _span(c.args["recvbuf"], count * n_out, dtype)
            if kind in ("reduce", "broadcast") and r != root:
                continue  # NCCL ignores the receive buffer off the root of a reduce, the send buffer of a broadcast
            size = send[1] - send[0]
            legal = {"allGather": recv[0] + r * size, "reduceScatter": send[0] + r * (recv[1] - recv[0])}
            in_place = (
                send[0] == recv[0]
                if kind not in legal
                else (send[0] == legal[kind] if kind == "allGather" else recv[0] == legal[kind])
            )
            if _overlap(send, recv) and not in_place:
                raise NcclError(
                    f"fake NCCL: {kind} on rank {r} has overlapping send/recv buffers that are not "
                    "NCCL's in-place layout"
                )
        inputs = [_view(c.args["sendbuf"], count * n_in, dtype).clone() for c in calls]
        if kind == "allReduce":
            result = _reduce(inputs, op)
            outs = [result] * world
        elif kind == "reduce":
            outs = {root: _reduce(inputs, op)}
        elif kind == "broadcast":
            outs = [inputs[root]] * world
        elif kind == "allGather":
            outs = [torch.cat(inputs)] * world
        else:
            result = _reduce(inputs, op)
            outs = [result[r * count : (r + 1) * count] for r in range(world)]
        for r, value in outs.items() if isinstance(outs, dict) else enumerate(outs):
            _view(calls[r].args["recvbuf"], count * n_out, dtype).copy_(value)


class _Communicator:
    """``cupy.cuda.nccl.NcclCommunicator(ndev, commId, rank)``: blocks until all ``ndev`` ranks joined.

    ``abort()`` is ``ncclCommAbort``: local to this rank. Its calls waiting for peers fail at once (the kernels are
    released) and it never waits for anyone; the peers are not told, so theirs go on waiting (a peer that died is
    simply a rank that stops posting) until they abort too. Only :meth:`FakeNccl.abort_all`, the test harness's
    way out when a rank thread failed, releases every rank of a communicator.
    """

    _fake: FakeNccl

    def __init__(self, ndev: int, commId: bytes | tuple, rank: int):
        want = bytes if self._fake.cupy_version >= 14 else tuple
        if not isinstance(commId, want):  # Cython's check of the typed argument
            raise TypeError(
                f"Argument 'commId' has incorrect type (expected {want.__name__}, got {type(commId).__name__})"
            )
        if len(commId) != 128:
            raise AssertionError("commId must hold 128 bytes (CuPy asserts this)")
        if want is tuple and any(not isinstance(b, int) or not -128 <= b <= 127 for b in commId):
            raise OverflowError("value too large to convert to char (commId holds signed bytes, -128..127)")
        commId = tuple(commId)
        if not 0 <= rank < ndev:
            raise NcclError(f"NCCL_ERROR_INVALID_ARGUMENT: rank {rank} of {ndev}")
        self._rank, self._seq, self._closed, self._aborted, self.async_error = rank, 0, False, False, None
        self._clique = self._fake._clique(commId, ndev)
        with self._clique.cond:
            if rank in self._clique.members:
                raise NcclError(f"NCCL_ERROR_INVALID_USAGE: rank {rank} joined this communicator twice")
            self._clique.members.add(rank)
            self._clique.cond.notify_all()
            self._fake._wait(self, lambda: len(self._clique.members) == ndev, "ncclCommInitRank")

    def _usable(self) -> None:
        if self._closed:
            raise NcclError("NCCL_ERROR_INVALID_ARGUMENT: the communicator was destroyed or aborted")

    def destroy(self) -> None:
        self._closed = True

    def abort(self) -> None:
        with self._clique.cond:
            self._aborted = self._closed = True
            self._clique.cond.notify_all()  # wakes this rank's waiting calls; the peers' ones see nothing new

    def _abort_reason(self) -> str | None:
        """Why this rank's waiting calls must fail: its own abort, or the harness's ``abort_all``."""
        return f"rank {self._rank} called ncclCommAbort" if self._aborted else self._clique.aborted

    def check_async_error(self) -> None:
        self._usable()  # CuPy passes the freed (NULL) handle on: NCCL_ERROR_INVALID_ARGUMENT
        if self.async_error is not None:
            raise NcclError(self.async_error)

    def device_id(self) -> int:
        return 0

    def rank_id(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._clique.world

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        self._fake._submit(
            self,
            _Call("allReduce", sendbuf=sendbuf, recvbuf=recvbuf, count=count, datatype=datatype, op=op, stream=stream),
        )

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        self._fake._submit(
            self,
            _Call(
                "reduce",
                sendbuf=sendbuf,
                recvbuf=recvbuf,
                count=count,
                datatype=datatype,
                op=op,
                root=root,
                stream=stream,
            ),
        )

    def broadcast(self, sendbuff, recvbuff, count, datatype, root, stream):
        self._fake._submit(
            self,
            _Call(
                "broadcast",
                sendbuf=sendbuff,
                recvbuf=recvbuff,
                count=count,
                datatype=datatype,
                root=root,
                stream=stream,
            ),
        )

    def bcast(self, buff, count, datatype, root, stream):
        self.broadcast(buff, buff, count, datatype, root, stream)

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
        self._fake._submit(
            self,
            _Call(
                "reduceScatter",
                sendbuf=sendbuf,
                recvbuf=recvbuf,
                count=recvcount,
                datatype=datatype,
                op=op,
                stream=stream,
            ),
        )

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        self._fake._submit(
            self, _Call("allGather", sendbuf=sendbuf, recvbuf=recvbuf, count=count, datatype=datatype, stream=stream)
        )

    def send(self, sendbuf, count, datatype, peer, stream):
        self._peer(peer)
        self._fake._submit(
            self, _Call("send", sendbuf=sendbuf, count=count, datatype=datatype, peer=peer, stream=stream)
        )

    def recv(self, recvbuf, count, datatype, peer, stream):
        self._peer(peer)
        self._fake._submit(
            self, _Call("recv", recvbuf=recvbuf, count=count, datatype=datatype, peer=peer, stream=stream)
        )

    def _peer(self, peer: int) -> None:
        if not 0 <= peer < self._clique.world:
            raise NcclError(f"NCCL_ERROR_INVALID_ARGUMENT: peer {peer} of {self._clique.world} ranks")


class _Done:
    def query(self) -> bool:
        return True


class _Never:
    def query(self) -> bool:
        return False


class HostRuntime:
    """The backend's device seam on the CPU: every call above has finished when it returns, so events are done.
    ``stuck=True`` makes events never complete (a kernel waiting for a dead peer), to exercise the watchdog.

    It keeps the bookkeeping a GPU would act on, for tests to check: the handle of the communication stream NCCL
    calls must be issued on (``COMM_STREAM``, not torch's current stream 0), how many ops made that stream wait for
    the current one first (``joins``), and the tensors held for it (``held``, by ``id``)."""

    stuck = False
    COMM_STREAM = 7

    def __init__(self, device, group: str, rank: int):
        self.device = torch.device("cpu")
        self.joins = 0
        self.held: set[int] = set()

    def stream(self) -> int:
        self.joins += 1
        return self.COMM_STREAM

    def on_comm(self):
        return contextlib.nullcontext()

    def hold(self, tensors) -> None:
        self.held.update(id(t) for t in tensors)

    def record(self):
        return _Never() if self.stuck else _Done()

    def record_current(self):
        """An event after the current stream's work (a replayed graph); never completes when ``stuck``."""
        return _Never() if self.stuck else _Done()

    def recycle(self, event) -> None:
        pass  # its events hold no state

    def wait(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def selected(self):
        return contextlib.nullcontext()


# -- a GPU-like device: deferred NCCL calls on ordered stream queues, host syncs counted -----------------------------

_ASYNC_STREAMS: weakref.WeakValueDictionary[int, AsyncRuntime] = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1001)
_host = threading.local()  # per rank thread: its runtimes, active sync counters and traces, and a "quiet" flag
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_blocked_lock, _blocked = threading.Lock(), {}  # host threads waiting in AsyncRuntime._block -> how deep


def _every_host_blocked() -> bool:
    """Whether every live thread that owns an :class:`AsyncRuntime` is waiting for one (a real GPU would be running
    everything they enqueued)."""
    owners = {rt.owner for rt in list(_ASYNC_STREAMS.values()) if rt.owner.is_alive()}
    with _blocked_lock:
        return owners <= set(_blocked)


def _span_bytes(span: tuple[int, int]) -> torch.Tensor:
    return _view(span[0], span[1] - span[0], NCCL_UINT8).clone()


def _buffers(comm: _Communicator, call: _Call) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The byte ranges ``call`` reads and writes on ``comm``'s rank (NCCL ignores a reduce's receive buffer off the
    root and a broadcast's send buffer off the root)."""
    a, kind, world, rank = call.args, call.kind, comm._clique.world, comm._rank
    n_in, n_out = {"allGather": (1, world), "reduceScatter": (world, 1)}.get(kind, (1, 1))
    reads, writes = [], []
    if "sendbuf" in a and not (kind == "broadcast" and a["root"] != rank):
        reads.append(_span(a["sendbuf"], a["count"] * n_in, a["datatype"]))
    if "recvbuf" in a and not (kind == "reduce" and a["root"] != rank):
        writes.append(_span(a["recvbuf"], a["count"] * n_out, a["datatype"]))
    return [s for s in reads if s[0] != s[1]], [s for s in writes if s[0] != s[1]]


class _Entry:
    """One unit of work on a simulated communication stream: one NCCL (group) call, or one in-place torch op run
    inside ``on_comm()``; with the bytes it reads and writes as they were when it was enqueued, and what was held."""

    __slots__ = ("calls", "held", "op", "outputs", "reads", "what", "writes")

    def __init__(self, what: str, reads, writes, calls=(), op=None):
        self.what, self.calls, self.op, self.outputs = what, list(calls), op, list(writes)
        self.reads: dict[tuple[int, int], torch.Tensor | None] = dict.fromkeys(reads)
        self.writes: dict[tuple[int, int], torch.Tensor | None] = dict.fromkeys(w for w in writes if w not in reads)
        self.held: list[tuple[torch.Tensor, int, int]] = []

    def snapshot(self, touched: list[tuple[int, int]] | None = None) -> None:
        for spans in (self.reads, self.writes):
            for span in spans:
                if touched is None or any(_overlap(span, t) for t in touched):
                    spans[span] = _span_bytes(span)


class _AsyncEvent:
    """A CUDA event on a simulated communication stream: complete once every entry enqueued before it has run."""

    def __init__(self, runtime: AsyncRuntime, upto: int):
        self.runtime, self.upto = runtime, upto
        self.free = False
        """Given back to the runtime's pool (:meth:`AsyncRuntime.recycle`): reading it now is a bug."""

    def _check_in_use(self, what: str) -> None:
        if self.free:
            raise NcclError(
                f"fake CUDA: {what} of an event given back to the pool (its op completed and was waited for); a "
                "later op may record it again, so whoever still reads it would wait for the wrong op"
            )

    def query(self) -> bool:
        """Whether the work before the event has run. Asked on the rank's own thread (the host), it also lets that
        work start (the device runs what the host looks at); asked by the watchdog, it only looks."""
        self._check_in_use("query")
        rt = self.runtime
        if threading.current_thread() is rt.owner:
            rt._release(self.upto)
        return rt._done >= self.upto or rt._error is not None

    def synchronize(self) -> None:
        self._check_in_use("synchronize")
        _host_sync("event.synchronize")
        self.runtime._block(self.upto)


class _OnCommStream(TorchDispatchMode):
    """``on_comm()``: the in-place torch ops inside are enqueued on the communication stream behind the NCCL call
    (AVERAGE's scaling on NCCL < 2.10), instead of running on the host before it."""

    def __init__(self, runtime: AsyncRuntime):
        super().__init__()
        self.runtime = runtime

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        target = args[0] if args else None
        if not (func._schema.is_mutable and isinstance(target, torch.Tensor)):
            raise NotImplementedError(
                f"fake CUDA: only in-place ops can be enqueued on the simulated communication stream, got {func}"
            )
        span = (target.data_ptr(), target.data_ptr() + target.numel() * target.element_size())
        self.runtime._push(_Entry(str(func), [span], [span], op=(func, args, kwargs or {})))
        return target


class AsyncRuntime:
    """The backend's device seam as a GPU behaves, where it matters to correctness, on the CPU.

    Each instance is one communication stream (its own handle, so gpudist's sub-groups get their own streams). NCCL
    calls issued on it are not run: the simulated NCCL enqueues them, in order, and the host goes on. They run, in
    that order (still matching their peers as :class:`FakeNccl` does), on a thread standing for the device, and only
    once something waits for an event recorded after them: ``wait(event)`` (the current stream waits: on the CPU,
    where compute runs on the host, that blocks the host), ``synchronize()``, or ``event.query()`` asked on the rank's
    own thread (so shutdown completes; the watchdog's queries only look). Whatever the host does before such a wait
    sees the buffers as they were before the op: a strategy that reads an op's output without waiting trains wrong.
    When every rank's host has been blocked in such a wait for ``STUCK`` seconds, everything enqueued anywhere is let
    run (a GPU runs whatever is enqueued; without this, a rank blocked on one stream would starve a peer waiting on
    another, a deadlock no GPU has). No host can read a buffer meanwhile, so this hides nothing; ``fallbacks`` counts
    it. An op still waiting for a peer when its communicator is aborted completes (``ncclCommAbort`` releases the
    kernels), and so does the rest of the stream, leaving the buffers unfinished: the backend raises at its next call.

    Checked, raising a :class:`NcclError` that names the op: an NCCL call issued without ``stream()`` (the join of
    the current stream) since the previous one; a send buffer whose bytes changed between enqueue and completion;
    a receive buffer written by someone else between enqueue and run (ops earlier on the same stream may write it);
    a buffer not inside a tensor passed to ``hold()`` for that op, or whose storage was freed or resized since
    (``record_stream`` keeps the caching allocator from reusing it; here the held tensors stay referenced until
    the op ran). An error on the stream sticks: later waits raise it and the communicator reports it as its async
    error; every error is also kept in ``errors`` and in the fake's ``stream_errors``.

    Counted: ``joins`` (``stream()`` calls), ``ops`` (NCCL dispatches, a group call counting once), ``fallbacks``
    (waits that let everything run), and host syncs (``synchronize()``, ``event.synchronize()``) into the
    thread's :func:`count_host_syncs` counter."""

    STUCK = 0.2

    def __init__(self, device, group: str, rank: int):
        self.device = torch.device("cpu")
        self.group, self.rank = group, rank
        self.handle = next(_HANDLES)
        self.owner = threading.current_thread()
        self.joins = self.ops = self.fallbacks = 0
        self.events_made = 0
        """Events created (not taken from the pool of given-back ones)."""
        self._free: list[_AsyncEvent] = []
        self.errors: list[BaseException] = []
        self.fake: FakeNccl | None = None
        self._cond = threading.Condition()
        self._queue: collections.deque[_Entry] = collections.deque()
        self._enqueued = self._released = self._done = 0
        self._error: BaseException | None = None
        self._batch: list[_Entry] = []
        self._joined = False
        self._worker: threading.Thread | None = None
        _ASYNC_STREAMS[self.handle] = self
        if not hasattr(_host, "runtimes"):
            _host.runtimes = []
        _host.runtimes.append(weakref.ref(self))

    # -- the seam -----------------------------------------------------------------------------------------------------

    def stream(self) -> int:
        self.joins += 1
        self._joined = True
        return self.handle

    def on_comm(self):
        return _OnCommStream(self)

    def hold(self, tensors) -> None:
        held = [(t, t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors]
        for entry in self._batch:
            entry.held.extend(held)

    def record(self) -> _AsyncEvent:
        self._batch = []
        if self._free:  # recorded again, as a pooled CUDA event is
            event = self._free.pop()
            event.free, event.upto = False, self._enqueued
            return event
        self.events_made += 1
        return _AsyncEvent(self, self._enqueued)

    def record_current(self) -> _AsyncEvent:
        """After everything enqueued so far (compute runs at once here; the communication queue is what can lag)."""
        self.events_made += 1
        return _AsyncEvent(self, self._enqueued)

    def recycle(self, event: _AsyncEvent) -> None:
        if not event.query():
            raise NcclError("fake CUDA: an event given back to the pool before its op completed")
        event.free = True
        self._free.append(event)

    def wait(self, event: _AsyncEvent) -> None:
        event._check_in_use("wait")
        event.runtime._block(event.upto)

    def synchronize(self) -> None:
        _host_sync("synchronize")
        self._block(self._enqueued)

    def selected(self):
        return contextlib.nullcontext()

    # -- the queue ----------------------------------------------------------------------------------------------------

    def _enqueue_calls(self, fake: FakeNccl, queued: list[tuple[_Communicator, _Call]]) -> None:
        what = "+".join(dict.fromkeys(call.kind for _, call in queued))
        if not self._joined:
            raise NcclError(
                f"fake CUDA: {what} issued on the communication stream of group '{self.group}' (rank {self.rank}) "
                "without first making it wait for the current stream: it would read inputs not written yet"
            )
        self._joined = False
        self.fake, self.ops = fake, self.ops + 1
        reads, writes = [], []
        for comm, call in queued:
            r, w = _buffers(comm, call)
            reads += r
            writes += w
        self._push(_Entry(what, reads, writes, calls=queued))
        for _, call in queued:
            _note("nccl", call.kind)

    def _push(self, entry: _Entry) -> None:
        with _quiet(), self._cond:  # the snapshot under the lock: the device refreshes it after ops that write there
            entry.snapshot()
            self._queue.append(entry)
            self._enqueued += 1
        self._batch.append(entry)

    def _release(self, upto: int) -> None:
        with self._cond:
            if upto > self._released:
                self._released = upto
            if self._worker is None and self._done < self._released and self._error is None:
                self._worker = threading.Thread(
                    target=self._drain, name=f"fake-comm-stream-{self.group}-r{self.rank}", daemon=True
                )
                self._worker.start()

    def _block(self, upto: int) -> None:
        """Let the work before ``upto`` run and wait for it (the host waits: on the CPU, compute is the host)."""
        self._release(upto)
        me = threading.current_thread()
        with _blocked_lock:
            _blocked[me] = _blocked.get(me, 0) + 1
        stuck_since = None
        try:
            while True:
                with self._cond:
                    if self._error is not None:
                        raise NcclError(f"fake CUDA: the communication stream failed: {self._error}")
                    if self._done >= upto:
                        return
                    self._cond.wait(0.05)
                if not _every_host_blocked():
                    stuck_since = None
                elif stuck_since is None:
                    stuck_since = time.monotonic()
                elif time.monotonic() - stuck_since > self.STUCK:
                    stuck_since = None
                    self.fallbacks += 1
                    for rt in list(_ASYNC_STREAMS.values()):
                        rt._release(rt._enqueued)
        finally:
            with _blocked_lock:
                _blocked[me] -= 1
                if not _blocked[me]:
                    del _blocked[me]

    def _drain(self) -> None:
        """The device: run released entries in order."""
        while True:
            with self._cond:
                if self._error is not None or self._done >= self._released:
                    self._worker = None
                    return
                entry = self._queue[0]
            try:
                self._run(entry)
            except NcclError as e:
                if not any(comm._abort_reason() for comm, _ in entry.calls):
                    self._fail(entry, e)
                    return
                with self._cond:  # ncclCommAbort released the kernels: the rest of the stream completes, unfinished
                    for comm, _ in entry.calls:
                        comm.async_error = comm.async_error or f"NCCL_ERROR_REMOTE_ERROR: {e}"
                    self._queue.clear()
                    self._done = self._released = self._enqueued
                    self._worker = None
                    self._cond.notify_all()
                return
            except BaseException as e:
                self._fail(entry, e)
                return
            with self._cond:
                self._queue.popleft()
                self._done += 1
                for later in self._queue:
                    later.snapshot(entry.outputs)
                self._cond.notify_all()

    def _fail(self, entry: _Entry, e: BaseException) -> None:
        """The stream's error sticks: later waits raise it, the communicator reports it, the test sees it."""
        with self._cond:
            self._error, self._worker = e, None
            self.errors.append(e)
            if self.fake is not None:
                self.fake.stream_errors.append(f"group '{self.group}' rank {self.rank}: {e}")
            for comm, _ in entry.calls:
                comm.async_error = comm.async_error or str(e)
            self._cond.notify_all()

    def _problem(self, entry: _Entry, text: str) -> NcclError:
        return NcclError(f"fake CUDA: rank {self.rank}'s {entry.what} on group '{self.group}': {text}")

    def _run(self, entry: _Entry) -> None:
        for span in (*entry.reads, *entry.writes):
            owner = next((h for h in entry.held if h[1] <= span[0] and span[1] <= h[1] + h[2]), None)
            if owner is None:
                raise self._problem(
                    entry,
                    "a buffer was not held for the communication stream (hold/record_stream): the caching allocator "
                    "could hand its memory out while the op runs",
                )
            storage = owner[0].untyped_storage()
            if (storage.data_ptr(), storage.nbytes()) != owner[1:]:
                raise self._problem(entry, "a buffer was freed or resized while its NCCL op was in flight")
        for spans, role in ((entry.reads, "send"), (entry.writes, "receive")):
            for span, before in spans.items():
                if not torch.equal(_span_bytes(span), before):
                    raise self._problem(
                        entry,
                        f"its {role} buffer was modified while its NCCL op was in flight (after it was enqueued, "
                        "before it ran); wait on the op's Work before writing the buffer",
                    )
        if entry.op is not None:
            func, args, kwargs = entry.op
            func(*args, **kwargs)
            return
        self.fake._execute(entry.calls)
        for span, before in entry.reads.items():
            if not any(_overlap(span, w) for w in entry.outputs) and not torch.equal(_span_bytes(span), before):
                raise self._problem(entry, "its send buffer was modified while the op ran")


# -- host syncs and the order of host work, per rank thread ----------------------------------------------------------


@contextlib.contextmanager
def _quiet():
    """The simulation's own torch ops (snapshots) are neither compute nor host syncs."""
    before = getattr(_host, "quiet", False)
    _host.quiet = True
    try:
        yield
    finally:
        _host.quiet = before


def _ours(filename: str) -> bool:
    """Whether ``filename`` is this repository's code (not this file, nor a package installed in a virtual environment
    that lives inside the checkout, as CI's does)."""
    return (
        filename.startswith(_ROOT)
        and filename != __file__
        and f"{os.sep}site-packages{os.sep}" not in filename
        and f"{os.sep}dist-packages{os.sep}" not in filename
    )


def _site() -> str | None:
    """``path:line (function)`` of the innermost frame in this repository outside ``gpudist/comm`` (and this file)
    that led here, with the backend's frame after "via" when the sync is the backend's own (a validated op's
    check); None for torch.optim's reads of ``state['step']``, which torch keeps on the host (no device sync)."""
    frame, via = sys._getframe(2), None
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_get_value" and f"torch{os.sep}optim" in code.co_filename:
            return None
        if _ours(code.co_filename):
            where = f"{os.path.relpath(code.co_filename, _ROOT)}:{frame.f_lineno} ({code.co_name})"
            if not where.startswith(os.path.join("gpudist", "comm", "")):
                return where if via is None else f"{where} via {via}"
            via = via or where
        frame = frame.f_back
    return via or "?"


class HostSyncs:
    """Host syncs seen on one thread: ``sites`` counts ``"path:line (function) what"``; ``total`` sums them."""

    def __init__(self):
        self.sites: collections.Counter[str] = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def add(self, what: str) -> None:
        site = _site()
        if site is not None:
            self.sites[f"{site} {what}"] += 1


def _host_sync(what: str) -> None:
    if getattr(_host, "quiet", False):
        return
    for counter in getattr(_host, "syncs", ()):
        counter.add(what)


_SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2", "aten::unique_dim"}
_COPIES = ("cpu", "numpy", "tolist", "to")
_copies_lock, _copies_users, _copies_saved = threading.Lock(), [0], {}


class _SyncOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in _SYNC_OPS:
            _host_sync(func._schema.name.removeprefix("aten::"))
        return func(*args, **(kwargs or {}))


def _strings(*values) -> list[str]:
    return [v for v in values if isinstance(v, str)]


def _counting_copy(name: str, original):
    """``torch.Tensor.<name>`` that counts a host sync on threads counting them (a method patch, not a torch
    function mode: autograd runs backward hooks without the caller's torch function modes)."""

    def method(self, *args, **kwargs):
        if getattr(_host, "syncs", None) and (name != "to" or "cpu" in _strings(*args, kwargs.get("device"))):
            _host_sync(f"{name}()")
        return original(self, *args, **kwargs)

    return method


@contextlib.contextmanager
def _counting_copies() -> Iterator[None]:
    with _copies_lock:
        if _copies_users[0] == 0:
            for name in _COPIES:
                _copies_saved[name] = torch.Tensor.__dict__.get(name)
                setattr(torch.Tensor, name, _counting_copy(name, getattr(torch.Tensor, name)))
        _copies_users[0] += 1
    try:
        yield
    finally:
        with _copies_lock:
            _copies_users[0] -= 1
            if _copies_users[0] == 0:
                for name, saved in _copies_saved.items():
                    if saved is None:
                        delattr(torch.Tensor, name)
                    else:
                        setattr(torch.Tensor, name, saved)


@contextlib.contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    """Count this thread's host syncs inside the block: ``aten._local_scalar_dense`` (``.item()``, ``bool()``,
    ``float()``, ``int()`` of a tensor), data-dependent shapes (``nonzero``, ``masked_select``, ``unique``),
    device-to-host copies (``.cpu()``, ``.numpy()``, ``.tolist()``, ``.to("cpu")`` with the string: on the CPU tier
    every tensor is on the host, so each such call counts as the copy it is on a GPU, even where it would be a no-op
    there; ``.to(device)`` with a ``torch.device`` is taken for the backend's device and not counted), and the
    :class:`AsyncRuntime`'s ``synchronize()`` and event host waits. Not counted: torch.optim's reads of its
    ``state['step']`` tensors, which torch keeps on the host. Each sync is recorded with the innermost frame of this
    repository that made it (``HostSyncs.sites``)."""
    counter = HostSyncs()
    stack = getattr(_host, "syncs", [])
    _host.syncs = [*stack, counter]
    try:
        with _counting_copies(), _SyncOps():
            yield counter
    finally:
        _host.syncs = stack


class StreamTrace:
    """What one thread enqueued, in order: ``("compute", aten op)``, ``("nccl", call kind)`` and the test's own
    ``("mark", label)`` entries."""

    def __init__(self):
        self.events: list[tuple[str, str]] = []

    def mark(self, label: str) -> None:
        self.events.append(("mark", label))

    def between(self, first: str, last: str) -> list[tuple[str, str]]:
        """The events after the mark ``first`` and before the mark ``last``."""
        at = self.events.index(("mark", first))
        return self.events[at + 1 : self.events.index(("mark", last), at)]


def _note(kind: str, name: str) -> None:
    if getattr(_host, "quiet", False):
        return
    for trace in getattr(_host, "traces", ()):
        trace.events.append((kind, name))


class _ComputeOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        _note("compute", func._schema.name.removeprefix("aten::"))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def stream_trace() -> Iterator[StreamTrace]:
    """Record, on this thread, every aten op (the compute a GPU would enqueue on the current stream) and every NCCL
    call an :class:`AsyncRuntime` enqueues, in order."""
    trace = StreamTrace()
    stack = getattr(_host, "traces", [])
    _host.traces = [*stack, trace]
    try:
        with _ComputeOps():
            yield trace
    finally:
        _host.traces = stack


@contextlib.contextmanager
def installed(fake: FakeNccl, runtime: type = HostRuntime):
    """Make gpudist's NCCL backend use ``fake`` as CuPy's NCCL and ``runtime`` as its device (for every thread).

    On a GPU-like runtime (not :class:`HostRuntime`) the kernels run their torch references unless a test chose
    otherwise (``GPUDIST_KERNELS``): those are the GPU's algorithms in torch ops, while the CPU's own fast paths may
    read the host where that costs nothing (top-k's), which on the simulated device would count as host syncs."""
    from gpudist.comm import nccl
    from gpudist.kernels.dispatch import ENV_VAR

    saved = nccl._nccl, nccl._runtime
    nccl._nccl, nccl._runtime = (lambda: fake), runtime
    chosen = os.environ.get(ENV_VAR)
    if runtime is not HostRuntime and chosen in (None, "", "auto"):
        os.environ[ENV_VAR] = "torch"
    try:
        yield fake
    finally:
        nccl._nccl, nccl._runtime = saved
        if chosen is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = chosen


def _rank_on_nccl(comm, body, fake: FakeNccl, checked: bool, kwargs: dict):
    from gpudist.comm.nccl import NCCLCommunicationBackend

    try:
        backend = NCCLCommunicationBackend.from_bootstrap(comm, validate=checked)
        try:
            return body(backend, **kwargs)
        finally:
            backend.shutdown()
    except BaseException as e:
        fake.abort_all(f"rank {comm.rank} failed: {type(e).__name__}: {e}")
        raise


def run_nccl(fn, world_size: int, fake: FakeNccl, *, validate: bool = True, runtime: type = HostRuntime, **kwargs):
    """``run_ranks`` over the simulated NCCL: in-memory ranks bootstrap one NCCL backend each (the unique id goes
    through ``from_bootstrap``) on ``runtime`` as their device and run ``fn(nccl_backend, **kwargs)``; results in
    rank order."""
    from gpudist.testing import run_ranks

    with installed(fake, runtime):
        return run_ranks(_rank_on_nccl, world_size, "inmemory", body=fn, fake=fake, checked=validate, kwargs=kwargs)
