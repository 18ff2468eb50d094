"""The executor: one stage's part of one pipelined training step, op by op in its schedule's order.

Ops are ``(kind, micro-batch)`` or, interleaved, ``(kind, micro-batch, chunk)``: chunk ``c`` of rank ``r`` is
virtual stage ``c * p + r``, and its activations go to rank ``r + 1`` around the ring (rank ``p - 1``'s to rank 0).

Messages: every message a peer sends this rank is known from the peer's schedule, so each peer's messages form a
stream received in the order sent (receives from one peer match its sends in order, whatever their kind: at
``p = 2`` activations and gradients share one pair of ranks). Receives are posted ahead, each op's and the next
forward's and backward's before the op computes, so they land while it runs (on Gloo a receive posted late costs a
round trip: the payload waits for it). Every micro-batch's activation (a tensor, tuple or dict of tensors) of one
chunk has the spec announced by that chunk's spec message, sent before its first activation; the first activation's
receives are posted with the previous step's spec before that message arrives, and a sender whose spec changed
sends dummies of the old one first, so both ends always agree. A receive whose buffers depend on a spec message not
yet read is not posted ahead. Gradients travel back for the tensors the spec marks as needing one (not for a padding
mask or position ids). The loss (averaged over replicas on the last stage) travels back one stage at a time behind
the last gradient.

Where point-to-point runs in issue order (NCCL: one communicator and stream, a send completes only when its
receive runs), every rank issues its sends and receives in one global order of the step's messages
(:func:`exchange_plan`: by when a replay of all the ranks' orders has each message's producing op finish), each
send after the op that made it, each receive as early as that order allows, consecutive ones in one group. The
earliest message not yet done is then next on both its ends, so no schedule deadlocks: not the V's (ZB-V,
DualPipe-V), whose ranks send both ways, nor interleaved, where posting each receive just before its op does (at
p = 2 and at p = 4, m = 8 on the simulated NCCL: ranks end up each waiting for a send the other has not posted a
receive for yet).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...comm import ReductionOperation
from .backward import SplitBackward
from .p2p import META_LEN, ActivationSpec, StageLink, flatten_activation, unflatten_activation
from .schedule import holder, replay, virtual_stage

__all__ = ["StepExecutor", "exchange_plan", "loss_path", "peer_streams", "receive_plan"]


def _chunk(op: tuple) -> int:
    return op[2] if len(op) == 3 else 0


def loss_path(where: str, p: int, v: int, rank: int) -> tuple[int | None, int | None]:
    """The ranks ``rank`` receives the step's loss from and passes it on to (None: computes it / the end): it travels
    one rank at a time away from the rank holding the last virtual stage (rank ``p - 1``, or rank 0 in a V)."""
    source = holder(where, p, p * v - 1)[0]
    step = -1 if source == p - 1 else 1
    ahead = rank + step
    return None if rank == source else rank - step, ahead if 0 <= ahead < p else None


def peer_streams(orders: list[list[tuple]], rank: int, where: str = "loop") -> dict[int, list[tuple]]:
    """Per peer, the messages it sends ``rank`` in one step, in order: ``("meta", c)`` (the spec of chunk ``c``'s
    activations), ``("act", m, c)`` and ``("grad", m, c)`` (for this rank's op on micro-batch ``m``, chunk ``c``),
    ``("loss",)``. ``orders`` holds every rank's schedule, ``where`` the chunks' :func:`placement`; activations and
    gradients between two chunks of one rank (the turn of a V) are no message."""
    p = len(orders)
    v = 1 + max(_chunk(op) for order in orders for op in order)
    last = p * v - 1
    streams: dict[int, list[tuple]] = {}
    for q in range(p):
        items = []
        for op in orders[q]:
            kind, m, u = op[0], op[1], virtual_stage(where, p, q, _chunk(op))
            if kind == "F" and u < last and holder(where, p, u + 1)[0] == rank != q:
                c = holder(where, p, u + 1)[1]
                items += [("meta", c)] if m == 0 else []
                items.append(("act", m, c))
            elif kind == "B" and u > 0 and holder(where, p, u - 1)[0] == rank != q:
                items.append(("grad", m, holder(where, p, u - 1)[1]))
        if q == loss_path(where, p, v, rank)[0]:
            items.append(("loss",))
        if items:
            streams[q] = items
    return streams


def receive_plan(order: list[tuple], streams: dict[int, list[tuple]]):
    """Where p2p runs out of order (Gloo, MPI, in-memory), for each op ``k`` of a rank's ``order``: the message it
    receives (``own[k]``: ``(peer, index)`` in the peer's stream, or None) and, per peer, the last message of its
    stream (:func:`peer_streams`) to post before op ``k`` runs (``ahead[k]``): the next forward's and backward's
    message after op ``k`` (all that is left, the loss included, when none follows)."""
    where = {item: (q, i) for q, items in streams.items() for i, item in enumerate(items)}
    own = [where.get(("act" if op[0] == "F" else "grad", op[1], _chunk(op))) if op[0] != "W" else None for op in order]
    ahead: list[dict[int, int]] = [{} for _ in order]
    following: dict[str, tuple[int, int] | None] = {"F": None, "B": None}
    for k in range(len(order) - 1, -1, -1):
        spots = [following["F"], following["B"], own[k]]
        targets = {q: len(items) - 1 for q, items in streams.items()}
        if own[k] is not None:
            following[order[k][0]] = own[k]
        seen: set[int] = set()
        for q, i in (spot for spot in spots if spot is not None):
            targets[q] = i if q not in seen else max(targets[q], i)
            seen.add(q)
        ahead[k] = targets
    return own, ahead


def exchange_plan(orders: list[list[tuple]], rank: int, where: str = "loop") -> list[list[tuple]]:
    """For ordered p2p: what ``rank`` exchanges before each op of its order (entry ``k``; entry ``len(order)``: after
    the last op, before the loss), as events in one global order of the step's messages: ``("send", j)``, the
    message(s) its op ``j`` produced, and ``("recv", peer, index)``, message ``index`` of ``peer``'s stream
    (:func:`peer_streams`).

    The global order is the messages sorted by when :func:`replay` has their producing op finish (then by sender
    and op). A message's consumer starts at or after that time and its producer's later ops finish after it, so
    every rank can issue its sends after their ops and its receives before theirs, in that one order; each rank
    issues its events in it (receives as early as it allows). Then no NCCL group waits on one that waits on it: the
    earliest message not yet done is next on both its sender and its receiver. Consecutive events may share a
    group; splitting one (before an activation whose spec message was just received) keeps the order."""
    p = len(orders)
    v = 1 + max(_chunk(op) for order in orders for op in order)
    last = p * v - 1
    finish = replay(orders, where=where)
    streams = peer_streams(orders, rank, where)
    index = {(q, item): i for q, items in streams.items() for i, item in enumerate(items)}
    messages = []  # (time, sender, op index, events on this rank)
    for q in range(p):
        for j, op in enumerate(orders[q]):
            kind, m, u = op[0], op[1], virtual_stage(where, p, q, _chunk(op))
            if kind == "F" and u < last:
                to, c = holder(where, p, u + 1)
                items = [("meta", c), ("act", m, c)] if m == 0 else [("act", m, c)]
            elif kind == "B" and u > 0:
                to, c = holder(where, p, u - 1)
                items = [("grad", m, c)]
            else:
                continue
            if to == q or rank not in (q, to):
                continue
            events = [("send", j)] if q == rank else [("recv", q, index[(q, item)]) for item in items]
            messages.append((finish[q][j], q, j, events))
    order = orders[rank]
    plan: list[list[tuple]] = [[] for _ in range(len(order) + 1)]
    consumer = {("act" if op[0] == "F" else "grad", op[1], _chunk(op)): k for k, op in enumerate(order) if op[0] != "W"}
    issued = 0  # ops of this rank before the next event
    for _, q, j, events in sorted(messages, key=lambda msg: msg[:3]):
        if q == rank:
            issued = max(issued, j + 1)
        for event in events:
            item = streams[event[1]][event[2]] if event[0] == "recv" else None
            if item is not None and item[0] != "meta" and consumer[item] < issued:
                raise RuntimeError(f"exchange_plan: rank {rank} would receive {item} after the op that needs it")
        plan[issued] += events
    return plan


class StepExecutor:
    """Runs one step of stage ``link.stage``: ``order`` (from :func:`stage_schedule`; ``orders`` holds every
    stage's) over ``micro_batches`` micro-batches of ``chunks`` (one module, or ``v`` placed by ``where``,
    :func:`placement`); virtual stage 0 reads ``inputs``, the last computes ``loss_fn`` against ``targets`` (lists
    of micro-batches, None elsewhere). A backward whose ``("W", ...)``
    op is in the order runs as :class:`SplitBackward`'s input pass, the ``W`` as its weight pass; one without is a
    whole backward. :meth:`run` returns the step's loss, averaged over micro-batches and, through ``data_group``,
    over replicas, on every stage."""

    def __init__(
        self,
        chunks: list[nn.Module],
        link: StageLink,
        orders: list[list[tuple]],
        micro_batches: int,
        *,
        inputs: list[Any] | None,
        targets: list[Any] | None,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        data_group=None,
        stage_output: Callable[[Any], Any] = lambda y: y,
        where: str = "loop",
    ):
        self.chunks, self.link, self.order = chunks, link, orders[link.stage]
        self.orders, self.where = orders, where
        p = len(orders)
        self.loss_from, self.loss_to = loss_path(where, p, len(chunks), link.stage)
        self.last_virtual = p * len(chunks) - 1
        self.split = {op[1:] for op in self.order if op[0] == "W"}  # (micro-batch[, chunk]) of split backwards
        self.local: dict[tuple, Any] = {}  # activations and gradients between two chunks of this rank
        self.inputs, self.targets, self.loss_fn = inputs, targets, loss_fn
        self.data_group, self.stage_output = data_group, stage_output
        self.micro_batches = micro_batches
        self.ordered = link.group.ordered_p2p
        self.outbox: list | None = [] if self.ordered else None
        self.pending: list = []  # (Work, tensors it holds) of every op posted this step
        self.streams = peer_streams(orders, link.stage, where)
        self.posted = dict.fromkeys(self.streams, 0)  # per peer: messages of its stream posted
        self.guessed: dict[int, int] = {}  # peer -> chunk whose first activation was posted with last step's spec
        self.received: dict[tuple, tuple[list[torch.Tensor], Any]] = {}  # posted receives, by stream item
        self.spec: dict[int, ActivationSpec] = {}  # per chunk, of the activations received this step
        self.out: dict[int, ActivationSpec] = {}  # and of those sent
        # per (micro-batch, chunk): the received tensors that need a gradient and the outputs that carry one, or
        # after a split backward's input pass its SplitBackward (alive until its W)
        self.in_flight: dict[tuple[int, int], Any] = {}
        # On the device, written by a device copy per micro-batch: the host reads the loss once, after the step.
        self.losses = torch.zeros(self.micro_batches, dtype=torch.float64, device=link.device)
        self.max_in_flight = 0
        self.busy = 0.0
        self.produced: dict[int, list] = {}  # ordered p2p: op k's sends, until exchange_plan says they go out

    def run(self) -> torch.Tensor:
        """The step; returns the loss as a 1-element float64 tensor. ``report()`` describes it afterwards."""
        link, started = self.link, time.perf_counter()
        if self.ordered:
            plan = exchange_plan(self.orders, link.stage, self.where)
        else:
            own, ahead = receive_plan(self.order, self.streams)
        with link.group.unchecked():  # every message's shape is agreed by the step's shape messages
            for k, op in enumerate(self.order):
                if self.ordered:
                    self._exchange(plan[k])
                else:
                    self._post(ahead[k], needed=False)
                    if own[k] is not None:
                        self._post(dict([own[k]]), needed=True)
                if op[0] == "F":
                    self._forward(op[1], _chunk(op))
                elif op[0] == "B":
                    self._backward(op[1], _chunk(op), split=op[1:] in self.split)
                else:
                    self._weight(op[1], _chunk(op))
                if self.ordered:  # its sends wait for their turn in the plan
                    self.produced[k] = self.outbox[:]
                    self.outbox.clear()
            if self.ordered:
                self._exchange(plan[-1])
            loss = self._loss()
            for work, _ in self.pending:
                work.wait()
        self.step_seconds = time.perf_counter() - started
        return loss

    def report(self) -> dict[str, Any]:
        """What the last :meth:`run` did: its op order, the most micro-batches in flight, seconds computing, in all."""
        return {
            "order": self.order,
            "max_in_flight": self.max_in_flight,
            "busy_s": self.busy,
            "step_s": self.step_seconds,
        }

    # -- receives -------------------------------------------------------------------------------------------------

    def _post(self, targets: dict[int, int], needed: bool) -> None:
        """Post the receives of each peer's messages up to its ``targets[peer]``-th, in one group where p2p is
        ordered. Ahead of need (``needed`` False) it stops at an activation whose spec message is not read yet;
        when needed it reads that message (the peer sent it before the message this op waits for, so it has
        arrived or will), posting what it has first."""
        batch: list[tuple[tuple, list, int]] = []  # (stream item, buffers, offset)
        for peer, upto in targets.items():
            stream, offset = self.streams[peer], peer - self.link.stage
            while self.posted[peer] <= upto:
                item = stream[self.posted[peer]]
                if peer in self.guessed or (item[0] == "act" and item[2] not in self.spec):
                    if not needed:
                        break
                    self._post_batch(batch)
                    self._learn_spec(self.guessed.get(peer, item[-1]), peer)
                    continue
                if item[0] == "grad" and item[2] not in self.out:  # its forward has not run here yet
                    if not needed:
                        break
                    raise RuntimeError(f"PipelineParallelModel: gradient {item} expected before its forward ran")
                self.posted[peer] += 1
                if item[0] == "meta":
                    batch.append((item, [(torch.Size([META_LEN]), torch.int64)], offset))
                    guess = self.link.received_spec.get(item[1])
                    if guess is not None and not self.ordered:  # speculatively, with the last step's spec
                        batch.append((("act", 0, item[1]), guess.buffers, offset))
                        self.guessed[peer] = item[1]
                        self.posted[peer] += 1
                elif item[0] == "act":
                    batch.append((item, self.spec[item[2]].buffers, offset))
                elif item[0] == "grad":
                    batch.append((item, self.out[item[2]].gradients, offset))
                else:
                    batch.append((item, [(torch.Size([1]), torch.float64)], offset))
        self._post_batch(batch)

    def _post_batch(self, batch: list[tuple[tuple, list, int]], sends: list | None = None) -> None:
        """Post ``batch``'s receives in one group with ``sends`` (default: the outbox; ordered p2p)."""
        if batch:
            wanted = [(buffers, offset) for _, buffers, offset in batch]
            posted = self.link.post_recv_group(wanted, self.pending, self.outbox if sends is None else sends)
            self.received.update(zip((item for item, _, _ in batch), posted, strict=True))
            batch.clear()

    def _exchange(self, events: list[tuple]) -> None:
        """Issue ``events`` (an entry of :func:`exchange_plan`) in order, consecutive ones in one group; a group
        ends before an activation whose spec message it holds (read before that activation's buffers exist)."""
        sends: list = []
        batch: list[tuple[tuple, list, int]] = []
        for event in events:
            if event[0] == "send":
                sends += self.produced.pop(event[1])
                continue
            _, peer, i = event
            item, offset = self.streams[peer][i], peer - self.link.stage
            self.posted[peer] = i + 1
            if item[0] == "meta":
                batch.append((item, [(torch.Size([META_LEN]), torch.int64)], offset))
                continue
            if item[0] == "act" and item[2] not in self.spec:
                self._post_batch(batch, sends)
                self._learn_spec(item[2], peer)
            buffers = self.spec[item[2]].buffers if item[0] == "act" else self.out[item[2]].gradients
            batch.append((item, buffers, offset))
        self._post_batch(batch, sends)
        self.link.flush(self.pending, sends)

    @property
    def _box(self) -> tuple[list, list | None]:
        return self.pending, self.outbox

    def _learn_spec(self, c: int, peer: int) -> None:
        """Read chunk ``c``'s spec message; if the first activation was posted with a different guess, take the
        dummies the sender sends for it and post it again (nothing from ``peer`` was posted after the guess)."""
        link = self.link
        meta, work = self.received.pop(("meta", c))
        work.wait()
        self.spec[c] = link.decode_spec(meta[0])
        if self.guessed.pop(peer, None) is not None and self.spec[c] != link.received_spec[c]:
            self.received.pop(("act", 0, c))[1].wait()
            self.received[("act", 0, c)] = link.post_recvs(self.spec[c].buffers, peer - link.stage)
        link.received_spec[c] = self.spec[c]

    # -- ops ------------------------------------------------------------------------------------------------------

    def _virtual(self, c: int) -> int:
        return virtual_stage(self.where, len(self.orders), self.link.stage, c)

    def _neighbour(self, u: int) -> tuple[int, int]:
        """``(offset from this rank, chunk there)`` of virtual stage ``u``; offset 0: a chunk of this rank."""
        rank, chunk = holder(self.where, len(self.orders), u)
        return rank - self.link.stage, chunk

    def _forward(self, i: int, c: int) -> None:
        needs_grad: list[torch.Tensor] = []
        virtual = self._virtual(c)
        if virtual == 0:
            x = self.inputs[i]
        else:
            offset, _ = self._neighbour(virtual - 1)
            if offset == 0:  # the turn of a V: the previous chunk's output, cut from its graph
                spec, received = self.local.pop(("act", i, c))
            else:
                if c not in self.spec:  # its first activation was posted ahead with the right guess
                    self._learn_spec(c, self.link.stage + offset)
                received, work = self.received.pop(("act", i, c))
                work.wait()
                spec = self.spec[c]
            for t, (_, _, grad) in zip(received, spec.leaves, strict=True):
                if grad:  # as on the sending stage
                    needs_grad.append(t.requires_grad_())
            x = unflatten_activation(spec, received)
        t0 = time.perf_counter()
        y = self.stage_output(self.chunks[c](x))
        if virtual == self.last_virtual:
            y = self.loss_fn(y, self.targets[i])
            if not isinstance(y, torch.Tensor) or y.numel() != 1:
                raise ValueError(
                    f"loss_fn must return a scalar tensor, got {type(y).__name__} {tuple(getattr(y, 'shape', ()))}"
                )
            self.losses[i] = y.detach().reshape(())
        self.busy += time.perf_counter() - t0
        if virtual != self.last_virtual:
            offset, chunk = self._neighbour(virtual + 1)
            spec = self.link.check_sendable(y)
            _, tensors = flatten_activation(y)
            if offset == 0:
                self.local[("act", i, chunk)] = (spec, [t.detach() for t in tensors])
            else:
                if i == 0:
                    self._announce(spec, c, offset)
                elif spec != self.out[c]:
                    raise ValueError(
                        f"PipelineParallelModel: stage {self.link.stage}'s output for micro-batch {i} is {spec}, but "
                        f"micro-batch 0's was {self.out[c]}; every micro-batch's activation must have the same shapes"
                    )
                for t in tensors:
                    self.link.send(t.detach(), offset, self.pending, self.outbox)
            y = [t for t in tensors if t.requires_grad]
        self.in_flight[(i, c)] = (needs_grad, y)
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))

    def _announce(self, spec: ActivationSpec, c: int, offset: int) -> None:
        """Send chunk ``c``'s spec message to the rank ``offset`` away; if the spec changed since the last step,
        first dummies of the old spec for the receives that rank posted speculatively."""
        link = self.link
        self.out[c] = spec
        link.send(link.encode_spec(spec), offset, self.pending, self.outbox)
        old = link.sent_spec.get(c)
        if old not in (None, spec) and not self.ordered:  # the receiver's guess
            for shape, dtype in old.buffers:
                link.send(torch.zeros(shape, dtype=dtype, device=link.device), offset, self.pending)
        link.sent_spec[c] = spec

    def _backward(self, i: int, c: int, split: bool) -> None:
        """Micro-batch ``i``'s backward through chunk ``c``: whole, or (``split``) its input pass, the weight pass
        left to its ``W``; then the input's gradient to the previous virtual stage."""
        x, y = self.in_flight.pop((i, c))
        virtual = self._virtual(c)
        last = virtual == self.last_virtual
        if not last:
            offset, _ = self._neighbour(virtual + 1)
            if offset == 0:
                grads = self.local.pop(("grad", i, c))
            else:
                grads, work = self.received.pop(("grad", i, c))
                work.wait()
        t0 = time.perf_counter()
        outputs, output_grads = ([y / self.micro_batches], None) if last else (y, grads)
        if split:
            part = SplitBackward(outputs, output_grads, x, list(self.chunks[c].parameters()))
            input_grads = part.input_pass()
            self.in_flight[(i, c)] = part
        else:
            if outputs:
                torch.autograd.backward(outputs, output_grads)
            input_grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in x]
        self.busy += time.perf_counter() - t0
        if virtual > 0:
            offset, chunk = self._neighbour(virtual - 1)
            if offset == 0:
                self.local[("grad", i, chunk)] = input_grads
            else:
                for g in input_grads:
                    self.link.send(g, offset, self.pending, self.outbox)

    def _weight(self, i: int, c: int) -> None:
        """Micro-batch ``i``'s weight pass through chunk ``c`` (its split backward's second half)."""
        t0 = time.perf_counter()
        self.in_flight.pop((i, c)).weight_pass()
        self.busy += time.perf_counter() - t0

    def _loss(self) -> torch.Tensor:
        """The step's loss: computed on the rank holding the last virtual stage (averaged over replicas), passed on
        one rank at a time (:func:`loss_path`)."""
        link = self.link
        if self.loss_from is None:
            loss = self.losses.mean().reshape(1)
            if self.data_group is not None:  # the replicas' batches are equal slices: their mean is the global's
                self.data_group.agreed.all_reduce(loss, ReductionOperation.AVERAGE)
        else:
            self._post({self.loss_from: len(self.streams[self.loss_from]) - 1}, needed=True)
            loss, work = self.received.pop(("loss",))
            loss = loss[0]
            work.wait()
        if self.loss_to is not None:
            link.send(loss, self.loss_to - link.stage, self.pending, self.outbox)
            link.flush(self.pending, self.outbox)
        return loss
