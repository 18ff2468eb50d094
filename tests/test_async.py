"""AsyncSGDOptimizer: parameter-server shards with bounded staleness, against synchronous references.

Synchronous parity (max_staleness=0) is against single-process training in float64, within a multiple of the
float32 run's own error (tests/tolerances.py): the shards differ from one process only in summation order.
"""

from __future__ import annotations

import copy
import os
import random
import signal
import socket
import threading
import time
from multiprocessing.connection import Connection, answer_challenge

import pytest
import torch
from torch import nn

import gpudist
from gpudist.strategies import async_sgd
from gpudist.testing import RanksFailedError, run_ranks

from .tolerances import assert_matches_reference, reference_pair

STEPS, BATCH = 6, 12


def _data(seed: int = 0, n: int = STEPS * BATCH, d: int = 8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randn(n, 1, generator=g)


def _template(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _make_optimizer(kind: str, module: nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    groups = [
        {"params": [p for n, p in module.named_parameters() if n.endswith("weight")], "weight_decay": 0.1},
        {"params": [p for n, p in module.named_parameters() if n.endswith("bias")], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=0.01)


def _reference(kind: str, template: nn.Module, dtype=torch.float32) -> torch.Tensor:
    """Single-process training on the global batch."""
    x, y = (t.to(dtype) for t in _data())
    model = copy.deepcopy(template).to(dtype)
    opt = _make_optimizer(kind, model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for i in range(STEPS):
        nn.functional.mse_loss(model(x[i * BATCH : (i + 1) * BATCH]), y[i * BATCH : (i + 1) * BATCH]).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return _flat(model)


def _train_async(comm, kind: str, template: nn.Module, max_staleness: int):
    x, y = _data()
    model = copy.deepcopy(template)
    opt = gpudist.AsyncSGDOptimizer(
        _make_optimizer(kind, model), gpudist.ShardingConfiguration(comm), max_staleness=max_staleness
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    n, r = comm.world_size, comm.rank
    for i in range(STEPS):
        xb, yb = x[i * BATCH : (i + 1) * BATCH].chunk(n)[r], y[i * BATCH : (i + 1) * BATCH].chunk(n)[r]
        nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    opt.finish()
    return _flat(model), opt.stats


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize(
    "world,backend", [(2, "inmemory"), (3, "inmemory"), pytest.param(2, "gloo", marks=pytest.mark.slow, id="2-gloo")]
)
def test_staleness_zero_equals_synchronous(world, backend, kind):
    """max_staleness=0 must be synchronous SGD on the global batch, for momentum SGD and AdamW with two param groups
    and an LR schedule. Catches a round closing before every worker's gradient arrived, a gradient applied twice or
    to the wrong shard, the mean taken over the wrong count, server hyper-parameters not following the scheduler,
    or parameters not pulled after the last round."""
    template = _template()
    expected = reference_pair(_reference, kind, template)
    results = run_ranks(_train_async, world, backend, kind=kind, template=template, max_staleness=0)
    for flat, stats in results:
        assert_matches_reference(flat, *expected)
        assert stats["rounds"] == STEPS and stats["dropped"] == 0 and stats["max_staleness_seen"] == 0


def _straggler(comm, max_staleness: int, steps: int, gate: dict):
    """Rank world-1 does not push anything until the others have finished all their steps (or a deadline)."""
    x, y = _data(seed=comm.rank)
    model = copy.deepcopy(gate["template"])
    opt = gpudist.AsyncSGDOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), gpudist.ShardingConfiguration(comm), max_staleness=max_staleness
    )
    slow = comm.rank == comm.world_size - 1
    done_fast = 0
    for i in range(steps):
        if slow and i == 0:
            gate["fast_done"].wait(timeout=gate["deadline"])
            done_fast = gate["count"]
        nn.functional.mse_loss(model(x[i * 4 : (i + 1) * 4]), y[i * 4 : (i + 1) * 4]).backward()
        opt.step()
        opt.zero_grad()
        if not slow:
            with gate["lock"]:
                gate["count"] += 1
                if gate["count"] == steps * (comm.world_size - 1):
                    gate["fast_done"].set()
    opt.finish()
    return done_fast, opt.stats, _flat(model)


@pytest.mark.parametrize("max_staleness", [1, 3])
def test_straggler_does_not_stall_the_others(max_staleness):
    """With max_staleness >= 1, two fast workers finish all their steps while the third has not pushed a single
    gradient (the slow rank waits for them first: a stall would show as a timeout, not as a slow run). Catches rounds
    that wait for every worker, or a per-version limit that blocks the fast ones. The straggler's too-stale
    gradient is dropped, and every rank ends with the same parameters."""
    steps = 8
    gate = {
        "template": _template(),
        "fast_done": threading.Event(),
        "lock": threading.Lock(),
        "count": 0,
        "deadline": 30.0,
    }
    results = run_ranks(_straggler, 3, "inmemory", max_staleness=max_staleness, steps=steps, gate=gate)
    done_fast = results[2][0]
    assert done_fast == steps * 2, f"the fast workers stalled after {done_fast} of {steps * 2} steps"
    dropped = sum(stats["dropped"] for _, stats, _ in results)
    assert dropped >= 1  # the straggler's first gradient, computed on version 0, is far too old
    for _, _, flat in results[1:]:
        torch.testing.assert_close(flat, results[0][2], atol=0, rtol=0)


def test_staleness_zero_waits_for_the_straggler():
    """The converse: with max_staleness=0 (synchronous) the fast workers cannot get past their first step while
    the straggler holds back. Catches a bound that is not enforced."""
    gate = {
        "template": _template(),
        "fast_done": threading.Event(),
        "lock": threading.Lock(),
        "count": 0,
        "deadline": 1.5,
    }
    results = run_ranks(_straggler, 3, "inmemory", max_staleness=0, steps=4, gate=gate)
    assert results[2][0] <= 2  # each fast worker pushed its first gradient, then waited for the round
    assert all(stats["rounds"] == 4 and stats["dropped"] == 0 for _, stats, _ in results)


def _convex(comm, max_staleness: int, sleep: float):
    g = torch.Generator().manual_seed(1)
    w_true = torch.randn(6, 1, generator=g)
    x = torch.randn(600, 6, generator=g)
    y = x @ w_true + 0.01 * torch.randn(600, 1, generator=g)
    model = nn.Linear(6, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    opt = gpudist.AsyncSGDOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), gpudist.ShardingConfiguration(comm), max_staleness=max_staleness
    )
    rows = x[comm.rank :: comm.world_size], y[comm.rank :: comm.world_size]
    for i in range(60):
        lo = (i * 10) % rows[0].shape[0]
        nn.functional.mse_loss(model(rows[0][lo : lo + 10]), rows[1][lo : lo + 10]).backward()
        opt.step()
        opt.zero_grad()
        if comm.rank == 0:
            time.sleep(sleep)  # a straggler
    opt.finish()
    return float((model.weight.detach().reshape(-1, 1) - w_true).norm() / w_true.norm()), opt.stats


def test_converges_on_a_convex_problem_with_a_straggler():
    """Least squares with one slow worker and stale gradients still reaches the true weights (1% relative error).
    Catches stale gradients applied with the wrong sign or scale, or rounds that lose gradients. The 1% bounds the
    optimization, not rounding: which version each stale gradient meets depends on thread timing (host speed and
    load), and any such schedule within max_staleness=2 converges on this problem."""
    results = run_ranks(_convex, 3, "inmemory", max_staleness=2, sleep=0.005)
    for err, _ in results:
        assert err < 0.01, err
    assert results[0][1]["max_staleness_seen"] >= 1  # it really ran asynchronously


def _bad(comm, case: str):
    model = nn.Linear(4, 2)
    config = gpudist.ShardingConfiguration(comm)
    if case == "staleness":
        gpudist.AsyncSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), config, max_staleness=-1)
    elif case == "ddp":
        wrapped = gpudist.DDPModel(model, config)
        gpudist.AsyncSGDOptimizer(torch.optim.SGD(wrapped.parameters(), lr=0.1), config)
    elif case == "dtype":
        model.double()
        gpudist.AsyncSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), config)


@pytest.mark.parametrize(
    "case,message", [("staleness", "max_staleness=-1"), ("ddp", "needs a plain module"), ("dtype", "torch.float64")]
)
def test_bad_input_is_refused(case, message):
    """Bad settings raise an error naming the value and the fix, before any shard starts serving."""
    with pytest.raises(gpudist.testing.RanksFailedError, match=message):
        run_ranks(_bad, 2, "inmemory", case=case)


# -- hardened setup and dead shards (issue 23, item 2) ----------------------------------------------------------------


def _intrude(address) -> list:
    """Open three foreign connections to a shard before any worker does: a wrong key (answering the challenge in a
    thread), a silent one, and random bytes. Returns what to close afterwards."""
    wrong = socket.create_connection(address)
    silent = socket.create_connection(address)
    garbage = socket.create_connection(address)
    garbage.sendall(b"\xff\xff\xff\x7f" + random.Random(0).randbytes(60))  # claims a 2 GiB message, then noise
    conn = Connection(wrong.detach())

    def answer_with_the_wrong_key():
        try:
            answer_challenge(conn, b"not the job's key" * 2)
        except Exception:
            pass  # refused, as it should be

    threading.Thread(target=answer_with_the_wrong_key, daemon=True).start()
    return [conn, silent, garbage]


def _train_briefly(comm, template: nn.Module):
    x, y = _data()
    model = copy.deepcopy(template)
    start = time.monotonic()
    opt = gpudist.AsyncSGDOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), gpudist.ShardingConfiguration(comm), max_staleness=0
    )
    setup = time.monotonic() - start
    for i in range(2):
        nn.functional.mse_loss(model(x[i * 4 : (i + 1) * 4]), y[i * 4 : (i + 1) * 4]).backward()
        opt.step()
        opt.zero_grad()
    opt.finish()
    return setup, _flat(model)


@pytest.mark.faults
def test_intruders_do_not_break_or_hang_the_setup(monkeypatch):
    """A wrong key, a silent connection and random bytes reach every shard before the real workers do; setup still
    completes for the real workers without waiting for the intruders' handshake timeout, and they train. Catches
    the acceptor that gave the first `world` comers the slots: the wrong key killed it (every rank then got
    ConnectionRefusedError) and the silent connection hung every rank in the constructor."""
    opened = []
    real_init = async_sgd._ShardServer.__init__

    def init_then_intrude(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        opened.extend(_intrude(self.address))  # before the addresses are exchanged: the intruders come first

    monkeypatch.setattr(async_sgd._ShardServer, "__init__", init_then_intrude)
    try:
        results = run_ranks(_train_briefly, 2, "inmemory", timeout=30.0, template=_template())
    finally:
        for s in opened:
            s.close()
    for setup, flat in results:
        assert setup < async_sgd._HANDSHAKE_SECONDS, f"setup waited {setup:.1f}s: an intruder held it up"
        torch.testing.assert_close(flat, results[0][1], atol=0, rtol=0)


def _wrong_key_connect(real_connect):
    """``AsyncSGDOptimizer._connect`` with rank 1 presenting a wrong key to shard 0, as if it belonged to another job.
    Installed once, by the test's main thread: a class attribute patched and restored by each rank thread on its own
    could be left patched (the last thread to restore puts back what another thread installed), and every later
    async optimizer in the process would then fail to connect."""

    def connect(self, shard, host, port, authkey):
        if self.comm.rank == 1 and shard == 0:
            authkey = bytes(32)
        return real_connect(self, shard, host, port, authkey)

    return connect


def _build_async(comm):
    try:
        gpudist.AsyncSGDOptimizer(
            torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=0.1), gpudist.ShardingConfiguration(comm)
        )
    except gpudist.CommunicationError as e:
        return str(e)
    return None


@pytest.mark.faults
def test_a_worker_that_never_connects_is_named_on_every_rank(monkeypatch):
    """Rank 1 cannot authenticate with rank 0's shard: after the setup deadline (the backend's timeout) every rank
    raises CommunicationError naming shard 0 and the missing rank 1. Catches a setup that waits forever, or that
    fails on one rank only (the others would hang in the next collective)."""
    real_connect = async_sgd.AsyncSGDOptimizer._connect
    monkeypatch.setattr(async_sgd.AsyncSGDOptimizer, "_connect", _wrong_key_connect(real_connect))
    start = time.monotonic()
    errors = run_ranks(_build_async, 2, "inmemory", timeout=2.0)
    assert time.monotonic() - start < 15.0
    for error in errors:
        assert error is not None and "AsyncSGDOptimizer setup failed" in error
        assert "ranks [1] never connected to the parameter-server shard of rank 0" in error, error


def _push_to_a_dead_shard(comm):
    model = nn.Linear(100, 200)  # 20200 parameters: each shard's push is over 16 KiB, header and payload written apart
    opt = gpudist.AsyncSGDOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), gpudist.ShardingConfiguration(comm), max_staleness=8
    )
    x = torch.randn(4, 100)
    model(x).sum().backward()
    opt.step()
    comm.barrier()
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)  # the kernel has closed rank 1's sockets
    start = time.monotonic()
    try:
        for _ in range(50):
            opt.step()
    except Exception as e:
        return {"type": type(e).__name__, "error": str(e), "elapsed": time.monotonic() - start}
    finally:
        opt.close()
    return {"type": None}


@pytest.mark.faults
def test_a_dead_shard_gives_a_named_communication_error():
    """Rank 1 is SIGKILLed after a step; rank 0's next push or pull raises CommunicationError naming rank 1's shard
    and the op, within seconds (the op timeout is 60 s). Catches the raw BrokenPipeError of a push, and EOFError
    or ConnectionResetError of a pull."""
    with pytest.raises(RanksFailedError) as info:
        run_ranks(_push_to_a_dead_shard, 2, "gloo")
    assert list(info.value.failures) == [1] and "killed by signal 9" in info.value.failures[1]
    result = info.value.results[0]
    assert result["type"] == "CommunicationError", result
    assert "parameter-server shard of rank 1" in result["error"] and "async_pu" in result["error"], result
    assert result["elapsed"] < 10.0
