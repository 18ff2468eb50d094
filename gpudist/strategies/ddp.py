"""DDP: replicated parameters and optimizer state; gradients averaged over ranks.

:class:`DDPModel` averages gradients in buckets while backward is still running (the overlap torch DDP gives): its
:class:`~gpudist.strategies.reducer.Reducer` launches the buckets as they fill, and :class:`AllReduceBuckets` is what
each bucket goes through (gradient views or pack/unpack, the wire cast, a comm hook, the hierarchical all-reduce).
ZeRO-1's model is DDP's with its parameters in one padded buffer; ZeRO-2's swaps the collective for
``ReduceScatterBuckets`` (zero.py). :class:`DDPOptimizer` steps the replicated state, and averages the gradients
itself when the module is not wrapped (one all-reduce per bucket after backward).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator

import torch
from torch import nn

from .. import kernels
from ..comm import CommunicationBackend, ReductionOperation, Work, shard_range
from ..compression import PowerSGDCompressor
from ..flat import (
    BufferSpec,
    FlatBuffer,
    FlatLayout,
    GradientBucket,
    assign_buckets,
    broadcast_tensors,
    flatten_parameters,
    padded_shard,
    vector_align,
)
from ..topology import Topology
from .model import ShardedModel
from .optimizer import ShardedOptimizer
from .reducer import BucketCollective, Reducer

__all__ = ["AllReduceBuckets", "DDPModel", "DDPOptimizer", "bucket_groups"]


def bucket_groups(params: list[torch.nn.Parameter], config) -> list[list[int]]:
    """:func:`~gpudist.flat.assign_buckets` with the configuration's caps, each bucket's indices in parameter order
    (its gradients are then one range of the flat order)."""
    groups = assign_buckets(params, config.bucket_cap_bytes(), config.bucket_cap_bytes(first=True))
    return [sorted(indices) for indices in groups]


class AllReduceBuckets(BucketCollective):
    """DDP's and ZeRO-1's gradient path: every bucket all-reduced (averaged) over the ranks, flat, hierarchical
    (reduce-scatter inside the node, all-reduce across nodes, all-gather inside the node) or through a comm hook;
    ``param.grad`` are views into the buckets when ``config.gradient_as_bucket_view`` (else packed into them at the
    bucket's launch and unpacked back at the end of backward).

    Args:
        comm: The data-parallel group.
        config: The model's configuration (bucket caps, wire dtype, gradient views, overlap).
        named: ``(name, parameter)`` of the trainable parameters, in the module's order.
        capacity: Elements of the flat gradient buffer (its padding after the gradients), or 0.
        topology: The node layout of a hierarchical all-reduce, or None (flat).
    """

    hook_op = "all_reduce"
    """The collective a comm hook replaces for each bucket."""

    def __init__(
        self, comm, config, named, *, capacity: int = 0, topology: Topology | None = None, aligned: bool = False
    ):
        self.comm, self.config, self.topology = comm, config, topology
        self.world_size = comm.world_size
        self.views = config.gradient_as_bucket_view
        self.hook = None
        self.aligned = aligned
        params = [p for _, p in named]
        # With gradient views and one dtype/device, the buckets are slices of one gradient buffer in parameter
        # order, so any range of the flat gradients is a view (ZeRO-1 steps its range of it with no copy).
        self.flat_grads = None
        if self.views and len({(p.dtype, p.device) for p in params}) == 1:
            layout = FlatLayout.of(params, self._align(params[0].dtype))
            self.flat_grads = torch.zeros(max(layout.total, capacity), dtype=params[0].dtype, device=params[0].device)
        self.buckets = []
        for b, indices in enumerate(bucket_groups(params, config)):
            storage = None
            if self.flat_grads is not None:
                first, last = layout.offsets[indices[0]], layout.offsets[indices[-1]] + layout.numels[indices[-1]]
                storage = self.flat_grads[first:last]  # tensor starts are aligned: its layout is the same in it
            self.buckets.append(self._bucket(b, [params[i] for i in indices], [named[i][0] for i in indices], storage))
        self._pieces: dict[int, torch.Tensor] = {}
        self.plan()

    def _align(self, dtype: torch.dtype) -> int:
        """Elements every gradient starts at a multiple of in its bucket: a 16-byte vector's (``aligned``: DDP, whose
        buckets only it reads) or 1 (ZeRO-1: its buckets view the optimizer's flat order, back to back)."""
        return vector_align(dtype) if self.aligned else 1

    def _bucket(self, index: int, params: list, names: list[str], storage: torch.Tensor | None) -> GradientBucket:
        align = self._align(params[0].dtype)
        if storage is None:
            grads = FlatBuffer.empty_like(params, align=align)
        else:
            grads = FlatBuffer(FlatLayout.of(params, align), storage)
        wire_dtype = self.config.communication_dtype or grads.data.dtype
        wire = grads.data if wire_dtype == grads.data.dtype else torch.empty_like(grads.data, dtype=wire_dtype)
        bucket = GradientBucket(index, params, names, grads, wire)
        bucket.batched_copy = self.views and grads.data.device.type in _BATCHED_COPY_DEVICES
        if self.views:
            bucket.views = grads.views()
            for p, view in zip(params, bucket.views, strict=True):
                p.grad = view
        return bucket

    def use_hook(self, hook) -> None:
        """Route every bucket through ``hook`` from now on (checked by :meth:`DDPModel.register_comm_hook`)."""
        self.hook = hook
        self.plan()

    def plan(self) -> None:
        """Decide, per bucket, what a gradient is multiplied by as it reaches its view (:meth:`_arrival_scale`) and
        plan its all-reduce (checked now, issued every step with no per-call checks): once when the buckets are built
        and again when a comm hook is registered, not per gradient or per step."""
        flat = self.topology is None and self.hook is None
        for bucket in self.buckets:
            bucket.arrival_scale = self._arrival_scale(bucket)
            # Views whose fresh gradients are copied at the launch, unscaled: nothing to do per gradient (the launch
            # finds them all, _absorb). Without views the launch packs param.grad itself.
            bucket.on_arrival = self.views and not (bucket.batched_copy and bucket.arrival_scale is None)
            bucket.reduce = self.comm.plan_all_reduce(bucket.wire, self._reduction(bucket)) if flat else None

    def _reduction(self, bucket: GradientBucket) -> ReductionOperation:
        """SUM when the 1/N of the average rode on a pass the bucket made anyway (the pack into it, the copy of a
        fresh gradient into its view, the cast to a low-precision wire); AVERAGE for views otherwise: on a transport
        that averages for free (ncclAvg), and for a bucket of small tensors (:data:`_SCALED_COPY_MIN_NUMEL`)."""
        lowp = bucket.wire is not bucket.grads.data
        scaled = not self.views or lowp or bucket.arrival_scale is not None or self.world_size == 1
        return ReductionOperation.SUM if scaled else ReductionOperation.AVERAGE

    def _arrival_scale(self, bucket: GradientBucket) -> float | None:
        """The 1/N of the average, applied to a gradient as it reaches its bucket view (folded into the copy when
        there is one), or None: no views (the pack scales), a comm hook (it averages), a low-precision wire (the
        cast scales), the transport averages for free (ncclAvg), one rank, or a bucket of small tensors (the
        transport's AVERAGE divides it instead: see :data:`_SCALED_COPY_MIN_NUMEL`)."""
        n = self.world_size
        if not self.views or self.hook is not None or bucket.wire is not bucket.grads.data or n == 1:
            return None
        if self.comm.averages_in_transport or bucket.grads.data.numel() < _SCALED_COPY_MIN_NUMEL * len(bucket.params):
            return None
        return 1.0 / n

    def buffer_specs(self) -> dict[int, BufferSpec]:
        if self.topology is None:
            return {b.index: BufferSpec.of(b.params, self.hook_op, align=b.grads.layout.align) for b in self.buckets}
        intra = self.topology.intra
        return {
            b.index: BufferSpec.of(
                b.params,
                self.hook_op,
                *shard_range(b.grads.data.numel(), intra.world_size, intra.rank),
                align=b.grads.layout.align,
            )
            for b in self.buckets
        }

    def overlaps(self) -> bool:
        """Whether this backward launches buckets as they fill: ``config.overlap_communication``, except on Gloo's
        shared-memory transport, flat and without a comm hook, where they start at the end of backward. There the
        all-reduce is this process's own copying and adding on a worker thread (not a NIC's or the kernel's), so
        overlapping it with backward only makes the two share the cores. Measured on the loaded 2-core machine (2
        ranks, ``benchmarks/ddp.py``, 10 rounds), CPU time per step against torch DDP at its best: overlapped 1.01x
        (MLP) and 0.97x (GPT), at the end 1.12x and 1.06x."""
        at_end = self.topology is None and self.hook is None and self.comm.shared_memory
        return self.config.overlap_communication and not at_end

    # -- the gradient path ------------------------------------------------------------------------------------------

    def arrived(self, bucket: GradientBucket, j: int, param: torch.Tensor) -> None:
        """Views: make ``param.grad`` its bucket view, holding the gradient (times the arrival scale, if any).

        On the hot path of every backward (once per parameter, inside autograd's engine), so it reads ``param.grad``
        once and decides nothing that was decided when the buckets were built."""
        view, scale, grad = bucket.views[j], bucket.arrival_scale, param.grad
        if grad is view:  # accumulated in place (zero_grad(set_to_none=False), no_sync)
            if scale is not None:
                view.mul_(scale)  # one scaling pass
            return
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            # zero_grad(set_to_none=True) dropped the view: autograd made a new tensor. Copy it in, scaled in the same
            # pass (as torch DDP's mul_out into its bucket). (Unscaled ones on a batched-copy device never come here:
            # their bucket's launch copies them all at once, _absorb; see on_arrival in plan.)
            if scale is not None:
                torch.mul(grad, scale, out=view)
            else:
                view.copy_(grad)
        elif scale is not None:
            view.mul_(scale)  # the view's storage under another tensor object: accumulated in place
        param.grad = view

    def missing(self, bucket: GradientBucket, j: int, param: torch.Tensor) -> None:
        if not self.views:
            return  # the launch packs a missing gradient as zeros
        view = bucket.views[j]
        if param.grad is None or param.grad.data_ptr() != view.data_ptr():
            view.zero_()  # stale since zero_grad(set_to_none=True); no_sync sums in a live view are kept
            param.grad = view

    def _absorb(self, bucket: GradientBucket) -> None:
        """Copy the bucket's fresh gradients into their views in one multi-tensor copy, and make each ``param.grad``
        its view again. Fresh: every ``param.grad`` that is not its view object, found here in one pass over the
        bucket (a list comprehension, where a call per gradient from autograd cost a function call each); a gradient
        that is its view's storage under another tensor object is copied onto itself, harmlessly. Nothing is kept
        between gradients and launch, so a backward that failed half way leaves nothing to reset: its gradients stay
        in ``param.grad`` and the next launch finds them."""
        params, views = bucket.params, bucket.views
        fresh = [j for j, p in enumerate(params) if p.grad is not views[j]]
        if fresh:
            torch._foreach_copy_([views[j] for j in fresh], [params[j].grad for j in fresh])
            for j in fresh:
                params[j].grad = views[j]

    def launch(self, bucket: GradientBucket, earlier: list[tuple[GradientBucket, Work]]) -> Work:
        n = self.world_size
        hooked, lowp = self.hook is not None, bucket.wire is not bucket.grads.data
        # The 1/N of the average rides on a pass the bucket makes anyway (the pack into the bucket, the copy of a
        # fresh gradient into its view, the cast to a low-precision wire) and the wire is SUMmed, or the transport
        # averages (_reduction says which, per bucket). A comm hook averages by itself.
        if not self.views:
            grads, data, scale = self._grads_of(bucket), bucket.grads.data, 1.0 if hooked or lowp else 1.0 / n
            kernels.pack(grads, data, scale=scale, layout=bucket.grads.layout)  # the bucket's (aligned) layout
        elif bucket.batched_copy:
            self._absorb(bucket)
        if hooked and self.topology is not None:
            return self._hooked_hierarchical_all_reduce(bucket)
        if hooked:  # synchronous: a compressed all-reduce is several dependent collectives
            self.hook.all_reduce(bucket.index, bucket.grads.data)
            return Work()
        if lowp:
            kernels.pack([bucket.grads.data], bucket.wire, scale=1.0 / n)
        if bucket.reduce is not None:  # planned when the buckets were built (layouts agree by construction)
            return bucket.reduce.start()
        # Hierarchical: start the cross-node all-reduce of each earlier bucket whose reduce-scatter finished, in bucket
        # order (a group's collectives must be issued in the same order on every rank, whatever finishes first); the
        # all-gathers inside the node wait for the end of backward, after every bucket's reduce-scatter was issued.
        for _, work in earlier:
            if isinstance(work, _Chain) and not work.advance(through=1):
                break
        return self._hierarchical_all_reduce(bucket, self._reduction(bucket))

    def _hooked_hierarchical_all_reduce(self, bucket: GradientBucket) -> Work:
        """Average inside the node (a reduce-scatter, dense), let the hook average this rank's piece across nodes
        (compressed), and start the all-gather inside the node. Issued in bucket order, each group's collectives in
        the same order on every rank; the hook returns with the piece reduced."""
        intra, data = self.topology.intra, bucket.grads.data
        piece = self._piece(bucket, data)
        intra.agreed.reduce_scatter(data, piece, ReductionOperation.AVERAGE)
        self.hook.all_reduce(bucket.index, piece)
        return intra.agreed.all_gather(piece, data, async_op=True)

    def _piece(self, bucket: GradientBucket, like: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``bucket`` (:func:`~gpudist.comm.shard_range` over the node's ranks), a buffer kept
        from step to step."""
        intra = self.topology.intra
        start, end = shard_range(like.numel(), intra.world_size, intra.rank)
        piece = self._pieces.get(bucket.index)
        if piece is None or piece.dtype != like.dtype:
            piece = self._pieces[bucket.index] = torch.empty(end - start, dtype=like.dtype, device=like.device)
        return piece

    def _hierarchical_all_reduce(self, bucket: GradientBucket, op: ReductionOperation) -> _Chain:
        """Reduce-scatter the bucket inside the node, all-reduce this rank's piece across nodes, all-gather inside
        the node. A SUM of pre-scaled gradients stays a SUM; an AVERAGE is an average at both levels."""
        intra, inter = self.topology.intra, self.topology.inter
        wire = bucket.wire
        piece = self._piece(bucket, wire)

        def unchecked(comm: CommunicationBackend, run: Callable[[], Work]) -> Callable[[], Work]:
            def start_stage() -> Work:
                with comm.unchecked():  # the bucket's layout agrees by construction (checked at wrap time)
                    return run()

            return start_stage

        return _Chain(
            [
                unchecked(intra, lambda: intra.reduce_scatter(wire, piece, op, async_op=True)),
                unchecked(inter, lambda: inter.all_reduce(piece, op, async_op=True)),
                unchecked(intra, lambda: intra.all_gather(piece, wire, async_op=True)),
            ]
        )

    def finished(self, bucket: GradientBucket) -> None:
        """Put the result where the gradients live: the wire back into the bucket, the bucket into ``param.grad``."""
        if bucket.wire is not bucket.grads.data and self.hook is None:
            bucket.grads.data.copy_(bucket.wire)
        if not self.views:
            kernels.unpack(bucket.grads.data, self._grads_of(bucket), layout=bucket.grads.layout)

    @staticmethod
    def _grads_of(bucket: GradientBucket) -> list[torch.Tensor]:
        for p in bucket.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in bucket.params]

    def zero_grad(self, set_to_none: bool) -> None:
        for bucket in self.buckets:
            if set_to_none:
                for p in bucket.params:
                    p.grad = None
                continue
            bucket.grads.data.zero_()
            if self.views:
                for p, view in zip(bucket.params, bucket.views, strict=True):
                    p.grad = view
            else:
                for p in bucket.params:
                    if p.grad is not None:
                        p.grad.zero_()

    def count_memory(self, mem: dict[str, int]) -> dict[str, int]:
        """``mem`` (the model's base table) with the buckets and wires added (the views' storage is the gradients)."""
        wires = sum(b.wire.numel() * b.wire.element_size() for b in self.buckets if b.wire is not b.grads.data)
        buckets = sum(b.grads.data.numel() * b.grads.data.element_size() for b in self.buckets)
        mem["gradients"] = buckets if self.views else mem["gradients"] + buckets
        mem["communication_buffers"] = wires
        return mem


class DDPModel(ShardedModel):
    """Distributed data parallel: every rank holds the whole model and trains on its slice of the batch.

    Shards: nothing. Communicates: one all-reduce (average) of the gradients per step, ``2 (N-1)/N x P``
    bytes per rank on a ring, in buckets of ``config.bucket_cap_mb`` launched during backward as soon as
    each bucket's gradients are ready (the last layers' first), so communication overlaps the rest of
    backward; on Gloo's shared-memory transport, where the all-reduce is this process's own CPU work, all buckets
    start at the end of backward instead (overlap would only share the cores). ``param.grad`` are views into the
    flat buckets (no copy); ``no_sync()`` accumulates locally.
    Use it when the model, its gradients and its optimizer state fit on one device.

    Hierarchical all-reduce (``hierarchical``): each bucket is reduce-scattered inside the node, its 1/L piece
    all-reduced across the M nodes, and the result all-gathered inside the node again (``L`` ranks per node). Per
    node, ``2 (M-1)/M x P`` bytes cross the network (spread over the L ranks' connections) instead of the flat
    ring's ``2 (N-1)/N x P`` through one link, and the slow link sees ``2 (M-1)`` steps instead of ``2 (N-1)``:
    it pays where the inter-node link is much slower than the intra-node one (see docs/multihost.md). The
    reduce-scatters and the cross-node all-reduces start during backward, in bucket order; the all-gathers at its
    end. A :class:`~gpudist.GradientCompressionOptimizer` then compresses the cross-node step alone.

    Args:
        module: The ``nn.Module`` to wrap; every rank must build the same architecture. Its parameters and buffers
            take rank 0's values.
        config: The settings shared with the paired optimizer (bucket sizes, ``communication_dtype``, overlap,
            ...); ``config.backend`` is the data-parallel group.
        hierarchical: False: one all-reduce per bucket over ``config.backend``. True: hierarchical, with
            ``config.backend.topology`` (``gpudist.init()`` sets it). A :class:`~gpudist.Topology` of
            ``config.backend``: hierarchical with that layout (e.g. a simulated one on one host).

    Raises:
        TypeError: When ``module`` is not an ``nn.Module`` or is already wrapped, ``config`` is not a
            :class:`~gpudist.ShardingConfiguration`, or ``hierarchical`` is neither a bool nor a Topology.
        ValueError: When ranks wrap modules whose parameter names, shapes or dtypes differ, or ``hierarchical``
            asks for a topology ``config.backend`` does not have (or one of another group), or is set on a
            strategy other than DDP.
    """

    strategy = "ddp"

    def __init__(self, module: nn.Module, config, *, hierarchical: bool | Topology = False):
        self._topology = _hierarchy(config, hierarchical, self.strategy)
        super().__init__(module, config)

    _collective_type: type[BucketCollective] = AllReduceBuckets
    """What the buckets' gradients go through (ZeRO-2: ``ReduceScatterBuckets``)."""

    _flat_parameters = False
    """Whether the trainable parameters move into one flat buffer at wrap time (ZeRO-1/2: their optimizer adopts it
    instead of allocating and packing a second copy of the model). DDP keeps torch's parameters as they are."""

    _pads_to_shards = False
    """Whether the flat parameter and gradient buffers are padded to whole even shards (ZeRO-1:
    :func:`gpudist.flat.padded_shard`, so its optimizer's range is a view of both)."""

    _aligned_gradients = True
    """Whether each gradient starts on a 16-byte boundary in its bucket (:func:`gpudist.flat.vector_align`; at most
    15 bytes of zeros per parameter, communicated with the bucket), so every copy into a bucket and every kernel over
    it takes its vector path in fp32 and bf16 alike. DDP: its buckets are its own. ZeRO-1/2: no (ZeRO-1's buckets
    view the flat parameter order its optimizer and checkpoints share; ZeRO-2 packs a send buffer)."""

    def initialize_sharding(self) -> None:
        module, comm, config = self.module, self.comm, self.config
        self._check_same_model()
        trainable = [p for p in module.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in trainable)
        capacity = self.world_size * padded_shard(numel, self.world_size) if self._pads_to_shards else 0
        if self._flat_parameters:  # ZeRO-1/2: one buffer, which their optimizer adopts instead of packing a copy
            flatten_parameters(trainable, capacity)
        broadcast_tensors(comm, trainable)  # rank 0's values; one buffer's views go straight into it
        moved = set(map(id, trainable))
        broadcast_tensors(comm, [t for t in (*module.parameters(), *module.buffers()) if id(t) not in moved])
        # The buffers forward broadcasts, found once (not by walking the module tree every step); as torch DDP,
        # buffers registered after wrapping are not broadcast.
        self._synced_buffers = list(module.buffers()) if self.world_size > 1 else []
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._params = [p for _, p in named]
        self._param_ids = {id(p) for p in self._params}
        self._collective = self._collective_type(
            comm, config, named, capacity=capacity, topology=self._topology, aligned=self._aligned_gradients
        )
        self._buckets = self._collective.buckets
        self.flat_grads = self._collective.flat_grads
        """With gradient views and one dtype/device, the buckets are slices of this one gradient buffer in parameter
        order, so any range of the flat gradients is a view (ZeRO-1 steps its range of it with no copy); else None."""
        self._reducer = Reducer(
            self._collective, self._refuse_unused, self._mark_step_bytes, static_graph=config.static_graph
        )
        if self._topology is not None:
            self._topology.groups()  # collective: the node groups are built now, on every rank at once

    def manages(self, param: torch.Tensor) -> bool:
        return id(param) in self._param_ids

    def clone(self) -> DDPModel:
        """A new wrapper of the same strategy (hierarchical too) around a deep copy of the module (collective).

        Returns:
            The new wrapper, built with the same ``config``.
        """
        if self._topology is None:
            return super().clone()
        return type(self)(copy.deepcopy(self.module), self.config, hierarchical=self._topology)

    def traffic_settings(self) -> dict:
        """The base settings, plus the node layout of a hierarchical all-reduce (None: flat)."""
        layout = None if self._topology is None else self._topology.layout.describe()
        return {**super().traffic_settings(), "hierarchical": layout}

    def _bytes_total(self) -> int:
        if self._topology is None:
            return super()._bytes_total()
        intra, inter = self._topology.intra, self._topology.inter
        return super()._bytes_total() + sum(g.stats.total_bytes for g in {intra, inter} if g is not self.comm)

    # -- communication hook ---------------------------------------------------------------------------------------

    def gradient_buffers(self) -> dict[int, BufferSpec]:
        """What each bucket communicates, by bucket index (for a communication hook and its checkpoints).

        Returns:
            Bucket index -> its :class:`~gpudist.flat.BufferSpec` (size, collective, parameter spans); with a
            hierarchical all-reduce, this rank's piece of each bucket, which a hook all-reduces across nodes; for
            ZeRO-2, the bucket zero-padded to ``world_size`` even pieces (what its reduce-scatter sends).
        """
        return self._collective.buffer_specs()

    @property
    def hook_group(self):
        """The group a communication hook's collectives run on: ``config.backend``, or, with a hierarchical
        all-reduce, the inter-node group (the hook then replaces only the cross-node step: compression of the slow
        hop alone)."""
        return self.comm if self._topology is None else self._topology.inter

    def capture_refusal(self) -> str | None:
        """Why a captured graph could not replay this step, or None. The flat all-reduce (or ZeRO-2's reduce-scatter)
        is planned at wrap time and captures; a hierarchical all-reduce also runs over the node groups, which
        :func:`gpudist.capture` neither pauses (their watchdogs would query events inside capture) nor compares
        across ranks, and a comm hook may decide on the host: both refused until proven under capture.

        Returns:
            The reason and the way out, or None.
        """
        if self._topology is not None:
            return (
                "its hierarchical all-reduce runs over the node groups too, which capture neither pauses nor checks; "
                f"build {type(self).__name__}(..., hierarchical=False) to capture, or run it eagerly"
            )
        if self._comm_hook is not None:
            return f"a comm hook ({type(self._comm_hook).__name__}) routes its buckets; capture it without one"
        return None

    def register_comm_hook(self, hook) -> None:
        """Route every bucket through the hook instead of the plain collective: ``hook.all_reduce(bucket_index,
        flat_grads)`` must average the bucket over ranks in place (ZeRO-2: ``hook.reduce_scatter(bucket_index,
        flat_grads, out)`` puts this rank's piece of the average, per :func:`gpudist.comm.split_sizes`, in ``out``).
        :class:`gpudist.GradientCompressionOptimizer` installs one. The hook runs when the bucket is ready, in bucket
        order on every rank, and replaces the ``communication_dtype`` cast too: the hook decides what travels. With a
        hierarchical all-reduce the hook replaces the cross-node step only: it averages this rank's piece of each
        bucket (:meth:`gradient_buffers`) over :attr:`hook_group`, after a dense average inside the node and before
        the all-gather inside it (compression of the slow hop alone).

        Args:
            hook: An object with the ``all_reduce`` (ZeRO-2: ``reduce_scatter``) method described above.

        Raises:
            TypeError: When ``hook`` lacks that method.
            ValueError: When another hook is already registered, or a hierarchical model gets a PowerSGD or
                momentum-compressing hook.
        """
        if self._topology is not None and isinstance(getattr(hook, "compressor", None), PowerSGDCompressor):
            raise ValueError(
                f"{type(self).__name__}(hierarchical=...): PowerSGD compresses whole matrices, but the cross-node "
                "step carries pieces of buckets; use an elementwise compressor (top-k, int8, 1-bit) or a flat "
                "DDPModel"
            )
        if self._topology is not None and getattr(hook, "local_gradients", False):
            raise ValueError(
                f"{type(self).__name__}(hierarchical=...): compress='momentum' communicates at the step, over one "
                "group; compress the gradients, or use a flat DDPModel"
            )
        op = self._collective.hook_op
        if not callable(getattr(hook, op, None)):
            raise TypeError(
                f"a {type(self).__name__} comm hook needs a {op}(bucket_index, ...) method, got {type(hook).__name__}"
            )
        if self._comm_hook is not None and hook is not self._comm_hook:
            raise ValueError(
                f"{type(self).__name__} already has a comm hook ({type(self._comm_hook).__name__}); "
                "build one optimizer that communicates per model"
            )
        self._comm_hook = hook
        self._collective.use_hook(hook)
        self._reducer.replan()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside the block only accumulate locally; the first backward
        after it reduces the accumulated sum (as torch DDP's ``no_sync``)."""
        previous, self._reducer.sync = self._reducer.sync, False
        try:
            yield
        finally:
            self._reducer.sync = previous

    def forward(self, *args, **kwargs):
        if self._reducer.failed_half_way:  # a previous backward failed half way: start clean
            self._reducer.reset()
        # Buffers (e.g. BatchNorm statistics) follow rank 0 in training only, as torch DDP: predict() and
        # evaluation on a single rank must not start a collective.
        if self._synced_buffers and self.config.broadcast_buffers and self.training and torch.is_grad_enabled():
            broadcast_tensors(self.comm.agreed, self._synced_buffers)
        return self.module(*args, **kwargs)

    def _refuse_unused(self, missing: list[tuple[GradientBucket, int]]) -> None:
        """Parameters that got no gradient in this backward count as zeros with ``find_unused_parameters``, and
        stop the step otherwise (their buckets could not be reduced)."""
        if self.config.find_unused_parameters:
            return
        names = [b.names[j] for b, j in missing]
        raise RuntimeError(
            f"{type(self).__name__}: {len(names)} parameter(s) got no gradient in this backward ({', '.join(names[:5])}"
            f"{', ...' if len(names) > 5 else ''}), so their buckets could not be reduced; pass "
            "ShardingConfiguration(find_unused_parameters=True), or set requires_grad=False on parameters "
            "that are never used"
        )

    def synchronize_gradients(self) -> None:
        """Average every gradient now. Backward already does it; this is for gradients produced outside a
        synced backward (e.g. after the last ``no_sync`` micro-batch without a final synced one)."""
        self._reducer.mark_all_ready()
        self._reducer.finish()

    def zero_grad_buckets(self, set_to_none: bool = True) -> None:
        """Clear the gradients. ``set_to_none`` (torch's default) drops ``param.grad`` and leaves the buckets as they
        are: the next backward copies each fresh gradient into its bucket view (no zeroing pass over P).
        ``set_to_none=False`` zeroes the buckets in place and keeps ``param.grad`` as views into them. (ZeRO-2: the
        owned pieces are not zeroed but overwritten by the next backward, or zeroed now with ``set_to_none=False``.)

        Args:
            set_to_none: Drop ``param.grad`` (True) or zero the buckets in place (False), as described above.
        """
        self._collective.zero_grad(set_to_none)

    def bucket_sizes(self) -> list[int]:
        """Bytes on the wire per bucket, in launch order (for tests and reports).

        Returns:
            One byte count per bucket.
        """
        return [b.nbytes for b in self._buckets]

    def memory_per_rank(self) -> dict[str, int]:
        mem = super().memory_per_rank()
        return self._collective.count_memory(mem)

    def extra_repr(self) -> str:
        return f"world_size={self.world_size}, buckets={len(self._buckets)}"


_BATCHED_COPY_DEVICES = {"cuda", "cpu"}
"""Device types whose fresh gradients are copied into their views in one multi-tensor copy per bucket
(:meth:`AllReduceBuckets._absorb`) rather than one copy per gradient in its hook. On a GPU: one or two launches per
bucket instead of one per gradient; on the CPU, less Python per parameter inside backward (docs/results.md, "Host
time")."""

_SCALED_COPY_MIN_NUMEL = 16384
"""Mean elements per gradient from which a bucket folds the 1/N of the average into each gradient's copy into its
view (``torch.mul(out=)``, no extra pass over the bucket); below it the gradients are copied plain and the bucket is
all-reduced with AVERAGE (the transport's division: one pass over the bucket, while its chunk is in cache on the
shared-memory transport). The threshold weighs a ``mul(out=)``'s host cost per call above a ``copy_``'s against a
division pass's cost per element (measured on CPU: docs/results.md, "Host time"). A GPT of hundreds of tiny tensors
(``gpt-host``) copies plain, the 20M MLP's 1M-element layers scale on the copy."""


def _hierarchy(config, hierarchical: bool | Topology, strategy: str) -> Topology | None:
    """The topology a ``hierarchical`` argument asks for (None: flat), checked against ``config.backend``."""
    if hierarchical is False:
        return None
    if hierarchical is True:
        topology = getattr(config, "backend", None) and config.backend.topology
        if topology is None:
            raise ValueError(
                "hierarchical=True needs config.backend.topology, which gpudist.init() sets; for a backend built "
                "otherwise pass hierarchical=gpudist.Topology(backend, ranks_per_node=...)"
            )
    elif isinstance(hierarchical, Topology):
        topology = hierarchical
    else:
        raise TypeError(f"hierarchical must be a bool or a gpudist.Topology, got {type(hierarchical).__name__}")
    if topology.world is not config.backend:
        raise ValueError(
            f"hierarchical: the topology is of group {topology.world.group!r}, but config.backend is "
            f"{config.backend.group!r}; build the Topology from config.backend"
        )
    if strategy != "ddp":
        raise ValueError(
            f"hierarchical all-reduce is DDP's ({strategy} communicates with reduce-scatter and all-gather over "
            "config.backend); use DDPModel, or FSDPModel(..., replicate_group=topology.inter) for HSDP"
        )
    return topology


class _Chain:
    """Async collectives run one after another, each started once the one before completed: ``advance(through)``
    starts stages up to index ``through`` that are ready, without blocking; ``wait()`` runs the rest. Quacks like a
    :class:`~gpudist.comm.Work`."""

    def __init__(self, stages: list[Callable[[], Work]]):
        self._stages = list(stages)
        self._started = 0
        self._work: Work | None = None
        self._next()

    def _next(self) -> None:
        self._work = self._stages[self._started]() if self._started < len(self._stages) else None
        self._started += self._work is not None

    def advance(self, through: int) -> bool:
        """Start the next stages while the running one has completed, up to stage ``through``; return whether
        stage ``through`` has started."""
        while self._work is not None and self._started <= through and self._work.is_completed():
            self._work.wait()
            self._next()
        return self._started > through

    def wait(self) -> None:
        while self._work is not None:
            self._work.wait()
            self._next()

    def is_completed(self) -> bool:
        return self._work is None


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
