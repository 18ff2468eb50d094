"""ShardingConfiguration: how a strategy communicates, shared by a model wrapper and its optimizer."""

from __future__ import annotations

import dataclasses
import math
import weakref

import torch

from .comm import CommunicationBackend

__all__ = ["ShardingConfiguration"]

_COMM_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass
class ShardingConfiguration:
    """Settings a ``ShardedModel`` and its ``ShardedOptimizer`` share. Validated on construction.

    A model wrapper and its optimizer pair up in one of two ways: ``ZeRO2Optimizer(inner, model)`` names the model
    (explicit), or ``ZeRO2Optimizer(inner, config)`` with the config the model was built from, which finds the model
    that reduces the optimizer's parameters (:meth:`model_for`). Either way the optimizer learns that the model
    already reduces gradients, and never reduces them twice.

    Each field is described in full at its attribute below.

    Args:
        backend: The group every collective runs on (required).
        bucket_cap_mb: Gradient bucket size in MiB (> 0).
        first_bucket_mb: Size of the first bucket in MiB (> 0).
        communication_dtype: None, ``torch.float32``, ``torch.bfloat16`` or ``torch.float16``.
        find_unused_parameters: Allow parameters that get no gradient in some steps.
        gradient_as_bucket_view: Make ``param.grad`` views into the gradient buckets.
        static_graph: Every backward uses the same parameters in the same order (one hook per bucket).
        broadcast_buffers: Broadcast module buffers from rank 0 before each training forward.
        overlap_communication: Start each bucket's collective during backward.
        max_grad_norm: Clip gradients to this global L2 norm (> 0); None: no clipping.

    Raises:
        TypeError: When ``backend`` is not a gpudist ``CommunicationBackend``.
        ValueError: When ``bucket_cap_mb`` or ``first_bucket_mb`` is not a positive finite number,
            ``communication_dtype`` is not one of the dtypes above, or ``max_grad_norm`` is neither None nor a
            positive number.
    """

    backend: CommunicationBackend
    """The group every collective of this strategy runs on (``gpudist.init()`` gives the world group)."""

    bucket_cap_mb: float = 25.0
    """Gradient bucket size in MiB (as torch DDP). Bigger buckets: fewer, more efficient collectives;
    smaller: communication starts earlier in backward and overlaps more of it."""

    first_bucket_mb: float = 1.0
    """Size of the first bucket (the last parameters, whose gradients are ready first) in MiB; small so
    the first collective starts as early as possible."""

    communication_dtype: torch.dtype | None = None
    """Dtype gradients travel in: None keeps each gradient's dtype; ``torch.bfloat16`` halves the bytes
    (the reduced values are accumulated back into fp32 gradients)."""

    find_unused_parameters: bool = False
    """Allow parameters that get no gradient in some steps (branches, frozen heads). Off: a bucket waits
    for all of its gradients, and a step that leaves one unused raises a clear error at the next step."""

    gradient_as_bucket_view: bool = True
    """Make ``param.grad`` a view into the flat gradient bucket: saves one copy of the gradients each way
    and their memory. With a low-precision ``communication_dtype`` the bucket stays in the gradients' dtype
    and one kernel pass casts it to the wire."""

    static_graph: bool = False
    """Promise that every backward uses the same parameters, whose gradients arrive in the same order (torch DDP's
    ``static_graph``). After two backward passes that agree, each bucket keeps one hook, on the gradient that
    completes it, instead of one per parameter: Python work inside backward per bucket, not per parameter (what a
    GPU waits for in a host-bound step). A backward that breaks the promise is refused with an error where it shows
    (a bucket complete with a gradient missing); one that accumulates in place (``zero_grad(set_to_none=False)``)
    cannot be checked. DDP, ZeRO-1 and ZeRO-2; FSDP ignores it."""

    broadcast_buffers: bool = True
    """Broadcast module buffers (e.g. BatchNorm statistics) from rank 0 before each forward."""

    overlap_communication: bool = True
    """Start each bucket's collective as soon as its gradients are ready during backward. Off: all
    collectives run after backward (simpler to profile; slower)."""

    max_grad_norm: float | None = None
    """Clip gradients to this global L2 norm (across all ranks and shards) before each optimizer step."""

    _models: weakref.WeakSet = dataclasses.field(default_factory=weakref.WeakSet, init=False, repr=False, compare=False)
    """Model wrappers built with this configuration, for :meth:`model_for` (they add themselves when built)."""

    def __post_init__(self) -> None:
        if not isinstance(self.backend, CommunicationBackend):
            raise TypeError(
                f"backend must be a gpudist CommunicationBackend, got {type(self.backend).__name__}; "
                "create one with gpudist.init() or InMemoryCommunicationBackend(rank, world_size)"
            )
        for name in ("bucket_cap_mb", "first_bucket_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive number of MiB (torch DDP's default is 25)")
        if self.communication_dtype not in _COMM_DTYPES:
            raise ValueError(
                f"communication_dtype={self.communication_dtype!r} must be None, torch.float32, torch.bfloat16 "
                "or torch.float16"
            )
        if self.max_grad_norm is not None and (
            isinstance(self.max_grad_norm, bool)
            or not isinstance(self.max_grad_norm, (int, float))
            or not self.max_grad_norm > 0
        ):
            raise ValueError(f"max_grad_norm={self.max_grad_norm!r} must be a positive number or None")

    @property
    def world_size(self) -> int:
        """The number of ranks of ``backend``."""
        return self.backend.world_size

    @property
    def rank(self) -> int:
        """This rank in ``backend``."""
        return self.backend.rank

    def model_for(self, params: list[torch.Tensor]):
        """The model wrapper built with this configuration that reduces the gradients of every one of ``params``
        (its :meth:`~gpudist.ShardedModel.manages`): how ``Optimizer(inner, config)`` finds its model.

        Args:
            params: The parameters an optimizer steps (those that require grad).

        Returns:
            That ``ShardedModel``, or None when no wrapper built with this configuration manages them all.
        """
        return next((m for m in list(self._models) if all(m.manages(p) for p in params)), None)

    def bucket_cap_bytes(self, first: bool = False) -> int:
        """A gradient bucket's capacity in bytes.

        Args:
            first: The first bucket's (``first_bucket_mb``) rather than the others' (``bucket_cap_mb``).

        Returns:
            The capacity, ``MiB * 2**20`` rounded down.
        """
        return int((self.first_bucket_mb if first else self.bucket_cap_mb) * (1 << 20))
