"""DDPModel + DDPOptimizer against single-process training on the global batch, and against torch DDP.

Tolerance for "same parameters": DDP's only arithmetic difference from one process is the order of the gradient
sum (per-rank means averaged vs one mean over the global batch). Results are compared with single-process training
in float64, within a multiple of the float32 single-process run's own error (tests/tolerances.py), so the bound
follows this CPU's rounding instead of a number that passed on one machine.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpudist
from gpudist import CommunicationError, DDPModel, DDPOptimizer, ShardingConfiguration, ZeRO2Model, ZeRO2Optimizer
from gpudist.flat import FlatLayout, vector_align
from gpudist.strategies import ddp as ddp_module
from gpudist.testing import run_ranks

from .backends import mpi_world
from .helpers import STEPS, Net, batch, flat, fresh_net, initial_state, single_process, train_steps
from .tolerances import assert_matches_reference, reference_pair, unit_roundoff

# ---------------------------------------------------------------------------------------------- rank functions


def train_ddp(comm, state, steps=STEPS, opt_name="adam", config_kw=None, wrap_model=True):
    config = ShardingConfiguration(comm, **(config_kw or {}))
    net = fresh_net(state)
    model = DDPModel(net, config) if wrap_model else net
    inner = {
        "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    }[opt_name](model.parameters())
    opt = DDPOptimizer(inner, config)
    per_step_bytes = []
    for step in range(steps):
        x, y = batch(step, comm.rank, comm.world_size)
        before = comm.stats.total_bytes
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        per_step_bytes.append(comm.stats.total_bytes - before)
    meta = model.get_model_metadata() if wrap_model else None
    return {
        "params": flat(net),
        "bytes": per_step_bytes,
        "meta": meta,
        "buckets": model.bucket_sizes() if wrap_model else None,
    }


def train_torch_ddp(comm, state, steps=STEPS):
    from torch.nn.parallel import DistributedDataParallel

    net = fresh_net(state)
    model = DistributedDataParallel(net, bucket_cap_mb=0.0002)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train_steps(model, opt, steps, comm.rank, comm.world_size)
    return flat(net)


PAIRS = {
    "ddp": (DDPModel, DDPOptimizer),
    "zero1": (gpudist.ZeRO1Model, gpudist.ZeRO1Optimizer),
    "zero2": (ZeRO2Model, ZeRO2Optimizer),
}
"""DDP, ZeRO-1 and ZeRO-2 share one reducer; ZeRO-2 copies each gradient into its bucket's send buffer as it
arrives."""


def accumulate(comm, state, micro_batches=3, strategy="ddp", last="synced backward"):
    config = ShardingConfiguration(comm, bucket_cap_mb=0.0002)
    model_cls, opt_cls = PAIRS[strategy]
    model = model_cls(fresh_net(state), config)
    opt = opt_cls(torch.optim.SGD(model.parameters(), lr=0.1), config)
    x, y = batch(0, comm.rank, comm.world_size)
    chunks = list(zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True))
    bytes_inside = comm.stats.total_bytes
    with model.no_sync():
        for cx, cy in chunks[:-1]:
            (F.mse_loss(model(cx), cy) / micro_batches).backward()
    bytes_inside = comm.stats.total_bytes - bytes_inside
    cx, cy = chunks[-1]
    if last == "synced backward":
        (F.mse_loss(model(cx), cy) / micro_batches).backward()
    else:  # every micro-batch under no_sync, then the average made explicitly
        with model.no_sync():
            (F.mse_loss(model(cx), cy) / micro_batches).backward()
        model.synchronize_gradients()
    opt.step()
    return flat(model.module), bytes_inside


def branch_step(comm, state, find_unused, strategy="ddp"):
    config = ShardingConfiguration(comm, find_unused_parameters=find_unused, bucket_cap_mb=0.0002)
    model_cls, opt_cls = PAIRS[strategy]
    model = model_cls(fresh_net(state, with_branch=True), config)
    opt = opt_cls(torch.optim.SGD(model.parameters(), lr=0.1), config)
    x, y = batch(0, comm.rank, comm.world_size)
    use_branch = comm.rank == 0  # only rank 0 uses the branch
    F.mse_loss(model(x, use_branch=use_branch), y).backward()
    opt.step()
    return flat(model.module)


# ---------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize(
    ("backend", "world"),
    [
        ("inmemory", 1),
        ("inmemory", 2),
        ("inmemory", 3),
        ("inmemory", 4),
        ("gloo", 2),
        pytest.param("gloo", 3, marks=pytest.mark.slow, id="gloo-3"),
        mpi_world(2),
        mpi_world(3, slow=True),
    ],
)
@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
def test_ddp_matches_single_process(backend, world, opt_name):
    """Catches a gradient summed instead of averaged (SGD sees it; Adam is nearly scale-invariant), a bucket
    reduced twice or never, gradients read before their all-reduce finished, and parameters not broadcast at
    wrap time: 10 steps on N ranks equal one process on the global batch, and every replica is bit-identical."""
    state = initial_state()
    config = {"bucket_cap_mb": 0.0001, "first_bucket_mb": 0.00002}  # ~100 B and ~20 B: three uneven buckets
    results = run_ranks(train_ddp, world, backend, state=state, config_kw=config, opt_name=opt_name)
    if opt_name == "adam":
        expected = reference_pair(single_process, state)
    else:
        expected = reference_pair(single_process, state, torch.optim.SGD, lr=0.1, momentum=0.9)
    for r in results:
        assert_matches_reference(r["params"], *expected)
        assert torch.equal(r["params"], results[0]["params"]), "replicas differ"
    assert len(results[0]["buckets"]) >= 3, "the tiny cap should give several buckets"


def test_ddp_matches_torch_ddp_on_gloo():
    """Catches semantic drift from PyTorch's own DDP (e.g. averaging vs summing, buffer handling): same seeds,
    same data, same Gloo ranks."""
    state = initial_state()
    ours = run_ranks(train_ddp, 2, "gloo", state=state)
    theirs = run_ranks(train_torch_ddp, 2, "gloo", state=state)
    expected = reference_pair(single_process, state)
    for a, b in zip(ours, theirs, strict=True):
        assert_matches_reference(b, *expected, what="torch DDP")  # the peer itself is within the bound
        assert_matches_reference(a["params"], *expected, what="gpudist DDP")


@pytest.mark.parametrize("wire", [None, torch.bfloat16])
def test_bytes_per_step_and_no_double_reduction(wire):
    """Catches DDPOptimizer reducing gradients that DDPModel already reduced (2x bytes), a bf16 wire that still
    sends fp32, and a bucket whose gradients are not on 16-byte starts: bytes per step equal one all-reduce of the
    gradient bucket in the wire dtype, each gradient at a multiple of 4 fp32 elements (the model's odd-sized
    tensors make that more than the parameter count), and the memory table counts the same bucket."""
    state = initial_state()
    n_params = sum(t.numel() for k, t in state.items())
    bucket = FlatLayout.of(list(state.values()), vector_align(torch.float32)).total  # one bucket at the default cap
    assert bucket > n_params, "the model should have tensors whose sizes are not multiples of 4"
    per_elem = 2 if wire is torch.bfloat16 else 4
    results = run_ranks(train_ddp, 2, "inmemory", state=state, steps=3, config_kw={"communication_dtype": wire})
    for r in results:
        assert r["buckets"] == [bucket * per_elem]
        assert r["bytes"] == [bucket * per_elem] * 3
        assert r["meta"]["bytes_per_step"] == bucket * per_elem
        assert r["meta"]["parameter_count"] == n_params and r["meta"]["strategy"] == "ddp"
        memory = r["meta"]["memory_per_rank"]
        assert memory["parameters"] == n_params * 4
        assert memory["gradients"] == bucket * 4  # gradients are the bucket views
        assert memory["optimizer_state"] >= 2 * n_params * 4  # Adam: exp_avg + exp_avg_sq (+ step scalars)
        assert memory["communication_buffers"] == (bucket * 2 if wire is torch.bfloat16 else 0)
    if wire is torch.bfloat16:  # bf16 gradients on the wire: close to fp32 training, not equal
        # Rounding a gradient to bf16 moves it by a relative u_bf16 = 2^-9; Adam's update is lr times a ratio of
        # moving averages of gradients, each off by at most a few u_bf16, so each step moves a parameter by at most
        # lr x (a few u_bf16) more than fp32 training: 3 steps, 8 u_bf16 per step.
        atol = 3 * 1e-2 * 8 * unit_roundoff(torch.bfloat16)
        torch.testing.assert_close(results[0]["params"], single_process(state, steps=3), rtol=0, atol=atol)


def test_ddp_optimizer_alone_averages_gradients():
    """Catches DDPOptimizer with a plain module skipping the reduction (replicas diverge) or not averaging."""
    state = initial_state()
    results = run_ranks(train_ddp, 3, "inmemory", state=state, wrap_model=False, opt_name="sgd")
    expected = reference_pair(single_process, state, torch.optim.SGD, lr=0.1, momentum=0.9)
    for r in results:
        assert_matches_reference(r["params"], *expected)


@pytest.mark.parametrize("last", ["synced backward", "synchronize_gradients"])
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
def test_no_sync_accumulation_equals_one_big_batch(strategy, last):
    """Catches no_sync communicating anyway, or the final synced backward reducing only its own micro-batch (ZeRO-2:
    copying only the last micro-batch's gradient into the send buffer); and ``synchronize_gradients()`` after the
    last no_sync micro-batch not averaging what was accumulated (ZeRO-2 raised a KeyError there: its send buffers
    were only ever filled by backward's hooks)."""
    state = initial_state()
    results = run_ranks(accumulate, 2, "inmemory", state=state, strategy=strategy, last=last)
    expected = reference_pair(single_process, state, torch.optim.SGD, steps=1, lr=0.1)
    for params, bytes_inside in results:
        assert bytes_inside == 0
        assert_matches_reference(params, *expected)


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_unused_parameters(strategy):
    """Catches a hang or silent skip when a parameter gets no gradient: without find_unused_parameters the error
    names the parameter; with it, the unused rank contributes zeros (ZeRO-2: a send-buffer slot no gradient wrote
    must be zeroed, not sent as whatever the memory held) and the replicas agree."""
    state = initial_state(with_branch=True)
    with pytest.raises(Exception, match=r"branch\.weight.*find_unused_parameters=True"):
        run_ranks(branch_step, 2, "inmemory", state=state, find_unused=False, timeout=5, strategy=strategy)
    # torch.empty then returns NaNs (torch.utils.deterministic.fill_uninitialized_memory): a slot nobody wrote shows up
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        results = run_ranks(branch_step, 2, "inmemory", state=state, find_unused=True, strategy=strategy)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert torch.equal(results[0], results[1])

    # The branch's gradient is rank 0's divided by 2 (rank 1 contributed zeros).
    def branch_after_step(dtype):
        net = fresh_net(state, with_branch=True).to(dtype)
        x, y = batch(0, 0, 2)
        F.mse_loss(net(x.to(dtype), use_branch=True), y.to(dtype)).backward()
        return net.branch.weight.detach() - 0.1 * net.branch.weight.grad / 2

    expected = reference_pair(branch_after_step)
    offset = sum(
        p.numel() for n, p in fresh_net(state, with_branch=True).named_parameters() if not n.startswith("branch")
    )
    got = results[0][offset : offset + expected[0].numel()].view_as(expected[0])
    assert_matches_reference(got, *expected)


def wrap_mismatched(comm):
    net = Net() if comm.rank == 0 else nn.Sequential(nn.Linear(7, 5))
    DDPModel(net, ShardingConfiguration(comm))


def skip_backward_on_rank1(comm, state):
    model = DDPModel(fresh_net(state), ShardingConfiguration(comm))
    x, y = batch(0, comm.rank, comm.world_size)
    if comm.rank == 0:
        F.mse_loss(model(x), y).backward()


def test_errors_surface_through_the_model():
    """Catches different models on different ranks slipping through (their buckets would mismatch and Gloo would
    abort), and a rank that never reduces hanging the others instead of timing out with a named op."""
    with pytest.raises(Exception, match=r"differ from rank \d's"):
        run_ranks(wrap_mismatched, 2, "inmemory")
    with pytest.raises(Exception, match=r"all_reduce.*(timed out|timeout)"):
        run_ranks(skip_backward_on_rank1, 2, "inmemory", timeout=2, state=initial_state())


def test_configuration_validation():
    """Catches nonsense settings reaching the strategies."""
    comm = gpudist.InMemoryCommunicationBackend(0, 1, group="cfg-test")
    with pytest.raises(ValueError, match="bucket_cap_mb=0"):
        ShardingConfiguration(comm, bucket_cap_mb=0)
    with pytest.raises(ValueError, match=r"communication_dtype=torch\.int8"):
        ShardingConfiguration(comm, communication_dtype=torch.int8)
    with pytest.raises(TypeError, match="CommunicationBackend"):
        ShardingConfiguration("gloo")
    with pytest.raises(ValueError, match="max_grad_norm=-1"):
        ShardingConfiguration(comm, max_grad_norm=-1)
    config = ShardingConfiguration(comm)
    with pytest.raises(TypeError, match=r"wraps an nn\.Module"):
        DDPModel("model", config)
    with pytest.raises(TypeError, match=r"wraps a torch.optim.Optimizer"):
        DDPOptimizer([1, 2], config)


def test_serialize_save_load_and_damage(tmp_path):
    """Catches a lossy round trip, a non-atomic or unverified file, and a damaged file changing the model."""
    comm = gpudist.InMemoryCommunicationBackend(0, 1, group="ser-test")
    config = ShardingConfiguration(comm)
    model = DDPModel(fresh_net(initial_state()), config)
    data = model.serialize()
    twin = DDPModel(Net(), config)
    twin.deserialize(data)
    assert torch.equal(twin.gather_full_parameters(), model.gather_full_parameters())
    path = tmp_path / "m.safetensors"
    model.save_model(path)
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x40  # one flipped bit in the last tensor
    path.write_bytes(bytes(raw))
    before = twin.get_parameters()
    twin.set_parameters(before + 1)
    changed = twin.get_parameters()
    with pytest.raises(ValueError, match="checksum mismatch"):
        twin.load_model(path)
    assert torch.equal(twin.get_parameters(), changed)
    with pytest.raises(ValueError, match="truncated or damaged"):
        twin.deserialize(data[: len(data) // 2])
    with pytest.raises(ValueError, match="1-D tensor of"):
        twin.set_parameters(torch.zeros(3))
    other = DDPModel(nn.Linear(2, 2), config)
    with pytest.raises(ValueError, match="does not match"):
        other.deserialize(data)
    clone = model.with_parameters(torch.zeros(model.parameter_count()))
    assert clone.gather_full_parameters().abs().sum() == 0 and model.gather_full_parameters().abs().sum() > 0


def optimize_with_early_stop(comm, state):
    config = ShardingConfiguration(comm)
    model = DDPModel(fresh_net(state), config)
    opt = DDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), config)  # lr 0: the loss never improves
    data = [batch(s, comm.rank, comm.world_size) for s in range(2)]
    result = opt.optimize(model, data, F.mse_loss, epochs=10, patience=2)
    vote = opt.should_early_stop(comm.rank == 0, require="any"), opt.should_early_stop(comm.rank == 0)
    return result, vote


def test_optimize_loop_and_early_stop_consensus():
    """Catches ranks stopping at different epochs (a hang at the next collective) and a wrong vote rule."""
    results = run_ranks(optimize_with_early_stop, 2, "inmemory", state=initial_state())
    for result, vote in results:
        assert result.stopped_early and result.epochs == 3 and result.steps == 6
        assert result.losses == results[0][0].losses
        assert vote == (True, False)


def optimizer_state_roundtrip(comm, state):
    config = ShardingConfiguration(comm)
    model = DDPModel(fresh_net(state), config)
    opt = DDPOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), config)
    x, y = batch(0, comm.rank, comm.world_size)
    model.train_step(x, y, F.mse_loss, opt)
    twin = DDPOptimizer(torch.optim.Adam(copy.deepcopy(model.module).parameters(), lr=1e-2), config)
    twin.deserialize(opt.serialize())
    a, b = opt.state_dict()["state"], twin.state_dict()["state"]
    return all(torch.equal(a[k]["exp_avg_sq"], b[k]["exp_avg_sq"]) for k in a) and len(a) == len(b)


def test_optimizer_serialize_roundtrip():
    """Catches optimizer state lost or reordered by serialize/deserialize."""
    assert run_ranks(optimizer_state_roundtrip, 1, "inmemory", state=initial_state()) == [True]


def test_lr_scheduler_accepts_the_wrapper():
    """Catches the wrapper not being a torch Optimizer (schedulers refuse it) or not sharing param_groups."""
    comm = gpudist.InMemoryCommunicationBackend(0, 1, group="sched-test")
    config = ShardingConfiguration(comm)
    model = DDPModel(Net(), config)
    opt = DDPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), config)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = batch(0)
    model.train_step(x, y, F.mse_loss, opt)
    sched.step()
    assert opt.optimizer.param_groups[0]["lr"] == 0.5


def grads_not_views(comm, state):
    return train_ddp(comm, state, config_kw={"gradient_as_bucket_view": False, "overlap_communication": False})


def test_without_bucket_views_or_overlap():
    """Catches the pack/unpack path (gradients not views into buckets) or the no-overlap path diverging."""
    state = initial_state()
    results = run_ranks(grads_not_views, 2, "inmemory", state=state)
    expected = reference_pair(single_process, state)
    for r in results:
        assert_matches_reference(r["params"], *expected)


def zero_grad_modes(comm, state, set_to_none, model_cls, opt_cls):
    config = ShardingConfiguration(comm, bucket_cap_mb=0.0002, first_bucket_mb=0.0001)
    model = model_cls(fresh_net(state), config)
    opt = opt_cls(torch.optim.Adam(model.parameters(), lr=1e-2), config)
    cleared = []
    for step in range(STEPS):
        x, y = batch(step, comm.rank, comm.world_size)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        grads = [p.grad for p in model.parameters()]
        cleared.append(all(g is None for g in grads) if set_to_none else all(not g.any() for g in grads))
    return flat(model.module), all(cleared)


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("pair", ["ddp", "zero1"])
def test_zero_grad_both_modes(set_to_none, pair):
    """Catches stale bucket contents leaking into the next step: set_to_none=True leaves the buckets unzeroed and
    relies on backward copying fresh gradients in (a skipped copy would add the previous step's gradients);
    set_to_none=False must zero the views in place. Both equal single-process training."""
    state = initial_state()
    classes = {"ddp": (DDPModel, DDPOptimizer), "zero1": (gpudist.ZeRO1Model, gpudist.ZeRO1Optimizer)}[pair]
    results = run_ranks(
        zero_grad_modes, 2, "inmemory", state=state, set_to_none=set_to_none, model_cls=classes[0], opt_cls=classes[1]
    )
    expected = reference_pair(single_process, state)
    for params, cleared in results:
        assert cleared, "zero_grad left gradients behind"
        assert_matches_reference(params, *expected)


def reductions_used(comm, state, views, set_to_none):
    """Train 3 steps (the last after a no_sync micro-batch) recording the reduction of every gradient all-reduce."""
    ops = []
    real, plan = comm.all_reduce, comm.plan_all_reduce

    def spy(tensor, op="sum", **kwargs):
        ops.append(gpudist.ReductionOperation.parse(op).name)
        return real(tensor, op, **kwargs)

    class Spied:  # a bucket's all-reduce, planned when it is built: its op, at every start
        def __init__(self, tensor, op="sum"):
            self.planned, self.name = plan(tensor, op), gpudist.ReductionOperation.parse(op).name

        def start(self):
            ops.append(self.name)
            return self.planned.start()

    spy_plan = Spied

    comm.all_reduce, comm.plan_all_reduce = spy, spy_plan
    config = ShardingConfiguration(comm, gradient_as_bucket_view=views, bucket_cap_mb=0.0002)
    model = DDPModel(fresh_net(state), config)
    opt = DDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), config)
    ops.clear()  # wrapping's own collectives (the model check) are not gradients
    for step in range(3):
        x, y = batch(step, comm.rank, comm.world_size)
        if step == 2:  # half the batch accumulated under no_sync, then the synced half
            with model.no_sync():
                F.mse_loss(model(x[:1]), y[:1]).mul(0.5).backward()
            F.mse_loss(model(x[1:]), y[1:]).mul(0.5).backward()
        else:
            F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return flat(model.module), ops


@pytest.mark.parametrize(
    ("tensors", "batched"), [("large", False), ("small", False), ("small", True)], ids=["large", "small", "batched"]
)
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("views", [True, False])
def test_gradients_are_averaged_where_it_costs_least(views, set_to_none, tensors, batched, monkeypatch):
    """On a transport without free averaging (Gloo, MPI, in-memory: AVERAGE is SUM and then a division pass), a
    bucket of large tensors has the 1/N ride on the copy of each gradient into its bucket (fresh gradients), or on
    one scaling pass where backward accumulated into the bucket view in place, and its wire is SUMmed; a bucket of
    small tensors (``_SCALED_COPY_MIN_NUMEL``: the host's time per scaled copy costs more than the division pass)
    copies plain and is all-reduced with AVERAGE; without views the pack scales, and the wire is SUMmed.
    ``batched``: the fresh gradients of a bucket go into their views in one multi-tensor copy at its launch (what a
    GPU does; forced here on CPU). Catches the wrong reduction for the bucket, a 1/N applied twice or not at all on
    any path, and a gradient the batched copy misses (the SGD parameters would differ)."""
    monkeypatch.setattr(ddp_module, "_SCALED_COPY_MIN_NUMEL", 0 if tensors == "large" else 10**9)
    monkeypatch.setattr(ddp_module, "_BATCHED_COPY_DEVICES", {"cpu"} if batched else set())
    state = initial_state()
    results = run_ranks(reductions_used, 2, "inmemory", state=state, views=views, set_to_none=set_to_none)
    expected_ops = {"AVERAGE"} if views and tensors == "small" else {"SUM"}

    def reference(dtype):
        net = fresh_net(state).to(dtype)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(3):
            x, y = (t.to(dtype) for t in batch(step))
            per_rank = [F.mse_loss(net(x[r * 6 : r * 6 + 6]), y[r * 6 : r * 6 + 6]) for r in range(2)]
            if step == 2:  # each rank's loss was the mean of two halves of its slice
                per_rank = [
                    0.5 * F.mse_loss(net(x[r * 6 : r * 6 + 1]), y[r * 6 : r * 6 + 1])
                    + 0.5 * F.mse_loss(net(x[r * 6 + 1 : r * 6 + 6]), y[r * 6 + 1 : r * 6 + 6])
                    for r in range(2)
                ]
            (sum(per_rank) / 2).backward()
            opt.step()
            opt.zero_grad()
        return flat(net)

    expected = reference_pair(reference)
    for params, ops in results:
        assert ops and set(ops) == expected_ops, f"gradient all-reduces used {sorted(set(ops))}"
        assert_matches_reference(params, *expected)


def bn_net(state=None) -> nn.Module:
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    if state is not None:
        net.load_state_dict(state)
    return net


def bn_input(rank: int) -> torch.Tensor:
    return torch.randn(8, 3, generator=torch.Generator().manual_seed(rank)) + rank  # statistics differ per rank


def batchnorm_buffers(comm, state):
    model = DDPModel(bn_net(state), ShardingConfiguration(comm))
    x = bn_input(comm.rank)
    model(x).sum().backward()
    before = comm.stats.total_bytes
    model.predict(x)  # eval, no grad: must not communicate
    predicted_bytes = comm.stats.total_bytes - before
    model(x)  # the next training forward adopts rank 0's running statistics first
    return model.module[1].running_mean.clone(), predicted_bytes


def test_buffers_follow_rank0_and_predict_is_local():
    """Catches replicas drifting apart through BatchNorm buffers (each rank keeping its own statistics), and
    predict() starting a collective (a hang when only one rank evaluates)."""
    torch.manual_seed(0)
    state = bn_net().state_dict()
    (_, bytes0), (mean1, bytes1) = run_ranks(batchnorm_buffers, 2, "inmemory", state=state)
    assert bytes0 == bytes1 == 0

    # After rank 1's second forward: 0.9 x (rank 0's running mean after one step) + 0.1 x rank 1's batch mean.
    def running_mean(dtype):
        net = bn_net(state).to(dtype)
        with torch.no_grad():
            a0, a1 = (net[0](bn_input(r).to(dtype)).mean(0) for r in (0, 1))
        return 0.9 * (0.1 * a0) + 0.1 * a1

    assert_matches_reference(mean1, *reference_pair(running_mean), what="running_mean")


def test_communication_failure_is_a_communication_error():
    """The error class users catch: mismatches and timeouts are CommunicationErrors."""
    assert issubclass(gpudist.CommunicationTimeoutError, CommunicationError)


def _grad_addresses(comm, dtype: torch.dtype, strategy: str) -> dict:
    net = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 7), nn.Linear(7, 1)).to(dtype)  # odd sizes: 15, 3, 21, 7, 7, 1
    values = torch.Generator().manual_seed(0)  # the ranks are threads: not torch's one global generator
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=values) * 0.5)
    model_cls, opt_cls = gpudist.strategies.DATA_PARALLEL_PAIRS[strategy]
    config = ShardingConfiguration(comm, bucket_cap_mb=0.0001, first_bucket_mb=0.00002)  # several buckets
    model = model_cls(net, config)
    opt = opt_cls(torch.optim.SGD(model.parameters(), lr=0.1), config)
    for step in range(2):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * step + comm.rank)).to(dtype)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return {
        "offsets": [p.grad.data_ptr() - model.flat_grads.data_ptr() for p in model.module.parameters()],
        "buckets": len(model._buckets),
        "params": [p.detach().float().clone() for p in model.module.parameters()],
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ddp_gradients_start_on_16_byte_boundaries(dtype):
    """Catches DDP buckets laid out back to back (an odd-sized tensor puts every later gradient off the 128-bit
    vector path of the copies and kernels over the bucket, bf16 most), and padding that breaks training (ZeRO-1,
    which shares the flat order with its optimizer, stays back to back): every gradient of a model with odd-sized
    tensors starts at a multiple of 16 bytes in the gradient buffer, over several buckets, and the same two steps
    as ZeRO-1 (unaligned) give the same parameters."""
    ddp = run_ranks(_grad_addresses, 2, "inmemory", dtype=dtype, strategy="ddp")
    zero1 = run_ranks(_grad_addresses, 2, "inmemory", dtype=dtype, strategy="zero1")
    assert ddp[0]["buckets"] >= 2
    assert all(offset % 16 == 0 for offset in ddp[0]["offsets"]), ddp[0]["offsets"]
    assert any(offset % 16 for offset in zero1[0]["offsets"]), "ZeRO-1's gradients follow its flat parameter order"
    if dtype != torch.float32:  # bf16: ZeRO-1 steps an fp32 master, DDP's SGD the bf16 parameters (not comparable)
        assert all(p.isfinite().all() for p in ddp[0]["params"])
        return
    for a, b in zip(ddp[0]["params"], zero1[0]["params"], strict=True):  # the same arithmetic: bit for bit
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _packed_buckets(comm) -> list[bool]:
    net = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 7), nn.Linear(7, 1))  # odd sizes: gaps in every bucket
    config = ShardingConfiguration(comm, gradient_as_bucket_view=False, bucket_cap_mb=0.0001, first_bucket_mb=0.00002)
    model = DDPModel(net, config)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(comm.rank))
    model(x).square().mean().backward()
    return [
        torch.equal(view, p.grad) for b in model._buckets for p, view in zip(b.params, b.grads.views(), strict=True)
    ]


def test_packed_ddp_buckets_follow_their_aligned_layout():
    """Catches the pack without gradient views laying gradients back to back in a bucket whose layout (its views, the
    comm hook's spans) puts each on a 16-byte start: after backward every bucket view equals its parameter's
    (reduced) gradient."""
    for matches in run_ranks(_packed_buckets, 2, "inmemory"):
        assert matches and all(matches), matches
