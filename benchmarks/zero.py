"""ZeRO strategies vs PyTorch's own, same model, data and Gloo processes, same run; memory per rank vs formulas.

    python -m benchmarks.zero [--world-size 2] [--steps 5] [--rounds 5]

- Throughput: gpudist ZeRO1Model + ZeRO1Optimizer(Adam) vs torch DDP + ZeroRedundancyOptimizer(Adam) on a
  ~20M-parameter MLP, interleaved round by round (target ratio >= 1.2). ZeRO-3 vs FSDP2 joins when ZeRO-3 lands.
- Memory per rank, measured from live tensors (in-memory ranks, N = 1..8): parameters, gradients and optimizer
  state against the formulas P, P, K*P/N (Adam fp32: K = 2, in bytes of parameters).
Writes ``benchmarks/results/zero_gloo_w{N}.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.nn import functional as F

import gpudist
from gpudist.bench import environment, interleaved_times
from gpudist.fileio import atomic_write_json
from gpudist.launch import spawn
from gpudist.testing import run_ranks

from .ddp import make_model

RESULTS = Path(__file__).resolve().parent / "results"


def bench_rank(comm, width: int, depth: int, batch: int, steps: int, rounds: int) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(comm.rank)
    x, y = torch.randn(batch, width), torch.randint(0, 10, (batch,))
    config = gpudist.ShardingConfiguration(comm)
    ours = gpudist.ZeRO1Model(make_model(width, depth), config)
    ours_opt = gpudist.ZeRO1Optimizer(torch.optim.Adam(ours.parameters(), lr=1e-4), config)
    theirs = DistributedDataParallel(make_model(width, depth))
    theirs_opt = ZeroRedundancyOptimizer(theirs.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)

    def step(model, opt):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    seconds = interleaved_times(comm, {"gpudist_zero1": lambda: step(ours, ours_opt),
                                       "torch_zero": lambda: step(theirs, theirs_opt)}, steps, rounds)  # fmt: skip
    return {"params": sum(p.numel() for p in ours.parameters()), "seconds": seconds}


def memory_rank(comm, strategy: str, width: int, depth: int) -> dict:
    torch.manual_seed(0)
    config = gpudist.ShardingConfiguration(comm)
    model_cls, opt_cls = {"ddp": (gpudist.DDPModel, gpudist.DDPOptimizer),
                          "zero1": (gpudist.ZeRO1Model, gpudist.ZeRO1Optimizer)}[strategy]  # fmt: skip
    model = model_cls(make_model(width, depth), config)
    opt = opt_cls(torch.optim.Adam(model.parameters(), lr=1e-4), config)
    x, y = torch.randn(4, width), torch.randint(0, 10, (4,))
    F.cross_entropy(model(x), y).backward()
    opt.step()
    memory = model.get_model_metadata()["memory_per_rank"]
    memory["optimizer_state"] = opt.state_bytes()  # both report what they hold (ZeRO: its owned range only)
    return memory


def memory_table(width: int, depth: int, worlds=(1, 2, 4, 8)) -> list[dict]:
    rows = []
    for strategy in ("ddp", "zero1"):
        for n in worlds:
            mem = run_ranks(memory_rank, n, "inmemory", strategy=strategy, width=width, depth=depth)
            p_bytes = mem[0]["parameters"]
            shard = 1 if strategy == "ddp" else n
            formula = {"parameters": p_bytes, "gradients": p_bytes, "optimizer_state": 2 * p_bytes / shard}
            worst = {k: max(m[k] for m in mem) for k in formula}
            # Adam also keeps one 4-byte step counter per parameter tensor (DDP: torch's state).
            rows.append({"strategy": strategy, "world_size": n, "measured_max_rank": worst, "formula": formula,
                         "ratio": {k: worst[k] / formula[k] for k in formula}})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=19)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    n = args.world_size
    res = spawn(bench_rank, n, width=args.width, depth=args.depth, batch=args.batch, steps=args.steps,
                rounds=args.rounds, timeout=1800.0)[0]  # fmt: skip
    s = res["seconds"]
    ratio = s["torch_zero"] / s["gpudist_zero1"]
    rows = memory_table(256, 4)
    doc = {"benchmark": "zero", "backend": "gloo", "world_size": n, "settings": vars(args),
           "environment": environment(), "parameters": res["params"], "step_seconds": s,
           "samples_per_s": {k: args.batch * n / v for k, v in s.items()},
           "ratio_zero1_vs_torch_zero": ratio, "target_ratio": 1.2, "memory": rows}  # fmt: skip
    print(f"# ZeRO-1: gpudist vs torch ZeroRedundancyOptimizer, gloo, world {n}, {res['params'] / 1e6:.1f}M params, "
          f"batch {args.batch}/rank; median of {args.rounds} rounds")  # fmt: skip
    for name, t in s.items():
        print(f"{name:>16} {t * 1e3:>10.1f} ms/step {args.batch * n / t:>10.1f} samples/s")
    print(f"# ratio gpudist/torch: {ratio:.3f} (target >= 1.2)")
    print("# memory per rank (worst rank) / formula, in-memory ranks, 0.8M-param MLP, Adam:")
    print(f"{'strategy':>9} {'N':>3} {'params':>8} {'grads':>8} {'optimizer':>10}")
    for r in rows:
        q = r["ratio"]
        print(f"{r['strategy']:>9} {r['world_size']:>3} {q['parameters']:>8.3f} {q['gradients']:>8.3f} "
              f"{q['optimizer_state']:>10.3f}")  # fmt: skip
    out = Path(args.out) if args.out else RESULTS / f"zero_gloo_w{n}.json"
    print(f"# wrote {atomic_write_json(out, doc)}")


if __name__ == "__main__":
    main()
