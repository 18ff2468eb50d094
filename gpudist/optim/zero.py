"""ZeRO optimizers: optimizer state (and the update) split across ranks by ranges of the flat parameter buffer.

The machinery is shared: a rank owns a list of *segments* of the flat parameter buffer (``(offset, length)``,
in parameter order) and keeps their fp32 master values, gradients and optimizer state in contiguous
"owned" buffers, so one fused kernel launch updates everything it owns (one per parameter group). ZeRO-1
owns one contiguous range per rank (``shard_range``); later stages only change how segments and gradients
are obtained.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .. import kernels
from ..comm import ReductionOperation, shard_range
from ..comm.base import _stable_hash
from ..config import ShardingConfiguration
from ..flat import BufferSpec, flatten_parameters, partition_buckets
from ..models.base import same_on_every_rank
from ..models.zero3 import ZeRO3Model
from .base import ShardedOptimizer

__all__ = ["ZeRO1Optimizer", "ZeRO2Optimizer", "ZeRO3Optimizer"]

_GATHER_CHUNK_BYTES = 4 << 20
"""ZeRO-1 sends its updated range in chunks of about this size (or the bucket cap if smaller; at most 8 chunks),
each while the next one is updated."""
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
    return kind


class _FlatShardOptimizer(ShardedOptimizer):
    """Owns segments of the flat parameter buffer; steps them with the fused kernels or the wrapped optimizer."""

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
        if self._replicated() and not same_on_every_rank(self.comm, _stable_hash(layout)):  # before any change
            raise ValueError(
                f"{type(self).__name__}: rank {self.comm.rank}'s parameter groups or shapes differ from another "
                "rank's; every rank must build the same model and optimizer"
            )
        self._flat_params = params
        # The parameters live in one flat buffer, so an all-gather into it updates them in place. ZeRO1Model and
        # ZeRO2Model put them there at wrap time (adopted here as it is: no second copy of the model, even for a
        # moment); otherwise they move now.
        self._flat = flatten_parameters(params)
        ends, offset = [], 0
        for g in self.param_groups:
            offset += sum(p.numel() for p in g["params"] if p.requires_grad)
            ends.append(offset)
        self._group_ends = ends
        self._segments = self.owned_segments()
        self._pieces = self._split_by_group(self._segments)
        owned = sum(length for _, length in self._segments)
        device, dtype = params[0].device, params[0].dtype
        # fp32 parameters are their own master: the owned pieces of the flat buffer are updated in place (no copy;
        # one launch per piece when the pieces are not contiguous, as ZeRO-2's per-bucket pieces). Low-precision
        # parameters get one contiguous fp32 master buffer.
        self._master_is_view = dtype == torch.float32
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
        self._steps = [0] * len(self.param_groups)
        self._state: dict[str, torch.Tensor] = {}
        fp32_state = lambda: torch.zeros(owned, dtype=torch.float32, device=device)
        if self._kind in ("adam", "adamw"):
            self._state = {"exp_avg": fp32_state(), "exp_avg_sq": fp32_state()}
        elif self._kind == "sgd" and any(g["momentum"] != 0 for g in self.param_groups):
            self._state = {"momentum_buffer": fp32_state()}
        self._inner: torch.optim.Optimizer | None = None
        self._comm_hook = None
        self.last_step_skipped, self.last_grad_norm = False, math.nan
        if self._kind is None:
            self._views = [
                nn.Parameter(self._master_of(p.owned_offset, p.owned_offset + p.length)) for p in self._pieces
            ]
            groups = [{"params": [v], **self._hyper(p.group)} for v, p in zip(self._views, self._pieces, strict=True)]
            self._inner = type(optimizer)(groups, **optimizer.defaults) if groups else None

    def _replicated(self) -> bool:
        """Whether every rank holds all parameters (so their layout must agree); ZeRO-3's shards differ by rank."""
        return True

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

    # -- partition --------------------------------------------------------------------------------------------------

    def owned_segments(self) -> list[tuple[int, int]]:
        """(flat offset, length) ranges of the flat parameter buffer this rank updates, ascending."""
        raise NotImplementedError

    def _segment_spans(self):
        at = 0
        for start, length in self._segments:
            yield start, length, at
            at += length

    def _split_by_group(self, segments) -> list[_Piece]:
        pieces, at = [], 0
        for start, length in segments:
            begin = 0
            for g, end in enumerate(self._group_ends):
                lo, hi = max(start, begin), min(start + length, end)
                if lo < hi:
                    pieces.append(_Piece(g, lo, at + lo - start, hi - lo))
                begin = end
            at += length
        return pieces

    def _hyper(self, group: int) -> dict:
        return {k: v for k, v in self.param_groups[group].items() if k != "params"}

    # -- gradients --------------------------------------------------------------------------------------------------

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
        if grad.numel() != self._owned_numel or borrowed:
            self._grad = torch.empty(self._owned_numel, dtype=grad.dtype, device=grad.device)
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
        return flat[start : start + length]

    @staticmethod
    def _storage_of(model) -> int | None:
        flat = getattr(model, "flat_grads", None)
        return None if flat is None else flat.untyped_storage().data_ptr()

    def _reduce_scatter_gradients(self) -> None:
        raise NotImplementedError

    def gradient_buffers(self) -> dict[int, BufferSpec]:
        """What this optimizer reduce-scatters itself when used with a plain module, by buffer index."""
        raise NotImplementedError

    def register_comm_hook(self, hook) -> None:
        """Used with a plain module: reduce-scatter every gradient buffer through ``hook.reduce_scatter(index, inp,
        out)`` (``out`` = this rank's piece of the average over ranks) instead of the plain reduce-scatter."""
        self._comm_hook = hook

    # -- stepping ---------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.reduce_gradients()
        # One all-reduce of the owned squared norms gives both the global norm (for clipping) and the
        # non-finite verdict every rank shares (a NaN anywhere makes every rank skip the step).
        if self.gradient_norm_fn is not None:
            norm = self.gradient_norm_fn()
        else:
            total = kernels.squared_norm(self._grad).reshape(1).double()
            self.comm.all_reduce(total, ReductionOperation.SUM)
            norm = math.sqrt(total.item())
        if not math.isfinite(norm):
            self.last_step_skipped = True
            return loss
        self.last_step_skipped = False
        scale = 1.0
        if self.config.max_grad_norm is not None:
            scale = min(1.0, self.config.max_grad_norm / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s rule
        self.last_grad_norm = norm
        self._update_and_gather(scale)
        return loss

    def _update_and_gather(self, scale: float) -> None:
        """Update the owned values, then bring every rank's updated parameters to all ranks."""
        if self._kind is not None:
            self._count_steps()
            self._fused_step(scale)
        elif self._inner is not None:  # None when this rank owns nothing (more ranks than elements)
            self._generic_step(scale)
        self._gather_parameters()

    def _overlaps_gather(self) -> bool:
        """Whether the update can be sent piece by piece as it is made: fused kernels on fp32 parameters (the owned
        values are the flat buffer's own, sent in place) and more than one rank."""
        return self._kind is not None and self._master_is_view and self.comm.world_size > 1

    def _update_and_send(self, scale: float, regions: list[tuple[int, int, int]]) -> None:
        """Update the owned values and send them, overlapped: each region ``(flat offset, numel, owned offset)`` is
        split evenly over the ranks (:func:`shard_range`) and this rank's range is updated in chunks of at most
        4 MiB (up to 8 per region); once a chunk is updated it goes to every rank (one async broadcast per rank's
        matching chunk, straight into the flat buffer) while the next chunk is updated. Same bytes as all-gathering
        every region after the whole update, which on 2 Gloo processes left the update's time exposed
        (``benchmarks/zero.py``)."""
        world, rank, flat = self.comm.world_size, self.comm.rank, self._flat.data
        chunk_bytes = min(_GATHER_CHUNK_BYTES, self.config.bucket_cap_bytes())
        self._count_steps()
        works = []
        with self.comm.unchecked():  # sizes agree by construction (layout checked across ranks when built)
            for offset, numel, owned_at in regions:
                ranges = [shard_range(numel, world, r) for r in range(world)]
                widest = max(end - start for start, end in ranges)
                chunks = max(1, min(8, -(-widest * flat.element_size() // chunk_bytes)))
                mine = ranges[rank][1] - ranges[rank][0]
                for c in range(chunks):
                    lo, hi = shard_range(mine, chunks, c)
                    if hi > lo:
                        self._fused_step(scale, (owned_at + lo, owned_at + hi))
                    for r, (start, end) in enumerate(ranges):
                        lo, hi = shard_range(end - start, chunks, c)
                        if hi > lo:
                            piece = flat[offset + start + lo : offset + start + hi]
                            works.append(self.comm.broadcast(piece, src=r, async_op=True))
        for work in works:
            work.wait()

    def _count_steps(self) -> None:
        for g in self._by_group():
            self._steps[g] += 1

    def _fused_step(self, scale: float, window: tuple[int, int] | None = None) -> None:
        """One fused launch per contiguous owned piece, restricted to owned[window[0]:window[1]] if given."""
        for g, pieces in self._by_group().items():
            h = self.param_groups[g]
            for lo, hi in pieces:
                if window is not None:
                    lo, hi = max(lo, window[0]), min(hi, window[1])
                    if lo >= hi:
                        continue
                args = {
                    "param": self._master_of(lo, hi),
                    "grad": self._grad[lo:hi],
                    "grad_scale": scale,
                    "check_finite": False,
                    "maximize": h.get("maximize", False),
                    "lr": h["lr"],
                    "weight_decay": h.get("weight_decay", 0.0),
                }
                if self._kind == "sgd":
                    buf = self._state.get("momentum_buffer")
                    kernels.sgd_step(
                        momentum_buffer=None if buf is None else buf[lo:hi],
                        momentum=h["momentum"],
                        dampening=h["dampening"],
                        nesterov=h["nesterov"],
                        first_step=self._steps[g] == 1,
                        **args,
                    )
                else:
                    beta1, beta2 = h["betas"]
                    state = self._state
                    kernels.adam_step(
                        exp_avg=state["exp_avg"][lo:hi],
                        exp_avg_sq=state["exp_avg_sq"][lo:hi],
                        step=self._steps[g],
                        beta1=beta1,
                        beta2=beta2,
                        eps=h["eps"],
                        decoupled_weight_decay=self._kind == "adamw",
                        **args,
                    )

    def _by_group(self) -> dict[int, list[tuple[int, int]]]:
        merged: dict[int, list[tuple[int, int]]] = {}
        flat_end = -1
        for p in self._pieces:
            spans = merged.setdefault(p.group, [])
            # adjacent in the owned buffer (and, without a master buffer, in the flat parameters too): one launch
            if spans and spans[-1][1] == p.owned_offset and (self._master is not None or flat_end == p.flat_offset):
                spans[-1] = (spans[-1][0], p.owned_offset + p.length)
            else:
                spans.append((p.owned_offset, p.owned_offset + p.length))
            flat_end = p.flat_offset + p.length
        return merged

    def _generic_step(self, scale: float) -> None:
        for view, piece, inner_group in zip(self._views, self._pieces, self._inner.param_groups, strict=True):
            inner_group.update(self._hyper(piece.group))  # LR schedulers edit our groups: follow them
            view.grad = self._grad[piece.owned_offset : piece.owned_offset + piece.length].to(torch.float32) * scale
        self._inner.step()

    def _gather_parameters(self) -> None:
        raise NotImplementedError

    # -- state ------------------------------------------------------------------------------------------------------

    def state_bytes(self, params: set[int] | None = None) -> int:
        tensors = list(self._state.values())
        if self._inner is not None:
            inner = self._inner.state.values()
            tensors += [v for entry in inner for v in entry.values() if isinstance(v, torch.Tensor)]
        if not self._master_is_view:
            tensors.append(self._master)
        return sum(t.numel() * t.element_size() for t in tensors)

    def state_dict(self) -> dict:
        """This rank's shard of the optimizer state (resharding checkpoints: gpudist.checkpoint, next release)."""
        return {
            "strategy": self.strategy,
            "world_size": self.comm.world_size,
            "rank": self.comm.rank,
            "segments": list(self._segments),
            "steps": list(self._steps),
            "state": {k: v.clone() for k, v in self._state.items()},
            "inner": self._inner.state_dict() if self._inner is not None else None,
            "param_groups": [self._hyper(g) for g in range(len(self.param_groups))],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("world_size") != self.comm.world_size or state_dict.get("segments") != list(self._segments):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the state was saved at world size "
                f"{state_dict.get('world_size')} with segments {state_dict.get('segments')}, this rank owns "
                f"{list(self._segments)} at world size {self.comm.world_size}; load across world sizes through a "
                "gpudist checkpoint"
            )
        for key, value in state_dict["state"].items():
            self._state[key].copy_(value)
        self._steps = list(state_dict["steps"])
        if self._inner is not None:
            self._inner.load_state_dict(state_dict["inner"])
        for group, hyper in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update(hyper)


class ZeRO1Optimizer(_FlatShardOptimizer):
    """ZeRO stage 1: each rank keeps the optimizer state of one contiguous 1/N range of the flat parameters.

    Shards: optimizer state (and the fp32 master copy for low-precision parameters). Communicates: the
    gradients' average (the model's all-reduce, or a reduce-scatter when used with a plain module), then one
    all-gather of the updated parameters: 2(N-1)/N x P per rank on a ring, as DDP. Adam, AdamW and SGD step
    the owned range in one fused kernel launch per parameter group; any other torch optimizer steps views of it.
    Use it when the optimizer state is what does not fit.
    """

    strategy = "zero1"

    def owned_segments(self) -> list[tuple[int, int]]:
        start, end = shard_range(self._flat.layout.total, self.comm.world_size, self.comm.rank)
        return [(start, end - start)]

    def gradient_buffers(self) -> dict[int, BufferSpec]:
        return {0: BufferSpec.of(self._flat_params, "reduce_scatter")}

    def _reduce_scatter_gradients(self) -> None:
        owned = self._private_grad()
        full = torch.empty(self._flat.layout.total, dtype=owned.dtype, device=owned.device)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._flat_params]
        if self._comm_hook is not None:
            kernels.pack(grads, full)
            self._comm_hook.reduce_scatter(0, full, owned)
            return
        kernels.pack(grads, full, scale=1.0 / self.comm.world_size)
        self.comm.reduce_scatter(full, owned, ReductionOperation.SUM, scratch_input=True)

    def _gather_parameters(self) -> None:
        # fp32: the master is this rank's range of the flat buffer itself, which the all-gather sends in place
        src = self._master if self._master_is_view else self._master.to(self._flat.data.dtype)
        self.comm.all_gather(src, self._flat.data)

    def _update_and_gather(self, scale: float) -> None:
        """Fused fp32 path: the flat buffer is one gathered region (:meth:`_update_and_send`)."""
        if not self._overlaps_gather():
            super()._update_and_gather(scale)
            return
        self._update_and_send(scale, [(0, self._flat.data.numel(), 0)])


class ZeRO2Optimizer(_FlatShardOptimizer):
    """ZeRO stage 2: each rank keeps 1/N of the gradients and of the optimizer state, as one even piece of every
    gradient bucket, and updates only those pieces.

    With :class:`gpudist.ZeRO2Model` the gradients arrive already reduce-scattered (during backward). With a
    plain module, ``step`` reduce-scatters them bucket by bucket itself. Then it updates the owned pieces in
    one fused launch per parameter group, and all-gathers each bucket's updated parameters:
    ``2 (N-1)/N x P`` per rank per step, as DDP, with (2 + K) P / N less memory for gradients and state.
    The optimizer's parameters must be the model's trainable parameters in the model's order.
    """

    strategy = "zero2"

    def owned_segments(self) -> list[tuple[int, int]]:
        self._parts = partition_buckets(
            self._flat_params,
            self.config.bucket_cap_bytes(),
            self.config.bucket_cap_bytes(first=True),
            self.comm.world_size,
            self.comm.rank,
        )
        return sorted(part.segment for part in self._parts)

    def reduce_gradients(self) -> None:
        model = self.model()
        if model is None:
            self._reduce_scatter_gradients()
            return
        owned = getattr(model, "owned_grads", None)
        if owned is None or [id(p) for p in model._params] != [id(p) for p in self._flat_params]:
            raise ValueError(
                "ZeRO2Optimizer pairs with a ZeRO2Model whose trainable parameters are the optimizer's, in the "
                f"model's parameters() order; got {type(model).__name__} with a different parameter list/order"
            )
        self._grad = model.owned_gradients()  # the model's reduce-scattered pieces, same order: stepped in place

    def gradient_buffers(self) -> dict[int, BufferSpec]:
        return {
            i: BufferSpec.of(self._flat_params, "reduce_scatter", part.flat_offset, part.flat_offset + part.numel)
            for i, part in enumerate(self._parts)
        }

    def _reduce_scatter_gradients(self) -> None:
        hook, owned = self._comm_hook, self._private_grad()
        for i, part in enumerate(self._parts):
            views = self._grad_views_for(part.flat_offset, part.numel)
            sent = torch.empty(part.numel, dtype=owned.dtype, device=owned.device)
            out = owned[part.owned_at : part.owned_at + part.owned_numel]
            kernels.pack(views, sent, scale=1.0 if hook is not None else 1.0 / self.comm.world_size)
            if hook is not None:
                hook.reduce_scatter(i, sent, out)
            else:
                self.comm.reduce_scatter(sent, out, ReductionOperation.SUM, scratch_input=True)

    def _gather_parameters(self) -> None:
        dtype = self._flat.data.dtype
        for part in self._parts:
            piece = self._master_of(part.owned_at, part.owned_at + part.owned_numel)
            src = piece if self._master_is_view else piece.to(dtype)  # fp32: in place, as ZeRO-1
            self.comm.all_gather(src, self._flat.data[part.flat_offset : part.flat_offset + part.numel])

    def _update_and_gather(self, scale: float) -> None:
        """Fused fp32 path: each bucket is a gathered region (:meth:`_update_and_send`), in launch order."""
        if not self._parts or not self._overlaps_gather():  # ZeRO-3's own shards: nothing to gather
            super()._update_and_gather(scale)
            return
        self._update_and_send(scale, [(part.flat_offset, part.numel, part.owned_at) for part in self._parts])


class ZeRO3Optimizer(ZeRO2Optimizer):
    """ZeRO stage 3: steps the parameter shards a :class:`gpudist.ZeRO3Model` (or ``FSDPModel``) keeps on this rank.

    Build it from ``model.parameters()`` (the shards) and the same configuration. The model has already
    reduce-scattered the gradients into the shards' ``.grad`` during backward and gathers parameters again at
    the next forward, so ``step`` only updates: one fused launch per parameter group for Adam/AdamW/SGD (any other
    torch optimizer over views), an fp32 master copy when the shards are bf16/fp16, global-norm clipping and the
    non-finite skip agreed over all ranks by one 8-byte all-reduce. Used with parameters no ZeRO-3 wrapper
    shards (a plain module), it does ZeRO-2's job: reduce-scatter, update the owned pieces, all-gather.
    """

    strategy = "zero3"

    def _sharded(self) -> bool:
        return isinstance(self.model(), ZeRO3Model)

    def _replicated(self) -> bool:
        return not self._sharded()  # the model checked its architecture across ranks when it was built

    def owned_segments(self) -> list[tuple[int, int]]:
        if self._sharded():
            self._parts = []
            return [(0, self._flat.layout.total)]  # the shards are ours entirely
        return super().owned_segments()

    def reduce_gradients(self) -> None:
        if not self._sharded():
            super().reduce_gradients()
            return
        # The model reduce-scattered every shard's gradient into one flat buffer in parameter order (the shards'
        # .grad are its slices): step that buffer in place. Otherwise (a gradient missing or replaced), a copy.
        grads = [p.grad for p in self._flat_params]
        common = self._common_buffer(grads)
        if common is not None:
            self._grad = common
            return
        self._grad = torch.empty(self._owned_numel, dtype=self._grad.dtype, device=self._grad.device)
        kernels.pack(
            [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, self._flat_params, strict=True)],
            self._grad,
        )

    def _common_buffer(self, grads: list[torch.Tensor | None]) -> torch.Tensor | None:
        """The 1-D buffer whose consecutive slices ``grads`` are, in this optimizer's layout, or None."""
        base = grads[0]._base if grads and grads[0] is not None else None
        layout = self._flat.layout
        if base is None or base.dim() != 1 or base.numel() != layout.total or not base.is_contiguous():
            return None
        storage, ptr, size = base.untyped_storage().data_ptr(), base.data_ptr(), base.element_size()
        for g, offset, numel in zip(grads, layout.offsets, layout.numels, strict=True):
            if (
                g is None
                or g.numel() != numel
                or g.data_ptr() != ptr + offset * size
                or g.untyped_storage().data_ptr() != storage
            ):
                return None
        return base

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if set_to_none and self._sharded():
            self._grad = self._grad.new_empty(0)  # the shards' gradients are gone: this view of them goes too

    def _gather_parameters(self) -> None:
        if not self._sharded():
            super()._gather_parameters()
        elif not self._master_is_view:
            kernels.pack([self._master], self._flat.data)  # new low-precision shard values from the fp32 master


def data_parallel_optimizer(zero_stage: int) -> type[ShardedOptimizer]:
    """The data-parallel optimizer class for ``zero_stage`` (0: DDP, replicated state; 1: ZeRO-1; 2: ZeRO-2), as
    the strategies that run data parallelism inside them (hybrid, elastic) take it."""
    from .ddp import DDPOptimizer

    classes = {0: DDPOptimizer, 1: ZeRO1Optimizer, 2: ZeRO2Optimizer}
    if isinstance(zero_stage, bool) or zero_stage not in classes:
        raise ValueError(f"zero_stage={zero_stage!r}; use 0 (replicated state), 1 (ZeRO-1) or 2 (ZeRO-2)")
    return classes[zero_stage]
