"""HybridShardedModel's bytes per link class on simulated nodes (in-memory ranks): each of its groups classed by the
node layout (intra-node, inter-node, or both like the world group), per step against the formulas of its layout.

The model: ``K`` MLP blocks ``D -> H -> D`` (column-parallel, then row-parallel), so per rank and step, with ``b``
samples per replica in ``M`` micro-batches: the tensor group all-reduces each block's ``b x D`` output forward and,
where the block's input needs a gradient (not the first stage's data), its input gradient backward; the data group
all-reduces the rank's ``P_r = 2 D H/tp + H/tp + D`` parameters per block (its float64 loss too, on the last stage);
the pipeline group carries the step's spec message, ``b x D`` activations one way and their gradients back, and the
float64 loss to the first stage.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gpudist import HybridShardedModel, HybridShardedOptimizer, ShardingConfiguration, Topology
from gpudist.flat import padded_shard
from gpudist.strategies.pipeline.p2p import META_LEN
from gpudist.testing import run_ranks
from gpudist.topology import NodeLayout, ring_inter_node_bytes

D, H, BATCH, MICRO = 6, 8, 8, 2
FLOAT, F64 = 4, 8  # bytes of a float32 element; of one float64 (the step's loss, the clipping norm)


def _net(blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D)) for _ in range(blocks)])


def _plan(blocks: int) -> dict[str, str]:
    return {f"{i}.{j}": style for i in range(blocks) for j, style in ((0, "colwise"), (2, "rowwise"))}


def _block_params(tp: int) -> int:
    """One block's parameters on one tensor rank: both weights and the first bias split, the second bias whole."""
    return 2 * D * H // tp + H // tp + D


def _step_bytes(comm, per_node: int, pp: int, tp: int, zero_stage: int | None, steps: int = 2):
    """The last step's ``model.link_bytes()`` difference on this rank, its stage, the replicas, and whether each of
    its groups holds it at its own place.
    ``zero_stage`` None: the model averages gradients over replicas and plain SGD steps; else a
    HybridShardedOptimizer with that stage and gradient clipping (its norm all-reduce runs over the world)."""
    comm.topology = Topology(comm, ranks_per_node=per_node)  # as gpudist.init() sets it on real nodes
    blocks = 2 if pp == 1 else pp
    config = ShardingConfiguration(comm, max_grad_norm=None if zero_stage is None else 1.0)
    model = HybridShardedModel(_net(blocks), config, pp, tp, plan=_plan(blocks), micro_batches=MICRO)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = sgd if zero_stage is None else HybridShardedOptimizer(sgd, config, pp, tp, zero_stage=zero_stage)
    replicas, d = model.data_parallel_size, model.data_parallel_rank
    n = BATCH // replicas
    for step in range(steps):
        before = model.link_bytes()
        torch.manual_seed(step)
        x, y = torch.randn(BATCH, D), torch.randn(BATCH, D)
        model.train_step(x[d * n : (d + 1) * n], y[d * n : (d + 1) * n], F.mse_loss, optimizer=opt)
        after = model.link_bytes()
    placed = all(ranks[group.rank] == comm.rank for group, ranks in model.link_groups())  # rank i is ranks[i]
    return {k: after[k] - before[k] for k in after}, model.pipeline_parallel_rank, replicas, placed


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_tensor_inside_nodes_data_across(zero_stage):
    """pp=1 x dp=2 x tp=2 on 2 nodes x 2: tensor groups [0, 1], [2, 3] inside the nodes, data groups [0, 2], [1, 3]
    across. Catches groups classed by size instead of by node (both kinds have 2 ranks: one class would get all),
    the data group's gradient all-reduce or ZeRO-1's reduce-scatter + all-gather counted as intra-node, a group left
    out of link_groups, and the clipping norm's all-reduce over the world not counted under "world"."""
    for link, _, replicas, _ in run_ranks(_step_bytes, 4, per_node=2, pp=1, tp=2, zero_stage=zero_stage):
        blocks, b = 2, BATCH // replicas
        params = blocks * _block_params(2)
        tensor = (blocks + blocks - 1) * b * D * FLOAT  # forward per block; backward but into the first (data input)
        # DDP: one all-reduce of the gradients; ZeRO-1: reduce-scatter the padded gradients, all-gather the parameters
        elements = params if zero_stage == 0 else 2 * replicas * padded_shard(params, replicas)
        data = elements * FLOAT + F64  # + the loss averaged over replicas
        assert link == {"intra": tensor, "inter": data, "world": F64}


def test_pipeline_across_nodes():
    """pp=2 x dp=2 x tp=2 on 2 nodes x 4: tensor and data groups inside each node (stage s on node s), pipeline groups
    [r, r + 4] across. Catches the pipeline group (or the tied-parameter groups) missing from link_groups, its point-to-
    point bytes counted under intra-node, a stage's data or tensor bytes counted on the wrong class, and a group
    kept with another group's ranks (every rank must be in its groups' ranks, at its place)."""
    for link, stage, replicas, placed in run_ranks(_step_bytes, 8, per_node=4, pp=2, tp=2, zero_stage=None):
        assert placed
        b, last = BATCH // replicas, stage == 1
        tensor = (2 if last else 1) * b * D * FLOAT  # the second stage's input needs a gradient: one more all-reduce
        data = _block_params(2) * FLOAT + (F64 if last else 0)
        pipeline = META_LEN * 8 + 2 * b * D * FLOAT + F64  # spec, activations and gradients (M of b/M), loss
        assert link == {"intra": tensor + data, "inter": pipeline, "world": 0}


def _world_class(comm):
    topo = Topology(comm, ranks_per_node=2)
    comm.topology = topo
    model = HybridShardedModel(_net(1), ShardingConfiguration(comm), 1, 1, micro_batches=MICRO)
    before = model.link_bytes()
    model.train_step(torch.randn(BATCH // 4, D), torch.randn(BATCH // 4, D), F.mse_loss)
    after = model.link_bytes()
    again = topo.link_bytes([(topo.intra, topo.layout.intra_groups()[topo.layout.node]), *model.link_groups() * 2])
    with pytest.raises(ValueError, match=r"ranks \[0\] name 1 rank\(s\) for a group of 2") as mismatch:
        topo.link_bytes([(topo.intra, [0])])
    return {k: after[k] - before[k] for k in after}, again == after, str(mismatch.value)


def test_groups_over_both_links_and_the_ring_estimate():
    """pp=1 x dp=4 x tp=1 on 2 nodes x 2: the data group spans both nodes with 2 ranks on each, so it counts under
    "world" (both links), and ring_inter_node_bytes over its ranks gives the world ring's network share. Catches a
    group with several ranks per node classed "inter" (everything on the network) or "intra", groups counted twice
    (given twice, or one of the topology's own), a ring estimate that ignores how often the ring enters and leaves
    nodes, and ranks that do not match their group accepted."""
    params = _block_params(1) * FLOAT
    for link, same, _ in run_ranks(_world_class, 4):
        assert link == {"intra": 0, "inter": 0, "world": params + F64} and same
    nodes = NodeLayout(0, 8, 4)
    classes = [nodes.link_class(r) for r in ([1, 3], [0, 4], [3, 4, 5], [0, 1, 2, 3], [2, 6, 3, 7])]
    assert classes == ["intra", "inter", "world", "intra", "world"]
    with pytest.raises(ValueError, match=r"ranks \[0, 8\] must be a non-empty list of ranks in 0..7"):
        nodes.link_class([0, 8])
    link = 2 * (4 - 1) / 4 * 100  # what each link of a 4-rank ring carries for 100 bytes
    assert ring_inter_node_bytes(100, nodes, [0, 1, 4, 5]) == link  # enters and leaves each node once
    assert ring_inter_node_bytes(100, nodes, [0, 4, 1, 5]) == 2 * link  # every ring link crosses: 4 over 2 nodes
    assert ring_inter_node_bytes(100, nodes, [0, 1, 2]) == 0 == ring_inter_node_bytes(100, NodeLayout(0, 4, 4))
    assert ring_inter_node_bytes(100, nodes) == 2 * (8 - 1) / 8 * 100  # the world, as before
