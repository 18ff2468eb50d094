"""The pipeline's point-to-point protocol between neighbouring stages: activations forward, their gradients back.

An activation is one tensor, a tuple or a dict of tensors (a decoder's hidden states with its padding mask and
position ids). A step's first message to the next stage is a spec message (:data:`META_LEN` int64s holding the
structure, and each tensor's shape, dtype and whether it needs a gradient), so the receiver can allocate every
activation buffer of the step; gradients travel back only for the tensors that need one. Receives from one peer
match that peer's sends in order, so they may be posted ahead; on backends whose point-to-point runs in issue
order (NCCL on the compute stream, ``group.ordered_p2p``) sends wait in an *outbox* and go out in one group with
the next receive.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DTYPES", "META_LEN", "ActivationSpec", "StageLink", "flatten_activation", "unflatten_activation"]

META_LEN = 128  # int64s of the spec message (1 KiB): its byte length, then the spec as JSON
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]


@dataclass(frozen=True)
class ActivationSpec:
    """An activation's structure (``keys``: None for one tensor, an int for a tuple of that many, the keys of a
    dict) and each tensor's ``(shape, dtype, needs a gradient)``."""

    keys: int | tuple[str, ...] | None
    leaves: tuple[tuple[torch.Size, torch.dtype, bool], ...]

    @property
    def buffers(self) -> list[tuple[torch.Size, torch.dtype]]:
        """(shape, dtype) of every tensor, in order."""
        return [(shape, dtype) for shape, dtype, _ in self.leaves]

    @property
    def gradients(self) -> list[tuple[torch.Size, torch.dtype]]:
        """(shape, dtype) of the tensors whose gradient travels back, in order."""
        return [(shape, dtype) for shape, dtype, grad in self.leaves if grad]


def flatten_activation(value: Any) -> tuple[ActivationSpec, list[torch.Tensor]]:
    """``value`` (a tensor, or a tuple/list or dict of tensors) as its spec and its tensors in order.

    Raises:
        TypeError: When ``value`` is anything else.
    """
    if isinstance(value, torch.Tensor):
        keys, tensors = None, [value]
    elif isinstance(value, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in value):
        keys, tensors = len(value), list(value)
    elif isinstance(value, dict) and all(isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in value.items()):
        keys, tensors = tuple(value), list(value.values())
    else:
        raise TypeError(
            f"a pipeline activation is a tensor, a tuple or a dict of tensors, got {type(value).__name__}"
            + (f" of {[type(v).__name__ for v in value.values()]}" if isinstance(value, dict) else "")
        )
    leaves = tuple((t.shape, t.dtype, bool(t.requires_grad)) for t in tensors)
    return ActivationSpec(keys, leaves), tensors


def unflatten_activation(spec: ActivationSpec, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`flatten_activation`."""
    if spec.keys is None:
        return tensors[0]
    if isinstance(spec.keys, int):
        return tuple(tensors)
    return dict(zip(spec.keys, tensors, strict=True))


class _AllWorks:
    """Waits for several receives as one."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


class StageLink:
    """Sends and receives of stage ``stage`` of a pipeline ``group`` to the stages ``offset`` away (+1: next), on
    a ring: with interleaved chunks the last rank's activations go on to rank 0, whose gradients come back. The
    messages go through the group's :attr:`~gpudist.comm.CommunicationBackend.agreed` ops: their shapes were agreed
    by the step's spec message."""

    def __init__(self, group, stage: int, device: torch.device):
        self.group, self.stage, self.device = group, stage, device
        self.sent_spec: dict[int, ActivationSpec] = {}
        """Per chunk, the spec of the last train_step's activations sent to the next stage; the receiver posts the
        first activation's receives with it before the step's spec message arrives."""
        self.received_spec: dict[int, ActivationSpec] = {}
        """Per chunk, the spec of the last train_step's activations received from the previous stage."""

    def peer(self, offset: int) -> int:
        """Rank, in the pipeline group, of the stage ``offset`` away (around the ring)."""
        return (self.stage + offset) % self.group.world_size

    def send(self, tensor: torch.Tensor, offset: int, pending: list, outbox: list | None = None) -> None:
        """Send to the stage ``offset`` away: now, or (``outbox`` given, on backends whose p2p runs in issue order)
        later, posted in one group with the next receive or by :meth:`flush`."""
        tensor = tensor.contiguous()
        if outbox is not None:
            outbox.append((tensor, self.peer(offset)))
            return
        pending.append((self.group.agreed.send(tensor, self.peer(offset), async_op=True), tensor))

    def post_recvs(
        self,
        buffers: list[tuple[torch.Size, torch.dtype]],
        offset: int,
        pending: list | None = None,
        outbox: list | None = None,
    ) -> tuple[list[torch.Tensor], Any]:
        """Post receives from the stage ``offset`` away, one per ``(shape, dtype)``; returns the buffers and a Work
        to wait on before reading them. Receives from one peer match that peer's sends in order, so they may be
        posted ahead of time (not where p2p runs in issue order: there the sends waiting in ``outbox`` go out in one
        group with them)."""
        return self.post_recv_group([(buffers, offset)], pending, outbox)[0]

    def post_recv_group(
        self,
        wanted: list[tuple[list[tuple[torch.Size, torch.dtype]], int]],
        pending: list | None = None,
        outbox: list | None = None,
    ) -> list[tuple[list[torch.Tensor], Any]]:
        """:meth:`post_recvs` of several messages ``(buffers, offset)``, in order: with an ``outbox``, all in one
        group with its sends (one Work for all)."""
        bufs = [[torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in b] for b, _ in wanted]
        agreed = self.group.agreed
        if outbox is None:
            return [
                (got, _AllWorks([agreed.recv(buf, self.peer(offset), async_op=True) for buf in got]))
                for got, (_, offset) in zip(bufs, wanted, strict=True)
            ]
        recvs = [(buf, self.peer(offset)) for got, (_, offset) in zip(bufs, wanted, strict=True) for buf in got]
        work = agreed.batch_send_recv(outbox, recvs)
        pending.append((work, list(outbox)))
        outbox.clear()
        return [(got, work) for got in bufs]

    def post_recv(
        self,
        shape: torch.Size,
        dtype: torch.dtype,
        offset: int,
        pending: list | None = None,
        outbox: list | None = None,
    ) -> tuple[torch.Tensor, Any]:
        """:meth:`post_recvs` of one tensor."""
        bufs, work = self.post_recvs([(shape, dtype)], offset, pending, outbox)
        return bufs[0], work

    def flush(self, pending: list, outbox: list | None) -> None:
        """Post the sends waiting in ``outbox`` (ordered p2p), as one group."""
        if outbox:
            pending.append((self.group.agreed.batch_send_recv(outbox), list(outbox)))
            outbox.clear()

    def recv(self, shape: torch.Size, dtype: torch.dtype, offset: int) -> torch.Tensor:
        buf, work = self.post_recv(shape, dtype, offset)
        work.wait()
        return buf

    def encode_spec(self, spec: ActivationSpec) -> torch.Tensor:
        """``spec`` as a message (on this stage's device: NCCL sends only device memory)."""
        body = {
            "keys": list(spec.keys) if isinstance(spec.keys, tuple) else spec.keys,
            "leaves": [[list(shape), DTYPES.index(dtype), grad] for shape, dtype, grad in spec.leaves],
        }
        data = json.dumps(body, separators=(",", ":")).encode()
        room = (META_LEN - 1) * 8
        if len(data) > room:
            raise ValueError(
                f"PipelineParallelModel: stage {self.stage}'s activation ({len(spec.leaves)} tensors) needs a "
                f"{len(data)}-byte spec message, more than {room}; send fewer tensors or shorter dict keys"
            )
        words = [len(data)]
        padded = data.ljust(room, b"\0")
        words += [int.from_bytes(padded[i : i + 8], sys.byteorder, signed=True) for i in range(0, room, 8)]
        return torch.tensor(words, dtype=torch.int64, device=self.device)  # built on the device, as NCCL needs

    @staticmethod
    def decode_spec(meta: torch.Tensor) -> ActivationSpec:
        words = meta.tolist()  # the one host read of the message
        data = b"".join(w.to_bytes(8, sys.byteorder, signed=True) for w in words[1:])[: words[0]]
        body = json.loads(data)
        keys = tuple(body["keys"]) if isinstance(body["keys"], list) else body["keys"]
        leaves = tuple((torch.Size(shape), DTYPES[code], grad) for shape, code, grad in body["leaves"])
        return ActivationSpec(keys, leaves)

    def check_sendable(self, value: Any) -> ActivationSpec:
        """The spec of ``value``, an activation this stage sends.

        Raises:
            TypeError: When it is not a tensor, a tuple or a dict of tensors.
            ValueError: When a tensor's dtype cannot be sent.
        """
        try:
            spec, tensors = flatten_activation(value)
        except TypeError as e:
            raise TypeError(f"PipelineParallelModel: stage {self.stage} output cannot be sent: {e}") from None
        for t in tensors:
            if t.dtype not in DTYPES:
                raise ValueError(
                    f"PipelineParallelModel: stage {self.stage} output of shape {tuple(t.shape)} and dtype "
                    f"{t.dtype} cannot be sent; use one of {DTYPES}"
                )
        return spec

    def send_activation(self, value: Any, pending: list, offset: int = 1) -> None:
        """Send ``value`` with its spec message first to the stage ``offset`` away (no-gradient paths: forward,
        predict)."""
        spec = self.check_sendable(value)
        self.send(self.encode_spec(spec), offset, pending)
        for t in flatten_activation(value)[1]:
            self.send(t, offset, pending)

    def recv_activation(self, offset: int = -1) -> Any:
        """The activation :meth:`send_activation` sent from the stage ``offset`` away (default: the previous)."""
        spec = self.decode_spec(self.recv(torch.Size([META_LEN]), torch.int64, offset))
        bufs, work = self.post_recvs(spec.buffers, offset)
        work.wait()
        return unflatten_activation(spec, bufs)
