"""gpudist DDP vs torch DDP: same model (~20M parameters), same data, same Gloo processes, same run.

    python -m benchmarks.ddp [--world-size 2] [--steps 20] [--batch 32] [--rounds 5]

Both wrappers train copies of one MLP on the same process group. Steps alternate between them round by
round, so machine noise hits both alike. The script reports throughput in samples/s, the ratio gpudist/torch
(target >= 1.05), and the overlap of communication with backward:
(local step + all-reduce alone - DDP step) / all-reduce alone, where a local step is the
same forward, backward and SGD step with no communication. It also reports the bytes per step from
gpudist's counters against the ring formula 2(N-1)/N x parameter bytes. The results go to
``benchmarks/results/ddp_gloo_w{N}.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import gpudist
from gpudist.bench import environment, interleaved_times
from gpudist.fileio import atomic_write_json
from gpudist.launch import spawn

RESULTS = Path(__file__).resolve().parent / "results"


def make_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def bench_rank(comm, width: int, depth: int, batch: int, steps: int, rounds: int, bucket_mb: float) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(comm.rank)
    x, y = torch.randn(batch, width), torch.randint(0, 10, (batch,))
    config = gpudist.ShardingConfiguration(comm, bucket_cap_mb=bucket_mb)
    ours = gpudist.DDPModel(make_model(width, depth), config)
    ours_opt = gpudist.DDPOptimizer(torch.optim.SGD(ours.parameters(), lr=1e-4), config)
    theirs = DistributedDataParallel(make_model(width, depth), bucket_cap_mb=bucket_mb)
    theirs_opt = torch.optim.SGD(theirs.parameters(), lr=1e-4)
    local = make_model(width, depth)
    local_opt = torch.optim.SGD(local.parameters(), lr=1e-4)
    params = sum(p.numel() for p in local.parameters())

    def step(model, opt):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


    flat = torch.zeros(params)

    def allreduce_alone():  # the same bytes in buckets of the same size, no compute to hide behind
        with comm.unchecked():
            for chunk in flat.split(int(bucket_mb * (1 << 20)) // 4):
                comm.all_reduce(chunk, "average")

    variants = {"gpudist": lambda: step(ours, ours_opt), "torch": lambda: step(theirs, theirs_opt),
                "local_step": lambda: step(local, local_opt), "allreduce_alone": allreduce_alone}  # fmt: skip
    slowest = interleaved_times(comm, variants, steps, rounds)
    before = comm.stats.total_bytes
    step(ours, ours_opt)
    step_bytes = comm.stats.total_bytes - before
    return {"params": params, "seconds": slowest, "step_bytes": step_bytes,
            "buckets": len(ours.bucket_sizes())}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=19, help="hidden layers: 19 x 1024^2 ~ 20M parameters")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    n = args.world_size
    res = spawn(bench_rank, n, width=args.width, depth=args.depth, batch=args.batch, steps=args.steps,
                rounds=args.rounds, bucket_mb=args.bucket_mb, timeout=1800.0)[0]  # fmt: skip
    s = res["seconds"]
    samples = args.batch * n
    overlap = (s["local_step"] + s["allreduce_alone"] - s["gpudist"]) / s["allreduce_alone"]
    ring_formula = 2 * (n - 1) / n * res["params"] * 4
    doc = {
        "benchmark": "ddp", "backend": "gloo", "world_size": n, "settings": vars(args), "environment": environment(),
        "parameters": res["params"], "buckets": res["buckets"],
        "step_seconds": s,
        "samples_per_s": {"gpudist": samples / s["gpudist"], "torch": samples / s["torch"]},
        "ratio_gpudist_vs_torch": s["torch"] / s["gpudist"], "target_ratio": 1.05,
        "overlap_fraction": max(0.0, min(1.0, overlap)), "overlap_raw": overlap,
        "bytes_per_step_payload": res["step_bytes"],
        "bytes_per_step_ring_estimate": res["step_bytes"] * 2 * (n - 1) / n,
        "bytes_per_step_formula": ring_formula,
    }  # fmt: skip
    print(f"# gpudist DDP vs torch DDP: gloo, world {n}, {res['params'] / 1e6:.1f}M params, "
          f"batch {args.batch}/rank, {res['buckets']} buckets; median of {args.rounds} rounds")  # fmt: skip
    print(f"{'variant':>16} {'step (ms)':>10} {'samples/s':>10}")
    for name, t in s.items():
        print(f"{name:>16} {t * 1e3:>10.1f} {samples / t if name in ('gpudist', 'torch') else float('nan'):>10.1f}")
    print(f"# throughput ratio gpudist/torch: {doc['ratio_gpudist_vs_torch']:.3f} (target >= 1.05)")
    print(f"# overlap of communication with backward: {doc['overlap_fraction']:.0%} (raw {overlap:.2f})")
    print(f"# bytes per step per rank (ring): {doc['bytes_per_step_ring_estimate'] / 2**20:.2f} MiB; "
          f"formula 2(N-1)/N x P = {ring_formula / 2**20:.2f} MiB")  # fmt: skip
    out = Path(args.out) if args.out else RESULTS / f"ddp_gloo_w{n}.json"
    print(f"# wrote {atomic_write_json(out, doc)}")


if __name__ == "__main__":
    main()
