"""ZeRO model wrappers."""

from __future__ import annotations

import torch

from ..comm import ReductionOperation, Work
from ..flat import FlatLayout, GradientBucket, partition_buckets
from .base import ShardedModel
from .ddp import DDPModel

__all__ = ["ZeRO1Model", "ZeRO2Model"]


class ZeRO1Model(DDPModel):
    """ZeRO stage 1, model side: parameters and gradients replicated, gradients averaged in buckets during
    backward exactly as :class:`DDPModel` does. The sharding is the optimizer's: pair it with
    :class:`gpudist.ZeRO1Optimizer` built from the same configuration, which keeps 1/N of the optimizer state
    and all-gathers the updated parameters."""

    strategy = "zero1"
    _flat_parameters = True


class ZeRO2Model(DDPModel):
    """ZeRO stage 2, model side: parameters replicated, gradients reduce-scattered bucket by bucket during
    backward, and each rank keeps only its piece of every bucket (1/N of the gradients, ``owned_grads``).

    A bucket's full gradients live only until its reduce-scatter starts; then ``param.grad`` is released.
    Communicates ``(N-1)/N x P`` per step for the gradients (the optimizer's all-gather adds the same again).
    Pair it with :class:`gpudist.ZeRO2Optimizer` built from the same configuration; it steps the owned pieces.
    """

    strategy = "zero2"
    _hook_op = "reduce_scatter"
    _flat_parameters = True

    @property
    def _views(self) -> bool:
        return False  # full gradients do not persist: that is the memory ZeRO-2 saves

    def initialize_sharding(self) -> None:
        kinds = {(p.dtype, p.device) for p in self.module.parameters() if p.requires_grad}
        if len(kinds) > 1:
            raise ValueError(
                f"ZeRO2Model needs all trainable parameters in one dtype and device, got "
                f"{sorted(str(k) for k in kinds)}; cast the model first (e.g. model.float())"
            )
        super().initialize_sharding()
        config = self.config
        parts = partition_buckets(
            self._params, config.bucket_cap_bytes(), config.bucket_cap_bytes(first=True), self.world_size, self.rank
        )
        for bucket, part in zip(self._buckets, parts, strict=True):
            bucket.part = part
        first = self._params[0] if self._params else None
        owned = sum(part.owned_numel for part in parts)
        self.owned_grads = torch.zeros(
            owned,
            dtype=first.dtype if first is not None else torch.float32,
            device=first.device if first is not None else "cpu",
        )
        self._wire_dtype = config.communication_dtype or self.owned_grads.dtype
        self._layouts = {b.index: FlatLayout.of(b.params) for b in self._buckets}
        self._filling: dict[int, torch.Tensor] = {}
        """Send buffers of the buckets whose gradients are arriving (bucket index -> buffer): every slot is written by
        its parameter's hook, or by ``_complete_unused`` for a parameter this backward did not use."""
        self._stale: set[int] = set()
        """Buckets whose owned piece holds no gradient since zero_grad(set_to_none=True): the next reduce writes it
        instead of adding to it, so zero_grad makes no zeroing pass (:meth:`owned_gradients` zeroes what is left)."""

    def _make_bucket(self, index, params, names, storage=None) -> GradientBucket:
        return GradientBucket(index, params, names)

    def owned_segments(self) -> list[tuple[int, int]]:
        """(flat offset, length) of the gradient pieces this rank keeps, ascending (the owned buffer's order)."""
        return sorted(b.part.segment for b in self._buckets)

    def _arrived(self, bucket: GradientBucket, j: int, param: torch.Tensor) -> None:
        """Copy the gradient into its slot of the bucket's send buffer (allocated by the bucket's first gradient), times
        1/N unless a comm hook averages, and free it: full gradients never pile up while a bucket fills, and the
        copy reads the gradient while it is still in cache (as torch DDP's copy into its bucket)."""
        sent = self._filling.get(bucket.index)
        if sent is None:
            dtype = self.owned_grads.dtype if self._comm_hook is not None else self._wire_dtype
            sent = self._filling[bucket.index] = torch.empty(bucket.numel, dtype=dtype, device=self.owned_grads.device)
        layout = self._layouts[bucket.index]
        slot = sent[layout.offsets[j] : layout.offsets[j] + layout.numels[j]].view(param.shape)
        if param.grad is None:  # unused in this backward (find_unused_parameters), nothing from no_sync: zeros
            slot.zero_()
        elif self._comm_hook is not None:
            slot.copy_(param.grad)
        else:
            torch.mul(param.grad, 1.0 / self.world_size, out=slot)
        param.grad = None  # the full gradient is in the bucket now; free it

    def _launch(self, bucket: GradientBucket) -> None:
        hook, part = self._comm_hook, bucket.part
        sent = self._filling.pop(bucket.index)
        if hook is not None:
            received = torch.empty(part.owned_numel, dtype=sent.dtype, device=sent.device)
            hook.reduce_scatter(bucket.index, sent, received)
            work = Work()
        else:
            received = sent[part.owned_start : part.owned_start + part.owned_numel]  # in place: no second buffer
            with self.comm.unchecked():  # bucket layouts agree by construction (same fingerprint at wrap time)
                work = self.comm.reduce_scatter(
                    sent, received, ReductionOperation.SUM, async_op=True, scratch_input=True
                )  # sent is this bucket's own packed copy
        bucket.in_flight = (sent, received)
        self._pending.append((bucket, work))
        # At most _IN_FLIGHT reduce-scatters at a time, as ZeRO3Model: each holds its bucket's full-size send buffer,
        # so letting all of them run to the end of backward held a full copy of the gradients at the peak, and the
        # memory freed at once went back to the OS and had to be faulted in again the next step.
        while len(self._pending) > self._IN_FLIGHT:  # the work objects hold the buffers too: let them go
            done, work = self._pending.pop(0)
            work.wait()
            self._after_reduce(done)

    _IN_FLIGHT = 2

    def _after_reduce(self, bucket: GradientBucket) -> None:
        _, received = bucket.in_flight
        part = bucket.part
        piece = self.owned_grads[part.owned_at : part.owned_at + part.owned_numel]
        if bucket.index in self._stale:  # the first reduce since zero_grad(set_to_none=True): write
            piece.copy_(received)
            self._stale.discard(bucket.index)
        else:  # several synced backward passes before a step add up, as plain gradients do
            piece.add_(received)
        bucket.in_flight = None

    def _reset_step(self) -> None:
        super()._reset_step()
        self._filling.clear()

    def owned_gradients(self) -> torch.Tensor:
        """The owned gradient pieces (``owned_grads``), zero where no backward wrote since ``zero_grad``."""
        for bucket in self._buckets:
            if bucket.index in self._stale:
                part = bucket.part
                self.owned_grads[part.owned_at : part.owned_at + part.owned_numel].zero_()
        self._stale.clear()
        return self.owned_grads

    def zero_grad_buckets(self, set_to_none: bool = True) -> None:
        """Clear the gradients. The owned pieces are not zeroed here but overwritten by the next backward
        (``set_to_none``, torch's default: no pass over P/N), or zeroed now (``set_to_none=False``)."""
        if set_to_none:
            self._stale = {b.index for b in self._buckets}
        else:
            self.owned_grads.zero_()
            self._stale.clear()
        for p in self._params:
            p.grad = None

    def memory_per_rank(self) -> dict[str, int]:
        mem = ShardedModel.memory_per_rank(self)
        mem["gradients"] += self.owned_grads.numel() * self.owned_grads.element_size()
        return mem
