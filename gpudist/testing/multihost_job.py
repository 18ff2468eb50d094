"""One multi-host job that trains every data-parallel strategy in turn, for the network-namespace test tier and the
multi-host benchmark. Run one copy per host under torchrun:

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST0:PORT \\
        -m gpudist.testing.multihost_job --out results.json

Each strategy (DDP flat and hierarchical, the latter also through GradientCompressionOptimizer's hook on the
inter-node step, dense in its warm-up; ZeRO-1/2/3, FSDP, HSDP, hybrid tensor x data) trains the same small
model from the same initial values on slices of the same global batches; rank 0 writes each one's final full
parameters, its payload bytes per step per link class (:meth:`gpudist.Topology.link_bytes`) and the bytes that
left this host's network interface, as JSON. :func:`reference` trains the same model in one process (what the
test compares with). With ``--survive`` the ranks then keep all-reducing until a peer fails and write the error
each one got (``survivor-<rank>.json``): the tier kills a whole host and checks every survivor heard of it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import gpudist
from gpudist.strategies import DATA_PARALLEL_PAIRS

STEPS = 4
GLOBAL_BATCH = 8
STRATEGIES = ("ddp", "ddp-hierarchical", "ddp-hierarchical-hook", "zero1", "zero2", "zero3", "fsdp", "hsdp", "hybrid")


def build_model(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """The model every strategy trains: two linears (uneven over 4 shards, even over a tensor-parallel pair)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 14), nn.Tanh(), nn.Linear(14, 5)).to(dtype)


def batch(step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 6, generator=g).to(dtype), torch.randn(GLOBAL_BATCH, 5, generator=g).to(dtype)


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def reference(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Single-process training on the global batches: the final parameters, flattened."""
    net = build_model(dtype)
    opt = _optimizer(net.parameters())
    for step in range(STEPS):
        x, y = batch(step, dtype)
        F.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def _slice(t: torch.Tensor, index: int, parts: int) -> torch.Tensor:
    per = t.shape[0] // parts
    return t[index * per : (index + 1) * per]


def _hybrid(comm, topo) -> tuple[gpudist.ShardedModel, object, int, int]:
    """Tensor parallel inside the node (the layout puts consecutive ranks in a tensor group), data across nodes."""
    config = gpudist.ShardingConfiguration(comm)
    plan = {"0": "colwise", "2": "rowwise"}
    tp = topo.layout.ranks_per_node
    model = gpudist.HybridShardedModel(build_model(), config, 1, tp, plan=plan, micro_batches=1)
    opt = gpudist.HybridShardedOptimizer(_optimizer(model.parameters()), config, 1, tp, zero_stage=0)
    return model, opt, model.data_parallel_rank, model.data_parallel_size


def train(comm, strategy: str, steps: int = STEPS) -> dict:
    """Train ``strategy`` from :func:`build_model`'s values; its final full parameters and bytes per step."""
    topo = comm.topology
    if strategy == "hybrid":
        model, opt, part, parts = _hybrid(comm, topo)
    else:
        name, hierarchical, replicate = strategy, False, None
        config = gpudist.ShardingConfiguration(comm)
        if strategy.startswith("ddp-hierarchical"):
            name, hierarchical = "ddp", True
        elif strategy == "hsdp":
            name, replicate = "fsdp", topo.inter
            config = gpudist.ShardingConfiguration(topo.intra)
        model_cls, opt_cls = DATA_PARALLEL_PAIRS[name]
        kwargs = {"hierarchical": True} if hierarchical else {}
        kwargs |= {"replicate_group": replicate} if replicate is not None else {}
        model = model_cls(build_model(), config, **kwargs)
        opt = opt_cls(_optimizer(model.parameters()), config)
        if strategy == "ddp-hierarchical-hook":  # int8 on the inter-node step after a warm-up longer than the run
            opt = gpudist.GradientCompressionOptimizer(opt, config, "int8", warmup_steps=steps)
        part, parts = comm.rank, comm.world_size
    link, nic = [], []
    for step in range(steps):
        x, y = batch(step)
        comm.barrier()
        before, tx = topo.link_bytes(), interface_tx_bytes()
        x, y = _slice(x, part, parts), _slice(y, part, parts)
        if strategy == "hybrid":
            model.train_step(x, y, F.mse_loss, optimizer=opt)
        else:
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        comm.barrier()
        after = topo.link_bytes()
        link.append({k: after[k] - before[k] for k in after})
        nic.append(interface_tx_bytes() - tx)
    return {"params": model.gather_full_parameters().tolist(), "link_bytes": link, "nic_tx_bytes": nic}


def interface_tx_bytes() -> int:
    """Bytes sent so far through the interface Gloo uses (this host's side of the inter-host link; -1: unknown)."""
    import os

    name = os.environ.get("GLOO_SOCKET_IFNAME", "")
    path = Path(f"/sys/class/net/{name}/statistics/tx_bytes")
    return int(path.read_text()) if name and name != "lo" and path.exists() else -1


def survive(comm, out: Path, limit: float) -> None:
    """All-reduce until a peer fails (or ``limit`` seconds pass); write what this rank got."""
    started = time.time()
    error, x = None, torch.ones(1024)
    (out / f"ready-{comm.rank}").write_text(str(started))
    while time.time() - started < limit:
        try:
            comm.all_reduce(x)
        except gpudist.CommunicationError as e:
            error = e
            break
        time.sleep(0.02)
    report = {"rank": comm.rank, "time": time.time(), "timeout": comm.timeout, "error": None}
    if error is not None:
        report["error"] = {"type": type(error).__name__, "op": error.op, "message": str(error)[:500]}
    (out / f"survivor-{comm.rank}.json").write_text(json.dumps(report))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for results.json (and survivor-<rank>.json)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds every op may take")
    parser.add_argument("--survive", type=float, default=0.0, help="then all-reduce this long, until a peer fails")
    args = parser.parse_args()
    out = Path(args.out)
    comm = gpudist.init("gloo", timeout=args.timeout)
    results = {"layout": comm.topology.layout.describe(), "strategies": {}}
    for strategy in args.strategies.split(","):
        results["strategies"][strategy] = train(comm, strategy)
    if comm.rank == 0:
        (out / "results.json").write_text(json.dumps(results))
    if args.survive:
        survive(comm, out, args.survive)


if __name__ == "__main__":
    main()
