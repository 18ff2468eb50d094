"""The pipeline's point-to-point protocol between neighbouring stages: activations forward, their gradients back.

A step's first message to the next stage is a shape message (:data:`META_LEN` int64s: ndim, dtype code, sizes), so
the receiver can allocate every activation buffer of the step. Receives from one peer match that peer's sends in
order, so they may be posted ahead; on backends whose point-to-point runs in issue order (NCCL on the compute
stream, ``group.ordered_p2p``) sends wait in an *outbox* and go out in one group with the next receive.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DTYPES", "META_LEN", "StageLink"]

META_LEN = 10  # [ndim, dtype code, up to 8 sizes]: the shape message that precedes a step's first activation
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]


class StageLink:
    """Sends and receives of stage ``stage`` of a pipeline ``group`` to the stages ``offset`` away (+1: next)."""

    def __init__(self, group, stage: int, device: torch.device):
        self.group, self.stage, self.device = group, stage, device
        self.sent_shape: tuple[torch.Size, torch.dtype] | None = None
        """(shape, dtype) of the last train_step's activations sent to the next stage; the receiver posts the first
        activation's receive with it before the step's shape message arrives."""
        self.received_shape: tuple[torch.Size, torch.dtype] | None = None
        """(shape, dtype) of the last train_step's activations received from the previous stage."""

    def peer(self, offset: int) -> int:
        """Rank, in the pipeline group, of the stage ``offset`` away."""
        return self.stage + offset

    def send(self, tensor: torch.Tensor, offset: int, pending: list, outbox: list | None = None) -> None:
        """Send to the stage ``offset`` away: now, or (``outbox`` given, on backends whose p2p runs in issue order)
        later, posted in one group with the next receive or by :meth:`flush`."""
        tensor = tensor.contiguous()
        if outbox is not None:
            outbox.append((tensor, self.peer(offset)))
            return
        with self.group.unchecked():  # shapes agreed by the step's shape message
            pending.append((self.group.send(tensor, self.peer(offset), async_op=True), tensor))

    def post_recv(
        self,
        shape: torch.Size,
        dtype: torch.dtype,
        offset: int,
        pending: list | None = None,
        outbox: list | None = None,
    ) -> tuple[torch.Tensor, Any]:
        """Post a receive from the stage ``offset`` away; returns the buffer and the Work to wait on before reading
        it. Receives from one peer match that peer's sends in order, so they may be posted ahead of time (not where
        p2p runs in issue order: there the sends waiting in ``outbox`` go out in one group with it)."""
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        with self.group.unchecked():
            if outbox is None:
                return buf, self.group.recv(buf, self.peer(offset), async_op=True)
            work = self.group.batch_send_recv(outbox, [(buf, self.peer(offset))])
            pending.append((work, list(outbox)))
            outbox.clear()
            return buf, work

    def flush(self, pending: list, outbox: list | None) -> None:
        """Post the sends waiting in ``outbox`` (ordered p2p), as one group."""
        if outbox:
            with self.group.unchecked():
                pending.append((self.group.batch_send_recv(outbox), list(outbox)))
            outbox.clear()

    def recv(self, shape: torch.Size, dtype: torch.dtype, offset: int) -> torch.Tensor:
        buf, work = self.post_recv(shape, dtype, offset)
        work.wait()
        return buf

    @staticmethod
    def encode_meta(tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s shape and dtype as a message (on ``tensor``'s device: NCCL sends only device memory)."""
        meta = [tensor.dim(), DTYPES.index(tensor.dtype), *tensor.shape]
        return torch.tensor(meta + [0] * (META_LEN - len(meta)), dtype=torch.int64, device=tensor.device)

    @staticmethod
    def decode_meta(meta: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
        values = meta.tolist()
        return torch.Size(values[2 : 2 + values[0]]), DTYPES[values[1]]

    def check_sendable(self, tensor: torch.Tensor) -> None:
        if tensor.dim() > META_LEN - 2 or tensor.dtype not in DTYPES:
            raise ValueError(
                f"PipelineParallelModel: stage {self.stage} output of shape "
                f"{tuple(tensor.shape)} and dtype {tensor.dtype} cannot be sent; use at most "
                f"{META_LEN - 2} dimensions and one of {DTYPES}"
            )

    def send_meta(self, tensor: torch.Tensor, pending: list) -> None:
        self.check_sendable(tensor)
        self.send(self.encode_meta(tensor), +1, pending)

    def recv_meta(self) -> tuple[torch.Size, torch.dtype]:
        return self.decode_meta(self.recv(torch.Size([META_LEN]), torch.int64, -1))
