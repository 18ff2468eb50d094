"""FlatLayout: where each tensor of a list lives inside one flat buffer.

The single definition of offsets used by the bucketing kernels (``pack``/``unpack``) and by
``gpudist/flat.py`` (flat parameter and gradient buffers, per-rank shard ranges). Tensor ``i``
occupies ``flat[offsets[i] : offsets[i] + numels[i]]``; starts are rounded up to a multiple of
``align`` elements and the gaps (padding) are never written by the kernels.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import lru_cache

import torch

__all__ = ["FlatLayout"]


class FlatLayout:
    """Offsets of a list of tensor shapes inside one flat buffer.

    Immutable after construction. The kernels' per-chunk index tables are built once per
    (chunk size, device, tensor selection) and cached here, so a layout reused every step (a
    gradient bucket) costs no host work or host-to-device copy after the first call.

    Args:
        shapes: The tensors' shapes, in buffer order.
        align: Every tensor starts at a multiple of this many elements (1: back to back).

    Raises:
        ValueError: When ``align`` is not a positive int.
    """

    def __init__(self, shapes: Iterable[Sequence[int]], align: int = 1):
        if not isinstance(align, int) or align < 1:
            raise ValueError(f"align={align!r} must be a positive number of elements")
        self.shapes: tuple[torch.Size, ...] = tuple(torch.Size(s) for s in shapes)
        self.align = align
        numels, offsets, cursor = [], [], 0
        for shape in self.shapes:
            cursor = -(-cursor // align) * align
            offsets.append(cursor)
            numels.append(shape.numel())
            cursor += shape.numel()
        self.numels: tuple[int, ...] = tuple(numels)
        self.offsets: tuple[int, ...] = tuple(offsets)
        #: Elements a buffer needs to hold every tensor (padding included, none after the last).
        self.total: int = cursor
        self._tables: dict[tuple, tuple[torch.Tensor, ...]] = {}

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], align: int = 1) -> FlatLayout:
        """The layout of ``tensors`` in list order; cached by shapes, so calling it every step is cheap.

        Args:
            tensors: The tensors (only their shapes matter).
            align: Every tensor starts at a multiple of this many elements.

        Returns:
            The (shared, cached) layout.

        Raises:
            ValueError: When ``align`` is not a positive int.
        """
        return _cached_layout(tuple(tuple(t.shape) for t in tensors), align)

    def __len__(self) -> int:
        return len(self.shapes)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FlatLayout) and (self.shapes, self.align) == (other.shapes, other.align)

    def __hash__(self) -> int:
        return hash((self.shapes, self.align))

    def __repr__(self) -> str:
        return f"FlatLayout({len(self)} tensors, total={self.total}, align={self.align})"

    def slice(self, index: int) -> slice:
        """The range tensor ``index`` occupies in the flat buffer.

        Args:
            index: The tensor's position in the layout.

        Returns:
            ``slice(offset, offset + numel)``.
        """
        return slice(self.offsets[index], self.offsets[index] + self.numels[index])

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views into ``flat`` shaped like the layout's tensors (writing a view writes the buffer).

        Not cached here: a view keeps its buffer's storage alive (and, through ``_base``, the buffer's Python
        object, so no weak reference to the buffer ever dies), so a cache of views in a layout shared by every
        buffer of that shape held the last buffers it saw, a full copy of the model among them. An owner that views
        its buffer every step keeps the views beside the buffer (:class:`gpudist.flat.FlatBuffer` does).

        Args:
            flat: A 1-D contiguous buffer of at least :attr:`total` elements.

        Returns:
            One view per tensor, in layout order.

        Raises:
            TypeError: When ``flat`` is not a tensor.
            ValueError: When ``flat`` is not 1-D and contiguous, or is too small.
        """
        self.check_buffer(flat)
        return [flat[self.slice(i)].view(shape) for i, shape in enumerate(self.shapes)]

    def check_buffer(self, flat: torch.Tensor, name: str = "flat buffer") -> None:
        """Raise a clear error unless ``flat`` is a 1-D contiguous tensor large enough for this layout.

        Args:
            flat: The buffer to check.
            name: How the error names it.

        Raises:
            TypeError: When ``flat`` is not a tensor.
            ValueError: When ``flat`` is not 1-D and contiguous, or has fewer than :attr:`total` elements.
        """
        if not isinstance(flat, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(flat).__name__}")
        if flat.dim() != 1 or not flat.is_contiguous():
            raise ValueError(
                f"{name} must be 1-D and contiguous, got shape {tuple(flat.shape)} "
                f"(contiguous={flat.is_contiguous()}); allocate it with torch.empty(layout.total)"
            )
        if flat.numel() < self.total:
            raise ValueError(f"{name} holds {flat.numel()} elements but the layout needs {self.total}")

    def check_tensors(self, tensors: Sequence[torch.Tensor], name: str = "tensors") -> None:
        """Raise a clear error unless ``tensors`` match this layout one for one in number of elements.

        Args:
            tensors: The tensors to check.
            name: How the error names them.

        Raises:
            ValueError: When their number, or one's element count, differs from the layout's.
        """
        if len(tensors) != len(self):
            raise ValueError(f"{name} has {len(tensors)} tensors but the layout describes {len(self)}")
        for i, (t, numel) in enumerate(zip(tensors, self.numels, strict=True)):
            if t.numel() != numel:
                raise ValueError(
                    f"{name}[{i}] has {t.numel()} elements (shape {tuple(t.shape)}) but the layout expects {numel} "
                    f"(shape {tuple(self.shapes[i])}); build the layout from these tensors with FlatLayout.of"
                )

    def chunk_table(self, block: int, device: torch.device, select: tuple[int, ...] | None = None):
        """Per-chunk index tables for a kernel that gives one program ``block`` elements of one tensor.

        Returns ``(chunk_tensor, chunk_start, offsets, numels)`` on ``device``: program ``p`` handles
        elements ``chunk_start[p] : chunk_start[p] + block`` of tensor ``chunk_tensor[p]`` (an index
        into ``select``, or into the whole layout), which lives at ``offsets[...]`` in the buffer.
        Empty tensors get no chunk. Cached per (block, device, select).

        Args:
            block: Elements per program.
            device: Where the tables live (the kernel's device).
            select: Indices of the tensors to cover, in table order; None: all of them.

        Returns:
            ``(chunk_tensor, chunk_start, offsets, numels)``, int64 tensors on ``device``.
        """
        key = (block, str(device), select)
        table = self._tables.get(key)
        if table is None:
            members = range(len(self)) if select is None else select
            chunk_tensor, chunk_start = [], []
            for local, index in enumerate(members):
                for start in range(0, self.numels[index], block):
                    chunk_tensor.append(local)
                    chunk_start.append(start)
            offsets = [self.offsets[i] for i in members]
            numels = [self.numels[i] for i in members]
            table = tuple(_to_device(values, device) for values in (chunk_tensor, chunk_start, offsets, numels))
            self._tables[key] = table
        return table


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as int64 on ``device``; to a GPU from pinned memory without blocking (no host sync; the caching
    pinned allocator keeps the source until the copy is done)."""
    host = torch.tensor(values, dtype=torch.int64)
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@lru_cache(maxsize=256)
def _cached_layout(shapes: tuple[tuple[int, ...], ...], align: int) -> FlatLayout:
    return FlatLayout(shapes, align)
