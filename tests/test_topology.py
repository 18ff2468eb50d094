"""Node layout from the launchers' variables, its validation, and the intra-/inter-node groups of a Topology."""

from __future__ import annotations

import pytest
import torch

from gpudist import NodeLayout, Topology, detect_layout
from gpudist.launch import interface_for
from gpudist.testing import run_ranks

# rank 5 of 8 on 2 nodes of 4: node 1, local rank 1, in each launcher's words
LAUNCHERS = {
    "torchrun": {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"},
    "slurm": {"SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "4(x2)"},
    "openmpi": {"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"},
    "mpich": {"MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"},
}


@pytest.mark.parametrize("source", list(LAUNCHERS))
def test_layout_from_each_launcher(source):
    """Catches a launcher's variable read under the wrong name (the job would look like one node) or the node and
    local rank computed from the wrong one."""
    layout = detect_layout(5, 8, LAUNCHERS[source])
    assert (layout.source, layout.nodes, layout.ranks_per_node, layout.node, layout.local_rank) == (source, 2, 4, 1, 1)
    assert layout.intra_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.inter_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_layout_without_a_launcher_and_explicit():
    """Catches a plain process (no launcher) not being one node, and the explicit override being ignored."""
    assert detect_layout(2, 3, {}).describe() == "1 node(s) x 3 rank(s) = 3 (single)"
    layout = detect_layout(3, 4, LAUNCHERS["torchrun"], ranks_per_node=2)
    assert (layout.source, layout.nodes, layout.node, layout.local_rank) == ("explicit", 2, 1, 1)


@pytest.mark.parametrize(
    ("rank", "world", "env", "message"),
    [
        (0, 3, {"SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "2,1"}, "nodes run [2, 1] tasks"),
        (1, 6, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0"}, "world_size(6) is not a multiple"),
        (2, 4, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}, "node-by-node numbering puts it"),
        (1, 4, {"OMPI_COMM_WORLD_LOCAL_RANK": "x", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, "is not an integer"),
    ],
    ids=["uneven-slurm", "size-not-dividing", "round-robin", "not-an-int"],
)
def test_bad_layouts_raise_naming_the_values(rank, world, env, message):
    """Catches uneven nodes, round-robin numbering (rank 2 on node 0) or garbage accepted silently: node groups built
    from them would mix hosts."""
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        detect_layout(rank, world, env)


def _groups(comm, ranks_per_node):
    topo = Topology(comm, ranks_per_node=ranks_per_node)
    world_rank = torch.tensor([float(comm.rank)])
    intra, inter = world_rank.clone(), world_rank.clone()
    topo.intra.all_reduce(intra)
    topo.inter.all_reduce(inter)
    return topo.intra.world_size, topo.inter.world_size, float(intra), float(inter), topo.link_bytes()


def test_intra_and_inter_groups_hold_the_right_ranks():
    """Catches groups built from the wrong ranks (inter-node groups of consecutive ranks, or this rank in another
    node's group): each group's sum of world ranks names its members. 6 ranks as 3 nodes of 2."""
    results = run_ranks(_groups, 6, ranks_per_node=2)
    for rank, (n_intra, n_inter, intra_sum, inter_sum, link) in enumerate(results):
        node, local = divmod(rank, 2)
        assert (n_intra, n_inter) == (2, 3)
        assert intra_sum == 2 * node * 2 + 1  # ranks 2*node and 2*node+1
        assert inter_sum == local * 3 + 2 * (0 + 1 + 2)  # ranks local, local+2, local+4
        assert link["intra"] == 4 and link["inter"] == 4  # one fp32 all-reduce each


def _disagree(comm):
    Topology(comm, ranks_per_node=2 if comm.rank else 4).groups()


def test_ranks_that_disagree_on_the_layout_fail_on_every_rank():
    """Catches ranks building node groups from different layouts (one rank launched with another --nproc-per-node):
    every rank must raise, naming the rank that differs, instead of hanging in new_group."""
    from gpudist.testing import RanksFailedError

    with pytest.raises(RanksFailedError, match="rank 0: ranks_per_node=4"):
        run_ranks(_disagree, 4)


def test_interface_for_loopback():
    """Catches the rendezvous interface lookup sending loopback jobs onto a real interface."""
    assert interface_for("127.0.0.1") == "lo"


def test_node_layout_validates():
    """Catches a layout that cannot be node-by-node (world not a multiple of the node size) being accepted."""
    with pytest.raises(ValueError, match=r"world_size\(5\) is not a multiple of ranks_per_node\(2\)"):
        NodeLayout(0, 5, 2)


def test_init_refuses_an_interface_this_host_lacks(monkeypatch):
    """Catches a mistyped interface name being passed on to Gloo, which would fail later with an opaque error (or
    bind somewhere else): init must name the interfaces that exist, before joining anything."""
    import gpudist

    for var in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "GLOO_SOCKET_IFNAME"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match=r"interface='gd-no-such0' is not a network interface of this host \(.*lo"):
        gpudist.init("gloo", interface="gd-no-such0")


def test_tensor_groups_must_lie_inside_a_node():
    """Catches a check that tests only the first tensor group or only group sizes (tp=2 on nodes of 3 ranks: group
    [2, 3] straddles nodes 0 and 1 although 2 <= 3), and one that refuses layouts that fit (tp dividing the ranks
    per node, whatever pp and dp are)."""
    from gpudist.strategies.layout import ParallelLayout

    for world, pp, tp, per in ((8, 2, 2, 4), (8, 1, 4, 4), (12, 3, 1, 1), (12, 1, 2, 2)):
        ParallelLayout.resolve(world, pp, tp).check_tensor_groups_within_nodes(NodeLayout(0, world, per))
    for world, tp, per, group in ((12, 2, 3, "[2, 3]"), (8, 4, 2, "[0, 1, 2, 3]")):
        with pytest.raises(ValueError, match="divides the") as err:
            ParallelLayout.resolve(world, 1, tp).check_tensor_groups_within_nodes(NodeLayout(0, world, per))
        assert f"tp={tp}" in str(err.value) and f"tensor-parallel group {group} spans nodes [0, 1]" in str(err.value)


def _hybrid_on_nodes(comm, tp: int):
    from examples.lm import as_sequential, tinylm_plan
    from gpudist import HybridShardedModel, ShardingConfiguration

    from .helpers import hybrid_lm

    comm.topology = Topology(comm, ranks_per_node=2)  # as gpudist.init() sets it: 2 nodes x 2
    try:
        model = HybridShardedModel(
            hybrid_lm(), ShardingConfiguration(comm), 1, tp, plan=tinylm_plan, blocks=as_sequential
        )
    except ValueError as e:
        return str(e)
    return model.tensor_group.world_size


def test_hybrid_model_refuses_tensor_groups_across_nodes():
    """Catches HybridShardedModel ignoring the backend's node layout: tp=4 over 2 nodes x 2 must raise on every rank
    (before any group is built, so no rank hangs), tp=2 inside each node must build."""
    for message in run_ranks(_hybrid_on_nodes, 4, tp=4):
        assert "pp=1 x dp=1 x tp=4 = 4 ranks on 2 node(s) x 2 rank(s)" in message and "([1, 2])" in message
    assert run_ranks(_hybrid_on_nodes, 4, tp=2) == [2] * 4
