"""Live elastic training: survivors of a failure keep training in the same processes, newcomers heal from peers.

Restart mode (:class:`~gpudist.ElasticOptimizer` under torchrun) stops the world on every membership change: each
worker is restarted and reloads the last checkpoint. Live mode keeps the processes:

* **Membership service.** A TCPStore hosted by a process that outlives the workers (:class:`MembershipService`,
  started by ``python -m gpudist.live``, the launcher that starts the workers). Not torchrun's agent store: on a
  worker failure torchrun's agent stops *every* worker of its node, which is the restart this mode avoids.
  Every worker heartbeats into it (a counter, every ``heartbeat_interval`` seconds, from a thread).
* **Generations.** Membership is a sequence of generations ``1, 2, ...``; generation ``g`` is a list of member ids in
  rank order, decided once (``compare_set`` on ``gen/g``: the first proposal wins, everyone reads the same list).
  When a collective fails (a dead peer's TCP connection errors at once; a hung one raises after the op
  ``timeout``), each survivor reports for ``g + 1`` and waits until every member of ``g`` has either reported or
  stopped heartbeating for ``failure_timeout`` seconds (or ``quorum_timeout`` passed: a member that hangs with a
  live heartbeat); then ``g + 1`` = the reporters, in their old rank order, plus the joiners waiting, in the order
  they asked. A member left out (it was too slow) learns it on reading ``g + 1`` and joins again as a newcomer.
* **Admission.** A newcomer registers a join request and waits. Rank 0 of ``g`` sees it in its per-step check (one
  store round trip per step; the other ranks make one as well) and writes "generation ``g`` ends before step
  ``s + 1``"; every member reads that at the start of step ``s + 1`` (it cannot pass step ``s``'s collectives
  before rank 0 wrote it), so all leave ``g`` at the same step boundary and form ``g + 1`` with the newcomer.
* **New groups.** Each generation gets a new Gloo group on a fresh namespace of the store
  (:meth:`GlooCommunicationBackend.join_group`), and a new model wrapper and optimizer built on it from the user's
  ``build_module`` / ``build_optimizer`` (the old ones are kept until the state has moved, then dropped). The group
  connects in a thread while the members' heartbeats are watched (:meth:`Membership.while_alive`): a member that
  died after the generation was decided is given up on after ``failure_timeout``, not the connect timeout.
* **Healing** (the state, moved over the new group, never through a file). Every member says which step its state
  is at (-1: none, a newcomer or a member whose step was cut off half-applied). Replicated state (DDP, zero_stage=0):
  the lowest rank at the highest step sends a whole copy (:func:`~gpudist.checkpoint.snapshot_state`) by broadcast,
  unless everyone is already there (each then reloads its own copy, no traffic). So a survivor whose peer applied
  the failed step before the failure (a ring all-reduce can complete on some ranks and not others) catches up
  instead of anyone applying it twice. ZeRO-1/2/3 (sharded state; ZeRO-3 shards the parameters too): when no member
  of ``g`` was lost (a join, a scale-up), every old member's shard snapshot is all-gathered and each rank loads its
  new ranges from their union (resharding live); when a member was lost, its shard is gone, and every member loads
  the newest complete checkpoint from ``checkpoint_dir``, resharded (steps since it are redone, in the same
  processes), unless ``redundancy="buddy"`` kept a mirror of it on the next rank: then the survivors rebuild it
  from the mirrors, at the step they had reached.
* **The failed step is retried** at the new world size with the same global batch: the batch is split over the
  members by numpy's ``array_split`` rule (contiguous shares, the first ``G % N`` one sample larger), each rank's
  summed loss is scaled by ``N / G`` and the gradients averaged over the ``N`` ranks, so every step minimizes the
  mean loss over the same ``G`` samples at any world size: the result equals uninterrupted training up to float
  reassociation (a different summation order of the same terms).

* **Leaving a failed group.** A survivor whose op failed aborts the group before anything else (Gloo: shuts down
  its connections, so a peer still waiting on it fails at once instead of at the op timeout, and aborts in turn;
  NCCL: ``ncclCommAbort``), and a watch thread aborts the current group as soon as a member's heartbeat stops for
  ``failure_timeout``, whatever this worker is blocked in.

Limits: one process per member; Gloo (CPU), NCCL or in-memory groups (tests), not MPI (no ULFM); plain ZeRO-3 over
the whole group (no HSDP or hpZ groups); when every member of a generation dies the job stops (relaunch it: the
checkpoint is the fallback).
"""

from .launcher import launch as launch
from .launcher import main as main
from .membership import STORE_ENV, Generation, JobFinished, Membership, MembershipError, MembershipService
from .mirror import newest_covered as newest_covered
from .trainer import LiveElasticTrainer

__all__ = [
    "STORE_ENV",
    "Generation",
    "JobFinished",
    "LiveElasticTrainer",
    "Membership",
    "MembershipError",
    "MembershipService",
]
