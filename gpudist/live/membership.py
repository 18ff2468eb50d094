"""The membership of a live elastic job: the service that holds it (:class:`MembershipService`), each worker's view
of it (:class:`Membership`: its id, its heartbeat, the generations it agrees on) and the heartbeat watch. The protocol
is described in :mod:`gpudist.live`."""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..comm.gloo import is_loopback

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
        the mark at the start of each step, so all leave at the same step (see the package doc, :mod:`gpudist.live`).

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
