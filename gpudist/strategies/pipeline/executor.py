"""The executor: one stage's part of one pipelined training step, op by op in its schedule's order.

Messages: receives are posted ahead, each op's and the next forward's and backward's before the op computes, so they
land while it runs (on Gloo a receive posted late costs a round trip: the payload waits for it). Every micro-batch's
activation (a tensor, tuple or dict of tensors) has the spec announced by the step's spec message; the first
activation's receives are posted with the previous step's spec before that message arrives, and a sender whose spec
changed sends dummies of the old one first, so both ends always agree. Gradients travel back for the tensors the
spec marks as needing one (not for a padding mask or position ids). The loss (averaged over replicas on the last
stage) travels back one stage at a time behind the last gradient.

Where point-to-point runs in issue order (NCCL on the compute stream), a receive is posted only when its op runs,
together with the sends made since (a crossing send and receive in one group cannot deadlock); sends go out at once
when the next op posts no receive.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...comm import ReductionOperation
from .p2p import META_LEN, ActivationSpec, StageLink, flatten_activation, unflatten_activation

__all__ = ["StepExecutor", "receive_plan"]


def receive_plan(order: list[tuple[str, int]], first: bool, last: bool, ordered: bool):
    """For each op ``k`` of a stage's ``order``: the largest micro-batch whose activation (``ahead_f[k]``) and
    gradient (``ahead_b[k]``) must be posted before op ``k`` runs, which is the next forward / backward after it
    (unless p2p is ``ordered``), else op ``k``'s own, -1 for none; and whether op ``k`` receives at all
    (``receives[k]``, with a final False)."""
    ahead_f, ahead_b, next_f, next_b = [-1] * len(order), [-1] * len(order), -1, -1
    for k in range(len(order) - 1, -1, -1):
        kind, i = order[k]
        ahead_f[k] = next_f if next_f >= 0 and not ordered else i if kind == "F" else -1
        ahead_b[k] = next_b if next_b >= 0 and not ordered else i if kind == "B" else -1
        next_f, next_b = (i, next_b) if kind == "F" else (next_f, i)
    receives = [(kind == "F" and not first) or (kind == "B" and not last) for kind, _ in order] + [False]
    return ahead_f, ahead_b, receives


class StepExecutor:
    """Runs one step of stage ``link.stage``: ``order`` (from :func:`stage_schedule`) over ``micro_batches``
    micro-batches of ``module``; the first stage reads ``inputs``, the last computes ``loss_fn`` against ``targets``
    (lists of micro-batches, None elsewhere). :meth:`run` returns the step's loss, averaged over micro-batches and,
    through ``data_group``, over replicas, on every stage."""

    def __init__(
        self,
        module: nn.Module,
        link: StageLink,
        order: list[tuple[str, int]],
        micro_batches: int,
        *,
        first: bool,
        last: bool,
        inputs: list[Any] | None,
        targets: list[Any] | None,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        data_group=None,
        stage_output: Callable[[Any], Any] = lambda y: y,
    ):
        self.module, self.link, self.order = module, link, order
        self.first, self.last = first, last
        self.inputs, self.targets, self.loss_fn = inputs, targets, loss_fn
        self.data_group, self.stage_output = data_group, stage_output
        self.micro_batches = micro_batches
        self.ordered = link.group.ordered_p2p
        self.outbox: list | None = [] if self.ordered else None
        self.pending: list = []  # (Work, tensors it holds) of every op posted this step
        self.acts: dict[int, tuple[list[torch.Tensor], Any]] = {}  # posted receives: activations from stage s - 1
        self.grads: dict[int, tuple[list[torch.Tensor], Any]] = {}  # and gradients from stage s + 1
        self.posted_f = self.posted_b = 0
        self.spec: ActivationSpec | None = None  # of the activations received this step
        self.out: ActivationSpec | None = None  # and of those sent
        self.loss_recv = None
        # per micro-batch: the received tensors that need a gradient, and the outputs that carry one (or the loss)
        self.in_flight: dict[int, tuple[list[torch.Tensor], Any]] = {}
        # On the device, written by a device copy per micro-batch: the host reads the loss once, after the step.
        self.losses = torch.zeros(self.micro_batches, dtype=torch.float64, device=link.device)
        self.max_in_flight = 0
        self.busy = 0.0

    def run(self) -> torch.Tensor:
        """The step; returns the loss as a 1-element float64 tensor. ``report()`` describes it afterwards."""
        link, started = self.link, time.perf_counter()
        ahead_f, ahead_b, receives = receive_plan(self.order, self.first, self.last, self.ordered)
        with link.group.unchecked():  # every message's shape is agreed by the step's shape message
            meta = None
            if not self.first:
                meta = link.post_recv(torch.Size([META_LEN]), torch.int64, -1, self.pending, self.outbox)
                if link.received_spec is not None and not self.ordered:  # speculatively, with the last step's spec
                    self.acts[0], self.posted_f = link.post_recvs(link.received_spec.buffers, -1), 1
            for k, (kind, i) in enumerate(self.order):
                if not self.first:
                    if self.spec is None:  # the first op, F0: learn the step's spec
                        self._learn_spec(meta)
                    self._post_activations(ahead_f[k])
                if self.out is not None:
                    self._post_gradients(ahead_b[k])
                if kind == "F":
                    self._forward(i)
                else:
                    self._backward(i)
                if not receives[k + 1]:
                    link.flush(self.pending, self.outbox)
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

    def _learn_spec(self, meta) -> None:
        link = self.link
        meta[1].wait()
        self.spec = link.decode_spec(meta[0])
        if self.posted_f and self.spec != link.received_spec:  # the speculative receives get dummies
            self.acts.pop(0)[1].wait()
            self.posted_f = 0
        link.received_spec = self.spec

    def _post_activations(self, upto: int) -> None:
        while self.posted_f <= upto:
            received = self.link.post_recvs(self.spec.buffers, -1, self.pending, self.outbox)
            self.acts[self.posted_f], self.posted_f = received, self.posted_f + 1

    def _post_gradients(self, upto: int) -> None:
        while self.posted_b <= upto:
            received = self.link.post_recvs(self.out.gradients, +1, self.pending, self.outbox)
            self.grads[self.posted_b], self.posted_b = received, self.posted_b + 1
        if self.posted_b == self.micro_batches and self.loss_recv is None and not self.ordered:
            self.loss_recv = self.link.post_recv(torch.Size([1]), torch.float64, +1)

    # -- ops ------------------------------------------------------------------------------------------------------

    def _forward(self, i: int) -> None:
        needs_grad: list[torch.Tensor] = []
        if self.first:
            x = self.inputs[i]
        else:
            received, work = self.acts.pop(i)
            work.wait()
            for t, (_, _, grad) in zip(received, self.spec.leaves, strict=True):
                if grad:  # as on the sending stage
                    needs_grad.append(t.requires_grad_())
            x = unflatten_activation(self.spec, received)
        t0 = time.perf_counter()
        y = self.stage_output(self.module(x))
        if self.last:
            y = self.loss_fn(y, self.targets[i])
            if not isinstance(y, torch.Tensor) or y.numel() != 1:
                raise ValueError(
                    f"loss_fn must return a scalar tensor, got {type(y).__name__} {tuple(getattr(y, 'shape', ()))}"
                )
            self.losses[i] = y.detach().reshape(())
        self.busy += time.perf_counter() - t0
        if not self.last:
            spec = self.link.check_sendable(y)
            if i == 0:
                self._announce(spec)
            elif spec != self.out:
                raise ValueError(
                    f"PipelineParallelModel: stage {self.link.stage}'s output for micro-batch {i} is {spec}, but "
                    f"micro-batch 0's was {self.out}; every micro-batch's activation must have the same shapes"
                )
            _, tensors = flatten_activation(y)
            for t in tensors:
                self.link.send(t.detach(), +1, self.pending, self.outbox)
            y = [t for t in tensors if t.requires_grad]
        self.in_flight[i] = (needs_grad, y)
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))

    def _announce(self, spec: ActivationSpec) -> None:
        """Send the step's spec message; if the spec changed since the last step, first dummies of the old spec for
        the receives the next stage posted speculatively."""
        link = self.link
        self.out = spec
        link.send(link.encode_spec(spec), +1, self.pending, self.outbox)
        if link.sent_spec not in (None, self.out) and not self.ordered:  # the receiver's guess
            for shape, dtype in link.sent_spec.buffers:
                link.send(torch.zeros(shape, dtype=dtype, device=link.device), +1, self.pending)
        link.sent_spec = self.out

    def _backward(self, i: int) -> None:
        x, y = self.in_flight.pop(i)
        if not self.last:
            grads, work = self.grads.pop(i)
            work.wait()
        t0 = time.perf_counter()
        if self.last:
            (y / self.micro_batches).backward()
        elif y:
            torch.autograd.backward(y, grads)
        self.busy += time.perf_counter() - t0
        for t in x:
            self.link.send(t.grad if t.grad is not None else torch.zeros_like(t), -1, self.pending, self.outbox)

    def _loss(self) -> torch.Tensor:
        """The step's loss: computed on the last stage (averaged over replicas), passed back stage by stage."""
        link = self.link
        if self.last:
            loss = self.losses.mean().reshape(1)
            if self.data_group is not None:  # the replicas' batches are equal slices: their mean is the global's
                with self.data_group.unchecked():  # one float64 on every replica, by construction
                    self.data_group.all_reduce(loss, ReductionOperation.AVERAGE)
        else:
            loss, work = self.loss_recv or link.post_recv(torch.Size([1]), torch.float64, +1, self.pending, self.outbox)
            work.wait()
        if not self.first:
            link.send(loss, -1, self.pending, self.outbox)
            link.flush(self.pending, self.outbox)
        return loss
