"""The NCCL backend's own code on the CPU tier, over the simulated NCCL of tests/fakenccl.py (CuPy's API, strict
in-order semantics, ranks as threads): every op, the id exchange, sub-groups, version-dependent paths, the
watchdog, and every strategy trained to single-process parity (each strategy's own test module's tolerance:
single-process training in float64, within a multiple of the float32 run's own error). What only a GPU can show
(CUDA streams and events, device placement, NCCL itself, speed) is in tests/test_gpu.py.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

import gpudist
from examples import train
from gpudist.comm import CommunicationError, CommunicationTimeoutError
from gpudist.comm.cuda_runtime import CudaRuntime
from gpudist.comm.nccl import NCCLCommunicationBackend, nccl_version
from gpudist.testing import free_port, run_ranks

from .fakenccl import AsyncRuntime, FakeNccl, HostRuntime, installed, run_nccl
from .helpers import (
    GPU_PAIRS,
    GPU_STEPS,
    LOSSY,
    assert_losses_match,
    assert_lossless,
    check_training,
    conservation,
    gpu_batch,
    gpu_net,
    gpu_reference,
    gpu_train,
    hybrid_check,
    hybrid_train,
    lossless_vs_plain,
    pipeline_reference,
    pipeline_train,
    pipeline_train_varying,
    script_losses,
    tp_lm_batch,
    tp_single_process_lm,
    tp_train_lm,
    varying_batch,
)
from .tolerances import assert_matches_reference, reference_pair


def solo(fake: FakeNccl, **kwargs) -> NCCLCommunicationBackend:
    return NCCLCommunicationBackend(0, 1, fake.get_unique_id(), **kwargs)


def _reductions(comm) -> dict:
    out = {}
    for op in ("sum", "average", "max"):
        t = torch.tensor([1.0, 2.0, 3.0]) * (comm.rank + 1)
        comm.all_reduce(t, op)
        out[op] = t.tolist()
    try:
        comm.all_reduce(torch.ones(2, dtype=torch.bfloat16))
        out["bf16"] = "ok"
    except TypeError as e:
        out["bf16"] = str(e)
    return out


@pytest.mark.parametrize("version", [21003, 20903])
def test_average_and_bf16_follow_the_runtime_version(version):
    """CuPy defines NCCL_AVG and NCCL_BFLOAT16 whatever libnccl it loads; NCCL has them from 2.10. Catches a
    backend that trusts the constants: on 2.9 it must average as SUM then scale, and refuse bf16 with a clear
    error instead of passing NCCL an op/type code it rejects."""
    fake = FakeNccl(version=version)
    results = run_nccl(_reductions, 2, fake)
    for r in results:
        assert r["sum"] == [3.0, 6.0, 9.0] and r["average"] == [1.5, 3.0, 4.5] and r["max"] == [2.0, 4.0, 6.0]
    if version >= 21000:
        assert results[0]["bf16"] == "ok"
        assert fake.calls["allReduce"] > 0
    else:
        assert "bfloat16" in results[0]["bf16"] and "cast to float32" in results[0]["bf16"]
    with installed(fake):
        assert nccl_version() == (2, version // 100 % 100, version % 100)


def _ring(comm) -> list[float]:
    left, right = (comm.rank - 1) % comm.world_size, (comm.rank + 1) % comm.world_size
    got = torch.zeros(3)
    comm.batch_send_recv([(torch.full((3,), float(comm.rank)), right)], [(got, left)]).wait()
    return got.tolist()


def test_batch_send_recv_lets_a_ring_exchange_in_one_step():
    """Every rank sends right and receives from the left at once. Catches a batch that is not one group call:
    with NCCL's in-order p2p each rank would block in its send (or receive) and the ring would deadlock."""
    fake = FakeNccl(timeout=10)
    assert run_nccl(_ring, 3, fake) == [[2.0] * 3, [0.0] * 3, [1.0] * 3]
    assert fake.calls["send"] == fake.calls["recv"] == 3


def _on_threads(fn, world: int, fake: FakeNccl) -> list:
    """``fn(rank)`` for every rank, each on a thread of its own, results in rank order. Every wait is bounded: a rank
    that fails releases the others (``abort_all``), and a thread still running after 120 s fails the test."""
    results, errors = [None] * world, []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # pytest's own failures too: reported below
            errors.append(e)
            fake.abort_all(f"rank {rank} failed: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    assert not errors, errors
    return results


@pytest.mark.parametrize("cupy_version", [14, 13])
def test_create_exchanges_the_id_through_the_tcp_store(cupy_version):
    """Two ranks join through torch's TCPStore. Catches the 128-byte id in the wrong form for the installed CuPy
    (bytes from 14 on, signed chars before: an unsigned byte > 127 overflows) or ranks reading different ids
    (init never completes)."""
    fake, port = FakeNccl(timeout=20, cupy_version=cupy_version), free_port()

    def join(rank: int) -> float:
        comm = NCCLCommunicationBackend.create(rank, 2, "127.0.0.1", port, timeout=20)
        t = torch.tensor([rank + 1.0])
        comm.all_reduce(t)
        comm.shutdown()
        return t.item()

    with installed(fake):
        assert _on_threads(join, 2, fake) == [3.0, 3.0]


def _subgroup_sums(comm) -> list[float]:
    out = []
    for ranks in ([0, 1], [1, 2], [0, 2]):
        group = comm.new_group(ranks)
        if group is not None:
            t = torch.tensor([comm.rank + 1.0])
            group.all_reduce(t)
            out.append(t.item())
    return out


@pytest.mark.parametrize("cupy_version", [14, 13])
def test_ids_take_the_installed_cupys_form(cupy_version):
    """CuPy 14 changed the unique id from a tuple of signed chars to bytes, and each refuses the other with a
    TypeError. Catches the backend passing one form only: with CuPy 14 (what cupy-cuda13x installs) every
    NCCL group, the world one from the bootstrap and each sub-group, failed at construction."""
    results = run_nccl(_subgroup_sums, 3, FakeNccl(cupy_version=cupy_version))
    assert results == [[3.0, 4.0], [3.0, 5.0], [5.0, 4.0]]


def _mismatch(comm) -> str:
    try:
        comm.all_reduce(torch.ones(3 if comm.rank == 0 else 4))
    except CommunicationError as e:
        return str(e)
    return "no error"


def test_validated_ops_catch_a_shape_mismatch_before_sending():
    """With ``validate`` the signature all-gather runs first: both ranks raise naming the op, and nothing reaches
    NCCL (which would hang or mix memory). Catches a backend that skips the check or checks on one rank."""
    fake = FakeNccl(timeout=10)
    for message in run_nccl(_mismatch, 2, fake):
        assert "all_reduce" in message and "mismatch" in message
    assert fake.calls["allReduce"] == 0


def _until_it_raises(call, limit: float = 120.0) -> None:
    """Call ``call`` every 50 ms until it raises (the watchdog thread has acted), for at most ``limit`` seconds: how
    soon that thread runs depends on the machine's load, which the test must not."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        threading.Event().wait(0.05)
        call()


class _Stuck(HostRuntime):
    stuck = True


def test_watchdog_aborts_a_stuck_op_and_the_next_call_names_it():
    """An op whose completion event never fires (a peer died) makes the watchdog abort the communicator after the
    timeout; the next call raises CommunicationTimeoutError naming the op, group and rank instead of hanging."""
    fake = FakeNccl()
    with installed(fake, _Stuck):
        comm = solo(fake, timeout=0.3)
        comm.all_reduce(torch.ones(2))
        stuck = r"all_reduce on group 'world' failed on rank 0: timed out"
        with pytest.raises(CommunicationTimeoutError, match=stuck):
            _until_it_raises(lambda: comm.broadcast(torch.ones(2), 0))
        assert not comm.healthy
        assert comm._comm._closed  # ncclCommAbort was called: kernels waiting for the dead peer are released
        comm.shutdown()


class _StuckDevice(_Stuck):
    """A device whose NCCL kernel waits for a dead peer: its events never complete and a device-wide synchronize
    would never return (here it fails the test instead of hanging it)."""

    def synchronize(self) -> None:
        raise AssertionError("shutdown waited on the device with an op stuck on it: it would hang on a GPU")


def test_shutdown_with_a_stuck_op_aborts_instead_of_waiting_for_the_device():
    """Catches a shutdown that synchronizes the device while an NCCL kernel waits for a dead peer (it would hang
    forever): it waits for this rank's ops at most until their deadline, then aborts the communicator."""
    fake = FakeNccl()
    with installed(fake, _StuckDevice):
        comm = solo(fake, timeout=0.5)
        comm.all_reduce(torch.ones(2), async_op=True)
        comm.shutdown()
        assert not comm.healthy
        assert comm._comm._closed  # ncclCommAbort: the stuck kernel is released
        assert not comm._watchdog.is_alive()  # joined, not left behind
        with pytest.raises(CommunicationTimeoutError, match=r"all_reduce.*timed out"):
            comm.broadcast(torch.ones(2), 0)
        comm.shutdown()  # idempotent


def _generation(store: dist.Store, rank: int, world: int, number: int, **kwargs) -> NCCLCommunicationBackend:
    """Membership generation ``number``'s NCCL group, in a namespace of its own on ``store`` (as live training does)."""
    name = f"gen-{number}"
    return NCCLCommunicationBackend.join_group(
        dist.PrefixStore(f"{name}/", store), rank, world, name=name, connect_timeout=60, **kwargs
    )


def test_survivors_of_a_dead_rank_abort_and_all_reduce_in_a_new_group():
    """Rank 1 of 3 dies (stops posting) before an all-reduce; on a GPU-like device the survivors' op waits for it until
    the watchdog aborts the communicator at the op timeout, and raises naming op, group and rank; they then form a
    2-rank group through the store and all-reduce exactly; the old group refuses further ops. Catches a pending op
    that returns its unfinished output as if complete once the abort released it (the survivors would train on a
    half-reduced gradient), and a rebuild that reuses the old group's id or store keys."""
    fake, store, dead = FakeNccl(timeout=60), dist.HashStore(), 1

    def life(rank: int):
        old = _generation(store, rank, 3, 0, timeout=2.0)
        warm = torch.tensor([rank + 1.0])
        old.all_reduce(warm)
        if rank == dead:
            return old  # it dies here: posts nothing more (its communicator is aborted below, as its exit would)
        with pytest.raises(CommunicationTimeoutError) as timed_out, old.unchecked():  # as in steady-state steps
            old.all_reduce(torch.tensor([rank + 1.0]))
        new = _generation(store, [0, 2].index(rank), 2, 1, timeout=60)
        t = torch.tensor([rank + 1.0, 10.0 * rank])
        new.all_reduce(t)
        with pytest.raises(CommunicationError) as refused:
            old.broadcast(torch.zeros(1), 0)
        new.shutdown()
        old.shutdown()
        return warm.item(), str(timed_out.value), t.tolist(), str(refused.value), old._comm._closed

    with installed(fake, AsyncRuntime):
        results = _on_threads(life, 3, fake)
    results[dead].abort()
    results[dead].shutdown()
    for rank in (0, 2):
        warm, timed_out, reduced, refused, closed = results[rank]
        assert warm == 6.0
        assert timed_out.startswith(f"all_reduce on group 'gen-0' failed on rank {rank}: "), timed_out
        assert "timed out after 2s" in timed_out and "aborted" in timed_out
        assert reduced == [4.0, 20.0]  # ranks 0 and 2 only: 1 + 3, 0 + 20
        assert refused.startswith(f"broadcast on group 'gen-0' failed on rank {rank}: the group is unusable"), refused
        assert "timed out" in refused and closed
    assert not fake.stream_errors, fake.stream_errors


def test_abort_fails_pending_work_and_the_group_is_rebuilt():
    """A survivor told by its membership service that its peer died aborts at once, while its all-reduce already
    waits for that peer on the device. Catches an abort that does not mark the group broken (the Work, released by
    the abort, would return the unfinished output as if complete) and a group that cannot be formed again after it."""
    fake, store = FakeNccl(timeout=60), dist.HashStore()

    def life(rank: int):
        comm = _generation(store, rank, 2, 0, timeout=600, validate=False)
        if rank == 1:
            return comm  # dies before its all-reduce
        work = comm.all_reduce(torch.ones(2), async_op=True)
        assert not work.is_completed()  # the device started the op: it waits for rank 1
        comm.abort()
        with pytest.raises(CommunicationError, match=r"all_reduce on group 'gen-0' failed on rank 0: .*ncclCommAbort"):
            work.wait()
        comm.shutdown()
        alone = _generation(store, 0, 1, 1)
        t = torch.tensor([5.0])
        alone.all_reduce(t)
        alone.shutdown()
        return t.item(), comm._watchdog.is_alive()

    with installed(fake, AsyncRuntime):
        results = _on_threads(life, 2, fake)
    results[1].abort()
    results[1].shutdown()
    assert results[0] == (5.0, False)


def test_join_group_names_the_ranks_that_never_arrived():
    """Ranks 0 and 1 of 3 join; rank 2 died before it could. Catches a join that goes on into ncclCommInitRank, which
    waits for every rank with no timeout (the survivors would hang instead of forming the next generation), and a
    timeout that does not say which rank is missing."""
    fake, store = FakeNccl(timeout=10), dist.HashStore()

    def join(rank: int) -> str:
        with pytest.raises(CommunicationTimeoutError) as e:
            NCCLCommunicationBackend.join_group(store, rank, 3, name="gen-4", connect_timeout=0.5)
        return str(e.value)

    with installed(fake):
        for rank, message in enumerate(_on_threads(join, 2, fake)):
            assert message.startswith(f"rank {rank}: NCCL group 'gen-4' of 3 did not form within 0.5s: rank(s) [2]")
    assert fake.calls["allReduce"] == 0


class _Recording(HostRuntime):
    """Records which threads select the device (CUDA calls made without it go to device 0)."""

    threads: list[str] = []

    def selected(self):
        type(self).threads.append(threading.current_thread().name)
        return super().selected()


def test_watchdog_selects_the_backends_device():
    """Catches a watchdog thread whose event queries run on the thread's default device (each rank would create a
    CUDA context on GPU 0, about 0.5 GiB apiece, and query the wrong device's events)."""
    fake = FakeNccl()
    _Recording.threads = []
    with installed(fake, _Recording):
        comm = solo(fake)
        deadline = time.monotonic() + 60
        while comm._watchdog.name not in _Recording.threads and time.monotonic() < deadline:
            threading.Event().wait(0.01)
        assert comm._watchdog.name in _Recording.threads
        comm.shutdown()


class _FailingQuery:
    def query(self) -> bool:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


class _BrokenDevice(HostRuntime):
    def record(self):
        return _FailingQuery()


def test_a_watchdog_failure_breaks_the_group_with_its_text():
    """Catches a watchdog that dies silently on an exception of its own (after which no op would ever time out):
    the group breaks, and the next call names the watchdog and the CUDA error."""
    fake = FakeNccl()
    with installed(fake, _BrokenDevice):
        comm = solo(fake, timeout=600)
        comm.all_reduce(torch.ones(2))
        with pytest.raises(CommunicationError, match=r"watchdog failed.*illegal memory access"):
            _until_it_raises(lambda: comm.broadcast(torch.ones(2), 0))
        comm.shutdown()


class _SlowQuery:
    entered = threading.Event()
    release = threading.Event()

    def query(self) -> bool:
        type(self).entered.set()
        type(self).release.wait(300)
        return True


class _SlowDevice(HostRuntime):
    def record(self):
        return _SlowQuery()


def test_watchdog_queries_events_without_holding_the_lock_ops_take():
    """Catches the watchdog holding a lock across a CUDA event query that an op needs to register its event: an op
    issued meanwhile would wait for the query, i.e. for the device."""
    fake = FakeNccl()
    _SlowQuery.entered.clear()
    _SlowQuery.release.clear()
    with installed(fake, _SlowDevice):
        comm = solo(fake)
        comm.all_reduce(torch.ones(2))
        assert _SlowQuery.entered.wait(60), "the watchdog never queried the op's event"
        issued = threading.Event()
        threading.Thread(target=lambda: (comm.all_reduce(torch.ones(2)), issued.set()), daemon=True).start()
        try:
            assert issued.wait(30), "an op waited for the watchdog's event query"
        finally:
            _SlowQuery.release.set()
        comm.shutdown()


def test_every_nccl_backend_is_shut_down_at_exit(monkeypatch):
    """Catches a backend left to the interpreter's teardown (``init("nccl")`` registered nothing): the exit hook
    stops its watchdog and destroys its communicator, and holds no reference that would keep it alive."""
    from gpudist.comm import nccl

    hooks = []
    monkeypatch.setattr(nccl.atexit, "register", lambda fn, *args: hooks.append((fn, args)))
    fake = FakeNccl()
    with installed(fake):
        comm = solo(fake)
        assert len(hooks) == 1
        fn, args = hooks[0]
        fn(*args)
        assert comm._comm._closed and not comm._watchdog.is_alive()


def test_async_nccl_error_breaks_the_group_with_its_text():
    """ncclCommGetAsyncError reporting a failure (a remote rank's network error) surfaces on the next call."""
    fake = FakeNccl()
    with installed(fake):
        comm = solo(fake)
        comm._comm.async_error = "NCCL_ERROR_REMOTE_ERROR: remote process exited"
        with pytest.raises(CommunicationError, match="REMOTE_ERROR"):
            _until_it_raises(lambda: comm.all_reduce(torch.ones(2)))
        comm.shutdown()


def test_missing_cupy_names_the_extra_to_install(monkeypatch):
    """Without CuPy the error says which pip extra brings NCCL, instead of an ImportError from deep inside."""
    import builtins

    real_import = builtins.__import__

    def no_cupy(name, *args, **kwargs):
        if name.startswith("cupy"):
            raise ImportError("No module named 'cupy'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_cupy)
    from gpudist.comm import nccl

    with pytest.raises(CommunicationError, match=r"gpudist\[cuda12\]"):
        nccl._nccl()
    assert nccl.nccl_version() is None


def test_cupy_without_libnccl_names_the_wheel_to_install(monkeypatch):
    """CuPy imports without libnccl and marks ``nccl.available`` False: the error says which NCCL to install,
    instead of an AttributeError from the first NCCL call."""
    import sys
    import types

    cupy, cuda, lib = types.ModuleType("cupy"), types.ModuleType("cupy.cuda"), types.ModuleType("cupy.cuda.nccl")
    lib.available, cuda.nccl, cupy.cuda = False, lib, cuda
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", lib)
    from gpudist.comm import nccl

    with pytest.raises(CommunicationError, match=r"libnccl was not found.*nvidia-nccl-cu12"):
        nccl._nccl()
    assert nccl.nccl_version() is None


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("strategy", list(GPU_PAIRS))
def test_strategy_over_nccl_matches_one_process(strategy, world):
    """DDP, ZeRO-1/2/3 and FSDP driving the NCCL backend (uneven reduce-scatter/all-gather as grouped
    reduces/broadcasts, in-place aliasing, sub-groups): 5 Adam steps equal one process on the global batch."""
    expected = reference_pair(gpu_reference, "cpu")
    for params in run_nccl(gpu_train, world, FakeNccl(), strategy=strategy):
        assert_matches_reference(params, *expected)


def test_ops_run_on_the_communication_stream_and_hold_their_tensors():
    """Catches an op issued on torch's current stream (it would serialize with compute: nothing overlaps), one that
    does not first make the communication stream wait for the current one (it would read inputs not yet written),
    and a tensor not held for the communication stream (the caching allocator could hand its memory out while the
    op still reads or writes it)."""
    fake = FakeNccl()
    with installed(fake):
        comm = solo(fake, validate=False)
        a, b, out = torch.ones(4), torch.ones(4), torch.empty(4)
        comm.all_reduce(a, async_op=True).wait()
        comm.all_gather(b, out)
        comm.broadcast(a, 0)
        assert dict(fake.streams) == {HostRuntime.COMM_STREAM: 3}
        assert comm._rt.joins == 3
        assert {id(a), id(b), id(out)} <= comm._rt.held
        comm.shutdown()


class _Stream:
    def __init__(self, cuda: _Cuda, handle: int):
        self.cuda, self.cuda_stream, self.stream_id = cuda, handle, handle

    def wait_stream(self, other) -> None:
        self.cuda.call("Stream.wait_stream")
        self.cuda.log.append(("wait", self.cuda_stream, None, other.cuda_stream))

    def wait_event(self, event) -> None:
        self.cuda.call("Stream.wait_event")
        event.wait(self)


class _Event:
    def __init__(self, cuda: _Cuda):
        cuda.call("Event()")
        self.cuda, self.on = cuda, None

    def record(self, stream) -> None:
        self.cuda.call("Event.record")
        self.on = stream.cuda_stream
        self.cuda.log.append(("record", self, stream.cuda_stream))

    def wait(self, stream) -> None:
        self.cuda.call("Event.wait")
        self.cuda.log.append(("wait", stream.cuda_stream, self, self.on))

    def query(self) -> bool:
        self.cuda.call("Event.query")
        return True


class _Cuda:
    """torch.cuda as the real CUDA seam (``CudaRuntime``) uses it, stood in for on the CPU: streams and events
    that log what was done to them (``log``), a current stream the test can switch (``current``), torch's C lookup of
    the current stream where ``fast`` (torch 2.11-2.13 have it; without it the seam falls back to
    ``current_stream()``), and every call counted by name, on the thread that built this only (the watchdog's event
    queries are not the op's host work)."""

    def __init__(self, monkeypatch, fast: bool = True):
        self.calls: collections.Counter[str] = collections.Counter()
        self.log: list[tuple] = []
        self.thread = threading.current_thread()
        self.handles = itertools.count(1)
        self.current = self.new_stream()
        self.made: list[_Stream] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_stream", self.current_stream)
        monkeypatch.setattr(torch.cuda, "Stream", self.stream)
        monkeypatch.setattr(torch.cuda, "Event", lambda: _Event(self))
        monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
        if fast:
            monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", self.lookup, raising=False)
        else:
            monkeypatch.delattr(torch._C, "_cuda_getCurrentStream", raising=False)

    def call(self, name: str) -> None:
        if threading.current_thread() is self.thread:
            self.calls[name] += 1

    def new_stream(self) -> _Stream:
        return _Stream(self, next(self.handles))

    def current_stream(self, device=None) -> _Stream:
        self.call("current_stream")
        return _Stream(self, self.current.cuda_stream)  # a new object per call, as torch's

    def lookup(self, index: int) -> tuple[int, int, int]:
        self.call("getCurrentStream")
        return (self.current.stream_id, index, 1)

    def stream(self, device=None, priority=0, stream_id=None, device_index=None, device_type=None) -> _Stream:
        self.call("Stream()")
        if stream_id is not None:  # an object for an existing stream, as current_stream() makes
            return _Stream(self, stream_id)
        self.made.append(self.new_stream())
        return self.made[-1]

    def joined(self, stream: int) -> list[int]:
        """The streams whose work ``stream`` was made to wait for, in order (by an event recorded there)."""
        return [on for kind, waiter, *rest in self.log if kind == "wait" and waiter == stream for on in rest[1:]]


class _Tensor:
    def record_stream(self, stream) -> None:
        self.held_for = stream


@pytest.mark.parametrize("fast", [True, False], ids=["current-stream-by-id", "current_stream"])
def test_cuda_runtime_issues_on_its_own_stream_after_the_current_one(monkeypatch, fast):
    """The real CUDA seam, with torch.cuda's stream and event objects stood in for: catches ops issued on torch's
    current stream (no overlap), a communication stream that does not wait for the current one (inputs read before
    they are written), one that waits for a stale current stream after ``torch.cuda.stream(...)`` switched it (the
    seam keeps one object per stream it met), completion events recorded on the wrong stream (Work.wait() would not
    wait for the op), a wait that blocks the host or a stale stream instead of the current one, a ``record_stream``
    per tensor coming back (the backend keeps an op's tensors referenced instead), and an event given back to the
    pool that is not recorded again. Both with torch's C lookup of the current stream and without it."""
    cuda = _Cuda(monkeypatch, fast)
    first = cuda.current.cuda_stream
    rt = CudaRuntime(0, "world", 0)
    comm = rt.stream()
    assert rt.stream() == comm and len(cuda.made) == 1 and comm == cuda.made[0].cuda_stream != first
    assert cuda.joined(comm) == [first, first]  # one stream, made to wait for the current one per op
    event = rt.record()
    assert event.on == comm
    rt.wait(event)
    assert cuda.joined(first) == [comm]
    cuda.current = cuda.new_stream()  # torch.cuda.stream(other): the next op joins it, and waits land on it
    rt.stream()
    assert cuda.joined(comm) == [first, first, cuda.current.cuda_stream]
    rt.wait(event)
    assert cuda.joined(cuda.current.cuda_stream) == [comm] and cuda.joined(first) == [comm]
    tensor = _Tensor()
    rt.hold([tensor])
    assert not hasattr(tensor, "held_for")
    rt.recycle(event)
    again = rt.record()
    assert again is event and again.on == comm  # the pooled event, recorded again on the communication stream
    assert rt.record() is not event  # the pool is empty again: a new one


class _CudaOnCpuTensors(CudaRuntime):
    """The real CUDA seam (over :class:`_Cuda`'s stand-ins) for a backend whose tensors are the CPU tier's."""

    def __init__(self, device, group: str, rank: int):
        super().__init__(0, group, rank)
        self.device = torch.device("cpu")


PER_OP = {  # host calls into torch.cuda per planned all-reduce (start, then Work.wait), steady state, and why
    "getCurrentStream": 2,  # torch's current stream, looked up by id at the start (to join it) and at the wait
    "Event.record": 2,  # the hand-over event on the current stream; the op's pooled event after it
    "Event.wait": 2,  # the communication stream waits for the hand-over; the current stream for the op's event
}


def _planned_ops(comm, cuda: _Cuda, ops: int) -> collections.Counter:
    """``ops`` starts and waits of a planned all-reduce after as many for warm-up: the calls they made."""
    x = torch.ones(4)
    plan = comm.plan_all_reduce(x)
    # The warm-up: the streams made, and ``ops`` events, all in flight before the first wait (an op's event is given
    # back only once it was waited for and retired), so none is reused during it however late the watchdog runs:
    # the pool then holds one event per op of the measured burst.
    works = [plan.start() for _ in range(ops)]
    for work in works:
        work.wait()
    deadline = time.monotonic() + 30
    while comm._inflight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not comm._inflight, "the watchdog never retired the warm-up's ops"
    cuda.calls.clear()
    for _ in range(ops):
        plan.start().wait()
    return collections.Counter(cuda.calls)  # not shutdown's calls


def test_a_planned_collective_makes_the_fewest_cuda_calls(monkeypatch):
    """Counts the host's calls into torch.cuda per steady-state planned all-reduce (what each bucket of every step
    takes) through the real CUDA seam, as tests/test_host_budget.py counts checks and allocations: catches a
    ``torch.cuda.current_stream()`` (a new Stream object per call), a ``Stream.wait_stream`` (a new Event, so a
    cudaEventCreate and a cudaEventDestroy, per op), an event created per op instead of taken from the pool (also by
    a pool smaller than a burst of ops within one watchdog period), or any other call added to the path. On an H200's
    host such calls had the planned all-reduce cost 19.0 us per start and wait against 8.3 us for the raw CuPy call
    with torch's hand-over; 8.0 us with these (benchmarks/host_overhead.py's cuda rows, 2026-11-28)."""
    fake, ops = FakeNccl(), 200  # as many as the cuda rows of benchmarks/host_overhead.py issue back to back
    cuda = _Cuda(monkeypatch)
    with installed(fake, _CudaOnCpuTensors):
        comm = solo(fake, validate=False)
        try:
            calls = _planned_ops(comm, cuda, ops)
        finally:
            comm.shutdown()
    per_op = {name: n / ops for name, n in calls.items()}
    assert per_op == PER_OP, f"torch.cuda calls per planned all-reduce: {per_op}, expected {PER_OP}"
    assert fake.calls["allReduce"] == 2 * ops and set(fake.streams) == {cuda.made[0].cuda_stream}


def _steady_events(comm, steps: int = 3) -> dict:
    """DDP steps over the simulated device; after each, the watchdog's look at the ops in flight (as its thread does
    every 50 ms) and the tensors the backend still keeps for ops."""
    import weakref

    config = gpudist.ShardingConfiguration(comm, bucket_cap_mb=0.0001, first_bucket_mb=0.00002)
    model = gpudist.DDPModel(gpu_net(comm.device), config)
    opt = gpudist.DDPOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), config)
    made, kept = [], []
    for step in range(steps):
        x, y = gpu_batch(step, comm.device, comm.rank, comm.world_size)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        assert comm._poll() is None
        made.append(comm._rt.events_made)
        kept.append(sum(e.tensors is not None for e in comm._inflight))
    scratch = torch.ones(8, device=comm.device)
    work = comm.all_reduce(scratch, async_op=True)
    ref = weakref.ref(scratch)
    del scratch
    held_until_wait = ref() is not None
    work.wait()
    comm._poll()
    return {"made": made, "kept": kept, "held_until_wait": held_until_wait, "freed": ref() is None}


def test_steady_steps_reuse_events_and_let_tensors_go_once_waited():
    """Catches a CUDA event created (and destroyed) per collective in a steady-state step (host microseconds per op,
    what the event pool saves), an event given back while an op or a Work could still read it (the simulation
    raises on any read of a pooled event), tensors dropped before the op was waited for (their memory could be
    reused while NCCL reads it) and tensors kept after it (memory held past its op)."""
    results = run_nccl(_steady_events, 2, FakeNccl(), runtime=AsyncRuntime)
    for r in results:
        first, *rest = r["made"]
        assert first > 0 and all(m == first for m in rest), r["made"]
        assert r["kept"] == [0, 0, 0]
        assert r["held_until_wait"] and r["freed"]


@pytest.mark.parametrize("strategy", list(GPU_PAIRS))
def test_every_strategy_communicates_on_the_communication_stream(strategy):
    """Catches a strategy path that reaches NCCL some other way than the backend's ops (all of its calls must be on
    the communication stream, where they overlap the compute enqueued after them)."""
    fake = FakeNccl()
    run_nccl(gpu_train, 2, fake, strategy=strategy)
    assert set(fake.streams) == {HostRuntime.COMM_STREAM}


def _steady_steps(comm, strategy, nccl, gate, seen, steps=3):
    """``steps`` training steps of ``strategy``; the NCCL calls (all ranks) and this rank's consistency checks of the
    steps after the first (steady state), counted between thread barriers that issue no NCCL call."""
    config = gpudist.ShardingConfiguration(comm, bucket_cap_mb=0.0001, first_bucket_mb=0.00002)
    model_cls, opt_cls = GPU_PAIRS[strategy]
    model = model_cls(gpu_net(comm.device), config)
    opt = opt_cls(torch.optim.Adam(model.parameters(), lr=1e-2), config)
    for step in range(steps):
        if step == 1:
            gate.wait()
            if comm.rank == 0:
                seen.update(nccl.calls)
            gate.wait()
            checks = comm.stats.check_calls
        x, y = gpu_batch(step, comm.device, comm.rank, comm.world_size)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    gate.wait()
    calls = {k: (v - seen.get(k, 0)) / (steps - 1) for k, v in nccl.calls.items() if v != seen.get(k, 0)}
    return {"checks": comm.stats.check_calls - checks, "calls_per_step": calls}


@pytest.mark.parametrize("strategy", list(GPU_PAIRS))
def test_steady_state_steps_make_no_consistency_check_over_nccl(strategy):
    """Catches a per-step collective left to the cross-rank signature check: on NCCL each check is one more
    all-gather and a device-to-host copy, a host sync per op (ZeRO-3 made 10 per step on this model). Layouts are
    checked once, when the model is wrapped (its fingerprint), and the steps' ops agree by construction."""
    fake, world = FakeNccl(), 2
    results = run_nccl(_steady_steps, world, fake, strategy=strategy, nccl=fake, gate=threading.Barrier(world), seen={})
    assert [r["checks"] for r in results] == [0] * world


def test_zero1_sends_its_update_in_one_collective_over_nccl():
    """Catches ZeRO-1's update sent as chunked per-rank broadcasts on NCCL (written to overlap the update with the
    sends on Gloo, whose ops progress on their own threads; NCCL ops queue behind the update on its stream, so the
    chunks only multiply launches: 16 broadcasts per step at 2 ranks). One all-gather per rank and step instead."""
    fake, world = FakeNccl(), 2
    results = run_nccl(_steady_steps, world, fake, strategy="zero1", nccl=fake, gate=threading.Barrier(world), seen={})
    calls = results[0]["calls_per_step"]
    assert "broadcast" not in calls, calls
    assert calls["allGather"] == world, calls  # the parameters' all-gather, one call on each rank


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "fsdp"])
def test_uneven_models_make_one_collective_per_bucket_or_unit_over_nccl(strategy, world):
    """Catches a shard that is not padded to the same size on every rank: NCCL has no uneven reduce-scatter or
    all-gather, so the backend turns one into a reduce or broadcast per rank (a ZeRO-3 step at 4 ranks issued 112
    reduces and 224 broadcasts). Every bucket and unit here is uneven (layers of 9x33, 33, 33x17, ... elements, tiny
    buckets), so each must be padded for its collective to be one call: no reduce or broadcast in a steady step."""
    fake = FakeNccl()
    results = run_nccl(_steady_steps, world, fake, strategy=strategy, nccl=fake, gate=threading.Barrier(world), seen={})
    calls = results[0]["calls_per_step"]
    assert "reduce" not in calls and "broadcast" not in calls, calls
    assert calls.get("reduceScatter", 0) > 0 or strategy == "zero1", calls  # ZeRO-1's model all-reduces
    assert calls["allGather"] % world == 0, calls


@pytest.mark.parametrize("views", [False, True])
def test_ddp_folds_the_average_into_a_pass_it_makes_anyway(views):
    """DDP packs gradients into its buckets unless they are bucket views: the 1/N rides on that pack and the wire
    is SUMmed, so no NCCL (with or without ncclAvg) pays a separate scaling pass; views have no pass and ask for
    AVERAGE (ncclAvg here). Catches the pack path asking for AVERAGE, and a scale applied twice or not at all."""
    fake = FakeNccl(version=21003)
    expected = reference_pair(gpu_reference, "cpu")
    for params in run_nccl(gpu_train, 2, fake, strategy="ddp", gradient_as_bucket_view=views):
        assert_matches_reference(params, *expected)
    averaged = fake.reductions[fake.NCCL_AVG]
    assert (averaged >= 2 * GPU_STEPS) if views else averaged == 0, dict(fake.reductions)


@pytest.mark.parametrize(
    ("world", "micro", "schedule"), [(2, 4, "1f1b"), (3, 4, "1f1b"), (4, 8, "1f1b"), (3, 4, "gpipe"), (4, 2, "1f1b")]
)
def test_pipeline_over_nccl_matches_one_process(world, micro, schedule):
    """Pipeline stages over NCCL's in-order p2p: each receive posted when needed, grouped with the sends before
    it. Catches the deadlock of receives posted ahead (they stall the stream; the simulated NCCL reports it as
    a hang) and shape/loss messages kept in host memory (NCCL sends device memory only)."""
    want = reference_pair(pipeline_reference)
    for params, losses, _, _ in run_nccl(pipeline_train, world, FakeNccl(timeout=20), micro=micro, schedule=schedule):
        check_training(params, losses, want)


@pytest.mark.parametrize(("stages", "micro"), [(3, 2), (2, 1)])
def test_pipeline_with_changing_shapes_over_nccl(stages, micro):
    """Batches of 16, 8, 8, 24 samples with predict() in between. Catches the ordered path expecting the dummy
    message that only the speculative (posted-ahead) path sends, or a predict() shape message left in host memory."""
    want = reference_pair(pipeline_reference, steps=4, batch=varying_batch)
    for params, losses in run_nccl(pipeline_train_varying, stages, FakeNccl(timeout=20), stages=stages, micro=micro):
        check_training(params, losses, want)


def test_tensor_parallel_over_nccl_matches_one_process():
    """Tensor-parallel TinyLM (column/row/vocab layers, vocabulary-parallel loss) on 2 NCCL ranks."""
    x, y = tp_lm_batch()
    (losses32, params32), (losses64, params64) = reference_pair(tp_single_process_lm, "adamw")
    for r in run_nccl(tp_train_lm, 2, FakeNccl(), tp=2, opt_name="adamw", x=x, y=y):
        assert_matches_reference(r["params"], params32, params64, what="parameters")
        assert_matches_reference(r["losses"], losses32, losses64, what="losses")


def test_3d_hybrid_over_nccl_matches_one_process():
    """pp=2 x dp=2 x tp=2 with ZeRO-2 on 8 NCCL ranks: pipeline p2p groups, tensor all-reduces and sharded
    data-parallel steps on nested NCCL sub-communicators."""
    hybrid_check(run_nccl(hybrid_train, 8, FakeNccl(timeout=30), zero_stage=2, kind="adamw"), "adamw", 8)


@pytest.mark.parametrize("name", ["topk", "int8", "1bit"])
def test_compressed_collectives_over_nccl(name):
    """The compression channels' all-gathers of packed payloads and scales over NCCL: lossless codecs equal the
    plain all-reduce, and with a lossy codec error feedback conserves the gradient sum (applied + pending)."""
    from gpudist.compression import IdentityCompressor, TopKCompressor

    for compressor in (IdentityCompressor(), TopKCompressor(1.0)):
        for results in run_nccl(lossless_vs_plain, 3, FakeNccl(), compressor=compressor, n=1001):
            assert_lossless(results, 3)
    for applied, pending, true, bound in run_nccl(conservation, 3, FakeNccl(), compressor=LOSSY[name], n=5000):
        torch.testing.assert_close(applied + pending, true, rtol=0, atol=bound)


@pytest.mark.parametrize(("strategy", "world", "pp"), [("zero3", 2, 1), ("pipeline", 2, 2)])
def test_example_script_over_nccl_trains_like_ddp(tmp_path, strategy, world, pp):
    """examples/train.py's ``train(comm, cfg)`` on NCCL ranks: its loss window, final loss average and replica
    check go through the backend too. Same per-step losses as DDP on in-memory ranks."""
    import json

    def cfg(name, **kw):
        return train.TrainConfig(
            steps=4, global_batch=8, log_every=2, d_model=32, seq_len=16, out=str(tmp_path / name), **kw
        )

    run_ranks(train.train, 2, "inmemory", cfg=cfg("ddp"))
    run_nccl(train.train, world, FakeNccl(), cfg=cfg(strategy, strategy=strategy, pp=pp, micro_batches=2))
    ddp, other = (json.loads((tmp_path / n / "metrics.json").read_text()) for n in ("ddp", strategy))
    losses32, losses64 = script_losses(steps=4, global_batch=8, d_model=32, seq_len=16)
    assert_losses_match(ddp["loss"], losses32, losses64, what="ddp")
    assert_losses_match(other["loss"], losses32, losses64, what=strategy)
    assert other["replicas_identical"] and other["comm_stats"]


def test_nccl_is_marked_ordered_and_cpu_backends_are_not():
    """The pipeline relies on this flag to choose between receives posted ahead and grouped in-order receives."""
    assert NCCLCommunicationBackend.ordered_p2p is True
    assert gpudist.InMemoryCommunicationBackend.ordered_p2p is False


def _bench_rank(comm) -> tuple[list[dict], dict]:
    from gpudist.bench import collectives as bench

    rows = bench.sweep(comm, min_bytes=256, max_bytes=1024, rounds=1, target_seconds=1e-4)
    n, r = comm.world_size, comm.rank
    full = torch.arange(10 * n, dtype=torch.float32) * (r + 1)
    ours = {
        "all_reduce": lambda i, o: comm.all_reduce(i),
        "reduce_scatter": comm.reduce_scatter,
        "all_gather": comm.all_gather,
    }
    same = {}
    for op, inp, out_numel in (
        ("all_reduce", full, 10 * n),
        ("reduce_scatter", full, 10),
        ("all_gather", full[10 * r : 10 * (r + 1)], 10 * n),
    ):
        outs = []
        for call in (ours[op], lambda i, o, op=op: bench._raw_call(comm, op, i, o)()):
            i = inp.clone()
            o = i if op == "all_reduce" else torch.empty(out_numel)
            call(i, o)
            outs.append(o)
        same[op] = torch.equal(*outs)
    return rows, same


def test_collectives_benchmark_runs_over_nccl():
    """``gpudist bench collectives --backend nccl``'s per-rank sweep over the simulated NCCL: gpudist, its
    unchecked variant and the raw ``cupy.cuda.nccl`` baseline each run, on the backend's stream, and the baseline
    computes the same values. Catches a baseline call with wrong arguments (it would fail or sum other data, and
    every ratio in the committed JSON would be meaningless) and a bench path that assumes a CUDA device."""
    fake = FakeNccl()
    for rows, same in run_nccl(_bench_rank, 2, fake):
        assert {r["op"] for r in rows} == {"all_reduce", "reduce_scatter", "all_gather"} and len(rows) == 6
        assert all(r["baseline_s"] > 0 and r["gpudist_nocheck_s"] > 0 for r in rows)
        assert same == {"all_reduce": True, "reduce_scatter": True, "all_gather": True}


def test_collectives_benchmark_refuses_more_ranks_than_gpus(monkeypatch):
    """Catches the NCCL benchmark spawning ranks that each die in ncclCommInitRank with two on one GPU: it names
    the world size, the GPU count and the NCCL_MULTI_RANK_GPU_ENABLE way out instead."""
    from gpudist.bench import collectives as bench

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("NCCL_MULTI_RANK_GPU_ENABLE", raising=False)
    with (
        installed(FakeNccl(version=23003)),
        pytest.raises(
            SystemExit,
            match=r"--world-size 2 needs 2 GPUs.*has 1"
            r".*NCCL_MULTI_RANK_GPU_ENABLE=1",
        ),
    ):
        bench._check_gpus(2)
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    bench._check_gpus(2)


def test_simulation_matches_the_installed_cupy():
    """Where CuPy with libnccl is installed (a GPU machine, or any machine with the cuda extra: CuPy imports
    without a GPU), the simulation's names and argument lists must be CuPy's, and the id form gpudist passes must
    get past CuPy's argument checks into NCCL. Catches the simulation drifting from CuPy, which would let the
    CPU tier pass code that fails on the real library (as the id's bytes/tuple change in CuPy 14 did)."""
    import inspect

    real = pytest.importorskip("cupy.cuda.nccl", reason="CuPy is not installed (pip install 'gpudist[cuda13]')")
    if not real.available:
        pytest.skip("CuPy is installed without libnccl")
    fake = FakeNccl()
    own = {"abort_all", "available", "calls", "cupy_version", "reductions", "timeout", "version"}
    for name in sorted(n for n in dir(fake) if not n.startswith("_") and n not in own):
        assert hasattr(real, name), f"cupy.cuda.nccl has no {name}"
    for name in sorted(n for n in dir(fake.NcclCommunicator) if not n.startswith("_")):
        member = getattr(real.NcclCommunicator, name, None)
        assert member is not None, f"cupy's NcclCommunicator has no {name}"
        doc = (member.__doc__ or "").strip().splitlines()
        if callable(getattr(fake.NcclCommunicator, name)) and doc and doc[0].startswith(f"NcclCommunicator.{name}("):
            theirs = [p.split()[-1].split("=")[0] for p in doc[0].split("(", 1)[1].rstrip(")").split(", ")]
            ours = list(inspect.signature(getattr(fake.NcclCommunicator, name)).parameters)
            assert ours == theirs, f"{name}: simulated {ours}, CuPy {theirs}"
    from gpudist.comm import nccl

    try:  # without a GPU, NCCL itself refuses (NcclError, a RuntimeError); CuPy's own checks raise TypeError
        nccl._communicator(real, 1, NCCLCommunicationBackend.unique_id(), 0).destroy()
    except RuntimeError as e:
        assert not torch.cuda.is_available(), e
