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

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint import frame_length, frame_snapshot, load_snapshots, snapshot_frame, snapshot_state
from .comm import (
    CommunicationBackend,
    CommunicationError,
    GlooCommunicationBackend,
    InMemoryCommunicationBackend,
    Work,
)
from .comm.gloo import is_loopback
from .comm.nccl import NCCLCommunicationBackend
from .config import ShardingConfiguration
from .elastic import ElasticOptimizer, elastic_classes
from .flat import exchange_bytes

__all__ = [
    "STORE_ENV",
    "Generation",
    "JobFinished",
    "LiveElasticTrainer",
    "Membership",
    "MembershipError",
    "MembershipService",
]

_log = logging.getLogger("gpudist.live")

STORE_ENV = "GPUDIST_LIVE_STORE"
"""The environment variable the launcher sets to the membership service's ``host:port``."""


class MembershipError(RuntimeError):
    """The membership could not be agreed on in time (no quorum, the service is gone, or a join was never
    admitted)."""


class JobFinished(MembershipError):
    """The job finished (:meth:`Membership.finish`) while this worker was still waiting to be admitted: a
    replacement that came up too late has nothing to join and can exit."""


@dataclass(frozen=True)
class Generation:
    """One agreed membership: ``members`` (worker ids) in rank order."""

    number: int
    members: tuple[int, ...]
    survivors: tuple[int, ...]
    """The members that were in the previous generation (the others are newcomers)."""
    lost: tuple[int, ...]
    """The previous generation's members that are not in this one (dead, hung or too slow)."""
    admitted: int
    """Join requests ``1..admitted`` were considered for this or an earlier generation."""

    def rank_of(self, member: int) -> int:
        return self.members.index(member)

    def encode(self) -> str:
        return json.dumps([self.number, self.members, self.survivors, self.lost, self.admitted])

    @classmethod
    def decode(cls, data: bytes | str) -> Generation:
        number, members, survivors, lost, admitted = json.loads(data)
        return cls(number, tuple(members), tuple(survivors), tuple(lost), admitted)


class MembershipService:
    """The store the membership lives in: a TCPStore server in this process (run it in a process that outlives the
    workers: the launcher, ``python -m gpudist.live``).

    Args:
        host: The address to listen on (a loopback address keeps it off the network).
        port: The port; 0 picks a free one (read :attr:`address`).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.host = host
        self.store = dist.TCPStore(
            host, port, None, True, datetime.timedelta(seconds=60), wait_for_workers=False, use_libuv=False
        )
        self.port = self.store.port

    @property
    def address(self) -> str:
        """``host:port``, what workers pass to :meth:`Membership.connect` (the launcher sets :data:`STORE_ENV`)."""
        return f"{self.host}:{self.port}"


def _client(address: str, timeout: float) -> dist.Store:
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=timeout), use_libuv=False)


class Membership:
    """One worker's view of the job's membership: its id, its heartbeat, and the generations it agrees on.

    Args:
        connect: Opens a client of the membership store (called twice: one client for the heartbeat thread; then
            once per Gloo group connect, see :meth:`while_alive`).
        job: Namespace of this job's keys in the store.
        min_size: Workers the first generation waits for.
        heartbeat_interval: Seconds between heartbeats.
        failure_timeout: A member whose heartbeat has not moved for this long is dead (> ``heartbeat_interval``;
            the detection time of a dead peer that no collective noticed).
        quorum_timeout: Seconds to wait for a member that still heartbeats but never reports (hung) before
            deciding without it.
        join_timeout: Seconds a newcomer waits to be admitted.
    """

    _POLL = 0.02

    def __init__(
        self,
        connect: Callable[[], dist.Store],
        *,
        job: str = "job",
        min_size: int = 1,
        heartbeat_interval: float = 0.1,
        failure_timeout: float = 1.0,
        quorum_timeout: float = 30.0,
        join_timeout: float = 300.0,
    ):
        if not 0 < heartbeat_interval < failure_timeout:
            raise ValueError(
                f"need 0 < heartbeat_interval ({heartbeat_interval}) < failure_timeout ({failure_timeout})"
            )
        if min_size < 1:
            raise ValueError(f"min_size={min_size} must be >= 1")
        prefix = f"gpudist-live/{job}/"
        self._prefix, self._connect = prefix, connect
        self.job = job
        self.store = dist.PrefixStore(prefix, connect())
        self.min_size = min_size
        self.heartbeat_interval = heartbeat_interval
        self.failure_timeout = failure_timeout
        self.quorum_timeout = quorum_timeout
        self.join_timeout = join_timeout
        self.id = self.store.add("next_id", 1)
        self._seen = 0  # newest generation read
        self._admit_written: int | None = None
        self._beats = _Heartbeats(self.store, failure_timeout)  # kept across waits: a silence counts from its start
        self._stop = threading.Event()
        beat_store = dist.PrefixStore(prefix, connect())
        beat_store.add(f"hb/{self.id}", 1)
        self._beat = threading.Thread(target=self._heartbeat, args=(beat_store,), daemon=True, name="gpudist-live-hb")
        self._beat.start()

    @classmethod
    def connect(cls, address: str | None = None, *, timeout: float = 30.0, **options: Any) -> Membership:
        """Join the membership service at ``address`` (``host:port``; None: the :data:`STORE_ENV` variable).

        Args:
            address: The service's address.
            timeout: Seconds each store request may take.
            **options: As the constructor.

        Returns:
            This worker's membership.
        """
        address = address or os.environ.get(STORE_ENV)
        if not address:
            raise MembershipError(
                f"no membership service: pass its address or launch with python -m gpudist.live "
                f"(which sets {STORE_ENV})"
            )
        host = address.rsplit(":", 1)[0]
        if is_loopback(host):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        return cls(lambda: _client(address, timeout), **options)

    def _heartbeat(self, store: dist.Store) -> None:
        while not self._stop.wait(self.heartbeat_interval):
            try:
                store.add(f"hb/{self.id}", 1)
            except Exception:  # the service is gone: the next generation decision will say so
                return

    def close(self) -> None:
        """Stop heartbeating (the others will count this worker dead after ``failure_timeout``)."""
        self._stop.set()

    def finish(self) -> None:
        """Mark the job finished (any member, after the last step): a newcomer still waiting in :meth:`join` raises
        :class:`JobFinished` at once instead of waiting ``join_timeout`` for an admission that will never come."""
        self.store.set("finished", "1")

    # -- generations -------------------------------------------------------------------------------------------------

    def _read(self, number: int) -> Generation | None:
        key = f"gen/{number}"
        return Generation.decode(self.store.get(key)) if self.store.check([key]) else None

    def join(self) -> Generation:
        """Ask to be admitted, and wait for the generation that includes this worker (bounded by ``join_timeout``).

        Returns:
            That generation.

        Raises:
            MembershipError: When no generation admitted this worker within ``join_timeout``.
            JobFinished: When the job finished first (:meth:`finish`).
        """
        ticket = self.store.add("joins", 1)
        self.store.set(f"join/{ticket}", str(self.id))
        deadline = time.monotonic() + self.join_timeout
        while time.monotonic() < deadline:
            newest = None
            while (g := self._read(self._seen + 1)) is not None:
                newest, self._seen = g, g.number
            if newest is not None and self.id in newest.members:
                return newest
            if self.store.check(["finished"]):
                raise JobFinished(f"worker {self.id}: the job finished before it was admitted")
            if newest is not None and newest.admitted >= ticket:  # considered and left out (looked dead): ask again
                ticket = self.store.add("joins", 1)
                self.store.set(f"join/{ticket}", str(self.id))
            if self._seen == 0:  # the first generation: every newcomer may propose it
                g = self._decide(1, None, deadline)
                if self.id in g.members:
                    return g
            time.sleep(self._POLL)
        raise MembershipError(f"worker {self.id} was not admitted within {self.join_timeout:g}s")

    def next_generation(self, current: Generation) -> Generation:
        """Leave ``current`` (after a failure, or at an admission boundary) and agree on the next generation.

        Returns:
            The next generation; this worker may not be in it (it was counted dead): then :meth:`join` again.

        Raises:
            MembershipError: When it could not be decided within ``quorum_timeout`` plus ``failure_timeout``.
        """
        number = current.number + 1
        self.store.set(f"report/{number}/{self.id}", "1")
        return self._decide(number, current, time.monotonic() + self.quorum_timeout + 2 * self.failure_timeout)

    def _decide(self, number: int, previous: Generation | None, deadline: float) -> Generation:
        key = f"gen/{number}"
        old = previous.members if previous is not None else ()
        admitted = previous.admitted if previous is not None else 0
        start = time.monotonic()
        beats = self._beats
        joiners: list[int] = []
        while True:
            if (g := self._read(number)) is not None:
                self._seen = max(self._seen, number)
                return g
            now = time.monotonic()
            if now > deadline:
                raise MembershipError(f"generation {number} was not decided within the quorum timeout")
            total = self.store.add("joins", 0)
            while admitted + len(joiners) < total:
                joiners.append(int(self.store.get(f"join/{admitted + len(joiners) + 1}")))
            reported = [m for m in old if self.store.check([f"report/{number}/{m}"])]
            dead = beats.dead([*old, *joiners], now)
            fresh = [j for j in joiners if beats.moved(j) and j not in dead and j not in old]
            waiting = [m for m in old if m not in reported and m not in dead]
            waiting += [j for j in joiners if j not in fresh and j not in dead and j not in old]
            reported = [m for m in reported if m not in dead]  # reported, then died: it would never connect
            members = reported + [j for j in dict.fromkeys(fresh) if j not in reported]
            patient = now - start < self.quorum_timeout
            enough = len(members) >= (self.min_size if previous is None else 1)
            if enough and (not waiting or not patient):
                proposal = Generation(
                    number,
                    tuple(members),
                    tuple(reported),
                    tuple(m for m in old if m not in reported),
                    admitted + len(joiners),
                )
                self.store.compare_set(key, "", proposal.encode())
                continue
            time.sleep(self._POLL)

    def while_alive(self, g: Generation, connect: Callable[[dist.Store], Any], release: Callable[[Any], None]) -> Any:
        """Run ``connect(store)`` (a blocking group rendezvous, given a store client of its own) in a thread, and
        give up on it as soon as a member of ``g`` stops heartbeating: a rendezvous waits for a dead member's
        address (or retries its closed port) for its whole timeout, which no heartbeat would shorten. A connect
        given up on runs on in its thread until its own timeout; ``release`` closes what it returns if it does.

        Raises:
            MembershipError: When a member of ``g`` died before the connect completed.
        """
        done, outcome, lock = threading.Event(), {}, threading.Lock()

        def run() -> None:
            try:
                value = connect(dist.PrefixStore(self._prefix, self._connect()))
            except BaseException as e:  # re-raised below, unless given up on
                value, outcome["error"] = None, e
            with lock:
                outcome.setdefault("value", value)
                abandoned = outcome.get("abandoned", False)
            done.set()
            if abandoned and value is not None:
                release(value)

        threading.Thread(target=run, daemon=True, name=f"gpudist-live-connect-{g.number}").start()
        beats = self._beats
        others = [m for m in g.members if m != self.id]
        while not done.wait(self._POLL):
            if dead := beats.dead(others, time.monotonic()):
                with lock:
                    outcome["abandoned"] = "value" not in outcome
                if outcome["abandoned"]:
                    raise MembershipError(
                        f"member(s) {sorted(dead)} died while generation {g.number}'s group connected"
                    )
                break
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def watch(self, members: Callable[[], tuple[Generation, Any] | None], on_dead: Callable[[Any, set[int]], None]):
        """Start a thread that reads the heartbeats of the current generation's other members every
        ``heartbeat_interval`` (a store client of its own) and calls ``on_dead(token, dead)`` once per ``token`` when
        some stopped for ``failure_timeout``: how a worker blocked in a collective that waits on a live peer (which
        itself waits on the dead one, or already left the group) learns of a death without waiting out the op
        timeout. ``members()`` returns ``(generation, token)`` (the token: the group to abort), or None while no
        group is to be watched (one being formed is watched by :meth:`while_alive`). Stops with :meth:`close`."""
        beats = _Heartbeats(dist.PrefixStore(self._prefix, self._connect()), self.failure_timeout)

        def run() -> None:
            fired = None
            while not self._stop.wait(self.heartbeat_interval):
                current = members()
                if current is None or current[1] is fired:
                    continue
                g, token = current
                try:
                    dead = beats.dead([m for m in g.members if m != self.id], time.monotonic())
                except Exception:  # the service is gone: the next generation decision will say so
                    return
                if dead:
                    fired = token
                    on_dead(token, dead)

        thread = threading.Thread(target=run, daemon=True, name="gpudist-live-watch")
        thread.start()
        return thread

    def admission_due(self, current: Generation, step: int, rank: int) -> bool:
        """The per-step check (one store round trip; two on rank 0): whether ``current`` ends before ``step`` to
        admit newcomers. Rank 0 marks the end at the next step when a join request is pending; every rank reads
        the mark at the start of each step, so all leave at the same step (see the module doc).

        Args:
            current: This worker's generation.
            step: The step about to run.
            rank: This worker's rank in ``current``.

        Returns:
            True when this worker must call :meth:`next_generation` before running ``step``.
        """
        key = f"admit/{current.number}"
        if rank == 0 and self._admit_written != current.number and self.store.add("joins", 0) > current.admitted:
            self.store.compare_set(key, "", str(step + 1))
            self._admit_written = current.number
        return self.store.check([key]) and step >= int(self.store.get(key))


class _Heartbeats:
    """Which members' heartbeat counters stopped moving for ``failure_timeout`` seconds. One per worker, kept across
    its waits (the decision, the barrier, the connect): a member found silent in one wait is not given a fresh
    ``failure_timeout`` in the next, so a death during a group's connect costs one detection, not two."""

    def __init__(self, store: dist.Store, failure_timeout: float):
        self.store, self.failure_timeout = store, failure_timeout
        self._seen: dict[int, tuple[int, float, bool]] = {}  # id -> (last count, when it last moved, moved at all)

    def dead(self, members: list[int], now: float) -> set[int]:
        """Read the counters of ``members`` (one store round trip each); return those silent for too long."""
        for m in members:
            count = self.store.add(f"hb/{m}", 0)
            last = self._seen.get(m)
            if last is None:
                self._seen[m] = (count, now, False)
            elif count != last[0]:
                self._seen[m] = (count, now, True)
        return {m for m in members if now - self._seen[m][1] > self.failure_timeout}

    def moved(self, member: int) -> bool:
        """Whether ``member``'s counter was ever seen moving (a live process, not a stale join request)."""
        return self._seen[member][2]


# ---------------------------------------------------------------------------------------------------------------------
# Buddy redundancy (ZeRO-1/2): every rank's shard mirrored on the next rank

_FRAME_SLACK = 4096
"""Bytes a mirror frame holds beyond the snapshot it was sized for: room for the numbers in the snapshot's metadata
(step, samples seen) to grow without a larger message."""


def _frame_capacity(length: int) -> int:
    """Bytes of a frame for a snapshot frame of ``length`` bytes in use (:func:`~gpudist.checkpoint.frame_length`):
    those and the slack."""
    return length + _FRAME_SLACK


def newest_covered(reports: list[dict[str, Any]]) -> tuple[int, int] | None:
    """The newest ``(step, layout)`` at which every member of generation ``layout`` has its shard somewhere: on
    itself (a survivor's own copy or live state) or on its buddy (the next member in rank order, which mirrors it).

    Args:
        reports: One per rank of the new group (what :meth:`_BuddyMirror.report` returns): ``layout`` (the
            generation its copies are in; None: it holds none), ``members`` (that generation's member ids in rank
            order), ``id``, ``own`` (steps of its own shard it can provide), ``mirror`` (steps of its predecessor's
            shard it holds).

    Returns:
        The step and layout generation, or None when no step is covered (a buddy pair lost both members, or nobody
        holds any state).
    """
    have: set[tuple[int, int, int]] = set()  # (layout, member, step)
    members: dict[int, list[int]] = {}
    for r in reports:
        if r["layout"] is None:
            continue
        layout, ring = r["layout"], r["members"]
        members[layout] = ring
        predecessor = ring[(ring.index(r["id"]) - 1) % len(ring)]
        have.update((layout, r["id"], t) for t in r["own"])
        have.update((layout, predecessor, t) for t in r["mirror"])
    covered = [(t, layout) for layout, _, t in have if all((layout, m, t) in have for m in members[layout])]
    return max(covered, default=None)


def _uncovered(reports: list[dict[str, Any]]) -> str:
    """Why :func:`newest_covered` found nothing, in words: the members whose shard is nowhere at the newest step."""
    held = [r for r in reports if r["layout"] is not None and r["own"]]
    if not held:
        return "no member holds any state"
    newest = max(held, key=lambda r: (r["layout"], max(r["own"])))
    layout, ring, step = newest["layout"], newest["members"], max(newest["own"])
    present = {r["id"] for r in reports if r["layout"] == layout}
    missing = [m for m in ring if m not in present and ring[(ring.index(m) + 1) % len(ring)] not in present]
    if not missing:
        return f"the buddy mirrors of generation {layout} do not agree on a step (newest own: {step})"
    pairs = ", ".join(f"member {m} and its buddy {ring[(ring.index(m) + 1) % len(ring)]}" for m in missing)
    return f"both members of a buddy pair were lost ({pairs} of generation {layout}): their shard is nowhere"


class _BuddyMirror:
    """One rank's part of buddy redundancy: frames (:func:`~gpudist.checkpoint.snapshot_frame`) of its own shard (the
    ZeRO model's and optimizer's: its share of the parameters and its optimizer shard) at the two newest steps, and
    the mirrors of its predecessor's (rank - 1's), all in the coordinates of generation ``layout``.

    After each step every rank sends its new frame to its buddy (rank + 1) and receives its predecessor's, of fixed
    sizes (set at the generation's first, synchronous exchange). On Gloo and in-memory groups the receive is posted
    a step ahead, so a frame moves as soon as it is sent (a member killed right after sending still delivers it);
    where p2p runs in issue order (NCCL) a receive posted ahead would stall the stream, so the send and the receive
    go in one group call at the same point of every rank's op sequence. It moves while the next step's forward and
    backward run. The trainer waits for it before the next step's optimizer update: once
    any rank completes a collective of step ``s + 1`` after that wait, every mirror of step ``s`` has arrived. A
    snapshot that outgrew its frame (an optimizer that creates state lazily) follows whole in a second exchange at
    that wait, where both ends know of it. A member killed between finishing a step and its frame arriving takes
    that step's shard with it: the survivors then rebuild the step before (one step redone). Frames dropped (older
    than the step before) are reused for the next ones, so a step allocates no fresh memory.
    """

    def __init__(self, layout: Generation | None = None, member: int | None = None):
        self.layout = layout
        self.member = member
        self.own: dict[int, torch.Tensor] = {}
        self.mirror: dict[int, torch.Tensor] = {}
        self._send_cap = 0
        self._recv_cap = 0
        self._spare: list[torch.Tensor] = []  # dropped frames (host), for reuse
        self._recv: tuple[CommunicationBackend, int, Work, torch.Tensor] | None = None
        """The predecessor's frame being received: group, step, work, buffer."""
        self._send: Work | None = None
        """This rank's last post, until settled (where p2p is ordered, the same work as the receive)."""
        self._outgrew = False
        """Whether that post's frame outgrew the size the buddy expects (then it is sent whole at the settle)."""

    @classmethod
    def begin(
        cls, comm: CommunicationBackend, g: Generation, member: int, step: int, frame: torch.Tensor
    ) -> _BuddyMirror:
        """Generation ``g``'s first exchange (collective, synchronous): the frame sizes, then the frames."""
        mirror = cls(g, member)
        if comm.world_size == 1:
            mirror.own[step] = frame
            return mirror
        lengths = torch.zeros(comm.world_size, dtype=torch.int64, device=comm.device)
        comm.all_gather(torch.tensor([frame_length(frame)], dtype=torch.int64, device=comm.device), lengths)
        mirror._send_cap = _frame_capacity(int(lengths[comm.rank]))
        mirror._recv_cap = _frame_capacity(int(lengths[(comm.rank - 1) % comm.world_size]))
        if frame.numel() < mirror._send_cap:
            frame = torch.cat([frame, frame.new_empty(mirror._send_cap - frame.numel())])
        mirror.post(comm, step, frame)
        mirror.settle(strict=True)
        return mirror

    @property
    def nbytes(self) -> int:
        """Bytes held for redundancy: own frames, mirrors, spare frames and the frames in flight."""
        held = sum(f.numel() for f in (*self.own.values(), *self.mirror.values(), *self._spare))
        return held + (self._recv[3].numel() if self._recv is not None else 0)

    @property
    def capacity(self) -> int:
        """The size of this rank's frames (pass to :func:`~gpudist.checkpoint.snapshot_frame`)."""
        return self._send_cap

    def spare(self, numel: int) -> torch.Tensor | None:
        """A dropped frame of ``numel`` bytes at least, to write the next snapshot into, or None."""
        for i, frame in enumerate(self._spare):
            if frame.numel() >= numel:
                return self._spare.pop(i)
        return None

    def predecessor(self) -> int:
        ring = self.layout.members
        return ring[(ring.index(self.member) - 1) % len(ring)]

    def _keep(self, held: dict[int, torch.Tensor], step: int) -> dict[int, torch.Tensor]:
        """``held`` without what is older than ``step - 1`` (host frames kept as spares; at most two)."""
        for s, frame in held.items():
            if s < step - 1 and frame.device.type == "cpu" and len(self._spare) < 2:
                self._spare.append(frame)
        return {s: f for s, f in held.items() if s >= step - 1}

    def _post_recv(self, comm: CommunicationBackend, step: int) -> None:
        """Post the receive of the predecessor's frame of ``step`` (alone: a transport whose ops progress on their
        own, where it is posted a step ahead, so that frame moves as soon as the predecessor sends it)."""
        received = self.spare(self._recv_cap) if comm.device.type == "cpu" else None
        received = torch.empty(self._recv_cap, dtype=torch.uint8, device=comm.device) if received is None else received
        work = comm.recv(received[: self._recv_cap], (comm.rank - 1) % comm.world_size, async_op=True)
        self._recv = (comm, step, work, received)

    def post(self, comm: CommunicationBackend, step: int, frame: torch.Tensor) -> None:
        """Keep ``frame`` (this rank's snapshot at ``step``), send it to the buddy (and, where p2p runs in issue
        order, post the predecessor's receive with it, in one group call), and drop what is older than
        ``step - 1``."""
        self.own = self._keep(self.own, step)
        self.own[step] = frame
        self.mirror = self._keep(self.mirror, step)
        if comm.world_size == 1:
            return
        # A frame that outgrew the size the buddy expects: its first bytes, whose length tells the buddy so.
        self._outgrew = frame_length(frame) > self._send_cap
        send = (frame[: self._send_cap].to(comm.device), (comm.rank + 1) % comm.world_size)
        if comm.ordered_p2p:  # issued at the same point by every rank: it cannot stall a stream
            received = torch.empty(self._recv_cap, dtype=torch.uint8, device=comm.device)
            self._send = comm.batch_send_recv([send], [(received, (comm.rank - 1) % comm.world_size)])
            self._recv = (comm, step, self._send, received)
            return
        if self._recv is None or self._recv[1] != step:  # the generation's first post
            self._post_recv(comm, step)
        self._send = comm.send(*send, async_op=True)

    def settle(self, *, strict: bool) -> None:
        """Complete the last post's exchange. ``strict``: wait, exchange the frames that outgrew their sizes, post
        the next receive (where it goes a step ahead), and raise a CommunicationError (training: a failure like any
        other). Otherwise (after a failure, before this worker aborts the old group): wait for the predecessor's
        frame (also when this rank did not post that step: it may have arrived) and this rank's send on a transport
        whose ops progress on their own (a dead peer's connection errors at once; a live one sent it, or fails and
        aborts the group too, which ends the wait), just look where p2p runs in issue order (NCCL: a peer's abort
        does not end this rank's wait); give up a mirror that did not arrive or did not fit."""
        if self._recv is None or (strict and self._send is None):
            return
        comm, step, recv, received = self._recv
        send, outgrew = self._send, self._outgrew
        self._recv = self._send = None
        if not strict:
            for work in (w for w in (send, recv) if w is not None) if not comm.ordered_p2p else ():
                try:  # bounded: a peer that never sent fails, aborts and ends this wait (or the heartbeat watch does)
                    work.wait()
                except CommunicationError:  # a dead buddy needs no mirror; a frame that never came is lost
                    pass
            if not recv.is_completed() or (send is not None and not send.is_completed()):
                return
        try:
            recv.wait()
            if send is not None:
                send.wait()
        except CommunicationError:
            if strict:
                raise
            return
        received = received.cpu()
        length = frame_length(received)
        theirs_outgrew = length > received.numel()
        if not theirs_outgrew:
            self.mirror[step] = received
        if not strict:
            return  # (an outgrown frame's rest never comes)
        if outgrew or theirs_outgrew:
            rank, world = comm.rank, comm.world_size
            mine = self.own[step][: frame_length(self.own[step])]
            whole = torch.empty(length if theirs_outgrew else 0, dtype=torch.uint8, device=comm.device)
            sends = [(mine.to(comm.device), (rank + 1) % world)] if outgrew else []
            recvs = [(whole, (rank - 1) % world)] if theirs_outgrew else []
            comm.batch_send_recv(sends, recvs).wait()  # both ends of each pair know of it now
            if theirs_outgrew:
                self.mirror[step] = whole.cpu()
                self._recv_cap = _frame_capacity(length)
            if outgrew:
                self._send_cap = _frame_capacity(mine.numel())
        if not comm.ordered_p2p:
            self._post_recv(comm, step + 1)

    def report(self, live_step: int | None) -> dict[str, Any]:
        """What this rank can provide (see :func:`newest_covered`); ``live_step``: the step of its live state, if
        whole."""
        if self.layout is None:
            return {"layout": None, "members": [], "id": self.member, "own": [], "mirror": []}
        own = set(self.own) | ({live_step} if live_step is not None else set())
        return {
            "layout": self.layout.number,
            "members": list(self.layout.members),
            "id": self.member,
            "own": sorted(own),
            "mirror": sorted(self.mirror),
        }


# ---------------------------------------------------------------------------------------------------------------------
# The trainer


def _wrap(module: nn.Module, config: ShardingConfiguration, zero_stage: int) -> nn.Module:
    """The wrapper that pairs with ``ElasticOptimizer(zero_stage=...)`` (:func:`~gpudist.elastic.elastic_classes`)."""
    return elastic_classes(zero_stage)[0](module, config)


class LiveElasticTrainer:
    """Data-parallel training (DDP, or ZeRO-1/2/3 with ``zero_stage``) that survives workers dying and joining
    without restarting anyone (see the module doc for the protocol).

    A class of its own rather than ``ElasticOptimizer(mode="live")``: a failed step has to be re-run with the global
    batch split over the new members, so the trainer owns forward and backward (:meth:`train_step`), and the model
    wrapper and optimizer are rebuilt on each generation's group, so the caller cannot hold them across steps. Each
    generation's optimizer *is* an :class:`~gpudist.ElasticOptimizer` (restart mode's), which writes the
    checkpoints live mode falls back on.

    Args:
        build_module: Returns a fresh module (the same architecture every call; its initial values only matter for
            the first generation, and rank 0's are used).
        build_optimizer: Returns the torch optimizer over the parameters given.
        membership: This worker's :class:`Membership`.
        checkpoint_dir: Checkpoints (the fallback when sharded state is lost), as :class:`~gpudist.ElasticOptimizer`.
        checkpoint_every: Steps between checkpoints.
        zero_stage: 0 (replicated state), 1, 2 or 3 (ZeRO-3: :attr:`model` is a :class:`~gpudist.ZeRO3Model`, whose
            module holds no parameters between forwards: read them with ``model.gather_full_parameters()``).
        backend: ``"gloo"`` (processes), ``"nccl"`` (processes, one GPU each: the module is moved to the backend's
            device, a dead peer is detected by its heartbeat and a hung one by the op ``timeout``, and each
            generation aborts the old communicator and forms a new one; not MPI, which cannot drop a dead rank
            without ULFM) or ``"inmemory"`` (threads of one process: tests).
        timeout: Seconds every collective may take (bounds the detection of a hung peer).
        connect_timeout: Seconds a new generation's group may take to connect while all its members heartbeat (one
            that stops is detected after ``failure_timeout`` instead: :meth:`Membership.while_alive`). None:
            ``timeout``.
        config_options: Passed to :class:`~gpudist.ShardingConfiguration` (e.g. ``bucket_cap_mb``).
        redundancy: None, or ``"buddy"`` (ZeRO-1/2/3 only): after each step every rank's shard snapshot (its optimizer
            shard and its share of the parameters, at stage 3 their only copy) is mirrored to the next rank (async,
            waited for before the next step's optimizer update), so when members die the survivors rebuild the state
            from those mirrors, live, instead of reloading the checkpoint, as long as no member died together with its
            buddy. Costs host memory of about six copies of the shard per rank (two own, two mirrored, a spare and
            one in flight; :attr:`buddy_bytes`) and, per step, one copy of the shard plus a send/recv (1.05-1.13x the
            step time on a 13.9M-parameter GPT: docs/strategies.md).
    """

    def __init__(
        self,
        build_module: Callable[[], nn.Module],
        build_optimizer: Callable[[Any], torch.optim.Optimizer],
        membership: Membership,
        checkpoint_dir: str | os.PathLike,
        checkpoint_every: int = 100,
        *,
        zero_stage: int = 0,
        backend: str = "gloo",
        timeout: float = 10.0,
        connect_timeout: float | None = None,
        config_options: dict[str, Any] | None = None,
        redundancy: str | None = None,
    ):
        if backend not in ("gloo", "nccl", "inmemory"):
            raise ValueError(
                f"backend={backend!r}; use 'gloo', 'nccl' or 'inmemory' (an MPI job cannot drop a dead rank without "
                "ULFM: see docs/strategies.md)"
            )
        if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={zero_stage!r}; use 0 (DDP), 1, 2 or 3 (ZeRO-1/2/3)")
        if redundancy not in (None, "buddy"):
            raise ValueError(f"redundancy={redundancy!r}; use None or 'buddy'")
        if redundancy == "buddy" and zero_stage == 0:
            raise ValueError(
                "redundancy='buddy' mirrors sharded state; with zero_stage=0 every rank holds the whole state already "
                "(use zero_stage=1, 2 or 3, or leave redundancy=None)"
            )
        self.build_module = build_module
        self.build_optimizer = build_optimizer
        self.membership = membership
        self.checkpoint_dir = Path(checkpoint_dir)
        self.checkpoint_every = checkpoint_every
        self.zero_stage = zero_stage
        self.backend = backend
        self.timeout = timeout
        self.connect_timeout = timeout if connect_timeout is None else connect_timeout
        self.config_options = dict(config_options or {})
        self.step_count = 0
        self.samples_seen = 0
        self.events: list[dict[str, Any]] = []
        """One entry per generation this worker formed: number, world size, why, how the state healed, the step
        before and after, times (``time.time()``) of detection, decision, connect, heal and completion, and the
        ``trail`` of generations that failed to form before it (with their times and errors)."""
        self.generation: Generation | None = None
        self.comm: CommunicationBackend | None = None
        self.model: nn.Module | None = None
        self.optimizer: ElasticOptimizer | None = None
        self._torch_optimizer: torch.optim.Optimizer | None = None
        self._state_ok = False  # whether self.model/self.optimizer hold a whole state at self.step_count
        self.redundancy = redundancy
        self._buddy = _BuddyMirror(None, membership.id) if redundancy == "buddy" else None
        self._heal_detail: str | None = None
        self._phases: dict[str, float] = {}  # when the generation being formed was decided, connected, healed
        self._retired: list[tuple[float, CommunicationBackend]] = []  # (release after, group): see _retire
        self._watched: tuple[Generation, CommunicationBackend] | None = None  # what the watch thread may abort
        try:  # a process's first optimizer imports torch's compiler stack (1.2 s here): before joining, not in a heal
            build_optimizer([nn.Parameter(torch.zeros(1))])
        except Exception:  # an optimizer builder that wants the real parameters: it warms up in the heal instead
            pass
        self._enter(self.membership.join(), "join", time.time())
        self.membership.watch(lambda: self._watched, self._dead_found)

    def _dead_found(self, comm: CommunicationBackend, dead: set[int]) -> None:
        """The watch thread's verdict: members of the current generation stopped heartbeating. Abort its group, so
        this worker's op in it fails now (and every peer op that waits on this worker), whatever it waits on."""
        _abort(comm, f"member(s) {sorted(dead)} stopped heartbeating for {self.membership.failure_timeout:g}s")

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def buddy_bytes(self) -> int:
        """Host bytes this rank holds for buddy redundancy (0 without): its own shard snapshots, its predecessor's
        mirrored ones and the frames in flight."""
        return 0 if self._buddy is None else self._buddy.nbytes

    # -- generations -------------------------------------------------------------------------------------------------

    def _group(self, g: Generation) -> CommunicationBackend:
        """Generation ``g``'s group, connected only once every member is in it (watched by heartbeat)."""
        rank, world = g.rank_of(self.membership.id), len(g.members)
        name = f"live-gen-{g.number}"

        def connect(store: dist.Store) -> CommunicationBackend:
            if self.backend in ("gloo", "nccl"):  # every member is in the group once it connected; NCCL: a fresh id
                joined = GlooCommunicationBackend if self.backend == "gloo" else NCCLCommunicationBackend
                return joined.join_group(
                    dist.PrefixStore(f"{name}/", store),
                    rank,
                    world,
                    name=name,
                    timeout=self.timeout,
                    connect_timeout=self.connect_timeout,
                )
            comm = InMemoryCommunicationBackend(rank, world, f"{self.membership.job}/{name}", self.timeout)
            # Wait until every member holds this group: an in-memory group a member aborted (died) before another
            # joined it would be formed afresh by the latecomer, which would then wait for the dead one in every op.
            comm.barrier()
            return comm

        return self.membership.while_alive(g, connect, _release)

    def _enter(self, g: Generation, reason: str, detected: float) -> None:
        """Form generation ``g`` (and the next ones while forming fails) and heal the state into it."""
        trail: list[dict[str, Any]] = []  # the generations tried before this one formed, and why each failed
        self._watched = None
        while True:
            if self.membership.id not in g.members:
                self._state_ok = False  # counted dead: whatever this worker holds is stale
                if self._buddy is not None:
                    self._buddy = _BuddyMirror(None, self.membership.id)
                trail.append({"generation": g.number, "left_out": time.time()})
                g = self.membership.join()
                continue
            before = self.step_count if self._state_ok else None
            completed = self.step_count  # steps applied before the failure, also when the last was cut off
            self._heal_detail = None
            self._phases = {"decided": time.time()}
            try:
                heal = self._form(g)
            except (CommunicationError, MembershipError) as e:  # a member died (or hung) while the group formed
                reason, detected = f"failure while forming generation {g.number}: {e}", time.time()
                trail.append({"generation": g.number, **self._phases, "failed": detected, "error": str(e)[:300]})
                g = self.membership.next_generation(g)
                continue
            self.events.append(
                {
                    "generation": g.number,
                    "world": len(g.members),
                    "reason": reason,
                    "heal": heal,
                    "lost": list(g.lost),
                    "step_before": before,
                    "completed_before": completed,
                    "step": self.step_count,
                    "detail": self._heal_detail,
                    "detected": detected,
                    **self._phases,
                    "formed": time.time(),
                    "trail": trail,
                }
            )
            self._watched = (g, self.comm)
            return

    def _form(self, g: Generation) -> str:
        comm = self._group(g)
        self._phases["connected"] = time.time()
        try:
            return self._form_on(g, comm)
        except BaseException as e:
            _abort(comm, f"forming generation {g.number} failed: {e}")  # peers still in it fail at once
            self._retire(comm)
            raise

    def _form_on(self, g: Generation, comm: CommunicationBackend) -> str:
        config = ShardingConfiguration(comm, **self.config_options)
        model = _wrap(self.build_module().to(comm.device), config, self.zero_stage)
        torch_opt = self.build_optimizer(model.parameters())
        opt = ElasticOptimizer(
            torch_opt,
            config,
            self.checkpoint_dir,
            self.checkpoint_every,
            model=model,
            zero_stage=self.zero_stage,
            resume=False,
        )
        held = self.step_count, self.samples_seen  # what the old model and optimizer are at
        heal = self._heal(g, comm, model, opt)
        self._phases["healed"] = time.time()
        if self._buddy is not None:  # mirror the state just healed at once: a death in the next step is covered too
            try:
                frame = snapshot_frame(model, opt, step=self.step_count, extra=self._extra())
                self._buddy = _BuddyMirror.begin(comm, g, self.membership.id, self.step_count, frame)
            except CommunicationError:
                self.step_count, self.samples_seen = held  # the healed state was never switched to
                raise
        old = self.comm
        self.generation, self.comm, self.model, self.optimizer, self._torch_optimizer = g, comm, model, opt, torch_opt
        self._state_ok = True
        opt.step_count, opt.samples_seen = self.step_count, self.samples_seen
        opt.history.append([self.step_count, comm.world_size])
        if old is not None:
            self._retire(old)
        return heal

    def _retire(self, old: CommunicationBackend) -> None:
        """Release ``old`` (the previous generation's group) only once none of its ops can still be in flight, and
        release the groups retired more than the op ``timeout`` ago. Freeing a Gloo group waits for its ops in flight
        (after a failed ZeRO-2 all-gather: the other ranges' broadcasts, until their op ``timeout``) and holds the GIL
        meanwhile, so this worker's heartbeat stopped too: heals of 7-10 s instead of ~1.2 s and live members counted
        dead in benchmarks/live_elastic.py (ZeRO-2 with buddy, kills during the all-gather)."""
        now = time.monotonic()
        self._retired.append((now + self.timeout, old))
        for _, comm in (r for r in self._retired if r[0] <= now):
            _release(comm)
        self._retired = [r for r in self._retired if r[0] > now]

    def _extra(self) -> dict[str, Any]:
        return {"live": {"samples_seen": self.samples_seen}}

    def _snapshot(self, whole: bool) -> bytes:
        """This worker's state: a whole copy (replicated state) or its shard in the old group's coordinates."""
        if whole:
            return snapshot_state(self.model.module, self._torch_optimizer, step=self.step_count, extra=self._extra())
        return snapshot_state(self.model, self.optimizer, step=self.step_count, extra=self._extra())

    def _heal(self, g: Generation, comm: CommunicationBackend, model: nn.Module, opt: ElasticOptimizer) -> str:
        if self._buddy is not None:
            return self._heal_from_buddies(comm, model, opt)
        mine = self.step_count if self._state_ok else -1
        steps = torch.zeros(comm.world_size, dtype=torch.int64, device=comm.device)
        comm.all_gather(torch.tensor([mine], dtype=torch.int64, device=comm.device), steps)
        steps = steps.tolist()
        best = max(steps)
        if best < 0 or (self.zero_stage and (g.lost or min(steps[: len(g.survivors)]) != best)):
            opt.restore()  # no whole state anywhere (a sharded member was lost): the newest checkpoint, resharded
            self.step_count, self.samples_seen = opt.step_count, opt.samples_seen
            return "disk" if opt.restored is not None else "initial"
        if self.zero_stage:  # nothing lost: every old member's shard, resharded over the new group
            blobs = [b for b in exchange_bytes(comm, self._snapshot(False) if mine >= 0 else b"") if b]
            how = "peers"
        elif min(steps) == best:  # everyone holds the same whole state already
            blobs, how = [self._snapshot(True)], "local"
        else:  # the lowest rank at the newest step sends its whole state
            src = steps.index(best)
            blobs, how = [_broadcast_bytes(comm, self._snapshot(True) if comm.rank == src else b"", src)], "peer"
        info = load_snapshots(blobs, model, opt)
        self.step_count = info.step
        self.samples_seen = int(info.extra.get("live", {}).get("samples_seen", 0))
        return how

    def _heal_from_buddies(self, comm: CommunicationBackend, model: nn.Module, opt: ElasticOptimizer) -> str:
        """Sharded state with buddy mirrors: every rank says which steps of its own shard and of its predecessor's it
        holds; all load the newest step at which every old member's shard is held by someone (the survivors' own,
        the dead members' from their buddies), resharded over the new group. When a buddy pair lost both members,
        the newest checkpoint instead."""
        buddy = self._buddy
        buddy.settle(strict=False)  # the last mirror, if it arrived before the failure
        report = buddy.report(self.step_count if self._state_ok else None)
        reports = [json.loads(b) for b in exchange_bytes(comm, json.dumps(report).encode())]
        found = newest_covered(reports)
        if found is None:
            if any(r["own"] for r in reports):
                self._heal_detail = f"buddy redundancy cannot rebuild the state: {_uncovered(reports)}"
                if comm.rank == 0:
                    _log.warning("gpudist.live: %s; loading the newest checkpoint", self._heal_detail)
            opt.restore()
            self.step_count, self.samples_seen = opt.step_count, opt.samples_seen
            return "disk" if opt.restored is not None else "initial"
        step, layout = found
        held = report["layout"] == layout
        own = b""
        if held and step in report["own"]:  # not copied yet: the live state is at that step
            own = frame_snapshot(buddy.own[step]) if step in buddy.own else self._snapshot(False)
        owners = {r["id"] for r in reports if r["layout"] == layout and step in r["own"]}
        mirrored = b""
        if held and step in report["mirror"] and buddy.predecessor() not in owners:
            mirrored = frame_snapshot(buddy.mirror[step])
        rebuilt = [b for b in exchange_bytes(comm, mirrored) if b]
        blobs = [b for b in exchange_bytes(comm, own) if b] + rebuilt
        info = load_snapshots(blobs, model, opt)
        self.step_count = info.step
        self.samples_seen = int(info.extra.get("live", {}).get("samples_seen", 0))
        return "buddy" if rebuilt else "peers"

    def close(self) -> None:
        """Commit the pending checkpoint if the group is healthy, stop heartbeating and release the group."""
        self.membership.close()
        for _, comm in self._retired:
            _release(comm)
        if self.comm is not None:
            _release(self.comm)

    # -- training ----------------------------------------------------------------------------------------------------

    def train_step(
        self,
        get_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    ) -> float | None:
        """Run step ``step_count`` on its global batch, surviving failures: see the module doc.

        Args:
            get_batch: ``step -> (inputs, targets)``, the step's whole global batch (the same on every worker);
                this rank trains on its share (``torch.tensor_split(..., world_size)[rank]``).
            loss_fn: ``(outputs, targets) -> loss`` summed (not averaged) over the share's samples; the step
                minimizes its mean over the global batch.

        Returns:
            This rank's share's summed loss, or None when the step counter moved without this worker training
            (a peer had applied the step before a failure, or the state rolled back to a checkpoint): loop on
            ``step_count``.

        Raises:
            MembershipError: When the membership could not be agreed on (see :class:`Membership`).
        """
        start = self.step_count
        while True:
            g = self.generation
            if self.membership.admission_due(g, self.step_count, self.comm.rank):
                self._enter(self.membership.next_generation(g), "admission", time.time())
            if self.step_count != start:
                return None
            try:
                return self._attempt(get_batch(self.step_count), loss_fn)
            except CommunicationError as e:
                detected = time.time()
                if self._buddy is not None:  # the last mirror frames, sent and received, before leaving the group
                    self._buddy.settle(strict=False)  # (still watched: a member that stopped heartbeating ends it)
                self._watched = None
                # Leave the group at once: a survivor still waiting on this worker in an op fails now instead of at
                # the op timeout (then it aborts too, and so on), so every survivor reaches the decision below.
                _abort(self.comm, f"this worker left after: {e}")
                self._enter(self.membership.next_generation(self.generation), f"failure: {e}", detected)

    def _attempt(self, batch: tuple[torch.Tensor, torch.Tensor], loss_fn) -> float:
        inputs, targets = batch
        world, rank = self.comm.world_size, self.comm.rank
        total = inputs.shape[0]
        x, y = (torch.tensor_split(t, world)[rank].to(self.comm.device) for t in (inputs, targets))
        loss = loss_fn(self.model(x), y)
        (loss * (world / total)).backward()
        if self._buddy is not None:  # the previous step's mirrors, before this step changes any shard
            self._buddy.settle(strict=True)
        opt, before = self.optimizer, self.optimizer.step_count
        try:
            opt.step()
        except CommunicationError:
            if self.zero_stage and opt.step_count == before:
                self._state_ok = False  # a sharded step may have updated some shards and not gathered them
            raise
        finally:
            self.step_count = opt.step_count
        self.samples_seen += total
        opt.samples_seen = self.samples_seen
        opt.zero_grad()
        if self._buddy is not None:
            buddy = self._buddy
            frame = snapshot_frame(
                self.model,
                self.optimizer,
                step=self.step_count,
                extra=self._extra(),
                capacity=buddy.capacity,
                out=buddy.spare(buddy.capacity),
            )
            buddy.post(self.comm, self.step_count, frame)
        return float(loss.detach())

    def finish(self) -> None:
        """Commit the pending checkpoint (collective). Call after the last step."""
        self.optimizer.finish()


def _abort(comm: CommunicationBackend, reason: str) -> None:
    """Break ``comm`` from this worker now (any thread): Gloo shuts down its connections, NCCL aborts its
    communicator, an in-memory group fails on every member; its pending ops fail at once."""
    if isinstance(comm, (InMemoryCommunicationBackend, GlooCommunicationBackend, NCCLCommunicationBackend)):
        try:
            comm.abort(reason)
        except Exception as e:  # best effort: the group is left either way, and its ops still time out
            _log.warning("gpudist.live: aborting group %r failed: %s: %s", comm.group, type(e).__name__, e)


def _release(comm: CommunicationBackend) -> None:
    """Close a group this worker no longer uses (Gloo: its connections; NCCL: ``ncclCommAbort`` when a failure broke
    it, ``ncclCommDestroy`` otherwise; in-memory groups hold nothing)."""
    if hasattr(comm, "shutdown"):
        comm.shutdown()


def _broadcast_bytes(comm: CommunicationBackend, payload: bytes, src: int) -> bytes:
    """``src``'s ``payload`` on every rank (a length, then the bytes; collective)."""
    length = torch.tensor([len(payload)], dtype=torch.int64, device=comm.device)
    comm.broadcast(length, src)
    data = torch.zeros(int(length), dtype=torch.uint8, device=comm.device)
    if comm.rank == src and payload:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    comm.broadcast(data, src)
    return data.cpu().numpy().tobytes()


# ---------------------------------------------------------------------------------------------------------------------
# The launcher: python -m gpudist.live


def launch(command: list[str], nproc: int, *, replacements: int = 0, host: str = "127.0.0.1", port: int = 0) -> int:
    """Host the membership service, start ``nproc`` workers running ``command``, and start a replacement for each
    worker that dies (up to ``replacements`` times); return when every worker has exited.

    Returns:
        0 when the last workers all exited with 0, else the first non-zero exit code seen among them.
    """
    service = MembershipService(host, port)
    env = {**os.environ, STORE_ENV: service.address, "PYTHONUNBUFFERED": "1"}
    workers = [subprocess.Popen(command, env=env) for _ in range(nproc)]
    code = 0
    try:
        while workers:
            time.sleep(0.1)
            for w in list(workers):
                rc = w.poll()
                if rc is None:
                    continue
                workers.remove(w)
                if rc != 0 and replacements > 0:
                    replacements -= 1
                    print(f"gpudist.live: worker {w.pid} exited with {rc}; starting a replacement", file=sys.stderr)
                    workers.append(subprocess.Popen(command, env=env))
                elif rc != 0 and code == 0:
                    code = rc
    finally:
        for w in workers:
            w.send_signal(signal.SIGTERM)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpudist.live",
        description="Run a live elastic job: host the membership service and start the workers.",
    )
    parser.add_argument("--nproc", type=int, required=True, help="workers to start")
    parser.add_argument("--replacements", type=int, default=0, help="workers to start in place of ones that die")
    parser.add_argument("--host", default="127.0.0.1", help="address the membership service listens on")
    parser.add_argument("--port", type=int, default=0, help="its port (0: any free one)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the worker's command line (after --)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the worker's command after --")
    return launch(command, args.nproc, replacements=args.replacements, host=args.host, port=args.port)


if __name__ == "__main__":
    sys.exit(main())
