"""Every collective ZeRO-3/FSDP issues, in one place (FSDP2's ``_fsdp_collectives.py``): a unit's all-gather (over
the shard group, or hpZ's node group), its gradient's reduce-scatter, HSDP's all-reduce of a reduced shard over the
replicas, and the blocking gathers and all-reduces of the full parameters and norms outside the step.

The step's collectives are planned by shape on first use (``comm.plan_all_gather``, ``plan_reduce_scatter``): their
buffers are new every step, their sizes are not, so a steady-state step checks nothing per call."""

from __future__ import annotations

import torch

from ...comm import CommunicationBackend, ReductionOperation, Work

__all__ = ["Collectives", "ShardReplicaGroup"]


class Collectives:
    """The collectives of one ZeRO-3 wrapper.

    Args:
        comm: The group the parameters are sharded over (``config.backend``).
        replicate_group: HSDP's replica group, or None.
    """

    def __init__(self, comm: CommunicationBackend, replicate_group: CommunicationBackend | None):
        self.comm = comm
        self.replicate_group = replicate_group
        self._plans: dict[tuple, object] = {}
        """Each shape's planned gather or reduce-scatter, built once (:meth:`_plan`)."""

    def _plan(self, comm: CommunicationBackend, op: str, numel: int, dtype: torch.dtype):
        """The planned ``op`` (``"all_gather"`` or a SUM ``"reduce_scatter"`` of a scratch input) of ``numel``
        elements of ``dtype`` over ``comm``, built once."""
        key = (id(comm), op, numel, dtype)
        plan = self._plans.get(key)
        if plan is None:
            if op == "all_gather":
                plan = comm.plan_all_gather(numel, dtype)
            else:
                plan = comm.plan_reduce_scatter(numel, dtype, ReductionOperation.SUM, scratch_input=True)
            self._plans[key] = plan
        return plan

    def start_all_gather(self, comm: CommunicationBackend, source: torch.Tensor, full: torch.Tensor) -> Work:
        """Forward: ``full`` = every rank of ``comm``'s ``source``, in rank order (async). The units are laid out from
        the same model on every rank (its fingerprint is checked at wrap time), so the plan's sizes agree."""
        return self._plan(comm, "all_gather", full.numel(), full.dtype).start(source, full)

    def start_reduce_scatter(self, sent: torch.Tensor, received: torch.Tensor) -> Work:
        """Forward: ``received`` = this rank's range of the SUM of every rank's ``sent`` over the shard group
        (async); ``sent`` is the caller's own scaled copy, which the transport may reduce in."""
        return self._plan(self.comm, "reduce_scatter", sent.numel(), sent.dtype).start(sent, received)

    def start_replica_all_reduce(self, shard: torch.Tensor) -> Work:
        """HSDP: ``shard`` = the SUM of it over the replicas, in place (async)."""
        return self.replicate_group.agreed.all_reduce(shard, ReductionOperation.SUM, async_op=True)

    def gather_full(self, shard: torch.Tensor, gathered: int) -> torch.Tensor:
        """Every rank's ``shard`` in one new vector of ``gathered`` elements (blocking; outside the step)."""
        full = torch.empty(gathered, dtype=shard.dtype, device=shard.device)
        self.comm.all_gather(shard.detach(), full)
        return full

    def sum_over_shards(self, total: torch.Tensor) -> None:
        """``total`` = its SUM over the shard group, in place (blocking; e.g. a squared norm)."""
        self.comm.agreed.all_reduce(total, ReductionOperation.SUM)


class ShardReplicaGroup:
    """HSDP's shard group x replica group as one group of ``shards x replicas`` ranks, for the few small collectives
    a checkpoint makes (``exchange_bytes``' all-gathers, the load verdict's all-reduce): each runs in the shard
    group, then in the replica group. Rank ``r x shards + s`` is shard rank ``s`` of replica ``r`` (a
    :class:`~gpudist.Topology`'s world rank, ``node x ranks_per_node + local_rank``)."""

    def __init__(self, shard: CommunicationBackend, replica: CommunicationBackend):
        self.shard, self.replica = shard, replica
        self.rank = replica.rank * shard.world_size + shard.rank
        self.world_size = replica.world_size * shard.world_size
        self.device = shard.device

    def all_reduce(self, tensor: torch.Tensor, op: ReductionOperation = ReductionOperation.SUM) -> None:
        """Forward: the reduction over every rank (shard group, then replica group), in place."""
        self.shard.all_reduce(tensor, op)
        self.replica.all_reduce(tensor, op)

    def all_gather(self, tensor: torch.Tensor, output: torch.Tensor) -> None:
        """Forward: ``output`` holds every rank's ``tensor`` in this group's rank order."""
        node = torch.empty(tensor.numel() * self.shard.world_size, dtype=tensor.dtype, device=tensor.device)
        self.shard.all_gather(tensor, node)
        self.replica.all_gather(node, output)
