"""The CUDA that gpudist's NCCL backend needs: its device, its communication stream there, and events on it, through
as few host calls as torch allows (one seam, so the whole backend also runs in the CPU test tier over a simulated
NCCL and device: tests/fakenccl.py stands in for :class:`CudaRuntime`)."""

from __future__ import annotations

import torch

from .errors import CommunicationError

__all__ = ["CudaRuntime"]

_EVENT_POOL = 1024
"""Free events a runtime keeps for reuse (more ops than this in flight at once create new ones). The watchdog gives
events back every 50 ms, and a host-bound loop issues hundreds of small ops in that time: with a pool of 64, each
op of such a burst past the 64th created an event (a ``cudaEventCreate`` at its record) and the op's retirement
destroyed it."""

_STREAMS_KEPT = 64
"""Current streams a runtime keeps objects for (torch's pool has 32 per priority and device; past this it starts
over, so a program making streams without end does not grow it)."""


class CudaRuntime:
    """What the backend needs of CUDA: its device, its communication stream there, events on that stream.
    (One seam, so the whole backend also runs in the CPU test tier over a simulated NCCL: tests/fakenccl.py.)

    Per op it makes five CUDA calls and builds no Python object: the hand-over event recorded on the current stream
    and waited for by the communication stream (:meth:`stream`), the op's pooled event recorded after it
    (:meth:`record`), and the current stream's wait on that (:meth:`wait`). torch's own ways cost the host more than
    the calls themselves: ``torch.cuda.current_stream()`` builds a new ``Stream`` object each call and
    ``Stream.wait_stream`` a new ``Event`` (a ``cudaEventCreate`` and a ``cudaEventDestroy``), so the current stream
    is looked up by its id (a tuple from torch's C lookup, the one ``current_stream`` itself makes) among the streams
    met so far, and the hand-over reuses one event: a stream's wait takes the event's state when it is enqueued, not
    later records (CUDA's ``cudaStreamWaitEvent``). Ops of one backend are issued by one thread at a time (NCCL needs
    the same issue order on every rank anyway), so one hand-over event is not recorded by two ops at once. (On an
    H200's host this took a planned all-reduce from more than twice the raw CuPy call with torch's own hand-over to
    about the same: docs/results.md, "On a GPU".)"""

    def __init__(self, device: int | torch.device | None, group: str, rank: int):
        if not torch.cuda.is_available():
            raise CommunicationError(
                "the NCCL backend needs a CUDA device; torch sees none (use the Gloo or MPI backend on CPU)",
                op="init",
                group=group,
                rank=rank,
            )
        index = device.index if isinstance(device, torch.device) else device
        self.device = torch.device("cuda", torch.cuda.current_device() if index is None else int(index))
        self._index = self.device.index
        self._comm_stream: torch.cuda.Stream | None = None
        self._comm_handle = 0
        self._handover: torch.cuda.Event | None = None
        self._lookup = None
        """torch's C lookup of the current stream's ``(id, device index, device type)``; None: ``current_stream()``."""
        self._streams: dict[tuple, torch.cuda.Stream] = {}
        """The current streams met so far, by that key (one object each, made once)."""
        self._free: list[torch.cuda.Event] = []
        """Events whose op completed and was waited for, recorded again by later ops (:meth:`record`)."""

    def _comm(self) -> torch.cuda.Stream:
        if self._comm_stream is None:
            self._open()
        return self._comm_stream

    def _open(self) -> None:
        """The communication stream and the hand-over event, at the first op; and the current-stream lookup, where
        this torch has it in the form its ``current_stream()`` reads (checked, since it is not public API)."""
        first = torch.cuda.current_stream(self.device)  # also CUDA's lazy initialization, before any C lookup
        lookup = getattr(torch._C, "_cuda_getCurrentStream", None)
        key = lookup(self._index) if lookup is not None else None
        if isinstance(key, tuple) and len(key) == 3 and key[0] == first.stream_id:
            self._lookup = lookup
            self._streams[key] = first
        self._handover = torch.cuda.Event()
        self._comm_stream = torch.cuda.Stream(self.device)
        self._comm_handle = self._comm_stream.cuda_stream

    def current(self) -> torch.cuda.Stream:
        """torch's current stream on the device, as ``torch.cuda.current_stream(device)`` but without building an
        object per call (it changes with ``torch.cuda.stream(...)`` and per thread, so it is looked up every time)."""
        lookup = self._lookup
        if lookup is None:
            return torch.cuda.current_stream(self.device)
        key = lookup(self._index)
        stream = self._streams.get(key)
        if stream is None:
            if len(self._streams) >= _STREAMS_KEPT:
                self._streams.clear()
            stream = self._streams[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
        return stream

    def stream(self) -> int:
        """The communication stream's handle, once it waits for all work enqueued so far on the current stream."""
        if self._comm_stream is None:
            self._open()
        handover = self._handover
        handover.record(self.current())
        handover.wait(self._comm_stream)
        return self._comm_handle

    def on_comm(self):
        """Run the torch ops inside on the communication stream (an op's own follow-up, e.g. AVERAGE's scaling)."""
        return torch.cuda.stream(self._comm())

    def hold(self, tensors) -> None:
        """Nothing on a real device: the backend keeps ``tensors`` referenced in the op's in-flight entry until the
        current stream waited for the op or the op completed (:meth:`NCCLCommunicationBackend._enqueued`), which keeps
        the caching allocator from reusing their memory as ``record_stream`` did, without its per-tensor host call and
        without delaying the memory's reuse to the allocator's next event poll. (The simulated runtime checks here
        that every buffer an op touches was handed over.)"""

    def record(self) -> torch.cuda.Event:
        """An event after everything enqueued so far on the communication stream: a pooled one when an earlier op's
        event is free (:meth:`recycle`), so a steady-state step creates and destroys no CUDA event."""
        event = self._free.pop() if self._free else torch.cuda.Event()
        event.record(self._comm())
        return event

    def record_current(self) -> torch.cuda.Event:
        """An event after everything enqueued so far on the current stream (a replayed graph, :meth:`watch_graph`)."""
        event = self._free.pop() if self._free else torch.cuda.Event()
        event.record(self.current())
        return event

    def recycle(self, event: torch.cuda.Event) -> None:
        """Give back the event of an op that completed and whose Work was waited for (nothing reads it again)."""
        if len(self._free) < _EVENT_POOL:
            self._free.append(event)

    def wait(self, event: torch.cuda.Event) -> None:
        """The current stream waits for ``event`` (the host does not)."""
        event.wait(self.current())

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def selected(self):
        return torch.cuda.device(self.device)
