"""Topology-aware strategies across hosts on a capped link: HSDP vs torch FSDP2's HSDP, hierarchical vs flat DDP,
int8 compression of the inter-node hop only vs dense.

Two hosts are network namespaces (tests/netns.py) whose links to the bridge are capped by ``tc tbf`` (1 Gbit/s by
default); each runs ``torchrun --nproc-per-node 2`` with a c10d rendezvous at host 0's address. In one launch every
variant trains the same MLP; rounds interleave the variants (the order rotates each round), so they share the
machine's load alike. Per variant: seconds per step (slowest rank, median over rounds), the bytes each host sent
onto the link per step (the interface's own counter: payload, Gloo's framing and TCP/IP headers), and the formula's
payload for it. Needs root::

    python -m benchmarks.multihost                     # writes benchmarks/results/multihost.json
    python -m benchmarks.multihost --rate 200mbit --width 512

Formulas (P parameter bytes, N ranks on M nodes of L, per node onto the network, Gloo's ring all-reduce in rank
order): flat all-reduce ``2 (N-1)/N P`` (one ring link leaves each node); hierarchical ``2 (M-1)/M P`` (L pieces of
P/L, each all-reduced over M nodes); HSDP ``2 (M-1)/M P`` (the shards' all-reduce; gathers stay in the node);
hierarchical with int8 on the inter-node hop ``2 (M-1)/M x P/4 x (1 + 4/256)`` (codes and block scales, both
phases of the compressed all-reduce).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
INT8 = "gpudist DDP hierarchical, int8 across"
BASELINE = {
    "gpudist DDP": "torch DDP",
    "gpudist DDP hierarchical": "torch DDP",
    INT8: "gpudist DDP hierarchical",
    "gpudist HSDP": "torch FSDP2 HSDP",
    "gpudist FSDP": "torch FSDP2 HSDP",
}


class MLP(nn.Module):
    """``depth`` square linears with tanh: the blocks are a ModuleList, so FSDP (both) shards per block."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def _step(model, opt, x, y):
    def run() -> None:
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return run


def _variants(comm, args) -> dict[str, object]:
    """Every variant's one training step, built on this rank (collective)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import gpudist

    topo = comm.topology
    g = torch.Generator().manual_seed(comm.rank)
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, args.width, generator=g)
    sgd = {"lr": 1e-3, "fused": True}  # every variant, peers included, steps with torch's fused SGD (its best)
    out = {}
    for name, hierarchical in (("gpudist DDP", False), ("gpudist DDP hierarchical", True)):
        config = gpudist.ShardingConfiguration(comm)
        model = gpudist.DDPModel(MLP(args.width, args.depth), config, hierarchical=hierarchical)
        out[name] = _step(model, gpudist.DDPOptimizer(torch.optim.SGD(model.parameters(), **sgd), config), x, y)
    config = gpudist.ShardingConfiguration(comm)
    model = gpudist.DDPModel(MLP(args.width, args.depth), config, hierarchical=True)
    out[INT8] = _step(
        model, gpudist.GradientCompressionOptimizer(torch.optim.SGD(model.parameters(), **sgd), config, "int8"), x, y
    )
    ddp = DistributedDataParallel(MLP(args.width, args.depth), gradient_as_bucket_view=True)
    out["torch DDP"] = _step(ddp, torch.optim.SGD(ddp.parameters(), **sgd), x, y)
    for name, group, replicate in (("gpudist FSDP", comm, None), ("gpudist HSDP", topo.intra, topo.inter)):
        config = gpudist.ShardingConfiguration(group)
        model = gpudist.FSDPModel(MLP(args.width, args.depth), config, replicate_group=replicate)
        out[name] = _step(model, gpudist.ZeRO3Optimizer(torch.optim.SGD(model.parameters(), **sgd), config), x, y)
    layout = topo.layout
    mesh = init_device_mesh("cpu", (layout.nodes, layout.ranks_per_node), mesh_dim_names=("replicate", "shard"))
    net = MLP(args.width, args.depth)
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    # FSDP2's parameters are DTensors, for which torch 2.13 has no fused SGD ("aten._fused_sgd_ does not have a
    # sharding strategy"): its best is the foreach SGD, its default.
    out["torch FSDP2 HSDP"] = _step(net, torch.optim.SGD(net.parameters(), lr=sgd["lr"], foreach=True), x, y)
    return out


def worker(args) -> None:
    """One rank of the benchmark (run by torchrun inside a namespace)."""
    import gpudist
    from gpudist.bench.collectives import environment
    from gpudist.comm import ReductionOperation
    from gpudist.testing.multihost_job import interface_tx_bytes

    comm = gpudist.init("gloo", timeout=300)
    topo, layout = comm.topology, comm.topology.layout
    variants = _variants(comm, args)
    names = list(variants)
    wall = torch.zeros(len(names), args.rounds, dtype=torch.float64)
    sent = torch.zeros(len(names), layout.nodes, dtype=torch.float64)
    links = {}
    for fn in variants.values():  # warm-up: first-step allocations and connections
        fn()
    for r in range(args.rounds):
        for k in range(len(names)):
            i = (r + k) % len(names)
            comm.barrier()
            tx, before, t0 = interface_tx_bytes(), topo.link_bytes(), time.perf_counter()
            for _ in range(args.steps):
                variants[names[i]]()
            comm.barrier()
            wall[i, r] = (time.perf_counter() - t0) / args.steps
            if layout.local_rank == 0:
                sent[i, layout.node] += (interface_tx_bytes() - tx) / args.steps / args.rounds
            after = topo.link_bytes()
            links[names[i]] = {key: (after[key] - before[key]) / args.steps for key in after}
    comm.all_reduce(wall, ReductionOperation.MAX)
    comm.all_reduce(sent, ReductionOperation.SUM)
    if comm.rank != 0:
        return
    params = sum(p.numel() for p in MLP(args.width, args.depth).parameters()) * 4
    n, m = layout.world_size, layout.nodes
    formula = {
        "gpudist DDP": 2 * (n - 1) / n * params,
        "torch DDP": 2 * (n - 1) / n * params,
        "gpudist DDP hierarchical": 2 * (m - 1) / m * params,
        INT8: 2 * (m - 1) / m * params / 4 * (1 + 4 / 256),
        "gpudist HSDP": 2 * (m - 1) / m * params,
        "torch FSDP2 HSDP": 2 * (m - 1) / m * params,
        "gpudist FSDP": None,  # Gloo's all-gather is per-rank broadcasts, its reduce-scatter an all-reduce: no ring
    }
    rows = {}
    for i, name in enumerate(names):
        seconds = statistics.median(wall[i].tolist())
        rows[name] = {
            "seconds_per_step": seconds,
            "rounds": wall[i].tolist(),
            "link_tx_bytes_per_step_per_host": sent[i].tolist(),
            "formula_payload_bytes_per_host": formula[name],
            "measured_over_formula": None if formula[name] is None else sent[i].mean().item() / formula[name],
            "payload_bytes_per_rank_by_group": links.get(name),
        }
    for name, base in BASELINE.items():
        rows[name]["speedup_vs"] = {base: rows[base]["seconds_per_step"] / rows[name]["seconds_per_step"]}
    report = {
        "environment": environment(),
        "note": "2-core VM shared with other work while this ran; hosts are network namespaces on one machine, so "
        "the 'intra-node' links are loopback on the same 2 cores",
        "link": {"rate": args.rate, "qdisc": "tbf burst 256kb latency 100ms", "hosts": m, "ranks_per_host": n // m},
        "model": {"width": args.width, "depth": args.depth, "parameter_bytes": params, "batch_per_rank": args.batch},
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "variants": rows,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


def launch(args) -> None:
    """Make the hosts, start one torchrun agent per host, wait for the report (bounded), clean up."""
    sys.path.insert(0, str(ROOT))
    from tests import netns

    reason = netns.unavailable()
    if reason is not None:
        raise SystemExit(f"cannot run: {reason}")
    out = Path(args.out).resolve()
    out.unlink(missing_ok=True)
    logs = [Path(f"/tmp/gpudist-multihost-{os.getpid()}-host{i}.log") for i in range(args.hosts)]
    with netns.Hosts(args.hosts, rate=args.rate) as hosts:
        agents = []
        for i in range(args.hosts):
            job = ["benchmarks.multihost", "--worker", *sys.argv[1:], f"--out={out}"]
            argv = hosts.torchrun(i, str(args.hosts), job, join_timeout=300, agent_args=["--max-restarts=0"])
            agents.append(hosts.popen(i, argv, logs[i], env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}))
        deadline = time.monotonic() + args.limit
        while time.monotonic() < deadline and any(a.poll() is None for a in agents):
            time.sleep(0.5)
        codes = [a.poll() for a in agents]
    if codes != [0] * args.hosts or not out.exists():
        tails = "\n".join(f"--- {log}\n{log.read_text()[-3000:]}" for log in logs if log.exists())
        raise SystemExit(f"benchmark failed (agents' exit codes {codes})\n{tails}")
    report = json.loads(out.read_text())
    for name, row in report["variants"].items():
        ratio = row["measured_over_formula"]
        speed = "".join(f", {v:.2f}x vs {k}" for k, v in row.get("speedup_vs", {}).items())
        sent = max(row["link_tx_bytes_per_step_per_host"]) / 1e6
        print(
            f"{name:40s} {row['seconds_per_step'] * 1e3:8.1f} ms/step{speed}; {sent:.2f} MB/step/host on the link"
            + (f" ({ratio:.3f} x formula)" if ratio is not None else "")
        )
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--rate", default="1gbit", help="tc tbf rate of each host's link")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--limit", type=float, default=900.0, help="seconds before the launch is abandoned")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "multihost.json"))
    args = parser.parse_args()
    if args.worker:
        worker(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
