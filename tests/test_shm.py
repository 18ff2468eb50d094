"""The shared-memory transport of Gloo groups on one host (``gpudist.comm.shm``).

Each rank function builds two fresh groups of the pool's ranks over one ``torch.distributed`` sub-group, one forced
onto shared memory (``shm=True``) and one onto TCP (``shm=False``), and compares them on the same inputs: TCP Gloo is
the oracle. Sizes mix odd ones (1, 123, uneven shards) with sizes that cross a slot (2 MiB per rank), so chunking,
the last partial chunk and uneven ranges all run. Two ranks add in the same order either way (results exact);
three may differ in the last bit (fp32 sums compared within a few ulps of the operands' magnitude).
"""

from __future__ import annotations

import glob
import os
import time

import pytest
import torch
import torch.distributed as dist

from gpudist import ShardingConfiguration
from gpudist.comm import CommunicationError, CommunicationTimeoutError, GlooCommunicationBackend, split_sizes
from gpudist.comm import shm as S
from gpudist.launch.spawn import RanksFailedError, spawn
from gpudist.strategies import DATA_PARALLEL_PAIRS
from gpudist.testing import run_ranks

from .helpers import batch, flat, fresh_net, initial_state

SLOT = S.CHUNK_BYTES // 4  # fp32 elements per slot
SIZES = [1, 123, 2 * SLOT + 7]


def both_transports(comm, timeout: float = 60.0) -> tuple[GlooCommunicationBackend, GlooCommunicationBackend]:
    pg = dist.new_group(backend="gloo")
    on = GlooCommunicationBackend(pg, timeout=timeout, shm=True)
    off = GlooCommunicationBackend(pg, timeout=timeout, shm=False)
    assert on.shared_memory and not off.shared_memory
    return on, off


def data(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n + salt)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-100, 100, (n,), generator=g).to(dtype)


def every_op(comm, sizes: list[int], dtypes: list[torch.dtype]) -> list[str]:
    """Every collective and reduction through shared memory against TCP; the differences found."""
    on, off = both_transports(comm)
    wrong = []

    def same(what: str, a: torch.Tensor, b: torch.Tensor) -> None:
        # Two ranks combine in the same order either way; three may not: Gloo rounds after each pairwise step, the
        # channel once (torch.sum/prod over the ranks). Apart by at most one rounding of an intermediate of the
        # operands' magnitude (randn: |x| < 6, bf16's ulp at 8-16 is 1/16; fp32's ~1e-6).
        exact = comm.world_size == 2 or not a.dtype.is_floating_point or ("MAX" in what or "MIN" in what)
        tol = 1 / 16 if a.dtype == torch.bfloat16 else 1e-5
        if not torch.equal(a, b) and (exact or not torch.allclose(a.double(), b.double(), rtol=0, atol=tol)):
            wrong.append(f"rank {comm.rank} {what}: max |diff| {(a.double() - b.double()).abs().max():.3g}")

    for n in sizes:
        for dtype in dtypes:
            reductions = ["SUM", "MAX", "MIN"] + (["AVERAGE", "PRODUCT"] if dtype.is_floating_point else [])
            for red in reductions if n < SLOT or dtype == torch.float32 else ["SUM"]:
                x = data(comm.rank, n, dtype)
                if red == "PRODUCT":
                    x = 1 + x.float().tanh().to(dtype) / 4  # stays near 1, so products are exact enough to compare
                a, b = x.clone(), x.clone()
                on.all_reduce(a, red)
                off.all_reduce(b, red)
                same(f"all_reduce {red} {dtype} n={n}", a, b)
                share = split_sizes(n, comm.world_size)[comm.rank]
                a, b = torch.empty(share, dtype=dtype), torch.empty(share, dtype=dtype)
                on.reduce_scatter(x.clone(), a, red)
                off.reduce_scatter(x.clone(), b, red)
                same(f"reduce_scatter {red} {dtype} n={n}", a, b)
            mine = data(comm.rank, split_sizes(n, comm.world_size)[comm.rank], dtype)
            a, b = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
            on.all_gather(mine, a)
            off.all_gather(mine, b)
            same(f"all_gather {dtype} n={n}", a, b)
            for src in range(comm.world_size):
                a, b = data(comm.rank, n, dtype), data(comm.rank, n, dtype)
                on.broadcast(a, src)
                off.broadcast(b, src)
                same(f"broadcast src={src} {dtype} n={n}", a, b)
    on.shutdown()
    return wrong


@pytest.mark.parametrize("world", [2, 3])
def test_every_collective_matches_tcp_gloo(world):
    """Catches a wrong slice of the slots reduced or copied out, a chunk boundary off by one (sizes cross the 2 MiB
    slot), a wrong uneven range in reduce_scatter/all_gather, a wrong root in broadcast, a reduction mapped to the
    wrong torch op (AVERAGE not divided, PRODUCT summed), and a dtype viewed with the wrong element size (bf16, int8
    on two ranks)."""
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.int8] if world == 2 else [torch.float32, torch.int64]
    results = run_ranks(every_op, world, "gloo", sizes=SIZES, dtypes=dtypes)
    assert not [line for r in results for line in r], "\n".join(line for r in results for line in r)


def async_in_flight(comm) -> dict:
    """Several async ops of each kind in flight at once, TCP-only ops in between, waited in reverse order."""
    on, off = both_transports(comm)
    n = 3 * SLOT + 5
    xs = [data(comm.rank, n, torch.float32, salt=i) for i in range(3)]
    want = []
    for x in xs:
        w = x.clone()
        off.all_reduce(w)
        want.append(w)
    share = split_sizes(n, comm.world_size)[comm.rank]
    got = [x.clone() for x in xs]
    gathered, scattered = torch.empty(n), torch.empty(share)
    works = [on.all_reduce(got[0], async_op=True)]
    works.append(on.reduce_scatter(xs[1].clone(), scattered, async_op=True))
    swapped = torch.empty(4 * comm.world_size)
    on.all_to_all(torch.arange(4.0 * comm.world_size) + 100 * comm.rank, swapped)  # TCP, while those run
    works += [on.all_gather(want[2][slice(*_range(n, comm))].clone(), gathered, async_op=True)]
    works += [on.all_reduce(g, async_op=True) for g in got[1:]]
    for w in reversed(works):
        w.wait()
    start = sum(split_sizes(n, comm.world_size)[: comm.rank])
    on.barrier()
    on.shutdown()
    return {
        "all_reduce": all(torch.equal(g, w) for g, w in zip(got, want, strict=True)),
        "reduce_scatter": torch.equal(scattered, want[1][start : start + share]),
        "all_gather": torch.equal(gathered, want[2]),
        "all_to_all": swapped.view(comm.world_size, 4)[:, 0].tolist() == [100.0 * r + 4 * comm.rank for r in range(2)],
    }


def _range(n: int, comm) -> tuple[int, int]:
    start = sum(split_sizes(n, comm.world_size)[: comm.rank])
    return start, start + split_sizes(n, comm.world_size)[comm.rank]


def test_async_ops_complete_in_issue_order_beside_tcp_ops():
    """Catches async ops run out of order or concurrently on the channel (one op's chunks overwriting another's
    slots), a Work that returns before its op finished, and a deadlock between the shared-memory worker and ops that
    stay on Gloo's TCP (all_to_all) issued while shared-memory ops are in flight."""
    for result in run_ranks(async_in_flight, 2, "gloo"):
        assert all(result.values()), result


def in_place_and_bytes(comm) -> dict:
    on, off = both_transports(comm)
    n = 2 * SLOT + 3
    x = data(comm.rank, n, torch.float32)
    a, b = _range(n, comm)
    ref = x.clone()
    off.all_reduce(ref)
    inp = x.clone()
    on.reduce_scatter(inp, inp[a:b])  # the in-place form: out is inp's own range
    gathered = ref.clone()
    gathered[:a], gathered[b:] = 0, 0
    on.all_gather(gathered[a:b], gathered)  # in place: inp is out's own range
    stats = {k: (v.calls, v.bytes) for k, v in on.stats.ops.items()}
    on.shutdown()
    return {"scatter": torch.equal(inp[a:b], ref[a:b]), "gather": torch.equal(gathered, ref), "stats": stats}


def test_in_place_forms_and_byte_counters():
    """Catches the in-place reduce_scatter reading its own range after overwriting it, the in-place all_gather
    copying a rank's own range over itself from a stale slot, and byte counters that differ from TCP's definition
    (the logical payload: the input of reduce_scatter, the output of all_gather)."""
    n = 2 * SLOT + 3
    for r in run_ranks(in_place_and_bytes, 2, "gloo"):
        assert r["scatter"] and r["gather"], r
        assert r["stats"] == {"reduce_scatter": (1, 4 * n), "all_gather": (1, 4 * n)}


def leaves_nothing_in_dev_shm(comm) -> list[str]:
    on, _ = both_transports(comm)
    pids = [0] * comm.world_size
    pids[comm.rank] = os.getpid()
    everyone = torch.tensor(pids)
    on.all_reduce(everyone)
    on.shutdown()
    return glob.glob(f"/dev/shm/gpudist-{int(everyone[0])}-*")


def test_region_is_unlinked_once_mapped():
    """Catches a region file left in /dev/shm (rank 0 must unlink it as soon as every rank mapped it, so a killed
    job leaks nothing)."""
    assert run_ranks(leaves_nothing_in_dev_shm, 2, "gloo") == [[], []]


def peer_leaves(comm, mode: str) -> dict:
    on, _ = both_transports(comm, timeout=1.0 if mode == "silent" else 60.0)
    if comm.rank == 1:
        if mode == "shutdown":
            time.sleep(0.3)
            on.shutdown()
        elif mode == "abort":  # what a live-mode survivor does to a group with a dead member
            time.sleep(0.3)
            on.abort("a member died")
        else:
            time.sleep(1.5)  # never calls: rank 0 must time out
        return {}
    start = time.monotonic()
    try:
        with on.unchecked():  # the signature check would wait on Gloo first
            on.all_reduce(torch.ones(10))
    except CommunicationError as e:
        return {"type": type(e).__name__, "text": str(e), "op": e.op, "rank": e.rank, "s": time.monotonic() - start}
    return {"type": None}


@pytest.mark.parametrize("mode", ["shutdown", "abort", "silent"])
def test_a_peer_that_leaves_or_never_calls_fails_the_op(mode):
    """Catches a wait on a peer's sync count with no bound (a hang), a timeout raised as something other than
    CommunicationTimeoutError or without op, group and rank, and a peer's shutdown or abort() that leaves the others
    waiting out the whole 60 s timeout instead of failing at once (an abort that breaks only the TCP connections)."""
    r = run_ranks(peer_leaves, 2, "gloo", mode=mode)[0]
    assert r["op"] == "all_reduce" and r["rank"] == 0 and "group" in r["text"], r
    if mode in ("shutdown", "abort"):
        assert r["type"] == "CommunicationError" and r["s"] < 20, r
    else:
        assert r["type"] == CommunicationTimeoutError.__name__ and 0.9 < r["s"] < 20, r


def dies(comm) -> dict:
    on, _ = both_transports(comm)
    if comm.rank == 1:
        time.sleep(0.5)
        os._exit(0)
    start = time.monotonic()
    try:
        with on.unchecked():  # the signature check would wait on Gloo first
            on.all_reduce(torch.ones(10))
    except CommunicationError as e:
        return {"type": type(e).__name__, "text": str(e), "s": time.monotonic() - start}
    return {"type": None}


def test_a_dead_peer_process_fails_the_op_at_once():
    """Catches a dead peer noticed only at the timeout (60 s here): the waiter watches the peers' pids."""
    with pytest.raises(RanksFailedError) as info:
        spawn(dies, 2, timeout=60.0)
    r = info.value.results[0]
    assert r is not None and r["type"] == "CommunicationError" and "died" in r["text"] and r["s"] < 20, r


def test_ranks_on_different_hosts_or_opted_out_stay_on_tcp(monkeypatch):
    """Catches a group that maps shared memory although a rank sits in another network namespace (the multi-host
    tests simulate hosts that way), opted out or cannot reserve the region's pages (touching one later would be a
    SIGBUS), and a region file left behind when the answer is no."""
    before = set(glob.glob(f"/dev/shm/gpudist-{os.getpid()}-*"))

    def elsewhere(mine: torch.Tensor) -> torch.Tensor:
        other = mine.clone()
        other[2] += 1  # network namespace inode
        return torch.stack([mine, other])

    assert S.SharedMemoryChannel.open(elsewhere, 0, 2, "g", 5.0) is None
    assert S.SharedMemoryChannel.open(lambda m: torch.stack([m, m]), 0, 2, "g", 5.0, requested=False) is None
    assert set(glob.glob(f"/dev/shm/gpudist-{os.getpid()}-*")) == before
    with monkeypatch.context() as m:  # a /dev/shm too small for the region (a container's default 64 MiB)
        m.setattr(S.os, "posix_fallocate", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
        assert S.SharedMemoryChannel.open(lambda m: torch.stack([m, m]), 0, 2, "g", 5.0) is None
    monkeypatch.setenv(S.ENV, "0")
    assert not S.shm_requested(None) and S.shm_requested(True)
    monkeypatch.setenv(S.ENV, "1")
    assert S.shm_requested(None) and not S.shm_requested(False)


class _PeerCountThenCloseMark:
    """Counters as rank 1 of 2 sees them: rank 0's count is read from ``peer_counts`` in turn (the last value
    repeats) and the failure mark says rank 0 closed the channel."""

    def __init__(self, abort_index: int, peer_counts: list[int]):
        self.abort_index, self.peer_counts, self.reads = abort_index, peer_counts, 0
        self.values: dict[int, int] = {}

    def __getitem__(self, i: int) -> int:
        if i == 0:
            self.reads += 1
            return self.peer_counts[min(self.reads, len(self.peer_counts)) - 1]
        return 1 if i == self.abort_index else self.values.get(i, 0)

    def __setitem__(self, i: int, v: int) -> None:
        self.values[i] = v


def test_a_peer_that_arrives_then_closes_does_not_fail_the_sync_point():
    """Catches the race CI hit once: rank 0 passed the last sync point of an op and closed the channel while rank 1,
    descheduled between its read of rank 0's count (still the old one) and its read of the close mark, failed an op
    every rank had completed (and rank 0, gone on to its next group, waited out that group's 60 s timeout). A peer
    that closed without arriving must still fail the wait."""
    import mmap

    mm = mmap.mmap(-1, S._header_bytes(2) + 3 * 4096)
    channel = S.SharedMemoryChannel(mm, 1, 2, "g", 5.0, pids=None)
    try:
        channel._counters = _PeerCountThenCloseMark(channel._abort_index, [0, 1])  # stale, then arrived (seq 1)
        channel._sync("all_reduce")
        assert channel._counters.reads >= 2
        channel._counters = _PeerCountThenCloseMark(channel._abort_index, [1])  # never reaches seq 2
        with pytest.raises(CommunicationError, match="rank 0 of the shared-memory channel failed or shut down"):
            channel._sync("all_reduce")
    finally:
        channel._worker.shutdown()


def late_arrival(comm) -> float:
    on, _ = both_transports(comm)
    dozes, S._POLL_PID_EVERY = S._POLL_PID_EVERY, 30.0  # a waiter not posted would sleep 30 s
    try:
        if comm.rank == 1:
            time.sleep(0.5)  # rank 0 is asleep on its semaphore by now
        start = time.monotonic()
        with on.unchecked():  # the signature check would wait on Gloo first
            on.all_reduce(torch.ones(10))
        return time.monotonic() - start
    finally:
        S._POLL_PID_EVERY = dozes
        on.shutdown()


def test_a_waiting_rank_is_woken_by_its_peers_arrival():
    """Catches a lost wake-up: a waiter that sleeps on its semaphore until the sleep runs out (30 s here) instead of
    being posted when its peer arrives. A zeroed sem_t is process-private, so a post from another process is lost
    unless rank 0 initialized the semaphores as shared; a post taken back by the drain before its count was
    visible would do the same."""
    waited, _ = run_ranks(late_arrival, 2, "gloo")
    assert waited < 10.0, f"rank 0 waited {waited:.1f} s for a peer 0.5 s late"


def train_over_both(comm, state, strategy: str) -> dict:
    """Three steps of ``strategy`` over a shared-memory group and over a TCP group (several uneven buckets each);
    the parameters after them and the bytes each group had sent when the last gradient of the first backward
    arrived (``fc1.weight``, the final one: backward runs from the last layer)."""
    out = {}
    for name, group in zip(("shm", "tcp"), both_transports(comm), strict=True):
        config = ShardingConfiguration(group, bucket_cap_mb=0.0001, first_bucket_mb=0.00002)
        model_cls, opt_cls = DATA_PARALLEL_PAIRS[strategy]
        model = model_cls(fresh_net(state), config)
        opt = opt_cls(torch.optim.SGD(model.parameters(), lr=0.1), config)
        sent = []
        model.module.fc1.weight.register_post_accumulate_grad_hook(
            lambda _, sent=sent, group=group: sent.append(group.stats.total_bytes)
        )
        for step in range(3):
            x, y = batch(step, comm.rank, comm.world_size)
            start = group.stats.total_bytes
            torch.nn.functional.mse_loss(model(x), y).backward()
            sent[-1] -= start
            opt.step()
            opt.zero_grad()
        out[name] = {"params": flat(model.module), "during_backward": sent[0]}
        group.shutdown()
    return out


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
def test_data_parallel_over_shared_memory_matches_tcp(strategy):
    """Catches bucket all-reduces that a shared-memory group defers to the end of backward but then never starts or
    waits for (stale or unaveraged gradients), and deferral applied where it must not be: DDP and ZeRO-1 start none
    during backward on shared memory (there it only competes with backward for the cores), ZeRO-2 still does (its
    full-size send buffers must be freed as backward goes), TCP always does. Two ranks add in the same order on
    either transport, so the parameters agree exactly."""
    results = run_ranks(train_over_both, 2, "gloo", state=initial_state(), strategy=strategy)
    for r in results:
        assert torch.equal(r["shm"]["params"], r["tcp"]["params"])
        assert r["tcp"]["during_backward"] > 0
        assert (r["shm"]["during_backward"] > 0) == (strategy == "zero2"), r
