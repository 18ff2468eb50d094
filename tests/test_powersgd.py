"""PowerSGD (gpudist.compression.PowerSGDCompressor) and compressed buckets that overlap backward.

PowerSGD at full rank is dense averaging (``P P^T`` projects onto the whole column space), so it is compared with
single-process training within the float32 reference's own rounding (tests/tolerances.py); at low rank it is
compared with torch's ``powerSGD_hook`` on the example task. Overlapped compression runs the same stages in the same
order as the synchronous path, so it is compared bit for bit, and over the simulated NCCL (tests/fakenccl.py) its
collectives must be in flight while backward still enqueues compute.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpudist
from gpudist import (
    DDPModel,
    DDPOptimizer,
    GradientCompressionOptimizer,
    ReductionOperation,
    ShardingConfiguration,
    ZeRO1Model,
    ZeRO1Optimizer,
    ZeRO2Model,
    ZeRO2Optimizer,
)
from gpudist.comm.base import CommunicationBackend
from gpudist.compression import PowerSGDChannel, PowerSGDCompressor, parse_compressor
from gpudist.testing import run_ranks

from . import fakenccl
from .fakenccl import AsyncRuntime, FakeNccl, count_host_syncs, run_nccl, stream_trace
from .helpers import GPU_STEPS, average_rtol, gpu_batch, gpu_net
from .tolerances import assert_matches_reference, reference_pair

with torch.random.fork_rng(devices=[]):
    torch.manual_seed(0)
    _NET = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 2), nn.Tanh(), nn.Linear(2, 5), nn.LayerNorm(5))
"""Matrices 13 x 7 (taller than wide: rank 7 at full rank, Householder QR), 2 x 13 (wider than tall) and 5 x 2 (rank
2: Gram-Schmidt), and 1-D biases and LayerNorm weights (never compressed)."""

STEPS, GLOBAL_BATCH = 6, 12
FULL_RANK = PowerSGDCompressor(16, min_compression_rate=0)
"""Rank 16 >= every matrix's smaller side, and every matrix compressed (torch's default rate would send none)."""
LOW_RANK = PowerSGDCompressor(1, min_compression_rate=1)
"""Rank 1: all three matrices compressed, lossy."""
SETUPS = {"ddp": (DDPModel, DDPOptimizer), "zero1": (ZeRO1Model, ZeRO1Optimizer), "plain": (None, DDPOptimizer)}


def _net() -> nn.Module:
    return copy.deepcopy(_NET)  # one template: in-memory ranks are threads sharing torch's global RNG


def _batch(step: int, rank: int = 0, world: int = 1):
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randn(GLOBAL_BATCH, 5, generator=g)
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def _flat(values) -> torch.Tensor:
    return torch.cat([v.detach().reshape(-1) for v in values])


def _sgd(params) -> torch.optim.Optimizer:
    """Momentum SGD: a gradient error moves the parameters by lr times it. (Adam's first steps move every parameter
    by +-lr whatever the gradient's size, so a rounding-level difference in a near-zero gradient flips a whole step.)"""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _single_process(dtype=torch.float32) -> torch.Tensor:
    net = _net().to(dtype)
    opt = _sgd(net.parameters())
    for step in range(STEPS):
        x, y = _batch(step)
        F.mse_loss(net(x.to(dtype)), y.to(dtype)).backward()
        opt.step()
        opt.zero_grad()
    return _flat(net.parameters())


def _build(comm, setup: str, compressor, **kw):
    config = ShardingConfiguration(comm, bucket_cap_mb=0.0001, first_bucket_mb=0.00002)  # 3 buckets
    net = _net()
    model_cls, opt_cls = SETUPS[setup]
    model = model_cls(net, config) if model_cls is not None else net
    opt = GradientCompressionOptimizer(opt_cls(_sgd(model.parameters()), config), config, compressor, **kw)
    return net, model, opt


def _train(comm, setup="ddp", compressor=FULL_RANK, **kw):
    """Parameters after :data:`STEPS` steps, the gradients after every backward (before ``step``), and how many
    bucket all-reduces overlapped backward."""
    net, model, opt = _build(comm, setup, compressor, **kw)
    grads = []
    for step in range(STEPS):
        x, y = _batch(step, comm.rank, comm.world_size)
        F.mse_loss(model(x), y).backward()
        grads.append(_flat(p.grad for p in net.parameters()))
        opt.step()
        opt.zero_grad()
    return _flat(net.parameters()), grads, opt.hook.overlapped


# ------------------------------------------------------------------------------------------------------- the codec


def test_powersgd_spec_and_arguments():
    """Catches a ``"powersgd:RANK[:START_ITER]"`` spec that builds the wrong rank or warm-up, a bad rank accepted
    silently, and a start_iter that does not lengthen the optimizer's dense warm-up."""
    c = parse_compressor("PowerSGD:4:100")
    assert (type(c), c.rank, c.start_iter, c.min_compression_rate, c.warm_start) == (
        PowerSGDCompressor,
        4,
        100,
        2.0,
        True,
    )
    assert parse_compressor("powersgd:2").start_iter == 0
    for spec, match in [("powersgd", "not one of"), ("powersgd:0", "rank=0"), ("powersgd:2:-1", "start_iter=-1")]:
        with pytest.raises(ValueError, match=match):
            parse_compressor(spec)
    # torch's rule: a 64 x 64 matrix at rank 4 sends (64 + 64) 4 = 512 values < 4096 / 2; 8 x 8 at rank 4 does not.
    assert c.compresses(64, 64) and not c.compresses(8, 8) and c.matrix_rank(3, 64) == 3

    def rank(comm):
        _, _, opt = _build(comm, "ddp", PowerSGDCompressor(2, start_iter=5), warmup_steps=2)
        return opt.hook.warmup_steps

    assert run_ranks(rank, 2, "inmemory") == [5, 5]


def test_powersgd_refuses_reduce_scatter_setups():
    """ZeRO-2 (and a ZeRO optimizer's own reduce-scatter) would need a reduce-scatter of PowerSGD's factors, which
    it does not have: refused at construction with an error naming the fix, not at the first backward."""

    def rank(comm):
        config = ShardingConfiguration(comm)
        errors = []
        for make in (
            lambda: ZeRO2Optimizer(_sgd(ZeRO2Model(_net(), config).parameters()), config),
            lambda: ZeRO1Optimizer(_sgd(_net().parameters()), config),
        ):
            with pytest.raises(TypeError) as info:
                GradientCompressionOptimizer(make(), config, "powersgd:2")
            errors.append(str(info.value))
        return errors

    for error in run_ranks(rank, 2, "inmemory")[0]:
        assert "PowerSGD compresses all-reduces only" in error and "ZeRO1Model" in error


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_full_rank_powersgd_equals_dense_training(setup, world):
    """At full rank (every matrix compressed) PowerSGD is dense averaging: 6 momentum-SGD steps equal single-process
    training on the global batch, within 8x the float32 reference's own error against float64. Catches a missing or
    doubled 1/N (on the factors or the uncompressed part), P not summed over ranks before it is orthonormalized
    (each rank projecting on its own column space), Q not summed, a matrix written back transposed or at another
    offset, uncompressed tensors (biases, LayerNorm) left out, and a residual that does not vanish at full rank."""
    expected = reference_pair(_single_process)
    for params, _, _ in run_ranks(_train, world, "inmemory", setup=setup):
        assert_matches_reference(params, *expected, what=f"PowerSGD full rank, {setup}")


def _torch_hook_vs_gpudist(comm, steps: int, rank: int, start: int) -> dict[str, float]:
    """The example task (examples/lm.py's TinyLM on its synthetic corpus, momentum SGD) trained with torch DDP +
    ``powerSGD_hook`` and with gpudist's DDPModel + PowerSGD, same rank and steps; the mean loss of the last 20."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    from examples.lm import SyntheticCorpus, TinyLM, lm_loss

    corpus = SyntheticCorpus(0, 32)
    data = [corpus.batches(s, 16, comm.rank, comm.world_size) for s in range(steps)]
    out = {}
    for variant in ("torch", "gpudist", "gpudist-no-ef"):
        net = TinyLM(SyntheticCorpus.vocab_size, 32, 2, 4, 32, seed=0)
        if variant == "torch":
            model = DistributedDataParallel(net)
            state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=start)
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        else:
            config = ShardingConfiguration(comm)
            model = DDPModel(net, config)
            opt = GradientCompressionOptimizer(
                DDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), config),
                config,
                PowerSGDCompressor(rank, start_iter=start),
                error_feedback=variant == "gpudist",
            )
        losses = []
        for x, y in data:
            loss = lm_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        tail = torch.stack(losses[-20:]).mean()
        dist.all_reduce(tail)
        out[variant] = float(tail) / comm.world_size
    out["first"] = float(losses[0])
    return out


def test_low_rank_powersgd_converges_like_torchs_powersgd_hook():
    """The example task at rank 2 for 100 steps (10 dense first), on 2 Gloo processes: gpudist's final loss is within
    0.03 nats of torch's ``powerSGD_hook`` (measured: 0.0003 at 120 steps), and without error feedback it is
    measurably worse (measured +0.2). Catches error feedback that is not fed back, fed back with the wrong sign or
    scale, a warm start that restarts from noise, and a wrong matrix view of the tensors. The 0.03 nats bound a
    training outcome, not rounding: the two start from different random Q (torch's RNG, not gpudist's)."""
    result = run_ranks(_torch_hook_vs_gpudist, 2, "gloo", steps=100, rank=2, start=10)[0]
    assert result["torch"] < result["first"] - 1.0, result  # both really train
    assert abs(result["gpudist"] - result["torch"]) <= 0.03, result
    assert result["gpudist-no-ef"] >= result["gpudist"] + 0.05, result


# ------------------------------------------------------------------------------------------------------ checkpoints


def _steps(model, opt, comm, first: int, steps: int) -> None:
    for step in range(first, first + steps):
        x, y = _batch(step, comm.rank, comm.world_size)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _warm_state(opt, comm):
    """Each compressed parameter's Q (by bucket and offset), and the mean and mean magnitude of the ranks' worker
    residuals (what another world size must take back)."""
    qs, residuals = {}, []
    for key, channel in opt.hook.channels.items():
        assert isinstance(channel, PowerSGDChannel)
        qs.update({(key, o): q.clone() for o, q in channel.warm_start_state().items()})
        residuals.append(channel.worker_residual().clone())
    mean = torch.cat(residuals)
    magnitude = mean.abs()
    comm.all_reduce(mean, ReductionOperation.AVERAGE)
    comm.all_reduce(magnitude, ReductionOperation.AVERAGE)
    return qs, mean, magnitude


def _save_and_go_on(comm, path=None):
    """4 steps, a checkpoint and a state_dict; then 3 more steps. Returns the saved state and the parameters after."""
    net, model, opt = _build(comm, "ddp", LOW_RANK)
    _steps(model, opt, comm, 0, 4)
    gpudist.save_checkpoint(path, model, opt, step=4)
    saved = _warm_state(opt, comm)
    state = copy.deepcopy({"model": net.state_dict(), "opt": opt.state_dict()})
    _steps(model, opt, comm, 4, 3)
    return saved, state, _flat(net.parameters())


def _resume(comm, path=None, states=None):
    """Load the checkpoint at ``path`` (or this rank's state_dict of ``states``), then the 3 later steps."""
    net, model, opt = _build(comm, "ddp", LOW_RANK)
    if states is None:
        gpudist.load_checkpoint(path, model, opt)
    else:
        net.load_state_dict(states[comm.rank]["model"])
        opt.load_state_dict(states[comm.rank]["opt"])
    loaded = _warm_state(opt, comm)
    steps = opt.hook.steps
    _steps(model, opt, comm, 4, 3)
    return loaded, steps, _flat(net.parameters())


def test_powersgd_state_resumes_bit_identically_and_reshards(tmp_path):
    """PowerSGD's warm-start Q and worker residuals are part of the state. At the same world size, 3 more steps after
    loading the checkpoint (or a state_dict round trip) equal 3 more steps of the run that never stopped, bit for
    bit. Saved at N=4 and loaded at N=2: every Q is the same tensor (Q is equal on every rank) and the mean of the
    worker residuals (the pending update) is kept. Catches Q left out of checkpoints or state_dict (the power
    iteration restarts from noise and the next steps differ), Q attached to another parameter after resharding,
    and residuals lost."""
    saved = run_ranks(_save_and_go_on, 2, "inmemory", path=tmp_path / "w2")
    assert saved[0][0][0] and float(saved[0][0][1].abs().max()) > 0  # there is state to lose
    for states in (None, [state for _, state, _ in saved]):
        resumed = run_ranks(_resume, 2, "inmemory", path=tmp_path / "w2", states=states)
        for (_, _, after), (_, steps, params) in zip(saved, resumed, strict=True):
            assert steps == 4 and torch.equal(params, after), "checkpoint" if states is None else "state_dict"
    (qs, mean, magnitude), _, _ = run_ranks(_save_and_go_on, 4, "inmemory", path=tmp_path / "w4")[0]
    for (loaded_qs, loaded_mean, _), steps, _ in run_ranks(_resume, 2, "inmemory", path=tmp_path / "w4"):
        assert steps == 4 and set(loaded_qs) == set(qs)
        assert all(torch.equal(loaded_qs[k], qs[k]) for k in qs)
        # Both are fp32 means of the 4 saved residuals (the loader's sum / 4, the backend's AVERAGE).
        atol = 2 * average_rtol(4) * (1 + average_rtol(4)) * magnitude
        assert bool(((loaded_mean - mean).abs() <= atol).all())


# ------------------------------------------------------------------------------------------------------ overlap


@pytest.mark.parametrize("spec", ["topk:0.1", "int8", "1bit", "powersgd"])
def test_overlapped_compression_equals_the_synchronous_path(spec):
    """Compressed buckets launched during backward and finished by its end give the same gradients after every
    backward (before ``step``) and the same parameters, bit for bit, as buckets reduced synchronously when ready:
    DDP and ZeRO-1 at 2 and 3 ranks, and the plain-module path. Catches a decode that lands after ``backward()``
    returned (the optimizer would step on raw local gradients), stages run out of order across ranks (the
    collectives would pair up wrongly), a residual updated twice or from the wrong buffer, and a bucket left pending
    (its gradients never averaged). The overlap really happened: every DDP/ZeRO-1 bucket of every step was
    launched before backward ended."""
    compressor = LOW_RANK if spec == "powersgd" else spec
    for setup in SETUPS:
        for world in (2, 3) if setup != "plain" else (2,):
            sync = run_ranks(_train, world, "inmemory", setup=setup, compressor=compressor, overlap=False)
            overlapped = run_ranks(_train, world, "inmemory", setup=setup, compressor=compressor)
            for (p_sync, g_sync, n_sync), (p_over, g_over, n_over) in zip(sync, overlapped, strict=True):
                assert n_sync == 0 and n_over == (3 * STEPS if setup != "plain" else 0), (setup, n_over)
                assert all(torch.equal(a, b) for a, b in zip(g_sync, g_over, strict=True)), (setup, world)
                assert torch.equal(p_sync, p_over), (setup, world)
            assert not torch.equal(sync[0][0], run_ranks(_train, world, "inmemory", setup=setup)[0][0])


def _traced_step(comm, spec: str, overlap: bool) -> dict:
    """DDP + compression over the simulated NCCL: the steady-state step's enqueued compute, NCCL calls and waits
    (``("wait", op)``: the host, or on a GPU the compute stream, waits for an op), and its host syncs."""
    config = ShardingConfiguration(comm, bucket_cap_mb=0.0001, first_bucket_mb=0.00002)
    model = DDPModel(gpu_net(comm.device), config)
    compressor = PowerSGDCompressor(4, min_compression_rate=1) if spec == "powersgd" else spec
    opt = GradientCompressionOptimizer(
        DDPOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), config), config, compressor, overlap=overlap
    )
    for step in range(GPU_STEPS):
        with torch.no_grad():
            x, y = gpu_batch(step, comm.device, comm.rank, comm.world_size)
        with count_host_syncs() as syncs, stream_trace() as trace:
            loss = F.mse_loss(model(x), y)
            trace.mark("backward")
            loss.backward()
            trace.mark("step")
            opt.step()
            opt.zero_grad()
    return {"events": trace.between("backward", "step"), "syncs": dict(syncs.sites)}


@pytest.mark.parametrize(("spec", "collective"), [("topk:0.1", "allGather"), ("powersgd", "allReduce")])
def test_compressed_collective_is_in_flight_while_backward_computes(spec, collective, monkeypatch):
    """Over the simulated NCCL (ops run only when waited for), a steady-state backward enqueues the first bucket's
    compressed collective and then more backward matrix products before anything waits for it: on a GPU those
    products run while the compressed bucket is on the wire. With ``overlap=False`` the wait comes first (checked,
    so the test tells the two apart). Catches a hook that reduces (and waits) before returning to backward, and one
    that launches nothing until backward has ended. The overlapped step makes no host sync either."""
    real_wait = CommunicationBackend._wait

    def noted_wait(self, work, op):
        fakenccl._note("wait", op)
        return real_wait(self, work, op)

    monkeypatch.setattr(CommunicationBackend, "_wait", noted_wait)
    for overlap in (True, False):
        for r in run_nccl(_traced_step, 2, FakeNccl(timeout=60), runtime=AsyncRuntime, spec=spec, overlap=overlap):
            events = r["events"]
            first = events.index(("nccl", collective))
            waited = next(i for i in range(first, len(events)) if events[i][0] == "wait")
            computed = [i for i in range(first, len(events)) if events[i] == ("compute", "mm")]
            assert bool(computed) and (computed[0] < waited) == overlap, (overlap, events)
            if overlap:
                assert r["syncs"] == {}, r["syncs"]
