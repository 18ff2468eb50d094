"""Whole-step graphs: one training step (forward, backward, every collective of the strategy and the optimizer step)
captured once and replayed, so that a host-bound step costs the host one replay call.

    step = gpudist.capture(model, optimizer, loss_fn, (x, y))   # warm-up steps, then capture
    for x, y in loader:
        loss = step(x, y)                                         # copy into the static inputs, replay

``loss_fn(model, *batch)`` returns the loss; the step zeroes the gradients (``set_to_none=False``: they stay where
the graph wrote them), runs it, backward and ``optimizer.step()``. The loss comes back as a device tensor, the same
tensor every replay (read it, or ``.clone()`` it to keep it). A batch whose shapes or dtypes differ from the captured
ones runs eagerly, with a warning the first time.

What capture takes, and what it refuses before capturing anything:

- Strategies: a plain module, :class:`~gpudist.DDPModel`, ZeRO-1/2 and ZeRO-3/FSDP wrappers, whose per-step work
  is planned at wrap time (buckets, launch plans, persistent gradient views, no host reads). Gradient compression,
  pipelines and tensor parallelism are refused (their steps make host decisions or exchange shapes per step).
- Optimizers: the step must keep its counters on the device. torch's Adam/AdamW need ``capturable=True`` (their
  ``step`` then lives on the device), and so do gpudist's ZeRO optimizers wrapping them (their counts and bias
  corrections then live on the device, and a step the device skips is not counted); their SGD's counts move to the
  device at capture.
- Hyper-parameters given as numbers (lr, betas, weight decay) are constants of the graph: a replay after one of
  them changed (a scheduler stepping a float lr) is refused, naming it. A learning rate that should move between
  replays is a tensor (``torch.optim.AdamW(params, lr=torch.tensor(1e-3), capturable=True)``): schedulers fill it in
  place and every replay reads it.
- The group's watchdog looks at nothing while capture is under way (an event query from any thread would invalidate
  it), and each replay is timed as one op named "captured step": a replay that hangs fails at the group's timeout
  with an error naming it, the group and the rank.
- Every rank must capture the same collectives in the same order: after capture the ranks compare the sequence each
  one recorded (op and bytes of each) and refuse a mismatch with an error naming the first collective that differs,
  before the first replay (a mismatched graph would hang NCCL or mix up buffers).

The warm-up steps (``warmup``, default 3) are real training steps on ``example_batch``: they build what a step
allocates once (buckets, optimizer state, launch plans) and let ``static_graph`` learn the order of gradients, as
torch's whole-network capture recipe does. On CUDA the graph is a ``torch.cuda.CUDAGraph``; on the CPU tier a
simulated graph (tests/graphsim.py) is passed as ``graph``. When capture pays (a host-bound step) and when it does
not: docs/capture.md.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch
from torch import nn

from .comm import CollectiveMismatchError
from .flat import exchange_bytes
from .strategies.model import ShardedModel
from .strategies.optimizer import ShardedOptimizer, torch_capture_refusal

__all__ = ["CapturedStep", "Graph", "capture"]


class Graph(Protocol):
    """What :func:`capture` needs of a graph: record inside :meth:`capture`, run the record on :meth:`replay`."""

    def capture(self) -> contextlib.AbstractContextManager[None]: ...

    def replay(self) -> None: ...


class CudaGraph:
    """A ``torch.cuda.CUDAGraph`` captured on a side stream (as torch's ``torch.cuda.graph`` does), with its own
    memory pool."""

    def __init__(self):
        self.graph = torch.cuda.CUDAGraph()

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph):
            yield

    def replay(self) -> None:
        self.graph.replay()


def _check_capturable(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse what a graph cannot replay, before anything is captured: each strategy and optimizer says why it
    cannot be (``capture_refusal``); a torch optimizer is asked :func:`torch_capture_refusal`."""
    for obj in (model, optimizer):
        if isinstance(obj, ShardedModel | ShardedOptimizer):
            refusal = obj.capture_refusal()
        else:
            refusal = torch_capture_refusal(obj) if isinstance(obj, torch.optim.Optimizer) else None
        if refusal is not None:
            raise ValueError(f"gpudist.capture: {type(obj).__name__} cannot be captured: {refusal}")


def _numbers(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The hyper-parameters a graph holds as constants: every value of every parameter group but the parameters and
    tensors (which replays read)."""
    return [
        {k: v for k, v in g.items() if k != "params" and not isinstance(v, torch.Tensor)}
        for g in optimizer.param_groups
    ]


def _said(sequence: list, at: int) -> str:
    return f"{sequence[at][0]} of {sequence[at][1]} bytes" if at < len(sequence) else "nothing"


class CapturedStep:
    """A training step captured as one graph (:func:`capture` builds it).

    Attributes:
        replays: Steps run by replaying the graph.
        eager_steps: Steps run eagerly because the batch did not match the captured shapes.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[..., torch.Tensor],
        example_batch: Sequence[torch.Tensor] | torch.Tensor,
        *,
        warmup: int = 3,
        graph: Callable[[], Graph] | None = None,
    ):
        batch = (example_batch,) if isinstance(example_batch, torch.Tensor) else tuple(example_batch)
        if not batch or not all(isinstance(t, torch.Tensor) for t in batch):
            raise TypeError(
                "gpudist.capture: example_batch must be a tensor or a sequence of tensors (the step's inputs), got "
                f"{type(example_batch).__name__}"
            )
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 2:
            raise ValueError(
                f"gpudist.capture: warmup={warmup!r} must be an int >= 2 (what a step allocates once, and the "
                "order of gradients, are learned before capture)"
            )
        _check_capturable(model, optimizer)
        device = batch[0].device
        if graph is None:
            if device.type != "cuda":
                raise ValueError(
                    f"gpudist.capture: the batch is on {device}; CUDA graphs need CUDA tensors (the CPU tier passes "
                    "a simulated graph as graph=)"
                )
            graph = CudaGraph
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.comm = model.comm if isinstance(model, ShardedModel) else None
        self._static = [t.detach().clone() for t in batch]
        self._signature = [(t.shape, t.dtype, t.device) for t in self._static]
        self.replays = 0
        self.eager_steps = 0
        self._warned = False
        with self._warm_up_stream():
            for _ in range(warmup):
                self._eager(self._static)
        self.graph = graph()
        watching = self.comm.graph_capture() if self.comm is not None else contextlib.nullcontext()
        settled = optimizer.graph_capture() if isinstance(optimizer, ShardedOptimizer) else contextlib.nullcontext()
        recording = self.comm.stats.recording() if self.comm is not None else contextlib.nullcontext([])
        with settled, recording as sequence, watching, self.graph.capture():
            self.loss = self._eager(self._static)
        self._check_same_capture(sequence)
        self._constants = _numbers(optimizer)

    @contextlib.contextmanager
    def _warm_up_stream(self) -> Iterator[None]:
        """CUDA: warm up on a side stream (the capture's allocations then come from the graph's pool alone)."""
        if self._static[0].device.type != "cuda":
            yield
            return
        side = torch.cuda.Stream(self._static[0].device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            yield
        torch.cuda.current_stream().wait_stream(side)

    def _eager(self, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=False)
        loss = self.loss_fn(self.model, *batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"gpudist.capture: loss_fn must return a one-element tensor, got {type(loss).__name__}")
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def _check_same_capture(self, sequence: list[tuple[str, int]]) -> None:
        """Every rank captured the same collectives, in the same order (op and bytes of each); else refuse before
        any replay, naming the first collective where a rank differs from rank 0."""
        if self.comm is None or self.comm.world_size == 1:
            return
        everyone = [json.loads(p) for p in exchange_bytes(self.comm.agreed, json.dumps(sequence).encode())]
        differ = [r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
        if differ:
            first, theirs = everyone[0], everyone[differ[0]]
            at = next(
                (i for i, (a, b) in enumerate(zip(first, theirs, strict=False)) if a != b), min(len(first), len(theirs))
            )
            raise CollectiveMismatchError(
                f"gpudist.capture: ranks captured different collectives: collective #{at} is {_said(first, at)} on "
                f"rank 0 and {_said(theirs, at)} on rank {differ[0]} (rank 0 captured {len(first)}, rank {differ[0]} "
                f"{len(theirs)}; group {self.comm.group!r}, this rank {self.comm.rank}); every rank must run the "
                "same step (same model, strategy and loss_fn) to be replayed"
            )

    def __call__(self, *batch: torch.Tensor) -> torch.Tensor:
        """One training step on ``batch`` (the inputs ``loss_fn`` takes after the model).

        Returns:
            The loss, a device tensor (the captured one: the next call overwrites it).
        """
        if [(t.shape, t.dtype, t.device) for t in batch] != self._signature:
            if not self._warned:
                warnings.warn(
                    "gpudist.capture: a batch of other shapes or dtypes than the captured one runs eagerly "
                    f"(captured: {[(tuple(s), d) for s, d, _ in self._signature]})",
                    stacklevel=2,
                )
                self._warned = True
            self.eager_steps += 1
            return self._eager(batch)
        if _numbers(self.optimizer) != self._constants:
            self._refuse_changed_constants()
        with torch.no_grad():
            for static, t in zip(self._static, batch, strict=True):
                static.copy_(t)
        self.graph.replay()
        if self.comm is not None:
            self.comm.watch_graph("captured step")  # a replay that hangs times out, named, like any op
        self.replays += 1
        return self.loss

    def _refuse_changed_constants(self) -> None:
        for g, (now, then) in enumerate(zip(_numbers(self.optimizer), self._constants, strict=True)):
            for key in sorted(set(now) | set(then), key=str):
                if now.get(key) != then.get(key):
                    raise RuntimeError(
                        f"gpudist.capture: parameter group {g}'s {key} changed from {then.get(key)!r} to "
                        f"{now.get(key)!r} after capture, and the graph holds the captured value; give it as a tensor "
                        "that is filled in place (torch.optim.AdamW(params, lr=torch.tensor(1e-3), capturable=True): "
                        "schedulers fill it, every replay reads it), or capture again"
                    )
        raise RuntimeError("gpudist.capture: the optimizer's parameter groups changed after capture; capture again")


def capture(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[..., torch.Tensor],
    example_batch: Sequence[torch.Tensor] | torch.Tensor,
    *,
    warmup: int = 3,
    graph: Callable[[], Graph] | None = None,
) -> CapturedStep:
    """Capture one training step of ``model`` and ``optimizer`` and return it as a callable (module docstring).

    Args:
        model: A plain module or a gpudist data-parallel wrapper (DDP, ZeRO-1/2, ZeRO-3/FSDP).
        optimizer: Its optimizer (the paired gpudist optimizer, or a torch one for a plain module).
        loss_fn: ``loss_fn(model, *batch) -> loss`` (a one-element tensor).
        example_batch: The inputs of one step, shaped as every captured step's (a tensor or a sequence).
        warmup: Eager training steps on ``example_batch`` before capture (at least 2).
        graph: Makes the graph (default: a ``torch.cuda.CUDAGraph``; the CPU tier passes a simulated one).

    Returns:
        The captured step: ``step(*batch)`` returns the loss.

    Raises:
        ValueError: For a strategy or optimizer a graph cannot replay (named, with the way out), a batch off CUDA
            without ``graph``, or ``warmup`` < 2.
        RuntimeError: From a call of the step, when a hyper-parameter given as a number changed after capture.
        TypeError: When ``example_batch`` is not tensors or ``loss_fn`` does not return a one-element tensor.
        CollectiveMismatchError: When the ranks captured different collectives.
    """
    return CapturedStep(model, optimizer, loss_fn, example_batch, warmup=warmup, graph=graph)
