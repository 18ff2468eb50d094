"""ZeRO-1 and ZeRO-2 (model + optimizer pairs) against single-process training and torch's ZeroRedundancyOptimizer.

Same model, data and tolerance as tests/test_ddp.py (see its docstring): 10 steps on N ranks are compared with one
process on the global batch in float64, within a multiple of the float32 single-process run's own error
(tests/tolerances.py). Besides the order of the gradient sums, the fused optimizer kernels on CPU run torch's fused
CPU kernel, which rounds differently from torch.optim's single-tensor path by ulps per step: the same kind and size
of error as the float32 reference's own.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.nn import functional as F

import gpudist
from gpudist import (
    ShardingConfiguration,
    ZeRO1Optimizer,
)
from gpudist.flat import padded_shard
from gpudist.strategies.zero import partition_buckets
from gpudist.testing import run_ranks

from .helpers import (
    OPTIMIZERS,
    STEPS,
    batch,
    flat,
    fresh_net,
    initial_state,
    reference_kw,
    single_process,
    train_steps,
    train_zero1,
)
from .tolerances import assert_matches_reference, reference_pair

SMALL_BUCKETS = {"bucket_cap_mb": 0.0001, "first_bucket_mb": 0.00002}
"""~100 B and ~20 B: three uneven buckets, the first (norm.bias alone) 5 elements: at 8 ranks three own none of it."""


@pytest.mark.parametrize(
    ("backend", "world"), [("inmemory", 1), ("inmemory", 2), ("inmemory", 3), ("inmemory", 4), ("gloo", 2), ("gloo", 3)]
)
@pytest.mark.parametrize("opt_name", ["adam", "adamw", "sgd"])
@pytest.mark.parametrize("stage", [1, 2, 3, "fsdp"])
def test_zero_matches_single_process(backend, world, opt_name, stage):
    """Catches a wrong owned range (an element updated twice or never), optimizer state applied to another rank's
    range, a missing or partial all-gather, uneven shards (111 parameters over 2-4 ranks) mis-sized; for ZeRO-2 a
    bucket piece reduce-scattered to the wrong owner or stepped at the wrong flat offset (small buckets: several
    per model, each split unevenly); for ZeRO-3 (units per layer) and FSDP (one root unit here) a unit gathered
    stale or into the wrong views, or a gradient reduce-scattered to the wrong shard."""
    state = initial_state()
    cls, kw = OPTIMIZERS[opt_name]
    results = run_ranks(
        train_zero1, world, backend, state=state, opt_name=opt_name, stage=stage, config_kw=SMALL_BUCKETS
    )
    expected = reference_pair(single_process, state, cls, **kw)
    for r in results:
        assert_matches_reference(r["params"], *expected)
        assert torch.equal(r["params"], results[0]["params"]), "replicas differ"


@pytest.mark.parametrize("opt_name", ["adam", "sgd", "rmsprop"])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("wrap_model", [False, True])
def test_zero_with_plain_module_and_any_optimizer(opt_name, stage, wrap_model):
    """Catches the plain-module path (the optimizer reduce-scatters the gradients itself) and the generic path for
    optimizers without a fused kernel diverging from single-process training."""
    state = initial_state()
    cls, kw = OPTIMIZERS[opt_name]
    results = run_ranks(
        train_zero1,
        3,
        "inmemory",
        state=state,
        opt_name=opt_name,
        wrap_model=wrap_model,
        stage=stage,
        config_kw=SMALL_BUCKETS,
    )
    expected = reference_pair(single_process, state, cls, **kw)
    for r in results:
        assert_matches_reference(r["params"], *expected)


@pytest.mark.parametrize(
    "config_kw",
    [
        {"gradient_as_bucket_view": False},
        {"bucket_cap_mb": 1e-5},
        {"overlap_communication": False, "max_grad_norm": 0.05},
    ],
)
def test_zero1_gradient_and_gather_paths(config_kw):
    """Catches the paths beside the default one diverging: gradients copied out of separate bucket buffers (no
    views) instead of read in place from the model's flat gradient buffer, and the owned range sent in 8 uneven
    chunks (10-byte buckets) each broadcast into the wrong place or before its update."""
    state = initial_state()
    results = run_ranks(train_zero1, 3, "inmemory", state=state, config_kw=config_kw)
    cls, kw = OPTIMIZERS["adam"]
    expected = reference_pair(single_process, state, cls, max_norm=config_kw.get("max_grad_norm"), **kw)
    for r in results:
        assert_matches_reference(r["params"], *expected)


def train_torch_zero(comm, state, steps=STEPS):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    net = fresh_net(state)
    model = DistributedDataParallel(net)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)
    train_steps(model, opt, steps, comm.rank, comm.world_size)
    return flat(net)


def test_zero1_matches_torch_zero_redundancy_optimizer():
    """Catches drift from PyTorch's own ZeRO-1 (ZeroRedundancyOptimizer over DDP) on the same Gloo ranks."""
    state = initial_state()
    ours = run_ranks(train_zero1, 2, "gloo", state=state)
    theirs = run_ranks(train_torch_zero, 2, "gloo", state=state)
    expected = reference_pair(single_process, state)
    for a, b in zip(ours, theirs, strict=True):
        assert_matches_reference(b, *expected, what="torch ZeroRedundancyOptimizer")  # the peer is within it too
        assert_matches_reference(a["params"], *expected, what="gpudist ZeRO-1")


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_zero1_memory_and_bytes_follow_the_formulas(world):
    """Catches optimizer state that is not actually split (K*P per rank instead of K*P/N) and extra traffic:
    per step one all-reduce of P plus one all-gather of P (payload bytes as the backend counts them)."""
    state = initial_state()
    n_params = sum(t.numel() for t in state.values())
    results = run_ranks(train_zero1, world, "inmemory", state=state, steps=2)
    owned = padded_shard(n_params, world)  # every rank's range the same size, a multiple of 16 elements
    assert owned % 16 == 0 and n_params <= world * owned < n_params + 16 * world
    for r in results:
        assert r["state_bytes"] == 2 * owned * 4  # Adam: exp_avg + exp_avg_sq of the owned range, fp32
        memory = r["meta"]["memory_per_rank"]
        assert memory["parameters"] == memory["gradients"] == world * owned * 4  # the padding is allocated too
        assert memory["optimizer_state"] == 2 * owned * 4
        # all-reduce P, one even all-gather of the padded buffer, the 8-byte norm all-reduce
        assert r["bytes"] == [n_params * 4 + world * owned * 4 + 8] * 2


def test_zero1_clipping_matches_clip_grad_norm():
    """Catches a per-shard norm (each rank clipping by its own slice's norm) instead of the global norm."""
    state = initial_state()
    results = run_ranks(train_zero1, 3, "inmemory", state=state, opt_name="sgd", config_kw={"max_grad_norm": 0.05})
    cls, kw = OPTIMIZERS["sgd"]
    expected = reference_pair(single_process, state, cls, max_norm=0.05, **kw)
    for r in results:
        assert_matches_reference(r["params"], *expected)


def test_zero1_nonfinite_gradient_skips_on_every_rank():
    """Catches a NaN on one rank corrupting the owner's shard, or only some ranks skipping (replicas diverge):
    the bad step changes nothing anywhere, and the next step trains normally."""
    state = initial_state()
    for wrap_model in (False, True):
        results = run_ranks(
            train_zero1, 2, "inmemory", state=state, opt_name="sgd", steps=1, nan_step=0, wrap_model=wrap_model
        )
        for r in results:
            assert r["skipped"] == [True] and torch.equal(r["params"], flat(fresh_net(state)))
    results = run_ranks(train_zero1, 2, "inmemory", state=state, opt_name="sgd", steps=2, nan_step=0)
    for r in results:
        assert r["skipped"] == [True, False] and torch.isfinite(r["params"]).all()
        assert torch.equal(r["params"], results[0]["params"])


def _skipping_reference(state, dtype, skip):
    """Single-process Adam that leaves out step ``skip`` (as a skipped step must: no update, no step count)."""
    net = fresh_net(state).to(dtype)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for step in range(STEPS):
        if step != skip:
            train_steps(net, opt, step + 1, start=step, dtype=dtype)
    return flat(net)


@pytest.mark.parametrize("opt_name", ["adam", "adam-capturable"])
@pytest.mark.parametrize("stage", [1, 3, "fsdp"])  # ZeRO-2 steps the same code; its model frees param.grad
def test_a_step_skipped_on_the_device_is_not_counted(stage, opt_name):
    """The skip decision stays on the device, so the host learns of it a step later (capturable=True: never, the
    count itself is on the device): catches a skipped step still counted in Adam's bias correction (the next steps'
    updates come out too small), and a skip that leaves state changed. One rank's gradient is NaN at step 1: the
    result equals single-process Adam without step 1."""
    state = initial_state()
    results = run_ranks(train_zero1, 2, "inmemory", state=state, opt_name=opt_name, nan_step=1, stage=stage)
    expected = reference_pair(_skipping_reference, state, skip=1)
    for r in results:
        assert r["skipped"] == [step == 1 for step in range(STEPS)]
        assert_matches_reference(r["params"], *expected)


@pytest.mark.parametrize("stage", [1, 2, 3, "fsdp"])
def test_zero_step_on_the_triton_kernels_clips_and_skips_inside_the_step(stage, serial_interpreter, monkeypatch):
    """The GPU's path (Triton kernels, in the interpreter): the fused step reads the global squared norm itself, and
    no launch computes the scalars in between (``clip_scalars`` is never called). Catches a kernel that drops the
    clip (0.05 clips every step here), a NaN on one rank that does not skip the step on every rank, and a skipped
    step still counted in Adam's bias correction (host counts, and capturable=True's device counts, whose bias
    corrections the kernel reads from the device), each against single-process training."""
    calls = []
    monkeypatch.setattr(gpudist.kernels, "clip_scalars", lambda *a, **k: calls.append(a))
    state = initial_state()
    clipped = run_ranks(train_zero1, 2, "inmemory", state=state, opt_name="sgd", stage=stage,
                        config_kw={"max_grad_norm": 0.05})  # fmt: skip
    cls, kw = OPTIMIZERS["sgd"]
    expected = reference_pair(single_process, state, cls, max_norm=0.05, **kw)
    for r in clipped:
        assert_matches_reference(r["params"], *expected)
    # ZeRO2Model frees param.grad in backward (nowhere to put the NaN): ZeRO-2's optimizer over the plain module
    expected = reference_pair(_skipping_reference, state, skip=1)
    capturable = stage in (2, "fsdp")  # (the device counts' kernels are the same at every stage: two suffice)
    for opt_name in ("adam", "adam-capturable") if capturable else ("adam",):
        skipped = run_ranks(train_zero1, 2, "inmemory", state=state, opt_name=opt_name, nan_step=1, stage=stage,
                            wrap_model=stage != 2)  # fmt: skip
        for r in skipped:
            assert r["skipped"] == [step == 1 for step in range(STEPS)]
            assert_matches_reference(r["params"], *expected, what=opt_name)
    if capturable:
        opt_name = "adamw-capturable-tensor-lr"  # the kernel reads -lr / bc1, sqrt(bc2), 1 - lr * wd on the device
        results = run_ranks(train_zero1, 2, "inmemory", state=state, opt_name=opt_name, stage=stage)
        expected = reference_pair(single_process, state, OPTIMIZERS[opt_name][0], **reference_kw(opt_name))
        for r in results:
            assert_matches_reference(r["params"], *expected, what=opt_name)
    assert not calls, "the step's scalars were launched on their own"


@pytest.mark.parametrize("opt_name", ["adam-capturable", "adamw-capturable-tensor-lr"])
@pytest.mark.parametrize("stage", [1, 2, 3, "fsdp"])
def test_capturable_adam_matches_single_process(stage, opt_name):
    """Adam and AdamW built with ``capturable=True`` keep their step counts and bias corrections on the device (what a
    captured graph replays); AdamW's learning rate here is a device tensor. Catches a count that does not advance
    (every step would take step 1's bias correction), one advanced for a group this rank does not step, and a
    tensor learning rate or weight decay left out of the update, against single-process torch Adam/AdamW."""
    state = initial_state()
    results = run_ranks(
        train_zero1, 2, "inmemory", state=state, opt_name=opt_name, stage=stage, config_kw=SMALL_BUCKETS
    )
    expected = reference_pair(single_process, state, OPTIMIZERS[opt_name][0], **reference_kw(opt_name))
    for r in results:
        assert_matches_reference(r["params"], *expected)


def test_a_tensor_learning_rate_off_the_parameters_device_is_refused():
    """Catches a tensor learning rate the fused step cannot read where it runs (a CPU tensor for CUDA parameters: an
    upload per step, refused inside a captured graph): refused when the optimizer is built, naming the group and the
    fix."""
    comm = gpudist.InMemoryCommunicationBackend(0, 1, group="zero-tensor-lr")
    net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    sgd = torch.optim.SGD(net.parameters(), lr=torch.tensor(0.1))
    sgd.param_groups[0]["lr"] = torch.tensor(0.1, device="meta")  # another device (this machine has no CUDA)
    with pytest.raises(ValueError, match=r"group 0's lr is a tensor of 1 element\(s\) on meta.*device='cpu'"):
        ZeRO1Optimizer(sgd, ShardingConfiguration(comm))


def test_zero1_rejects_mixed_dtypes():
    """Catches a flat buffer silently mixing dtypes."""
    comm = gpudist.InMemoryCommunicationBackend(0, 1, group="zero-dtype")
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).bfloat16())
    with pytest.raises(ValueError, match="one dtype and device"):
        ZeRO1Optimizer(torch.optim.Adam(net.parameters()), ShardingConfiguration(comm))


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_zero2_memory_and_bytes_follow_the_formulas(world):
    """Catches full gradients kept alive after their reduce-scatter (P per rank instead of P/N), optimizer state
    not split, and extra traffic: per step one reduce-scatter of P plus one all-gather of P."""
    state = initial_state()
    n_params = sum(t.numel() for t in state.values())
    results = run_ranks(train_zero1, world, "inmemory", state=state, steps=2, stage=2, config_kw=SMALL_BUCKETS)
    buckets = [part.numel for part in partition_buckets(list(fresh_net(state).parameters()), 104, 20, world, 0)]
    assert sum(buckets) == n_params and len(buckets) > 1
    padded = sum(world * padded_shard(n, world) for n in buckets)  # each bucket: even pieces of 16k elements
    for r in results:
        memory = r["meta"]["memory_per_rank"]
        owned = memory["gradients"] // 4  # after the step only the owned pieces remain: no param.grad alive
        assert owned * world == padded
        assert memory["parameters"] == n_params * 4
        # Adam: exp_avg + exp_avg_sq of the owned pieces; fp32 parameters are updated in place (no master copy)
        assert r["state_bytes"] == memory["optimizer_state"] == 2 * owned * 4
        # reduce-scatter counts its padded input; the update goes out as broadcasts of the real pieces (the
        # in-memory backend's chunked overlap), P, or at one rank as padded all-gathers; plus the 8-byte norm
        gathered = padded if world == 1 else n_params
        assert r["bytes"] == [padded * 4 + gathered * 4 + 8] * 2


def zero2_gradient_bookkeeping(comm, state):
    config = ShardingConfiguration(comm, bucket_cap_mb=0.0002, first_bucket_mb=0.0001)
    model = gpudist.ZeRO2Model(fresh_net(state), config)
    opt = gpudist.ZeRO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), config)
    x, y = batch(0, comm.rank, comm.world_size)
    loss = lambda scale=1.0: F.mse_loss(model(x), y) * scale
    loss().backward()
    opt.step()
    opt.zero_grad()  # set_to_none: the owned pieces are left as they are, to be written by the next backward
    after_zero_grad = model.owned_gradients().clone()
    loss().backward()
    loss().backward()  # accumulates onto the first
    twice = model.owned_gradients().clone()
    opt.zero_grad()
    loss(2.0).backward()
    doubled = model.owned_gradients().clone()
    return after_zero_grad, twice, doubled


def test_zero2_zero_grad_leaves_no_stale_gradient_and_accumulation_adds():
    """zero_grad(set_to_none=True) no longer zeroes ZeRO-2's owned gradients (the next reduce writes them). Catches
    a step after zero_grad with no backward reading the previous step's gradients, the first reduce adding onto
    stale values, and a second backward overwriting instead of accumulating: two backward passes must equal one of
    twice the loss, bit for bit (every scaling involved is by a power of two, exact)."""
    state = initial_state()
    for after_zero_grad, twice, doubled in run_ranks(zero2_gradient_bookkeeping, 2, "inmemory", state=state):
        assert not after_zero_grad.any(), "stale gradients survived zero_grad"
        assert twice.any() and torch.equal(twice, doubled)


class _Branches(torch.nn.Module):
    """Four Linear(15, 8) on the same input, summed: 128 elements each."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(15, 8) for _ in range(4))
        g = torch.Generator().manual_seed(0)  # a seed of its own (rank threads share torch's global generator)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x):
        return sum(layer(x) for layer in self.layers)


def _zero2_step_hand_offs(comm) -> dict:
    # 128 elements per layer and bucket: even shards of 16-element multiples over 2 ranks (a padded bucket would go
    # on its own, through buffers of its own)
    net = _Branches()
    config = ShardingConfiguration(comm, bucket_cap_mb=128 * 4 / 2**20, first_bucket_mb=128 * 4 / 2**20)
    model = gpudist.ZeRO2Model(net, config)
    opt = gpudist.ZeRO2Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    joins = []
    for _ in range(3):
        x, y = torch.randn(4, 15), torch.randn(4, 8)
        torch.nn.functional.mse_loss(model(x), y).backward()
        before = comm._rt.joins
        opt.step()
        joins.append(comm._rt.joins - before)
        opt.zero_grad()
    return {"joins": joins, "buckets": len(opt._bucket_pieces.parts), "params": model.gather_full_parameters()}


def test_zero2_on_nccl_gathers_every_bucket_in_one_group():
    """ZeRO-2's step on NCCL hands the streams off twice, whatever the bucket count: the norm's all-reduce, and
    every bucket's parameter all-gather in one ncclGroupStart/End (one hand-off and one event, where one per bucket
    cost the H200's host ~30 us each). Catches the gather going back to one hand-off per bucket; the replicas must
    still agree."""
    from .fakenccl import FakeNccl, run_nccl

    results = run_nccl(_zero2_step_hand_offs, 2, FakeNccl())
    for r in results:
        assert r["buckets"] == 4 and r["joins"] == [2, 2, 2], r
        assert torch.equal(r["params"], results[0]["params"])


def _adam_launches_per_step(comm, launches: list, state: dict | None) -> dict:
    """ZeRO-2 with AdamW for 3 steps on the Triton path: this rank's Adam launches per step. ``state``: the shared
    test net in small odd buckets (pieces that are not 16-element aligned); None: four 128-element branches, a bucket
    each (aligned pieces)."""
    if state is None:
        net, buckets, shape = _Branches(), {"bucket_cap_mb": 512 / 2**20, "first_bucket_mb": 512 / 2**20}, (15, 8)
    else:
        net, buckets, shape = fresh_net(state), SMALL_BUCKETS, None
    config = ShardingConfiguration(comm, **buckets)
    model = gpudist.ZeRO2Model(net, config)
    opt = gpudist.ZeRO2Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    counts, me = [], threading.get_ident()
    for step in range(3):
        if shape is None:
            x, y = batch(step, comm.rank, comm.world_size)
        else:
            g = torch.Generator().manual_seed(step * 10 + comm.rank)
            x, y = torch.randn(4, shape[0], generator=g), torch.randn(4, shape[1], generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        before = launches.count(me)
        opt.step()
        counts.append(launches.count(me) - before)  # this rank's (the ranks are threads)
        opt.zero_grad()
    return {"launches": counts, "pieces": len(opt._by_group()[0]), "params": model.gather_full_parameters()}


def test_zero2_steps_every_bucket_piece_in_one_adam_launch(serial_interpreter, monkeypatch):
    """ZeRO-2 owns one piece of every bucket; on the GPU's path (Triton, here interpreted, over the simulated NCCL)
    its AdamW steps all of them in one launch where their offsets keep the kernel's 16-byte accesses (each launch
    cost the H200's host ~20 us; one per bucket added up to ms on a 30-bucket model), bit for bit as one launch per
    piece; pieces that are not aligned (small odd buckets) go one launch each, and train as single-process AdamW.
    Catches the update going back to a launch per piece, a piece the one launch skips or steps at the wrong offset,
    and one unaligned piece slowing every piece's update."""
    from gpudist.kernels import optim
    from gpudist.strategies.flat_optimizer import FlatShardOptimizer

    from .fakenccl import FakeNccl, run_nccl

    launches, kernel = [], optim._adam_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(threading.get_ident())
            return kernel[grid]

    monkeypatch.setattr(optim, "_adam_kernel", Counting())
    aligned = run_nccl(_adam_launches_per_step, 2, FakeNccl(), launches=launches, state=None)
    with monkeypatch.context() as m:
        m.setattr(FlatShardOptimizer, "_segments_plan", lambda self, pieces: None)
        per_piece = run_nccl(_adam_launches_per_step, 2, FakeNccl(), launches=launches, state=None)
    for one, each in zip(aligned, per_piece, strict=True):
        assert one["pieces"] == 4 and one["launches"] == [1, 1, 1] and each["launches"] == [4, 4, 4], (one, each)
        assert torch.equal(one["params"], each["params"])
    state = initial_state()
    unaligned = run_nccl(_adam_launches_per_step, 2, FakeNccl(), launches=launches, state=state)
    expected = reference_pair(single_process, state, torch.optim.AdamW, steps=3, lr=1e-2)
    for r in unaligned:
        assert r["pieces"] >= 2 and r["launches"] == [r["pieces"]] * 3, r
        assert_matches_reference(r["params"], *expected)
