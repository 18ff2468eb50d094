"""Collectives that are correct for compressed data, with error feedback on both sides.

A :class:`CompressedChannel` serves one gradient buffer (a DDP bucket, a ZeRO-2 bucket, a whole flat gradient)
for the whole run: it owns the buffer's residuals and counts what it sends. Every call averages over ranks.

- Sparse (top-k): ``acc = grad + worker_residual``; each rank's ``k`` largest entries ``(values, indices)`` are
  all-gathered and scatter-added into a dense zero vector, then divided by ``N``. Top-k sets differ between
  ranks, so summing the sparse vectors element by element on the wire would add unrelated entries.
- Quantized (int8, 1-bit, fp32 identity): the two-phase all-reduce. The buffer is laid out as ``N`` chunks,
  chunk ``r`` holding range ``r`` of :func:`gpudist.comm.split_sizes`, each padded to a multiple of the block
  size so blocks never straddle ranks. Phase 1: quantize ``grad + worker_residual`` (the worker residual keeps
  what the codes lost), all-to-all the codes so rank ``r`` receives every rank's codes of chunk ``r``,
  dequantize-accumulate them and divide by ``N``. Phase 2: quantize that average plus the *server* residual
  (what the second quantization lost last time), all-gather, dequantize. A reduce-scatter is phase 1 alone.

- Low-rank (PowerSGD, :class:`PowerSGDChannel`): the bucket's matrices ``M = grad + worker_residual`` give
  ``P = M Q``, summed by an all-reduce (with the bucket's uncompressed tensors, batched into a second all-reduce
  beside it), orthonormalized; ``Q = M^T P``, summed by a third; everyone applies ``P Q^T / N``.

Every channel runs a call as stages (:class:`PendingReduction`): local work up to a collective, launched with
``async_op=True``, then the next stage once it has landed. ``all_reduce`` runs them back to back;
``start_all_reduce`` returns after launching the first collective, so the caller can compute (the rest of
backward) while it flies and finish it later: the same code in the same order, so the same result.

Conservation (tested): summed over steps, what was applied plus ``mean_r(worker_r) + server`` equals the sum of
the true averaged gradients, so nothing is lost, only delayed.

Byte accounting uses the per-rank send volume of bandwidth-optimal algorithms (as nccl-tests' "bus bytes"):
all-reduce ``2 (N-1)/N x B``, reduce-scatter and all-to-all ``(N-1)/N x B``, all-gather ``(N-1) x b`` for a
per-rank piece of ``b`` bytes. Top-k's all-gather therefore grows with ``N`` (``N x 2 ratio`` of dense at fp32),
the quantized paths do not.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Generator, Sequence

import torch

from .. import kernels
from ..comm import CommunicationBackend, ReductionOperation, Work, split_sizes
from .compressors import Compressor, PowerSGDCompressor, QuantizingCompressor, TopKCompressor

__all__ = ["CompressedChannel", "PendingReduction", "PowerSGDChannel", "dense_bytes", "make_channel"]

Stages = Generator[list[Work], None, None]
"""A compressed collective as a generator: each ``yield`` hands over the ops it just launched (async); resuming it
after they completed runs the local work up to the next launch, and the generator returns when the result is
written."""

_SEED_MOD = 2**31


def dense_bytes(op: str, nbytes: int, world_size: int) -> int:
    """Per-rank send volume of an uncompressed ``op`` over ``nbytes`` (``"all_reduce"`` or ``"reduce_scatter"``).

    Args:
        op: ``"all_reduce"``; any other name counts as a reduce-scatter.
        nbytes: The buffer's size in bytes.
        world_size: The number of ranks.

    Returns:
        ``2 (N-1)/N x nbytes`` for an all-reduce, ``(N-1)/N x nbytes`` for a reduce-scatter, rounded.
    """
    n = world_size
    factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
    return round(factor * nbytes)


def _run(stages: Generator[list[Work], None, torch.Tensor]) -> torch.Tensor:
    """Run a stage generator to its end, waiting for each launch; its return value."""
    try:
        works = next(stages)
        while True:
            for work in works:
                work.wait()
            works = stages.send(None)
    except StopIteration as stop:
        return stop.value


class PendingReduction:
    """A compressed collective in flight (from ``start_all_reduce``): its first collective is launched; ``advance``
    waits for the latest one and runs the local work up to the next launch, ``finish`` runs it to the end.

    Every rank must advance its pending reductions in the same order (they launch collectives).

    Args:
        stages: The channel's stage generator; run at once up to its first launch.
    """

    def __init__(self, stages: Stages):
        self._stages = stages
        self._works: list[Work] | None = next(stages, None)

    @property
    def done(self) -> bool:
        """Whether the result is written (nothing left to wait for)."""
        return self._works is None

    def advance(self) -> None:
        """Wait for the collectives launched last, then run the local work up to the next launch (or the end)."""
        if self._works is None:
            return
        for work in self._works:
            work.wait()
        self._works = next(self._stages, None)

    def finish(self) -> None:
        """Run every remaining stage."""
        while self._works is not None:
            self.advance()


class CompressedChannel:
    """Compressed all-reduce / reduce-scatter of one ``numel``-element buffer, with its residuals and byte counts.

    ``error_feedback=False`` drops what compression loses (for comparison: training is then measurably worse).
    ``scatter=True`` serves reduce-scatters (ZeRO-2): no second phase, so no server residual.

    Args:
        comm: The group every call averages over.
        compressor: A :class:`TopKCompressor` or a :class:`QuantizingCompressor`.
        numel: Elements of the buffer this channel serves.
        device: Where the buffer and the residuals live.
        scatter: Serve reduce-scatters instead of all-reduces.
        error_feedback: Keep what compression loses in residuals (ignored for a lossless compressor).
    """

    def __init__(
        self,
        comm: CommunicationBackend,
        compressor: Compressor,
        numel: int,
        *,
        device: torch.device,
        scatter: bool = False,
        error_feedback: bool = True,
    ):
        self.comm, self.compressor, self.numel, self.scatter = comm, compressor, numel, scatter
        self.error_feedback = error_feedback and not compressor.lossless
        n, world = numel, comm.world_size
        self.sizes = split_sizes(n, world)
        self.starts = [sum(self.sizes[:r]) for r in range(world)]
        self.sparse = isinstance(compressor, TopKCompressor)
        self.worker: torch.Tensor | None = None
        self.server: torch.Tensor | None = None
        if self.sparse:
            if self.error_feedback:
                self.worker = torch.zeros(n, dtype=torch.float32, device=device)
        else:
            assert isinstance(compressor, QuantizingCompressor)
            block = compressor.block_size
            self.chunk = -(-max(self.sizes) // block) * block if n else 0
            self.pads = [(r * self.chunk + s, (r + 1) * self.chunk) for r, s in enumerate(self.sizes) if s < self.chunk]
            if self.error_feedback:
                self.worker = torch.zeros(world * self.chunk, dtype=torch.float32, device=device)
                if not scatter:
                    self.server = torch.zeros(self.chunk, dtype=torch.float32, device=device)
        self.calls = 0
        self.sent_bytes = 0
        self.dense_bytes = 0

    # -- public ops ----------------------------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, compress: bool = True) -> None:
        """Average ``tensor`` (flat, ``numel`` elements) over ranks, in place.

        Collective: every rank of ``comm`` calls it.

        Args:
            tensor: The 1-D floating-point buffer of ``numel`` elements; overwritten with the average.
            compress: False sends it uncompressed (a plain all-reduce, as during warm-up).

        Raises:
            ValueError: When ``tensor`` is not a 1-D tensor of ``numel`` elements.
            TypeError: When ``tensor`` is not floating point.
        """
        self.start_all_reduce(tensor, compress).finish()

    def start_all_reduce(self, tensor: torch.Tensor, compress: bool = True) -> PendingReduction:
        """:meth:`all_reduce`, returning once its first collective is launched; ``tensor`` holds the average once the
        returned reduction is finished, and must not change before.

        Collective: every rank of ``comm`` calls it.

        Args:
            tensor: As :meth:`all_reduce`.
            compress: As :meth:`all_reduce`.

        Returns:
            The reduction in flight.

        Raises:
            ValueError: When ``tensor`` is not a 1-D tensor of ``numel`` elements.
            TypeError: When ``tensor`` is not floating point.
        """
        self._check(tensor, "tensor", self.numel)
        self.calls += 1
        self.dense_bytes += dense_bytes("all_reduce", self.numel * tensor.element_size(), self.comm.world_size)
        return PendingReduction(self._all_reduce_stages(tensor, compress))

    def _all_reduce_stages(self, tensor: torch.Tensor, compress: bool) -> Stages:
        if self.comm.world_size == 1:
            return
        if not compress:
            yield from self._dense_stages(tensor)
            return
        work = tensor.float()
        stages = self._sparse(work) if self.sparse else self._two_phase(work, gather=True)
        result = yield from stages
        tensor.copy_(result)

    def _dense_stages(self, tensor: torch.Tensor) -> Stages:
        """The plain all-reduce (average), uncompressed."""
        self.sent_bytes += dense_bytes("all_reduce", self.numel * tensor.element_size(), self.comm.world_size)
        with self._checked():
            work = self.comm.all_reduce(tensor, ReductionOperation.AVERAGE, async_op=True)
        yield [work]

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, compress: bool = True) -> None:
        """``out`` = this rank's range (:func:`split_sizes`) of the average of every rank's ``inp``.

        Collective: every rank of ``comm`` calls it.

        Args:
            inp: This rank's 1-D floating-point buffer of ``numel`` elements.
            out: Receives this rank's range of the average: ``split_sizes(numel, world_size)[rank]`` elements.
            compress: False sends it uncompressed (a plain reduce-scatter, as during warm-up).

        Raises:
            ValueError: When ``inp`` or ``out`` is not a 1-D tensor of the expected size.
            TypeError: When ``inp`` or ``out`` is not floating point.
        """
        self._check(inp, "inp", self.numel)
        self._check(out, "out", self.sizes[self.comm.rank])
        world = self.comm.world_size
        self.calls += 1
        self.dense_bytes += dense_bytes("reduce_scatter", self.numel * inp.element_size(), world)
        if world == 1:
            out.copy_(inp)
            return
        if not compress:
            self.sent_bytes += dense_bytes("reduce_scatter", self.numel * inp.element_size(), world)
            sent = inp * (1.0 / world)
            received = torch.empty_like(sent[: out.numel()])
            with self._checked():
                self.comm.reduce_scatter(sent, received, ReductionOperation.SUM, scratch_input=True)
            out.copy_(received)
            return
        work = inp.float()
        rank = self.comm.rank
        if self.sparse:
            lo = self.starts[rank]
            out.copy_(_run(self._sparse(work))[lo : lo + out.numel()])
        else:
            out.copy_(_run(self._two_phase(work, gather=False))[: out.numel()])

    # -- residuals in the buffer's natural order (checkpoints) --------------------------------------------------

    def worker_residual(self) -> torch.Tensor | None:
        """This rank's worker residual, ``numel`` elements in buffer order (None without error feedback).

        Returns:
            The residual (the live tensor for top-k, a copy without the chunks' padding otherwise), or None.
        """
        if self.worker is None or self.sparse:
            return self.worker
        return torch.cat([self.worker[r * self.chunk : r * self.chunk + s] for r, s in enumerate(self.sizes)])

    def server_residual(self) -> tuple[int, torch.Tensor] | None:
        """(start, values) of the server residual this rank holds: its range of the buffer (None if it has none).

        Returns:
            ``(offset in the buffer, values)``, or None for top-k, reduce-scatter channels and no error feedback.
        """
        if self.server is None:
            return None
        rank = self.comm.rank
        return self.starts[rank], self.server[: self.sizes[rank]]

    def load_residuals(self, worker: torch.Tensor | None, server: torch.Tensor | None) -> None:
        """Set the residuals from natural-order values (as :meth:`worker_residual` / :meth:`server_residual`).

        Args:
            worker: ``numel`` values in buffer order; None (or a channel without one) leaves it as it is.
            server: This rank's range of the server residual; None (or a channel without one) leaves it as it is.
        """
        if worker is not None and self.worker is not None:
            if self.sparse:
                self.worker.copy_(worker)
            else:
                for r, s in enumerate(self.sizes):
                    self.worker[r * self.chunk : r * self.chunk + s].copy_(worker[self.starts[r] : self.starts[r] + s])
        if server is not None and self.server is not None:
            self.server[: server.numel()].copy_(server)

    def residual_norm(self) -> float:
        """The L2 norm of this rank's residuals, worker and server together (0.0 without error feedback).

        Returns:
            The norm, as a Python float.
        """
        return sum(float(t.norm()) ** 2 for t in (self.worker, self.server) if t is not None) ** 0.5

    # -- algorithms ------------------------------------------------------------------------------------------------

    def _sparse(self, acc: torch.Tensor) -> Generator[list[Work], None, torch.Tensor]:
        comm, world = self.comm, self.comm.world_size
        compressor: TopKCompressor = self.compressor  # type: ignore[assignment]
        k = compressor.k(self.numel)
        picked = kernels.topk_compress(acc, self.worker, k, compressor.mode, index_dtype=torch.int32)
        values = torch.empty(world * k, dtype=torch.float32, device=acc.device)
        indices = torch.empty(world * k, dtype=torch.int32, device=acc.device)
        with self._checked():
            works = [comm.all_gather(picked.values, values, async_op=True)]
            works.append(comm.all_gather(picked.indices, indices, async_op=True))
        self.sent_bytes += (world - 1) * compressor.payload_bytes(self.numel)
        yield works
        dense = torch.zeros(self.numel, dtype=torch.float32, device=acc.device)
        dense.index_add_(0, indices.long(), values)  # ranks' picks overlap: add, never overwrite
        return dense.div_(world)

    def _layout(self, acc: torch.Tensor) -> torch.Tensor:
        """``acc`` in the chunked layout (a view when no chunk needs padding)."""
        world = self.comm.world_size
        if not self.pads:
            return acc
        padded = torch.zeros(world * self.chunk, dtype=torch.float32, device=acc.device)
        for r, s in enumerate(self.sizes):
            padded[r * self.chunk : r * self.chunk + s] = acc[self.starts[r] : self.starts[r] + s]
        return padded

    def _two_phase(self, acc: torch.Tensor, gather: bool) -> Generator[list[Work], None, torch.Tensor]:
        comm, world, rank = self.comm, self.comm.world_size, self.comm.rank
        codec: QuantizingCompressor = self.compressor  # type: ignore[assignment]
        seed = ((self.calls - 1) * 2 * world + 2 * rank) % _SEED_MOD
        # Phase 1: every rank's codes of chunk r go to rank r, which averages them.
        codes = codec.encode(self._layout(acc), self.worker, seed)
        if self.worker is not None:
            for lo, hi in self.pads:
                self.worker[lo:hi] = 0  # padding is no gradient: keep no residual for it
        received = tuple(torch.empty_like(c) for c in codes)
        with self._checked():
            works = [comm.all_to_all(c, r, async_op=True) for c, r in zip(codes, received, strict=True)]
        self.sent_bytes += sum(round((world - 1) / world * c.numel() * c.element_size()) for c in codes)
        yield works
        mine = torch.empty(self.chunk, dtype=torch.float32, device=acc.device)
        for i in range(world):
            part = tuple(r.view(world, -1)[i] for r in received)
            codec.decode(part, mine, accumulate=i > 0)
        mine.div_(world)
        mine[self.sizes[rank] :] = 0
        if not gather:
            return mine
        # Phase 2: compress the averaged chunk again (server residual), all-gather, decode everything.
        codes = codec.encode(mine, self.server, seed + 1)
        if self.server is not None:
            self.server[self.sizes[rank] :] = 0
        everyone = tuple(torch.empty(world * c.numel(), dtype=c.dtype, device=c.device) for c in codes)
        with self._checked():
            works = [comm.all_gather(c, e, async_op=True) for c, e in zip(codes, everyone, strict=True)]
        self.sent_bytes += sum((world - 1) * c.numel() * c.element_size() for c in codes)
        yield works
        padded = torch.empty(world * self.chunk, dtype=torch.float32, device=acc.device)
        codec.decode(everyone, padded, accumulate=False)
        if not self.pads:
            return padded
        return torch.cat([padded[r * self.chunk : r * self.chunk + s] for r, s in enumerate(self.sizes)])

    # -- helpers -----------------------------------------------------------------------------------------------------

    def _checked(self):
        """The first call checks every op's shapes across ranks; later calls repeat the same shapes (unchecked)."""
        return self.comm.unchecked() if self.calls > 1 else contextlib.nullcontext()

    def _check(self, tensor: torch.Tensor, what: str, numel: int) -> None:
        _check_flat(self, tensor, what, numel)


def _check_flat(channel, tensor: torch.Tensor, what: str, numel: int) -> None:
    """Refuse what is not the flat floating-point buffer of ``numel`` elements a channel was built for."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1 or tensor.numel() != numel:
        got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(
            f"{type(channel).__name__}: {what} must be a flat tensor of {numel} elements (the channel "
            f"was built for that size), got {got}"
        )
    if not tensor.dtype.is_floating_point:
        raise TypeError(f"{type(channel).__name__}: {what} is {tensor.dtype}; gradients to compress are floating point")


# ---------------------------------------------------------------------------------------------------------------------
# PowerSGD


def orthogonalize(matrices: torch.Tensor) -> None:
    """Make the columns of each matrix of a ``(batch, n, r)`` stack orthonormal, in place (``r <= n``).

    Gram-Schmidt for ``r <= 2``, Householder QR above, the choice torch's ``powerSGD_hook`` makes (QR is one batched
    LAPACK/cuSOLVER call; Gram-Schmidt is ``r`` rounds of small ops). A zero column stays zero instead of becoming
    NaN: its norm is clamped to the smallest normal number, which changes no other column's result.

    Args:
        matrices: The ``(batch, n, r)`` stack to orthonormalize.
    """
    r = matrices.shape[2]
    if r > 2:
        matrices.copy_(torch.linalg.qr(matrices).Q)
        return
    tiny = torch.finfo(matrices.dtype).tiny
    for i in range(r):
        col = matrices[:, :, i : i + 1]
        col.div_(torch.linalg.vector_norm(col, dim=1, keepdim=True).clamp_min_(tiny))
        if i + 1 < r:
            rest = matrices[:, :, i + 1 :]
            rest.sub_((col * rest).sum(dim=1, keepdim=True) * col)


class _Matrices:
    """The bucket's compressed tensors of one shape: ``offsets`` in the buffer, each ``rows x cols`` at rank ``r``, with
    their P (``rows x r``) and Q (``cols x r``) at ``p_at`` / ``q_at`` of the channel's P and Q buffers."""

    def __init__(self, rows: int, cols: int, r: int, offsets: list[int], p_at: int, q_at: int):
        self.rows, self.cols, self.r, self.offsets, self.p_at, self.q_at = rows, cols, r, offsets, p_at, q_at

    @property
    def count(self) -> int:
        return len(self.offsets)

    def stack(self, flat: torch.Tensor) -> torch.Tensor:
        """The matrices as a ``(count, rows, cols)`` stack of ``flat``: a view for one, a copy for several."""
        size = self.rows * self.cols
        if self.count == 1:
            return flat[self.offsets[0] : self.offsets[0] + size].view(1, self.rows, self.cols)
        return torch.stack([flat[o : o + size].view(self.rows, self.cols) for o in self.offsets])

    def unstack(self, values: torch.Tensor, flat: torch.Tensor) -> None:
        """Write a ``(count, rows, cols)`` stack into ``flat`` at the matrices' offsets."""
        size = self.rows * self.cols
        for i, o in enumerate(self.offsets):
            flat[o : o + size].view(self.rows, self.cols).copy_(values[i])

    def p(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self.p_at : self.p_at + self.count * self.rows * self.r].view(self.count, self.rows, self.r)

    def q(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self.q_at : self.q_at + self.count * self.cols * self.r].view(self.count, self.cols, self.r)


class PowerSGDChannel:
    """PowerSGD all-reduce of one ``numel``-element buffer holding whole tensors at known offsets, with its worker
    residuals and warm-start ``Q``; the interface of :class:`CompressedChannel` (all-reduce only).

    Per call (after ``acc = grad + worker_residual``): the uncompressed part (tensors with < 2 dims, matrices too
    small to gain, any element no whole tensor covers) is packed into one buffer and its all-reduce launched; then
    ``P = M Q`` for every compressed matrix (batched per shape), ``Q`` being last step's average orthonormalized
    (warm start) or random (the same on every rank), and the all-reduce of all the bucket's ``P`` launched. Once both
    landed: ``P`` orthonormalized, ``Q = M^T P``, the worker residual set to ``M - P Q^T`` (what this rank's own
    factors miss), the all-reduce of ``Q`` launched. Once it landed: ``Q /= N`` (kept for the warm start) and the
    buffer gets ``P Q^T`` and the dense average. At full rank ``P P^T = I`` on the matrix's column space: the
    result is the dense average.

    Args:
        comm: The group every call averages over.
        compressor: The :class:`PowerSGDCompressor`.
        numel: Elements of the buffer this channel serves.
        tensors: ``(offset in the buffer, shape)`` of each whole tensor in it.
        device: Where the buffer, the residuals and P/Q live.
        error_feedback: Keep what compression loses in the worker residual.

    Raises:
        ValueError: When a tensor lies outside the buffer.
    """

    sparse = False
    scatter = False
    server = None

    def __init__(
        self,
        comm: CommunicationBackend,
        compressor: PowerSGDCompressor,
        numel: int,
        tensors: Sequence[tuple[int, tuple[int, ...]]],
        *,
        device: torch.device,
        error_feedback: bool = True,
    ):
        self.comm, self.compressor, self.numel, self.device = comm, compressor, numel, device
        self.error_feedback = error_feedback
        by_shape: dict[tuple[int, int], list[int]] = {}
        for offset, shape in tensors:
            size = math.prod(shape)
            if offset < 0 or offset + size > numel:
                raise ValueError(
                    f"PowerSGDChannel: a tensor of shape {tuple(shape)} at offset {offset} lies outside the "
                    f"{numel}-element buffer"
                )
            if len(shape) >= 2 and size and compressor.compresses(shape[0], size // shape[0]):
                by_shape.setdefault((shape[0], size // shape[0]), []).append(offset)
        self.groups: list[_Matrices] = []
        p_at = q_at = 0
        for (rows, cols), offsets in by_shape.items():
            r = compressor.matrix_rank(rows, cols)
            self.groups.append(_Matrices(rows, cols, r, offsets, p_at, q_at))
            p_at += len(offsets) * rows * r
            q_at += len(offsets) * cols * r
        covered = sorted((o, o + g.rows * g.cols) for g in self.groups for o in g.offsets)
        self.dense_ranges: list[tuple[int, int]] = []
        at = 0
        for lo, hi in [*covered, (numel, numel)]:
            if lo > at:
                self.dense_ranges.append((at, lo))
            at = max(at, hi)
        self.dense_numel = sum(hi - lo for lo, hi in self.dense_ranges)
        self.p_numel, self.q_numel = p_at, q_at
        self.q = torch.zeros(q_at, dtype=torch.float32, device=device)
        self.q_ready = False
        """Whether ``q`` holds a previous step's average (the warm start); False until the first compressed call."""
        self.worker = torch.zeros(numel, dtype=torch.float32, device=device) if error_feedback else None
        self.generator = torch.Generator().manual_seed(0x5EED)  # on the CPU, as torch's hook: equal on every rank
        self.calls = 0
        self.sent_bytes = 0
        self.dense_bytes = 0

    def payload_bytes(self) -> int:
        """Bytes one compressed call sums over ranks: the uncompressed elements, P and Q, in fp32.

        Returns:
            The size in bytes.
        """
        return 4 * (self.dense_numel + self.p_numel + self.q_numel)

    # -- public ops ----------------------------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, compress: bool = True) -> None:
        """Average ``tensor`` over ranks, in place (see :meth:`CompressedChannel.all_reduce`)."""
        self.start_all_reduce(tensor, compress).finish()

    def start_all_reduce(self, tensor: torch.Tensor, compress: bool = True) -> PendingReduction:
        """:meth:`all_reduce`, returning once its first collectives are launched (see
        :meth:`CompressedChannel.start_all_reduce`)."""
        _check_flat(self, tensor, "tensor", self.numel)
        self.calls += 1
        self.dense_bytes += dense_bytes("all_reduce", self.numel * tensor.element_size(), self.comm.world_size)
        return PendingReduction(self._stages(tensor, compress))

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, compress: bool = True) -> None:
        """Refused: PowerSGD's factors are summed whole, so it has no reduce-scatter.

        Raises:
            TypeError: Always.
        """
        raise TypeError(
            "PowerSGD compresses all-reduces only (every rank needs the whole P and Q); its gradients here are "
            "reduce-scattered (ZeRO-2): use ZeRO-1 or DDP with it, or another compressor"
        )

    # -- state in the buffer's natural order (checkpoints) -------------------------------------------------------

    def worker_residual(self) -> torch.Tensor | None:
        """This rank's worker residual, ``numel`` elements in buffer order (None without error feedback)."""
        return self.worker

    def server_residual(self) -> None:
        """None: PowerSGD keeps no server residual (its averages are exact sums of the factors)."""
        return None

    def load_residuals(self, worker: torch.Tensor | None, server: torch.Tensor | None) -> None:
        """Set the worker residual from ``numel`` values in buffer order (None leaves it); ``server`` is ignored."""
        if worker is not None and self.worker is not None:
            self.worker.copy_(worker)

    def residual_norm(self) -> float:
        """The L2 norm of this rank's worker residual (0.0 without error feedback)."""
        return float(self.worker.norm()) if self.worker is not None else 0.0

    def warm_start_state(self) -> dict[int, torch.Tensor]:
        """The warm-start ``Q`` of each compressed tensor, by its offset in the buffer: ``cols x r`` values (the same
        on every rank); empty before the first compressed call.

        Returns:
            Offset -> that tensor's ``Q`` (a view, flat).
        """
        if not self.q_ready:
            return {}
        out = {}
        for g in self.groups:
            q = g.q(self.q)
            for i, offset in enumerate(g.offsets):
                out[offset] = q[i].reshape(-1)
        return out

    def warm_start_sizes(self) -> dict[int, int]:
        """Elements of each compressed tensor's ``Q``, by its offset in the buffer.

        Returns:
            Offset -> ``cols x r``.
        """
        return {offset: g.cols * g.r for g in self.groups for offset in g.offsets}

    def load_warm_start(self, values: dict[int, torch.Tensor]) -> None:
        """Set every compressed tensor's ``Q`` (as :meth:`warm_start_state`); leaves the state as it is unless
        ``values`` covers all of them.

        Args:
            values: Offset -> flat ``Q`` values.
        """
        if not self.groups or set(values) != set(self.warm_start_sizes()):
            return
        for g in self.groups:
            q = g.q(self.q)
            for i, offset in enumerate(g.offsets):
                q[i].copy_(values[offset].view(g.cols, g.r))
        self.q_ready = True

    # -- the algorithm -----------------------------------------------------------------------------------------------

    def _stages(self, tensor: torch.Tensor, compress: bool) -> Stages:
        comm, world = self.comm, self.comm.world_size
        if world == 1:
            return
        if not compress:
            self.sent_bytes += dense_bytes("all_reduce", self.numel * tensor.element_size(), world)
            with self._checked():
                work = comm.all_reduce(tensor, ReductionOperation.AVERAGE, async_op=True)
            yield [work]
            return
        acc = tensor.float()
        if self.worker is not None:
            acc = acc + self.worker
        self.sent_bytes += dense_bytes("all_reduce", self.payload_bytes(), world)
        works = []
        dense = torch.cat([acc[lo:hi] for lo, hi in self.dense_ranges]) if self.dense_ranges else None
        if dense is not None:
            with self._checked():  # first: it needs no compute
                works.append(comm.all_reduce(dense, ReductionOperation.SUM, async_op=True))
        if self.groups:
            if not self.compressor.warm_start or not self.q_ready:
                self.q.copy_(torch.randn(self.q_numel, generator=self.generator, dtype=torch.float32))
            p = torch.empty(self.p_numel, dtype=torch.float32, device=acc.device)
            stacks = [g.stack(acc) for g in self.groups]
            for g, m in zip(self.groups, stacks, strict=True):
                q = g.q(self.q)
                orthogonalize(q)
                torch.bmm(m, q, out=g.p(p))
            with self._checked():
                works.append(comm.all_reduce(p, ReductionOperation.SUM, async_op=True))
        yield works
        if self.groups:
            residuals = []
            for g, m in zip(self.groups, stacks, strict=True):
                pg, qg = g.p(p), g.q(self.q)
                orthogonalize(pg)
                torch.bmm(m.transpose(1, 2), pg, out=qg)
                if self.worker is not None:  # what this rank's own factors miss: M - P (M^T P)^T
                    residuals.append(torch.baddbmm(m, pg, qg.transpose(1, 2), alpha=-1))
            if self.worker is not None:
                for g, residual in zip(self.groups, residuals, strict=True):
                    g.unstack(residual, self.worker)
            with self._checked():
                work = comm.all_reduce(self.q, ReductionOperation.SUM, async_op=True)
            yield [work]
            self.q.div_(world)
            self.q_ready = True
            for g in self.groups:
                g.unstack(torch.bmm(g.p(p), g.q(self.q).transpose(1, 2)), tensor)
        if dense is not None:
            dense.div_(world)
            at = 0
            for lo, hi in self.dense_ranges:
                tensor[lo:hi].copy_(dense[at : at + hi - lo])
                if self.worker is not None:
                    self.worker[lo:hi] = 0  # summed exactly: nothing lost
                at += hi - lo

    def _checked(self):
        """The first call checks every op's shapes across ranks; later calls repeat the same shapes (unchecked)."""
        return self.comm.unchecked() if self.calls > 1 else contextlib.nullcontext()


def make_channel(
    comm: CommunicationBackend,
    compressor: Compressor,
    numel: int,
    tensors: Sequence[tuple[int, tuple[int, ...]]] = (),
    *,
    device: torch.device,
    scatter: bool = False,
    error_feedback: bool = True,
) -> CompressedChannel | PowerSGDChannel:
    """The channel that serves ``compressor``: a :class:`PowerSGDChannel` for PowerSGD (which needs the buffer's
    ``tensors``, ``(offset, shape)``), else a :class:`CompressedChannel`.

    Args:
        comm: The group every call averages over.
        compressor: Any compressor.
        numel: Elements of the buffer.
        tensors: ``(offset in the buffer, shape)`` of each whole tensor in it (PowerSGD only).
        device: Where the buffer and the channel's state live.
        scatter: Serve reduce-scatters instead of all-reduces.
        error_feedback: Keep what compression loses.

    Returns:
        The channel.

    Raises:
        TypeError: When ``scatter`` is asked of PowerSGD (it compresses all-reduces only).
    """
    if isinstance(compressor, PowerSGDCompressor):
        if scatter:
            raise TypeError(
                "PowerSGD compresses all-reduces only (every rank needs the whole P and Q), and this buffer is "
                "reduce-scattered (ZeRO-2, or a ZeRO optimizer's own reduce-scatter); use DDPModel or ZeRO1Model "
                "(their bucket all-reduces) with PowerSGD, or another compressor with ZeRO-2"
            )
        return PowerSGDChannel(comm, compressor, numel, tensors, device=device, error_feedback=error_feedback)
    return CompressedChannel(comm, compressor, numel, device=device, scatter=scatter, error_feedback=error_feedback)
