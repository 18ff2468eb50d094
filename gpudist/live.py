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
  ``build_module`` / ``build_optimizer`` (the old ones are kept until the state has moved, then dropped).
* **Healing** (the state, moved over the new group, never through a file). Every member says which step its state
  is at (-1: none, a newcomer or a member whose step was cut off half-applied). Replicated state (DDP, zero_stage=0):
  the lowest rank at the highest step sends a whole copy (:func:`~gpudist.checkpoint.snapshot_state`) by broadcast,
  unless everyone is already there (each then reloads its own copy, no traffic). So a survivor whose peer applied
  the failed step before the failure (a ring all-reduce can complete on some ranks and not others) catches up
  instead of anyone applying it twice. ZeRO-1/2 (sharded state): when no member of ``g`` was lost (a join, a
  scale-up), every old member's shard snapshot is all-gathered and each rank loads its new ranges from their union
  (resharding live); when a member was lost, its optimizer shard is gone, and every member loads the newest
  complete checkpoint from ``checkpoint_dir``, resharded (steps since it are redone, in the same processes).
* **The failed step is retried** at the new world size with the same global batch: the batch is split over the
  members by numpy's ``array_split`` rule (contiguous shares, the first ``G % N`` one sample larger), each rank's
  summed loss is scaled by ``N / G`` and the gradients averaged over the ``N`` ranks, so every step minimizes the
  mean loss over the same ``G`` samples at any world size: the result equals uninterrupted training up to float
  reassociation (a different summation order of the same terms).

Limits: one process per member; Gloo (CPU) or in-memory groups (tests); ZeRO-3 is not supported; when every
member of a generation dies the job stops (relaunch it: the checkpoint is the fallback).
"""

from __future__ import annotations

import argparse
import datetime
import json
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

from .checkpoint import load_snapshots, snapshot_state
from .comm import CommunicationBackend, CommunicationError, GlooCommunicationBackend, InMemoryCommunicationBackend
from .comm.gloo import is_loopback
from .config import ShardingConfiguration
from .elastic import ElasticOptimizer
from .flat import exchange_bytes
from .strategies.ddp import DDPModel
from .strategies.zero import ZeRO2Model

__all__ = ["STORE_ENV", "Generation", "LiveElasticTrainer", "Membership", "MembershipError", "MembershipService"]

STORE_ENV = "GPUDIST_LIVE_STORE"
"""The environment variable the launcher sets to the membership service's ``host:port``."""


class MembershipError(RuntimeError):
    """The membership could not be agreed on in time (no quorum, the service is gone, or a join was never
    admitted)."""


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
        connect: Opens a client of the membership store (called twice: one client for the heartbeat thread).
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
        beats: dict[int, tuple[int, float, bool]] = {}  # id -> (last count, when it last moved, moved since start)
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
            for m in [*old, *joiners]:
                count = self.store.add(f"hb/{m}", 0)
                last = beats.get(m)
                if last is None:
                    beats[m] = (count, now, False)
                elif count != last[0]:
                    beats[m] = (count, now, True)
            dead = {m for m, (_, moved, _) in beats.items() if now - moved > self.failure_timeout}
            fresh = [j for j in joiners if beats[j][2] and j not in old]
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


# ---------------------------------------------------------------------------------------------------------------------
# The trainer


def _wrap(module: nn.Module, config: ShardingConfiguration, zero_stage: int) -> nn.Module:
    """The wrapper that pairs with ``ElasticOptimizer(zero_stage=...)``: ZeRO-2 frees the gradients it does not own,
    so it has its own model; stages 0 and 1 reduce gradients with DDP."""
    return (ZeRO2Model if zero_stage == 2 else DDPModel)(module, config)


class LiveElasticTrainer:
    """Data-parallel training (DDP, or ZeRO-1/2 with ``zero_stage``) that survives workers dying and joining
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
        zero_stage: 0 (replicated state), 1 or 2.
        backend: ``"gloo"`` (processes) or ``"inmemory"`` (threads of one process: tests).
        timeout: Seconds every collective may take (bounds the detection of a hung peer).
        connect_timeout: Seconds a new generation's group may take to connect.
        config_options: Passed to :class:`~gpudist.ShardingConfiguration` (e.g. ``bucket_cap_mb``).
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
        connect_timeout: float = 60.0,
        config_options: dict[str, Any] | None = None,
    ):
        if backend not in ("gloo", "inmemory"):
            raise ValueError(f"backend={backend!r}; use 'gloo' or 'inmemory'")
        if zero_stage not in (0, 1, 2):
            raise ValueError(f"zero_stage={zero_stage!r}; live mode supports 0 (DDP), 1 and 2")
        self.build_module = build_module
        self.build_optimizer = build_optimizer
        self.membership = membership
        self.checkpoint_dir = Path(checkpoint_dir)
        self.checkpoint_every = checkpoint_every
        self.zero_stage = zero_stage
        self.backend = backend
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.config_options = dict(config_options or {})
        self.step_count = 0
        self.samples_seen = 0
        self.events: list[dict[str, Any]] = []
        """One entry per generation this worker formed: number, world size, why, how the state healed, the step
        before and after, and times (``time.time()``) of detection and completion."""
        self.generation: Generation | None = None
        self.comm: CommunicationBackend | None = None
        self.model: nn.Module | None = None
        self.optimizer: ElasticOptimizer | None = None
        self._torch_optimizer: torch.optim.Optimizer | None = None
        self._state_ok = False  # whether self.model/self.optimizer hold a whole state at self.step_count
        self._enter(self.membership.join(), "join", time.time())

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    # -- generations -------------------------------------------------------------------------------------------------

    def _group(self, g: Generation) -> CommunicationBackend:
        rank, world = g.rank_of(self.membership.id), len(g.members)
        name = f"live-gen-{g.number}"
        if self.backend == "inmemory":
            return InMemoryCommunicationBackend(rank, world, f"{self.membership.job}/{name}", self.timeout)
        store = dist.PrefixStore(f"{name}/", self.membership.store)
        return GlooCommunicationBackend.join_group(
            store, rank, world, name=name, timeout=self.timeout, connect_timeout=self.connect_timeout
        )

    def _enter(self, g: Generation, reason: str, detected: float) -> None:
        """Form generation ``g`` (and the next ones while forming fails) and heal the state into it."""
        while True:
            if self.membership.id not in g.members:
                self._state_ok = False  # counted dead: whatever this worker holds is stale
                g = self.membership.join()
                continue
            before = self.step_count if self._state_ok else None
            try:
                heal = self._form(g)
            except CommunicationError:
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
                    "step": self.step_count,
                    "detected": detected,
                    "formed": time.time(),
                }
            )
            return

    def _form(self, g: Generation) -> str:
        comm = self._group(g)
        config = ShardingConfiguration(comm, **self.config_options)
        model = _wrap(self.build_module(), config, self.zero_stage)
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
        heal = self._heal(g, comm, model, opt)
        old = self.comm
        self.generation, self.comm, self.model, self.optimizer, self._torch_optimizer = g, comm, model, opt, torch_opt
        self._state_ok = True
        opt.step_count, opt.samples_seen = self.step_count, self.samples_seen
        opt.history.append([self.step_count, comm.world_size])
        if old is not None and hasattr(old, "shutdown"):
            old.shutdown()
        return heal

    def _snapshot(self, whole: bool) -> bytes:
        """This worker's state: a whole copy (replicated state) or its shard in the old group's coordinates."""
        extra = {"live": {"samples_seen": self.samples_seen}}
        if whole:
            return snapshot_state(self.model.module, self._torch_optimizer, step=self.step_count, extra=extra)
        return snapshot_state(self.model, self.optimizer, step=self.step_count, extra=extra)

    def _heal(self, g: Generation, comm: CommunicationBackend, model: nn.Module, opt: ElasticOptimizer) -> str:
        mine = self.step_count if self._state_ok else -1
        steps = torch.zeros(comm.world_size, dtype=torch.int64)
        comm.all_gather(torch.tensor([mine], dtype=torch.int64), steps)
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

    def close(self) -> None:
        """Commit the pending checkpoint if the group is healthy, stop heartbeating and release the group."""
        self.membership.close()
        if self.comm is not None and hasattr(self.comm, "shutdown"):
            self.comm.shutdown()

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
                self._enter(self.membership.next_generation(self.generation), f"failure: {e}", detected)

    def _attempt(self, batch: tuple[torch.Tensor, torch.Tensor], loss_fn) -> float:
        inputs, targets = batch
        world, rank = self.comm.world_size, self.comm.rank
        total = inputs.shape[0]
        x, y = torch.tensor_split(inputs, world)[rank], torch.tensor_split(targets, world)[rank]
        loss = loss_fn(self.model(x), y)
        (loss * (world / total)).backward()
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
        return float(loss.detach())

    def finish(self) -> None:
        """Commit the pending checkpoint (collective). Call after the last step."""
        self.optimizer.finish()


def _broadcast_bytes(comm: CommunicationBackend, payload: bytes, src: int) -> bytes:
    """``src``'s ``payload`` on every rank (a length, then the bytes; collective)."""
    length = torch.tensor([len(payload)], dtype=torch.int64)
    comm.broadcast(length, src)
    data = torch.zeros(int(length), dtype=torch.uint8)
    if comm.rank == src and payload:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    comm.broadcast(data, src)
    return data.numpy().tobytes()


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
