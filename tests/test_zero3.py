"""ZeRO-3 / FSDP specifics: torch FSDP2 parity, memory and bytes against the formulas, gathered memory really freed,
prefetch order, tied weights, bf16, plain optimizers, unused parameters and unit choice.

Parity across strategies (N = 1-4, in-memory and Gloo, Adam/AdamW/SGD) is in tests/test_zero.py; the parity checks
here use its tolerance: single-process training in float64, within a multiple of the float32 run's own error.
"""

from __future__ import annotations

import functools
import gc
import math
import weakref

import pytest
import torch
from torch.nn import functional as F

import gpudist
from examples.lm import lm_loss
from gpudist import FSDPModel, ShardingConfiguration, ZeRO2Model, ZeRO2Optimizer, ZeRO3Model, ZeRO3Optimizer
from gpudist.flat import padded_shard
from gpudist.testing import run_ranks

from .helpers import (
    STAGES,
    STEPS,
    batch,
    flat,
    fresh_net,
    initial_state,
    lm_batch,
    single_process,
    tiny_lm,
    train_steps,
    train_zero1,
)
from .tolerances import assert_matches_reference, reference_pair


def train_fsdp2(comm, state, steps=STEPS):
    from torch.distributed.fsdp import fully_shard

    net = fresh_net(state)
    for sub in (net.fc1, net.fc2, net.norm):
        fully_shard(sub)
    fully_shard(net)
    train_steps(net, torch.optim.Adam(net.parameters(), lr=1e-2), steps, comm.rank, comm.world_size)
    return torch.cat([p.full_tensor().reshape(-1) for p in net.parameters()])


def test_zero3_and_fsdp_match_torch_fsdp2():
    """Catches drift from PyTorch's own FSDP2 (fully_shard per layer and on the root) on the same Gloo ranks."""
    state = initial_state()
    theirs = run_ranks(train_fsdp2, 2, "gloo", state=state)
    expected = reference_pair(single_process, state)
    for b in theirs:
        assert_matches_reference(b, *expected, what="torch FSDP2")  # the peer itself is within the bound
    for stage in (3, "fsdp"):
        for a in run_ranks(train_zero1, 2, "gloo", state=state, stage=stage):
            assert_matches_reference(a["params"], *expected, what=f"gpudist {stage}")


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_zero3_memory_and_bytes_follow_the_formulas(world):
    """Catches full parameters or gradients kept after use (P instead of P/N per rank), optimizer state not split,
    and extra or missing traffic: per step an all-gather of P in forward, another in backward, and a
    reduce-scatter of P (payload bytes as the backend counts them), plus the 8-byte norm all-reduce."""
    state = initial_state()
    results = run_ranks(train_zero1, world, "inmemory", state=state, steps=2, stage=3)
    sizes = [t.numel() for t in state.values()]  # per-layer units here: fc1 (w, b), fc2 (w, b), norm (w, b)
    unit_sizes = [sizes[0] + sizes[1], sizes[2] + sizes[3], sizes[4] + sizes[5]]
    padded = [padded_shard(n, world) for n in unit_sizes]  # every rank's shard of a unit: the same 16k elements
    assert all(n <= world * s < n + 16 * world for n, s in zip(unit_sizes, padded, strict=True))
    shard = sum(padded) * 4
    for r in results:
        after = r["after_backward"]
        assert after["parameters"] == shard and after["gradients"] == shard
        assert after["gathered_parameters"] == 0
        assert r["meta"]["memory_per_rank"]["parameters"] == shard
        assert r["state_bytes"] == r["meta"]["memory_per_rank"]["optimizer_state"] == 2 * shard  # Adam, fp32
        assert r["bytes"] == [3 * world * shard + 8] * 2  # two all-gathers and a reduce-scatter, padded
    assert sum(r["after_backward"]["parameters"] for r in results) == world * shard


def test_zero3_frees_gathered_parameters_between_forward_and_backward():
    """Catches autograd keeping the gathered units alive from forward to backward (then ZeRO-3 saves nothing over
    ZeRO-2): after forward no gathered vector survives, and backward gathers each unit once more."""
    comm = gpudist.InMemoryCommunicationBackend(0, 1, group="zero3-free")
    model = ZeRO3Model(fresh_net(initial_state()), ShardingConfiguration(comm))
    gathered = []

    def spy(group, unshard):
        unshard()
        if group.full is not None and all(ref() is not group.full for ref in gathered):
            gathered.append(weakref.ref(group.full))

    for group in model._groups:
        group.unshard = functools.partial(spy, group, group.unshard)
    x, y = batch(0)
    loss = F.mse_loss(model(x), y)
    gc.collect()
    assert len(gathered) == 3 and all(ref() is None for ref in gathered), "gathered parameters outlived forward"
    loss.backward()
    assert len(gathered) == 6  # re-gathered in backward
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_zero3_prefetches_the_next_unit():
    """Catches a prefetch that never starts (each unit gathered only when its forward begins): from the second
    step on, the next unit's all-gather is already in flight when a unit's forward starts, in forward order, and
    in reverse order during backward."""
    comm = gpudist.InMemoryCommunicationBackend(0, 1, group="zero3-prefetch")
    model = ZeRO3Model(fresh_net(initial_state()), ShardingConfiguration(comm))
    events = []
    step = model._step
    before = step.unit_pre_forward

    def spy_start(group, unshard):
        if group.full is None:  # not gathered, nor being gathered
            events.append(("gather", group.layout.unit))
        unshard()

    def spy_before(unit):
        events.append(("forward", unit))
        before(unit)

    for group in model._groups:
        group.unshard = functools.partial(spy_start, group, group.unshard)
    step.unit_pre_forward = spy_before
    for step in range(2):
        events.clear()
        x, y = batch(step)
        F.mse_loss(model(x), y).backward()
    forward = events[: events.index(("gather", "norm")) + 1]
    assert forward[:6] == [
        ("forward", ""),
        ("gather", "fc1"),
        ("forward", "fc1"),
        ("gather", "fc2"),
        ("forward", "fc2"),
        ("gather", "norm"),
    ]
    backward = [e for e in events[len(forward) :] if e[0] == "gather"]
    assert backward == [("gather", "norm"), ("gather", "fc2"), ("gather", "fc1")]


TRANSITIONS = ("pre_forward", "post_forward", "pre_backward", "post_backward", "finalize_backward", "reset")


def _record_transitions(model) -> list[tuple[str, str, str]]:
    """``(unit, transition, state after it)`` for every transition of every group of ``model``, from now on."""
    log = []

    def recorded(group, name, transition, *args):
        transition(*args)
        log.append((group.layout.unit, name, group.state.name))

    for group in model._groups:
        for name in TRANSITIONS:
            setattr(group, name, functools.partial(recorded, group, name, getattr(group, name)))
    return log


def test_zero3_groups_follow_the_named_lifecycle():
    """Catches per-step state changed outside a group's named transitions or in the wrong order (what the flags
    ``_in_backward``/``ready``/``used``/``reduced``, set from four kinds of hooks, let drift: a recomputation taken for
    a new forward, a gradient reduced before its unit's regather, a unit resharded but still marked installed): in a
    forward and backward every group goes IDLE -> FORWARD -> IDLE -> PRE_BACKWARD -> POST_BACKWARD -> IDLE, units in
    forward order then reversed; and a transition out of order raises an error naming the group and its state, and
    leaves the wrapper usable (the forward that raised is undone)."""
    from gpudist.strategies.fsdp import TrainingState

    comm = gpudist.InMemoryCommunicationBackend(0, 1, group="zero3-lifecycle")
    net = fresh_net(initial_state())
    model = ZeRO3Model(net, ShardingConfiguration(comm))
    log = _record_transitions(model)
    x, y = batch(0)
    F.mse_loss(model(x), y).backward()
    for group in model._groups:
        assert group.state is TrainingState.IDLE and group.shard.grad is not None
        mine = [(name, state) for unit, name, state in log if unit == group.layout.unit]
        assert mine == [
            ("pre_forward", "FORWARD"),
            ("post_forward", "IDLE"),
            ("pre_backward", "PRE_BACKWARD"),
            ("post_backward", "POST_BACKWARD"),
            ("reset", "IDLE"),
        ], group.layout.unit
    units = [unit for unit, name, _ in log if name == "pre_forward"]
    assert units == ["fc1", "fc2", "norm"]
    assert [unit for unit, name, _ in log if name == "post_backward"] == units[::-1]

    first = model._groups[0]
    with pytest.raises(RuntimeError, match=r"fc1.*post_forward out of order, in state IDLE"):
        first.post_forward()
    second = model._groups[1]
    handle = net.fc2.register_forward_pre_hook(lambda m, a: second.pre_backward())  # while fc2 runs its forward
    with pytest.raises(RuntimeError, match=r"fc2.*pre_backward out of order, in state FORWARD"):
        model(x)
    handle.remove()
    assert all(g.state is TrainingState.IDLE and g.full is None for g in model._groups)
    model.zero_grad()
    F.mse_loss(model(x), y).backward()  # the wrapper still works
    assert all(g.shard.grad is not None for g in model._groups)


def train_lm(comm, stage, dtype=torch.float32, steps=4):
    config = ShardingConfiguration(comm)
    model_cls, opt_cls = {
        2: (ZeRO2Model, ZeRO2Optimizer),
        3: (ZeRO3Model, ZeRO3Optimizer),
        "fsdp": (FSDPModel, ZeRO3Optimizer),
    }[stage]
    model = model_cls(tiny_lm(dtype), config)
    opt = opt_cls(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1), config)
    for step in range(steps):
        model.train_step(*lm_batch(step, comm.rank, comm.world_size), lm_loss, opt)
    return model.gather_full_parameters().float(), model.units() if stage != 2 else None


def single_process_lm(dtype=torch.float32, steps=4) -> torch.Tensor:
    """:func:`train_lm`'s AdamW steps on one process over the global batch."""
    net = tiny_lm(dtype)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.1)
    for step in range(steps):
        lm_loss(net(lm_batch(step)[0]), lm_batch(step)[1]).backward()
        opt.step()
        opt.zero_grad()
    return flat(net)


def test_zero3_tied_weights_match_single_process():
    """Catches a tied parameter (TinyLM's head shares the token embedding) sharded twice, updated twice, or
    getting only one of its two gradient contributions; it must live once, in the root unit."""
    expected = reference_pair(single_process_lm)
    for stage in (3, "fsdp"):
        results = run_ranks(train_lm, 3, "inmemory", stage=stage)
        for params, _ in results:
            assert_matches_reference(params, *expected)
        units = results[0][1]
        assert ("blocks.0.fc" in units, "blocks.0" in units) == ((True, False) if stage == 3 else (False, True))


def test_zero3_bf16_parameters_with_fp32_master_match_zero2():
    """Catches the bf16 path losing the fp32 master (updates rounded away) or gathering stale bf16 shards: bf16
    ZeRO-3 must train exactly as bf16 ZeRO-2 (same fp32 master arithmetic, same 2-rank sums)."""
    zero2 = run_ranks(train_lm, 2, "inmemory", stage=2, dtype=torch.bfloat16)
    zero3 = run_ranks(train_lm, 2, "inmemory", stage=3, dtype=torch.bfloat16)
    start = tiny_lm(torch.bfloat16)
    assert not torch.equal(zero3[0][0], flat(start).float()), "no update survived"
    for a, b in zip(zero2, zero3, strict=True):
        torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)


def train_plain_optimizer(comm, state, clip=None):
    model = ZeRO3Model(fresh_net(state), ShardingConfiguration(comm))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step, comm.rank, comm.world_size)
        F.mse_loss(model(x), y).backward()
        if clip is not None:
            model.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
    return model.gather_full_parameters()


@pytest.mark.parametrize("clip", [None, 0.05])
def test_zero3_with_a_plain_torch_optimizer(clip):
    """Catches shards whose .grad is not the global average (a plain torch optimizer steps them as they are) and
    a per-shard clipping norm instead of the global one."""
    state = initial_state()
    expected = reference_pair(single_process, state, torch.optim.SGD, lr=0.1, momentum=0.9, max_norm=clip)
    for params in run_ranks(train_plain_optimizer, 3, "inmemory", state=state, clip=clip):
        assert_matches_reference(params, *expected)


def train_branch(comm, state, config_kw):
    config = ShardingConfiguration(comm, **config_kw)
    model = ZeRO3Model(fresh_net(state, with_branch=True), config)
    opt = ZeRO3Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), config)
    for step in range(4):
        x, y = batch(step, comm.rank, comm.world_size)
        F.mse_loss(model(x, use_branch=step % 2 == 1), y).backward()
        opt.step()
        opt.zero_grad()
    return model.gather_full_parameters()


@pytest.mark.parametrize("config_kw", [{"find_unused_parameters": True}, {"overlap_communication": False}])
def test_zero3_units_unused_in_some_steps(config_kw):
    """Catches ranks disagreeing on reduce-scatters when a unit (a branch) is skipped in some steps: deferred mode
    reduces every unit at the end of backward, unused ones as zeros, and training equals one process."""
    state = initial_state(with_branch=True)

    def single_process_branch(dtype):
        net = fresh_net(state, with_branch=True).to(dtype)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(4):
            x, y = batch(step)
            F.mse_loss(net(x.to(dtype), use_branch=step % 2 == 1), y.to(dtype)).backward()
            opt.step()
            opt.zero_grad()
        return flat(net)

    expected = reference_pair(single_process_branch)
    if config_kw.get("overlap_communication") is False:
        config_kw = {**config_kw, "find_unused_parameters": False}
    for params in run_ranks(train_branch, 2, "inmemory", state=state, config_kw=config_kw):
        assert_matches_reference(params, *expected)


def test_zero3_rejects_bad_units():
    """Catches a unit name that is not a submodule being silently ignored (everything would gather at once)."""
    comm = gpudist.InMemoryCommunicationBackend(0, 1, group="zero3-units")
    with pytest.raises(ValueError, match="'fc9' is not a submodule"):
        ZeRO3Model(fresh_net(initial_state()), ShardingConfiguration(comm), units=["fc1", "fc9"])
    model = FSDPModel(tiny_lm(), ShardingConfiguration(comm), auto_wrap_policy={torch.nn.Linear})
    assert "head" in model.units() and "blocks.0.qkv" in model.units()


def test_zero3_full_state_dict_clone_and_set_parameters():
    """Catches a full state missing tied names or buffers, a clone sharing storage with the original, and
    set_parameters writing outside this rank's shard."""

    def run(comm):
        model = ZeRO3Model(tiny_lm(), ShardingConfiguration(comm))
        full = model.full_state_dict()
        twin = model.clone()
        twin.set_parameters(torch.zeros(model.parameter_count()))
        return full, model.gather_full_parameters(), twin.gather_full_parameters()

    reference = tiny_lm().state_dict()
    for full, params, zeros in run_ranks(run, 3, "inmemory"):
        assert list(full) == list(reference)
        for k, v in reference.items():
            assert torch.equal(full[k], v), k
        assert torch.equal(params, flat(tiny_lm())) and not zeros.any()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_padding_is_never_written_to_checkpoints(tmp_path, stage):
    """Catches the padding of ZeRO's even shards leaking into a checkpoint (as values of no parameter, or
    optimizer state over it): a save at 3 ranks, where every shard is padded, holds exactly the elements a
    single-process save of the same model and optimizer holds, and loads into that plain model unchanged."""
    from safetensors import safe_open

    state = initial_state()

    def save(comm, folder):
        config = ShardingConfiguration(comm, bucket_cap_mb=0.0001, first_bucket_mb=0.00002)
        model_cls, opt_cls = STAGES[stage]
        model = model_cls(fresh_net(state), config)
        opt = opt_cls(torch.optim.Adam(model.parameters(), lr=1e-2), config)
        for step in range(2):
            x, y = batch(step, comm.rank, comm.world_size)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        gpudist.save_checkpoint(folder, model, opt, step=2)
        return model.gather_full_parameters()

    def elements(folder):
        total = 0
        for file in sorted(folder.glob("rank-*.safetensors")):
            with safe_open(str(file), "pt") as f:
                names = f.keys()
                total += sum(math.prod(f.get_slice(name).get_shape()) for name in names)
        return total

    full = run_ranks(save, 3, "inmemory", folder=tmp_path / "sharded")[0]
    net = fresh_net(state)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for step in range(2):
        x, y = batch(step)
        F.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    gpudist.save_checkpoint(tmp_path / "plain", net, opt, step=2)
    n_params = sum(t.numel() for t in state.values())
    assert elements(tmp_path / "sharded") == elements(tmp_path / "plain") >= 3 * n_params  # values, 2 moments
    loaded = fresh_net(state)
    gpudist.load_checkpoint(tmp_path / "sharded", loaded, torch.optim.Adam(loaded.parameters(), lr=1e-2))
    assert torch.equal(flat(loaded), full)


def _lm_units(comm, stage, min_unit_numel, steps=4):
    config = ShardingConfiguration(comm)
    model_cls = ZeRO3Model if stage == 3 else FSDPModel
    model = model_cls(tiny_lm(), config, min_unit_numel=min_unit_numel)
    opt = ZeRO3Optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1), config)
    for step in range(steps):
        model.train_step(*lm_batch(step, comm.rank, comm.world_size), lm_loss, opt)
    return model.gather_full_parameters().float(), model.units(), [g.layout.total for g in model._groups]


def test_min_unit_numel_merges_small_units_and_trains_the_same():
    """Catches a merged unit's parameters lost or sharded twice (the merged model must train TinyLM to the
    single-process result), a threshold that merges a unit of the size asked for or keeps one below it, and a small
    unit merged past a larger enclosing one. ZeRO-3's default units are TinyLM's modules (LayerNorms of 32 elements,
    Linears of 272-1,088); FSDP's are its blocks."""
    expected = reference_pair(single_process_lm)
    kept_all = run_ranks(_lm_units, 2, "inmemory", stage=3, min_unit_numel=0)[0][1]
    for stage, threshold in ((3, 300), (3, 10**6), ("fsdp", 10**6)):
        results = run_ranks(_lm_units, 2, "inmemory", stage=stage, min_unit_numel=threshold)
        for params, _, _ in results:
            assert_matches_reference(params, *expected, what=f"{stage}, min_unit_numel={threshold}")
        units, totals = results[0][1], results[0][2]
        if threshold == 10**6:  # nothing is that large: one unit, the root, holds everything
            assert units == [""] and len(totals) == 1, (stage, units)
            continue
        # TinyLM's modules under 300 elements: the position embedding, the LayerNorms, each block's proj, and the
        # token embedding and head, which gather nothing (their tied weight is the root's, as group_layouts places it)
        small = {"tok", "pos", "ln_f", "head"} | {f"blocks.{i}.{m}" for i in (0, 1) for m in ("ln1", "ln2", "proj")}
        assert set(kept_all) - set(units) == small and set(units) <= set(kept_all), units
        assert all(t >= threshold for t in totals[1:]), (units, totals)  # every unit's group but the root's
    with pytest.raises(ValueError, match="min_unit_numel=-1 must be an int >= 0"):
        ZeRO3Model(tiny_lm(), ShardingConfiguration(gpudist.InMemoryCommunicationBackend(0, 1)), min_unit_numel=-1)


def test_merge_small_units_goes_innermost_first_into_the_enclosing_unit():
    """Catches a small unit merged into the root past an enclosing unit that stays, or an enclosing unit judged by
    its own parameters alone (without the small units merged into it)."""
    from gpudist.strategies.fsdp.layout import merge_small_units

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(3))
            self.ln, self.lin = torch.nn.LayerNorm(4), torch.nn.Linear(4, 4)

    net = torch.nn.Sequential(Outer(), torch.nn.Linear(4, 1))
    units = ["0", "0.ln", "0.lin", "1"]  # elements: "0" 3 of its own, "0.ln" 8, "0.lin" 20, "1" 5
    assert merge_small_units(units, net, 0) == units
    assert merge_small_units(units, net, 6) == ["0.ln", "0.lin"]  # "0" (3) and "1" (5): into the root
    assert merge_small_units(units, net, 10) == ["0", "0.lin"]  # "0.ln" into "0", which then holds 11: it stays
    assert merge_small_units(units, net, 12) == ["0.lin"]  # "0" holds 11 with "0.ln": into the root too
    assert merge_small_units(units, net, 21) == ["0"]  # all three in "0": 31
    assert merge_small_units(units, net, 32) == []


def test_traffic_settings_name_the_units_after_wrapping():
    """Catches the units recomputed from the wrapped module after its parameters moved into the shards: every module
    then holds nothing, and the default pick (modules holding parameters) or a ``min_unit_numel`` merge found none."""
    comm = gpudist.InMemoryCommunicationBackend(0, 1, group="zero3-traffic")
    for model in (
        ZeRO3Model(tiny_lm(), ShardingConfiguration(comm)),
        FSDPModel(tiny_lm(), ShardingConfiguration(comm), min_unit_numel=300),
    ):
        assert model.traffic_settings()["units"] == [u for u in model.units() if u], type(model).__name__
        assert len(model.units()) > 1
