"""Gradient compression: wire bytes, codec throughput on CPU, and step time against DDP over a capped link.

    python -m benchmarks.compression [--links 0,10,3,1,0.3,0.1] [--steps 2] [--rounds 7] [--batch 256]

Four measurements, one JSON (``benchmarks/results/compression.json``):

1. Wire bytes relative to dense fp32, scales and indices included, on a ``--numel`` (4M) fp32 buffer, so block
   padding does not count: (a) one rank's payload, ``payload_bytes(n) / 4n``; (b) the per-rank send volume of a
   real compressed all-reduce on Gloo at N = 2 and 4, ``CompressedChannel.sent_bytes / dense_bytes`` (nccl-tests
   "bus bytes": dense all-reduce 2(N-1)/N x 4n), cross-checked against what the link cap below charged.
   Targets: top-k 1% <= 2.5%, int8 <= 27%, 1-bit <= 4%, checked on (a) and on (b) at N = 2. Top-k is
   all-gathered, so its volume grows with N (N x 2% at fp32); at N = 4 it is twice the N = 2 figure.
2. Codec throughput on this CPU (the torch reference kernels; no GPU here): GB/s of fp32 gradient processed
   (4n bytes / time) by ``topk_compress`` (exact and threshold, k = 1%), ``quantize_int8``, ``quantize_1bit``
   (all with a residual, i.e. error feedback) and the decode side (``dequantize_*_accumulate``), each beside the
   same math in plain torch ops (baseline / gpudist > 1: gpudist is faster). Median of interleaved rounds.
   GPU throughput needs a CUDA device: ``python -m benchmarks.kernels`` on a lent GPU (``"gpu": null`` here).
3. End-to-end step time at world size 2 on Gloo: ``DDPModel`` + ``DDPOptimizer(SGD)`` (dense, async all-reduce
   overlapped with backward) against ``DDPModel`` + ``GradientCompressionOptimizer(SGD, spec)`` (each bucket
   compressed and its collectives launched when ready, finished by the end of backward), PowerSGD at
   ``--powersgd-rank`` among the specs, interleaved round by round, at several link speeds. On uncapped loopback
   only, also: every spec with ``overlap=False`` (``"<spec> sync"``: each bucket reduced before backward goes on),
   and torch's own ``DistributedDataParallel`` dense (``torch_ddp``) and with ``powerSGD_hook`` at the same rank
   (``torch_powersgd``), on the same model, process group and loopback (torch's collectives do not go through
   gpudist's backend, so the link cap below cannot slow them: they are measured uncapped only). Loopback Gloo
   is far faster than a network, so :class:`ThrottledGloo` makes every collective take at least
   ``latency + per-rank send bytes / bandwidth`` (one serial link per rank), charged on the bytes each op really
   moves: compressed runs gain exactly what their smaller payloads save. ``local_step`` (no communication) is
   the compute floor. Speedup = DDP step / compressed step at the same link speed. Variants and link speeds
   take turns round by round; each time is the median round at the slowest rank's pace.
4. Convergence on the example task (examples/lm.py's TinyLM on its synthetic corpus, momentum SGD, 2 ranks):
   final loss (mean of the last 20 steps) of dense DDP, gpudist PowerSGD and torch DDP + ``powerSGD_hook`` at
   the same rank, steps and dense warm-up.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch
from torch.nn import functional as F

import gpudist
from gpudist import kernels
from gpudist.bench import environment, interleaved_times
from gpudist.bench.kernels import time_variants
from gpudist.comm import GlooCommunicationBackend, Work
from gpudist.compression import CompressedChannel, parse_compressor
from gpudist.fileio import atomic_write_json
from gpudist.launch import WorkerPool, spawn

from .workloads import mlp as make_model

RESULTS = Path(__file__).resolve().parent / "results"
TARGETS = {"topk:0.01": 0.025, "int8": 0.27, "1bit": 0.04}
"""Wire bytes / dense fp32 bytes each compressor must stay within (scales and indices included)."""


# ---------------------------------------------------------------------------------------------------------------------
# A slower link


class ThrottledGloo(GlooCommunicationBackend):
    """The Gloo group of ``comm`` behind a link of ``gbit_per_s`` (None: uncapped) and ``latency_s`` per op.

    Every public op (all_reduce, reduce_scatter, all_gather, all_to_all, broadcast, send, ...) goes through
    :meth:`_run`, which knows the op and its nccl-tests "size", so that is the one place to charge it: the op's
    per-rank send volume (all_reduce 2(N-1)/N B, reduce_scatter and all_to_all (N-1)/N B, all_gather (N-1)/N of
    the output, broadcast and send B, recv and barrier nothing) is booked on this rank's link, which carries
    one transfer at a time: a transfer starts when the op is issued or the previous one ends, whichever is later.
    A blocking op returns no earlier than its transfer's end; an ``async_op`` one's ``wait()`` does (so DDP's
    overlap of async all-reduces with backward is modelled, and two in-flight buckets do not share a free link).
    The op itself still runs on loopback, so the time is max(real, modelled). The consistency checks Gloo runs
    before ops (a few hundred bytes) are not charged.

    It is a subclass sharing ``comm``'s ProcessGroupGloo, not a wrapper, because ``ShardingConfiguration``
    wants a ``CommunicationBackend`` and ``unchecked()`` toggles the backend's own ``validate``.
    """

    def __init__(self, comm: GlooCommunicationBackend, gbit_per_s: float | None = None, latency_s: float = 0.0):
        super().__init__(
            timeout=comm.timeout,
            validate=comm.validate,
            _gloo=comm._gloo,
            _store=comm._store,
            _rank_world=(comm.rank, comm.world_size),
            _group_name=comm.group,
        )
        self.latency_s = latency_s
        self.set_link(gbit_per_s)
        self.wire_bytes = 0
        """Per-rank send volume charged so far (what the cap sees; compare with ``CompressedChannel.sent_bytes``)."""
        self.waited_s = 0.0
        """Seconds slept for the cap so far."""
        self._link_free = 0.0

    def set_link(self, gbit_per_s: float | None) -> None:
        self.gbit_per_s = gbit_per_s
        self._bytes_per_s = None if gbit_per_s is None else gbit_per_s * 1e9 / 8

    def send_volume(self, op: str, nbytes: int) -> float:
        n = self.world_size
        factor = {
            "all_reduce": 2 * (n - 1) / n,
            "reduce_scatter": (n - 1) / n,
            "all_to_all": (n - 1) / n,
            "all_gather": (n - 1) / n,
            "broadcast": 1.0,
            "send": 1.0,
        }.get(op, 0.0)
        return factor * nbytes

    def _run(self, sig, nbytes, async_op, start, stat_name=None) -> Work | None:
        volume = self.send_volume(stat_name or sig.op, nbytes)
        self.wire_bytes += round(volume)
        if self._bytes_per_s is None or volume == 0:
            return super()._run(sig, nbytes, async_op, start, stat_name)
        begin = max(time.perf_counter(), self._link_free)
        self._link_free = deadline = begin + self.latency_s + volume / self._bytes_per_s
        work = super()._run(sig, nbytes, async_op, start, stat_name)
        if not async_op:
            self._sleep_until(deadline)
            return None

        def wait() -> None:
            work.wait()
            self._sleep_until(deadline)

        return Work(wait, lambda: work.is_completed() and time.perf_counter() >= deadline)

    def _sleep_until(self, deadline: float) -> None:
        left = deadline - time.perf_counter()
        if left > 0:
            time.sleep(left)
            self.waited_s += left


# ---------------------------------------------------------------------------------------------------------------------
# 1. Wire bytes


def wire_rank(comm, numel: int, specs: list[str]) -> dict:
    capped = ThrottledGloo(comm)  # uncapped: only its byte counter is used here
    torch.manual_seed(comm.rank)
    grad = torch.randn(numel)
    rows = {}
    for spec in specs:
        channel = CompressedChannel(capped, parse_compressor(spec), numel, device=torch.device("cpu"))
        channel.all_reduce(grad.clone())  # the first call checks the shapes across ranks; count the second
        sent, dense, charged = channel.sent_bytes, channel.dense_bytes, capped.wire_bytes
        buf = grad.clone()
        start = time.perf_counter()
        channel.all_reduce(buf)
        seconds = time.perf_counter() - start
        rows[spec] = {
            "sent_bytes": channel.sent_bytes - sent,
            "dense_bytes": channel.dense_bytes - dense,
            "charged_by_cap": capped.wire_bytes - charged,
            "seconds": seconds,
        }
    return rows


def wire_table(numel: int, worlds: list[int], specs: list[str], pool: WorkerPool | None) -> dict:
    rows = {}
    for spec in specs:
        compressor = parse_compressor(spec)
        ratio = compressor.payload_bytes(numel) / (4 * numel)
        rows[spec] = {"compressor": compressor.describe(), "payload_ratio": ratio, "volume": {}}
    for n in worlds:
        if pool is not None and pool.world_size == n:
            res = pool.run(wire_rank, numel, specs)
        else:
            res = spawn(wire_rank, n, numel, specs, timeout=600.0)
        for spec in specs:
            r = res[0][spec]
            r["seconds"] = max(x[spec]["seconds"] for x in res)  # the slowest rank's call
            r["ratio"] = r["sent_bytes"] / r["dense_bytes"]
            rows[spec]["volume"][str(n)] = r
    for spec, target in TARGETS.items():
        if spec in rows:
            row = rows[spec]
            row["target"] = target
            row["payload_meets_target"] = row["payload_ratio"] <= target
            if "2" in row["volume"]:
                row["volume_n2_meets_target"] = row["volume"]["2"]["ratio"] <= target
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# 2. Codec throughput on CPU


def codec_variants(n: int, ratio: float = 0.01, block: int = 256) -> dict[str, dict]:
    """op -> {"gpudist": fn, "torch": fn}: the same work (error feedback included) in gpudist and in plain torch."""
    torch.manual_seed(0)
    n = n // block * block
    k = max(1, math.ceil(ratio * n))
    grad = torch.randn(n)
    res = {name: torch.randn(n) * 0.1 for name in ("exact", "threshold", "torch_topk", "int8", "1bit", "torch_q")}
    shifts = torch.arange(8, dtype=torch.uint8)

    def torch_topk():  # acc = grad + residual; keep the k largest |acc|; the residual keeps the rest
        acc = res["torch_topk"].add_(grad)
        idx = torch.topk(acc.abs(), k, sorted=False).indices
        values = acc[idx]
        acc.index_fill_(0, idx, 0.0)
        return values, idx

    def torch_int8():  # the plain cast with a per-block scale, then the residual update
        blocks = res["torch_q"].add_(grad).view(-1, block)
        scale = blocks.abs().amax(1, keepdim=True) / 127
        q = (blocks / scale).round().clamp(-127, 127)
        blocks.sub_(q * scale)
        return q.to(torch.int8), scale

    def torch_1bit():
        blocks = res["torch_q"].add_(grad).view(-1, block)
        scale = blocks.abs().mean(1, keepdim=True)
        negative = blocks < 0
        bits = (negative.view(-1, 8).to(torch.uint8) << shifts).sum(1, dtype=torch.uint8)
        blocks.sub_(torch.where(negative, -scale, scale))
        return bits, scale

    q, q_scales = kernels.quantize_int8(grad, block_size=block)
    bits, b_scales = kernels.quantize_1bit(grad, block_size=block)
    out = torch.zeros(n)

    def torch_deq_int8():
        out.view(-1, block).add_(q.view(-1, block).float() * q_scales.view(-1, 1))

    def torch_deq_1bit():
        negative = ((bits.view(-1, 1) >> shifts) & 1).bool().view(-1, block)
        out.view(-1, block).add_(torch.where(negative, -b_scales.view(-1, 1), b_scales.view(-1, 1)))

    return {
        "topk_exact_1pct": {
            "gpudist": lambda: kernels.topk_compress(grad, res["exact"], k, "exact"),
            "torch": torch_topk,
        },
        "topk_threshold_1pct": {
            "gpudist": lambda: kernels.topk_compress(grad, res["threshold"], k, "threshold"),
            "torch": torch_topk,
        },
        "quantize_int8": {
            "gpudist": lambda: kernels.quantize_int8(grad, res["int8"], block_size=block),
            "torch": torch_int8,
        },
        "quantize_1bit": {
            "gpudist": lambda: kernels.quantize_1bit(grad, res["1bit"], block_size=block),
            "torch": torch_1bit,
        },
        "dequantize_int8_accumulate": {
            "gpudist": lambda: kernels.dequantize_int8_accumulate(q, q_scales, out, block_size=block),
            "torch": torch_deq_int8,
        },
        "dequantize_1bit_accumulate": {
            "gpudist": lambda: kernels.dequantize_1bit_accumulate(bits, b_scales, out, block_size=block),
            "torch": torch_deq_1bit,
        },
    }


def codec_table(n: int, rounds: int) -> list[dict]:
    rows = []
    n = n // 256 * 256
    for op, variants in codec_variants(n).items():
        seconds, iters = time_variants(variants, torch.device("cpu"), rounds=rounds)
        rows.append(
            {
                "op": op,
                "elements": n,
                "seconds": seconds,
                "iters_per_round": iters,
                "gb_per_s": {k: 4 * n / v / 1e9 for k, v in seconds.items()},
                "speedup_vs_torch": seconds["torch"] / seconds["gpudist"],
            }
        )
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# 3. End to end over a capped link


def torch_powersgd(model: torch.nn.Module, rank: int, start_iter: int, bucket_mb: float) -> torch.nn.Module:
    """torch's ``DistributedDataParallel`` on the default process group, with ``powerSGD_hook`` at ``rank`` (its
    defaults otherwise: error feedback, warm start, min_compression_rate 2) after ``start_iter`` dense steps."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter)
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp


WARMUP_STEPS = 2
"""Uncapped steps of every variant before timing: PowerSGD (both) starts compressing after them (torch's hook needs
``start_powerSGD_iter >= 2`` with error feedback)."""


def e2e_rank(
    comm,
    width: int,
    depth: int,
    batch: int,
    steps: int,
    rounds: int,
    bucket_mb: float,
    links: list[float | None],
    specs: list[str],
    latency_s: float,
    powersgd_rank: int,
) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    link = ThrottledGloo(comm, latency_s=latency_s)
    torch.manual_seed(comm.rank)
    x, y = torch.randn(batch, width), torch.randint(0, 10, (batch,))
    local = make_model(width, depth)
    local_opt = torch.optim.SGD(local.parameters(), lr=1e-4)
    setups = {"local_step": (local, local_opt)}
    for spec, overlap in [(None, True), *((s, True) for s in specs), *((s, False) for s in specs)]:
        config = gpudist.ShardingConfiguration(link, bucket_cap_mb=bucket_mb)
        model = gpudist.DDPModel(make_model(width, depth), config)
        sgd = torch.optim.SGD(model.parameters(), lr=1e-4)
        if spec is None:
            setups["ddp"] = (model, gpudist.DDPOptimizer(sgd, config))
        else:
            opt = gpudist.GradientCompressionOptimizer(sgd, config, spec, warmup_steps=0, overlap=overlap)
            setups[spec if overlap else f"{spec} sync"] = (model, opt)
    dense = DistributedDataParallel(make_model(width, depth), bucket_cap_mb=bucket_mb)
    setups["torch_ddp"] = (dense, torch.optim.SGD(dense.parameters(), lr=1e-4))
    hooked = torch_powersgd(make_model(width, depth), powersgd_rank, WARMUP_STEPS, bucket_mb)
    setups["torch_powersgd"] = (hooked, torch.optim.SGD(hooked.parameters(), lr=1e-4))
    uncapped_only = {f"{spec} sync" for spec in specs} | {"torch_ddp", "torch_powersgd"}

    def step(model, opt):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    variants = {name: (lambda m=m, o=o: step(m, o)) for name, (m, o) in setups.items()}
    # Link speeds take turns round by round too, not one block of rounds each: a first full run with one block per
    # link had its 1 Gbit/s row alone inflated (ddp 321 ms, top-k 460 ms against 250 and 320 ms at the speeds
    # beside it) while another process held a core for those ~20 s; round-robin spreads such a burst over all rows.
    for fn in variants.values():  # warm-up, uncapped
        for _ in range(WARMUP_STEPS):
            fn()
    measured = {gbit: {n: fn for n, fn in variants.items() if gbit is None or n not in uncapped_only} for gbit in links}
    times: dict = {gbit: {name: [] for name in measured[gbit]} for gbit in links}
    waited = dict.fromkeys(links, 0.0)
    for _ in range(rounds):
        for gbit in links:
            link.set_link(gbit)
            before = link.waited_s
            for name, t in interleaved_times(link, measured[gbit], steps, 1, warmup=False).items():
                times[gbit][name].append(t)
            waited[gbit] += link.waited_s - before
    rows = [
        {
            "gbit_per_s": gbit,
            "step_seconds": {name: statistics.median(ts) for name, ts in times[gbit].items()},
            "round_seconds": times[gbit],
            "slept_for_cap_s": waited[gbit],
        }
        for gbit in links
    ]
    link.set_link(None)
    wire = {}
    for name, fn in variants.items():  # one more step each: what the cap charges per step
        if name.startswith("torch_"):
            continue  # torch's collectives bypass gpudist's backend: nothing to count here
        before = link.wire_bytes
        fn()
        wire[name] = link.wire_bytes - before
    reports = {spec: setups[spec][1].communication_report()["last_step"] for spec in specs}
    return {
        "params": sum(p.numel() for p in local.parameters()),
        "buckets": setups["ddp"][0].bucket_sizes(),
        "rows": rows,
        "wire_bytes_per_step": wire,
        "compression_report": reports,
    }


# ---------------------------------------------------------------------------------------------------------------------
# 4. Convergence on the example task


def convergence_rank(comm, steps: int, rank: int, start_iter: int = 10, d_model: int = 64, seq_len: int = 32) -> dict:
    """Dense DDP, gpudist PowerSGD and torch DDP + ``powerSGD_hook`` on the example task: same model, data, rank,
    dense warm-up and momentum SGD; the loss per step (mean over ranks) and the mean of the last 20."""
    import torch.distributed as dist

    from examples.lm import SyntheticCorpus, TinyLM, lm_loss

    corpus = SyntheticCorpus(0, seq_len)
    data = [corpus.batches(s, 16, comm.rank, comm.world_size) for s in range(steps)]
    curves, seconds = {}, {}
    for variant in ("dense", "gpudist_powersgd", "torch_powersgd"):
        net = TinyLM(SyntheticCorpus.vocab_size, d_model, 2, 4, seq_len, seed=0)
        if variant == "torch_powersgd":
            model = torch_powersgd(net, rank, start_iter, 25.0)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        else:
            config = gpudist.ShardingConfiguration(comm)
            model = gpudist.DDPModel(net, config)
            opt = gpudist.DDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), config)
            if variant == "gpudist_powersgd":
                opt = gpudist.GradientCompressionOptimizer(opt, config, f"powersgd:{rank}:{start_iter}")
        losses = []
        start = time.perf_counter()
        for x, y in data:
            loss = lm_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        seconds[variant] = time.perf_counter() - start
        curve = torch.stack(losses)
        dist.all_reduce(curve)
        curves[variant] = (curve / comm.world_size).tolist()
    return {
        "task": "examples/lm.py TinyLM on SyntheticCorpus(0), 2 layers, 4 heads, global batch 16, SGD lr 0.05 m 0.9",
        "d_model": d_model,
        "steps": steps,
        "rank": rank,
        "start_iter": start_iter,
        "final_loss": {k: statistics.fmean(v[-20:]) for k, v in curves.items()},
        "seconds": seconds,
        "loss_every_10": {k: v[::10] for k, v in curves.items()},
    }


def break_even(rows: list[dict], spec: str) -> dict:
    """Where the speedup of ``spec`` over DDP crosses 1 along the measured link speeds (log-interpolated)."""
    points = sorted(((r["gbit_per_s"] or math.inf, r["speedup"][spec]) for r in rows), key=lambda p: p[0])
    prefix = 0  # the slowest links, up to the first one where it does not pay
    while prefix < len(points) and points[prefix][1] > 1:
        prefix += 1
    if not prefix:
        return {
            "pays_up_to_gbit_per_s": None,
            "break_even_gbit_per_s": None,
            "text": f"does not pay at any measured link (slowest {points[0][0]:g} Gbit/s)",
        }
    fastest = points[prefix - 1][0]
    faster_none_pay = all(s <= 1 for _, s in points[prefix:])
    if math.isinf(fastest):
        return {
            "pays_up_to_gbit_per_s": "uncapped",
            "break_even_gbit_per_s": None,
            "text": "pays at every measured link, uncapped loopback included",
        }
    nxt = min(bw for bw, _ in points if bw > fastest)
    s_lo, s_hi = dict(points)[fastest], dict(points)[nxt]
    estimate = None
    if not math.isinf(nxt):  # log-log interpolation of the speedup between the two links around 1
        frac = math.log(s_lo) / (math.log(s_lo) - math.log(s_hi))
        estimate = math.exp(math.log(fastest) + frac * (math.log(nxt) - math.log(fastest)))
    text = f"pays at <= {fastest:g} Gbit/s, not at {'uncapped' if math.isinf(nxt) else f'{nxt:g} Gbit/s'}"
    if estimate is not None:
        text += f" (break-even ~{estimate:.2g} Gbit/s, log-interpolated)"
    if not faster_none_pay:
        faster = [f"{'uncapped' if math.isinf(bw) else f'{bw:g}'} ({sp:.2f}x)" for bw, sp in points[prefix:] if sp > 1]
        text += f"; yet > 1 again at {', '.join(faster)}: within noise?"
    return {"pays_up_to_gbit_per_s": fastest, "break_even_gbit_per_s": estimate, "text": text}


# ---------------------------------------------------------------------------------------------------------------------


def _link_list(text: str) -> list[float | None]:
    """'0,10,1,0.1' -> [None, 10, 1, 0.1] (0 or inf: uncapped), fastest first."""
    links = [None if float(t) in (0.0, math.inf) else float(t) for t in text.split(",")]
    return sorted(set(links), key=lambda g: -(g or math.inf))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=4 << 20, help="elements of the buffer of parts 1 and 2")
    parser.add_argument("--wire-worlds", default="2,4", help="world sizes of the measured send volume")
    parser.add_argument("--codec-rounds", type=int, default=7)
    parser.add_argument("--codec-threads", type=int, default=1, help="torch threads for part 2 (1 = as each rank)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4, help="hidden layers: 4 x 1024^2 ~ 4.2M parameters")
    parser.add_argument("--batch", type=int, default=256, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=2, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--links", default="0,10,3,1,0.3,0.1", help="link speeds in Gbit/s, 0 = uncapped")
    parser.add_argument("--latency-us", type=float, default=0.0, help="added to every capped op")
    parser.add_argument("--compressors", default="topk:0.01,topk:0.01:threshold,int8,1bit")
    parser.add_argument("--powersgd-rank", type=int, default=4, help="PowerSGD's rank, gpudist's and torch's hook")
    parser.add_argument("--convergence-steps", type=int, default=300, help="steps of part 4 (the example task)")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: wire, codec, e2e, convergence")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    powersgd = f"powersgd:{args.powersgd_rank}:{WARMUP_STEPS}"
    specs = [*args.compressors.split(","), powersgd]
    links = _link_list(args.links)
    worlds = [int(w) for w in args.wire_worlds.split(",")]
    # One thread for the codecs, as each rank of parts 1 and 3 has (launch.py): with 2 threads on this 2-core VM
    # while another process held a core, quantize_int8 took 68.6 ms and dequantize_int8_accumulate 190.6 ms
    # (OpenMP threads waiting on a busy core) where 1 thread took 13.2 and 3.2 ms in the same minute.
    torch.set_num_threads(args.codec_threads)
    doc = {
        "benchmark": "compression",
        "backend": "gloo",
        "settings": vars(args),
        "environment": {**environment(), "torch_threads_codec": torch.get_num_threads(), "torch_threads_per_rank": 1},
    }
    started = time.perf_counter()

    if "codec" not in skip:  # first, while no rank processes compete for the cores
        rows = codec_table(args.numel, args.codec_rounds)
        doc["throughput"] = {
            "cpu": rows,
            "gpu": None,
            "gpu_note": "GPU throughput needs a CUDA device: run python -m benchmarks.kernels on a "
            "lent GPU (Triton kernels); this machine has none",
        }
        print(
            f"# codec throughput on CPU, {rows[0]['elements'] / 2**20:g}M fp32, {torch.get_num_threads()} "
            f"threads; GB/s of fp32 gradient (4n bytes / time); median of {args.codec_rounds} rounds"
        )
        print(f"{'op':>28} {'gpudist ms':>10} {'GB/s':>6} {'torch ms':>9} {'GB/s':>6} {'torch/gpudist':>13}")
        for r in rows:
            s, g = r["seconds"], r["gb_per_s"]
            print(
                f"{r['op']:>28} {s['gpudist'] * 1e3:>10.2f} {g['gpudist']:>6.2f} {s['torch'] * 1e3:>9.2f} "
                f"{g['torch']:>6.2f} {r['speedup_vs_torch']:>13.2f}"
            )
        print("# gpu: null (no CUDA device here; python -m benchmarks.kernels on a lent GPU)")

    pool = WorkerPool(2, timeout=600.0) if {"wire", "e2e", "convergence"} - skip else None
    try:
        if "wire" not in skip:
            rows = wire_table(args.numel, worlds, ["topk:0.01", "int8", "1bit", "none"], pool)
            doc["wire"] = {"numel": args.numel, "rows": rows}
            print(
                f"# wire bytes / dense fp32, {args.numel / 2**20:g}M elements: payload per rank, and per-rank send "
                f"volume of a compressed all-reduce on Gloo (bus bytes; dense = 2(N-1)/N x 4n)"
            )
            head = "".join(f" {'vol N=' + str(n):>9}" for n in worlds)
            print(f"{'compressor':>10} {'payload':>8}{head} {'target':>7} {'met':>4} {'ms N=2':>7}")
            for spec, r in rows.items():
                vol = "".join(f" {r['volume'][str(n)]['ratio']:>9.2%}" for n in worlds)
                met = (
                    "-"
                    if "target" not in r
                    else ("yes" if r["payload_meets_target"] and r.get("volume_n2_meets_target", True) else "NO")
                )
                target = f"{r['target']:.1%}" if "target" in r else "-"
                ms = r["volume"]["2"]["seconds"] * 1e3 if "2" in r["volume"] else float("nan")
                print(f"{spec:>10} {r['payload_ratio']:>8.2%}{vol} {target:>7} {met:>4} {ms:>7.1f}")
            agree = all(v["charged_by_cap"] == v["sent_bytes"] for r in rows.values() for v in r["volume"].values())
            print(f"# the link cap charged the same bytes as CompressedChannel counted: {agree}")
            doc["wire"]["cap_agrees_with_channel"] = agree

        if "e2e" not in skip:
            res = pool.run(
                e2e_rank,
                width=args.width,
                depth=args.depth,
                batch=args.batch,
                steps=args.steps,
                rounds=args.rounds,
                bucket_mb=args.bucket_mb,
                links=links,
                specs=specs,
                latency_s=args.latency_us * 1e-6,
                powersgd_rank=args.powersgd_rank,
                call_timeout=3600.0,
            )[0]
            for r in res["rows"]:
                s = r["step_seconds"]
                # Paired: DDP's time over the variant's in the same round (seconds apart), then the median over
                # rounds; a neighbour's load that comes and goes then cancels within a pair.
                rs = r["round_seconds"]
                r["speedup"] = {
                    spec: statistics.median(d / c for d, c in zip(rs["ddp"], rs[spec], strict=True)) for spec in specs
                }
                r["speedup_of_medians"] = {spec: s["ddp"] / s[spec] for spec in specs}
                if r["gbit_per_s"] is not None:  # the cap's time for each variant's bytes, without overlap
                    r["wire_seconds"] = {
                        n: b * 8 / (r["gbit_per_s"] * 1e9) for n, b in res["wire_bytes_per_step"].items()
                    }
            pays = {spec: break_even(res["rows"], spec) for spec in specs}
            uncapped = next((r for r in res["rows"] if r["gbit_per_s"] is None), None)
            if uncapped is not None:
                rs = uncapped["round_seconds"]

                def paired(slow: str, fast: str) -> float:
                    return statistics.median(a / b for a, b in zip(rs[slow], rs[fast], strict=True))

                uncapped["overlap_speedup"] = {spec: paired(f"{spec} sync", spec) for spec in specs}
                uncapped["speedup"] |= {f"{spec} sync": paired("ddp", f"{spec} sync") for spec in specs}
                uncapped["gpudist_vs_torch"] = {
                    "ddp": paired("torch_ddp", "ddp"),
                    "powersgd": paired("torch_powersgd", powersgd),
                    "torch_powersgd_vs_torch_ddp": paired("torch_ddp", "torch_powersgd"),
                }
            doc["end_to_end"] = {
                "world_size": 2,
                "parameters": res["params"],
                "buckets": res["buckets"],
                "rows": res["rows"],
                "wire_bytes_per_step": res["wire_bytes_per_step"],
                "compression_report": res["compression_report"],
                "pays": pays,
            }
            names = ["local_step", "ddp", *specs]
            print(
                f"# step time (ms) at world 2 on Gloo over a capped link, {res['params'] / 1e6:.1f}M params, "
                f"batch {args.batch}/rank, {len(res['buckets'])} buckets; median of {args.rounds} rounds x "
                f"{args.steps} steps; (speedup: ddp / it, same link, median of per-round pairs)"
            )
            print(f"{'Gbit/s':>8}" + "".join(f" {n:>20}" for n in names))
            for r in res["rows"]:
                s = r["step_seconds"]
                cells = [f"{s[n] * 1e3:.1f}" + (f" ({r['speedup'][n]:.2f}x)" if n in specs else "") for n in names]
                link = "uncapped" if r["gbit_per_s"] is None else f"{r['gbit_per_s']:g}"
                print(f"{link:>8}" + "".join(f" {c:>20}" for c in cells))
            wire = res["wire_bytes_per_step"]
            print(
                "# MiB per rank per step charged by the cap: "
                + ", ".join(f"{n} {wire[n] / 2**20:.2f}" for n in names[1:])
            )
            for spec in specs:
                print(f"# {spec}: {pays[spec]['text']}")
            if uncapped is not None:
                s = uncapped["step_seconds"]
                print("# uncapped loopback: overlapped (default) vs synchronous compression; speedup = ddp / it")
                print(f"{'compressor':>22} {'overlap ms':>14} {'sync ms':>14} {'sync / overlap':>15}")
                for spec in specs:
                    over, sync = s[spec] * 1e3, s[f"{spec} sync"] * 1e3
                    print(
                        f"{spec:>22} {over:>6.1f} ({uncapped['speedup'][spec]:.2f}x) {sync:>6.1f} "
                        f"({uncapped['speedup'][f'{spec} sync']:.2f}x) {uncapped['overlap_speedup'][spec]:>15.2f}"
                    )
                vs = uncapped["gpudist_vs_torch"]
                print(
                    f"# same model and loopback: torch DDP {s['torch_ddp'] * 1e3:.1f} ms, gpudist DDP "
                    f"{s['ddp'] * 1e3:.1f} ms (torch / gpudist {vs['ddp']:.2f}); torch powerSGD_hook rank "
                    f"{args.powersgd_rank} {s['torch_powersgd'] * 1e3:.1f} ms, gpudist {powersgd} "
                    f"{s[powersgd] * 1e3:.1f} ms (torch / gpudist {vs['powersgd']:.2f})"
                )

        if "convergence" not in skip:
            conv = pool.run(
                convergence_rank, steps=args.convergence_steps, rank=args.powersgd_rank, call_timeout=3600.0
            )[0]
            doc["convergence"] = conv
            print(
                f"# example task (TinyLM d={conv['d_model']}, {conv['steps']} steps, momentum SGD, 2 ranks), mean loss "
                f"of the last 20 steps: " + ", ".join(f"{k} {v:.4f}" for k, v in conv["final_loss"].items())
            )
    finally:
        if pool is not None:
            pool.close()
    doc["wall_seconds"] = time.perf_counter() - started
    out = Path(args.out) if args.out else RESULTS / "compression.json"
    print(f"# wrote {atomic_write_json(out, doc)} in {doc['wall_seconds']:.0f} s")


if __name__ == "__main__":
    main()
