"""A simulated CUDA graph for the CPU tier: capture records a step's device work without running it, replay runs the
record in issue order. It is the ``graph=`` seam of :func:`gpudist.capture` on the CPU, where there is no CUDA.

What it models, as strictly as CUDA's stream capture:

- **Nothing executes inside capture.** Every aten op is recorded: a view is made for real (it moves no data); an op
  that writes its arguments (in place, ``out=``) is recorded and returns them unwritten; any other op gets outputs
  allocated with the shapes, strides and dtypes its meta kernel gives, filled with garbage (NaN, or a large integer),
  as a graph's memory pool holds whatever was there. Code that used a value computed during capture therefore sees
  garbage here, as on a GPU. Simulated NCCL calls (tests/fakenccl.py) are recorded, not issued, and so are Triton
  launches in the interpreter (the GPU's kernels): replay launches them again with the arguments they were given,
  numbers included, as a graph's kernel node holds its parameters.
- **What a graph cannot hold raises** :class:`CaptureError`, naming the op: a host sync (``.item()``, ``bool()`` of a
  tensor, ``.tolist()``), a data-dependent shape (``nonzero``, ``masked_select``), a tensor made from host data
  (``torch.tensor([...])``: an upload from pageable memory, which CUDA refuses inside capture and which would
  otherwise be baked into the graph), and a pinned host allocation (``pin_memory=True``: ``cudaHostAlloc``, refused
  while a graph is captured). Work forked onto the communication stream must be joined back: an op whose event was
  recorded there inside capture and never waited on by the end of capture (its ``Work`` not waited) fails the
  capture, as CUDA ends it with ``cudaErrorStreamCaptureUnjoined``.
- **Replay** runs the recorded ops against the same tensors (the static inputs, the parameters, the graph's own
  intermediates), writing each op's result into the outputs recorded for it, then issues the recorded NCCL calls in
  their place in the order; every rank replays in its own thread, so the collectives meet as they would on a GPU.

Not modelled: random numbers (each replay draws new ones, unlike CUDA's philox offsets), timing, and streams
(one issue order stands for the capture's stream and the communication stream it joins, which CUDA orders by events).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from . import fakenccl

aten = torch.ops.aten

__all__ = ["CaptureError", "SimulatedGraph"]


class CaptureError(RuntimeError):
    """Something a CUDA graph cannot capture was done inside capture."""


_HOST_SYNCS = {
    aten._local_scalar_dense.default: "reads a device value on the host (.item(), bool(), float() of a tensor)",
    aten.nonzero.default: "has a data-dependent shape (nonzero)",
    aten.masked_select.default: "has a data-dependent shape (masked_select)",
    aten.lift_fresh.default: "makes a tensor from host data (torch.tensor(...)): an upload the graph cannot hold",
}

_PINNING = {aten._pin_memory.default}
"""Ops that allocate pinned host memory (besides any op given ``pin_memory=True``)."""

_local = threading.local()


def _tape() -> list | None:
    return getattr(_local, "tape", None)


def _garbage(meta: torch.Tensor) -> torch.Tensor:
    out = torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype, device="cpu")
    if out.dtype.is_floating_point or out.dtype.is_complex:
        out.fill_(float("nan"))
    elif out.dtype == torch.bool:
        out.fill_(True)
    else:
        out.fill_(12345)
    return out


def _to_meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


class _Recorder(TorchDispatchMode):
    def __init__(self, tape: list):
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_SYNCS:
            raise CaptureError(f"{func} inside capture: it {_HOST_SYNCS[func]}; a CUDA graph cannot capture it")
        if kwargs.get("pin_memory") or func in _PINNING:
            raise CaptureError(
                f"{func} inside capture: it allocates pinned host memory (cudaHostAlloc), which CUDA refuses while "
                "a graph is captured; allocate it before capture"
            )
        schema = func._schema
        if schema.returns and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            return func(*args, **kwargs)  # a view: metadata only, no data moves
        written = {}
        for a, value in zip(schema.arguments, _arguments(schema, args, kwargs), strict=True):
            if a.alias_info is not None and a.alias_info.is_write:
                written.update(dict.fromkeys(a.alias_info.before_set, value))
        returns = list(schema.returns)

        def aliased(r) -> torch.Tensor | None:
            sets = r.alias_info.before_set & written.keys() if r.alias_info is not None else ()
            return written[next(iter(sets))] if sets else None

        if schema.is_mutable and all(r.alias_info is not None for r in returns):  # in place / out=: nothing new
            self.tape.append(functools.partial(_run, func, args, kwargs, []))
            outs = [aliased(r) for r in returns]
            return None if not outs else outs[0] if len(outs) == 1 else tuple(outs)
        try:
            meta = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
        except Exception as e:
            raise CaptureError(f"{func} inside capture: its output shape is not known without running it ({e})") from e
        metas, spec = tree_flatten(meta)
        outs = []
        fresh = []  # (position in the flat outputs, placeholder)
        for i, m in enumerate(metas):
            r = returns[i] if len(returns) == len(metas) else None
            if r is not None and aliased(r) is not None:
                outs.append(aliased(r))
            elif isinstance(m, torch.Tensor):
                placeholder = _garbage(m)
                outs.append(placeholder)
                fresh.append((i, placeholder))
            else:
                outs.append(m)
        self.tape.append(functools.partial(_run, func, args, kwargs, fresh))
        return spec.unflatten(outs) if metas else meta


def _arguments(schema, args, kwargs) -> list:
    values = []
    for i, a in enumerate(schema.arguments):
        if i < len(args):
            values.append(args[i])
        else:
            values.append(kwargs.get(a.name, a.default_value if a.has_default_value() else None))
    return values


def _run(func, args, kwargs, fresh: list[tuple[int, torch.Tensor]]) -> None:
    result = func(*args, **kwargs)
    if not fresh:
        return
    flat, _ = tree_flatten(result)
    for i, placeholder in fresh:
        placeholder.copy_(flat[i])


_NCCL_CALLS = ("allReduce", "reduce", "broadcast", "bcast", "reduceScatter", "allGather", "send", "recv")


def _recording(name: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def call(self, *args, **kwargs):
        tape = _tape()
        if tape is None:
            return original(self, *args, **kwargs)
        tape.append(functools.partial(original, self, *args, **kwargs))
        return None

    call.__graphsim__ = True
    return call


def _install_nccl_recording() -> None:
    """Make the simulated NCCL's calls recordable, and its group brackets (``groupStart``/``groupEnd``: the calls
    between them are one launch, which replay must keep) (once per process; a call outside capture runs as before)."""
    for cls, names in ((fakenccl._Communicator, _NCCL_CALLS), (fakenccl.FakeNccl, ("groupStart", "groupEnd"))):
        for name in names:
            method = getattr(cls, name)
            if not getattr(method, "__graphsim__", False):
                setattr(cls, name, _recording(name, method))


def _install_join_check() -> None:
    """Track the communication stream's events inside capture (recorded after an op, waited on by the stream that
    joins it): what is still unwaited when capture ends was never joined back (once per process)."""
    for cls in (fakenccl.HostRuntime, fakenccl.AsyncRuntime):
        record, wait = cls.record, cls.wait
        if getattr(record, "__graphsim__", False):
            continue

        def recorded(self, record=record):
            event = record(self)
            forks = getattr(_local, "forks", None)
            if forks is not None:
                forks[id(event)] = event
            return event

        def waited(self, event, wait=wait):
            forks = getattr(_local, "forks", None)
            if forks is not None:
                forks.pop(id(event), None)
            return wait(self, event)

        recorded.__graphsim__ = True
        cls.record, cls.wait = recorded, waited


def _install_stream_recording() -> None:
    """The GPU-like runtime's stream ordering (tests/fakenccl.py's ``AsyncRuntime``), as a graph holds it: inside
    capture, the communication stream's join of the capture stream (``stream()``), the tensors held for an op
    (``hold``), its event (``record``) and the capture stream's wait for it (``wait``) run as before (their results are
    the capture's) and are recorded too; replay repeats them around the replayed NCCL calls, re-recording each event
    after its op (so a wait waits for the replayed op, as the graph's dependency does). A host sync inside capture
    (``synchronize()``) raises."""
    cls = fakenccl.AsyncRuntime
    if getattr(cls.stream, "__graphsim__", False):
        return
    originals = {name: getattr(cls, name) for name in ("stream", "hold", "record", "wait", "synchronize")}

    def stream(self):
        tape = _tape()
        if tape is not None:
            tape.append(functools.partial(_replayed, originals["stream"], self))
        return originals["stream"](self)

    def hold(self, tensors):
        tape = _tape()
        if tape is not None:
            tape.append(functools.partial(_replayed, originals["hold"], self, list(tensors)))
        return originals["hold"](self, tensors)

    def record(self):
        event = originals["record"](self)
        tape = _tape()
        if tape is not None:
            tape.append(functools.partial(_rerecord, self, event))
        return event

    def wait(self, event):
        tape = _tape()
        if tape is not None:
            tape.append(functools.partial(_replayed, originals["wait"], self, event))
        return originals["wait"](self, event)

    def synchronize(self):
        if _tape() is not None:
            raise CaptureError("synchronize() inside capture: a host sync; a CUDA graph cannot capture it")
        return originals["synchronize"](self)

    for name, method in (("stream", stream), ("hold", hold), ("record", record), ("wait", wait),
                         ("synchronize", synchronize)):  # fmt: skip
        method.__graphsim__ = True
        setattr(cls, name, method)


def _replayed(method: Callable, *args) -> None:
    method(*args)


def _rerecord(runtime, event) -> None:
    """Replay of ``record()``: the same event, now after the ops enqueued so far (as the graph's node orders it)."""
    runtime._batch = []
    event.free, event.upto = False, runtime._enqueued


def _launch(run: Callable, kernel, args: tuple, kwargs: dict) -> None:
    run(kernel, *args, **kwargs)


def _install_triton_recording() -> None:
    """Make Triton's interpreted launches recordable (once per process; a launch outside capture runs as before)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # no Triton: nothing launches one
        return
    run = InterpretedFunction.run
    if getattr(run, "__graphsim__", False):
        return

    @functools.wraps(run)
    def recorded(self, *args, grid, warmup, **kwargs):
        tape = _tape()
        if tape is None or warmup:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        tape.append(functools.partial(_launch, run, self, args, {"grid": grid, "warmup": False, **kwargs}))
        return None

    recorded.__graphsim__ = True
    InterpretedFunction.run = recorded


_install_triton_recording()
_install_join_check()
_install_stream_recording()
_install_nccl_recording()  # at import: the NCCL backend binds its calls when it plans them, before any capture


class SimulatedGraph:
    """One captured step: :meth:`capture` records, :meth:`replay` runs the record (see the module docstring)."""

    def __init__(self):
        self.tape: list[Callable[[], None]] = []
        self.replays = 0

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        if self.tape:
            raise RuntimeError("this graph was captured already; make a new one")
        if _tape() is not None:
            raise CaptureError("a capture is already under way in this thread")
        _local.tape, _local.forks = self.tape, {}
        try:
            with _Recorder(self.tape):
                yield
            if _local.forks:
                raise CaptureError(
                    f"{len(_local.forks)} op(s) on the communication stream were not joined back into the capture "
                    "stream (their Work was never waited inside it): CUDA ends such a capture with "
                    "cudaErrorStreamCaptureUnjoined"
                )
        finally:
            _local.tape, _local.forks = None, None

    @property
    def nccl_calls(self) -> int:
        """How many NCCL calls the record holds."""
        return sum(1 for entry in self.tape if entry.func not in (_run, _launch, _replayed, _rerecord))

    @property
    def triton_launches(self) -> int:
        """How many Triton launches the record holds."""
        return sum(1 for entry in self.tape if entry.func is _launch)

    def replay(self) -> None:
        with torch.no_grad():
            for entry in self.tape:
                entry()
        self.replays += 1
