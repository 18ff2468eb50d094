"""The trainer: :class:`LiveElasticTrainer`, which forms each generation's group, heals the state into it and retries
a failed step (the protocol is described in :mod:`gpudist.live`)."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint import frame_snapshot, load_snapshots, snapshot_frame, snapshot_state
from ..comm import CommunicationBackend, CommunicationError, GlooCommunicationBackend, InMemoryCommunicationBackend
from ..comm.nccl import NCCLCommunicationBackend
from ..config import ShardingConfiguration
from ..elastic import ElasticOptimizer, elastic_classes
from ..flat import exchange_bytes
from .membership import Generation, Membership, MembershipError
from .mirror import _BuddyMirror, _uncovered, newest_covered

_log = logging.getLogger("gpudist.live")


def _wrap(module: nn.Module, config: ShardingConfiguration, zero_stage: int) -> nn.Module:
    """The wrapper that pairs with ``ElasticOptimizer(zero_stage=...)`` (:func:`~gpudist.elastic.elastic_classes`)."""
    return elastic_classes(zero_stage)[0](module, config)


class LiveElasticTrainer:
    """Data-parallel training (DDP, or ZeRO-1/2/3 with ``zero_stage``) that survives workers dying and joining
    without restarting anyone (see the package doc, :mod:`gpudist.live`, for the protocol).

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
        """Run step ``step_count`` on its global batch, surviving failures: see the package doc (:mod:`gpudist.live`).

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
    """Leave ``comm`` from this worker now (any thread), :meth:`CommunicationBackend.abort`: its pending ops fail at
    once, and so do the peers' ops that wait on this worker (Gloo shuts down its connections, NCCL aborts its
    communicator, an in-memory group fails on every member)."""
    try:
        comm.abort(reason)
    except Exception as e:  # best effort: the group is left either way, and its ops still time out
        _log.warning("gpudist.live: aborting group %r failed: %s: %s", comm.group, type(e).__name__, e)


def _release(comm: CommunicationBackend) -> None:
    """Close a group this worker no longer uses, :meth:`CommunicationBackend.shutdown` (Gloo: its connections; NCCL:
    ``ncclCommAbort`` when a failure broke it, ``ncclCommDestroy`` otherwise; in-memory groups hold nothing)."""
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
