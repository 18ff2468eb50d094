"""How ``all_reduce`` and ``reduce_scatter`` combine the ranks' values: :class:`ReductionOperation`."""

from __future__ import annotations

import enum

__all__ = ["ReductionOperation"]


class ReductionOperation(enum.Enum):
    """How ``all_reduce`` and ``reduce_scatter`` combine the ranks' values."""

    SUM = "sum"
    AVERAGE = "average"
    MAX = "max"
    MIN = "min"
    PRODUCT = "product"

    @classmethod
    def parse(cls, op: ReductionOperation | str) -> ReductionOperation:
        """The reduction ``op`` names.

        Args:
            op: A ``ReductionOperation``, or a name: ``"sum"``, ``"average"`` (``"avg"``, ``"mean"``), ``"max"``,
                ``"min"`` or ``"product"`` (``"prod"``), in any case.

        Returns:
            The ``ReductionOperation``.

        Raises:
            ValueError: When ``op`` is neither a ``ReductionOperation`` nor one of those names.
        """
        if isinstance(op, cls):
            return op
        if isinstance(op, str):
            key = op.strip().upper()
            key = {"AVG": "AVERAGE", "MEAN": "AVERAGE", "PROD": "PRODUCT"}.get(key, key)
            if key in cls.__members__:
                return cls[key]
        raise ValueError(f"unknown reduction {op!r}; use one of {', '.join(cls.__members__)}")
