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

from .helpers import STEPS, batch, flat, fresh_net, initial_state, single_process, train_steps
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
    if kind in ("hsdp", "hsdp-zero3", "zero3", "zero3-hpz"):
        hsdp = kind.startswith("hsdp")
        config = ShardingConfiguration(topo.intra if hsdp else comm)
        groups = {"replicate_group": topo.inter} if hsdp else {}
        if kind == "zero3-hpz":
            groups = {"secondary_group": topo.intra}  # sharded over the world, backward gathers inside the node
        cls = FSDPModel if kind == "hsdp" else ZeRO3Model  # FSDP: one unit here (no ModuleList); ZeRO-3: per layer
        model = cls(net, config, **groups)
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


@pytest.mark.parametrize("kind", ["hsdp", "hsdp-zero3", "hierarchical", "zero3-hpz"])
def test_topology_aware_strategies_match_single_process(kind):
    """Catches HSDP gradients not all-reduced across replicas (each node drifts on its half of the batch), averaged
    twice or summed (a wrong 1/(N R) scale), replicas starting from their own initial values (no broadcast over the
    replica group), a hierarchical all-reduce that skips or misorders a stage, and hpZ's backward gathering the
    wrong part of the secondary copy (chunks in the wrong order, another node's, or last step's values): every rank
    must end where single-process training on the global batch ends."""
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


def _hpz_memory(comm, state):
    """hpZ's secondary partitions after forward (all units kept) and after backward (all dropped)."""
    _, model, _ = _wrapped(comm, state, "zero3-hpz")
    x, y = batch(0, comm.rank, comm.world_size)
    loss = F.mse_loss(model(x), y)
    after_forward = model.memory_per_rank()["secondary_parameters"]
    loss.backward()
    return after_forward, model.memory_per_rank()["secondary_parameters"]


def test_hpz_bytes_and_memory_follow_the_formulas():
    """Catches hpZ's backward still gathering over the world (world bytes stay at 3 collectives of P), gathering
    inside the node but from full copies (intra bytes of L x P instead of one gathered P), a secondary copy bigger
    or smaller than P/L per rank, and one kept after backward: per step the world group carries the forward
    all-gather and the reduce-scatter of the world-padded units, the node's group backward's all-gather of them,
    nothing else crosses; the secondary partitions hold (N/L) world-padded shards per unit from forward until the
    unit's gradient is reduced."""
    state = initial_state()
    world_shard = [padded_shard(n, WORLD) for n in _unit_sizes(state)]
    gathered = WORLD * sum(world_shard) * 4
    for _, per_step, shards, _, step_bytes in run_ranks(_train, WORLD, state=state, kind="zero3-hpz", steps=2):
        assert shards == world_shard  # sharded over the world: P/N per rank, as plain ZeRO-3
        assert per_step[-1] == {"intra": gathered, "inter": 0, "world": 2 * gathered + 8}
        assert step_bytes == 3 * gathered + 8
    for after_forward, after_backward in run_ranks(_hpz_memory, WORLD, state=state):
        assert after_forward == gathered // PER_NODE and after_backward == 0


def test_hierarchical_ddp_bytes_follow_the_formulas():
    """Catches a hierarchical all-reduce that still sends whole buckets across nodes (inter-node bytes must be the
    1/L pieces: per bucket of n elements this local rank's split_sizes(n, L) share) or repeats a stage; flat DDP
    puts every bucket on the world group once."""
    state = initial_state()
    flat_runs = run_ranks(_train, WORLD, state=state, kind="ddp", steps=2)
    hier_runs = run_ranks(_train, WORLD, state=state, kind="hierarchical", steps=2)
    total = sum(t.numel() for t in state.values())
    for rank, (_, per_step, _, buckets, step_bytes) in enumerate(hier_runs):
        # each gradient starts on a 16-byte boundary in its bucket: at most 3 fp32 zeros after each tensor
        sent = sum(buckets)
        assert len(buckets) > 1 and total <= sent < total + 4 * len(state)
        local = rank % PER_NODE
        inter = sum(split_sizes(n, PER_NODE)[local] for n in buckets) * 4
        assert per_step[-1] == {"intra": 2 * sent * 4, "inter": inter, "world": 0}
        assert step_bytes == 2 * sent * 4 + inter
    for _, per_step, _, buckets, _ in flat_runs:
        assert per_step[-1] == {"intra": 0, "inter": 0, "world": sum(buckets) * 4}


def _misuse(comm):
    from gpudist import ZeRO2Model

    errors = []
    config = ShardingConfiguration(comm)
    topo = Topology(comm, ranks_per_node=2)
    for build in (
        lambda: DDPModel(fresh_net(initial_state()), config, hierarchical=True),
        lambda: ZeRO2Model(fresh_net(initial_state()), config, hierarchical=topo),
        lambda: ZeRO3Model(fresh_net(initial_state()), config, replicate_group=topo.inter, secondary_group=topo.intra),
    ):
        try:
            build()
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_hierarchical_misuse_is_refused():
    """Catches hierarchical=True silently running flat without a topology, ZeRO-2 accepting a hierarchy its
    reduce-scatter ignores, and hpZ accepted on top of HSDP (which already gathers inside the node)."""
    errors = run_ranks(_misuse, 2)[0]
    assert "needs config.backend.topology" in errors[0]
    assert "hierarchical all-reduce is DDP's" in errors[1]
    assert "secondary_group (hpZ) and replicate_group (HSDP) together" in errors[2]


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
    return model.gather_full_parameters(), per_step, sum(model.bucket_sizes()) // 4


def test_inter_node_only_compression():
    """Catches a comm hook on a hierarchical DDPModel that averages twice or not at all across levels (during
    warm-up the hook's all-reduce is dense, so training must match single-process training), that runs on the
    world group instead of the inter-node one, or that compresses the intra-node steps too: after warm-up, only
    the inter-node bytes shrink (int8 codes instead of fp32), the intra-node ones stay 2 x P."""
    state = initial_state()
    expected = reference_pair(single_process, state, torch.optim.SGD, **SGD)
    total = sum(t.numel() for t in state.values())
    runs = run_ranks(_train_compressed, WORLD, state=state, warmup_steps=STEPS, steps=STEPS)
    for params, per_step, buckets in runs:  # buckets: elements, each gradient 16-byte aligned in its bucket
        assert_matches_reference(params, *expected, what="hierarchical DDP, dense hook during warm-up")
        assert total <= buckets < total + 4 * len(state)
        assert per_step[-1]["world"] == 0 and per_step[-1]["intra"] == 2 * buckets * 4
    width = 128
    for _, per_step, _ in run_ranks(_train_compressed, WORLD, state=state, warmup_steps=1, steps=2, width=width):
        dense, compressed = per_step
        assert dense["intra"] == compressed["intra"] == 2 * (width + 1) * width * 4
        # Dense: the piece's 4 bytes per element. int8's two phases (reduce-scatter, all-gather) each send a byte
        # per element and a block scale: at least half of that, and less than all of it.
        assert dense["inter"] / 2 <= compressed["inter"] < dense["inter"] and compressed["world"] == 0


# ------------------------------------------------------------------------------------------------- HSDP checkpoints

ADAM = {"lr": 1e-2}
"""Adam for checkpoints: per-element state (exp_avg, exp_avg_sq) and a step count to carry across the save."""


def _hsdp(comm, state, per_node: int, shift: float = 0.0, fsdp: bool = False):
    """HSDP on ``world / per_node`` nodes of ``per_node`` ranks (``fsdp``: plain FSDP over the world), with Adam;
    ``shift`` moves the starting values, which loading must overwrite everywhere."""
    net = fresh_net(state)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(shift)
    net.register_buffer("counts", torch.arange(3.0) + shift)  # a buffer: written by one rank of all replicas
    if fsdp:
        config, replicate = ShardingConfiguration(comm), None
    else:
        topo = Topology(comm, ranks_per_node=per_node)
        config, replicate = ShardingConfiguration(topo.intra), topo.inter
    model = ZeRO3Model(net, config, replicate_group=replicate)  # a unit per layer: pieces in several groups
    return model, ZeRO3Optimizer(torch.optim.Adam(model.parameters(), **ADAM), config)


def _save_hsdp(comm, state, path, steps: int):
    from gpudist import save_checkpoint

    model, opt = _hsdp(comm, state, PER_NODE)
    train_steps(model, opt, steps, comm.rank, comm.world_size)
    save_checkpoint(path, model, opt, step=steps)
    at_save = model.gather_full_parameters()
    train_steps(model, opt, STEPS, comm.rank, comm.world_size, start=steps)
    return at_save, model.gather_full_parameters()


def _load_hsdp(comm, state, path, per_node: int, fsdp: bool = False):
    from gpudist import load_checkpoint

    model, opt = _hsdp(comm, state, per_node, shift=0.5, fsdp=fsdp)
    info = load_checkpoint(path, model, opt)
    loaded = model.gather_full_parameters()
    train_steps(model, opt, STEPS, comm.rank, comm.world_size, start=info.step)
    return loaded, model.gather_full_parameters()


def test_hsdp_checkpoint_reshards_and_resumes(tmp_path):
    """Catches HSDP checkpoints that write a shard once per replica (the reader then counts its elements twice and
    refuses), that only replica 0's shard group writes while another replica's files collide with it (ranks named
    by their shard rank: 2 files, not 4), that drop the Adam state or step of one replica's part, write a buffer
    once per replica, or cannot be read at another layout: saved at 2 nodes x 2 after 5 steps, loaded at 2 x 2
    (then 5 more steps must be bit for bit the uninterrupted run), 1 x 2, 4 x 1, plain FSDP over 3 ranks, and a
    plain module with torch's Adam (those must end where single-process training ends)."""
    from gpudist import load_checkpoint, read_manifest

    state = initial_state()
    path = tmp_path / "hsdp"
    saved = run_ranks(_save_hsdp, WORLD, state=state, path=path, steps=5)
    manifest = read_manifest(path)
    total = sum(t.numel() for t in state.values())
    written = [sum(p[3] for p in f["pieces"] if p[0] == "param") for f in manifest["files"]]
    assert manifest["world_size"] == WORLD and len(written) == WORLD
    assert sum(written) == total and all(written), f"each element once, every replica writing a part: {written}"
    for loaded, final in run_ranks(_load_hsdp, WORLD, state=state, path=path, per_node=PER_NODE):
        assert torch.equal(loaded, saved[0][0]) and torch.equal(final, saved[0][1])
    expected = reference_pair(single_process, state, torch.optim.Adam, **ADAM)
    for world, per_node, fsdp in ((2, 2, False), (4, 1, False), (3, 3, True)):
        for loaded, final in run_ranks(_load_hsdp, world, state=state, path=path, per_node=per_node, fsdp=fsdp):
            assert torch.equal(loaded, saved[0][0])
            assert_matches_reference(final, *expected, what=f"HSDP checkpoint loaded at {world // per_node}x{per_node}")
    net = fresh_net(state)
    opt = torch.optim.Adam(net.parameters(), **ADAM)
    load_checkpoint(path, net, opt)
    assert torch.equal(flat(net), saved[0][0])
    train_steps(net, opt, STEPS, start=5)
    assert_matches_reference(flat(net), *expected, what="HSDP checkpoint loaded into one process")


def _compressed(comm, state, per_node: int | None, shift: float = 0.0):
    """DDP with int8 compression after one dense step: across nodes only (``per_node``: hierarchical on nodes of
    that many ranks), or over every rank (None)."""
    from gpudist import GradientCompressionOptimizer

    net = fresh_net(state)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(shift)
    config = ShardingConfiguration(comm, bucket_cap_mb=0.0003, first_bucket_mb=0.0002)
    hierarchy = Topology(comm, ranks_per_node=per_node) if per_node else False
    model = DDPModel(net, config, hierarchical=hierarchy)
    opt = GradientCompressionOptimizer(torch.optim.SGD(model.parameters(), **SGD), config, "int8", warmup_steps=1)
    return model, opt


def _residual_energy(opt) -> float:
    return opt.communication_report()["residual_norm"] ** 2


def _save_compressed(comm, state, path, steps: int):
    from gpudist import save_checkpoint

    model, opt = _compressed(comm, state, PER_NODE)
    train_steps(model, opt, steps, comm.rank, comm.world_size)
    save_checkpoint(path, model, opt, step=steps)
    energy = _residual_energy(opt)
    train_steps(model, opt, STEPS, comm.rank, comm.world_size, start=steps)
    return energy, model.gather_full_parameters()


def _load_compressed(comm, state, path, per_node: int | None):
    from gpudist import load_checkpoint

    model, opt = _compressed(comm, state, per_node, shift=0.5)
    info = load_checkpoint(path, model, opt)
    energy = _residual_energy(opt)
    train_steps(model, opt, STEPS, comm.rank, comm.world_size, start=info.step)
    return energy, opt.communication_report()["steps"], model.gather_full_parameters()


def test_inter_node_compression_checkpoint(tmp_path):
    """Catches checkpoints of inter-node-only compression that drop the error-feedback residuals, key a node's
    worker residual by the world rank (then a reload at another ranks-per-node finds none, or two ranks' pieces
    collide), or lose the warm-up count: saved at 2 nodes x 2 after 4 steps (3 compressed), reloaded at 2 x 2 the
    continued run must be bit for bit the uninterrupted one; reloaded at 2 nodes x 1 (the same two worker
    residuals per element, now each whole on one rank) the residuals' total energy is the saved one; flat
    compressed DDP over 3 ranks (the mean of the nodes' residuals) loads too."""
    state = initial_state()
    path = tmp_path / "hier-int8"
    saved = run_ranks(_save_compressed, WORLD, state=state, path=path, steps=4)
    saved_energy = sum(energy for energy, _ in saved)
    assert saved_energy > 0
    for (energy, steps, final), (saved_rank_energy, _) in zip(
        run_ranks(_load_compressed, WORLD, state=state, path=path, per_node=PER_NODE), saved, strict=True
    ):
        assert torch.equal(final, saved[0][1]) and steps == STEPS and energy == saved_rank_energy
    moved = run_ranks(_load_compressed, NODES, state=state, path=path, per_node=1)
    assert sum(energy for energy, _, _ in moved) == pytest.approx(saved_energy, rel=1e-6)
    flat_runs = run_ranks(_load_compressed, 3, state=state, path=path, per_node=None)
    assert all(energy > 0 and steps == STEPS for energy, steps, _ in flat_runs)
