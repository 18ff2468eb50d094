"""Flat buffers: a list of parameters (or their gradients) <-> one contiguous buffer, and its shards.

Offsets come from :class:`gpudist.kernels.FlatLayout`, the same object the pack/unpack kernels use. Sharded
strategies split a flat buffer by :func:`padded_shard`: every rank's shard has the same size, a multiple of
:data:`SHARD_ALIGN` elements, and the buffer is padded at its end to ``world_size`` shards. So a reduce-scatter or
all-gather of it is one even collective (NCCL has no uneven form: uneven shares cost one ``ncclReduce`` or
``ncclBroadcast`` per rank), and every shard starts 64-byte aligned for fp32 (the vectorized kernels' 128-bit
loads). The padding is zero, is never written to checkpoints, and costs at most ``SHARD_ALIGN`` elements per rank
and buffer. :func:`gpudist.comm.shard_range` (the first ``numel % N`` ranks hold one element more) stays the rule
of the collectives' uneven form.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .comm import shard_range
from .kernels import FlatLayout, pack, unpack
from .kernels.bucket import FLOAT_DTYPES

__all__ = [
    "SHARD_ALIGN",
    "VECTOR_BYTES",
    "BufferSpec",
    "FlatBuffer",
    "GradientBucket",
    "assign_buckets",
    "broadcast_tensors",
    "exchange_bytes",
    "flatten_parameters",
    "padded_range",
    "padded_shard",
    "shard_range",
    "vector_align",
]

SHARD_ALIGN = 16
"""Elements every padded shard is a multiple of: 64 bytes of fp32, a 128-bit vector for 16-bit types times four."""


VECTOR_BYTES = 16
"""Bytes of the widest load or store the kernels issue per thread (128 bits): a tensor that starts at a multiple of
this in its buffer takes their vector path (torch's multi-tensor copies too) where the buffer itself is aligned."""


def vector_align(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` in :data:`VECTOR_BYTES` (fp32: 4, bf16/fp16: 8, fp64: 2): the ``align`` of a
    :class:`~gpudist.kernels.FlatLayout` whose every tensor starts on a vector boundary."""
    return max(1, VECTOR_BYTES // dtype.itemsize)


def padded_shard(numel: int, world_size: int, align: int = SHARD_ALIGN) -> int:
    """Elements of each rank's shard when ``numel`` are split evenly over ``world_size`` ranks with padding.

    Args:
        numel: Elements of the flat buffer (>= 0).
        world_size: Ranks it is split over (>= 1).
        align: The shard size is a multiple of this.

    Returns:
        ``ceil(numel / (world_size * align)) * align``; the padded buffer holds ``world_size`` times that.
    """
    if world_size < 1 or numel < 0:
        raise ValueError(f"padded_shard needs numel >= 0 and world_size >= 1, got {numel} and {world_size}")
    return -(-numel // (world_size * align)) * align


def padded_range(numel: int, world_size: int, rank: int, align: int = SHARD_ALIGN) -> tuple[int, int]:
    """``(start, end)`` of the real elements in ``rank``'s padded shard (:func:`padded_shard`); the shard itself is
    ``[rank * size, (rank + 1) * size)``. The last ranks' real range may be short or empty."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")
    size = padded_shard(numel, world_size, align)
    return min(rank * size, numel), min((rank + 1) * size, numel)


@dataclass
class FlatBuffer:
    """One contiguous buffer holding a list of same-dtype tensors back to back (``layout``), with views."""

    layout: FlatLayout
    data: torch.Tensor
    _views: tuple[torch.Tensor, list[torch.Tensor]] | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def empty_like(
        cls,
        tensors: Sequence[torch.Tensor],
        dtype: torch.dtype | None = None,
        zero: bool = True,
        capacity: int = 0,
        align: int = 1,
    ):
        """A new buffer for ``tensors``' layout (each starting at a multiple of ``align`` elements), of
        ``max(layout.total, capacity)`` elements; the padding after the tensors is zeroed even when ``zero`` is False
        (the gaps between them only with ``zero``)."""
        layout = FlatLayout.of(list(tensors), align)
        first = tensors[0]
        alloc = torch.zeros if zero else torch.empty
        data = alloc(max(layout.total, capacity), dtype=dtype or first.dtype, device=first.device)
        if not zero:
            data[layout.total :].zero_()
        return cls(layout, data)

    @classmethod
    def holding(cls, tensors: Sequence[torch.Tensor], capacity: int = 0) -> FlatBuffer | None:
        """The buffer ``tensors`` already are, back to back and in order in one storage (as :func:`flatten_parameters`
        leaves parameters), or None. Lets a second owner share that memory instead of packing a copy. (A parameter
        whose ``.data`` was set to a view has no ``_base``, so this compares storages and offsets.) With
        ``capacity``, ``data`` spans that many elements (the padding after the tensors) and the storage must hold
        them."""
        if not tensors:
            return None
        first = tensors[0]
        storage, origin = first.untyped_storage(), first.storage_offset()
        layout = FlatLayout.of(list(tensors))
        for t, offset, numel in zip(tensors, layout.offsets, layout.numels, strict=True):
            same_kind = t.dtype == first.dtype and t.device == first.device and t.is_contiguous() and t.numel() == numel
            in_place = t.untyped_storage().data_ptr() == storage.data_ptr() and t.storage_offset() == origin + offset
            if not (same_kind and in_place):
                return None
        size = max(layout.total, capacity)
        if (origin + size) * first.element_size() > storage.nbytes():
            return None
        data = torch.empty(0, dtype=first.dtype, device=first.device).set_(storage, origin, (size,))
        return cls(layout, data)

    def views(self) -> list[torch.Tensor]:
        """Views shaped like the tensors: writing one writes the buffer. Built once per ``data`` and kept here, with
        the buffer they view (a bucket is viewed every step, and each view is Python work). Do not modify the returned
        list."""
        if self._views is None or self._views[0] is not self.data:
            self._views = (self.data, self.layout.views(self.data))
        return self._views[1]


@dataclass
class GradientBucket:
    """Gradients of a few parameters reduced by one collective.

    ``grads`` holds the gradients in the parameters' dtype (``param.grad`` are views into it when the
    configuration allows); ``wire`` is what travels (the same tensor, or a bf16/fp16 copy).
    """

    index: int
    params: list[torch.nn.Parameter]
    names: list[str]
    grads: FlatBuffer | None = None
    wire: torch.Tensor | None = None
    ready: set[int] = field(default_factory=set)
    part: Any = None
    """ZeRO-2: where the bucket sits in the flat order and which piece of it this rank keeps (a
    ``gpudist.strategies.zero.BucketPartition``)."""
    in_flight: tuple[torch.Tensor, torch.Tensor] | None = None
    """ZeRO-2: (sent, received) buffers of a reduce-scatter in progress."""
    views: list[torch.Tensor] | None = None
    """DDP with gradient views: ``grads``' views shaped like ``params`` (what each ``param.grad`` is)."""
    arrival_scale: float | None = None
    """DDP with gradient views: what a gradient is multiplied by as it reaches its view (the 1/N of the average), or
    None (decided when the buckets are built and when a comm hook is registered)."""
    on_arrival: bool = True
    """Whether the collective's ``arrived`` runs for each gradient as it arrives (the reducer's hook skips the call
    when False: DDP's buckets whose launch takes every fresh gradient at once; decided when the buckets are built
    and when a comm hook is registered)."""
    batched_copy: bool = False
    """DDP with gradient views: whether fresh gradients wait for one multi-tensor copy at the bucket's launch (CPU and
    CUDA: ``gpudist.strategies.ddp._BATCHED_COPY_DEVICES``) instead of being copied as each arrives (decided when the
    bucket is built, not per gradient)."""
    reduce: Any = None
    """DDP: the bucket's all-reduce, planned with its reduction (a :class:`gpudist.comm.PlannedCollective`), or None
    where the bucket goes another way (a comm hook, a hierarchical all-reduce)."""

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def nbytes(self) -> int:
        if self.wire is not None:
            return self.wire.numel() * self.wire.element_size()
        return sum(p.numel() * p.element_size() for p in self.params)


def assign_buckets(params: Sequence[torch.nn.Parameter], cap_bytes: int, first_cap_bytes: int) -> list[list[int]]:
    """Group parameter indices into buckets, in REVERSE order (gradients of the last layers are ready first).

    A bucket holds one dtype and device and closes once it holds ``cap_bytes`` (``first_cap_bytes`` for the first
    bucket, so the first collective starts early): it may exceed the cap by its last parameter, as torch DDP's do.
    Closing before the cap instead left a near-empty first bucket whenever a large tensor followed the last layer's
    bias (3 KB on a GPT, 40 KB on an MLP): one more collective per step for nothing. Deterministic: every rank
    derives the same buckets from the same model.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size, key = 0, None
    for i in reversed(range(len(params))):
        p = params[i]
        if current and (p.dtype, p.device) != key:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += p.numel() * p.element_size()
        key = (p.dtype, p.device)
        if size >= (first_cap_bytes if not buckets else cap_bytes):
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


@dataclass(frozen=True)
class BufferSpec:
    """A flat gradient buffer that one collective communicates: its size, the collective, and which parameter
    elements it holds (what a communication hook needs to keep per-buffer state, and a checkpoint to name it)."""

    numel: int
    op: str
    """``"all_reduce"`` or ``"reduce_scatter"``."""
    spans: tuple[tuple[int, int, torch.nn.Parameter, int], ...]
    """(position in the buffer, length, parameter, position in the flattened parameter)."""

    @classmethod
    def of(
        cls,
        params: Sequence[torch.nn.Parameter],
        op: str,
        lo: int = 0,
        hi: int | None = None,
        size: int = 0,
        align: int = 1,
    ) -> BufferSpec:
        """Elements ``[lo, hi)`` of the parameters' flat layout (all of it by default; each parameter starting at a
        multiple of ``align`` elements), in a buffer of ``max(hi - lo, size)`` elements (``size``: a padded buffer,
        its padding after the elements)."""
        layout = FlatLayout.of(list(params), align)
        hi = layout.total if hi is None else hi
        spans = []
        for p, offset, numel in zip(params, layout.offsets, layout.numels, strict=True):
            a, b = max(lo, offset), min(hi, offset + numel)
            if a < b:
                spans.append((a - lo, b - a, p, a - offset))
        return cls(max(hi - lo, size), op, tuple(spans))


def flatten_parameters(params: Sequence[torch.nn.Parameter], capacity: int = 0) -> FlatBuffer | None:
    """Move ``params`` (one dtype and device) into one flat buffer, back to back in order: each parameter's ``.data``
    becomes a view of it and its old storage is freed as it moves (the peak is the buffer plus the parameters not
    moved yet). ``capacity`` pads the buffer with zeros to that many elements (a sharded optimizer's
    :func:`padded_shard` times the world size). Returns the buffer (the one they already are, when
    :meth:`FlatBuffer.holding` finds it with room for ``capacity``), or None (nothing moved) when the parameters
    are of several kinds."""
    params = list(params)
    if not params or len({(p.dtype, p.device) for p in params}) != 1:
        return None
    held = FlatBuffer.holding(params, capacity)
    if held is not None:
        return held
    flat = FlatBuffer.empty_like(params, zero=False, capacity=capacity)
    with torch.no_grad():
        for p, view in zip(params, flat.views(), strict=True):
            view.copy_(p.data)
            p.data = view
    return flat


def broadcast_tensors(comm, tensors: list[torch.Tensor], src: int = 0) -> None:
    """Overwrite ``tensors`` on every rank with ``src``'s values: one broadcast per device and dtype through a flat
    buffer (a kind that already is one buffer, such as a contiguous tensor or :func:`flatten_parameters`' views, goes
    as it is, no copy). Tensors off the backend's device (Adam's ``step`` counters stay on the CPU next to CUDA
    moments) travel through a copy on it."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_kind.setdefault((t.device, t.dtype), []).append(t)
    with torch.no_grad():
        for (device, dtype), group in by_kind.items():
            staged = group if device.type == comm.device.type else [t.to(comm.device) for t in group]
            held = FlatBuffer.holding(staged)
            if held is not None:
                comm.broadcast(held.data, src)
            elif dtype in FLOAT_DTYPES:
                flat = FlatBuffer.empty_like(staged, zero=False)
                pack(staged, flat.data)
                comm.broadcast(flat.data, src)
                unpack(flat.data, staged)
            else:  # integer buffers (BatchNorm's num_batches_tracked): plain cat and copy back
                data = torch.cat([t.reshape(-1) for t in staged])
                comm.broadcast(data, src)
                for t, piece in zip(staged, data.split([t.numel() for t in staged]), strict=True):
                    t.copy_(piece.view_as(t))
            if staged is not group:
                for t, s in zip(group, staged, strict=True):
                    t.copy_(s)


def reduce_gradients_in(group, params: Sequence[torch.nn.Parameter], op) -> None:
    """All-reduce the gradients of ``params`` over ``group`` in place, one flat buffer per dtype (a missing
    gradient counts as zeros, so every rank issues the same collectives). Shapes agree by construction."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    if group.world_size == 1:
        return
    with torch.no_grad():
        for grads in by_dtype.values():
            flat = FlatBuffer.empty_like(grads, zero=False)
            pack(grads, flat.data)
            group.agreed.all_reduce(flat.data, op)
            unpack(flat.data, grads)


def exchange_bytes(comm, payload: bytes) -> list[bytes]:
    """Every rank's ``payload`` on every rank (two all-gathers: lengths, then padded bytes; collective)."""
    n, device = comm.world_size, comm.device  # the messages live on the backend's device (NCCL: GPU memory)
    lengths = torch.zeros(n, dtype=torch.int64, device=device)
    comm.all_gather(torch.tensor([len(payload)], dtype=torch.int64, device=device), lengths)
    sizes = lengths.tolist()
    width = max(sizes)
    mine = torch.zeros(width, dtype=torch.uint8, device="cpu")  # filled from host bytes, then moved
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else mine[:0]
    every = torch.zeros(n * width, dtype=torch.uint8, device=device)
    comm.all_gather(mine.to(device), every)
    every = every.cpu()
    return [every[r * width : r * width + sizes[r]].numpy().tobytes() for r in range(n)]
