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

Conservation (tested): summed over steps, what was applied plus ``mean_r(worker_r) + server`` equals the sum of
the true averaged gradients, so nothing is lost, only delayed.

Byte accounting uses the per-rank send volume of bandwidth-optimal algorithms (as nccl-tests' "bus bytes"):
all-reduce ``2 (N-1)/N x B``, reduce-scatter and all-to-all ``(N-1)/N x B``, all-gather ``(N-1) x b`` for a
per-rank piece of ``b`` bytes. Top-k's all-gather therefore grows with ``N`` (``N x 2 ratio`` of dense at fp32),
the quantized paths do not.
"""

from __future__ import annotations

import contextlib

import torch

from .. import kernels
from ..comm import CommunicationBackend, ReductionOperation, split_sizes
from .compressors import Compressor, QuantizingCompressor, TopKCompressor

__all__ = ["CompressedChannel", "dense_bytes"]

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
        n, world, rank = numel, comm.world_size, comm.rank
        self.sizes = split_sizes(n, world)
        self.starts = [sum(self.sizes[:r]) for r in range(world)]
        self.sparse = isinstance(compressor, TopKCompressor)
        self.worker: torch.Tensor | None = None
        self.server: torch.Tensor | None = None
        if self.sparse:
            if self.error_feedback:
                self.worker = torch.zeros(n, dtype=torch.float32, device=device)
            self.generator = torch.Generator(device=device).manual_seed(0x5EED + rank)
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
        self._check(tensor, "tensor", self.numel)
        self.calls += 1
        self.dense_bytes += dense_bytes("all_reduce", self.numel * tensor.element_size(), self.comm.world_size)
        if self.comm.world_size == 1:
            return
        if not compress:
            self.sent_bytes += dense_bytes("all_reduce", self.numel * tensor.element_size(), self.comm.world_size)
            with self._checked():
                self.comm.all_reduce(tensor, ReductionOperation.AVERAGE)
            return
        work = tensor.float()
        result = self._sparse(work) if self.sparse else self._two_phase(work, gather=True)
        tensor.copy_(result)

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
            out.copy_(self._sparse(work)[lo : lo + out.numel()])
        else:
            out.copy_(self._two_phase(work, gather=False)[: out.numel()])

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

    def _sparse(self, acc: torch.Tensor) -> torch.Tensor:
        comm, world = self.comm, self.comm.world_size
        compressor: TopKCompressor = self.compressor  # type: ignore[assignment]
        k = compressor.k(self.numel)
        picked = kernels.topk_compress(
            acc, self.worker, k, compressor.mode, generator=self.generator, index_dtype=torch.int32
        )
        values = torch.empty(world * k, dtype=torch.float32, device=acc.device)
        indices = torch.empty(world * k, dtype=torch.int32, device=acc.device)
        with self._checked():
            comm.all_gather(picked.values, values)
            comm.all_gather(picked.indices, indices)
        self.sent_bytes += (world - 1) * compressor.payload_bytes(self.numel)
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

    def _two_phase(self, acc: torch.Tensor, gather: bool) -> torch.Tensor:
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
            for c, r in zip(codes, received, strict=True):
                comm.all_to_all(c, r)
        self.sent_bytes += sum(round((world - 1) / world * c.numel() * c.element_size()) for c in codes)
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
            for c, e in zip(codes, everyone, strict=True):
                comm.all_gather(c, e)
        self.sent_bytes += sum((world - 1) * c.numel() * c.element_size() for c in codes)
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
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1 or tensor.numel() != numel:
            got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(
                f"{type(self).__name__}: {what} must be a flat tensor of {numel} elements (the channel "
                f"was built for that size), got {got}"
            )
        if not tensor.dtype.is_floating_point:
            raise TypeError(
                f"{type(self).__name__}: {what} is {tensor.dtype}; gradients to compress are floating point"
            )
