"""The flat-shard optimizer base of ZeRO-1, ZeRO-2 and ZeRO-3: a rank owns *segments* of one flat parameter buffer and
steps them in place.

:class:`FlatShardOptimizer` keeps the owned ranges' fp32 master values (low-precision parameters), gradients and
optimizer state in contiguous "owned" buffers, so one fused kernel launch per parameter group updates everything the
rank owns; the global gradient norm (clipping, the non-finite skip) is one 8-byte all-reduce and stays on the device.
What differs between the stages (which ranges a rank owns, how their gradients arrive, how the updated parameters
return to every rank) is the subclasses' part, through the protected interface the class documents.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .. import kernels
from ..comm import shard_range, stable_hash
from ..config import ShardingConfiguration
from ..flat import BufferSpec, flatten_parameters, padded_range, padded_shard
from .flat_checkpoint import FlatCheckpoint
from .model import same_on_every_rank
from .optimizer import ShardedOptimizer
from .step_scalars import StepScale, _DeviceSteps, _LiveVerdict, _StepScalars, _Verdict

__all__ = ["FlatShardOptimizer"]

_GATHER_CHUNK_BYTES = 4 << 20
"""ZeRO-1/2 send their updated ranges in chunks of about this size (or the bucket cap if smaller; at most 8 per
region), each while the next one is updated."""
_FUSED = {torch.optim.AdamW: "adamw", torch.optim.Adam: "adam", torch.optim.SGD: "sgd"}


@dataclass(frozen=True)
class _Piece:
    """Part of a parameter group that this rank owns: flat[flat_offset : +length] <-> owned[owned_offset : +length]."""

    group: int
    flat_offset: int
    owned_offset: int
    length: int


def _fused_kind(optimizer: torch.optim.Optimizer) -> str | None:
    kind = next((name for cls, name in _FUSED.items() if type(optimizer) is cls), None)
    if kind is None:
        return None
    if any(g.get("amsgrad") or g.get("differentiable") for g in optimizer.param_groups):
        return None  # amsgrad / differentiable: the generic path (torch's own step over the owned views)
    for g in optimizer.param_groups:
        tensors = {k for k, v in g.items() if isinstance(v, torch.Tensor) or (k == "betas" and _has_tensor(v))}
        if tensors and not (tensors == {"lr"} and (kind == "sgd" or _device_counted(kind, optimizer))):
            return None  # tensor hyper-parameters the kernels take as numbers: torch's own step over the views
    return kind


def _has_tensor(values) -> bool:
    return any(isinstance(v, torch.Tensor) for v in values)


def _device_counted(kind: str | None, optimizer: torch.optim.Optimizer) -> bool:
    """Whether the fused Adam keeps its step counts on the device: the wrapped Adam/AdamW was built with
    ``capturable=True`` (its learning rate may then be a device tensor)."""
    return kind in ("adam", "adamw") and all(g.get("capturable") for g in optimizer.param_groups)


class FlatShardOptimizer(FlatCheckpoint, ShardedOptimizer):
    """The base of the ZeRO optimizers: owns *segments* of one flat parameter buffer and steps them with the fused
    kernels (Adam, AdamW, SGD: one launch per parameter group) or the wrapped optimizer over views.

    Shards: the owned segments' optimizer state, fp32 master values (low-precision parameters) and gradients.
    Communicates: one 8-byte all-reduce of the squared norm per step (clipping and the non-finite skip, decided on the
    device); the gradients' reduction and the parameters' return are the subclass's. A wrapped Adam/AdamW built with
    ``capturable=True`` keeps its step counts and bias corrections on the device too (its learning rate may be a
    device tensor), which a captured graph replays (docs/capture.md). Not used directly: ZeRO-1
    (:class:`~gpudist.ZeRO1Optimizer`), ZeRO-2 (:class:`~gpudist.ZeRO2Optimizer`) and ZeRO-3
    (:class:`~gpudist.ZeRO3Optimizer`) derive from it.

    Protected interface, for subclasses. A subclass decides *what it owns* and *how gradients arrive and updated
    parameters leave*, by overriding:

    - :meth:`owned_segments` (required; called once, from ``__init__``), and where the owned buffer is not the
      segments back to back, ``_owned_size()`` and ``_segment_spans()``; ``_flat_capacity(numel)`` for padding after
      the flat buffer's parameters; ``_replicated()`` False when ranks hold different parameters (ZeRO-3's shards),
      which skips the cross-rank layout check.
    - :meth:`reduce_gradients` (fill the owned gradient), :meth:`gradient_buffers` and
      ``_reduce_scatter_gradients()`` (the plain-module path), ``_gather_parameters()`` (the updated values back into
      the flat buffer on every rank) and ``_update_and_gather(scale)`` (update, then gather; override to overlap).

    It reads and writes these members, which the base creates in ``__init__`` and no other class touches:

    - ``_flat_params``: the trainable parameters in flat order; ``_flat``: their :class:`~gpudist.flat.FlatBuffer`.
    - ``_segments``: :meth:`owned_segments`' result; ``_owned_numel``: elements of the owned buffer.
    - ``_grad``: the owned gradient (a view of the model's reduced gradients where possible, else
      ``_private_grad()``); a subclass assigns it in :meth:`reduce_gradients`.
    - ``_master``: the owned fp32 values (None for fp32 parameters owned in several pieces); ``_master_is_view``:
      whether they are the flat buffer's own memory (fp32/fp64 parameters) rather than a separate copy.
    - ``_comm_hook``: the hook :meth:`register_comm_hook` installed, or None.

    and these helpers: ``_private_grad()``, ``_grad_views_for(start, length)``, ``_master_of(lo, hi)``,
    ``_gather_plan(key, make)``, ``_overlaps_gather()`` and ``_update_and_send(scale, regions)``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: ShardingConfiguration):
        super().__init__(optimizer, config)
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if not params:
            raise ValueError(f"{type(self).__name__}: the optimizer has no parameters that require grad")
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) != 1:
            raise ValueError(
                f"{type(self).__name__} needs all parameters in one dtype and device, got "
                f"{sorted(str(k) for k in kinds)}; cast the model first (e.g. model.float())"
            )
        layout = [len(g["params"]) for g in self.param_groups] + [s for p in params for s in (*p.shape, -1)]
        if self._replicated() and not same_on_every_rank(self.comm, stable_hash(layout)):  # before any change
            raise ValueError(
                f"{type(self).__name__}: rank {self.comm.rank}'s parameter groups or shapes differ from another "
                "rank's; every rank must build the same model and optimizer"
            )
        self._flat_params = params
        # The parameters live in one flat buffer, so an all-gather into it updates them in place. ZeRO1Model and
        # ZeRO2Model put them there at wrap time (adopted here as it is: no second copy of the model, even for a
        # moment); otherwise they move now.
        self._flat = flatten_parameters(params, self._flat_capacity(sum(p.numel() for p in params)))
        ends, offset = [], 0
        for g in self.param_groups:
            offset += sum(p.numel() for p in g["params"] if p.requires_grad)
            ends.append(offset)
        self._group_ends = ends
        self._segments = self.owned_segments()
        self._pieces = self._split_by_group()
        owned = self._owned_size()
        device, dtype = params[0].device, params[0].dtype
        # fp32 (and fp64) parameters are their own master: the owned pieces of the flat buffer are updated in place
        # (no copy; one launch per piece when the pieces are not contiguous, as ZeRO-2's per-bucket pieces).
        # Low-precision parameters get one contiguous fp32 master buffer. State is kept in the master's dtype.
        self._master_is_view = dtype in (torch.float32, torch.float64)
        self._state_dtype = dtype if self._master_is_view else torch.float32
        if self._master_is_view:
            start, length = self._segments[0] if len(self._segments) == 1 else (0, 0)
            self._master = self._flat.data[start : start + length] if len(self._segments) == 1 else None
        else:
            self._master = torch.empty(owned, dtype=torch.float32, device=device)
        self._refresh_master()
        # The owned gradients: a view of the model's where it has them in our order (no copy), else a buffer of our
        # own, allocated when first needed (``_private_grad``): none is held before the first step.
        self._owned_numel = owned
        self._grad = torch.empty(0, dtype=dtype, device=device)
        self._kind = _fused_kind(optimizer)
        if self._kind is not None:
            for g, group in enumerate(self.param_groups):
                lr = group["lr"]
                if isinstance(lr, torch.Tensor) and (lr.numel() != 1 or lr.device != device):
                    raise ValueError(
                        f"{type(self).__name__}: parameter group {g}'s lr is a tensor of {lr.numel()} element(s) on "
                        f"{lr.device}; the fused step reads it on the parameters' device: pass one element there "
                        f"(lr=torch.tensor(rate, device='{device}'))"
                    )
        self._steps = [0] * len(self.param_groups)
        self._device_steps: _DeviceSteps | None = None
        """The step counts on the device (Adam/AdamW built with ``capturable=True``, or any fused step once
        captured), advanced by the device's verdict; ``_steps`` then counts every step taken, skipped or not."""
        if _device_counted(self._kind, optimizer):
            self._device_steps = _DeviceSteps(self._steps, self._by_group(), device)
        self._capturing = False
        self._state: dict[str, torch.Tensor] = {}
        fp32_state = lambda: torch.zeros(owned, dtype=self._state_dtype, device=device)
        if self._kind in ("adam", "adamw"):
            self._state = {"exp_avg": fp32_state(), "exp_avg_sq": fp32_state()}
        elif self._kind == "sgd" and any(g["momentum"] != 0 for g in self.param_groups):
            self._state = {"momentum_buffer": fp32_state()}
        self._inner: torch.optim.Optimizer | None = None
        self._comm_hook = None
        self._plans: dict[tuple[int, int], kernels.AdamStep | kernels.SGDStep] = {}
        self._plans_key: tuple = ()
        self._gather_plans: dict[tuple, object] = {}
        """Planned collectives of the parameter gather (:meth:`_gather_plan`), and what their buffers were."""
        self._gather_plans_key: tuple = ()
        self._scalars: _StepScalars | None = None
        self._verdict = _Verdict(None)
        """The last step's global gradient norm, on the device (and on its way to the host)."""
        self._unsettled: list[tuple[_Verdict, list[int]]] = []
        """Fused steps whose verdict the host has not read yet, with the groups whose step count each incremented
        (taken back if the device skipped that step)."""
        if self._kind is None:
            self._views = [
                nn.Parameter(self._master_of(p.owned_offset, p.owned_offset + p.length)) for p in self._pieces
            ]
            groups = [{"params": [v], **self._hyper(p.group)} for v, p in zip(self._views, self._pieces, strict=True)]
            self._inner = type(optimizer)(groups, **optimizer.defaults) if groups else None

    def _replicated(self) -> bool:
        """Whether every rank holds all parameters (so their layout must agree); ZeRO-3's shards differ by rank."""
        return True

    def _flat_capacity(self, numel: int) -> int:
        """Elements of the flat parameter buffer: ``numel`` and the padding after it (ZeRO-1: whole even shards)."""
        return 0

    def _owned_size(self) -> int:
        """Elements of the owned buffer: the segments' slots, padding included."""
        return sum(length for _, length in self._segments)

    def _master_of(self, lo: int, hi: int) -> torch.Tensor:
        """The fp32 master values of owned[lo:hi]. Without a master buffer, owned[lo:hi] must also be contiguous in
        the flat parameters (``_by_group`` merges ranges only then)."""
        if self._master is not None:
            return self._master[lo:hi]
        if hi <= lo:  # this rank owns nothing of a bucket smaller than the world (its share is empty)
            return self._flat.data[:0]
        start, _, at = next(span for span in self._segment_spans() if span[2] <= lo < span[2] + span[1])
        return self._flat.data[start + lo - at : start + lo - at + hi - lo]

    def _refresh_master(self) -> None:
        """Set the fp32 master copy from the parameters (after they were overwritten, e.g. by a checkpoint)."""
        if not self._master_is_view:
            for start, length, at in self._segment_spans():
                self._master[at : at + length].copy_(self._flat.data[start : start + length])

    # -- partition ---------------------------------------------------------------------------------------------------

    def owned_segments(self) -> list[tuple[int, int]]:
        """(flat offset, length) ranges of the flat parameter buffer this rank updates, ascending.

        Returns:
            ``(offset in the flat parameter buffer, length)`` per owned range.
        """
        raise NotImplementedError

    def owned_ranges(self):
        """Where the owned buffer lies in the parameters, in owned-buffer order.

        Yields:
            ``(parameter, start in its flattened values, offset in the owned buffer, length)`` for every piece of
            a parameter this rank owns.
        """
        layout = self._flat.layout
        for start, length, at in self._segment_spans():
            for p, offset, numel in zip(self._flat_params, layout.offsets, layout.numels, strict=True):
                lo, hi = max(start, offset), min(start + length, offset + numel)
                if lo < hi:
                    yield p, lo - offset, at + lo - start, hi - lo

    @property
    def owned_gradient(self) -> torch.Tensor:
        """The owned gradients this rank steps, in owned-buffer order (valid from ``reduce_gradients`` to ``step``)."""
        return self._grad

    def _segment_spans(self):
        """``(flat offset, length, owned offset)`` of every segment, in owned order (back to back by default)."""
        at = 0
        for start, length in self._segments:
            yield start, length, at
            at += length

    def _split_by_group(self) -> list[_Piece]:
        pieces = []
        for start, length, at in self._segment_spans():
            begin = 0
            for g, end in enumerate(self._group_ends):
                lo, hi = max(start, begin), min(start + length, end)
                if lo < hi:
                    pieces.append(_Piece(g, lo, at + lo - start, hi - lo))
                begin = end
        return pieces

    def _hyper(self, group: int) -> dict:
        return {k: v for k, v in self.param_groups[group].items() if k != "params"}

    # -- gradients ---------------------------------------------------------------------------------------------------

    def _grad_views_for(self, start: int, length: int) -> list[torch.Tensor]:
        """Slices of the parameters' gradients covering flat[start : start + length] (no copy)."""
        views, layout, end = [], self._flat.layout, start + length
        for i, p in enumerate(self._flat_params):
            lo, hi = max(start, layout.offsets[i]), min(end, layout.offsets[i] + layout.numels[i])
            if lo < hi:
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                views.append(grad.reshape(-1)[lo - layout.offsets[i] : hi - layout.offsets[i]])
        return views

    def reduce_gradients(self) -> None:
        """Fill the owned gradient buffer with the global average of this rank's segments."""
        model = self.model()
        if model is not None:  # the model all-reduced full gradients: take our slices of them
            view = self._owned_gradient_view(model)
            if view is not None:
                self._grad = view
                return
            grad = self._private_grad()
            for start, length, at in self._segment_spans():
                kernels.pack(self._grad_views_for(start, length), grad[at : at + length])
            return
        self._reduce_scatter_gradients()

    def _private_grad(self) -> torch.Tensor:
        """The owned gradient buffer as memory of this optimizer's own, to write into: allocated on first use, and
        again after ``_grad`` was a view of the model's gradients (which a copy must not overwrite)."""
        grad, model = self._grad, self.model()
        borrowed = model is not None and grad.numel() and grad.untyped_storage().data_ptr() == self._storage_of(model)
        if grad.numel() != self._owned_numel or borrowed:  # zeros: the padding slots are never written
            self._grad = torch.zeros(self._owned_numel, dtype=grad.dtype, device=grad.device)
        return self._grad

    def _owned_gradient_view(self, model) -> torch.Tensor | None:
        """Our range of the model's one flat gradient buffer, when we own one range and every ``param.grad`` is a
        view into that buffer in our parameter order (then the update reads the gradients with no copy)."""
        flat = getattr(model, "flat_grads", None)
        same_order = [id(p) for p in model._params] == [id(p) for p in self._flat_params]
        if flat is None or len(self._segments) != 1 or not same_order:
            return None
        base, size = flat.data_ptr(), flat.element_size()
        for p, offset in zip(self._flat_params, self._flat.layout.offsets, strict=True):
            if p.grad is None or p.grad.data_ptr() != base + offset * size:
                return None  # e.g. dropped by zero_grad and no backward since: take the copying path
        start, length = self._segments[0]
        if start + length > flat.numel():  # ZeRO-1's padded range of a model whose gradient buffer has no padding
            return None
        return flat[start : start + length]

    @staticmethod
    def _storage_of(model) -> int | None:
        flat = getattr(model, "flat_grads", None)
        return None if flat is None else flat.untyped_storage().data_ptr()

    def _reduce_scatter_gradients(self) -> None:
        raise NotImplementedError

    def gradient_buffers(self) -> dict[int, BufferSpec]:
        """What this optimizer reduce-scatters itself when used with a plain module, by buffer index.

        Returns:
            Buffer index -> its :class:`~gpudist.flat.BufferSpec` (size, collective, parameter spans).
        """
        raise NotImplementedError

    def register_comm_hook(self, hook) -> None:
        """Used with a plain module: reduce-scatter every gradient buffer through ``hook.reduce_scatter(index, inp,
        out)`` (``out`` = this rank's piece of the average over ranks) instead of the plain reduce-scatter.

        Args:
            hook: An object with that ``reduce_scatter`` method, e.g. a gradient compression hook.
        """
        self._comm_hook = hook

    # -- stepping ----------------------------------------------------------------------------------------------------

    def capture_refusal(self) -> str | None:
        """Why a captured graph could not replay this step, or None. The fused Adam and AdamW keep their step counts
        on the host and pass the bias corrections to the kernel as numbers, which a graph would freeze at the captured
        step, unless the wrapped optimizer was built with ``capturable=True`` (counts and corrections on the device);
        the fused SGD's counts move to the device at capture. Other optimizers (and amsgrad) step through the wrapped
        one over owned views, deciding the non-finite skip on the host: refused."""
        name = type(self.optimizer).__name__
        if self._kind in ("adam", "adamw") and self._device_steps is None:
            return (
                f"its fused {self._kind} keeps its step count on the host (a graph would freeze the bias correction at "
                f"the captured step); build torch.optim.{name}(..., capturable=True), which keeps it on the device"
            )
        if self._kind is None:
            return (
                f"it steps torch.optim.{name} over its owned views and decides the non-finite skip on the host (a "
                "read of the device's verdict every step); capture it with Adam/AdamW(capturable=True) or SGD, "
                "which its fused kernels step on the device"
            )
        return super().capture_refusal()

    @contextlib.contextmanager
    def graph_capture(self) -> Iterator[None]:
        """A graph is being captured (:func:`gpudist.capture`): the verdicts of the eager steps before it are read
        now (a host sync, outside the graph), the fused step's counts move to the device if they were on the host,
        and inside, the step's verdict is the norm's device buffer (nothing copied for the host, no event recorded:
        a query of one during capture would invalidate it)."""
        if self._kind is not None and self._device_steps is None:
            self._settle(wait=True)
            self._device_steps = _DeviceSteps(self._steps, self._by_group(), self._flat.data.device)
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False

    def step(self, closure=None):
        """Reduce the gradients, take the global gradient norm (one all-reduce; collective), and, unless it is not
        finite (then every rank skips the step and ``last_step_skipped`` is True), clip to
        ``config.max_grad_norm``, update the owned values and all-gather the updated parameters.

        Args:
            closure: Re-evaluates the model and returns the loss (run with gradients enabled); None: use the
                gradients already computed.

        Returns:
            The closure's loss, or None without a closure.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._settle()
        self.reduce_gradients()
        # One all-reduce of the owned squared norms gives both the global norm (for clipping) and the non-finite
        # verdict every rank shares (a NaN anywhere makes every rank skip the step). Both stay on the device: the
        # fused kernels take the clip coefficient and the skip flag as tensors, so the step makes no host sync.
        scalars = self._scalars_on(self._grad.device)
        if self.gradient_norm_fn is not None:
            total = torch.as_tensor(self.gradient_norm_fn(), dtype=torch.float64, device=self._grad.device)
            scalars.total.copy_(total.reshape(1).square())
        else:
            scalars.squared_norm(self._grad)  # into scalars.total
            scalars.all_reduce.start().wait()  # one float64 on every rank (planned once: no per-step check)
        max_norm = self.config.max_grad_norm
        self._verdict = _LiveVerdict(scalars.total) if self._capturing else _Verdict(scalars.total, scalars.slots)
        if self._kind is not None and scalars.in_kernel:
            # The Triton steps take the skip flag and the clipping coefficient from the global norm themselves: a
            # step is the norm (one launch), its all-reduce and the update, with nothing launched in between.
            self._update_and_gather(StepScale(squared_norm=scalars.total, max_norm=max_norm))
            return loss
        # The norm, the skip flag and the clipping coefficient in one launch, into buffers kept from step to step.
        kernels.clip_scalars(scalars.total, scalars.norm, scalars.flags, max_norm)
        found_inf, scale = scalars.found_inf, scalars.clip if max_norm is not None else None
        if self._kind is None:  # torch's own step over views cannot take a device flag: decide on the host
            if self.last_step_skipped:
                return loss
            found_inf = None
        self._update_and_gather(StepScale(scale, found_inf))
        return loss

    def _scalars_on(self, device: torch.device) -> _StepScalars:
        """The step's scalar buffers on ``device`` (made on the first step, and again if the gradients moved or
        grew)."""
        scalars = self._scalars
        if scalars is None or scalars.total.device != device or scalars.squared_norm.numel < self._grad.numel():
            scalars = self._scalars = _StepScalars(self.comm, device, self._grad.numel())
        return scalars

    @property
    def last_grad_norm(self) -> float:
        """The global gradient norm of the last step, before clipping (NaN before the first). Reading it waits for
        the norm to reach the host: ask after the step, not inside a tight loop that should not sync."""
        return self._verdict.value()

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last step was skipped on every rank because the gradient norm was not finite."""
        return self._verdict.skipped()

    def _settle(self, wait: bool = False) -> None:
        """Take back the step counts of the steps the device skipped, for every verdict that has reached the host
        (all of them with ``wait``). A verdict is normally there by the next step (it was computed a whole forward
        and backward earlier), so this does not wait; if the device lags further behind, the check moves to the
        next step, and a step taken meanwhile uses a count one too high for its bias correction (only ever after a
        skipped step, which torch's GradScaler path handles no better)."""
        if not self._unsettled:
            return
        pending = []
        for verdict, groups in self._unsettled:
            if wait or verdict.ready():
                if verdict.skipped():
                    for g in groups:
                        self._steps[g] -= 1
            else:
                pending.append((verdict, groups))
        self._unsettled = pending

    def _update_and_gather(self, scale: StepScale) -> None:
        """Update the owned values, then bring every rank's updated parameters to all ranks."""
        if self._kind is not None:
            self._count_steps()
            self._fused_step(scale)
        elif self._inner is not None:  # None when this rank owns nothing (more ranks than elements)
            self._generic_step(scale)
        self._gather_parameters()

    def _overlaps_gather(self) -> bool:
        """Whether the update can be sent piece by piece as it is made: fused kernels on fp32 parameters (the owned
        values are the flat buffer's own, sent in place), more than one rank, and a transport where that pays
        (:attr:`~gpudist.CommunicationBackend.chunked_overlap`; on NCCL one all-gather per region is best)."""
        return (
            self._kind is not None and self._master_is_view and self.comm.world_size > 1 and self.comm.chunked_overlap
        )

    def _update_and_send(self, scale: StepScale, regions: list[tuple[int, int, int]]) -> None:
        """Update the owned values and send them, overlapped: each region ``(flat offset, numel, owned offset)`` is
        split over the ranks as its owned pieces are (:func:`~gpudist.flat.padded_range`) and this rank's range is
        updated in chunks of at most 4 MiB (up to 8 per region); once a chunk is updated it goes to every rank (one
        async broadcast per rank's matching chunk, straight into the flat buffer) while the next chunk is updated.
        Same bytes as all-gathering every region after the whole update, which on 2 Gloo processes left the update's
        time exposed (``benchmarks/zero.py``). A region of one chunk whose pieces are even has nothing to overlap: it
        goes in one all-gather in place instead of one broadcast per rank (on TCP each collective is a round trip)."""
        self._count_steps()
        works = []
        for window, sends in self._gather_plan(("send", tuple(regions)), lambda: self._send_schedule(regions)):
            if window is not None:
                self._fused_step(scale, window)
            works += [send() for send in sends]
        for work in works:
            work.wait()

    def _send_schedule(self, regions: list[tuple[int, int, int]]) -> list[tuple[tuple[int, int] | None, list]]:
        """:meth:`_update_and_send`'s chunks, decided once: per chunk, the owned window to update (None: this rank
        owns none of it) and its sends, each a call that starts a planned collective and returns its Work (sizes agree
        by construction: the layout was checked across ranks when built). Uneven regions keep the broadcasts of the
        real pieces even as one chunk: one padded all-gather would need buffers made per region, all alive until the
        sends are waited for (a second copy of the parameters at the peak)."""
        world, rank, flat = self.comm.world_size, self.comm.rank, self._flat.data
        chunk_bytes = min(_GATHER_CHUNK_BYTES, self.config.bucket_cap_bytes())
        schedule = []
        for offset, numel, owned_at in regions:
            ranges = [padded_range(numel, world, r) for r in range(world)]
            widest = max(end - start for start, end in ranges)
            chunks = max(1, min(8, -(-widest * flat.element_size() // chunk_bytes)))
            mine = ranges[rank][1] - ranges[rank][0]
            shard = padded_shard(numel, world)
            if chunks == 1 and numel == world * shard:  # even: one all-gather of this rank's piece, in place
                plan = self.comm.plan_all_gather(numel, flat.dtype)
                start, end = ranges[rank]
                piece, region = flat[offset + start : offset + end], flat[offset : offset + numel]
                schedule.append(((owned_at, owned_at + mine), [functools.partial(plan.start, piece, region)]))
                continue
            for c in range(chunks):
                lo, hi = shard_range(mine, chunks, c)
                window = (owned_at + lo, owned_at + hi) if hi > lo else None
                sends = []
                for r, (start, end) in enumerate(ranges):
                    a, b = shard_range(end - start, chunks, c)
                    if b > a:
                        sends.append(self.comm.plan_broadcast(flat[offset + start + a : offset + start + b], r).start)
                schedule.append((window, sends))
        return schedule

    def _count_steps(self) -> None:
        groups = list(self._by_group())
        for g in groups:
            self._steps[g] += 1
        if self._device_steps is None:
            self._unsettled.append((self._verdict, groups))
        else:  # counted on the device; the Triton Adam reads its coefficients there too
            adam = self._kind != "sgd" and self._scalars.in_kernel
            self._device_steps.advance(self._scalars.total, self.param_groups if adam else None)

    def _step_counts(self) -> list[int]:
        """Every group's count of steps taken (not skipped), on the host (a sync when counted on the device)."""
        if self._device_steps is not None:
            return self._device_steps.host_counts()
        self._settle(wait=True)
        return list(self._steps)

    def _set_step_counts(self, steps: list[int]) -> None:
        self._steps, self._unsettled = list(steps), []
        if self._device_steps is not None:
            self._device_steps.load(steps)

    def _fused_step(self, scale: StepScale, window: tuple[int, int] | None = None) -> None:
        """The fused update of every owned piece, restricted to owned[window[0]:window[1]] if given: Adam and AdamW
        in one launch per parameter group over all its pieces (:class:`~gpudist.kernels.AdamSegments`; ZeRO-2 has
        one per bucket), SGD and a window in one launch per contiguous piece."""
        plans = self._step_plans()
        for g, pieces in self._by_group().items():
            h = self.param_groups[g]
            common = {
                "lr": h["lr"],
                "weight_decay": h.get("weight_decay", 0.0),
                "maximize": h.get("maximize", False),
                "grad_scale_tensor": scale.clip,
                "found_inf": scale.found_inf,
                "squared_norm": scale.squared_norm,
                "max_norm": scale.max_norm,
            }
            if self._kind != "sgd":
                beta1, beta2 = h["betas"]
                common.update(
                    step=self._steps[g] if self._device_steps is None else self._device_steps.steps[g],
                    beta1=beta1,
                    beta2=beta2,
                    eps=h["eps"],
                    decoupled_weight_decay=self._kind == "adamw",
                )
                if window is None and len(pieces) > 1:
                    key = ("segments", g)
                    if key not in plans:
                        plans[key] = self._segments_plan(pieces)
                    if plans[key] is not None:  # None: pieces that would lose 16-byte accesses, one launch each
                        plans[key](self._grad, **common)
                        continue
            else:
                common.update(momentum=h["momentum"], dampening=h["dampening"], nesterov=h["nesterov"])
                common["first_step"] = self._steps[g] == 1
            for lo, hi in pieces:
                if window is not None:
                    lo, hi = max(lo, window[0]), min(hi, window[1])
                    if lo >= hi:
                        continue
                plan = plans.get((lo, hi))
                if plan is None:
                    plan = plans[(lo, hi)] = self._step_plan(lo, hi)
                plan(self._grad[lo:hi], **common)

    def _segments_plan(self, pieces: list[tuple[int, int]]) -> kernels.AdamSegments | None:
        """A group's owned pieces as one :class:`~gpudist.kernels.AdamSegments`: their parameter offsets in the
        master (or the flat parameters, fp32's own master); None where its kernel would lose its 16-byte accesses."""
        base = self._master if self._master is not None else self._flat.data
        size = base.element_size()
        segments = [((self._master_of(lo, hi).data_ptr() - base.data_ptr()) // size, lo, hi - lo) for lo, hi in pieces]
        state = self._state
        plan = kernels.AdamSegments(base, self._grad, state["exp_avg"], state["exp_avg_sq"], segments)
        return plan if plan.aligned else None

    def _step_plans(self) -> dict[tuple[int, int], kernels.AdamStep | kernels.SGDStep]:
        """The fused step's plans by owned range (built on first use, checked once), kept while the buffers they
        slice keep their memory: the master or flat parameters and the state (the gradients come with each call:
        ZeRO-3 frees them at zero_grad, and plans must not keep them alive)."""
        owners = (self._master if self._master is not None else self._flat.data, *self._state.values())
        key = tuple((t.data_ptr(), t.numel(), t.dtype) for t in owners)
        if key != self._plans_key:
            self._plans, self._plans_key = {}, key
        return self._plans

    def _gather_plan(self, key: tuple, make):
        """The planned collective ``make()`` returns, built once per ``key`` (its buffers and their memory) and kept
        from step to step: the parameter gather checks nothing per step. Plans of buffers that moved (a checkpoint
        load that replaced them) are dropped."""
        held = (self._flat.data.data_ptr(), None if self._master is None else self._master.data_ptr())
        if held != self._gather_plans_key:
            self._gather_plans, self._gather_plans_key = {}, held
        plan = self._gather_plans.get(key)
        if plan is None:
            plan = self._gather_plans[key] = make()
        return plan

    def _step_plan(self, lo: int, hi: int) -> kernels.AdamStep | kernels.SGDStep:
        param, grad, state = self._master_of(lo, hi), self._grad[lo:hi], self._state
        if self._kind == "sgd":
            buf = state.get("momentum_buffer")
            return kernels.SGDStep(param, grad, None if buf is None else buf[lo:hi])
        return kernels.AdamStep(param, grad, state["exp_avg"][lo:hi], state["exp_avg_sq"][lo:hi])

    def _by_group(self) -> dict[int, list[tuple[int, int]]]:
        merged: dict[int, list[tuple[int, int]]] = {}
        previous = None
        for p in self._pieces:
            spans = merged.setdefault(p.group, [])
            # The next piece of the same group in owned order: one launch over both when the owned buffers are the
            # optimizer's own (a master copy; the padding slot between them is zeros, and stays zero), or when they
            # are adjacent in the owned buffer and in the flat parameters too.
            follows = previous is not None and previous.group == p.group
            adjacent = (
                follows and spans[-1][1] == p.owned_offset and previous.flat_offset + previous.length == p.flat_offset
            )
            if follows and (self._master is not None or adjacent):
                spans[-1] = (spans[-1][0], p.owned_offset + p.length)
            else:
                spans.append((p.owned_offset, p.owned_offset + p.length))
            previous = p
        return merged

    def _generic_step(self, scale: StepScale) -> None:
        for view, piece, inner_group in zip(self._views, self._pieces, self._inner.param_groups, strict=True):
            inner_group.update(self._hyper(piece.group))  # LR schedulers edit our groups: follow them
            view.grad = self._grad[piece.owned_offset : piece.owned_offset + piece.length].to(self._state_dtype)
            if scale.clip is not None:
                view.grad.mul_(scale.clip)
        self._inner.step()

    def _gather_parameters(self) -> None:
        raise NotImplementedError

    # -- state -------------------------------------------------------------------------------------------------------

    def state_bytes(self, params: set[int] | None = None) -> int:
        tensors = list(self._state.values())
        if self._inner is not None:
            inner = self._inner.state.values()
            tensors += [v for entry in inner for v in entry.values() if isinstance(v, torch.Tensor)]
        if not self._master_is_view:
            tensors.append(self._master)
        return sum(t.numel() * t.element_size() for t in tensors)
