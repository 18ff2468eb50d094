"""DDP: replicated parameters and optimizer state; gradients averaged over ranks.

:class:`DDPModel` averages gradients in buckets while backward is still running (the overlap torch DDP gives);
:class:`DDPOptimizer` steps the replicated state, and averages the gradients itself when the module is not
wrapped (one all-reduce per bucket after backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .. import kernels
from ..comm import ReductionOperation, Work
from ..flat import (
    BufferSpec,
    FlatBuffer,
    FlatLayout,
    GradientBucket,
    assign_buckets,
    broadcast_tensors,
    flatten_parameters,
)
from .model import ShardedModel
from .optimizer import ShardedOptimizer

__all__ = ["DDPModel", "DDPOptimizer"]


class DDPModel(ShardedModel):
    """Distributed data parallel: every rank holds the whole model and trains on its slice of the batch.

    Shards: nothing. Communicates: one all-reduce (average) of the gradients per step, ``2 (N-1)/N x P``
    bytes per rank on a ring, in buckets of ``config.bucket_cap_mb`` launched during backward as soon as
    each bucket's gradients are ready (the last layers' first), so communication overlaps the rest of
    backward. ``param.grad`` are views into the flat buckets (no copy); ``no_sync()`` accumulates locally.
    Use it when the model, its gradients and its optimizer state fit on one device.

    Args:
        module: The ``nn.Module`` to wrap; every rank must build the same architecture. Its parameters and buffers
            take rank 0's values.
        config: The settings shared with the paired optimizer (bucket sizes, ``communication_dtype``, overlap,
            ...); ``config.backend`` is the data-parallel group.

    Raises:
        TypeError: When ``module`` is not an ``nn.Module`` or is already wrapped, or ``config`` is not a
            :class:`~gpudist.ShardingConfiguration`.
        ValueError: When ranks wrap modules whose parameter names, shapes or dtypes differ.
    """

    strategy = "ddp"

    def initialize_sharding(self) -> None:
        module, comm, config = self.module, self.comm, self.config
        self._check_same_model()
        trainable = [p for p in module.parameters() if p.requires_grad]
        capacity = self._flat_capacity(sum(p.numel() for p in trainable))
        if self._flat_parameters:  # ZeRO-1/2: one buffer, which their optimizer adopts instead of packing a copy
            flatten_parameters(trainable, capacity)
        broadcast_tensors(comm, trainable)  # rank 0's values; one buffer's views go straight into it
        moved = set(map(id, trainable))
        broadcast_tensors(comm, [t for t in (*module.parameters(), *module.buffers()) if id(t) not in moved])
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._params = [p for _, p in named]
        self._param_ids = {id(p) for p in self._params}
        groups = assign_buckets(self._params, config.bucket_cap_bytes(), config.bucket_cap_bytes(first=True))
        self._buckets: list[GradientBucket] = []
        self._slot: dict[int, tuple[GradientBucket, int]] = {}
        # With gradient views and one dtype/device, the buckets are slices of one gradient buffer in parameter
        # order, so any range of the flat gradients is a view (ZeRO-1 steps its range of it with no copy).
        kinds = {(p.dtype, p.device) for p in self._params}
        self.flat_grads = None
        if self._views and len(kinds) == 1:
            numel = sum(p.numel() for p in self._params)
            self.flat_grads = torch.zeros(
                max(numel, capacity), dtype=self._params[0].dtype, device=self._params[0].device
            )
        starts = [0]
        for p in self._params:
            starts.append(starts[-1] + p.numel())
        for b, indices in enumerate(groups):
            indices = sorted(indices)  # parameter order inside a bucket: its gradients are one range of the flat order
            storage = None
            if self.flat_grads is not None:
                storage = self.flat_grads[starts[indices[0]] : starts[indices[-1] + 1]]
            bucket = self._make_bucket(b, [self._params[i] for i in indices], [named[i][0] for i in indices], storage)
            self._buckets.append(bucket)
            for j, p in enumerate(bucket.params):
                self._slot[id(p)] = (bucket, j)
        self._sync = True
        self._next_bucket = 0
        self._pending: list[tuple[GradientBucket, object]] = []
        self._callback_queued = False
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._params]

    _flat_parameters = False
    """Whether the trainable parameters move into one flat buffer at wrap time (ZeRO-1/2: their optimizer adopts it
    instead of allocating and packing a second copy of the model). DDP keeps torch's parameters as they are."""

    def _flat_capacity(self, numel: int) -> int:
        """Elements the flat parameter and gradient buffers hold (``numel`` and the padding after it): ZeRO-1 pads
        them to whole even shards (:func:`gpudist.flat.padded_shard`), so its optimizer's range is a view of both."""
        return 0

    @property
    def _views(self) -> bool:
        """Whether ``param.grad`` are views into persistent bucket buffers."""
        return self.config.gradient_as_bucket_view

    def _make_bucket(
        self, index: int, params: list[torch.nn.Parameter], names: list[str], storage: torch.Tensor | None = None
    ) -> GradientBucket:
        grads = FlatBuffer.empty_like(params) if storage is None else FlatBuffer(FlatLayout.of(params), storage)
        wire_dtype = self.config.communication_dtype or grads.data.dtype
        wire = grads.data if wire_dtype == grads.data.dtype else torch.empty_like(grads.data, dtype=wire_dtype)
        if self._views:
            for p, view in zip(params, grads.views(), strict=True):
                p.grad = view
        return GradientBucket(index, params, names, grads, wire)

    def manages(self, param: torch.Tensor) -> bool:
        return id(param) in self._param_ids

    # -- communication hook ---------------------------------------------------------------------------------------

    _hook_op = "all_reduce"
    """The collective a comm hook replaces for each bucket (ZeRO-2: ``"reduce_scatter"``)."""

    def gradient_buffers(self) -> dict[int, BufferSpec]:
        """What each bucket communicates, by bucket index (for a communication hook and its checkpoints).

        Returns:
            Bucket index -> its :class:`~gpudist.flat.BufferSpec` (size, collective, parameter spans).
        """
        return {b.index: BufferSpec.of(b.params, self._hook_op) for b in self._buckets}

    def register_comm_hook(self, hook) -> None:
        """Route every bucket through the hook instead of the plain collective: ``hook.all_reduce(bucket_index,
        flat_grads)`` must average the bucket over ranks in place (ZeRO-2: ``hook.reduce_scatter(bucket_index,
        flat_grads, out)`` puts this rank's piece of the average, per :func:`gpudist.comm.split_sizes`, in ``out``).
        :class:`gpudist.GradientCompressionOptimizer` installs one. The hook runs when the bucket is ready, in bucket
        order on every rank, and replaces the ``communication_dtype`` cast too: the hook decides what travels.

        Args:
            hook: An object with the ``all_reduce`` (ZeRO-2: ``reduce_scatter``) method described above.

        Raises:
            TypeError: When ``hook`` lacks that method.
            ValueError: When another hook is already registered.
        """
        if not callable(getattr(hook, self._hook_op, None)):
            raise TypeError(
                f"a {type(self).__name__} comm hook needs a {self._hook_op}(bucket_index, ...) method, "
                f"got {type(hook).__name__}"
            )
        if self._comm_hook is not None and hook is not self._comm_hook:
            raise ValueError(
                f"{type(self).__name__} already has a comm hook ({type(self._comm_hook).__name__}); "
                "build one optimizer that communicates per model"
            )
        self._comm_hook = hook

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside the block only accumulate locally; the first backward
        after it reduces the accumulated sum (as torch DDP's ``no_sync``)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def forward(self, *args, **kwargs):
        if self._pending or self._callback_queued:  # a previous backward failed half way: start clean
            self._reset_step()
        # Buffers (e.g. BatchNorm statistics) follow rank 0 in training only, as torch DDP: predict() and
        # evaluation on a single rank must not start a collective.
        if self.config.broadcast_buffers and self.world_size > 1 and self.training and torch.is_grad_enabled():
            buffers = list(self.module.buffers())
            if buffers:
                with self.comm.unchecked():  # same model on every rank, checked at wrap time
                    broadcast_tensors(self.comm, buffers)
        return self.module(*args, **kwargs)

    # -- gradient hooks ---------------------------------------------------------------------------------------------

    def _view(self, bucket: GradientBucket, j: int) -> torch.Tensor:
        return bucket.grads.views()[j]

    def _ready_scale(self, bucket: GradientBucket) -> float | None:
        """The 1/N of the average, applied to a gradient as it reaches its bucket view (folded into the copy when
        there is one), or None: no views (the pack scales), a comm hook (it averages), a low-precision wire (the
        cast scales), the transport averages for free (ncclAvg), or one rank."""
        n = self.world_size
        if not self._views or self._comm_hook is not None or bucket.wire is not bucket.grads.data or n == 1:
            return None
        return None if self.comm.averages_in_transport else 1.0 / n

    def _into_bucket(self, bucket: GradientBucket, j: int, param: torch.Tensor) -> None:
        """Views: make ``param.grad`` its bucket view, holding the gradient (times the ready scale, if any)."""
        view, scale = self._view(bucket, j), self._ready_scale(bucket)
        if param.grad is None:
            view.zero_()
        elif param.grad is not view and param.grad.data_ptr() != view.data_ptr():
            # zero_grad(set_to_none=True) dropped the view: autograd made a new tensor. Copy it in, scaled in the
            # same pass (as torch DDP's mul_out into its bucket).
            if scale is None:
                view.copy_(param.grad)
            else:
                torch.mul(param.grad, scale, out=view)
            param.grad = view
            return
        elif scale is not None:
            view.mul_(scale)  # accumulated in place (zero_grad(set_to_none=False), no_sync): one scaling pass
        param.grad = view

    def _arrived(self, bucket: GradientBucket, j: int, param: torch.Tensor) -> None:
        """``param``'s gradient (bucket slot ``j``) is complete for this backward: views put it in the bucket now."""
        if self._views:
            self._into_bucket(bucket, j, param)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._sync:
            return
        bucket, j = self._slot[id(param)]
        self._arrived(bucket, j, param)
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        bucket.ready.add(j)
        if self.config.overlap_communication:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        # Buckets start strictly in index order on every rank, whatever order their gradients arrive in, so
        # all ranks issue the same collectives in the same sequence.
        while self._next_bucket < len(self._buckets):
            bucket = self._buckets[self._next_bucket]
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)
            self._next_bucket += 1

    def _launch(self, bucket: GradientBucket) -> None:
        n = self.world_size
        hooked, lowp = self._comm_hook is not None, bucket.wire is not bucket.grads.data
        # The 1/N of the average rides on a pass the bucket makes anyway (the pack into the bucket, the copy of a
        # fresh gradient into its view, the cast to a low-precision wire), and the wire is SUMmed: no backend pays a
        # separate scaling pass. Only views on a transport that averages for free (ncclAvg) ask for AVERAGE. A comm
        # hook averages by itself.
        if not self._views:
            kernels.pack(self._grads_of(bucket), bucket.grads.data, scale=1.0 if hooked or lowp else 1.0 / n)
        if hooked:  # synchronous: a compressed all-reduce is several dependent collectives
            self._comm_hook.all_reduce(bucket.index, bucket.grads.data)
            self._pending.append((bucket, Work()))
            return
        if lowp:
            kernels.pack([bucket.grads.data], bucket.wire, scale=1.0 / n)
        scaled_on_arrival = not self._views or lowp or self._ready_scale(bucket) is not None or n == 1
        op = ReductionOperation.SUM if scaled_on_arrival else ReductionOperation.AVERAGE
        with self.comm.unchecked():  # bucket layouts agree by construction (same fingerprint at wrap time)
            work = self.comm.all_reduce(bucket.wire, op, async_op=True)
        self._pending.append((bucket, work))

    def _after_reduce(self, bucket: GradientBucket) -> None:
        """Runs once the bucket's collective completed: put the result where the gradients live."""
        if bucket.wire is not bucket.grads.data and self._comm_hook is None:
            bucket.grads.data.copy_(bucket.wire)
        if not self._views:
            kernels.unpack(bucket.grads.data, self._grads_of(bucket))

    def _finish_backward(self) -> None:
        """Runs once at the end of backward (autograd callback): reduce what is left, wait, write gradients back."""
        self._callback_queued = False
        try:
            self._complete_unused()
            self._launch_ready_buckets()
            for bucket, work in self._pending:
                work.wait()
                self._after_reduce(bucket)
        finally:
            self._reset_step()
        self._mark_step_bytes()

    def _grads_of(self, bucket: GradientBucket) -> list[torch.Tensor]:
        for p in bucket.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in bucket.params]

    def _complete_unused(self) -> None:
        missing = [(b, j) for b in self._buckets for j in range(len(b.params)) if j not in b.ready]
        if not missing:
            return
        if not self.config.find_unused_parameters:
            names = [b.names[j] for b, j in missing]
            raise RuntimeError(
                f"DDPModel: {len(names)} parameter(s) got no gradient in this backward ({', '.join(names[:5])}"
                f"{', ...' if len(names) > 5 else ''}), so their buckets could not be reduced; pass "
                "ShardingConfiguration(find_unused_parameters=True), or set requires_grad=False on parameters "
                "that are never used"
            )
        for bucket, j in missing:  # unused here: contribute zeros (other ranks may have used them)
            param = bucket.params[j]
            if self._views:
                view = self._view(bucket, j)
                if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                    view.zero_()  # stale since zero_grad(set_to_none=True); no_sync sums in a live view are kept
                    param.grad = view
            else:  # DDP's _launch packs a missing gradient as zeros; ZeRO-2 writes its send-buffer slot now
                self._arrived(bucket, j, param)
            bucket.ready.add(j)

    def _reset_step(self) -> None:
        for bucket in self._buckets:
            bucket.ready.clear()
        self._pending = []
        self._next_bucket = 0
        self._callback_queued = False

    def synchronize_gradients(self) -> None:
        """Average every gradient now. Backward already does it; this is for gradients produced outside a
        synced backward (e.g. after the last ``no_sync`` micro-batch without a final synced one)."""
        for p in self._params:
            bucket, j = self._slot[id(p)]
            if self._views:
                self._into_bucket(bucket, j, p)
            bucket.ready.add(j)
        self._launch_ready_buckets()
        self._finish_backward()

    def zero_grad_buckets(self, set_to_none: bool = True) -> None:
        """Clear the gradients. ``set_to_none`` (torch's default) drops ``param.grad`` and leaves the buckets as they
        are: the next backward copies each fresh gradient into its bucket view (no zeroing pass over P, about 12 ms
        per step at 20M parameters on the benchmark VM). ``set_to_none=False`` zeroes the buckets in place and keeps
        ``param.grad`` as views into them.

        Args:
            set_to_none: Drop ``param.grad`` (True) or zero the buckets in place (False), as described above.
        """
        for bucket in self._buckets:
            if set_to_none:
                for p in bucket.params:
                    p.grad = None
                continue
            bucket.grads.data.zero_()
            if self._views:
                for p, view in zip(bucket.params, bucket.grads.views(), strict=True):
                    p.grad = view
            else:
                for p in bucket.params:
                    if p.grad is not None:
                        p.grad.zero_()

    def bucket_sizes(self) -> list[int]:
        """Bytes on the wire per bucket, in launch order (for tests and reports).

        Returns:
            One byte count per bucket.
        """
        return [b.nbytes for b in self._buckets]

    def memory_per_rank(self) -> dict[str, int]:
        mem = super().memory_per_rank()
        wires = sum(b.wire.numel() * b.wire.element_size() for b in self._buckets if b.wire is not b.grads.data)
        buckets = sum(b.grads.data.numel() * b.grads.data.element_size() for b in self._buckets)
        mem["gradients"] = buckets if self._views else mem["gradients"] + buckets
        mem["communication_buffers"] = wires
        return mem

    def extra_repr(self) -> str:
        return f"world_size={self.world_size}, buckets={len(self._buckets)}"


class DDPOptimizer(ShardedOptimizer):
    """Data-parallel optimizer: every rank holds the full optimizer state and applies the same update.

    With a ``DDPModel`` built from the same config, gradients arrive already averaged (the model reduced
    them during backward) and ``step`` only waits for that. With a plain module, ``step`` averages the
    gradients itself first: flattened into ``bucket_cap_mb`` buckets (one all-reduce each, 2(N-1)/N x P
    bytes per rank in all). Parameters that got no gradient on a rank count as zeros, so ranks always agree.

    Args:
        optimizer: The ``torch.optim.Optimizer`` to wrap; its ``param_groups`` and ``state`` are shared.
        config: The configuration the ``DDPModel`` (if any) was built from, or that model itself.

    Raises:
        TypeError: When ``optimizer`` is not a ``torch.optim.Optimizer`` (or is already wrapped), or ``config`` is
            neither a ``ShardingConfiguration`` nor a ``ShardedModel``.
        ValueError: When the model passed as ``config`` does not reduce every trainable parameter of
            ``optimizer``.
    """

    def reduce_gradients(self) -> None:
        model = self.model()
        if model is not None:
            return  # DDPModel averaged these gradients in its backward hooks; never reduce twice
        params = [p for p in self._params() if p.requires_grad]
        if self.comm.world_size == 1 or not params:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        cap = self.config.bucket_cap_bytes()
        wire_dtype = self.config.communication_dtype
        with torch.no_grad():
            for indices in assign_buckets(grads, cap, cap):
                group = [grads[i] for i in indices]
                flat = FlatBuffer.empty_like(group, dtype=wire_dtype or group[0].dtype, zero=False)
                kernels.pack(group, flat.data, scale=1.0 / self.comm.world_size)
                self.comm.all_reduce(flat.data, ReductionOperation.SUM)
                kernels.unpack(flat.data, group)
