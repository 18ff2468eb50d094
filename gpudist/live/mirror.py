"""Buddy redundancy (ZeRO-1/2): every rank's shard mirrored on the next rank."""

from __future__ import annotations

from typing import Any

import torch

from ..checkpoint import frame_length
from ..comm import CommunicationBackend, CommunicationError, Work
from .membership import Generation

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
