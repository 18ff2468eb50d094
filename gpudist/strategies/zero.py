"""ZeRO stages 1 and 2: optimizer state (ZeRO-1) and gradients too (ZeRO-2) split across ranks.

Everything the two stages communicate is in this module. The model side (:class:`ZeRO1Model`,
:class:`ZeRO2Model`) produces the averaged gradients during backward: ZeRO-1 all-reduces buckets as DDP does,
ZeRO-2 reduce-scatters each bucket and keeps only this rank's piece (``owned_grads``). The optimizer side owns
*segments* of the flat parameter buffer (``(offset, length)``, in parameter order) and keeps their fp32 master
values, gradients and optimizer state in contiguous "owned" buffers, so one fused kernel launch updates
everything it owns (one per parameter group); then it sends the updated values to every rank. ZeRO-1 owns one
contiguous range per rank (``shard_range``), ZeRO-2 an even piece of every gradient bucket
(``partition_buckets``), so a bucket's reduce-scatter lands exactly on what the rank updates.

The pairing is explicit: the optimizer asks its model (:meth:`ShardedOptimizer.model`) for the gradients through
the model's public methods (``flat_grads``, :meth:`ZeRO2Model.owned_gradients`), and used with a plain module it
does the model's part itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import kernels
from ..comm import ReductionOperation, Work
from ..flat import (
    BufferSpec,
    FlatLayout,
    GradientBucket,
    assign_buckets,
    padded_range,
    padded_shard,
)
from .ddp import DDPModel, DDPOptimizer, bucket_groups
from .flat_optimizer import FlatShardOptimizer
from .model import ShardedModel
from .optimizer import ShardedOptimizer
from .reducer import BucketCollective
from .step_scalars import StepScale

__all__ = ["BucketPieces", "ZeRO1Model", "ZeRO1Optimizer", "ZeRO2Model", "ZeRO2Optimizer", "data_parallel_optimizer"]


# ---------------------------------------------------------------------------------------------------------------------
# ZeRO-2's partition: every gradient bucket split evenly over the ranks


@dataclass(frozen=True)
class BucketPartition:
    """A bucket as a range of the flat parameter order, and the piece of it one rank owns (ZeRO-2).

    The bucket is split by :func:`gpudist.flat.padded_shard`: every rank's piece has ``shard`` elements (the
    bucket's reduce-scatter sends ``world_size * shard``, zero-padded, so it is one even collective), of which the
    first ``owned_numel`` are real; in the owned buffer each piece takes a ``shard``-sized, aligned slot."""

    flat_offset: int
    numel: int
    owned_start: int
    """Start of the owned piece inside the bucket (``rank * shard``, at most ``numel``)."""
    owned_numel: int
    """Real elements of the owned piece (fewer than ``shard`` on the last ranks; may be 0)."""
    owned_at: int
    """Where the owned piece's slot sits in the rank's owned buffer (slots in ascending flat order)."""
    shard: int
    """Elements of every rank's padded piece, a multiple of :data:`gpudist.flat.SHARD_ALIGN`."""

    @property
    def segment(self) -> tuple[int, int]:
        return self.flat_offset + self.owned_start, self.owned_numel


def partition_buckets(
    params: Sequence[torch.nn.Parameter], cap_bytes: int, first_cap_bytes: int, world_size: int, rank: int
) -> list[BucketPartition]:
    """Buckets of :func:`assign_buckets` (launch order) as flat ranges, each split evenly (padded) over the ranks.

    ZeRO2Model and ZeRO2Optimizer both derive their partition from this one function, so they agree on who owns
    what whichever of them is built first.
    """
    layout = FlatLayout.of(list(params))
    spans = []
    for indices in assign_buckets(params, cap_bytes, first_cap_bytes):
        first = min(indices)
        numel = sum(layout.numels[i] for i in indices)
        start, end = padded_range(numel, world_size, rank)
        spans.append((layout.offsets[first], numel, start, end - start, padded_shard(numel, world_size)))
    owned_at, at = {}, 0
    for offset, _, _, _, shard in sorted(spans):
        owned_at[offset] = at
        at += shard
    return [BucketPartition(off, n, start, owned, owned_at[off], shard) for off, n, start, owned, shard in spans]


class ZeRO1Model(DDPModel):
    """ZeRO stage 1, model side: parameters and gradients replicated, gradients averaged in buckets during
    backward exactly as :class:`DDPModel` does. The sharding is the optimizer's: pair it with
    :class:`gpudist.ZeRO1Optimizer` built from the same configuration, which keeps 1/N of the optimizer state
    and all-gathers the updated parameters.

    Args:
        module: The ``nn.Module`` to wrap; every rank must build the same architecture. Its parameters and buffers
            take rank 0's values, and its trainable parameters move into one flat buffer (which the optimizer
            adopts).
        config: The settings shared with the paired optimizer; ``config.backend`` is the data-parallel group.

    Raises:
        TypeError: When ``module`` is not an ``nn.Module`` or is already wrapped, or ``config`` is not a
            :class:`~gpudist.ShardingConfiguration`.
        ValueError: When ranks wrap modules whose parameter names, shapes or dtypes differ.
    """

    strategy = "zero1"
    _flat_parameters = True
    _pads_to_shards = True
    _aligned_gradients = False

    def memory_per_rank(self) -> dict[str, int]:
        mem = super().memory_per_rank()
        numel = sum(p.numel() for p in self._params)
        if numel:  # the padding after the parameters (and the gradients viewing one buffer) is allocated too
            padding = (self.world_size * padded_shard(numel, self.world_size) - numel) * self._params[0].element_size()
            mem["parameters"] += padding
            if self.flat_grads is not None:  # the buckets are views of it, counted with or without param.grad
                mem["gradients"] += padding
        return mem


class ReduceScatterBuckets(BucketCollective):
    """ZeRO-2's gradient path: each bucket's gradients are taken from ``param.grad`` as they arrive, flattened into a
    send buffer (zero-padded to ``world_size`` even pieces) in one multi-tensor copy when the bucket is complete, the
    bucket is reduce-scattered, and this rank keeps only its piece of the average, in ``owned_grads`` (slots in
    :func:`partition_buckets` order). At most :attr:`max_in_flight` send buffers live at a time.

    Args:
        comm: The data-parallel group.
        config: The model's configuration (bucket caps, wire dtype).
        named: ``(name, parameter)`` of the trainable parameters (one dtype and device), in the module's order.
        capacity: Unused (the owned buffer is padded per bucket).
        topology: Must be None (a hierarchical all-reduce is DDP's).
        aligned: Unused (the send buffer is packed, the owned pieces are in the flat parameter order).
    """

    hook_op = "reduce_scatter"
    max_in_flight = 2
    """As ZeRO3Model: each reduce-scatter holds its bucket's full-size send buffer, so letting all of them run to the
    end of backward held a full copy of the gradients at the peak, and the memory freed at once went back to the OS
    and had to be faulted in again the next step."""

    def __init__(self, comm, config, named, *, capacity: int = 0, topology=None, aligned: bool = False):
        self.comm, self.config = comm, config
        self.world_size, self.rank = comm.world_size, comm.rank
        self.hook = None
        self.flat_grads = None  # full gradients do not persist: that is the memory ZeRO-2 saves
        params = [p for _, p in named]
        self.buckets = [
            GradientBucket(b, [params[i] for i in ix], [named[i][0] for i in ix])
            for b, ix in enumerate(bucket_groups(params, config))
        ]
        parts = partition_buckets(
            params, config.bucket_cap_bytes(), config.bucket_cap_bytes(first=True), self.world_size, self.rank
        )
        for bucket, part in zip(self.buckets, parts, strict=True):
            bucket.part = part
        self._inverse_world = 1.0 / self.world_size
        first = params[0] if params else None
        self.owned_grads = torch.zeros(
            sum(part.shard for part in parts),
            dtype=first.dtype if first is not None else torch.float32,
            device=first.device if first is not None else "cpu",
        )
        self._wire_dtype = config.communication_dtype or self.owned_grads.dtype
        self._scale_first = self._wire_dtype == torch.float16  # N unscaled fp16 gradients could overflow their sum
        self._plans = [
            comm.plan_reduce_scatter(
                self.world_size * b.part.shard, self._wire_dtype, ReductionOperation.SUM, scratch_input=True
            )
            for b in self.buckets
        ]
        """Each bucket's reduce-scatter, checked now and started every step on its new send buffer (the buffer is
        the bucket's own packed copy, so the transport may reduce in it)."""
        for bucket in self.buckets:
            bucket.on_arrival = False  # the launch takes the bucket's gradients out of param.grad at once
        like = self.owned_grads
        self._padding = [
            torch.zeros(self.world_size * b.part.shard - b.part.numel, dtype=like.dtype, device=like.device)
            for b in self.buckets
        ]
        """Zeros after each bucket's gradients in its send buffer: every rank's piece the same size, one even
        reduce-scatter (kept from step to step, never written)."""
        self.stale: set[int] = set()
        """Buckets whose owned piece holds no gradient since zero_grad(set_to_none=True): the next reduce writes it
        instead of adding to it, so zero_grad makes no zeroing pass (:meth:`owned_gradients` zeroes what is left)."""

    def use_hook(self, hook) -> None:
        self.hook = hook

    def buffer_specs(self) -> dict[int, BufferSpec]:
        """What each bucket's reduce-scatter sends: the bucket zero-padded to ``world_size`` even pieces."""
        return {
            b.index: BufferSpec.of(b.params, self.hook_op, size=self.world_size * b.part.shard) for b in self.buckets
        }

    def overlaps(self) -> bool:
        return self.config.overlap_communication  # the send buffers are reduced and freed during backward

    def launch(self, bucket: GradientBucket, earlier: list[tuple[GradientBucket, Work]]) -> Work:
        part = bucket.part
        sent = self._send_buffer(bucket)
        if self.hook is not None:
            received = torch.empty(part.shard, dtype=sent.dtype, device=sent.device)
            self.hook.reduce_scatter(bucket.index, sent, received)
            work = Work()
        else:
            at = self.rank * part.shard
            received = sent[at : at + part.shard]  # in place: no second buffer
            work = self._plans[bucket.index].start(sent, received)  # layouts agree by construction (wrap time)
        bucket.in_flight = (sent, received)
        return work

    def _send_buffer(self, bucket: GradientBucket) -> torch.Tensor:
        """The bucket's gradients, taken out of ``param.grad`` (full gradients live only until their bucket is in its
        send buffer: ZeRO-2's memory), back to back, then its padding, in a new buffer (one multi-tensor copy, C++), in
        the wire dtype. The 1/N of the average is applied to this rank's reduced piece as it is written out
        (:meth:`finished`), 1/N of the elements, not here; only an fp16 wire is scaled first, so that the sum of N
        gradients cannot overflow it.

        Nothing runs per gradient as it arrives (``on_arrival`` is False): the bucket's gradients are taken here, in
        one pass, instead of by a call from autograd's hook for each (docs/results.md#host-time has the two side
        by side)."""
        params = bucket.params
        held = [p.grad for p in params]
        for p in params:
            p.grad = None
        for j in [j for j, grad in enumerate(held) if grad is None]:
            held[j] = torch.zeros_like(params[j])  # unused in this backward (find_unused_parameters): zeros
        sent = torch._utils._flatten_dense_tensors([*held, self._padding[bucket.index]])
        if self.hook is not None:
            return sent
        if self._scale_first:
            sent.mul_(self._inverse_world)
        return sent if sent.dtype == self._wire_dtype else sent.to(self._wire_dtype)

    def finished(self, bucket: GradientBucket) -> None:
        """Write (or add) this rank's piece of the average into its slot of ``owned_grads``."""
        _, received = bucket.in_flight
        part = bucket.part
        piece = self.owned_grads[part.owned_at : part.owned_at + part.shard]
        # The sum becomes the average here (a comm hook averages by itself; an fp16 wire was scaled on arrival).
        scale = 1.0 if self.hook is not None or self._scale_first else self._inverse_world
        if bucket.index in self.stale:  # the first reduce since zero_grad(set_to_none=True): write
            if scale != 1.0 and received.dtype == piece.dtype:
                torch.mul(received, scale, out=piece)
            else:  # a low-precision wire widens exactly, then scales in the piece's precision
                piece.copy_(received)
                if scale != 1.0:
                    piece.mul_(scale)
            self.stale.discard(bucket.index)
        else:  # several synced backward passes before a step add up, as plain gradients do
            piece.add_(received, alpha=scale)
        bucket.in_flight = None

    def owned_gradients(self) -> torch.Tensor:
        for bucket in self.buckets:
            if bucket.index in self.stale:
                part = bucket.part
                self.owned_grads[part.owned_at : part.owned_at + part.shard].zero_()
        self.stale.clear()
        return self.owned_grads

    def zero_grad(self, set_to_none: bool) -> None:
        if set_to_none:
            self.stale = {b.index for b in self.buckets}
        else:
            self.owned_grads.zero_()
            self.stale.clear()
        for bucket in self.buckets:
            for p in bucket.params:
                p.grad = None

    def count_memory(self, mem: dict[str, int]) -> dict[str, int]:
        mem["gradients"] += self.owned_grads.numel() * self.owned_grads.element_size()
        return mem


class ZeRO2Model(DDPModel):
    """ZeRO stage 2, model side: parameters replicated, gradients reduce-scattered bucket by bucket during
    backward, and each rank keeps only its piece of every bucket (1/N of the gradients, ``owned_grads``).

    A bucket's full gradients live only until its reduce-scatter starts; then ``param.grad`` is released.
    Communicates ``(N-1)/N x P`` per step for the gradients (the optimizer's all-gather adds the same again).
    Pair it with :class:`gpudist.ZeRO2Optimizer` built from the same configuration; it steps the owned pieces.
    Its gradient path is :class:`ReduceScatterBuckets` in DDP's :class:`~gpudist.strategies.reducer.Reducer`.

    Args:
        module: The ``nn.Module`` to wrap; every rank must build the same architecture. Its parameters and buffers
            take rank 0's values, and its trainable parameters move into one flat buffer (which the optimizer
            adopts).
        config: The settings shared with the paired optimizer; ``config.backend`` is the data-parallel group.

    Raises:
        TypeError: When ``module`` is not an ``nn.Module`` or is already wrapped, or ``config`` is not a
            :class:`~gpudist.ShardingConfiguration`.
        ValueError: When ranks wrap modules whose parameter names, shapes or dtypes differ, or the trainable
            parameters are not all of one dtype and device.
    """

    strategy = "zero2"
    _collective_type = ReduceScatterBuckets
    _flat_parameters = True
    _aligned_gradients = False

    def initialize_sharding(self) -> None:
        kinds = {(p.dtype, p.device) for p in self.module.parameters() if p.requires_grad}
        if len(kinds) > 1:
            raise ValueError(
                f"ZeRO2Model needs all trainable parameters in one dtype and device, got "
                f"{sorted(str(k) for k in kinds)}; cast the model first (e.g. model.float())"
            )
        super().initialize_sharding()
        self.owned_grads = self._collective.owned_grads

    def owned_segments(self) -> list[tuple[int, int]]:
        """(flat offset, length) of the gradient pieces this rank keeps, ascending (the owned buffer's order).

        Returns:
            ``(offset in the flat parameter order, length)`` per bucket.
        """
        return sorted(b.part.segment for b in self._buckets)

    def owned_gradients(self) -> torch.Tensor:
        """The owned gradient pieces (``owned_grads``), zero where no backward wrote since ``zero_grad``.

        Returns:
            ``owned_grads`` itself (1-D, in :meth:`owned_segments` order), not a copy.
        """
        return self._collective.owned_gradients()

    def memory_per_rank(self) -> dict[str, int]:
        return self._collective.count_memory(ShardedModel.memory_per_rank(self))


class ZeRO1Optimizer(FlatShardOptimizer):
    """ZeRO stage 1: each rank keeps the optimizer state of one contiguous 1/N range of the flat parameters.

    Shards: optimizer state (and the fp32 master copy for low-precision parameters). Communicates: the
    gradients' average (the model's all-reduce, or a reduce-scatter when used with a plain module), then one
    all-gather of the updated parameters: 2(N-1)/N x P per rank on a ring, as DDP. Adam, AdamW and SGD step
    the owned range in one fused kernel launch per parameter group; any other torch optimizer steps views of it.
    Use it when the optimizer state is what does not fit.

    Args:
        optimizer: The ``torch.optim.Optimizer`` whose algorithm and hyper-parameters to use; its trainable
            parameters move into one flat buffer (adopted as it is when the model already put them there).
        config: The configuration the model wrapper (if any) was built from, or that model itself.

    Raises:
        TypeError: When ``optimizer`` is not a ``torch.optim.Optimizer`` (or is already wrapped), or ``config`` is
            neither a ``ShardingConfiguration`` nor a ``ShardedModel``.
        ValueError: When the optimizer has no parameter that requires grad, its trainable parameters differ in
            dtype or device, another rank's parameter groups or shapes differ, or the model passed as ``config``
            does not reduce every trainable parameter.
    """

    strategy = "zero1"

    def _flat_capacity(self, numel: int) -> int:
        return self.comm.world_size * padded_shard(numel, self.comm.world_size)

    def owned_segments(self) -> list[tuple[int, int]]:
        """This rank's padded shard of the flat parameters (:func:`~gpudist.flat.padded_shard`): the same size on
        every rank, so the gradients' reduce-scatter and the parameters' all-gather are even collectives; the
        padding after the last parameter is zeros that no parameter, checkpoint or norm sees."""
        size = padded_shard(self._flat.layout.total, self.comm.world_size)
        return [(self.comm.rank * size, size)]

    def gradient_buffers(self) -> dict[int, BufferSpec]:
        return {0: BufferSpec.of(self._flat_params, "reduce_scatter", size=self._flat.data.numel())}

    def _reduce_scatter_gradients(self) -> None:
        owned = self._private_grad()
        full = torch.empty(self._flat.data.numel(), dtype=owned.dtype, device=owned.device)
        full[self._flat.layout.total :].zero_()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._flat_params]
        if self._comm_hook is not None:
            kernels.pack(grads, full)
            self._comm_hook.reduce_scatter(0, full, owned)
            return
        kernels.pack(grads, full, scale=1.0 / self.comm.world_size)
        self.comm.agreed.reduce_scatter(full, owned, ReductionOperation.SUM, scratch_input=True)

    def _gather_parameters(self) -> None:
        # fp32: the master is this rank's range of the flat buffer itself, which the all-gather sends in place
        flat = self._flat.data
        if self._master_is_view:  # planned once (sizes agree by construction: the layout was checked when built)
            plan = self._gather_plan(("gather",), lambda: self.comm.plan_all_gather(flat.numel(), flat.dtype))
            plan.start(self._master, flat).wait()
            return
        self.comm.agreed.all_gather(self._master.to(flat.dtype), flat)

    def _update_and_gather(self, scale: StepScale) -> None:
        """Fused fp32 path: the flat buffer is one gathered region (:meth:`_update_and_send`)."""
        if not self._overlaps_gather():
            super()._update_and_gather(scale)
            return
        self._update_and_send(scale, [(0, self._flat.data.numel(), 0)])


class ZeRO2Optimizer(FlatShardOptimizer):
    """ZeRO stage 2: each rank keeps 1/N of the gradients and of the optimizer state, as one even piece of every
    gradient bucket, and updates only those pieces.

    With :class:`gpudist.ZeRO2Model` the gradients arrive already reduce-scattered (during backward). With a
    plain module, ``step`` reduce-scatters them bucket by bucket itself. Then it updates the owned pieces in
    one fused launch per parameter group, and all-gathers each bucket's updated parameters:
    ``2 (N-1)/N x P`` per rank per step, as DDP, with (2 + K) P / N less memory for gradients and state.
    The optimizer's parameters must be the model's trainable parameters in the model's order.

    Args:
        optimizer: The ``torch.optim.Optimizer`` whose algorithm and hyper-parameters to use; its trainable
            parameters move into one flat buffer (adopted as it is when the model already put them there).
        config: The configuration the model wrapper (if any) was built from, or that model itself.

    Raises:
        TypeError: When ``optimizer`` is not a ``torch.optim.Optimizer`` (or is already wrapped), or ``config`` is
            neither a ``ShardingConfiguration`` nor a ``ShardedModel``.
        ValueError: When the optimizer has no parameter that requires grad, its trainable parameters differ in
            dtype or device, another rank's parameter groups or shapes differ, or the model passed as ``config``
            does not reduce every trainable parameter.
    """

    strategy = "zero2"

    def owned_segments(self) -> list[tuple[int, int]]:
        self._bucket_pieces = BucketPieces(self)
        return self._bucket_pieces.segments()

    def _owned_size(self) -> int:
        return self._bucket_pieces.owned_size()

    def _segment_spans(self):
        return self._bucket_pieces.spans()

    def reduce_gradients(self) -> None:
        """Fill the owned gradient buffer: the paired ZeRO2Model's reduce-scattered pieces (stepped in place), or,
        with a plain module, reduce-scatter the gradients here.

        Raises:
            ValueError: When the paired model is not a ``ZeRO2Model`` whose trainable parameters are this
                optimizer's, in the model's ``parameters()`` order.
        """
        self._bucket_pieces.reduce_gradients(self)

    def gradient_buffers(self) -> dict[int, BufferSpec]:
        return self._bucket_pieces.gradient_buffers(self)

    def _reduce_scatter_gradients(self) -> None:
        self._bucket_pieces.reduce_scatter(self)

    def _gather_parameters(self) -> None:
        self._bucket_pieces.gather(self)

    def _update_and_gather(self, scale: StepScale) -> None:
        """Fused fp32 path: each bucket is a gathered region (:meth:`_update_and_send`), in launch order."""
        if not self._overlaps_gather():
            super()._update_and_gather(scale)
            return
        self._update_and_send(scale, self._bucket_pieces.regions())


class BucketPieces:
    """ZeRO-2's ownership: one even piece of every gradient bucket (:func:`partition_buckets`), so that a bucket's
    reduce-scatter lands exactly on what this rank updates, and its all-gather sends exactly that back.

    The part of a :class:`~gpudist.strategies.flat_optimizer.FlatShardOptimizer` that :class:`ZeRO2Optimizer` (always)
    and :class:`gpudist.ZeRO3Optimizer` (over parameters no ZeRO-3 wrapper shards) hand their ownership hooks to. It
    uses only the base's documented protected interface, on the optimizer each verb is given.

    Args:
        optimizer: The optimizer whose trainable parameters it partitions (from its ``owned_segments``).
    """

    def __init__(self, optimizer: FlatShardOptimizer):
        config, comm = optimizer.config, optimizer.comm
        self.parts = partition_buckets(
            optimizer._flat_params,
            config.bucket_cap_bytes(),
            config.bucket_cap_bytes(first=True),
            comm.world_size,
            comm.rank,
        )

    def segments(self) -> list[tuple[int, int]]:
        """The owned pieces as ``(flat offset, length)``, ascending."""
        return sorted(part.segment for part in self.parts)

    def owned_size(self) -> int:
        """Elements of the owned buffer: a padded slot per bucket."""
        return sum(part.shard for part in self.parts)

    def spans(self):
        """Each bucket's owned piece at the start of its padded slot (``BucketPartition.owned_at``)."""
        for part in sorted(self.parts, key=lambda part: part.flat_offset):
            start, length = part.segment
            yield start, length, part.owned_at

    def regions(self) -> list[tuple[int, int, int]]:
        """The buckets as the regions ``_update_and_send`` gathers: ``(flat offset, numel, owned offset)``."""
        return [(part.flat_offset, part.numel, part.owned_at) for part in self.parts]

    def reduce_gradients(self, optimizer: FlatShardOptimizer) -> None:
        """The owned gradient: the paired ZeRO2Model's reduce-scattered pieces, or reduce-scattered here (a plain
        module)."""
        model = optimizer.model()
        if model is None:
            self.reduce_scatter(optimizer)
            return
        owned = getattr(model, "owned_grads", None)
        if owned is None or [id(p) for p in model._params] != [id(p) for p in optimizer._flat_params]:
            raise ValueError(
                "ZeRO2Optimizer pairs with a ZeRO2Model whose trainable parameters are the optimizer's, in the "
                f"model's parameters() order; got {type(model).__name__} with a different parameter list/order"
            )
        optimizer._grad = model.owned_gradients()  # the model's reduce-scattered pieces, same order: stepped in place

    def gradient_buffers(self, optimizer: FlatShardOptimizer) -> dict[int, BufferSpec]:
        """Each bucket as the buffer the plain-module path reduce-scatters."""
        world = optimizer.comm.world_size
        return {
            i: BufferSpec.of(
                optimizer._flat_params,
                "reduce_scatter",
                part.flat_offset,
                part.flat_offset + part.numel,
                world * part.shard,
            )
            for i, part in enumerate(self.parts)
        }

    def reduce_scatter(self, optimizer: FlatShardOptimizer) -> None:
        """Reduce-scatter every bucket's gradients into the owned pieces (a plain module: nothing did it)."""
        comm, hook, owned = optimizer.comm, optimizer._comm_hook, optimizer._private_grad()
        for i, part in enumerate(self.parts):
            views = optimizer._grad_views_for(part.flat_offset, part.numel)
            sent = torch.empty(comm.world_size * part.shard, dtype=owned.dtype, device=owned.device)
            sent[part.numel :].zero_()
            out = owned[part.owned_at : part.owned_at + part.shard]
            kernels.pack(views, sent, scale=1.0 if hook is not None else 1.0 / comm.world_size)
            if hook is not None:
                hook.reduce_scatter(i, sent, out)
            else:
                comm.agreed.reduce_scatter(sent, out, ReductionOperation.SUM, scratch_input=True)

    def gather(self, optimizer: FlatShardOptimizer) -> None:
        """All-gather every bucket's updated pieces into the flat parameters on every rank (planned once)."""
        optimizer._gather_plan(("bucket pieces",), lambda: self._gather_schedule(optimizer))()

    def _gather_schedule(self, optimizer: FlatShardOptimizer):
        """The gather, decided once for the buffers it is given (sizes agree by construction: the layout was checked
        across ranks when built). An even bucket's range of this rank first holds its updated values (the master
        itself for fp32 parameters, else a cast copy of it) and is all-gathered in place; every even bucket goes in
        one coalesced group (NCCL: one hand-off of the streams and one event, not one per bucket). A padded bucket
        (its shards rounded up to 16 elements overrun its range) goes after them, one at a time, through buffers
        made for it and freed after it (held all at once they would be another copy of the parameters), as one
        all-gather each rather than a broadcast per rank."""
        comm, flat = optimizer.comm, optimizer._flat.data
        dtype, world, rank = flat.dtype, comm.world_size, comm.rank
        in_place, casts, staged = [], [], []
        for part in self.parts:
            region = flat[part.flat_offset : part.flat_offset + part.numel]
            piece = optimizer._master_of(part.owned_at, part.owned_at + part.owned_numel)
            plan = comm.plan_all_gather(world * part.shard, dtype)
            if part.numel != world * part.shard:
                staged.append((part, region, piece, plan))
                continue
            mine = region[rank * part.shard : (rank + 1) * part.shard]
            if not optimizer._master_is_view:
                casts.append((mine, piece))
            in_place.append((plan, (mine, region)))
        group = comm.plan_coalesced(in_place) if in_place else None

        def run() -> None:
            for mine, piece in casts:
                mine.copy_(piece)
            if group is not None:
                group.start().wait()
            for part, region, piece, plan in staged:
                src = torch.zeros(part.shard, dtype=dtype, device=region.device)
                src[: part.owned_numel].copy_(piece)
                out = torch.empty(world * part.shard, dtype=dtype, device=region.device)
                plan.start(src, out).wait()
                region.copy_(out[: part.numel])

        return run


def data_parallel_optimizer(zero_stage: int) -> type[ShardedOptimizer]:
    """The data-parallel optimizer class for ``zero_stage`` (0: DDP, replicated state; 1: ZeRO-1; 2: ZeRO-2), as
    the strategies that run data parallelism inside them (hybrid, elastic) take it."""
    classes = {0: DDPOptimizer, 1: ZeRO1Optimizer, 2: ZeRO2Optimizer}
    if isinstance(zero_stage, bool) or zero_stage not in classes:
        raise ValueError(f"zero_stage={zero_stage!r}; use 0 (replicated state), 1 (ZeRO-1) or 2 (ZeRO-2)")
    return classes[zero_stage]
