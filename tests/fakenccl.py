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
- Collectives are matched by order on each communicator; ranks that disagree on kind, count, dtype, op or root
  get an error (real NCCL would hang or corrupt memory). In-place calls must use NCCL's exact aliasing
  (all-gather: ``send == recv + rank * count``; reduce-scatter: ``recv == send + rank * recvcount``); any
  other overlap of send and receive buffers is an error.
- ``NCCL_BFLOAT16``/``NCCL_AVG`` exist as constants whatever ``get_version()`` says, as in CuPy.
- The unique id has CuPy's two forms: ``bytes`` from CuPy 14 on, a tuple of 128 signed chars before
  (``cupy_version``); each refuses the other with CuPy's TypeError. Checked against the real CuPy 14.2.0
  (cupy-cuda13x with NCCL 2.32.3, imported without a GPU): its names and argument lists are the ones here.

What it cannot show: speed, CUDA streams and events, device placement (tensors live on the CPU), NCCL's own
bugs. Those need the GPU tier (tests/test_gpu.py).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import threading
import time

import torch

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
            self._execute(queued)

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
            self._execute([(comm, call)])

    def _wait(self, comm: _Communicator, ready, what: str) -> None:
        clique, deadline = comm._clique, time.monotonic() + self.timeout
        while not ready():
            if clique.aborted is not None:
                raise NcclError(
                    f"NCCL_ERROR_SYSTEM_ERROR: communicator aborted while rank {comm._rank} waited in "
                    f"{what} ({clique.aborted})"
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
    """``cupy.cuda.nccl.NcclCommunicator(ndev, commId, rank)``: blocks until all ``ndev`` ranks joined."""

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
        self._rank, self._seq, self._closed, self.async_error = rank, 0, False, None
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
            self._clique.aborted = self._clique.aborted or f"rank {self._rank} called abort"
            self._clique.cond.notify_all()
        self._closed = True

    def check_async_error(self) -> None:
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

    def wait(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def selected(self):
        return contextlib.nullcontext()


@contextlib.contextmanager
def installed(fake: FakeNccl, runtime: type = HostRuntime):
    """Make gpudist's NCCL backend use ``fake`` as CuPy's NCCL and ``runtime`` as its device (for every thread)."""
    from gpudist.comm import nccl

    saved = nccl._nccl, nccl._runtime
    nccl._nccl, nccl._runtime = (lambda: fake), runtime
    try:
        yield fake
    finally:
        nccl._nccl, nccl._runtime = saved


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


def run_nccl(fn, world_size: int, fake: FakeNccl, *, validate: bool = True, **kwargs):
    """``run_ranks`` over the simulated NCCL: in-memory ranks bootstrap one NCCL backend each (the unique id goes
    through ``from_bootstrap``) and run ``fn(nccl_backend, **kwargs)``; results in rank order."""
    from gpudist.testing import run_ranks

    with installed(fake):
        return run_ranks(_rank_on_nccl, world_size, "inmemory", body=fn, fake=fake, checked=validate, kwargs=kwargs)
