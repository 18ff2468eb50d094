"""Whole-step capture (gpudist.capture) on the CPU tier's simulated CUDA graph (tests/graphsim.py) over the simulated
NCCL (tests/fakenccl.py): inside capture nothing runs, replay runs the record, so a replayed step that equals the
eager one bit for bit shows that everything the step does on the device was captured, in order, and that nothing the
step needs was decided on the host from a value computed during capture."""

from __future__ import annotations

import contextlib
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gpudist
from gpudist.comm import CollectiveMismatchError
from gpudist.strategies import DATA_PARALLEL_PAIRS

from . import graphsim
from .fakenccl import AsyncRuntime, FakeNccl, HostRuntime, run_nccl
from .graphsim import CaptureError, SimulatedGraph

STEPS = 4
WARMUP = 3


def _net() -> nn.Module:
    """Built from a seed of its own (rank threads share torch's global generator)."""
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    return net


def _batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]


def _loss(model, x, y):
    return F.mse_loss(model(x), y)


def _pair(comm, strategy: str, opt_name: str = "sgd", **config):
    config = gpudist.ShardingConfiguration(comm, bucket_cap_mb=0.0005, first_bucket_mb=0.0005, **config)
    model_cls, opt_cls = DATA_PARALLEL_PAIRS[strategy]
    kw = {"auto_wrap_policy": {nn.Linear}} if strategy == "fsdp" else {}
    model = model_cls(_net(), config, **kw)
    if opt_name in ("sgd", "sgd-float"):
        return model, opt_cls(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), config)
    if opt_name == "sgd-tensor-lr":  # a learning rate a scheduler fills in place between replays
        return model, opt_cls(torch.optim.SGD(model.parameters(), lr=torch.tensor(0.05), momentum=0.9), config)
    if opt_name == "adamw-float":  # the counts and the learning rate on the host
        return model, opt_cls(torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1), config)
    # The counts on the device, and a learning rate a scheduler fills in place between replays
    inner = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), weight_decay=0.1, capturable=True)
    return model, opt_cls(inner, config)


HOST_TWIN = {"adamw": "adamw-float", "sgd-tensor-lr": "sgd-float"}
"""Each optimizer whose learning rate is a device tensor, and its twin with the rate a number (eager only)."""


def _params(model) -> list[torch.Tensor]:
    if hasattr(model, "full_state_dict"):
        return [t.clone() for t in model.full_state_dict().values()]
    return [p.detach().clone() for p in model.module.parameters()]


def _scheduled(opt, opt_name: str):
    """A scheduler for the tensor learning rates (filled in place: every replay reads them) and their twins, else
    none (a number that changed after capture is refused)."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.7**s) if opt_name != "sgd" else None


def _eager(comm, strategy: str, opt_name: str, batches: list) -> tuple[list[float], list[torch.Tensor]]:
    model, opt = _pair(comm, strategy, opt_name, static_graph=strategy != "fsdp")
    schedule = _scheduled(opt, opt_name)
    losses = []
    for i, (x, y) in enumerate([batches[0]] * WARMUP + batches[WARMUP:]):
        opt.zero_grad(set_to_none=False)
        loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        if i >= WARMUP:
            losses.append(loss.item())
            if schedule is not None:
                schedule.step()
    return losses, _params(model)


def _eager_and_replayed(comm, strategy: str, opt_name: str = "sgd", nan_step: int | None = None) -> dict:
    batches = _batches(comm.rank, WARMUP + STEPS)
    if nan_step is not None and comm.rank == 0:  # one rank's batch poisons the global norm: every rank skips
        batches[WARMUP + nan_step][0].fill_(float("nan"))
    static = strategy != "fsdp"
    eager, eager_params = _eager(comm, strategy, opt_name, batches)
    # The same schedule with the counts and learning rate on the host (the numbers the device's must give)
    host_params = _eager(comm, strategy, HOST_TWIN[opt_name], batches)[1] if opt_name in HOST_TWIN else None

    model, opt = _pair(comm, strategy, opt_name, static_graph=static)
    schedule = _scheduled(opt, opt_name)
    step = gpudist.capture(model, opt, _loss, batches[0], warmup=WARMUP, graph=SimulatedGraph)
    replayed = []
    for x, y in batches[WARMUP:]:
        replayed.append(step(x, y).item())
        if schedule is not None:
            schedule.step()
    return {
        "eager": eager,
        "replayed": replayed,
        "eager_params": eager_params,
        "host_params": host_params,
        "params": _params(model),
        "replays": step.replays,
        "nccl_calls": step.graph.nccl_calls,
        "triton_launches": step.graph.triton_launches,
        "rank": comm.rank,
        "last_grad_norm": getattr(opt, "last_grad_norm", None),
        "steps": opt.state_dict().get("steps"),
    }


RUNTIMES = [pytest.param(HostRuntime, id="host"), pytest.param(AsyncRuntime, id="async-streams")]
"""The simulated device under the graph: every op done when issued, or the GPU-like one (NCCL calls run later, on
a stream of their own, in order; a wait is what orders them), whose stream joins and waits replay records too."""


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp"])
def test_replayed_steps_equal_eager_steps_bit_for_bit(strategy, runtime):
    """Catches a step that a graph would replay wrongly: a collective not captured (the gradients would stay this
    rank's own), a value the host read during capture and baked in (the loss or the parameters would freeze or go
    NaN: the simulation fills what capture computes with NaN), a bucket launched from Python state that replay does
    not rerun, capture itself changing the model (nothing runs inside capture), and, on the GPU-like streams, a
    replayed step that reads a collective's output before the capture stream waited for it."""
    for r in run_nccl(_eager_and_replayed, 2, FakeNccl(), runtime=runtime, strategy=strategy):
        assert r["replays"] == STEPS and r["nccl_calls"] > 0, r
        assert r["replayed"] == r["eager"], (r["replayed"], r["eager"])
        for a, b in zip(r["params"], r["eager_params"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("opt_name", list(HOST_TWIN))
@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "fsdp"])
def test_replayed_steps_follow_a_scheduled_tensor_lr_and_skip_on_the_device(strategy, runtime, opt_name):
    """gpudist's ZeRO AdamW built with ``capturable=True`` and its SGD, each with its learning rate a tensor that a
    scheduler fills between replays, and one replayed step whose global norm is NaN (rank 0's batch): eager and
    replayed equal bit for bit, and match the same schedule with the rate a number. Catches a step count or bias
    correction frozen at the captured step (every replay would repeat it), a skipped step counted, a learning rate
    read once at capture (the schedule would not move the replays), and a verdict the host reads from capture
    (``last_grad_norm`` must be the last replay's)."""
    for r in run_nccl(
        _eager_and_replayed, 2, FakeNccl(), runtime=runtime, strategy=strategy, opt_name=opt_name, nan_step=1
    ):
        assert r["replays"] == STEPS
        torch.testing.assert_close(torch.tensor(r["replayed"]), torch.tensor(r["eager"]), rtol=0, atol=0,
                                   equal_nan=True)  # fmt: skip
        assert (r["replayed"][1] != r["replayed"][1]) == (r["rank"] == 0)  # rank 0's poisoned loss is NaN
        for a, b in zip(r["params"], r["eager_params"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert r["steps"][0] == WARMUP + STEPS - 1  # the skipped step is not counted
        assert r["last_grad_norm"] > 0 and r["last_grad_norm"] == r["last_grad_norm"]
        for a, b in zip(r["params"], r["host_params"], strict=True):  # lr held in fp32 on the device: ulps apart
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opt_name", list(HOST_TWIN))
@pytest.mark.parametrize(
    "strategy", [pytest.param("zero1", marks=pytest.mark.slow), "zero2", pytest.param("fsdp", marks=pytest.mark.slow)]
)  # ZeRO-2 in the default tier: the others step the same kernels (interpreted: seconds each)
def test_replayed_steps_on_the_triton_kernels_read_rate_and_count_on_the_device(strategy, opt_name, serial_interpreter):
    """The GPU's path of the same steps (Triton kernels in the interpreter, recorded into the graph as launches with
    the numbers they were given): Adam's kernel reads -lr / bc1, sqrt(bc2) and 1 - lr * wd from the device, which
    the step computes there before it; SGD's reads the learning rate tensor. Catches a coefficient or rate computed
    on the host and baked into the captured launch (the schedule and the count would stop at the captured step),
    or a launch the graph does not hold."""
    for r in run_nccl(_eager_and_replayed, 2, FakeNccl(), strategy=strategy, opt_name=opt_name, nan_step=1):
        assert r["triton_launches"] > 0
        torch.testing.assert_close(torch.tensor(r["replayed"]), torch.tensor(r["eager"]), rtol=0, atol=0,
                                   equal_nan=True)  # fmt: skip
        for a, b in zip(r["params"], r["eager_params"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert r["steps"][0] == WARMUP + STEPS - 1
        for a, b in zip(r["params"], r["host_params"], strict=True):  # lr held in fp32 on the device: ulps apart
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _verdicts_in_capture(comm) -> dict:
    model, opt = _pair(comm, "zero2")
    batches = _batches(comm.rank, 3)
    read_inside = []
    verdict = gpudist.strategies.step_scalars._Verdict
    ready, value = verdict.ready, verdict.value

    def spied(original):
        def call(self):
            read_inside.append(graphsim._tape() is not None)
            return original(self)

        return call

    verdict.ready, verdict.value = spied(ready), spied(value)
    try:
        step = gpudist.capture(model, opt, _loss, batches[0], graph=SimulatedGraph)
    finally:
        verdict.ready, verdict.value = ready, value
    norms = []
    for x, y in batches[1:]:
        step(x, y)
        norms.append(opt.last_grad_norm)
    return {"read_inside": sum(read_inside), "read": len(read_inside), "norms": norms}


def test_the_step_reads_no_verdict_inside_capture_and_reports_each_replays_norm():
    """ZeRO's SGD counts on the host and learns each step's verdict (the global norm) a step later, by an event the
    host queries: inside capture that query (from any thread, in CUDA's global mode) invalidates the graph. Catches
    a captured step that still settles or queries verdicts (they are all read before capture, none inside), and a
    ``last_grad_norm`` stuck at the captured step after replays."""
    for r in run_nccl(_verdicts_in_capture, 2, FakeNccl()):
        assert r["read"] > 0 and r["read_inside"] == 0, r
        assert r["norms"][0] != r["norms"][1] and all(n > 0 for n in r["norms"]), r


def _changed_lr(comm) -> str:
    model, opt = _pair(comm, "zero1")
    x, y = _batches(comm.rank, 1)[0]
    step = gpudist.capture(model, opt, _loss, (x, y), graph=SimulatedGraph)
    step(x, y)
    for group in opt.param_groups:
        group["lr"] *= 0.5  # a scheduler stepping a number the graph holds
    with pytest.raises(RuntimeError, match=r"parameter group 0's lr changed from 0\.05 to 0\.025") as caught:
        step(x, y)
    return str(caught.value)


def test_a_number_changed_after_capture_is_refused_before_replay():
    """Catches a learning rate given as a number that a scheduler changes after capture: the graph keeps the captured
    value, so training would silently go on at the old rate. The replay is refused, naming the group, the value and
    the way out (a tensor learning rate)."""
    for message in run_nccl(_changed_lr, 1, FakeNccl()):
        assert "lr=torch.tensor" in message


def _marking(flag: list[bool]) -> type[SimulatedGraph]:
    """A simulated graph that sets ``flag[0]`` when capture starts (so a loss_fn can act inside capture only)."""

    class Marking(SimulatedGraph):
        def capture(self):
            flag[0] = True
            return super().capture()

    return Marking


def _host_sync_in_capture(comm) -> str:
    model, opt = _pair(comm, "ddp")
    x, y = _batches(comm.rank, 1)[0]

    def loss_fn(m, x, y):
        loss = _loss(m, x, y)
        if loss.item() > 1e9:  # a host read of a value the device has not computed yet
            raise AssertionError
        return loss

    with pytest.raises(CaptureError, match="_local_scalar_dense") as caught:
        gpudist.capture(model, opt, loss_fn, (x, y), graph=SimulatedGraph)
    return str(caught.value)


def _upload_in_capture(comm) -> str:
    model, opt = _pair(comm, "ddp")
    x, y = _batches(comm.rank, 1)[0]

    def loss_fn(m, x, y):
        return _loss(m, x, y) * torch.tensor(1.0)  # host data uploaded at every eager step

    with pytest.raises(CaptureError, match="lift_fresh") as caught:
        gpudist.capture(model, opt, loss_fn, (x, y), graph=SimulatedGraph)
    return str(caught.value)


def _pinned_in_capture(comm) -> str:
    model, opt = _pair(comm, "ddp")
    x, y = _batches(comm.rank, 1)[0]
    capturing = [False]

    def loss_fn(m, x, y):
        if capturing[0]:
            torch.empty(1, pin_memory=True)  # a host staging buffer made per step, as ZeRO's verdict once did
        return _loss(m, x, y)

    with pytest.raises(CaptureError, match="pinned host memory") as caught:
        gpudist.capture(model, opt, loss_fn, (x, y), graph=_marking(capturing))
    return str(caught.value)


def _unjoined_in_capture(comm) -> str:
    model, opt = _pair(comm, "ddp")
    x, y = _batches(comm.rank, 1)[0]
    capturing, extra, pending = [False], torch.ones(3), []

    def loss_fn(m, x, y):
        if capturing[0]:
            pending.append(comm.agreed.all_reduce(extra, async_op=True))  # forked, never waited inside capture
        return _loss(m, x, y)

    with pytest.raises(CaptureError, match="not joined back") as caught:
        gpudist.capture(model, opt, loss_fn, (x, y), graph=_marking(capturing))
    return str(caught.value)


@pytest.mark.parametrize("body", [_host_sync_in_capture, _upload_in_capture, _pinned_in_capture, _unjoined_in_capture])
def test_host_syncs_and_uploads_inside_capture_are_refused(body):
    """Catches a capture that silently bakes in a value read on the host (``.item()`` during capture reads memory
    the device has not written), a tensor made from host data (an upload CUDA refuses inside capture), a pinned
    host allocation (``cudaHostAlloc``, refused while a graph is captured), or a collective left in flight at the
    end of capture (its stream never joined back: ``cudaErrorStreamCaptureUnjoined``)."""
    for message in run_nccl(body, 1, FakeNccl()):
        assert "inside capture" in message or "capture stream" in message


def _mismatched(comm) -> str:
    model, opt = _pair(comm, "ddp")
    x, y = _batches(comm.rank, 1)[0]
    extra = torch.ones(3)
    capturing = [False]

    def loss_fn(m, x, y):
        if comm.rank == 1 and capturing[0]:
            comm.agreed.all_reduce(extra)  # only rank 1 captures this collective
        return _loss(m, x, y)

    with pytest.raises(CollectiveMismatchError, match="captured different collectives") as caught:
        gpudist.capture(model, opt, loss_fn, (x, y), graph=_marking(capturing))
    return str(caught.value)


def _reordered(comm) -> str:
    model, opt = _pair(comm, "ddp")
    x, y = _batches(comm.rank, 1)[0]
    a, b = torch.ones(3), torch.ones(5)
    capturing = [False]

    def loss_fn(m, x, y):
        if capturing[0]:  # the same two collectives on both ranks, in the other order on rank 1
            calls = [lambda: comm.agreed.all_reduce(a), lambda: comm.agreed.broadcast(b, 0)]
            for call in calls[:: 1 if comm.rank == 0 else -1]:
                call()
        return _loss(m, x, y)

    with pytest.raises(CollectiveMismatchError, match="captured different collectives") as caught:
        gpudist.capture(model, opt, loss_fn, (x, y), graph=_marking(capturing))
    return str(caught.value)


def test_ranks_that_capture_the_same_collectives_in_another_order_are_refused():
    """Catches a check that compares only what kinds and how many bytes each rank captured: the same collectives in
    another order pass it, and the graphs would pair rank 0's all-reduce with rank 1's broadcast (a hang, or
    buffers mixed up). The error names the first collective where the ranks differ."""
    for message in run_nccl(_reordered, 2, FakeNccl()):
        assert "is all_reduce of 12 bytes on rank 0 and broadcast of 20 bytes on rank 1" in message, message


def test_ranks_that_capture_different_collectives_are_refused_before_replay():
    """Catches a graph replayed while ranks recorded different collectives (NCCL would hang or mix buffers): the
    ranks compare what each captured and every rank raises, naming the ranks."""
    for message in run_nccl(_mismatched, 2, FakeNccl()):
        assert "rank 1" in message


def test_unsupported_optimizers_and_batches_are_refused_before_capture():
    """Catches a torch Adam captured with its step count on the host (every replay would reuse the captured step's
    bias correction), gpudist's ZeRO Adam wrapping one (its counts on the host too), its generic path (RMSprop:
    the skip decided on the host every step, a sync inside the graph), a strategy that also communicates over other
    groups (a hierarchical all-reduce, HSDP: their watchdogs would query events inside capture) or through a comm
    hook, or a batch off CUDA with no graph given: each refused with the way out."""
    comm = gpudist.InMemoryCommunicationBackend(0, 1)
    x, y = _batches(0, 1)[0]
    net = _net()
    with pytest.raises(ValueError, match="capturable=True"):
        gpudist.capture(net, torch.optim.Adam(net.parameters()), _loss, (x, y), graph=SimulatedGraph)
    config = gpudist.ShardingConfiguration(comm)
    model = gpudist.ZeRO2Model(_net(), config)
    opt = gpudist.ZeRO2Optimizer(torch.optim.AdamW(model.parameters()), config)
    with pytest.raises(ValueError, match=r"fused adamw keeps its step count on the host.*capturable=True"):
        gpudist.capture(model, opt, _loss, (x, y), graph=SimulatedGraph)
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)
    hierarchical = gpudist.DDPModel(_net(), config, hierarchical=gpudist.Topology(comm, ranks_per_node=1))
    hooked = gpudist.DDPModel(_net(), config)
    hooked.register_comm_hook(type("Hook", (), {"all_reduce": lambda self, i, t: None})())
    hsdp = gpudist.FSDPModel(_net(), config, replicate_group=gpudist.InMemoryCommunicationBackend(0, 1, group="r"))
    for model, match in ((hierarchical, "hierarchical=False"), (hooked, "comm hook"), (hsdp, "replicate_group")):
        with pytest.raises(ValueError, match=match):  # other groups, which capture neither pauses nor checks
            gpudist.capture(model, sgd(model), _loss, (x, y), graph=SimulatedGraph)
    model = gpudist.ZeRO1Model(_net(), config)
    opt = gpudist.ZeRO1Optimizer(torch.optim.RMSprop(model.parameters()), config)
    with pytest.raises(ValueError, match=r"steps torch.optim.RMSprop over its owned views.*capturable=True\) or SGD"):
        gpudist.capture(model, opt, _loss, (x, y), graph=SimulatedGraph)
    with pytest.raises(ValueError, match="CUDA graphs need CUDA tensors"):
        gpudist.capture(net, torch.optim.SGD(net.parameters(), lr=0.1), _loss, (x, y))


def test_a_batch_of_other_shapes_runs_eagerly_with_one_warning():
    """Catches a replay on a batch that does not fit the static inputs (a copy error, or silently the old batch)."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    x, y = _batches(0, 1)[0]
    step = gpudist.capture(net, opt, _loss, (x, y), graph=SimulatedGraph)
    with pytest.warns(UserWarning, match="runs eagerly"):
        step(x[:3], y[:3])
    step(x[:2], y[:2])
    step(x, y)
    assert (step.eager_steps, step.replays) == (2, 1)


def _mixed_shapes(comm, capture: bool) -> dict:
    """Six steps of ZeRO-2 with capturable AdamW and a scheduled tensor lr, the third and fifth on a smaller batch:
    captured (those two run eagerly between replays), or every one eager."""
    batches = _batches(comm.rank, WARMUP + 6)
    for i in (WARMUP + 2, WARMUP + 4):
        batches[i] = (batches[i][0][:3], batches[i][1][:3])
    model, opt = _pair(comm, "zero2", "adamw", static_graph=True)
    schedule = _scheduled(opt, "adamw")
    losses = []
    if capture:
        step = gpudist.capture(model, opt, _loss, batches[0], warmup=WARMUP, graph=SimulatedGraph)
    else:

        def step(x, y):
            opt.zero_grad(set_to_none=False)
            loss = _loss(model, x, y)
            loss.backward()
            opt.step()
            return loss

        for _ in range(WARMUP):
            step(*batches[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the eager fallback's warning (tested above)
        for x, y in batches[WARMUP:]:
            losses.append(step(x, y).item())
            schedule.step()
    return {"losses": losses, "params": _params(model), "steps": opt.state_dict()["steps"]}


def test_eager_steps_between_replays_share_the_device_counts():
    """A batch of another shape runs eagerly between replays: with capturable AdamW both kinds of step advance the
    same device count and read the same tensor lr, so the mix equals all-eager training bit for bit. Catches an
    eager fallback that counts on the host (the replays would then reuse a stale count), or a replay that misses the
    eager step's update."""
    for replayed, eager in zip(
        run_nccl(_mixed_shapes, 2, FakeNccl(), capture=True),
        run_nccl(_mixed_shapes, 2, FakeNccl(), capture=False),
        strict=True,
    ):
        assert replayed["losses"] == eager["losses"] and replayed["steps"] == eager["steps"] == [WARMUP + 6]
        for a, b in zip(replayed["params"], eager["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def _watched(comm) -> dict:
    model, opt = _pair(comm, "ddp")
    batches = _batches(comm.rank, 2)
    looks = []  # the watchdog's looks at the communicator (each poll's async-error check), and whether in capture
    check = comm._comm.check_async_error

    def counting_check():
        looks.append(comm._graph_events is not None)
        return check()

    comm._comm.check_async_error = counting_check
    inflight = {}

    class Slow(SimulatedGraph):
        def capture(self):
            @contextlib.contextmanager
            def slow():
                inflight["before"] = len(comm._inflight)
                with SimulatedGraph.capture(self):
                    yield
                    time.sleep(0.3)  # long enough for several watchdog polls inside capture
                    inflight["after"] = len(comm._inflight)

            return slow()

    step = gpudist.capture(model, opt, _loss, batches[0], graph=Slow)
    captured_inflight = inflight["after"] - inflight["before"]
    comm._rt.stuck = True  # the replay's event never completes: a peer died inside the graph
    comm.timeout = 0.5
    step(*batches[1])
    with pytest.raises(gpudist.CommunicationTimeoutError, match="captured step") as caught:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            comm.agreed.all_reduce(torch.ones(1))
            time.sleep(0.05)
    return {
        "captured_inflight": captured_inflight,
        "graph_events": len(comm.graph_events[-1]),
        "looks_in_capture": sum(looks),
        "looks": len(looks),
        "error": str(caught.value),
    }


def test_capture_pauses_the_watchdog_and_a_hung_replay_times_out_named():
    """Catches the watchdog querying events while a graph is captured (on a GPU that invalidates the capture), the
    graph's events handed to the watchdog or the event pool (they never complete as ops do), and a replay that hangs
    without an error (a peer dead inside the graph would block the rank forever)."""
    for r in run_nccl(_watched, 1, FakeNccl()):
        assert r["captured_inflight"] == 0 and r["graph_events"] > 0, r
        assert r["looks_in_capture"] == 0 and r["looks"] > 0, r
        assert "captured step" in r["error"] and "rank 0" in r["error"], r
