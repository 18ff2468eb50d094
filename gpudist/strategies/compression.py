"""GradientCompressionOptimizer: compressed gradient communication with error feedback, for DDP, ZeRO-1 and ZeRO-2."""

from __future__ import annotations

from typing import Any

import torch

from .. import kernels
from ..checkpoint import Reader, Segments, Share, canonical, optimizer_pieces, stage_optimizer
from ..comm import shard_range
from ..compression import Compressor, PendingReduction, PowerSGDCompressor, make_channel, parse_compressor
from ..compression.collectives import CompressedChannel, PowerSGDChannel
from ..config import ShardingConfiguration
from ..flat import BufferSpec, assign_buckets
from .ddp import DDPModel, DDPOptimizer
from .fsdp import ZeRO3Optimizer
from .optimizer import ShardedOptimizer
from .reducer import EndOfBackward
from .zero import ZeRO1Optimizer, ZeRO2Model, ZeRO2Optimizer

__all__ = ["CompressionHook", "GradientCompressionOptimizer"]


class CompressionHook:
    """The communication hook a :class:`GradientCompressionOptimizer` installs: one channel (a
    :class:`~gpudist.compression.CompressedChannel`, or a :class:`~gpudist.compression.PowerSGDChannel`) per gradient
    buffer (built up front from the communicator's ``gradient_buffers()``), dense during warm-up, and the byte
    accounting of every step.

    With ``overlap``, a bucket all-reduced during backward whose gradients live in the buffer (``param.grad`` views,
    as ``DDPModel`` and ``ZeRO1Model`` keep them) is compressed and its first collective launched (async) at once;
    the hook returns and backward goes on while it flies. Later stages (the two-phase all-reduce's second phase,
    PowerSGD's ``Q`` round, the decode into the buffer) run when two more buckets have been launched since, and
    whatever is left at the end of backward (an autograd callback, before ``backward()`` returns). Every rank launches
    the same collectives in the same order, and each bucket's result is the synchronous one, bit for bit. Anything
    else (a buffer that is a copy, a call outside backward, ``overlap=False``) is reduced before the call returns.
    """

    LAG = 2
    """Buckets launched after a pending one before its next stage runs: its collectives have had that long to land,
    and the stage's wait then rarely blocks (a GPU's compute stream waits on them from that point)."""

    def __init__(
        self,
        comm,
        compressor: Compressor,
        buffers: dict[int, BufferSpec],
        *,
        warmup_steps: int,
        error_feedback: bool,
        local_gradients: bool = False,
        overlap: bool = True,
    ):
        self.comm, self.compressor, self.buffers = comm, compressor, buffers
        self.warmup_steps, self.error_feedback = warmup_steps, error_feedback
        self.local_gradients = local_gradients
        """After warm-up, leave every rank's own gradients in place (momentum compression communicates at step)."""
        self.overlap = overlap
        device = next((s[2].device for spec in buffers.values() for s in spec.spans), torch.device("cpu"))
        self.channels: dict[int, CompressedChannel | PowerSGDChannel] = {
            key: make_channel(
                comm,
                compressor,
                spec.numel,
                [(pos, tuple(p.shape)) for pos, n, p, at in spec.spans if at == 0 and n == p.numel()],
                device=device,
                scatter=spec.op == "reduce_scatter",
                error_feedback=error_feedback,
            )
            for key, spec in buffers.items()
        }
        self.steps = 0
        self.last_step = {"sent_bytes": 0, "dense_bytes": 0}
        self.total = {"sent_bytes": 0, "dense_bytes": 0}
        self._mark = (0, 0)
        self._pending: list[PendingReduction] = []
        self._end = EndOfBackward(self.flush)
        self.overlapped = 0
        """Bucket all-reduces launched during backward and finished later (for tests and reports)."""

    @property
    def compressing(self) -> bool:
        """False during the first ``warmup_steps`` optimizer steps (plain collectives), True after."""
        return self.steps >= self.warmup_steps

    def _channel(self, key: int, op: str) -> CompressedChannel:
        channel = self.channels.get(key)
        if channel is None or self.buffers[key].op != op:
            raise RuntimeError(
                f"CompressionHook: no {op} buffer {key}; the model or optimizer changed its gradient "
                "buffers after the GradientCompressionOptimizer was built"
            )
        return channel

    def all_reduce(self, key: int, tensor: torch.Tensor) -> None:
        """Average bucket ``key`` (``tensor``, its flat gradients) over ranks: at once, or launched now and finished by
        the end of backward (see the class docstring)."""
        if self.local_gradients and self.compressing:
            return
        channel = self._channel(key, "all_reduce")
        if not (self.overlap and _in_backward() and _holds_the_gradients(self.buffers[key], tensor)):
            self.flush()  # ranks launch collectives in the same order: whatever is pending goes first
            channel.all_reduce(tensor, compress=self.compressing)
            return
        self._pending.append(channel.start_all_reduce(tensor, compress=self.compressing))
        self.overlapped += 1
        self._end.arm()
        for pending in self._pending[: -self.LAG]:
            pending.advance()
        self._pending = [p for p in self._pending if not p.done]

    def all_reduce_many(self, buffers: list[tuple[int, torch.Tensor]]) -> None:
        """Average several buffers (``(key, tensor)``, in key order on every rank), every one's first collective
        launched before any is waited for (``overlap``), or one after the other."""
        if self.local_gradients and self.compressing:
            return
        self.flush()
        if not self.overlap:
            for key, tensor in buffers:
                self._channel(key, "all_reduce").all_reduce(tensor, compress=self.compressing)
            return
        self._pending = [
            self._channel(key, "all_reduce").start_all_reduce(tensor, compress=self.compressing)
            for key, tensor in buffers
        ]
        self.flush()

    def all_reduce_compressed(self, key: int, tensor: torch.Tensor) -> None:
        """Average ``tensor`` (buffer ``key``'s layout) compressed, whatever the warm-up says."""
        self.flush()
        self._channel(key, "all_reduce").all_reduce(tensor, compress=True)

    def reduce_scatter(self, key: int, inp: torch.Tensor, out: torch.Tensor) -> None:
        self.flush()
        self._channel(key, "reduce_scatter").reduce_scatter(inp, out, compress=self.compressing)

    def flush(self) -> None:
        """Finish every pending all-reduce, stage by stage across them (each stage's collectives of all buckets are
        launched before the next stage waits for any), in launch order on every rank."""
        try:
            while self._pending:
                for pending in self._pending:
                    pending.advance()
                self._pending = [p for p in self._pending if not p.done]
        finally:
            self._pending = []

    def end_step(self) -> None:
        self.flush()
        sent = sum(c.sent_bytes for c in self.channels.values())
        dense = sum(c.dense_bytes for c in self.channels.values())
        self.last_step = {"sent_bytes": sent - self._mark[0], "dense_bytes": dense - self._mark[1]}
        self.total = {"sent_bytes": sent, "dense_bytes": dense}
        self._mark = (sent, dense)
        self.steps += 1

    def report(self) -> dict[str, Any]:
        """Bytes this rank sent in the last step and in all, against the dense equivalent (per-rank send volume)."""

        def ratio(d: dict) -> float | None:
            return d["sent_bytes"] / d["dense_bytes"] if d["dense_bytes"] else None

        return {
            "compressor": self.compressor.describe(),
            "error_feedback": self.error_feedback,
            "compress": "momentum" if self.local_gradients else "gradients",
            "overlap": self.overlap,
            "warmup_steps": self.warmup_steps,
            "steps": self.steps,
            "compressing": self.compressing,
            "last_step": {**self.last_step, "ratio": ratio(self.last_step)},
            "total": {**self.total, "ratio": ratio(self.total)},
            "residual_norm": sum(c.residual_norm() ** 2 for c in self.channels.values()) ** 0.5,
        }


def _in_backward() -> bool:
    """Whether an autograd backward pass is running on this thread (so a final callback can be queued)."""
    return torch._C._current_graph_task_id() != -1


def _holds_the_gradients(spec: BufferSpec, tensor: torch.Tensor) -> bool:
    """Whether every parameter's ``.grad`` in ``spec`` is a view of ``tensor`` at its span: then writing the average
    into ``tensor`` later still reaches the gradients (a copy, e.g. ``gradient_as_bucket_view=False``, would be
    unpacked before that)."""
    base, size = tensor.data_ptr(), tensor.element_size()
    for pos, _, param, at in spec.spans:
        grad = param.grad
        if grad is None or grad.dtype != tensor.dtype or not grad.is_contiguous():
            return False
        if grad.data_ptr() != base + (pos - at) * size:
            return False
    return True


class GradientCompressionOptimizer(ShardedOptimizer):
    """Data-parallel training with compressed gradient communication and error feedback.

    Wraps a ``torch.optim.Optimizer`` (replicated state, like :class:`DDPOptimizer`) or a ``DDPOptimizer`` /
    ``ZeRO1Optimizer`` / ``ZeRO2Optimizer`` built from the same ``config``, and compresses what that setup
    communicates: a ``DDPModel`` or ``ZeRO1Model``'s bucket all-reduces, a ``ZeRO2Model``'s bucket reduce-scatters,
    or, with a plain module, the optimizer's own all-reduce (bucketed) or reduce-scatter. The ZeRO parameter
    all-gather stays dense (parameters have no error feedback to absorb the loss).

    ``compressor``: a :mod:`gpudist.compression` compressor or its spec string (``"topk:0.01"``, ``"int8"``,
    ``"1bit"``, ``"powersgd:4"``). The first ``warmup_steps`` steps communicate uncompressed (early gradients are
    large and change fast); PowerSGD's ``start_iter`` counts as warm-up too (the longer of the two). PowerSGD
    compresses all-reduces only: a ``ZeRO2Model`` or a ZeRO optimizer's own reduce-scatter is refused with it.

    ``overlap`` (default): a model's bucket is compressed and its collective launched as soon as its gradients are
    ready, and the result lands in the gradients by the end of ``backward()`` (see :class:`CompressionHook`), so
    backward compute runs while compressed buckets are on the wire; with a plain module every bucket is launched
    before any is waited for. Results equal ``overlap=False`` (each bucket reduced before backward goes on) bit for
    bit. ZeRO-2's reduce-scatters are always synchronous (its model reads each bucket's result during backward).

    ``compress="momentum"`` (momentum SGD only, replicated state: a plain module or ``DDPModel``) communicates
    the momentum instead of the gradient, the way DeepSpeed's 1-bit Adam does: after warm-up each rank forms
    ``mu * m + g_local`` (plus weight decay), the compressed all-reduce averages it with error feedback, and the
    average becomes everyone's momentum buffer and the update. Uncompressed it is exactly momentum SGD. Sign
    (1-bit) compression needs it: the momentum changes slowly, so the residual stays small, while compressing
    raw gradients with error feedback piles large entries into the residual (docs/results.md, Convergence).

    Residuals (worker and server) and PowerSGD's warm-start ``Q`` are part of :meth:`state_dict` and of gpudist
    checkpoints, saved per rank (``Q``: one copy, the same on every rank) and resharded when loaded at another
    world size. ``communication_report()`` and the model's
    ``get_model_metadata()["compression"]`` give the bytes sent against the dense equivalent.

    Args:
        optimizer: A ``torch.optim.Optimizer``, or a ``DDPOptimizer``, ``ZeRO1Optimizer`` or ``ZeRO2Optimizer``
            built from the same ``config``.
        config: The configuration the model wrapper (if any) and the wrapped optimizer were built from.
        compressor: A :mod:`gpudist.compression` compressor, or its spec string.
        warmup_steps: Optimizer steps that communicate uncompressed first (>= 0).
        error_feedback: Keep what compression loses in residuals and send it later; False drops it.
        compress: ``"gradients"`` or ``"momentum"``, as described above.
        overlap: Launch compressed bucket collectives during backward and finish them by its end, as described above.

    Raises:
        TypeError: When ``optimizer`` is not a ``torch.optim.Optimizer`` or is another gpudist optimizer than
            those above (a ``ZeRO3Optimizer`` too), ``config`` is neither a ``ShardingConfiguration`` nor a
            ``ShardedModel``, ``compressor`` is neither a compressor nor a string, the paired model is not a
            ``DDPModel``, ``ZeRO1Model`` or ``ZeRO2Model`` or does not match the wrapped optimizer (a
            ``ZeRO2Model`` needs a ``ZeRO2Optimizer`` and only it), or ``compress="momentum"`` gets a sharding
            optimizer or one that is not ``torch.optim.SGD``, or PowerSGD gets a setup that reduce-scatters gradients
            (ZeRO-2, or a ``ZeRO1Optimizer`` / ``ZeRO2Optimizer`` with a plain module).
        ValueError: When ``compress`` or ``warmup_steps`` is invalid, the compressor spec is not understood, the
            wrapped optimizer was built from another configuration, or (``compress="momentum"``) a parameter group
            does not have momentum > 0, dampening 0, no Nesterov and no ``maximize``.
    """

    strategy = "compression"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: ShardingConfiguration,
        compressor: Compressor | str,
        *,
        warmup_steps: int = 0,
        error_feedback: bool = True,
        compress: str = "gradients",
        overlap: bool = True,
    ):
        inner = optimizer if isinstance(optimizer, ShardedOptimizer) else None
        if compress not in ("gradients", "momentum"):
            raise ValueError(f"GradientCompressionOptimizer: compress={compress!r}; use 'gradients' or 'momentum'")
        if compress == "momentum":
            _check_momentum_target(inner, inner.optimizer if inner is not None else optimizer)
        if inner is not None:
            if isinstance(inner, ZeRO3Optimizer) or not isinstance(
                inner, (DDPOptimizer, ZeRO1Optimizer, ZeRO2Optimizer)
            ):
                raise TypeError(
                    f"GradientCompressionOptimizer wraps a torch optimizer, DDPOptimizer, ZeRO1Optimizer "
                    f"or ZeRO2Optimizer, got {type(inner).__name__} (ZeRO-3 gathers parameters, which "
                    "have no error feedback to absorb compression)"
                )
            if inner.config is not config:
                raise ValueError(
                    "GradientCompressionOptimizer: the wrapped optimizer was built from another "
                    "ShardingConfiguration; pass the same config to both"
                )
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps!r} must be an int >= 0")
        compressor = parse_compressor(compressor)
        super().__init__(inner.optimizer if inner is not None else optimizer, config)
        # A DDPOptimizer adds nothing but the all-reduce, which this class replaces: step the torch optimizer.
        self.inner = None if isinstance(inner, DDPOptimizer) else inner
        self.compressor = compressor
        model = self.model()
        if model is not None:
            if not isinstance(model, DDPModel):
                raise TypeError(
                    f"GradientCompressionOptimizer compresses the gradients of DDPModel, ZeRO1Model and "
                    f"ZeRO2Model; {type(model).__name__} is not supported (use a plain module or one of "
                    "those)"
                )
            if isinstance(model, ZeRO2Model) != isinstance(inner, ZeRO2Optimizer):
                raise TypeError(
                    f"GradientCompressionOptimizer: {type(model).__name__} pairs with "
                    f"{'a ZeRO2Optimizer' if isinstance(model, ZeRO2Model) else 'a torch optimizer, '}"
                    f"{'' if isinstance(model, ZeRO2Model) else 'DDPOptimizer or ZeRO1Optimizer'} "
                    f"inside it, got {type(inner or optimizer).__name__}"
                )
            self._communicator = model
        elif isinstance(inner, (ZeRO1Optimizer, ZeRO2Optimizer)):
            self._communicator = inner
        else:
            self._communicator = self
            params = [p for p in self._params() if p.requires_grad]
            cap = config.bucket_cap_bytes()
            self._buckets = [[params[i] for i in sorted(ix)] for ix in assign_buckets(params, cap, cap)]
        self.compress = compress
        if isinstance(compressor, PowerSGDCompressor):
            warmup_steps = max(warmup_steps, compressor.start_iter)
        self.hook = CompressionHook(
            getattr(self._communicator, "hook_group", self.comm),  # a hierarchical DDPModel: the inter-node group
            compressor,
            self._communicator.gradient_buffers(),
            warmup_steps=warmup_steps,
            error_feedback=error_feedback,
            local_gradients=compress == "momentum",
            overlap=bool(overlap),
        )
        if self._communicator is not self:
            self._communicator.register_comm_hook(self.hook)

    # -- the own path: a plain module and a torch optimizer ----------------------------------------------------------

    def gradient_buffers(self) -> dict[int, BufferSpec]:
        """What this optimizer all-reduces itself (a plain module and a torch optimizer or ``DDPOptimizer``).

        Returns:
            Bucket index -> its :class:`~gpudist.flat.BufferSpec` (size, collective, parameter spans).
        """
        return {i: BufferSpec.of(bucket, "all_reduce") for i, bucket in enumerate(self._buckets)}

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        if self._communicator is not self:
            return  # the model's hook (or the wrapped ZeRO optimizer) communicated them, compressed
        flats = []
        for i, bucket in enumerate(self._buckets):
            for p in bucket:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in bucket]
            flat = torch.empty(self.hook.buffers[i].numel, dtype=torch.float32, device=grads[0].device)
            kernels.pack(grads, flat)
            flats.append((i, flat))
        self.hook.all_reduce_many(flats)
        for (_, flat), bucket in zip(flats, self._buckets, strict=True):
            kernels.unpack(flat, [p.grad for p in bucket])

    # -- stepping ----------------------------------------------------------------------------------------------------

    def capture_refusal(self) -> str | None:
        """Compression decides on the host per step (error feedback, rank choice): not captured."""
        return "compression decides per step on the host (error feedback, rank choice); run it eagerly"

    def step(self, closure=None):
        """One optimizer step with compressed communication (collective), then count it for warm-up and reports.

        With ``compress="momentum"`` after warm-up the averaged, compressed momentum is the update; otherwise the
        wrapped optimizer steps (its communication compressed through the hook).

        Args:
            closure: Re-evaluates the model and returns the loss; None: use the gradients already computed.

        Returns:
            The closure's loss, or None without a closure.
        """
        self.hook.flush()  # nothing is pending after a backward; this guards gradients produced any other way
        if self.compress == "momentum" and self.hook.compressing:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self._momentum_step()
        else:
            loss = self.inner.step(closure) if self.inner is not None else super().step(closure)
        self.hook.end_step()
        return loss

    @torch.no_grad()
    def _momentum_step(self) -> None:
        """Momentum SGD with the momentum communicated: ``m = avg_compressed(mu * m + g + wd * p)``, ``p -= lr * m``
        (torch.optim.SGD's update, with the average moved from the gradient to the momentum)."""
        group_of = {p: g for g in self.optimizer.param_groups for p in g["params"]}
        state = self.optimizer.state
        for key, spec in self.hook.buffers.items():
            device = spec.spans[0][2].device if spec.spans else torch.device("cpu")
            flat = torch.zeros(spec.numel, dtype=torch.float32, device=device)
            for pos, n, p, at in spec.spans:
                group, piece = group_of[p], flat[pos : pos + n]
                if p.grad is not None:
                    piece.copy_(p.grad.reshape(-1)[at : at + n])
                if group["weight_decay"]:
                    piece.add_(p.detach().reshape(-1)[at : at + n], alpha=group["weight_decay"])
                buf = state[p].get("momentum_buffer")
                if buf is not None:
                    piece.add_(buf.reshape(-1)[at : at + n], alpha=group["momentum"])
            self.hook.all_reduce_compressed(key, flat)
            for pos, n, p, at in spec.spans:
                buf = state[p].get("momentum_buffer")
                if buf is None:
                    buf = state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                buf.reshape(-1)[at : at + n].copy_(flat[pos : pos + n])
                p.detach().reshape(-1)[at : at + n].add_(flat[pos : pos + n], alpha=-group_of[p]["lr"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.inner is not None:
            self.inner.zero_grad(set_to_none)
        else:
            super().zero_grad(set_to_none)

    def communication_report(self) -> dict[str, Any]:
        """Bytes sent in the last step and in all, against the dense equivalent (see :class:`CompressionHook`).

        Returns:
            The compressor, error feedback, mode, warm-up and step counts, ``"last_step"`` and ``"total"`` (each
            ``sent_bytes``, ``dense_bytes`` and their ``ratio``) and the residuals' norm.
        """
        return self.hook.report()

    # -- state -------------------------------------------------------------------------------------------------------

    # -- checkpoints (gpudist.checkpoint's optimizer protocol) -------------------------------------------------------

    def _residual_spans(self, segmap: dict[int, Segments]):
        """Each compressed buffer's channel, with its elements in canonical coordinates: (buffer position, length,
        name, position in name)."""
        for key, channel in self.hook.channels.items():
            spans = []
            for pos, length, param, at in self.hook.buffers[key].spans:
                for ppos, n, name, c in canonical(segmap.get(id(param), []), at, at + length):
                    spans.append((pos + ppos - at, n, name, c))
            yield channel, spans

    def _warm_start_names(self, segmap: dict[int, Segments]):
        """PowerSGD channels' compressed tensors with a canonical name: (channel, offset in its buffer, name). A
        tensor that is not one whole canonical tensor (none in the setups this optimizer supports) has no name and
        starts again from a random ``Q`` after a load."""
        for key, channel in self.hook.channels.items():
            if not isinstance(channel, PowerSGDChannel):
                continue
            at_offset = {pos: param for pos, n, param, at in self.hook.buffers[key].spans if at == 0}
            for offset in channel.warm_start_sizes():
                segments = segmap.get(id(at_offset[offset]), [])
                if len(segments) == 1 and segments[0][0] == 0 and segments[0][3] == 0:
                    yield channel, offset, segments[0][2]

    def _target(self):
        """The optimizer holding the model state: the wrapped ZeRO optimizer, or the torch optimizer (DDP)."""
        return self.inner if self.inner is not None else self.optimizer

    def checkpoint_pieces(self, segmap: dict[int, Segments], share: Share, rank: int, world: int):
        """The wrapped optimizer's pieces, then the error-feedback residuals. A worker residual is per rank
        (``residual.worker.<rank>``, the whole buffer); server residuals are one canonical tensor split over the ranks
        (``residual.server``), and so is PowerSGD's warm-start ``Q`` of each compressed parameter (``powersgd.q``,
        ``cols x r`` elements, the same on every rank). Over a hierarchical ``DDPModel`` (compression across nodes
        only) the hook's group is the inter-node one: each rank's buffer is its piece of every bucket, so
        ``residual.worker.<node>`` of an element is written by the rank of that node whose piece holds it, and
        every element has one worker residual per node, as it has one per rank in the flat case.

        Args: as :meth:`ShardedOptimizer.checkpoint_pieces`.

        Returns:
            ``(pieces, scalars, description)``, as :meth:`ShardedOptimizer.checkpoint_pieces`; the description
            carries the compression settings and step count under ``"compression"``.
        """
        pieces, scalars, desc = optimizer_pieces(self._target(), segmap, share, rank, world)
        peer = self.hook.comm.rank  # over a hierarchical DDPModel: this rank's node (it serves its piece's elements)
        for channel, spans in self._residual_spans(segmap):
            worker, server = channel.worker_residual(), channel.server_residual()
            for pos, n, name, c in spans:
                if worker is not None:
                    pieces[f"residual.worker.{peer}|{name}|{c}"] = worker[pos : pos + n].detach().cpu().clone()
                if server is not None:
                    start, values = server
                    a, b = max(pos, start), min(pos + n, start + values.numel())
                    if a < b:
                        piece = values[a - start : b - start]
                        pieces[f"residual.server|{name}|{c + a - pos}"] = piece.detach().cpu().clone()
        for channel, offset, name in self._warm_start_names(segmap):
            q = channel.warm_start_state().get(offset)
            if q is not None:
                lo, hi = shard_range(q.numel(), world, rank)
                if lo < hi:
                    pieces[f"powersgd.q|{name}|{lo}"] = q[lo:hi].detach().cpu().clone()
        meta = {
            "compressor": repr(self.compressor),
            "steps": self.hook.steps,
            "world_size": self.hook.comm.world_size,  # how many worker residuals each element has
            "error_feedback": self.hook.error_feedback,
            "compress": self.compress,
        }
        if isinstance(self.compressor, PowerSGDCompressor):
            meta["powersgd_rank"] = self.compressor.rank
        return pieces, scalars, {**desc, "compression": meta}

    def stage_checkpoint(self, body: dict, reader: Reader, segmap: dict[int, Segments], apply: list):
        """The wrapped optimizer's state, then the residuals. Saved at the same world size, each rank takes its own
        worker residual back; at another world size every rank takes the mean of the saved ones, which keeps the
        pending update ``mean_r(worker_r)`` unchanged. Server residuals are one tensor, resharded like parameters.

        Args: as :meth:`ShardedOptimizer.stage_checkpoint`.

        Returns:
            A function that installs the wrapped optimizer's state, the residuals and the step count.

        Raises:
            ValueError: When the checkpoint was saved with another ``compress`` mode.
            CheckpointError: When the wrapped optimizer's state cannot be read (see
                :meth:`ShardedOptimizer.stage_checkpoint`).
        """
        meta = (body.get("optimizer") or {}).get("compression")
        if meta is not None:
            check_compress_mode(self, meta)
        finish_inner = stage_optimizer(self._target(), body, reader, segmap, apply)
        rank, world = self.hook.comm.rank, self.hook.comm.world_size
        staged = []
        for channel, spans in self._residual_spans(segmap):
            worker = server = None
            if meta is not None and channel.worker is not None:
                saved_world = int(meta["world_size"])
                kinds = (
                    [f"residual.worker.{rank}"]
                    if saved_world == world
                    else [f"residual.worker.{r}" for r in range(saved_world)]
                )
                worker = torch.zeros(channel.numel, dtype=torch.float32, device="cpu")
                for pos, n, name, c in spans:
                    if all(reader.has(kind, name) for kind in kinds):
                        total = sum(reader.read(kind, name, c, n, torch.float32) for kind in kinds)
                        worker[pos : pos + n] = total / len(kinds)
            held = channel.server_residual()
            if meta is not None and held is not None:
                start, values = held
                server = torch.zeros(values.numel(), dtype=torch.float32, device="cpu")
                for pos, n, name, c in spans:
                    a, b = max(pos, start), min(pos + n, start + values.numel())
                    if a < b and reader.has("residual.server", name):
                        part = reader.read("residual.server", name, c + a - pos, b - a, torch.float32)
                        server[a - start : b - start] = part
            staged.append((channel, worker, server))
        warm: dict[int, dict[int, torch.Tensor]] = {}
        same_rank = meta is not None and meta.get("powersgd_rank") == getattr(self.compressor, "rank", None)
        for channel, offset, name in self._warm_start_names(segmap) if same_rank else ():
            if reader.has("powersgd.q", name):
                size = channel.warm_start_sizes()[offset]
                warm.setdefault(id(channel), {})[offset] = reader.read("powersgd.q", name, 0, size, torch.float32)

        def finish() -> None:
            finish_inner()
            for channel, worker, server in staged:
                channel.load_residuals(worker, server)
                if id(channel) in warm:
                    channel.load_warm_start(warm[id(channel)])
            if meta is not None:
                self.hook.steps = int(meta["steps"])

        return finish

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state plus this rank's residuals (per buffer, in buffer order) and step count.

        Returns:
            ``{"inner": the wrapped optimizer's state_dict, "compression": {steps, world size, rank, mode,
            residuals, warm_start}}`` (``warm_start``: PowerSGD's ``Q`` per buffer and offset); it loads back only at
            the same world size (:meth:`load_state_dict`).
        """
        inner = self.inner.state_dict() if self.inner is not None else self.optimizer.state_dict()
        residuals = {}
        for key, channel in self.hook.channels.items():
            server = channel.server_residual()
            worker = channel.worker_residual()
            residuals[key] = {
                "worker": None if worker is None else worker.clone(),
                "server": None if server is None else server[1].clone(),
            }
        return {
            "inner": inner,
            "compression": {
                "steps": self.hook.steps,
                "world_size": self.comm.world_size,
                "rank": self.comm.rank,
                "compress": self.compress,
                "residuals": residuals,
                "warm_start": {
                    key: {offset: q.clone() for offset, q in channel.warm_start_state().items()}
                    for key, channel in self.hook.channels.items()
                    if isinstance(channel, PowerSGDChannel)
                },
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned: the wrapped optimizer's state, the residuals and the step count.

        Args:
            state_dict: A :meth:`state_dict` saved at the same world size, with the same buffers and mode.

        Raises:
            ValueError: When ``state_dict`` is not from :meth:`state_dict`, was saved at another world size, with
                other gradient buffers or with another ``compress`` mode.
        """
        meta = state_dict.get("compression") if isinstance(state_dict, dict) else None
        if meta is None or "inner" not in state_dict:
            raise ValueError(
                "GradientCompressionOptimizer.load_state_dict: not a state from "
                "GradientCompressionOptimizer.state_dict() (no 'compression' entry)"
            )
        if meta["world_size"] != self.comm.world_size or set(meta["residuals"]) != set(self.hook.channels):
            raise ValueError(
                f"GradientCompressionOptimizer.load_state_dict: the state was saved at world size "
                f"{meta['world_size']} with buffers {sorted(meta['residuals'])}, this run has world size "
                f"{self.comm.world_size} and buffers {sorted(self.hook.channels)}; load across world sizes through "
                "gpudist.save_checkpoint / load_checkpoint, which reshard residuals"
            )
        check_compress_mode(self, meta)
        if self.inner is not None:
            self.inner.load_state_dict(state_dict["inner"])
        else:
            super().load_state_dict(state_dict["inner"])
        for key, channel in self.hook.channels.items():
            channel.load_residuals(meta["residuals"][key]["worker"], meta["residuals"][key]["server"])
            if isinstance(channel, PowerSGDChannel) and key in meta.get("warm_start", {}):
                channel.load_warm_start(meta["warm_start"][key])
        self.hook.steps = int(meta["steps"])


def check_compress_mode(opt: GradientCompressionOptimizer, meta: dict) -> None:
    """Residuals of compressed gradients and of compressed momentum are different quantities: refuse to mix them."""
    saved = meta.get("compress", "gradients")
    if saved != opt.compress:
        raise ValueError(
            f"GradientCompressionOptimizer: the state was saved with compress={saved!r}, this optimizer "
            f"has compress={opt.compress!r}; build it with compress={saved!r} to resume"
        )


def _check_momentum_target(inner: ShardedOptimizer | None, optimizer: torch.optim.Optimizer) -> None:
    """compress="momentum" needs replicated momentum SGD state; say what to change otherwise."""
    if inner is not None and not isinstance(inner, DDPOptimizer):
        raise TypeError(
            f"GradientCompressionOptimizer(compress='momentum') needs every rank's full momentum, which "
            f"{type(inner).__name__} shards; use compress='gradients' with ZeRO, or a DDPOptimizer / "
            "torch optimizer"
        )
    if type(optimizer) is not torch.optim.SGD:
        raise TypeError(
            f"GradientCompressionOptimizer(compress='momentum') runs momentum SGD (torch.optim.SGD), got "
            f"{type(optimizer).__name__}; use compress='gradients' for other optimizers"
        )
    for i, group in enumerate(optimizer.param_groups):
        bad = {
            k: group.get(k)
            for k, ok in (
                ("momentum", group.get("momentum", 0) > 0),
                ("dampening", not group.get("dampening")),
                ("nesterov", not group.get("nesterov")),
                ("maximize", not group.get("maximize")),
            )
            if not ok
        }
        if bad:
            raise ValueError(
                f"GradientCompressionOptimizer(compress='momentum'): param group {i} has "
                f"{', '.join(f'{k}={v!r}' for k, v in bad.items())}; it needs momentum > 0, "
                "dampening=0, nesterov=False, maximize=False"
            )
