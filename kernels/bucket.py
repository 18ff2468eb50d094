"""Bucketing: many tensors <-> one flat buffer, with the dtype cast and a scale fused into the copy.

``pack`` fills a communication bucket from a list of gradients (e.g. fp32 grads into a bf16 bucket,
multiplied by 1/world on the way); ``unpack`` writes a reduced bucket back. Each is one kernel
launch for the whole list (its dtypes mixed as they come), driven by a per-chunk table from
the list's ``FlatLayout``: program ``p`` copies one chunk of one tensor, located through a table
of data pointers, so a list of 300 small gradients costs one launch instead of 300 copies plus 300
multiplies (the ``torch.cat`` + ``mul`` baseline of ``benchmarks/kernels.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ._triton import cast_rne, tl, triton
from .dispatch import use_triton
from .layout import FlatLayout, _to_device

__all__ = ["PackPlan", "pack", "pack_reference", "pack_triton", "unpack", "unpack_reference", "unpack_triton"]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""What pack/unpack move. float64 (parity checks, scientific models) always takes the torch path, computing in
float64: the kernels compute in float32."""

# Elements per program. One program moves one chunk of one tensor; 4096 elements x 4 warps keeps
# each thread on 32 elements, enough loads in flight to stream at copy bandwidth, while a
# 1000-element gradient still costs a single program. (Tuned on GPU by benchmarks/kernels.py.)
BLOCK = 4096
NUM_WARPS = 4
# Elements per step of the masked path (a chunk's ragged end, or a chunk whose addresses are not 16-byte
# aligned): 8 per thread. Masking all 4096 at once kept 32 scalar loads, their 64-bit addresses and predicates
# live per thread: 148-168 registers, 3 blocks of 4 warps per SM (19% occupancy on sm_90); in steps of 1024 the
# kernel needs 32-40 registers (75-100%). From tests/kernel_compile.py's SASS report, triton 3.9 and 3.6.
MASKED_STEP = 1024


@triton.jit
def _bucket_copy_kernel(
    tensor_ptrs_ptr,  # int64[len]: data pointer of each listed tensor
    flat_ptr,
    chunk_tensor_ptr,  # int64[chunks]: which listed tensor program p copies
    chunk_start_ptr,  # int64[chunks]: first element of its chunk inside that tensor
    offsets_ptr,  # int64[len]: where each listed tensor starts in the flat buffer
    numels_ptr,  # int64[len]
    dtypes_ptr,  # int32[len]: each listed tensor's dtype code (_DTYPE_CODES); read only for a mixed list
    scale,
    HAS_F32: tl.constexpr,  # which tensor dtypes the list holds: one launch copies them all
    HAS_BF16: tl.constexpr,
    HAS_F16: tl.constexpr,
    DTYPE_CODE: tl.constexpr,  # the list's one dtype code, or -1 for a mixed list (read per tensor from dtypes_ptr)
    PACK: tl.constexpr,  # True: tensors -> flat; False: flat -> tensors
    BLOCK: tl.constexpr,
    MASKED_STEP: tl.constexpr,
):
    pid = tl.program_id(0)
    index = tl.load(chunk_tensor_ptr + pid)
    start = tl.multiple_of(tl.load(chunk_start_ptr + pid), BLOCK)  # chunks start at 0, BLOCK, 2 * BLOCK, ...
    numel = tl.load(numels_ptr + index)
    flat_start = tl.load(offsets_ptr + index)
    tensor_address = tl.load(tensor_ptrs_ptr + index)
    code = DTYPE_CODE
    if DTYPE_CODE < 0:  # a mixed list: each program takes its tensor's branch (uniform within the program)
        code = tl.load(dtypes_ptr + index)
    # One dtype (the usual bucket): ``code`` is a constant, so one branch compiles and no table is read.
    if HAS_F32:
        if code == 0:
            _copy_chunk(tensor_address, flat_ptr, flat_start, start, numel, scale, tl.float32, PACK, BLOCK, MASKED_STEP)
    if HAS_BF16:
        if code == 1:
            _copy_chunk(
                tensor_address, flat_ptr, flat_start, start, numel, scale, tl.bfloat16, PACK, BLOCK, MASKED_STEP
            )
    if HAS_F16:
        if code == 2:
            _copy_chunk(tensor_address, flat_ptr, flat_start, start, numel, scale, tl.float16, PACK, BLOCK, MASKED_STEP)


@triton.jit
def _copy_chunk(
    tensor_address, flat_ptr, flat_start, start, numel, scale, TENSOR_DTYPE: tl.constexpr, PACK: tl.constexpr,
    BLOCK: tl.constexpr, MASKED_STEP: tl.constexpr,
):  # fmt: skip
    """One program's chunk of one tensor (elements ``start : start + BLOCK``), both directions."""
    TENSOR_BYTES: tl.constexpr = TENSOR_DTYPE.primitive_bitwidth // 8
    FLAT_BYTES: tl.constexpr = flat_ptr.dtype.element_ty.primitive_bitwidth // 8
    flat_address = flat_ptr.to(tl.int64) + flat_start * FLAT_BYTES
    # The peel: the first h elements of the tensor (h < 16) are copied apart, so that its chunks start where both
    # sides are on 16-byte boundaries, whatever the tensor's own start. h comes from the narrower dtype's side (more
    # elements per 16 bytes, so its boundaries are the stricter ones) and holds only if the other side lines up
    # too; otherwise (the two starts out of phase) h = 0 and the tensor's chunks take the masked path. The same for
    # every chunk of one tensor, since it depends only on the tensor's two start addresses.
    if TENSOR_BYTES <= FLAT_BYTES:
        peel = ((16 - tensor_address % 16) % 16) // TENSOR_BYTES
    else:
        peel = ((16 - flat_address % 16) % 16) // FLAT_BYTES
    lined_up = ((tensor_address + peel * TENSOR_BYTES) % 16 == 0) & ((flat_address + peel * FLAT_BYTES) % 16 == 0)
    peel = tl.where(lined_up, peel, 0)
    tensor_ptr = tensor_address.to(tl.pointer_type(TENSOR_DTYPE))
    if (start == 0) & (peel > 0):  # the peeled head, by the tensor's first chunk
        offs = tl.arange(0, 16)
        mask = offs < tl.minimum(peel, numel)
        _masked_copy(tensor_ptr, flat_ptr + flat_start, offs, mask, scale, TENSOR_DTYPE, PACK)
    lo = start + peel
    if lined_up & (lo + BLOCK <= numel):
        # A whole chunk between 16-byte aligned addresses: no mask, and the hints let the compiler use 128-bit loads
        # and stores. The addresses come from a table, so Triton's launcher cannot see their alignment; the test
        # above is what makes the hints true. Where the two dtypes differ in width (bf16 tensors, fp32 bucket) both
        # sides are still 128-bit, and Triton moves the values between the two layouts through 4 KiB of shared
        # memory in the direction that widens.
        tensor_chunk = tl.multiple_of((tensor_address + lo * TENSOR_BYTES).to(tl.pointer_type(TENSOR_DTYPE)), 16)
        flat_chunk = tl.multiple_of((flat_address + lo * FLAT_BYTES).to(tl.pointer_type(flat_ptr.dtype.element_ty)), 16)
        offs = tl.arange(0, BLOCK)
        if PACK:
            x = tl.load(tensor_chunk + offs).to(tl.float32) * scale
            tl.store(flat_chunk + offs, cast_rne(x, flat_ptr.dtype.element_ty))
        else:
            x = tl.load(flat_chunk + offs).to(tl.float32) * scale
            tl.store(tensor_chunk + offs, cast_rne(x, TENSOR_DTYPE))
    else:
        for step in range(0, BLOCK, MASKED_STEP):
            offs = lo + step + tl.arange(0, MASKED_STEP)
            _masked_copy(tensor_ptr, flat_ptr + flat_start, offs, offs < numel, scale, TENSOR_DTYPE, PACK)


@triton.jit
def _masked_copy(tensor_ptr, flat_ptr, offs, mask, scale, TENSOR_DTYPE: tl.constexpr, PACK: tl.constexpr):
    """Elements ``offs`` (where ``mask``) between the tensor and its place in the flat buffer, scaled and cast."""
    if PACK:
        x = tl.load(tensor_ptr + offs, mask=mask).to(tl.float32) * scale
        tl.store(flat_ptr + offs, cast_rne(x, flat_ptr.dtype.element_ty), mask=mask)
    else:
        x = tl.load(flat_ptr + offs, mask=mask).to(tl.float32) * scale
        tl.store(tensor_ptr + offs, cast_rne(x, TENSOR_DTYPE), mask=mask)


_POINTER_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _pointer_table(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The data pointers of ``tensors`` as an int64 tensor on ``device``.

    Cached by the pointer values: a bucket whose gradients keep their storage between steps pays
    the host-to-device copy once. A stale entry cannot be wrong, since it holds only the addresses.
    A miss (gradients freed by ``zero_grad(set_to_none=True)`` come back at new addresses) copies
    from pinned memory without blocking, on the current stream, ahead of the kernel that reads it:
    no host sync. The pinned source stays in the cache with the table (torch's pinned allocator
    also keeps a freed block until the copies using it are done).
    """
    key = (str(device), tuple(t.data_ptr() for t in tensors))
    entry = _POINTER_TABLES.get(key)
    if entry is None:
        if len(_POINTER_TABLES) >= 256:
            _POINTER_TABLES.pop(next(iter(_POINTER_TABLES)))
        host = torch.tensor(key[1], dtype=torch.int64)
        if device.type == "cuda":
            host = host.pin_memory()
            entry = (host.to(device, non_blocking=True), host)
        else:
            entry = (host.to(device), host)
        _POINTER_TABLES[key] = entry
    return entry[0]


_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""A listed tensor's dtype as the kernel's branches read it."""
_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_DTYPE_TABLES: dict[tuple, torch.Tensor] = {}


def _dtype_table(dtypes: tuple[torch.dtype, ...], device: torch.device) -> torch.Tensor:
    """The dtype codes of a mixed list as an int32 tensor on ``device``, cached by the dtypes (a bucket's list keeps
    them from step to step)."""
    key = (str(device), dtypes)
    table = _DTYPE_TABLES.get(key)
    if table is None:
        if len(_DTYPE_TABLES) >= 256:
            _DTYPE_TABLES.pop(next(iter(_DTYPE_TABLES)))
        table = _DTYPE_TABLES[key] = _to_device([_DTYPE_CODES[d] for d in dtypes], device).int()
    return table


def _launches(tensors, flat, layout) -> list[tuple]:
    """What the Triton path launches for ``tensors`` <-> ``flat``: one ``(grid, pointers, chunk_tensor, chunk_start,
    offsets, numels, dtype codes, dtype flags)`` for the whole list, whatever its dtypes (none when every tensor is
    empty; tables cached in the layout, by pointer values and by dtypes)."""
    present = {t.dtype for t in tensors if t.numel()}
    if not present:
        return []
    chunk_tensor, chunk_start, offsets, numels = layout.chunk_table(BLOCK, flat.device)
    pointers = _pointer_table(tensors, flat.device)
    mixed = len(present) > 1
    codes = _dtype_table(tuple(t.dtype for t in tensors), flat.device) if mixed else pointers
    flags = {f"HAS_{name}": dtype in present for dtype, name in _DTYPE_NAMES.items()}
    flags["DTYPE_CODE"] = -1 if mixed else _DTYPE_CODES[next(iter(present))]
    return [((chunk_tensor.numel(),), pointers, chunk_tensor, chunk_start, offsets, numels, codes, flags)]


def _launch(launches: list[tuple], flat: torch.Tensor, scale: float, pack_direction: bool) -> None:
    for grid, pointers, chunk_tensor, chunk_start, offsets, numels, codes, flags in launches:
        _bucket_copy_kernel[grid](
            pointers,
            flat,
            chunk_tensor,
            chunk_start,
            offsets,
            numels,
            codes,
            float(scale),
            **flags,
            PACK=pack_direction,
            BLOCK=BLOCK,
            MASKED_STEP=MASKED_STEP,
            num_warps=NUM_WARPS,
        )


def pack_triton(tensors: Sequence[torch.Tensor], out: torch.Tensor, scale: float = 1.0, *, layout=None) -> torch.Tensor:
    """Triton launcher of :func:`pack` (inputs already validated and contiguous)."""
    _launch(_launches(tensors, out, layout or FlatLayout.of(tensors)), out, scale, pack_direction=True)
    return out


def pack_reference(
    tensors: Sequence[torch.Tensor], out: torch.Tensor, scale: float = 1.0, *, layout=None
) -> torch.Tensor:
    """torch reference of :func:`pack`: the same arithmetic (fp32 multiply, round to nearest even)."""
    layout = layout or FlatLayout.of(tensors)
    return _pack_torch(tensors, out, scale, _TorchPlan(tensors, out, layout))


class _TorchPlan:
    """What the torch path of one ``tensors`` <-> ``flat`` pair needs: 1-D sources for ``cat``, the tensors and the
    buffer's views in the layout's shapes, whether the tensors lie back to back in a width one ``cat`` keeps. Each
    list is made on first use (a one-off :func:`pack` needs only the sources) and kept for a :class:`PackPlan`."""

    def __init__(self, tensors, flat, layout: FlatLayout):
        self.tensors, self.flat, self.layout = tensors, flat, layout
        self.dense = flat[: layout.total] if layout.total == sum(layout.numels) else None
        self.wide = flat.dtype == torch.float64 or (flat.dtype == torch.float32 and not _float64(flat, tensors))

    @functools.cached_property
    def sources(self) -> list[torch.Tensor]:
        return [t.reshape(-1) for t in self.tensors]

    @functools.cached_property
    def shaped(self) -> list[torch.Tensor]:
        return [t if t.shape == s else t.view(s) for t, s in zip(self.tensors, self.layout.shapes, strict=True)]

    @functools.cached_property
    def views(self) -> list[torch.Tensor]:
        return self.layout.views(self.flat)


def _pack_torch(tensors, out: torch.Tensor, scale: float, plan: _TorchPlan) -> torch.Tensor:
    if plan.dense is not None and (scale == 1.0 or plan.wide):
        # Back to back (no padding): one multi-threaded cat and one multiply over the whole bucket, the
        # baseline's own recipe, and still one rounding:
        # cat only widens (exact) or, with scale 1, casts once.
        torch.cat(plan.sources, out=plan.dense)
        if scale != 1.0:
            plan.dense.mul_(scale)
        return out
    _scaled_copies(plan.views, plan.shaped, scale)
    return out


def unpack_triton(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float = 1.0, *, layout=None):
    """Triton launcher of :func:`unpack` (inputs already validated and contiguous)."""
    _launch(_launches(tensors, flat, layout or FlatLayout.of(tensors)), flat, scale, pack_direction=False)
    return tensors


def unpack_reference(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float = 1.0, *, layout=None):
    """torch reference of :func:`unpack`."""
    layout = layout or FlatLayout.of(tensors)
    targets = [t if t.shape == shape else t.view(shape) for t, shape in zip(tensors, layout.shapes, strict=True)]
    _scaled_copies(targets, layout.views(flat), scale)
    return tensors


class PackPlan:
    """:func:`pack` and :func:`unpack` between one fixed list of tensors and one fixed flat buffer, decided once.

    What the functions work out on every call is worked out here, when a strategy builds its buckets: the checks,
    the layout, which implementation runs, the buffer's views and the copies' sources (torch), the chunk and pointer
    tables of each launch (Triton). A call then only launches: one kernel for the list, or one or two multi-tensor
    torch ops, with no Python loop over the tensors (``benchmarks/host_overhead.py`` times the function and the plan
    side by side).

    The tensors must keep their storage for the plan's life (a bucket's gradient views, a shard's buffers): the
    Triton launches hold their addresses.

    Args:
        tensors: The tensors (contiguous; any shapes; float32, bfloat16, float16 or float64), in buffer order.
        flat: The flat buffer (1-D, contiguous, large enough for the layout).
        layout: Where each tensor lives in ``flat`` (default: back to back).

    Raises:
        TypeError: As :func:`pack`.
        ValueError: As :func:`pack`, or when a tensor is not contiguous.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], flat: torch.Tensor, *, layout: FlatLayout | None = None):
        tensors, layout = _validate(tensors, flat, 1.0, layout, "flat")
        for i, t in enumerate(tensors):
            if not t.is_contiguous():
                raise ValueError(f"tensors[{i}] (shape {tuple(t.shape)}) is not contiguous; a plan writes in place")
        self.tensors, self.flat, self.layout = tuple(tensors), flat, layout
        self.triton = use_triton(flat) and not _float64(flat, tensors)
        self._launches = _launches(tensors, flat, layout) if self.triton else None
        self._torch = None if self.triton else _TorchPlan(tensors, flat, layout)

    def pack(self, scale: float = 1.0) -> torch.Tensor:
        """The tensors into the flat buffer, times ``scale`` (as :func:`pack`); returns the buffer."""
        if self._launches is not None:
            _launch(self._launches, self.flat, scale, pack_direction=True)
            return self.flat
        return _pack_torch(self.tensors, self.flat, scale, self._torch)

    def unpack(self, scale: float = 1.0) -> tuple[torch.Tensor, ...]:
        """The flat buffer into the tensors, times ``scale`` (as :func:`unpack`); returns the tensors."""
        if self._launches is not None:
            _launch(self._launches, self.flat, scale, pack_direction=False)
        else:
            _scaled_copies(self._torch.shaped, self._torch.views, scale)
        return self.tensors


def _float64(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> bool:
    return flat.dtype == torch.float64 or any(t.dtype == torch.float64 for t in tensors)


def _scaled_copies(dsts: list[torch.Tensor], srcs: list[torch.Tensor], scale: float) -> None:
    """``dst = src * scale`` pairwise (same shapes), multiplied in fp32 and rounded once into dst's dtype.

    Into fp32: ``_foreach_copy_`` (widening is exact) then ``_foreach_mul_``, one C++ loop each, not a Python loop
    of copy + mul.
    Into bf16/fp16 the product must be rounded once from fp32: ``torch.mul(..., out=)`` per tensor.
    """
    f64 = torch.float64
    if scale == 1.0:
        torch._foreach_copy_(dsts, srcs)
    elif all(d.dtype == f64 for d in dsts) or (
        all(d.dtype == torch.float32 for d in dsts) and all(s.dtype != f64 for s in srcs)
    ):  # widening copies are exact: one rounding, in the multiply (float64 destinations multiply in float64)
        torch._foreach_copy_(dsts, srcs)
        torch._foreach_mul_(dsts, scale)
    else:
        for dst, src in zip(dsts, srcs, strict=True):
            if dst.numel():
                torch.mul(src if src.dtype in (torch.float32, f64) else src.float(), scale, out=dst)


def _validate(tensors, flat, scale, layout, flat_name):
    if isinstance(tensors, torch.Tensor):
        raise TypeError("tensors must be a list of tensors, got a single tensor; wrap it in a list")
    tensors = list(tensors)
    if layout is None:
        layout = FlatLayout.of(tensors)
    elif not isinstance(layout, FlatLayout):
        raise TypeError(f"layout must be a FlatLayout, got {type(layout).__name__}")
    layout.check_buffer(flat, flat_name)
    layout.check_tensors(tensors)
    if flat.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{flat_name} has dtype {flat.dtype}; buckets are float32, bfloat16, float16 or float64")
    for i, t in enumerate(tensors):
        if t.device != flat.device:
            raise ValueError(f"tensors[{i}] is on {t.device} but {flat_name} is on {flat.device}; move them together")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"tensors[{i}] has dtype {t.dtype}; pack/unpack move float32, bfloat16, float16 or float64")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale must be a Python number, got {type(scale).__name__}")
    return tensors, layout


def pack(
    tensors: Sequence[torch.Tensor], out: torch.Tensor, scale: float = 1.0, *, layout: FlatLayout | None = None
) -> torch.Tensor:
    """Write ``tensors`` (any shapes, empty ones allowed) into the flat buffer ``out``, times ``scale``.

    Casts to ``out.dtype`` in the same pass (fp32 <-> bf16/fp16, rounding to nearest even). Offsets
    come from ``layout`` (default: ``FlatLayout.of(tensors)``, packed back to back).

    Args:
        tensors: A list of float32, bfloat16 or float16 tensors on ``out``'s device (not a single tensor).
        out: A 1-D contiguous float32, bfloat16 or float16 buffer of at least ``layout.total`` elements.
        scale: A Python number every value is multiplied by (in fp32) on the way.
        layout: Where each tensor goes in ``out``; it must describe ``tensors`` one for one.

    Returns:
        ``out``.

    Raises:
        TypeError: When ``tensors`` is a single tensor, ``layout`` is not a ``FlatLayout``, ``out`` is not a
            tensor, a dtype is not float32, bfloat16 or float16, or ``scale`` is not a Python number.
        ValueError: When ``out`` is not 1-D and contiguous or is too small, ``tensors`` do not match ``layout``
            in number or element counts, or a tensor is on another device than ``out``.
    """
    tensors, layout = _validate(tensors, out, scale, layout, "out")
    tensors = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    impl = pack_triton if use_triton(out) and not _float64(out, tensors) else pack_reference
    return impl(tensors, out, scale, layout=layout)


def unpack(
    flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float = 1.0, *, layout: FlatLayout | None = None
) -> list[torch.Tensor]:
    """Write the flat buffer ``flat``, times ``scale``, back into ``tensors`` in place (casting to each one's dtype).

    The reverse of :func:`pack` with the same layout.

    Args:
        flat: A 1-D contiguous float32, bfloat16 or float16 buffer of at least ``layout.total`` elements.
        tensors: A list of float32, bfloat16 or float16 tensors on ``flat``'s device (not a single tensor),
            overwritten in place.
        scale: A Python number every value is multiplied by (in fp32) on the way.
        layout: Where each tensor's values are in ``flat``; it must describe ``tensors`` one for one.

    Returns:
        ``tensors``, as a list.

    Raises:
        TypeError: When ``tensors`` is a single tensor, ``layout`` is not a ``FlatLayout``, ``flat`` is not a
            tensor, a dtype is not float32, bfloat16 or float16, or ``scale`` is not a Python number.
        ValueError: When ``flat`` is not 1-D and contiguous or is too small, ``tensors`` do not match ``layout``
            in number or element counts, or a tensor is on another device than ``flat``.
    """
    tensors, layout = _validate(tensors, flat, scale, layout, "flat")
    targets = [t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    impl = unpack_triton if use_triton(flat) and not _float64(flat, tensors) else unpack_reference
    impl(flat, targets, scale, layout=layout)
    for t, target in zip(tensors, targets, strict=True):
        if target is not t:
            t.copy_(target)
    return tensors
