"""ParallelLayout: how ``world_size`` ranks factor into pipeline x data x tensor parallel groups.

Ranks are laid out tensor-parallel fastest, then data-parallel, then pipeline (Megatron-LM's order): tensor
groups are consecutive ranks (the most traffic, so on one node first), and a pipeline stage is a contiguous block
of ``data_parallel_size * tensor_parallel_size`` ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..topology import NodeLayout

__all__ = ["ParallelLayout", "make_groups"]

DIMENSIONS = ("pipeline", "data", "tensor")


@dataclass(frozen=True)
class ParallelLayout:
    """``rank = (pipeline_rank * data_parallel_size + data_rank) * tensor_parallel_size + tensor_rank``."""

    world_size: int
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1

    @classmethod
    def resolve(
        cls,
        world_size: int,
        pipeline_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = -1,
    ) -> ParallelLayout:
        """Validate the factors; ``data_parallel_size=-1`` takes the ranks left over. The error names every factor."""
        sizes = {"pipeline_parallel_size": pipeline_parallel_size, "tensor_parallel_size": tensor_parallel_size}
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if (
            isinstance(data_parallel_size, bool)
            or not isinstance(data_parallel_size, int)
            or (data_parallel_size < 1 and data_parallel_size != -1)
        ):
            raise ValueError(
                f"data_parallel_size={data_parallel_size!r} must be an int >= 1, or -1 for the ranks left over"
            )
        model = pipeline_parallel_size * tensor_parallel_size
        if data_parallel_size == -1:
            if world_size % model:
                raise ValueError(
                    f"pp({pipeline_parallel_size}) * tp({tensor_parallel_size}) = {model} does not "
                    f"divide world_size({world_size}); choose sizes whose product divides it"
                )
            data_parallel_size = world_size // model
        if model * data_parallel_size != world_size:
            raise ValueError(
                f"pp({pipeline_parallel_size}) * dp({data_parallel_size}) * tp({tensor_parallel_size}) "
                f"= {model * data_parallel_size} != world_size({world_size}); make the product equal "
                "the world size, or pass data_parallel_size=-1"
            )
        return cls(world_size, pipeline_parallel_size, data_parallel_size, tensor_parallel_size)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(pipeline_rank, data_rank, tensor_rank)`` of ``rank``."""
        tp, dp = self.tensor_parallel_size, self.data_parallel_size
        return rank // (tp * dp), (rank // tp) % dp, rank % tp

    def rank_of(self, pipeline_rank: int, data_rank: int, tensor_rank: int) -> int:
        return (pipeline_rank * self.data_parallel_size + data_rank) * self.tensor_parallel_size + tensor_rank

    def groups(self, dimension: str) -> list[list[int]]:
        """Every group of ``dimension`` ("pipeline", "data" or "tensor"): the ranks that differ only in it."""
        if dimension not in DIMENSIONS:
            raise ValueError(f"dimension={dimension!r}; use one of {DIMENSIONS}")
        sizes = (self.pipeline_parallel_size, self.data_parallel_size, self.tensor_parallel_size)
        axis = DIMENSIONS.index(dimension)
        groups = []
        for rank in range(self.world_size):
            coords = self.coords(rank)
            if coords[axis] == 0:
                groups.append([self.rank_of(*coords[:axis], i, *coords[axis + 1 :]) for i in range(sizes[axis])])
        return groups

    def describe(self) -> str:
        return (
            f"pp={self.pipeline_parallel_size} x dp={self.data_parallel_size} x tp={self.tensor_parallel_size} "
            f"= {self.world_size} ranks"
        )

    def check_tensor_groups_within_nodes(self, nodes: NodeLayout) -> None:
        """Refuse a layout whose tensor-parallel groups span nodes: tensor parallelism all-reduces activations in
        every layer, forward and backward, so a group across the network runs at the network's speed (Megatron-LM
        and torchtitan keep ``tp`` inside a node for this reason). Tensor groups are consecutive ranks and nodes
        consecutive blocks of ``ranks_per_node``, so every group is inside a node exactly when ``tp`` divides
        ``ranks_per_node``.

        Args:
            nodes: Where the ranks sit (:class:`gpudist.topology.NodeLayout`, e.g. ``comm.topology.layout``).

        Raises:
            ValueError: When a tensor group spans nodes, naming the layout, the group and the sizes that fit.
        """
        per = nodes.ranks_per_node
        for group in self.groups("tensor"):
            on = sorted({nodes.node_of(r) for r in group})
            if len(on) > 1:
                fits = [d for d in range(1, per + 1) if per % d == 0]
                raise ValueError(
                    f"{self.describe()} on {nodes.describe()}: tensor-parallel group {group} spans nodes {on}, so "
                    "its per-layer activation all-reduces would cross the network; use a tensor_parallel_size that "
                    f"divides the {per} rank(s) per node ({fits}) and put the other factors into "
                    "data_parallel_size or pipeline_parallel_size"
                )


def make_groups(comm, groups: list[list[int]], required: bool = True):
    """Create every group in ``groups`` (collective: each rank of ``comm`` calls it with the same list) and return
    this rank's (None if it is in none and not ``required``). Groups of one rank are created too."""
    mine = None
    for ranks in groups:
        group = comm.new_group(ranks)
        if group is not None:
            mine = group
    if mine is None and required:
        raise ValueError(f"rank {comm.rank} is in none of the groups {groups}")
    return mine
