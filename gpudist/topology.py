"""Where the ranks sit: nodes (hosts), the ranks on each, and a group per link class.

A job of ``N`` ranks on ``M`` nodes runs ``L = N / M`` ranks per node, numbered node by node (``rank = node * L +
local_rank``; torchrun, ``srun --distribution=block`` and ``mpirun --map-by slot`` do this). :class:`NodeLayout`
is that arithmetic, read from the launcher (:func:`detect_layout`: torchrun's ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``; Slurm's ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_TASKS_PER_NODE``; Open
MPI's ``OMPI_COMM_WORLD_LOCAL_RANK``, ``OMPI_COMM_WORLD_LOCAL_SIZE``; MPICH's ``MPI_LOCALRANKID``,
``MPI_LOCALNRANKS``) or given explicitly, and validated: every node the same number of ranks, ranks contiguous per
node. :class:`Topology` adds the groups, built with the backend's ``new_group``:

- ``intra``: the ``L`` ranks of this node (fast links: NVLink, shared memory, loopback);
- ``inter``: the ``M`` ranks with this local rank, one per node (the slow network between hosts).

``intra x inter`` is the 2D mesh HSDP and hierarchical all-reduce need (FSDP2's ``(replicate, shard)``
DeviceMesh): shard or reduce-scatter inside the node, replicate or all-reduce across nodes.

Link classes and their bytes: every collective a strategy runs on ``intra`` stays inside a node, every one on
``inter`` crosses the network, and one on the world group does both. :meth:`Topology.link_bytes` reads the three
groups' counters (payload bytes as :class:`~gpudist.comm.CommStats` counts them), and any other groups' (a hybrid
model's), each classed by its ranks (:meth:`NodeLayout.link_class`); :func:`ring_inter_node_bytes` gives the network
share of a flat ring all-reduce, over the world or one group, for comparison.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from .comm import CommunicationBackend

__all__ = ["NodeLayout", "Topology", "detect_layout", "ring_inter_node_bytes"]


@dataclass(frozen=True)
class NodeLayout:
    """``world_size`` ranks on ``nodes`` nodes of ``ranks_per_node`` each, numbered node by node; this rank's place.

    Validated on construction: ``world_size`` a multiple of ``ranks_per_node``, ``rank = node * ranks_per_node +
    local_rank``.
    """

    rank: int
    """This process's rank in the world group."""
    world_size: int
    """Ranks in the job."""
    ranks_per_node: int
    """Ranks on every node (torchrun's ``LOCAL_WORLD_SIZE``, ``--nproc-per-node``)."""
    source: str = "explicit"
    """Who said so: ``"torchrun"``, ``"slurm"``, ``"openmpi"``, ``"mpich"``, ``"explicit"`` or ``"single"``."""

    def __post_init__(self) -> None:
        for name in ("rank", "world_size", "ranks_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"NodeLayout.{name}={value!r} must be an int")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank({self.rank}) must be in 0..world_size-1 (world_size={self.world_size})")
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(
                f"world_size({self.world_size}) is not a multiple of ranks_per_node({self.ranks_per_node}) "
                f"(from {self.source}): every node must run the same number of ranks; launch the same "
                "--nproc-per-node (or --ntasks-per-node) on every node"
            )

    @property
    def nodes(self) -> int:
        """The number of nodes."""
        return self.world_size // self.ranks_per_node

    @property
    def node(self) -> int:
        """This rank's node, ``0..nodes-1``."""
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        """This rank's place on its node, ``0..ranks_per_node-1``."""
        return self.rank % self.ranks_per_node

    def node_of(self, rank: int) -> int:
        """The node ``rank`` runs on."""
        return rank // self.ranks_per_node

    def intra_groups(self) -> list[list[int]]:
        """Every node's ranks: ``[[0, 1], [2, 3]]`` for 2 nodes of 2."""
        per = self.ranks_per_node
        return [list(range(n * per, (n + 1) * per)) for n in range(self.nodes)]

    def inter_groups(self) -> list[list[int]]:
        """The ranks of each local rank, one per node: ``[[0, 2], [1, 3]]`` for 2 nodes of 2."""
        per = self.ranks_per_node
        return [list(range(local, self.world_size, per)) for local in range(per)]

    def describe(self) -> str:
        return f"{self.nodes} node(s) x {self.ranks_per_node} rank(s) = {self.world_size} ({self.source})"

    def link_class(self, ranks: Sequence[int]) -> str:
        """Which links a group of ``ranks`` (world ranks) uses: ``"intra"`` when all of them share a node, ``"inter"``
        when each is on a node of its own (every byte crosses the network), else ``"world"`` (several nodes, several
        ranks on one of them, as the world group: its bytes split between the links, see
        :func:`ring_inter_node_bytes`).

        Raises:
            ValueError: When ``ranks`` is empty or holds a rank outside ``0..world_size-1``.
        """
        if not ranks or not all(0 <= r < self.world_size for r in ranks):
            raise ValueError(f"ranks {list(ranks)} must be a non-empty list of ranks in 0..{self.world_size - 1}")
        nodes = [self.node_of(r) for r in ranks]
        spanned = len(set(nodes))
        return "intra" if spanned == 1 else "inter" if spanned == len(nodes) else "world"


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from None


def _slurm_tasks_per_node(text: str) -> list[int]:
    """Slurm's compressed per-node task counts: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise ValueError(f"SLURM_TASKS_PER_NODE={text!r} is not Slurm's 'count(xnodes),...' form")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def detect_layout(
    rank: int, world_size: int, environ: Mapping[str, str] | None = None, *, ranks_per_node: int | None = None
) -> NodeLayout:
    """The node layout of this rank, from ``ranks_per_node`` if given, else the launcher's variables.

    Checked against what the launcher says about this rank: a node index or local rank that contradicts
    node-by-node numbering raises (gpudist's node groups would put ranks of different hosts in one "node").

    Args:
        rank: This process's rank in the world.
        world_size: Ranks in the world.
        environ: The variables to read; None: ``os.environ``.
        ranks_per_node: Ranks on every node, overriding the launcher (a simulated layout on one host, or a
            launcher gpudist does not read).

    Returns:
        The layout; one node of ``world_size`` ranks when no launcher says otherwise (``source="single"``).

    Raises:
        ValueError: When a variable is not an integer, nodes run different numbers of ranks
            (``SLURM_TASKS_PER_NODE="2,1"``, a ``LOCAL_WORLD_SIZE`` that does not divide the world), or the
            launcher numbers ranks other than node by node.
    """
    env = os.environ if environ is None else environ
    if ranks_per_node is not None:
        return NodeLayout(rank, world_size, ranks_per_node, "explicit")
    # (source, local rank, ranks per node, node index) variables, in the order detect_environment reads launchers.
    launchers = [
        ("torchrun", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"),
        ("openmpi", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", None),
        ("mpich", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", None),
        ("slurm", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_NODEID"),
    ]
    for source, local_var, size_var, node_var in launchers:
        local = _int(env, local_var)
        if local is None:
            continue
        per = _int(env, size_var)
        if source == "slurm" and env.get("SLURM_TASKS_PER_NODE", "").strip():
            counts = _slurm_tasks_per_node(env["SLURM_TASKS_PER_NODE"])
            if len(set(counts)) > 1:
                raise ValueError(
                    f"SLURM_TASKS_PER_NODE={env['SLURM_TASKS_PER_NODE']!r}: nodes run {counts} tasks; gpudist's "
                    "node groups need the same number on every node (srun --ntasks-per-node)"
                )
            per = counts[0] if per is None else per
        if per is None:
            continue  # a local rank without the node's size: not enough to place this rank
        layout = NodeLayout(rank, world_size, per, source)
        node = _int(env, node_var) if node_var else None
        if not 0 <= local < per or (node is not None and node != layout.node) or local != layout.local_rank:
            said = f"{local_var}={local}, {size_var}={per}" + (f", {node_var}={node}" if node_var else "")
            raise ValueError(
                f"{source} places rank {rank} of {world_size} at {said}, but node-by-node numbering puts it at "
                f"node {layout.node}, local rank {layout.local_rank}; number ranks node by node (torchrun does; "
                "srun --distribution=block, mpirun --map-by slot) or pass ranks_per_node explicitly"
            )
        return layout
    return NodeLayout(rank, world_size, world_size, "single")


def ring_inter_node_bytes(payload: int, layout: NodeLayout, ranks: Sequence[int] | None = None) -> float:
    """Bytes one node sends to the next over the network in a flat ring all-reduce of ``payload`` bytes.

    A ring in rank order crosses between nodes once per node, and every ring link carries ``2 (N-1)/N x payload``;
    so each node sends that much across. A hierarchical all-reduce (reduce-scatter inside, all-reduce across, all-
    gather inside) sends ``L x 2 (M-1)/M x payload / L = 2 (M-1)/M x payload`` per node instead.

    Args:
        payload: Bytes of the all-reduced buffer.
        layout: The node layout.
        ranks: The group's world ranks in its ring order (a data-parallel group of a hybrid layout, say); None: the
            world. A group of ``n`` ranks whose ring enters and leaves nodes ``c`` times in all, over the ``m``
            nodes it spans, sends ``c / m x 2 (n-1)/n x payload`` per node (``c = m`` for a group in rank order).

    Returns:
        Bytes per node onto the network (0 when the group is on one node).
    """
    ranks = range(layout.world_size) if ranks is None else ranks
    layout.link_class(ranks)  # validates the ranks
    nodes = [layout.node_of(r) for r in ranks]
    n, spanned = len(nodes), len(set(nodes))
    crossings = sum(a != b for a, b in zip(nodes, nodes[1:] + nodes[:1], strict=True))
    return 0.0 if spanned == 1 else crossings / spanned * 2 * (n - 1) / n * payload


class Topology:
    """A world group with its node layout, and the intra-node and inter-node groups of this rank.

    The groups are built on first use of :attr:`intra` or :attr:`inter` (both at once, with the world backend's
    ``new_group``): that first use is collective, so every rank must make it at the same point (as every rank
    wraps its model). Building them also checks across ranks that the layout agrees (each rank reports its node
    and local rank; one small all-gather).

    Args:
        world: The world group's backend (``gpudist.init()`` gives it, with ``world.topology`` set).
        layout: Where the ranks sit; None: :func:`detect_layout` from the environment.
        ranks_per_node: Shorthand for an explicit layout of this many ranks per node (a simulated 2 x 2 on one
            host); exclusive with ``layout``.

    Raises:
        TypeError: When ``world`` is not a gpudist backend.
        ValueError: When both ``layout`` and ``ranks_per_node`` are given, the layout's rank or world size differs
            from ``world``'s, or as :func:`detect_layout` raises.
    """

    def __init__(
        self, world: CommunicationBackend, layout: NodeLayout | None = None, *, ranks_per_node: int | None = None
    ):
        if not isinstance(world, CommunicationBackend):
            raise TypeError(f"world must be a gpudist CommunicationBackend, got {type(world).__name__}")
        if layout is not None and ranks_per_node is not None:
            raise ValueError("pass layout or ranks_per_node, not both")
        if layout is None:
            layout = detect_layout(world.rank, world.world_size, ranks_per_node=ranks_per_node)
        if (layout.rank, layout.world_size) != (world.rank, world.world_size):
            raise ValueError(
                f"layout says rank {layout.rank} of {layout.world_size} but the backend is rank {world.rank} of "
                f"{world.world_size}; build the layout for this backend's group"
            )
        self.world = world
        self.layout = layout
        self._groups: tuple[CommunicationBackend, CommunicationBackend] | None = None

    @property
    def intra(self) -> CommunicationBackend:
        """This node's ranks (collective on first use, see the class)."""
        return self.groups()[0]

    @property
    def inter(self) -> CommunicationBackend:
        """This local rank's peers on every node, one per node (collective on first use)."""
        return self.groups()[1]

    def groups(self) -> tuple[CommunicationBackend, CommunicationBackend]:
        """``(intra, inter)``, built now if not yet (collective the first time: every rank calls it).

        Returns:
            This node's group and this local rank's cross-node group (the world group itself where one of them
            spans the world: ``intra`` on one node, ``inter`` at one rank per node).

        Raises:
            ValueError: When the ranks disagree on the layout (names every rank that differs).
        """
        if self._groups is not None:
            return self._groups
        layout, world = self.layout, self.world
        self._check_agreement()
        intra = world if layout.nodes == 1 else _my_group(world, layout.intra_groups())
        inter = world if layout.ranks_per_node == 1 else _my_group(world, layout.inter_groups())
        self._groups = (intra, inter)
        return self._groups

    def _check_agreement(self) -> None:
        """Every rank must report the same ranks per node, and its node and local rank by node-by-node numbering."""
        world, layout = self.world, self.layout
        mine = torch.tensor([layout.ranks_per_node, layout.node, layout.local_rank], dtype=torch.int64)
        everyone = torch.zeros(world.world_size * 3, dtype=torch.int64)
        everyone[world.rank * 3 : world.rank * 3 + 3] = mine
        everyone = everyone.to(world.device)
        world.all_reduce(everyone)  # each rank fills its own row: a SUM is an all-gather
        rows = everyone.cpu().view(world.world_size, 3).tolist()
        per = layout.ranks_per_node
        bad = [(r, row) for r, row in enumerate(rows) if row != [per, *divmod(r, per)]]
        if bad:
            described = ", ".join(f"rank {r}: ranks_per_node={p}, node={n}, local_rank={lr}" for r, (p, n, lr) in bad)
            raise ValueError(
                f"the ranks disagree on the node layout (this rank, {world.rank}, has {layout.describe()}): "
                f"{described}; every node must run {per} ranks numbered node by node"
            )

    def link_bytes(self, groups: Iterable[tuple[CommunicationBackend, Sequence[int]]] = ()) -> dict[str, int]:
        """Payload bytes counted so far per link class (see :class:`~gpudist.comm.CommStats` for what counts).

        Args:
            groups: More groups to count, each a backend with its world ranks (a hybrid model's tensor, data and
                pipeline groups: ``HybridShardedModel.link_groups()``), each under its
                :meth:`NodeLayout.link_class`. A backend that is one of the three groups below, or given twice,
                counts once.

        Returns:
            ``{"intra": ..., "inter": ..., "world": ...}``: the intra-node group's, the inter-node group's and the
            world group's counters (a group that is the world group itself, ``intra`` on one node or ``inter``
            at one rank per node, counts under ``world`` only), plus each of ``groups``.

        Raises:
            ValueError: When a group's ranks are not valid world ranks, or not as many as the group has.
        """
        intra, inter = self.groups()
        out = {"intra": 0, "inter": 0, "world": self.world.stats.total_bytes}
        if intra is not self.world:
            out["intra"] = intra.stats.total_bytes
        if inter is not self.world:
            out["inter"] = inter.stats.total_bytes
        seen = {id(intra), id(inter), id(self.world)}
        for group, ranks in groups:
            link = self.layout.link_class(ranks)
            if len(ranks) != group.world_size:
                raise ValueError(
                    f"link_bytes: ranks {list(ranks)} name {len(ranks)} rank(s) for a group of {group.world_size}; "
                    "pass each group with its own world ranks"
                )
            if id(group) not in seen:
                seen.add(id(group))
                out[link] += group.stats.total_bytes
        return out

    def __repr__(self) -> str:
        return f"Topology({self.layout.describe()}, rank={self.layout.rank})"


def _my_group(world: CommunicationBackend, groups: list[list[int]]) -> CommunicationBackend:
    """Create every group of ``groups`` (collective: same list on every rank) and return this rank's."""
    mine = None
    for ranks in groups:
        group = world.new_group(ranks)
        if group is not None:
            mine = group
    assert mine is not None  # the groups partition the world by construction
    return mine
