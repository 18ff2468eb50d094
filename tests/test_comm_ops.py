"""Every op of the communication contract x {in-memory, gloo} x world sizes 1-4 x dtypes, against numpy.

Each rank's inputs come from a seeded generator, so the test process regenerates all ranks' inputs and computes
the expected outputs with numpy in float64 (exact for these inputs, up to 2^-53). Sizes are odd on purpose: uneven
reduce_scatter/all_gather shares (13 elements over 2, 3, 4 ranks; 3 elements over 4 ranks, where one rank's share is
empty). Tolerances: exact, or the rounding bound of the reduction (``ROUNDINGS``); a dropped or doubled rank
changes a result by a whole input, about 1.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from gpudist.comm import ReductionOperation, shard_range, split_sizes
from gpudist.testing import run_ranks

from .backends import ALL as BACKENDS
from .backends import ALL_MPI_SLOW, mpi_world
from .tolerances import sum_rtol

WORLDS = [1, 2, 3, 4]
BACKEND_WORLDS = [(b, w) for b in ("inmemory", "gloo", "nccl-sim") for w in WORLDS] + [mpi_world(2), mpi_world(3, True)]
"""MPI at 2 and 3 processes (mpirun -np 2 / -np 3; 3 in the slow tier): one mpirun per world size runs every
dtype. ``nccl-sim`` is the real NCCL backend over the simulated NCCL of tests/fakenccl.py (strict in-order p2p,
NCCL's aliasing rules)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64}
REDUCTIONS = ["SUM", "AVERAGE", "MAX", "MIN", "PRODUCT"]
ROUNDINGS = {"SUM": lambda w: w - 1, "AVERAGE": lambda w: w + 1, "PRODUCT": lambda w: w - 1}
"""Roundings on any value's path through a reduction of ``w`` values in the wire dtype, in any order: the additions
(or multiplications); for AVERAGE also the rounded 1/N and its product, or one division. The result is within
gamma(k) = k u / (1 - k u) of the exact one, relative to sum |x_i| (SUM; AVERAGE: divided by N) or to |product|
(Higham, sections 3.1 and 4.2). A bf16 reduction may round in bf16 after every operation (Gloo) or accumulate in
fp32 and round once: gamma_bf16(k) + gamma_fp32(k) covers both. MAX, MIN and every data movement are exact; so is
everything on int64."""


def make_input(rank: int, dtype_name: str, numel: int, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype_name == "int64":
        return torch.randint(-4, 5, (numel,), generator=g)
    return torch.randn(numel, generator=g).to(DTYPES[dtype_name])


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float64).numpy() if t.is_floating_point() else t.numpy()


def _all_ops(comm, dtype_name: str) -> dict:
    """Run every op once on this rank and return the outputs (numpy) by case name."""
    r, w = comm.rank, comm.world_size
    dtype, ints = DTYPES[dtype_name], dtype_name == "int64"
    out = {}
    for i, red in enumerate(REDUCTIONS):
        if ints and red == "AVERAGE":
            continue
        t = make_input(r, dtype_name, 15, salt=i).view(3, 5)
        comm.all_reduce(t, ReductionOperation[red])
        out[f"all_reduce_{red}"] = as_numpy(t)
    for i, red in enumerate(["SUM", "MAX"] + ([] if ints else ["AVERAGE"])):
        inp = make_input(r, dtype_name, 13, salt=10 + i)
        res = torch.zeros(split_sizes(13, w)[r], dtype=dtype)
        comm.reduce_scatter(inp, res, red)
        out[f"reduce_scatter_{red}"] = as_numpy(res)
    for numel in (11, 3, 4 * w):
        res = torch.zeros(numel, dtype=dtype)
        comm.all_gather(make_input(r, dtype_name, split_sizes(numel, w)[r], salt=20 + numel), res)
        out[f"all_gather_{numel}"] = as_numpy(res)
    t = make_input(r, dtype_name, 6, salt=30).view(2, 3)
    comm.broadcast(t, src=w - 1)
    out["broadcast"] = as_numpy(t)
    res = torch.zeros(3 * w, dtype=dtype)
    comm.all_to_all(make_input(r, dtype_name, 3 * w, salt=40), res)
    out["all_to_all"] = as_numpy(res)
    if w > 1:  # ring: receive from the left neighbour while sending to the right one
        got, sent = torch.zeros(6, dtype=dtype), make_input(r, dtype_name, 6, salt=50)
        if comm.ordered_p2p:  # NCCL: a receive posted alone blocks this rank's send behind it; group them
            comm.batch_send_recv([(sent, (r + 1) % w)], [(got, (r - 1) % w)]).wait()
        else:
            handle = comm.recv(got, (r - 1) % w, async_op=True)
            comm.send(sent, (r + 1) % w)
            handle.wait()
        out["send_recv"] = as_numpy(got)
    # Several async ops in flight at once, completed in reverse order.
    a, b = make_input(r, dtype_name, 9, salt=60), make_input(r, dtype_name, 9, salt=61)
    handles = [comm.all_reduce(a, "sum", async_op=True), comm.all_reduce(b, "max", async_op=True)]
    for h in reversed(handles):
        h.wait()
        assert h.is_completed()
    out["async_sum"], out["async_max"] = as_numpy(a), as_numpy(b)
    comm.barrier()
    out["stats"] = comm.stats.as_dict()
    return out


def reference(case: str, world: int, dtype_name: str) -> list[np.ndarray]:
    """Expected output of ``case`` on every rank, computed with numpy in float64."""
    inputs = lambda numel, salt: [as_numpy(make_input(r, dtype_name, numel, salt)) for r in range(world)]
    reduce = {
        "SUM": lambda x: x.sum(0),
        "AVERAGE": lambda x: x.mean(0),
        "MAX": lambda x: x.max(0),
        "MIN": lambda x: x.min(0),
        "PRODUCT": lambda x: x.prod(0),
    }
    if case.startswith("all_reduce_"):
        red = case.removeprefix("all_reduce_")
        full = reduce[red](np.stack(inputs(15, REDUCTIONS.index(red)))).reshape(3, 5)
        return [full] * world
    if case.startswith("reduce_scatter_"):
        red = case.removeprefix("reduce_scatter_")
        salt = 10 + (["SUM", "MAX", "AVERAGE"].index(red))
        full = reduce[red](np.stack(inputs(13, salt)))
        return np.split(full, np.cumsum(split_sizes(13, world))[:-1])
    if case.startswith("all_gather_"):
        numel = int(case.removeprefix("all_gather_"))
        parts = [as_numpy(make_input(r, dtype_name, split_sizes(numel, world)[r], 20 + numel)) for r in range(world)]
        return [np.concatenate(parts)] * world
    if case == "broadcast":
        return [inputs(6, 30)[world - 1].reshape(2, 3)] * world
    if case == "all_to_all":
        chunks = [np.split(x, world) for x in inputs(3 * world, 40)]
        return [np.concatenate([chunks[src][dst] for src in range(world)]) for dst in range(world)]
    if case == "send_recv":
        sent = inputs(6, 50)
        return [sent[(r - 1) % world] for r in range(world)]
    if case in ("async_sum", "async_max"):
        salt, red = (60, "SUM") if case == "async_sum" else (61, "MAX")
        return [reduce[red](np.stack(inputs(9, salt)))] * world
    raise KeyError(case)


def error_bound(case: str, world: int, dtype_name: str) -> list[np.ndarray | float]:
    """Largest allowed |output - reference(case)| on every rank (see ``ROUNDINGS``)."""
    red = next((r for r in ROUNDINGS if case.endswith(f"_{r}") or (case == "async_sum" and r == "SUM")), None)
    if red is None or dtype_name == "int64":
        return [0.0] * world  # exact by construction
    k = ROUNDINGS[red](world)
    gamma = sum_rtol(k + 1, DTYPES[dtype_name])  # an n-term sum rounds n - 1 times
    if dtype_name == "bfloat16":
        gamma += sum_rtol(k + 1, torch.float32)
    numel, salt = (
        (9, 60)
        if case == "async_sum"
        else (15, REDUCTIONS.index(red))
        if case.startswith("all_reduce_")
        else (13, 10 + ["SUM", "MAX", "AVERAGE"].index(red))
    )
    x = np.stack([as_numpy(make_input(r, dtype_name, numel, salt)) for r in range(world)])
    magnitude = {"SUM": np.abs(x).sum(0), "AVERAGE": np.abs(x).mean(0), "PRODUCT": np.abs(x.prod(0))}[red]
    if case.startswith("reduce_scatter_"):
        return [gamma * part for part in np.split(magnitude, np.cumsum(split_sizes(numel, world))[:-1])]
    return [gamma * magnitude.reshape(3, 5) if numel == 15 else gamma * magnitude] * world


def _all_ops_every_dtype(comm) -> dict:
    return {name: _all_ops(comm, name) for name in DTYPES}


@functools.cache
def _mpi_outputs(world: int) -> list[dict]:
    return run_ranks(_all_ops_every_dtype, world, "mpi")


def ranks_on(backend: str, fn, world: int, **kwargs) -> list:
    """``fn(comm, **kwargs)`` on ``world`` ranks of ``backend``, or of the simulated NCCL (``"nccl-sim"``)."""
    if backend == "nccl-sim":
        from .fakenccl import FakeNccl, run_nccl

        return run_nccl(fn, world, FakeNccl(), **kwargs)
    return run_ranks(fn, world, backend, **kwargs)


@functools.cache
def outputs(backend: str, world: int, dtype_name: str) -> list[dict]:
    if backend == "mpi":
        return [rank[dtype_name] for rank in _mpi_outputs(world)]
    return ranks_on(backend, _all_ops, world, dtype_name=dtype_name)


CASES = (
    [f"all_reduce_{r}" for r in REDUCTIONS]
    + [f"reduce_scatter_{r}" for r in ("SUM", "MAX", "AVERAGE")]
    + [
        "all_gather_11",
        "all_gather_3",
        "all_gather_even",
        "broadcast",
        "all_to_all",
        "send_recv",
        "async_sum",
        "async_max",
    ]
)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize(("backend", "world"), BACKEND_WORLDS)
@pytest.mark.parametrize("case", CASES)
def test_op_matches_numpy(case, backend, world, dtype_name):
    """Each rank's output equals numpy's. Catches wrong reductions, wrong uneven share boundaries (off-by-one in
    the first-ranks-get-one-more rule), chunk order bugs in all_to_all, p2p matching and async completion bugs."""
    if dtype_name == "int64" and "AVERAGE" in case:
        pytest.skip("AVERAGE of integers is rejected by design (tested in test_comm_failures)")
    if case == "send_recv" and world == 1:
        pytest.skip("send/recv needs a peer")
    if case == "all_gather_even":
        case = f"all_gather_{4 * world}"
    results = outputs(backend, world, dtype_name)
    expected = reference(case, world, dtype_name)
    bounds = error_bound(case, world, dtype_name)
    for rank in range(world):
        got = results[rank][case]
        assert got.shape == expected[rank].shape, f"{case} rank {rank}: shape {got.shape} != {expected[rank].shape}"
        err = np.abs(got - expected[rank])
        assert (err <= bounds[rank]).all(), (
            f"{case} on rank {rank}: |got - numpy| up to {err.max():.3g} exceeds the "
            f"rounding bound\ngot {got}\nwant {expected[rank]}"
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_stats_count_payload_bytes(backend):
    """Byte counters follow the documented rule (all_reduce: tensor; reduce_scatter: input; all_gather: output).
    Catches counters that miss ops, count the check traffic as payload, or count per element instead of bytes."""
    world = 3
    stats = outputs(backend, world, "float32")[1]["stats"]["ops"]
    n_all_reduce = len(REDUCTIONS) + 2  # five reductions + two async
    assert stats["all_reduce"] == {"calls": n_all_reduce, "bytes": 4 * (len(REDUCTIONS) * 15 + 2 * 9)}
    assert stats["reduce_scatter"] == {"calls": 3, "bytes": 3 * 13 * 4}
    assert stats["all_gather"] == {"calls": 3, "bytes": (11 + 3 + 4 * world) * 4}
    assert stats["broadcast"] == {"calls": 1, "bytes": 6 * 4}
    assert stats["send"] == stats["recv"] == {"calls": 1, "bytes": 6 * 4}
    assert stats["barrier"]["calls"] == 1


def _subgroups(comm) -> dict:
    evens = comm.new_group([0, 2])
    odds = comm.new_group([3, 1])  # rank 0 of this group is global rank 3
    mine = evens if comm.rank % 2 == 0 else odds
    other = odds if comm.rank % 2 == 0 else evens
    t = torch.tensor([float(comm.rank)])
    mine.all_reduce(t)
    nested = mine.new_group([1])  # a sub-group of a sub-group
    b = torch.tensor([float(comm.rank)])
    mine.broadcast(b, src=0)
    comm.all_reduce(torch.ones(1))  # the parent group still works after sub-groups were made
    return {
        "other_is_none": other is None,
        "sum": t.item(),
        "sub_rank": mine.rank,
        "sub_world": mine.world_size,
        "bcast": b.item(),
        "nested": None if nested is None else (nested.rank, nested.world_size),
    }


@pytest.mark.parametrize("backend", ALL_MPI_SLOW)
def test_subgroups(backend):
    """Sub-groups of 2 inside 4 ranks (rank order as given, not sorted) and a nested sub-group. Catches sub-group
    ranks mapped by sorting, members meeting the wrong group, and non-members getting a backend."""
    res = run_ranks(_subgroups, 4, backend)
    assert [r["other_is_none"] for r in res] == [True] * 4
    assert [r["sum"] for r in res] == [2.0, 4.0, 2.0, 4.0]
    assert [r["sub_rank"] for r in res] == [0, 1, 1, 0]
    assert [r["sub_world"] for r in res] == [2] * 4
    assert [r["bcast"] for r in res] == [0.0, 3.0, 0.0, 3.0]
    assert [r["nested"] for r in res] == [None, (0, 1), (0, 1), None]  # sub-rank 1 of [0,2] and of [3,1]


def _big_world(comm) -> float:
    t = torch.full((5,), float(comm.rank))
    comm.all_reduce(t)
    out = torch.zeros(split_sizes(130, comm.world_size)[comm.rank])
    comm.reduce_scatter(torch.ones(130), out)
    assert bool((out == comm.world_size).all())
    return t[0].item()


def test_inmemory_simulates_64_ranks():
    """64 threads form one group. Catches slot bookkeeping that only works for small worlds."""
    assert run_ranks(_big_world, 64) == [float(sum(range(64)))] * 64


def _reduce_scatter_forms(comm) -> dict:
    """Every rank reduce-scatters arange(n) + 100 * rank (13 and 16 elements: uneven and even shares) four ways:
    out separate or inp's own range (in place), each with and without ``scratch_input``. Small integers: exact."""
    out = {}
    for numel in (13, 16):
        start, end = shard_range(numel, comm.world_size, comm.rank)
        for in_place in (False, True):
            for scratch in (False, True):
                inp = torch.arange(numel, dtype=torch.float32) + 100 * comm.rank
                target = inp[start:end] if in_place else torch.full((end - start,), -1.0)
                comm.reduce_scatter(inp, target, scratch_input=scratch)
                out[(numel, in_place, scratch)] = target.tolist()
                if not scratch:  # the caller still owns its input: untouched outside its own range
                    outside = torch.cat([inp[:start], inp[end:]])
                    expect = torch.cat([torch.arange(numel)[:start], torch.arange(numel)[end:]]) + 100 * comm.rank
                    assert torch.equal(outside, expect.float()), "reduce_scatter wrote into its input"
    return out


@pytest.mark.parametrize("backend", [*BACKENDS, "nccl-sim"])
def test_reduce_scatter_in_place_and_on_scratch_input(backend):
    """ZeRO-2 reduce-scatters its packed bucket in place (out = the bucket's own range) with ``scratch_input``, which
    lets Gloo reduce the bucket itself instead of a copy. Catches an in-place form that reads its own already
    written range, MPI handed overlapping buffers, a result copied from the wrong range, and a caller's input
    clobbered without ``scratch_input``."""
    world = 3
    results = ranks_on(backend, _reduce_scatter_forms, world)
    for rank, res in enumerate(results):
        for (numel, in_place, scratch), got in res.items():
            start, end = shard_range(numel, world, rank)
            want = [float(world * i + 100 * sum(range(world))) for i in range(start, end)]
            assert got == want, f"n={numel} in_place={in_place} scratch_input={scratch} on rank {rank}: {got}"


def _planned_all_reduce(comm) -> dict:
    with pytest.raises(ValueError, match="not contiguous"):  # checked when planned, before anything is sent
        comm.plan_all_reduce(torch.ones(4, 4).t())
    t = torch.full((5,), float(comm.rank + 1))
    sums = comm.plan_all_reduce(t, "sum")
    means = comm.plan_all_reduce(t, ReductionOperation.AVERAGE)
    comm.stats.reset()
    values = []
    for plan in (sums, sums, means):
        plan.start().wait()
        values.append(t[0].item())
    return {"values": values, "stats": comm.stats.as_dict()["ops"], "checks": comm.stats.check_calls}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_planned_all_reduce_is_the_all_reduce_without_per_call_checks(backend):
    """comm.plan_all_reduce checks its arguments once; each start() is the same all-reduce (SUM of 1 and 2 is 3, then
    6; the average of 6 on every rank is 6), counted in the byte counters, with no cross-rank signature check. Catches
    a plan that reduces a stale copy, skips the counters, or runs the per-call check it exists to avoid."""
    for r in run_ranks(_planned_all_reduce, 2, backend):
        assert r["values"] == [3.0, 6.0, 6.0]
        assert r["stats"] == {"all_reduce": {"calls": 3, "bytes": 3 * 5 * 4}}
        assert r["checks"] == 0


def test_a_planned_all_reduce_over_the_simulated_nccl():
    """The NCCL plan binds the pointer, count and codes once: the same results and counters as above."""
    from .fakenccl import FakeNccl, run_nccl

    for r in run_nccl(_planned_all_reduce, 2, FakeNccl()):
        assert r["values"] == [3.0, 6.0, 6.0]
        assert r["stats"] == {"all_reduce": {"calls": 3, "bytes": 3 * 5 * 4}}


def _planned_shapes(comm) -> dict:
    """The other plans: a reduce-scatter by shape (tensors per start, even and uneven), an all-gather and a broadcast
    on fixed buffers; each started twice, its results next to the unplanned op's on the same inputs."""
    world, rank = comm.world_size, comm.rank
    with pytest.raises(TypeError, match="not supported"):  # checked when planned, before anything is sent
        comm.plan_reduce_scatter(8, torch.complex64)
    with pytest.raises(ValueError, match="numel"):
        comm.plan_reduce_scatter(-1, torch.float32)
    with pytest.raises(ValueError, match="numel"):
        comm.plan_all_gather(2.5, torch.float32)
    with pytest.raises(ValueError, match="src"):
        comm.plan_broadcast(torch.ones(3), world)
    results = {}
    for numel in (4 * world, 4 * world + 1):  # even (NCCL: one bound ncclReduceScatter) and uneven
        plan = comm.plan_reduce_scatter(numel, torch.float32, "sum")
        got = []
        for step in range(2):
            inp = torch.arange(numel, dtype=torch.float32) + 10 * rank + step
            out = torch.empty(split_sizes(numel, world)[rank])
            plan.start(inp, out).wait()
            want = torch.empty_like(out)
            comm.reduce_scatter(inp, want)
            got.append(torch.equal(out, want))
        results[f"reduce_scatter {numel}"] = got
    piece = torch.full((3,), float(rank + 1))
    out = torch.zeros(3 * world)
    gather = comm.plan_all_gather(out.numel(), out.dtype)
    cast = torch.arange(5, dtype=torch.float32) * (rank + 1)
    send = comm.plan_broadcast(cast, world - 1)
    comm.stats.reset()
    for step in range(2):
        piece.add_(step)
        gather.start(piece, out).wait()
        send.start().wait()
    results["all_gather"] = out.tolist()
    results["broadcast"] = cast.tolist()
    results["checks"] = comm.stats.check_calls
    results["ops"] = {k: v["calls"] for k, v in comm.stats.as_dict()["ops"].items()}
    return results


@pytest.mark.parametrize("backend", [*BACKENDS, "nccl-sim"])
def test_planned_reduce_scatter_all_gather_and_broadcast_are_their_ops(backend):
    """What ZeRO's and FSDP's steps issue every step without per-call checks: a reduce-scatter and an all-gather
    planned by shape (new buffers each step, or the same ones), and a broadcast planned on a fixed buffer. Catches a
    plan that binds a stale pointer or size (the second start would read the first step's buffer), the wrong root
    or rank order, an uneven size taking the even path, per-start cross-rank checks, and bad arguments accepted at
    plan time."""
    world = 2
    results = ranks_on(backend, _planned_shapes, world)
    for rank, r in enumerate(results):
        for key in ("reduce_scatter 8", "reduce_scatter 9"):
            assert r[key] == [True, True], (rank, key)
        # each rank's piece: rank + 1, plus 0 then 1 (the second start sends the updated piece)
        assert r["all_gather"] == [float(q + 2) for q in range(world) for _ in range(3)], rank
        assert r["broadcast"] == [float(i * world) for i in range(5)], rank
        assert r["checks"] == 0 and r["ops"] == {"all_gather": 2, "broadcast": 2}, rank


def _coalesced(comm) -> dict:
    """Three all-gathers (one uneven share size each rank agrees on) and an AVERAGE all-reduce planned on fixed
    buffers and coalesced, started twice; the transport's joins of its stream counted where it has them."""
    world, rank = comm.world_size, comm.rank
    pieces = [torch.full((n,), float(rank + 1)) for n in (1, 3, 4)]
    outs = [torch.zeros(world * p.numel()) for p in pieces]
    mean = torch.full((5,), float(rank + 1))
    plans = [(comm.plan_all_gather(o.numel(), o.dtype), (p, o)) for p, o in zip(pieces, outs, strict=True)]
    plans.append((comm.plan_all_reduce(mean, ReductionOperation.AVERAGE), ()))
    group = comm.plan_coalesced(plans)
    foreign = type("Foreign", (), {"_backend": object(), "_op": "all_gather"})()  # a plan of another group
    with pytest.raises(ValueError, match="another backend"):
        comm.plan_coalesced([(foreign, ())])
    comm.stats.reset()
    rt = getattr(comm, "_rt", None)
    joins = rt.joins if rt is not None else None
    for step in range(2):
        for p in pieces:
            p.add_(step)
        group.start().wait()
    return {
        "outs": [o.tolist() for o in outs],
        "mean": mean.tolist(),
        "ops": {k: v["calls"] for k, v in comm.stats.as_dict()["ops"].items()},
        "joins": None if rt is None else rt.joins - joins,
        "checks": comm.stats.check_calls,
    }


@pytest.mark.parametrize("backend", [*BACKENDS, "nccl-sim"])
def test_coalesced_plans_are_their_ops_issued_together(backend):
    """comm.plan_coalesced (ZeRO-2's gather of every bucket): the coalesced collectives give what each gives alone,
    with their byte counters, no per-start checks, and on NCCL one join of the communication stream per start for
    all four (one ncclGroupStart/End, one event). Catches a group that binds a stale pointer, drops a call, mixes up
    buffers, or hands the streams off per collective again, and a plan of another group accepted."""
    world = 2
    for rank, r in enumerate(ranks_on(backend, _coalesced, world)):
        for n, out in zip((1, 3, 4), r["outs"], strict=True):  # rank q's piece: q + 1, plus 0 then 1
            assert out == [float(q + 2) for q in range(world) for _ in range(n)], (rank, n)
        assert r["mean"] == [1.5] * 5, rank  # the average of 1 and 2, then of 1.5 and 1.5
        assert r["ops"] == {"all_gather": 6, "all_reduce": 2} and r["checks"] == 0, rank
        if backend == "nccl-sim":
            assert r["joins"] == 2, rank  # one per start, not one per collective
