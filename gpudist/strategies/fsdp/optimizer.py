"""ZeRO-3's optimizer: steps the parameter shards a :class:`~.model.ZeRO3Model` keeps on this rank, in place."""

from __future__ import annotations

import torch

from ... import kernels
from ...flat import BufferSpec
from ..flat_optimizer import FlatShardOptimizer
from ..zero import BucketPieces
from .model import ZeRO3Model

__all__ = ["ZeRO3Optimizer"]


class ZeRO3Optimizer(FlatShardOptimizer):
    """ZeRO stage 3: steps the parameter shards a :class:`gpudist.ZeRO3Model` (or ``FSDPModel``) keeps on this rank.

    Build it from ``model.parameters()`` (the shards) and the same configuration. The model has already
    reduce-scattered the gradients into the shards' ``.grad`` during backward and gathers parameters again at
    the next forward, so ``step`` only updates: one fused launch per parameter group for Adam/AdamW/SGD (any other
    torch optimizer over views), an fp32 master copy when the shards are bf16/fp16, global-norm clipping and the
    non-finite skip agreed over all ranks by one 8-byte all-reduce. Used with parameters no ZeRO-3 wrapper
    shards (a plain module), it does ZeRO-2's job: reduce-scatter, update the owned pieces, all-gather.

    Args:
        optimizer: The ``torch.optim.Optimizer`` over ``model.parameters()`` whose algorithm and
            hyper-parameters to use.
        config: The configuration the ``ZeRO3Model`` was built from, or that model itself.

    Raises:
        TypeError: When ``optimizer`` is not a ``torch.optim.Optimizer`` (or is already wrapped), or ``config`` is
            neither a ``ShardingConfiguration`` nor a ``ShardedModel``.
        ValueError: When the optimizer has no parameter that requires grad, its trainable parameters differ in
            dtype or device, the model passed as ``config`` does not reduce every trainable parameter, or (a
            plain module) another rank's parameter groups or shapes differ.
    """

    strategy = "zero3"

    def _replicated(self) -> bool:
        # a ZeRO-3 model's shards differ by rank (the model checked its architecture across ranks when it was built)
        return not isinstance(self.model(), ZeRO3Model)

    def owned_segments(self) -> list[tuple[int, int]]:
        """The whole of every shard (a ZeRO-3 model's); over a plain module, ZeRO-2's piece of every bucket."""
        self._bucket_pieces = BucketPieces(self) if self._replicated() else None
        return [(0, self._flat.layout.total)] if self._bucket_pieces is None else self._bucket_pieces.segments()

    _bucket_pieces: BucketPieces | None = None
    """ZeRO-2's ownership over a plain module (or a ZeRO2Model); None over a ZeRO-3 model's shards."""

    def _owned_size(self) -> int:
        return super()._owned_size() if self._bucket_pieces is None else self._bucket_pieces.owned_size()

    def _segment_spans(self):
        return super()._segment_spans() if self._bucket_pieces is None else self._bucket_pieces.spans()

    def reduce_gradients(self) -> None:
        """Take the shards' gradients, which the ZeRO-3 model already reduce-scattered, as the owned gradients;
        without a ZeRO-3 model, reduce them as :class:`~gpudist.ZeRO2Optimizer` does.

        Raises:
            ValueError: When the paired model is neither a ZeRO-3 model nor a ``ZeRO2Model`` whose trainable
                parameters are this optimizer's, in order.
        """
        if self._bucket_pieces is not None:
            self._bucket_pieces.reduce_gradients(self)
            return
        # The model reduce-scattered every shard's gradient into one flat buffer in parameter order (the shards'
        # .grad are its slices): step that buffer in place. Otherwise (a gradient missing or replaced), a copy.
        grads = [p.grad for p in self._flat_params]
        common = self._common_buffer(grads)
        if common is not None:
            self._grad = common
            return
        self._grad = torch.empty(self._owned_numel, dtype=self._grad.dtype, device=self._grad.device)
        kernels.pack(
            [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, self._flat_params, strict=True)],
            self._grad,
        )

    def gradient_buffers(self) -> dict[int, BufferSpec]:
        return {} if self._bucket_pieces is None else self._bucket_pieces.gradient_buffers(self)

    def _reduce_scatter_gradients(self) -> None:
        if self._bucket_pieces is not None:  # a ZeRO-3 model reduce-scattered them in backward
            self._bucket_pieces.reduce_scatter(self)

    def _common_buffer(self, grads: list[torch.Tensor | None]) -> torch.Tensor | None:
        """The 1-D buffer whose consecutive slices ``grads`` are, in this optimizer's layout, or None."""
        base = grads[0]._base if grads and grads[0] is not None else None
        layout = self._flat.layout
        if base is None or base.dim() != 1 or base.numel() != layout.total or not base.is_contiguous():
            return None
        storage, ptr, size = base.untyped_storage().data_ptr(), base.data_ptr(), base.element_size()
        for g, offset, numel in zip(grads, layout.offsets, layout.numels, strict=True):
            if (
                g is None
                or g.numel() != numel
                or g.data_ptr() != ptr + offset * size
                or g.untyped_storage().data_ptr() != storage
            ):
                return None
        return base

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if set_to_none and self._bucket_pieces is None:
            self._grad = self._grad.new_empty(0)  # the shards' gradients are gone: this view of them goes too

    def _gather_parameters(self) -> None:
        if self._bucket_pieces is not None:
            self._bucket_pieces.gather(self)
        elif not self._master_is_view:
            kernels.pack([self._master], self._flat.data)  # new low-precision shard values from the fp32 master

    def _update_and_gather(self, scale) -> None:
        """Over a plain module with the fused fp32 path: each bucket is a gathered region, as in ZeRO-2."""
        if self._bucket_pieces is None or not self._overlaps_gather():  # a ZeRO-3 model's shards: nothing to overlap
            super()._update_and_gather(scale)
            return
        self._update_and_send(scale, self._bucket_pieces.regions())
