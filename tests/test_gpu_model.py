"""Every strategy over the simulated NCCL on a GPU-like device (tests/fakenccl.py's :class:`AsyncRuntime`): NCCL calls
are enqueued on ordered communication-stream queues and run only when something waits for them, buffers of ops in
flight are checked, and the host's syncs and the order of what it enqueues are recorded per rank.

For each strategy (the data-parallel ones, DDP with gradient compression, pipeline, tensor and 3D hybrid), one run
per world size is shared by the tests (:func:`_run`): it trains to the single-process result; a steady-state step
(the last one) makes at most its budgeted host syncs and, for the data-parallel family, one NCCL call per bucket or
unit collective whatever the ranks' shares; communication is enqueued while the backward (and, for ZeRO-3/FSDP,
the forward) is still enqueueing compute. A rank whose peer stops calling shuts down within the op timeout.
"""

from __future__ import annotations

import collections
import functools
import threading
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpudist
from examples.lm import TinyLM, as_sequential, tinylm_plan
from gpudist import (
    HybridShardedModel,
    HybridShardedOptimizer,
    PipelineParallelModel,
    ShardingConfiguration,
    TensorParallelModel,
)
from gpudist.comm import CommunicationError, CommunicationTimeoutError
from gpudist.strategies import DATA_PARALLEL_PAIRS, GradientCompressionOptimizer

from .fakenccl import AsyncRuntime, FakeNccl, count_host_syncs, run_nccl, stream_trace
from .helpers import (
    GPU_STEPS,
    HYBRID_STEPS,
    TP_LM,
    TP_OPTIMIZERS,
    check_training,
    global_batch,
    gpu_batch,
    gpu_net,
    gpu_reference,
    hybrid_batch,
    hybrid_lm,
    hybrid_optimizer,
    hybrid_reference,
    mlp,
    pipeline_reference,
    tp_lm_batch,
    tp_single_process_lm,
)
from .tolerances import assert_matches_reference, reference_pair

DATA_PARALLEL = ["ddp", "zero1", "zero2", "zero3", "fsdp", "compression"]
STRATEGIES = [*DATA_PARALLEL, "pipeline", "tensor", "hybrid"]
WORLD = {"hybrid": 8}  # pp=2 x dp=2 x tp=2; every other strategy runs on 2 ranks
PIPELINE_STEPS = TP_STEPS = 3

HOST_SYNC_BUDGET = {
    # The data-parallel family: none. ZeRO's norm, clip coefficient and skip flag stay on the device (the fused
    # kernels take them as tensors); the verdict reaches the host by a non-blocking copy, read steps later.
    "ddp": 0,
    "zero1": 0,
    "zero2": 0,
    "zero3": 0,
    "fsdp": 0,
    "compression": 0,
    # The stages after the first read the step's first message on the host (pipeline/p2p.py decode_spec: the
    # structure, shapes and dtypes of the activations, which may change from step to step) to allocate the buffers
    # they receive into; the loss stays on the device (train_step returns it as a tensor).
    "pipeline": 1,
    # None: tensor-parallel activations' collectives skip the per-op signature check where it costs a host sync
    # (tensor/mappings.py activation_check).
    "tensor": 0,
    # The pipeline's decode_spec; the loss's average over replicas runs unchecked (one float64, by construction).
    "hybrid": 1,
}
"""Host syncs per rank in a steady-state training step (the most any rank makes). The target is 0 unless
documented; where today's code makes more, the budget is what it makes (measured), with where each comes from."""

GRADIENT_COLLECTIVE = {
    "ddp": "allReduce",
    "zero1": "allReduce",
    "zero2": "reduceScatter",
    "zero3": "reduceScatter",
    "fsdp": "reduceScatter",
    "compression": "allGather",  # the compressed payloads (and their scales), gathered per bucket
}

# The net has 6 parameters (3 Linear layers); bucket_cap_mb=0.0001 with a 0.00002 MB first bucket makes 5 buckets,
# and ZeRO-3/FSDP (wrapping each Linear) have 3 units. One NCCL call per bucket or unit collective, plus ZeRO's
# all-reduce of the squared gradient norm; ZeRO-3/FSDP gather each unit again in backward.
CALLS_PER_STEP = {
    "ddp": {"allReduce": 5},
    "zero1": {"allReduce": 5 + 1, "allGather": 1},
    "zero2": {"reduceScatter": 5, "allReduce": 1, "allGather": 5},
    "zero3": {"allGather": 3 + 3, "reduceScatter": 3, "allReduce": 1},
    "fsdp": {"allGather": 3 + 3, "reduceScatter": 3, "allReduce": 1},
    "compression": {"allGather": 2 * 5},  # top-k's values and indices, per bucket
}
FAN_OUT = {"reduce", "broadcast", "send", "recv"}  # what an uneven collective fans out into, one per rank


def _observed(steps: int, step) -> list[tuple[collections.Counter, list[tuple[str, str]]]]:
    """Run ``step(i, trace)`` for each step, counting its host syncs and recording what it enqueued, in order."""
    seen = []
    for i in range(steps):
        with count_host_syncs() as syncs, stream_trace() as trace:
            trace.mark("start")
            step(i, trace)
            trace.mark("end")
        seen.append((syncs.sites, trace.events))
    return seen


def _runtime_counts(comm) -> dict:
    rt = comm._rt
    return {"joins": rt.joins, "ops": rt.ops}


def _train_data_parallel(comm, strategy: str, spec: str = "topk:1.0", capturable: bool = False) -> dict:
    config = gpudist.ShardingConfiguration(comm, bucket_cap_mb=0.0001, first_bucket_mb=0.00002)
    model_cls, opt_cls = DATA_PARALLEL_PAIRS["ddp" if strategy == "compression" else strategy]
    wrap = {"auto_wrap_policy": {nn.Linear}} if strategy == "fsdp" else {}  # units to gather, as ZeRO-3's default
    model = model_cls(gpu_net(comm.device), config, **wrap)
    # capturable: the step counts and bias corrections on the device, the learning rate a device tensor
    adam = {"lr": torch.tensor(1e-2), "capturable": True} if capturable else {"lr": 1e-2}
    opt = opt_cls(torch.optim.Adam(model.parameters(), **adam), config)
    if strategy == "compression":
        opt = GradientCompressionOptimizer(opt, config, spec)  # topk:1.0, k = n: lossless, so it trains as DDP

    def step(i, trace):
        with torch.no_grad():  # the batch is input, not compute of the step
            x, y = gpu_batch(i, comm.device, comm.rank, comm.world_size)
        trace.mark("forward")
        loss = F.mse_loss(model(x), y)
        trace.mark("backward")
        loss.backward()
        trace.mark("step")
        opt.step()
        opt.zero_grad()

    seen = _observed(GPU_STEPS, step)
    return {"params": model.gather_full_parameters().cpu(), "seen": seen, "runtime": _runtime_counts(comm)}


def _train_pipeline(comm) -> dict:
    model = PipelineParallelModel(mlp(), ShardingConfiguration(comm), micro_batches=4, schedule="1f1b")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    seen = _observed(PIPELINE_STEPS, lambda i, _: losses.append(model.train_step(*global_batch(i), F.mse_loss, opt)))
    return {"params": model.gather_full_parameters(), "losses": losses, "seen": seen, "runtime": _runtime_counts(comm)}


def _train_tensor(comm) -> dict:
    x, y = tp_lm_batch()
    model = TensorParallelModel(TinyLM(**TP_LM), ShardingConfiguration(comm), tinylm_plan, tensor_parallel_size=2)
    opt = TP_OPTIMIZERS["adamw"](model.parameters())
    losses = []
    seen = _observed(TP_STEPS, lambda i, _: losses.append(model.train_step(x, y, optimizer=opt)))
    return {"params": model.gather_full_parameters(), "losses": losses, "seen": seen, "runtime": _runtime_counts(comm)}


def _train_hybrid(comm) -> dict:
    config = ShardingConfiguration(comm)
    model = HybridShardedModel(hybrid_lm(), config, 2, 2, 2, plan=tinylm_plan, blocks=as_sequential, micro_batches=2)
    opt = HybridShardedOptimizer(hybrid_optimizer(model.parameters(), "adamw"), config, 2, 2, 2, zero_stage=2)
    d, losses = model.data_parallel_rank, []

    def step(i, _):
        x, y = hybrid_batch(i)
        n = x.shape[0] // model.data_parallel_size
        losses.append(model.train_step(x[d * n : (d + 1) * n], y[d * n : (d + 1) * n], optimizer=opt))

    seen = _observed(HYBRID_STEPS, step)
    return {"params": model.gather_full_parameters(), "losses": losses, "seen": seen, "runtime": _runtime_counts(comm)}


@functools.cache
def _run(strategy: str, world: int | None = None, **kw) -> tuple[list[dict], list[str]]:
    """Each rank's results of ``strategy`` trained over the simulated NCCL on :class:`AsyncRuntime`s, and the errors
    the simulated streams reported (shared by the tests: one run per strategy and world size)."""
    fake = FakeNccl(timeout=60)
    world = world or WORLD.get(strategy, 2)
    if strategy in DATA_PARALLEL:
        results = run_nccl(_train_data_parallel, world, fake, runtime=AsyncRuntime, strategy=strategy, **kw)
    else:
        fn = {"pipeline": _train_pipeline, "tensor": _train_tensor, "hybrid": _train_hybrid}[strategy]
        results = run_nccl(fn, world, fake, runtime=AsyncRuntime)
    return results, list(fake.stream_errors)


def _steady(result: dict) -> tuple[collections.Counter, list[tuple[str, str]]]:
    return result["seen"][-1]


def _calls(events, start: str = "start", end: str = "end") -> collections.Counter:
    at = events.index(("mark", start))
    return collections.Counter(name for kind, name in events[at : events.index(("mark", end), at)] if kind == "nccl")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_trains_to_the_single_process_result_on_an_asynchronous_device(strategy):
    """NCCL ops complete only when something waits for them, so a strategy that reads an op's output (or writes its
    input) before waiting on its Work trains on stale values and misses the single-process result, or is stopped by
    the stream's buffer check. Catches, too, an op issued without first joining the current stream (the runtime
    refuses it; ``joins >= ops`` below)."""
    results, errors = _run(strategy)
    assert errors == []
    for r in results:
        assert r["runtime"]["joins"] >= r["runtime"]["ops"] > 0, r["runtime"]
    if strategy in DATA_PARALLEL:
        expected = reference_pair(gpu_reference, "cpu")
        for r in results:
            assert_matches_reference(r["params"], *expected)
    elif strategy == "pipeline":
        want = reference_pair(pipeline_reference, steps=PIPELINE_STEPS)
        for r in results:
            check_training(r["params"], r["losses"], want)
    else:
        if strategy == "tensor":
            (losses32, params32), (losses64, params64) = reference_pair(tp_single_process_lm, "adamw", TP_STEPS)
        else:
            (params32, losses32), (params64, losses64) = reference_pair(hybrid_reference, "adamw")
        for r in results:
            assert_matches_reference(r["params"], params32, params64, what="parameters")
            assert_matches_reference(r["losses"], losses32, losses64, what="losses")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_steady_state_step_stays_within_its_host_sync_budget(strategy):
    """A host sync (``.item()``, ``bool()``/``float()`` of a tensor, ``.cpu()``/``.tolist()``, ``synchronize()``)
    stops the host until the device has caught up: nothing is enqueued meanwhile, so the GPU idles once per sync.
    Catches a new ``.item()`` or validated (signature-checked) op in a step, and shows where each sync comes from."""
    results, _ = _run(strategy)
    for rank, r in enumerate(results):
        sites = _steady(r)[0]
        assert sum(sites.values()) <= HOST_SYNC_BUDGET[strategy], (rank, dict(sites))


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "fsdp"])
def test_capturable_adam_counts_on_the_device_with_no_host_sync(strategy):
    """ZeRO's Adam built with ``capturable=True`` (a tensor learning rate): its steady-state step on the simulated
    device makes no host sync and trains to the single-process result. Catches a device count or coefficient read
    back on the host (a sync per step, and inside a captured graph a failure), and a learning rate or count the
    asynchronous device sees stale."""
    results, errors = _run(strategy, capturable=True)
    assert errors == []
    expected = reference_pair(gpu_reference, "cpu")
    for r in results:
        assert sum(_steady(r)[0].values()) == 0, dict(_steady(r)[0])
        assert_matches_reference(r["params"], *expected)


@pytest.mark.parametrize("mode", ["exact", "threshold"])
def test_lossy_topk_compression_makes_no_host_sync(mode, monkeypatch):
    """Top-k at 30% on the asynchronous device, with the kernels' torch references (``GPUDIST_KERNELS=torch``: the
    GPU's selection in torch ops; the CPU's own threshold path reads its candidate count on the host, where that
    costs nothing): catches a count or a data-dependent shape read back on the way to the gathers in either mode
    (the threshold mode's candidate count once was)."""
    monkeypatch.setenv("GPUDIST_KERNELS", "torch")
    results = run_nccl(_train_data_parallel, 2, FakeNccl(timeout=60), runtime=AsyncRuntime, strategy="compression",
                       spec=f"topk:0.3:{mode}")  # fmt: skip
    for rank, r in enumerate(results):
        sites = _steady(r)[0]
        assert sum(sites.values()) == 0, (rank, dict(sites))
        assert _calls(_steady(r)[1]) == CALLS_PER_STEP["compression"]


@pytest.mark.parametrize("world", [2, 3], ids=["even-shards", "uneven-shards"])
@pytest.mark.parametrize("strategy", DATA_PARALLEL)
def test_one_nccl_call_per_bucket_or_unit_collective(strategy, world):
    """A steady-state step makes one NCCL call per bucket (DDP, ZeRO-1/2, compression) or unit (ZeRO-3/FSDP)
    collective, however the ranks' shares fall: at 3 ranks the shards of these buckets and units are uneven. Catches
    an uneven reduce-scatter or all-gather fanned out into one grouped reduce or broadcast per rank (N kernel launches
    and N x the latency per collective), per-parameter collectives, and a per-step collective left validated (one
    more all-gather each)."""
    results, _ = _run(strategy, world)
    for r in results:
        calls = _calls(_steady(r)[1])
        assert not FAN_OUT & set(calls), dict(calls)
        assert calls == CALLS_PER_STEP[strategy], dict(calls)


@pytest.mark.parametrize("strategy", DATA_PARALLEL)
def test_gradient_communication_overlaps_the_backward(strategy):
    """The first gradient collective of a steady-state backward is enqueued while the backward still has matrix
    products (earlier layers' gradients) to enqueue: on a GPU it runs beside them. Catches a strategy that launches
    every collective at the end of backward (or after it), leaving the communication exposed."""
    results, _ = _run(strategy)
    for r in results:
        events = _steady(r)[1]
        backward = events[events.index(("mark", "backward")) : events.index(("mark", "step"))]
        first = backward.index(("nccl", GRADIENT_COLLECTIVE[strategy]))
        assert ("compute", "mm") in backward[first:], " ".join(n for _, n in backward)


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_next_unit_is_gathered_before_this_units_forward_compute(strategy):
    """ZeRO-3/FSDP prefetch: before the first unit's matrix product is enqueued, the second unit's all-gather is
    already enqueued, so it runs beside that compute. Catches a forward that gathers each unit only when it starts
    (every all-gather then sits on the critical path)."""
    results, _ = _run(strategy)
    for r in results:
        events = _steady(r)[1]
        forward = events[events.index(("mark", "forward")) : events.index(("mark", "backward"))]
        first_compute = forward.index(("compute", "addmm"))
        assert forward[:first_compute].count(("nccl", "allGather")) >= 2, " ".join(n for _, n in forward)


TIMEOUT = 0.5
SLACK = 10.0  # the watchdog polls every 50 ms; two shared cores can be slow; a hang lasts the fake's 30 s


def _peer_dies(comm, strategy: str, survivor_done: threading.Event) -> dict:
    """Both ranks build the model and take a step; then rank 1 stops calling (it hangs until rank 0 is done, so its
    own shutdown plays no part), and rank 0 takes another step and shuts down."""
    comm.timeout = TIMEOUT  # before any sub-group is made: they take it over
    config = gpudist.ShardingConfiguration(comm)
    if strategy == "pipeline":
        model = PipelineParallelModel(mlp(), config, micro_batches=2)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        step = lambda i: model.train_step(*global_batch(i), F.mse_loss, opt)
    elif strategy == "tensor":
        model = TensorParallelModel(TinyLM(**TP_LM), config, tinylm_plan, tensor_parallel_size=2)
        opt = TP_OPTIMIZERS["adamw"](model.parameters())
        step = lambda i: model.train_step(*tp_lm_batch(), optimizer=opt)
    else:
        model_cls, opt_cls = DATA_PARALLEL_PAIRS[strategy]
        model = model_cls(gpu_net(comm.device), config)
        opt = opt_cls(torch.optim.Adam(model.parameters(), lr=1e-2), config)

        def step(i):
            x, y = gpu_batch(i, comm.device, comm.rank, comm.world_size)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    step(0)
    if comm.rank == 1:
        survivor_done.wait(60)
        return {}
    try:
        start, error = time.monotonic(), None
        try:
            step(1)
            comm.barrier()  # the step's last wait may have been released by the abort: the next call raises
        except CommunicationError as e:
            error = e
        failed = time.monotonic()
        comm.shutdown()
        return {"error": error, "failed_after": failed - start, "shutdown": time.monotonic() - failed}
    finally:
        survivor_done.set()


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3", "fsdp", "pipeline", "tensor"])
def test_a_dead_peer_fails_the_next_step_within_the_timeout(strategy):
    """A peer stops calling mid-training: rank 0's next step blocks on an op the peer never joins; the watchdog
    aborts the communicator after the timeout, and the step (or the next call) raises CommunicationTimeoutError
    naming the op, instead of hanging. Catches a wait with no timeout on the device, and an abort that leaves the
    stream stuck (the simulated NCCL would only give up after 30 s)."""
    survivor, _ = run_nccl(
        _peer_dies, 2, FakeNccl(timeout=30), runtime=AsyncRuntime, strategy=strategy, survivor_done=threading.Event()
    )
    assert isinstance(survivor["error"], CommunicationTimeoutError), survivor
    assert "timed out" in str(survivor["error"]), survivor
    assert survivor["failed_after"] < TIMEOUT + SLACK and survivor["shutdown"] < SLACK, survivor


def _shutdown_with_an_op_in_flight(comm, survivor_done: threading.Event) -> float:
    comm.timeout = TIMEOUT
    comm.all_reduce(torch.ones(3))
    if comm.rank == 1:
        survivor_done.wait(60)
        return 0.0
    try:
        with comm.unchecked():  # no signature check: the op itself is left in flight
            comm.all_reduce(torch.ones(3), async_op=True)  # the peer never joins it
        start = time.monotonic()
        comm.shutdown()
        assert not comm.healthy and comm._comm._closed  # aborted: ncclCommAbort released the stuck kernel
        return time.monotonic() - start
    finally:
        survivor_done.set()


def test_shutdown_with_an_op_in_flight_to_a_dead_peer_returns_by_its_deadline():
    """Shutdown right after enqueueing an op whose peer is gone: the op never completes on its own. Catches a
    shutdown that synchronizes the device or waits for the op without bound (30 s here, forever on a GPU): it must
    abort the communicator once the op's deadline has passed."""
    took, _ = run_nccl(
        _shutdown_with_an_op_in_flight, 2, FakeNccl(timeout=30), runtime=AsyncRuntime, survivor_done=threading.Event()
    )
    assert took < TIMEOUT + SLACK, took
