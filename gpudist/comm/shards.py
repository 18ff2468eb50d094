"""Uneven sizes: the single definition of how a flat buffer splits over the ranks.

A flat buffer of ``n`` elements is split over ``N`` ranks into contiguous ranges in rank order; the first ``n % N``
ranks get ``n // N + 1`` elements, the rest ``n // N`` (the ``numpy.array_split`` rule). :func:`split_sizes` and
:func:`shard_range` are that rule (``reduce_scatter`` and ``all_gather`` take it natively); ``gpudist.flat`` reuses
them.
"""

from __future__ import annotations

__all__ = ["shard_range", "split_sizes"]


def split_sizes(numel: int, world_size: int) -> list[int]:
    """Element counts of each rank's contiguous range when ``numel`` elements are split over ``world_size``.

    Args:
        numel: Elements of the flat buffer (>= 0).
        world_size: Ranks it is split over (>= 1).

    Returns:
        ``world_size`` counts in rank order: the first ``numel % world_size`` get ``numel // world_size + 1``.

    Raises:
        ValueError: When ``world_size < 1`` or ``numel < 0``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    base, extra = divmod(numel, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def _share(numel: int, world_size: int, rank: int) -> int:
    """``split_sizes(numel, world_size)[rank]`` without the list (checked on every collective)."""
    base, extra = divmod(numel, world_size)
    return base + (rank < extra)


def shard_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(start, end)`` of ``rank``'s range of a flat buffer of ``numel`` elements (see :func:`split_sizes`).

    Args:
        numel: Elements of the flat buffer.
        world_size: Ranks it is split over.
        rank: The rank whose range to return.

    Returns:
        ``(start, end)``, end exclusive.

    Raises:
        ValueError: When ``rank`` is not in ``0..world_size-1``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")
    base, extra = divmod(numel, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)
