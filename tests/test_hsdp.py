"""Topology-aware strategies on a simulated 2 nodes x 2 ranks (in-memory ranks, no network namespaces needed):
HSDP (FSDP/ZeRO-3 sharded inside the node, replicated across) and DDP's hierarchical all-reduce, each against
single-process training, and their bytes per step per link class against the formulas."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from gpudist import DDPModel, DDPOptimizer, FSDPModel, ShardingConfiguration, Topology, ZeRO3Model, ZeRO3Optimizer
from gpudist.comm import split_sizes
from gpudist.flat import padded_shard
from gpudist.testing import run_ranks

from .helpers import STEPS, batch, fresh_net, initial_state, single_process
from .tolerances import assert_matches_reference, reference_pair

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
SGD = {"lr": 0.1, "momentum": 0.9}
"""SGD, not Adam: Adam's update barely changes when every gradient is scaled alike, so a wrong 1/N would hide."""


def _wrapped(comm, state, kind: str):
    """This rank's model and optimizer for ``kind``; ranks other than 0 start from other values, which the wrapper
    must replace with rank 0's (through both groups, for HSDP)."""
    net = fresh_net(state)
    if comm.rank:
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.1 * comm.rank)
    topo = Topology(comm, ranks_per_node=PER_NODE)
    if kind in ("hsdp", "hsdp-zero3", "zero3"):
        config = ShardingConfiguration(topo.intra if kind != "zero3" else comm)
        replicate = topo.inter if kind != "zero3" else None
        cls = FSDPModel if kind == "hsdp" else ZeRO3Model  # FSDP: one unit here (no ModuleList); ZeRO-3: per layer
        model = cls(net, config, replicate_group=replicate)
        opt = ZeRO3Optimizer(torch.optim.SGD(model.parameters(), **SGD), config)
    else:
        config = ShardingConfiguration(comm, bucket_cap_mb=0.0003, first_bucket_mb=0.0002)  # several buckets
        model = DDPModel(net, config, hierarchical=topo if kind == "hierarchical" else False)
        opt = DDPOptimizer(torch.optim.SGD(model.parameters(), **SGD), config)
    return topo, model, opt


def _train(comm, state, kind: str, steps: int = STEPS):
    topo, model, opt = _wrapped(comm, state, kind)
    per_step = []
    for step in range(steps):
        before = topo.link_bytes()
        x, y = batch(step, comm.rank, comm.world_size)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        after = topo.link_bytes()
        per_step.append({k: after[k] - before[k] for k in after})
    shards = [p.numel() for p in model.parameters()]
    buckets = [b // 4 for b in model.bucket_sizes()] if hasattr(model, "bucket_sizes") else []
    return model.gather_full_parameters(), per_step, shards, buckets, model.last_step_bytes


@pytest.mark.parametrize("kind", ["hsdp", "hsdp-zero3", "hierarchical"])
def test_topology_aware_strategies_match_single_process(kind):
    """Catches HSDP gradients not all-reduced across replicas (each node drifts on its half of the batch), averaged
    twice or summed (a wrong 1/(N R) scale), replicas starting from their own initial values (no broadcast over the
    replica group), and a hierarchical all-reduce that skips or misorders a stage: every rank must end where
    single-process training on the global batch ends."""
    state = initial_state()
    expected = reference_pair(single_process, state, torch.optim.SGD, **SGD)
    for params, *_ in run_ranks(_train, WORLD, state=state, kind=kind):
        assert_matches_reference(params, *expected, what=kind)


def _unit_sizes(state) -> list[int]:
    sizes = [t.numel() for t in state.values()]  # fc1 (w, b), fc2 (w, b), norm (w, b): one unit each
    return [sizes[0] + sizes[1], sizes[2] + sizes[3], sizes[4] + sizes[5]]


def test_hsdp_bytes_and_shards_follow_the_formulas():
    """Catches HSDP sharding over the world instead of the node (shards of P/4, not P/2), its gathers or
    reduce-scatters crossing nodes, and the replica all-reduce sending more than one padded shard per unit (the
    full gradient, say): per step, intra-node 2 all-gathers + 1 reduce-scatter of the node-padded units, inter-node
    one all-reduce of a shard per unit; plain ZeRO-3 on the same ranks puts all of it on the world group."""
    state = initial_state()
    units = _unit_sizes(state)
    shard = [padded_shard(n, PER_NODE) for n in units]
    hsdp = run_ranks(_train, WORLD, state=state, kind="hsdp-zero3", steps=2)
    flat = run_ranks(_train, WORLD, state=state, kind="zero3", steps=2)
    for _, per_step, shards, _, step_bytes in hsdp:
        assert shards == shard  # P/L per rank, not P/N
        intra, inter = 3 * PER_NODE * sum(shard) * 4 + 8, sum(shard) * 4  # + the optimizer's 8-byte norm check
        assert per_step[-1] == {"intra": intra, "inter": inter, "world": 0}
        assert step_bytes == intra + inter
    world_shard = [padded_shard(n, WORLD) for n in units]
    for _, per_step, shards, _, _ in flat:
        assert shards == world_shard
        assert per_step[-1] == {"intra": 0, "inter": 0, "world": 3 * WORLD * sum(world_shard) * 4 + 8}


def test_hierarchical_ddp_bytes_follow_the_formulas():
    """Catches a hierarchical all-reduce that still sends whole buckets across nodes (inter-node bytes must be the
    1/L pieces: per bucket of n elements this local rank's split_sizes(n, L) share) or repeats a stage; flat DDP
    puts every bucket on the world group once."""
    state = initial_state()
    flat_runs = run_ranks(_train, WORLD, state=state, kind="ddp", steps=2)
    hier_runs = run_ranks(_train, WORLD, state=state, kind="hierarchical", steps=2)
    total = sum(t.numel() for t in state.values())
    for rank, (_, per_step, _, buckets, step_bytes) in enumerate(hier_runs):
        assert len(buckets) > 1 and sum(buckets) == total
        local = rank % PER_NODE
        inter = sum(split_sizes(n, PER_NODE)[local] for n in buckets) * 4
        assert per_step[-1] == {"intra": 2 * total * 4, "inter": inter, "world": 0}
        assert step_bytes == 2 * total * 4 + inter
    for _, per_step, _, _, _ in flat_runs:
        assert per_step[-1] == {"intra": 0, "inter": 0, "world": total * 4}


def _misuse(comm):
    from gpudist import ZeRO2Model

    errors = []
    config = ShardingConfiguration(comm)
    for build in (
        lambda: DDPModel(fresh_net(initial_state()), config, hierarchical=True),
        lambda: ZeRO2Model(fresh_net(initial_state()), config, hierarchical=Topology(comm, ranks_per_node=2)),
    ):
        try:
            build()
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_hierarchical_misuse_is_refused():
    """Catches hierarchical=True silently running flat without a topology, and ZeRO-2 accepting a hierarchy its
    reduce-scatter ignores."""
    errors = run_ranks(_misuse, 2)[0]
    assert "needs config.backend.topology" in errors[0]
    assert "hierarchical all-reduce is DDP's" in errors[1]


def _clone_settings(comm):
    topo = Topology(comm, ranks_per_node=PER_NODE)
    ddp = DDPModel(fresh_net(initial_state()), ShardingConfiguration(comm), hierarchical=topo)
    hsdp = FSDPModel(fresh_net(initial_state()), ShardingConfiguration(topo.intra), replicate_group=topo.inter)
    return ddp.clone().traffic_settings()["hierarchical"], hsdp.clone().replicas


def test_clones_keep_the_topology():
    """Catches clone() (with_parameters(), the elastic and checkpoint paths) quietly turning a hierarchical DDP into
    a flat one, or an HSDP model into FSDP over the node only (each node would then train apart)."""
    for hierarchy, replicas in run_ranks(_clone_settings, WORLD):
        assert hierarchy == "2 node(s) x 2 rank(s) = 4 (explicit)" and replicas == NODES


def _train_compressed(comm, state, warmup_steps: int, steps: int, width: int = 0):
    """Hierarchical DDP with int8 compression of the inter-node step; ``width``: a ``width x width`` linear layer
    on random data instead of the helpers' Net (buffers large enough for int8's block scales not to dominate)."""
    from gpudist import GradientCompressionOptimizer

    topo = Topology(comm, ranks_per_node=PER_NODE)
    config = ShardingConfiguration(comm, bucket_cap_mb=0.0003, first_bucket_mb=0.0002)
    net = fresh_net(state) if not width else torch.nn.Linear(width, width)
    model = DDPModel(net, config, hierarchical=topo)
    inner = torch.optim.SGD(model.parameters(), **SGD)
    opt = GradientCompressionOptimizer(inner, config, "int8", warmup_steps=warmup_steps)
    per_step = []
    for step in range(steps):
        before = topo.link_bytes()
        if width:
            loss = model(torch.randn(4, width)).square().mean()
        else:
            x, y = batch(step, comm.rank, comm.world_size)
            loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        after = topo.link_bytes()
        per_step.append({k: after[k] - before[k] for k in after})
    return model.gather_full_parameters(), per_step


def test_inter_node_only_compression():
    """Catches a comm hook on a hierarchical DDPModel that averages twice or not at all across levels (during
    warm-up the hook's all-reduce is dense, so training must match single-process training), that runs on the
    world group instead of the inter-node one, or that compresses the intra-node steps too: after warm-up, only
    the inter-node bytes shrink (int8 codes instead of fp32), the intra-node ones stay 2 x P."""
    state = initial_state()
    expected = reference_pair(single_process, state, torch.optim.SGD, **SGD)
    total = sum(t.numel() for t in state.values())
    for params, per_step in run_ranks(_train_compressed, WORLD, state=state, warmup_steps=STEPS, steps=STEPS):
        assert_matches_reference(params, *expected, what="hierarchical DDP, dense hook during warm-up")
        assert per_step[-1]["world"] == 0 and per_step[-1]["intra"] == 2 * total * 4
    width = 128
    for _, per_step in run_ranks(_train_compressed, WORLD, state=state, warmup_steps=1, steps=2, width=width):
        dense, compressed = per_step
        assert dense["intra"] == compressed["intra"] == 2 * (width + 1) * width * 4
        # Dense: the piece's 4 bytes per element. int8's two phases (reduce-scatter, all-gather) each send a byte
        # per element and a block scale: at least half of that, and less than all of it.
        assert dense["inter"] / 2 <= compressed["inter"] < dense["inter"] and compressed["world"] == 0
