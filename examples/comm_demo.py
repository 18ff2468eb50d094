"""A tour of gpudist's communication layer on N CPU ranks.

Standalone, it spawns the ranks itself:

    python examples/comm_demo.py --world-size 3

Under a launcher, each process is one rank (the same code path a training script uses):

    torchrun --nproc-per-node 3 examples/comm_demo.py

Every rank averages a gradient-like vector, reduce-scatters and all-gathers a flat buffer with an uneven split,
passes a token around a ring, and reports the bytes its backend moved; rank 0 checks each result against the
value it must have and prints a table.
"""

from __future__ import annotations

import argparse
import os

import torch

import gpudist
from gpudist.comm import split_sizes
from gpudist.launch import spawn


def tour(comm: gpudist.CommunicationBackend, numel: int = 1_000_003) -> dict:
    r, n = comm.rank, comm.world_size
    checks = {}

    grad = torch.full((numel,), float(r + 1))
    comm.all_reduce(grad, gpudist.ReductionOperation.AVERAGE)
    checks["all_reduce AVERAGE"] = bool(torch.all(grad == (n + 1) / 2))

    shard = torch.empty(split_sizes(numel, n)[r])
    comm.reduce_scatter(torch.ones(numel), shard)  # rank r keeps its contiguous range of the sum
    checks["reduce_scatter (uneven)"] = bool(torch.all(shard == n))

    full = torch.empty(numel)
    comm.all_gather(torch.full((shard.numel(),), float(r)), full)
    owner = torch.repeat_interleave(torch.arange(n, dtype=torch.float32), torch.tensor(split_sizes(numel, n)))
    checks["all_gather (uneven)"] = bool(torch.equal(full, owner))

    if n > 1:  # a ring: receive from the left while sending to the right
        token = torch.empty(4)
        pending = comm.recv(token, (r - 1) % n, async_op=True)
        comm.send(torch.full((4,), float(r)), (r + 1) % n)
        pending.wait()
        checks["send/recv ring"] = bool(torch.all(token == (r - 1) % n))

    flags = torch.tensor([int(all(checks.values()))])
    comm.all_reduce(flags, "min")
    return {"rank": r, "checks": checks, "all_ranks_ok": bool(flags.item()), "stats": comm.stats.as_dict()}


def report(results: list[dict], backend: str) -> bool:
    print(f"gpudist {gpudist.__version__}: communication tour on {len(results)} rank(s), backend={backend}")
    for name, ok in results[0]["checks"].items():
        print(f"  {name:<26} {'ok' if ok else 'WRONG'}")
    print(f"  {'rank':>4} {'ops':>5} {'payload MiB':>12} {'check msgs':>11}")
    for res in results:
        s = res["stats"]
        calls = sum(v["calls"] for v in s["ops"].values())
        print(f"  {res['rank']:>4} {calls:>5} {s['total_bytes'] / 2**20:>12.2f} {s['check_calls']:>11}")
    ok = all(r["all_ranks_ok"] for r in results)
    print("all checks passed on every rank" if ok else "SOME CHECKS FAILED")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=3, help="ranks to spawn when not under a launcher")
    parser.add_argument("--numel", type=int, default=1_000_003)
    args = parser.parse_args()
    if "RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ or "PMI_RANK" in os.environ:
        comm = gpudist.init()  # one rank of a torchrun/mpirun job
        result = tour(comm, args.numel)
        if comm.rank == 0:
            print(f"rank 0 of {comm.world_size}: {result['checks']}, all ranks ok: {result['all_ranks_ok']}")
        raise SystemExit(0 if result["all_ranks_ok"] else 1)
    results = spawn(tour, args.world_size, numel=args.numel, timeout=120.0)
    raise SystemExit(0 if report(results, "gloo") else 1)


if __name__ == "__main__":
    main()
