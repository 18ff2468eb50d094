"""Bad input, cross-rank mismatches, timeouts and dead peers: clear errors, in seconds, never a hang or abort."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import pytest
import torch

from gpudist.comm import (
    CollectiveMismatchError,
    CommunicationError,
    CommunicationTimeoutError,
    GlooCommunicationBackend,
    InMemoryCommunicationBackend,
    ReductionOperation,
)
from gpudist.testing import RanksFailedError, free_port, run_ranks

from .backends import ALL as BACKENDS
from .backends import ALL_FAST_INMEMORY

SHORT = 2.0  # per-op timeout for the timeout cases, seconds
NO_HANG = 30.0  # a failure must surface well within this (the timeout is SHORT)


def solo() -> InMemoryCommunicationBackend:
    return InMemoryCommunicationBackend(0, 1, group=f"solo-{uuid.uuid4().hex}")


def _local_errors(comm) -> list[str]:
    """Every bad call raises before anything is sent; returns the messages and checks nothing was counted."""
    bad_calls = [
        lambda: comm.all_reduce(torch.ones(4, 4).t()),  # not contiguous
        lambda: comm.all_reduce(torch.ones(3, device="meta")),  # wrong device
        lambda: comm.all_reduce(torch.ones(3, dtype=torch.complex64)),  # unsupported dtype
        lambda: comm.all_reduce(torch.ones(3, dtype=torch.int64), "average"),  # AVERAGE of ints
        lambda: comm.all_reduce(torch.ones(3), "median"),  # unknown reduction
        lambda: comm.send(torch.ones(3), 5),  # rank out of range
        lambda: comm.send(torch.ones(3), comm.rank),  # to itself
        lambda: comm.broadcast(torch.ones(3), src=-1),
        lambda: comm.reduce_scatter(torch.ones(10), torch.ones(10)),  # out not the rank's share
        lambda: comm.all_gather(torch.ones(3), torch.ones(10)),  # inp not the rank's share
        lambda: comm.all_gather(torch.ones(5), torch.ones(10, dtype=torch.float64)),  # dtypes differ
        lambda: comm.all_to_all(torch.ones(5), torch.ones(5)),  # not divisible by world size
        lambda: comm.all_reduce([1.0, 2.0]),  # not a tensor
        lambda: comm.new_group([0, 0]),
    ]
    messages = []
    for call in bad_calls:
        with pytest.raises((ValueError, TypeError)) as info:
            call()
        messages.append(str(info.value))
    assert comm.stats.total_calls == 0 and comm.stats.check_calls == 0, "an invalid call reached the transport"
    comm.all_reduce(torch.ones(2))  # and the group is still fine
    return messages


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_is_rejected_before_sending(backend):
    """Catches validation that runs after the transport started (which Gloo answers with SIGABRT) and errors that
    do not say what is wrong and how to fix it."""
    messages = run_ranks(_local_errors, 2, backend)[0]
    expected_fragments = [
        "contiguous",
        "meta",
        "complex64",
        "AVERAGE",
        "median",
        "dst=5 is out of range",
        "itself",
        "src=-1",
        "split_sizes",
        "split_sizes",
        "same dtype",
        "divisible",
        "torch.Tensor",
        "duplicates",
    ]
    for message, fragment in zip(messages, expected_fragments, strict=True):
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_cuda_tensor_error_names_the_fix():
    """The wrong-device message names the device and the way out (move to CPU or use NCCL)."""
    comm = solo()
    fake_cuda = torch.empty(2, device="meta")
    with pytest.raises(ValueError, match=r"meta.*cpu"):
        comm.all_reduce(fake_cuda)
    if torch.cuda.is_available():  # pragma: no cover - GPU tier
        with pytest.raises(ValueError, match="NCCLCommunicationBackend"):
            comm.all_reduce(torch.ones(2, device="cuda"))


# -- mismatches ------------------------------------------------------------------------------------------------------

MISMATCHES = {
    "shape": lambda c: c.all_reduce(torch.ones(4 + (c.rank == 1))),
    "dtype": lambda c: c.all_reduce(torch.ones(4, dtype=torch.float64 if c.rank == 1 else torch.float32)),
    "op": lambda c: (
        c.all_gather(torch.ones(2), torch.ones(2 * c.world_size))
        if c.rank == 1
        else c.all_reduce(torch.ones(2 * c.world_size))
    ),
    "reduction": lambda c: c.all_reduce(torch.ones(3), "max" if c.rank == 1 else "sum"),
    "root": lambda c: c.broadcast(torch.ones(3), src=1 if c.rank == 1 else 0),
    # more dimensions than the signature holds (8): the tail is folded into a hash, which must still tell them apart
    "shape_10d": lambda c: c.all_reduce(torch.ones([1] * 9 + [2 + (c.rank == 1)])),
}


def _mismatch(comm, kind: str) -> dict:
    try:
        MISMATCHES[kind](comm)
        raised = None
    except CollectiveMismatchError as e:
        raised = str(e)
    t = torch.ones(3)
    comm.all_reduce(t)  # nothing was sent, so the group is still usable
    return {"error": raised, "after": t.tolist(), "healthy": comm.healthy}


def _mismatch_cases() -> list:
    """Every kind on every backend; on MPI (an mpirun each, seconds) only ``shape`` in the default tier, the other
    kinds in the slow tier: the signature check above the transport is the same code for each kind."""
    cases = []
    for backend in BACKENDS:
        for kind in MISMATCHES:
            name = getattr(backend, "values", (backend,))[0]
            marks = getattr(backend, "marks", ())
            if name == "mpi" and kind != "shape":
                marks = (*marks, pytest.mark.slow)
            cases.append(pytest.param(name, kind, marks=marks, id=f"{name}-{kind}"))
    return cases


@pytest.mark.faults
@pytest.mark.parametrize(("backend", "kind"), _mismatch_cases())
def test_mismatch_raises_on_every_rank(backend, kind):
    """All three ranks raise, naming the op and rank 1 (the one that differed), and the group stays usable.
    Catches the Gloo SIGABRT on size/dtype mismatch, and errors raised on only some ranks (the rest would hang)."""
    results = run_ranks(_mismatch, 3, backend, kind=kind)
    for rank, res in enumerate(results):
        assert res["error"] is not None, f"rank {rank} did not raise"
        assert "mismatch" in res["error"] and "rank 1 called" in res["error"], res["error"]
        assert f"raised on rank {rank}" in res["error"]
        assert res["after"] == [3.0, 3.0, 3.0] and res["healthy"]


def _p2p_mismatch(comm) -> dict:
    try:
        if comm.rank == 0:
            comm.send(torch.ones(5), 1)
        else:
            comm.recv(torch.zeros(4), 0)
        error = None
    except CollectiveMismatchError as e:
        error = str(e)
    ok = torch.zeros(2)  # the pair still works afterwards
    if comm.rank == 0:
        comm.send(torch.full((2,), 7.0), 1)
    else:
        comm.recv(ok, 0)
    return {"error": error, "ok": ok.tolist()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_send_recv_mismatch_raises_on_both_sides(backend):
    """A recv buffer of another size than the send raises on sender and receiver. Catches Gloo's silent short
    receive (recv larger than send) and its abort (recv smaller than send)."""
    sender, receiver = run_ranks(_p2p_mismatch, 2, backend)
    for res in (sender, receiver):
        assert res["error"] is not None and "rank 0 sent shape=(5,)" in res["error"]
        assert "rank 1 posted recv(shape=(4,)" in res["error"]
    assert receiver["ok"] == [7.0, 7.0]


# -- timeouts, missing and dead ranks --------------------------------------------------------------------------------


def _absent_rank(comm) -> dict:
    if comm.rank == comm.world_size - 1:
        return {"skipped": True}
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(3))
        return {"error": None}
    except CommunicationTimeoutError as e:
        error = str(e)
    elapsed = time.monotonic() - start
    try:  # the group is now unusable and says so at once
        comm.all_reduce(torch.ones(3))
        again = None
    except CommunicationError as e:
        again = str(e)
    return {"error": error, "elapsed": elapsed, "again": again, "healthy": comm.healthy}


@pytest.mark.faults
def test_ten_dimensional_shapes_that_agree_pass_the_check():
    """Two ranks with the same 10-dimensional shape are not a mismatch (the folded tail hashes alike in every
    process), and the op runs. Catches a fold that breaks the equal case while fixing the unequal one."""
    for backend in ("inmemory", "gloo"):
        assert run_ranks(_ten_dims_sum, 2, backend) == [6.0, 6.0]


def _ten_dims_sum(comm) -> float:
    t = torch.ones([1] * 9 + [3])
    comm.all_reduce(t)
    return t.sum().item()


@pytest.mark.faults
def test_gloo_application_timeout_is_a_timeout():
    """Gloo's "Application timeout caused pair closure" (what a peer sees when a pair's wait gave up) is classed
    as CommunicationTimeoutError, like Gloo's other timeout wordings; a closed connection stays a plain
    CommunicationError. Catches the classification that matched only "Timed out"/"timed out"/"Timeout"."""
    comm = GlooCommunicationBackend.__new__(GlooCommunicationBackend)  # _translate needs no process group
    comm.rank, comm.world_size, comm.group, comm.timeout = 0, 2, "g", SHORT
    error = comm._translate(
        RuntimeError("[../gloo/transport/tcp/pair.cc:598] Application timeout caused pair closure"), "all_reduce"
    )
    assert type(error) is CommunicationTimeoutError and "timed out after 2s" in str(error)
    error = comm._translate(RuntimeError("[pair.cc:534] Connection closed by peer [127.0.0.1]:1234"), "all_reduce")
    assert type(error) is CommunicationError and "closed its connection" in str(error)


@pytest.mark.faults
@pytest.mark.parametrize("backend", ALL_FAST_INMEMORY)
def test_rank_that_never_calls_times_out(backend):
    """Two ranks call all_reduce, the third never does: both raise CommunicationTimeoutError within the timeout,
    naming op, group and rank, and later ops fail at once. Catches collectives that wait forever."""
    results = run_ranks(_absent_rank, 3, backend, timeout=SHORT)
    for rank, res in enumerate(results[:2]):
        assert res["error"] is not None, f"rank {rank} returned from an all_reduce that rank 2 never joined"
        assert "all_reduce" in res["error"] and f"rank {rank}" in res["error"] and "group '" in res["error"]
        assert SHORT * 0.5 <= res["elapsed"] < NO_HANG
        assert "unusable" in res["again"] and not res["healthy"]
    if backend == "inmemory":
        assert "ranks [2]" in results[0]["error"]  # the in-memory backend knows exactly who is missing


@pytest.mark.faults
def test_inmemory_rank_that_never_joins():
    """Only 2 of 3 ranks construct their backend; the others raise naming the absent rank within the timeout."""
    group, errors = f"never-{uuid.uuid4().hex}", {}

    def rank_main(rank):
        comm = InMemoryCommunicationBackend(rank, 3, group=group, timeout=SHORT)
        try:
            comm.barrier()
        except CommunicationTimeoutError as e:
            errors[rank] = str(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(NO_HANG)
    assert time.monotonic() - start < NO_HANG
    assert sorted(errors) == [0, 1] and all("ranks [2]" in e and "barrier" in e for e in errors.values())
    # The failed formation does not poison the name: a new world with the same name forms and works.
    res = []
    threads = [
        threading.Thread(
            target=lambda r=r: res.append(InMemoryCommunicationBackend(r, 2, group=group, timeout=SHORT).barrier())
        )
        for r in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(NO_HANG)
    assert len(res) == 2


@pytest.mark.faults
def test_gloo_rank_that_never_joins():
    """Rank 0 of a 2-rank Gloo job whose rank 1 never starts raises CommunicationTimeoutError within the join
    timeout. Catches a rendezvous that waits forever."""
    start = time.monotonic()
    with pytest.raises(CommunicationTimeoutError, match=r"never joined"):
        GlooCommunicationBackend.create(0, 2, "127.0.0.1", free_port(), timeout=SHORT, connect_timeout=SHORT)
    assert time.monotonic() - start < NO_HANG
    with pytest.raises(ValueError, match="connect_timeout must be a positive"):
        GlooCommunicationBackend.create(0, 2, "127.0.0.1", free_port(), connect_timeout=0)


class _SlowToUnpickle:
    """Unpickles ``delay`` seconds late in the worker named ``gpudist-rank{rank}`` (a slow import of a test module on
    a loaded machine), at once elsewhere."""

    def __init__(self, rank: int, delay: float):
        self.rank, self.delay = rank, delay

    def __reduce__(self):
        return _arrive_late, (self.rank, self.delay)


def _arrive_late(rank: int, delay: float) -> _SlowToUnpickle:
    import multiprocessing

    if multiprocessing.current_process().name == f"gpudist-rank{rank}":
        time.sleep(delay)
    return _SlowToUnpickle(rank, delay)


def _sum_after_late_start(comm, late) -> float:
    return _sum_ranks(comm)


def test_slow_start_of_one_rank_does_not_use_up_the_op_timeout():
    """Rank 1 takes longer than the op timeout to unpickle its function; the call still succeeds, because the pool
    starts a function on all ranks together and the op timeout counts from there. Catches the harness timing a
    peer's start-up (module imports on a loaded machine) against the op timeout, which failed
    test_rank_that_never_calls_times_out on a loaded host."""
    assert run_ranks(_sum_after_late_start, 2, "gloo", timeout=SHORT, late=_SlowToUnpickle(1, SHORT * 2)) == [1, 1]


def _one_rank_dies(comm) -> dict:
    comm.barrier()
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(1000))
        return {"error": None}
    except CommunicationError as e:
        return {"error": str(e), "type": type(e).__name__, "elapsed": time.monotonic() - start}


@pytest.mark.faults
def test_killed_gloo_rank():
    """Rank 1 is SIGKILLed; rank 0's next all_reduce raises CommunicationError (not a hang, not an abort) and the
    harness reports rank 1's death. Uses a long op timeout to show the error comes from the dead socket, not the
    clock."""
    with pytest.raises(RanksFailedError) as info:
        run_ranks(_one_rank_dies, 2, "gloo", timeout=120.0)
    failures, results = info.value.failures, info.value.results
    assert list(failures) == [1] and "killed by signal 9" in failures[1]
    assert results[0]["error"] is not None and "all_reduce" in results[0]["error"], results[0]
    assert results[0]["elapsed"] < NO_HANG
    # The harness replaces the broken pool: the next call works.
    assert run_ranks(_sum_ranks, 2, "gloo", timeout=120.0) == [1.0, 1.0]


def _sum_ranks(comm) -> float:
    t = torch.tensor([float(comm.rank)])
    comm.all_reduce(t)
    return t.item()


def _raise_on_rank_2(comm):
    if comm.rank == 2:
        raise KeyError("boom on rank 2")
    comm.all_reduce(torch.ones(2))


@pytest.mark.faults
@pytest.mark.parametrize("backend", ALL_FAST_INMEMORY)
def test_exception_on_one_rank_fails_run_ranks_with_its_traceback(backend):
    """The root cause (rank 2's KeyError) is reported first, with its traceback; the other ranks are released
    instead of waiting out the timeout."""
    start = time.monotonic()
    with pytest.raises(RanksFailedError) as info:
        run_ranks(_raise_on_rank_2, 3, backend, timeout=60.0 if backend == "inmemory" else SHORT)
    message = str(info.value)
    assert 2 in info.value.failures and "KeyError: 'boom on rank 2'" in info.value.failures[2]
    assert message.index("--- rank 2 ---") < min(message.find(f"--- rank {r} ---") % len(message) for r in (0, 1))
    assert time.monotonic() - start < NO_HANG


def test_a_rank_that_aborts_before_the_others_join_still_releases_them():
    """The race behind a once-flaky run of the test above: rank 2 formed its side of the group and aborted before
    ranks 0 and 1 had joined. Catches the late ranks taking the broken group for a failed formation and forming a
    new one without rank 2 (then they wait for it until their timeout): they must join the aborted group and fail
    at their first op, naming the abort."""
    import uuid

    from gpudist.comm.inmemory import InMemoryCommunicationBackend

    name = f"abort-before-join-{uuid.uuid4().hex[:8]}"
    InMemoryCommunicationBackend(2, 3, name, 600.0).abort("KeyError: boom on rank 2")
    errors = []

    def late(rank: int) -> None:
        comm = InMemoryCommunicationBackend(rank, 3, name, 600.0)
        try:
            comm.all_reduce(torch.ones(2))
        except CommunicationError as e:
            errors.append(e)

    threads = [threading.Thread(target=late, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "the late ranks wait for rank 2 (their 600 s timeout)"
    assert len(errors) == 2 and all("rank 2 aborted" in str(e) and "boom" in str(e) for e in errors), errors


def _raise_after_forming_subgroups(comm):
    world = comm.new_group(list(range(comm.world_size)))
    inner = world.new_group([2, 1, 0])  # a group of a group
    if comm.rank == 0:
        raise ValueError("optimizer got an empty parameter list")  # what a parameter-free pipeline stage's user saw
    inner.all_reduce(torch.ones(2))  # waits for rank 0, which left


@pytest.mark.faults
def test_a_rank_that_raises_releases_the_others_waiting_in_subgroups():
    """Catches the harness aborting only the world group: ranks waiting in a group new_group made (a pipeline's, a
    data-parallel one) waited out the whole 60 s timeout, and then reported a timeout, not the root cause. Here the
    others fail at once with the abort naming rank 0's error."""
    start = time.monotonic()
    with pytest.raises(RanksFailedError) as info:
        run_ranks(_raise_after_forming_subgroups, 3, "inmemory", timeout=60.0)
    failures = info.value.failures
    assert "empty parameter list" in failures[0]
    for r in (1, 2):
        assert "rank 0 aborted the group: ValueError: optimizer got an empty parameter list" in failures[r]
        assert "CommunicationTimeoutError" not in failures[r]
    assert time.monotonic() - start < NO_HANG


def _backward_thread(comm):
    x = torch.ones(3, requires_grad=True)
    seen = []
    x.register_hook(lambda g: seen.append(threading.get_ident()))
    (x * 2).sum().backward()
    return torch.autograd.is_multithreading_enabled(), seen == [threading.get_ident()], comm.device


def test_run_ranks_gives_each_inmemory_rank_its_own_backward():
    """On a CUDA device autograd runs the backward of every Python thread on one shared device thread, so in-memory
    ranks deadlocked in DDP's first gradient hook on an H200 (a rank blocked in a collective there holds up the hooks
    the others wait for). Catches the harness losing its protection: each rank thread must run with autograd's
    multithreading off (its backward on its own thread), and a CUDA-device group must form under run_ranks (its
    constructor refuses threads without the protection; nothing here touches a GPU)."""
    for device in ("cpu", "cuda"):
        for multithreaded, own_thread, where in run_ranks(_backward_thread, 2, "inmemory", device=device):
            assert not multithreaded and own_thread and where.type == device


def test_inmemory_on_a_cuda_device_refuses_the_shared_backward_thread():
    """Catches a hand-made in-memory CUDA group (threads of the user's own) that would deadlock in its first backward:
    the constructor names the cause and the fix instead; inside the setting, or at world size 1, it forms."""
    with pytest.raises(ValueError, match=r"device='cuda'.*set_multithreading_enabled\(False\)"):
        InMemoryCommunicationBackend(0, 2, group=f"cuda-{uuid.uuid4().hex}", device="cuda")
    assert InMemoryCommunicationBackend(0, 1, group=f"cuda-{uuid.uuid4().hex}", device="cuda").world_size == 1
    with torch.autograd.set_multithreading_enabled(False):
        assert InMemoryCommunicationBackend(0, 2, group=f"cuda-{uuid.uuid4().hex}", device="cuda").rank == 0


def test_inmemory_rejects_inconsistent_construction():
    """Two ranks claiming the same slot, or disagreeing on world size, are told so."""
    group = f"dup-{uuid.uuid4().hex}"
    InMemoryCommunicationBackend(0, 3, group=group)
    with pytest.raises(ValueError, match="already joined"):
        InMemoryCommunicationBackend(0, 3, group=group)
    with pytest.raises(ValueError, match="world_size 3"):
        InMemoryCommunicationBackend(1, 4, group=group)
    with pytest.raises(ValueError, match="out of range"):
        InMemoryCommunicationBackend(3, 3, group="x")


def test_reduction_parsing():
    assert ReductionOperation.parse("avg") is ReductionOperation.AVERAGE
    assert ReductionOperation.parse(ReductionOperation.MAX) is ReductionOperation.MAX
    with pytest.raises(ValueError, match="SUM, AVERAGE, MAX, MIN, PRODUCT"):
        ReductionOperation.parse("xor")


def _chain_of_waits(comm, port: int) -> dict:
    """In a new group of 3: rank 2 waits for rank 1, rank 1 for rank 0, rank 0 for rank 2, and nobody sends; rank
    0 aborts (a survivor leaving a failed group), then each rank aborts once its op failed, as live mode does."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 3, False, timeout=datetime.timedelta(seconds=60))  # hosted by the test
    group = GlooCommunicationBackend.join_group(
        dist.PrefixStore("chain/", store), comm.rank, 3, name="chain", timeout=120.0
    )
    group.all_reduce(torch.ones(1))  # every rank connected (an abort during the connect fails the peers' connect)
    work = group.recv(torch.zeros(4), (comm.rank - 1) % 3, async_op=True)
    store.add("posted", 1)
    if comm.rank == 0:
        while store.add("posted", 0) < 3:  # every receive is posted before rank 0 leaves
            time.sleep(0.01)
        group.abort("rank 0 left")
    try:
        work.wait()
        error = None
    except CommunicationError as e:
        error = f"{type(e).__name__}: {e}"
    group.abort("its op failed")
    try:
        group.all_reduce(torch.ones(1))
        again = None
    except CommunicationError as e:
        again = str(e)
    group.shutdown()
    return {"error": error, "again": again}


@pytest.mark.faults
def test_gloo_abort_releases_a_chain_of_waits_on_live_peers():
    """GlooCommunicationBackend.abort shuts down this rank's connections of the group: its own pending receive
    fails, and so does a live peer's receive from it, which aborts in turn and releases the next one, with no
    death and no timeout (ops may take 120 s here). Catches an abort that only marks the group broken (Gloo's own
    ProcessGroupGloo.abort returns without failing a pending receive): rank 2's receive from rank 1, which waits
    on rank 0, would wait out the op timeout, as a live-mode survivor did when its peer had already left."""
    import datetime

    import torch.distributed as dist

    port = free_port()  # the store lives outside the ranks, as live mode's membership service does
    store = dist.TCPStore("127.0.0.1", port, 3, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    results = run_ranks(_chain_of_waits, 3, "gloo", timeout=120.0, port=port)
    del store
    assert "aborted on this rank (rank 0 left)" in results[0]["error"], results[0]
    for r in (1, 2):
        assert results[r]["error"].startswith("CommunicationError:"), results[r]
        assert "closed its connection" in results[r]["error"] and "timed out" not in results[r]["error"], results[r]
    for r in range(3):
        assert "unusable" in results[r]["again"], results[r]


def _agreed_ops(comm) -> dict:
    t = torch.ones(3)
    before = comm.stats.check_calls
    comm.all_reduce(t)
    checked = comm.stats.check_calls - before
    before = comm.stats.check_calls
    comm.agreed.all_reduce(t)
    comm.agreed.broadcast(t, src=0)
    out = torch.zeros(3 * comm.world_size)
    comm.agreed.all_gather(t, out)
    agreed = comm.stats.check_calls - before
    try:
        comm.agreed.all_reduce(t, "no-such-op")
        refused = None
    except (TypeError, ValueError) as e:
        refused = type(e).__name__
    return {
        "checked": checked,
        "agreed": agreed,
        "validate_after": comm.validate,
        "refused": refused,
        "reads_through": comm.agreed.world_size == comm.world_size and comm.agreed.rank == comm.rank,
        "same_handle": comm.agreed is comm.agreed,
        "sum": t.tolist(),
    }


@pytest.mark.parametrize("backend", ["gloo", "inmemory"])
def test_agreed_ops_skip_the_signature_check_and_restore_it(backend):
    """``comm.agreed`` runs each op as inside ``unchecked()``. Catches an agreed op that still runs the cross-rank
    check (a round trip per op on Gloo), one that leaves ``validate`` off for the ops after it (also when the op
    raises on a bad argument), and attributes that do not read through to the backend."""
    for r in run_ranks(_agreed_ops, 2, backend):
        if backend == "gloo":
            assert r["checked"] == 1 and r["agreed"] == 0, r
        assert r["validate_after"] is True and r["refused"] == "ValueError", r
        assert r["reads_through"] and r["same_handle"], r
        assert r["sum"] == [4.0, 4.0, 4.0], r  # two all-reduces of ones over 2 ranks, then rank 0's broadcast
