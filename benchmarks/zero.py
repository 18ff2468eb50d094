"""ZeRO strategies vs PyTorch's own, same model, data and Gloo processes, same run; memory per rank vs formulas.

    python -m benchmarks.zero [--world-size 2] [--steps 5] [--rounds 5]

- Throughput on a ~20M-parameter MLP, all four interleaved round by round in the same processes:
  gpudist ZeRO1Model + ZeRO1Optimizer(Adam) vs torch DDP + ZeroRedundancyOptimizer(Adam) (target ratio >= 1.2),
  and gpudist FSDPModel (one unit per Linear) + ZeRO3Optimizer(Adam) vs torch FSDP2 (``fully_shard`` per Linear
  and on the root) + Adam (target ratio >= 1.0).
- Memory per rank, measured from live tensors (in-memory ranks, N = 1..8) for DDP, ZeRO-1, ZeRO-2 and ZeRO-3:
  parameters, gradients and optimizer state against the formulas (Adam fp32: K = 2, in bytes of parameters):
  DDP P, P, KP; ZeRO-1 P, P, KP/N; ZeRO-2 P, P/N, KP/N; ZeRO-3 P/N, P/N, KP/N.
Writes ``benchmarks/results/zero_gloo_w{N}.json``.
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
from gpudist.testing import run_ranks

from .ddp import make_model

RESULTS = Path(__file__).resolve().parent / "results"


def bench_rank(comm, width: int, depth: int, batch: int, steps: int, rounds: int) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(comm.rank)
    x, y = torch.randn(batch, width), torch.randint(0, 10, (batch,))
    config = gpudist.ShardingConfiguration(comm)
    zero1 = gpudist.ZeRO1Model(make_model(width, depth), config)
    zero1_opt = gpudist.ZeRO1Optimizer(torch.optim.Adam(zero1.parameters(), lr=1e-4), config)
    torch_ddp = DistributedDataParallel(make_model(width, depth))
    torch_zero = ZeroRedundancyOptimizer(torch_ddp.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)
    config3 = gpudist.ShardingConfiguration(comm)
    fsdp = gpudist.FSDPModel(make_model(width, depth), config3, auto_wrap_policy={nn.Linear})
    fsdp_opt = gpudist.ZeRO3Optimizer(torch.optim.Adam(fsdp.parameters(), lr=1e-4), config3)
    fsdp2 = make_model(width, depth)
    for layer in fsdp2:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(fsdp2)
    fsdp2_opt = torch.optim.Adam(fsdp2.parameters(), lr=1e-4)

    def step(model, opt):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    variants = {"gpudist_zero1": lambda: step(zero1, zero1_opt), "torch_zero": lambda: step(torch_ddp, torch_zero),
                "gpudist_fsdp": lambda: step(fsdp, fsdp_opt), "torch_fsdp2": lambda: step(fsdp2, fsdp2_opt)}
    seconds = interleaved_times(comm, variants, steps, rounds)
    bytes_per_step = {"gpudist_zero1": zero1.last_step_bytes, "gpudist_fsdp": fsdp.last_step_bytes}
    return {"params": sum(p.numel() for p in zero1.parameters()), "seconds": seconds, "bytes": bytes_per_step}


def memory_rank(comm, strategy: str, width: int, depth: int) -> dict:
    torch.manual_seed(0)
    config = gpudist.ShardingConfiguration(comm)
    model_cls, opt_cls = PAIRS[strategy]
    model = model_cls(make_model(width, depth), config)
    opt = opt_cls(torch.optim.Adam(model.parameters(), lr=1e-4), config)
    x, y = torch.randn(4, width), torch.randint(0, 10, (4,))
    F.cross_entropy(model(x), y).backward()
    memory = model.get_model_metadata()["memory_per_rank"]  # gradients: what backward leaves (ZeRO-2/3: 1/N)
    opt.step()
    memory["parameters"] = model.get_model_metadata()["memory_per_rank"]["parameters"]
    memory["optimizer_state"] = opt.state_bytes()  # both report what they hold (ZeRO: its owned range only)
    return memory


PAIRS = {"ddp": (gpudist.DDPModel, gpudist.DDPOptimizer), "zero1": (gpudist.ZeRO1Model, gpudist.ZeRO1Optimizer),
         "zero2": (gpudist.ZeRO2Model, gpudist.ZeRO2Optimizer), "zero3": (gpudist.ZeRO3Model, gpudist.ZeRO3Optimizer)}
DIVISORS = {"ddp": (1, 1, 1), "zero1": (1, 1, None), "zero2": (1, None, None), "zero3": (None, None, None)}
"""Per strategy, what parameters, gradients and optimizer state are divided by (None: the world size)."""


def memory_table(width: int, depth: int, worlds=(1, 2, 4, 8)) -> list[dict]:
    rows = []
    p_bytes = sum(p.numel() * p.element_size() for p in make_model(width, depth).parameters())
    for strategy, divisors in DIVISORS.items():
        for n in worlds:
            mem = run_ranks(memory_rank, n, "inmemory", strategy=strategy, width=width, depth=depth)
            d = [n if v is None else v for v in divisors]
            formula = {"parameters": p_bytes / d[0], "gradients": p_bytes / d[1], "optimizer_state": 2 * p_bytes / d[2]}
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
    ratio3 = s["torch_fsdp2"] / s["gpudist_fsdp"]
    rows = memory_table(256, 4)
    doc = {"benchmark": "zero", "backend": "gloo", "world_size": n, "settings": vars(args),
           "environment": environment(), "parameters": res["params"], "step_seconds": s,
           "samples_per_s": {k: args.batch * n / v for k, v in s.items()},
           "ratio_zero1_vs_torch_zero": ratio, "target_ratio": 1.2, "ratio_fsdp_vs_torch_fsdp2": ratio3,
           "target_ratio_fsdp": 1.0, "bytes_per_step": res["bytes"], "memory": rows}  # fmt: skip
    print(f"# ZeRO-1 and ZeRO-3/FSDP: gpudist vs torch, gloo, world {n}, {res['params'] / 1e6:.1f}M params, "
          f"batch {args.batch}/rank; median of {args.rounds} rounds")  # fmt: skip
    for name, t in s.items():
        print(f"{name:>16} {t * 1e3:>10.1f} ms/step {args.batch * n / t:>10.1f} samples/s")
    print(f"# ratio gpudist ZeRO-1 / torch ZeroRedundancyOptimizer: {ratio:.3f} (target >= 1.2)")
    print(f"# ratio gpudist FSDP / torch FSDP2: {ratio3:.3f} (target >= 1.0)")
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
