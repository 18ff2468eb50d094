"""One command for a GPU runner: ``gpudist bench gpu`` (or ``python -m benchmarks.gpu``, run from the repository root)
runs the GPU test tier and measures every GPU number in one go, into one JSON file with the machine, the versions and
the date beside the numbers. It is made for a short slot (a GPU lent for about 15 minutes, its start included):
correctness first and cheapest first, every part and every test bounded, the whole run within ``--budget`` seconds
(default 450: under 8 minutes), the JSON rewritten after every part and one summary table at the end.

Parts, in this order, each in its own process (a pytest subprocess, or a spawned one), so that a crash, a sticky
CUDA error or a hang in one is recorded as that part's error and the parts after it still run:

- ``tests-kernels``: the Triton kernels' ``cuda`` test cases (tests/test_kernels.py, test_kernels_compression.py).
- ``tests-nccl``: every NCCL op at world size 1 and the compressed collectives on CUDA (tests/test_gpu.py).
- ``tests-host-sync``: the no-host-sync test of every data-parallel strategy on the real GPU.
- ``tests-strategies``: the rest of the GPU tier: every strategy on CUDA (in-memory ranks at world 2 and 4, NCCL
  at world 1, several NCCL ranks where NCCL allows them on one GPU).
- ``kernels``: each gpudist kernel (pack, unpack, Adam, SGD, squared norm, int8/1-bit quantize, int8 dequantize,
  top-k) at each size, timed with CUDA events after warm-up (median of rounds); its GB/s (bytes it must read plus
  write) as a fraction of ``dst.copy_(src)`` measured in the same process at the same size.
- ``collectives``: all-reduce, all-gather, reduce-scatter and broadcast through gpudist's NCCL backend (with its
  cross-rank check, and ``unchecked()``) against raw ``cupy.cuda.nccl`` calls on the same communicator and buffers;
  algbw and busbw as nccl-tests defines them. World size: every visible GPU, one spawned rank each.
- ``strategies``: step times of gpudist DDP and FSDP against torch DDP (``gradient_as_bucket_view=True``,
  ``static_graph=True``, fused AdamW) and FSDP2 (``fully_shard`` per unit and the root, fused AdamW) on the models of
  ``gpudist.bench.workloads``, gpudist over its NCCL backend and torch over its own NCCL process group, every GPU
  one rank.
- ``gate``: the pytest-benchmark tier's CUDA cases against ``benchmarks/baselines/<device kind>.json``
  (benchmarks/gate.py); a device kind without a baseline is measured and reported, not gated.

The test parts and ``gate`` run pytest in the repository (``--repo``, or found from the working directory); every
other part runs from the installed package alone.

``--parts tests`` stands for the four test parts. Each test runs under pytest-timeout (``--test-timeout``, where
pytest-timeout is installed), so a hanging test costs its own timeout; a part past its time limit gets SIGINT
(pytest still writes its report) and then SIGKILL. ``--quick`` measures fewer sizes and rounds.

Exit codes (what a CI runner acts on; the JSON is written in every case but a usage error):

- 0: every part ran and the GPU tests passed; also when there is no CUDA device at all, so that a CPU job which
  runs the command stays green (the JSON and the output say ``skipped`` and why).
- 1: a part failed, ran out of the budget, or the GPU test tier had failures; the other parts' numbers are in the
  JSON all the same.
- 2: usage error (bad option).
- 3: no CUDA device and ``--require-gpu`` was given: a GPU runner that lost its GPU must not pass as a skip.

``--check`` runs nothing: it prints which parts would run and what each lacks (imports, the repository), exiting 0
when nothing is missing, 1 otherwise (CUDA itself aside).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..collectives import BUS_FACTORS, parse_size
from .common import (
    EXIT_NO_GPU,
    EXIT_OK,
    EXIT_PART_FAILED,
    EXIT_USAGE,
    NO_CUDA,
    TEST_PARTS,
    GPUSettings,
    bandwidth_GBps,
    bus_bandwidth,
    find_repo,
    fraction_of_copy,
)
from .measure import COLLECTIVE_OPS, collective_rows, kernels_part
from .pytest_part import MIN_PART_SECONDS, PART_RESERVE, junit_counts
from .run import PART_GROUPS, PARTS, check_plan, run_gpu, run_parts
from .steps import PHASES, profile_rows, strategy_rows

__all__ = [
    "BUS_FACTORS",
    "COLLECTIVE_OPS",
    "EXIT_NO_GPU",
    "EXIT_PART_FAILED",
    "MIN_PART_SECONDS",
    "NO_CUDA",
    "PARTS",
    "PART_RESERVE",
    "PHASES",
    "TEST_PARTS",
    "GPUSettings",
    "add_arguments",
    "bandwidth_GBps",
    "bus_bandwidth",
    "check_plan",
    "collective_rows",
    "fraction_of_copy",
    "junit_counts",
    "kernels_part",
    "main",
    "profile_rows",
    "run_gpu",
    "run_parts",
    "settings_from",
    "strategy_rows",
]


# -- command line -----------------------------------------------------------------------------------------------------


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(parse_size(t) for t in text.split(","))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = GPUSettings()
    parser.add_argument(
        "--parts",
        default=",".join(d.parts),
        help=f"comma-separated subset of {', '.join(PARTS)} ('tests': the four test parts)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer sizes and rounds: " + QUICK_HELP)
    parser.add_argument(
        "--budget", type=float, default=d.budget, help="seconds for the whole run (default %(default)s)"
    )
    parser.add_argument(
        "--test-timeout", type=float, default=d.test_timeout, help="seconds one test may take (default %(default)s)"
    )
    parser.add_argument(
        "--out", default=None, help="JSON file or folder (default benchmarks/results/gpu_<device>.json)"
    )
    parser.add_argument(
        "--check", action="store_true", help="print which parts would run and what they lack; run nothing"
    )
    parser.add_argument("--require-gpu", action="store_true", help=f"exit {EXIT_NO_GPU} instead of 0 without CUDA")
    parser.add_argument("--elements", default=None, help="kernel sizes in elements (default 4M,16M,64M)")
    parser.add_argument("--kernel-ops", default=None, help="subset of the kernel ops (default all)")
    parser.add_argument("--bytes", default=None, help="collective sizes in bytes (default 64K,1M,16M,256M)")
    parser.add_argument("--workloads", default=None, help=f"gpudist.bench.workloads models (default {d.workloads})")
    parser.add_argument("--rounds", type=int, default=None, help=f"interleaved rounds (default {d.rounds})")
    parser.add_argument("--steps", type=int, default=None, help=f"training steps per round (default {d.steps})")
    parser.add_argument("--world-size", type=int, default=None, help="ranks (default: every visible GPU)")
    parser.add_argument("--repo", default=None, help="the repository root (default: found from the working dir)")
    parser.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every part's time limit")


QUICK = {"elements": "16M", "bytes": "1M,64M", "workloads": "mlp,gpt", "rounds": 3, "steps": 3}
"""What ``--quick`` measures (an option given explicitly wins)."""
QUICK_HELP = ", ".join(f"{k} {v}" for k, v in QUICK.items())


def settings_from(args: argparse.Namespace) -> GPUSettings:
    parts: list[str] = []
    for p in (p for p in args.parts.split(",") if p):
        parts += PART_GROUPS.get(p, (p,))
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown part(s) {unknown}; available: {', '.join([*PARTS, *PART_GROUPS])}")
    defaults = GPUSettings()
    full = {
        "elements": "4M,16M,64M",
        "bytes": "64K,1M,16M,256M",
        "workloads": ",".join(defaults.workloads),
        "rounds": defaults.rounds,
        "steps": defaults.steps,
    }
    chosen = {k: getattr(args, k) if getattr(args, k) is not None else (QUICK if args.quick else full)[k] for k in full}
    world = args.world_size
    if chosen["rounds"] < 1 or chosen["steps"] < 1 or (world is not None and world < 1):
        raise ValueError(f"--rounds ({chosen['rounds']}), --steps ({chosen['steps']}) and --world-size must be >= 1")
    if args.budget <= 0 or args.test_timeout <= 0:
        raise ValueError(f"--budget ({args.budget}) and --test-timeout ({args.test_timeout}) must be > 0")
    repo = Path(args.repo).resolve() if args.repo else find_repo()
    return GPUSettings(
        parts=tuple(dict.fromkeys(parts)),
        kernel_elements=_sizes(chosen["elements"]),
        kernel_ops=tuple(args.kernel_ops.split(",")) if args.kernel_ops else None,
        collective_bytes=_sizes(chosen["bytes"]),
        workloads=tuple(chosen["workloads"].split(",")),
        rounds=chosen["rounds"],
        steps=chosen["steps"],
        world_size=world,
        timeouts={k: v * args.timeout_scale for k, v in defaults.timeouts.items()},
        test_timeout=args.test_timeout,
        budget=args.budget,
        repo=str(repo) if repo else None,
    )


def main(argv: list[str] | None = None, prog: str = "gpudist bench gpu") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


def run_from_args(args: argparse.Namespace) -> int:
    try:
        settings = settings_from(args)
    except ValueError as e:
        print(f"gpudist bench gpu: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.check:
        plan = check_plan(settings)
        for name, p in plan.items():
            state = "would run" if p["would_run"] else f"would skip ({p['reason']})"
            lack = "; ".join(p["problems"]) or "imports resolve"
            print(f"{name:<17} {state}: {lack}")
        return EXIT_OK if not any(p["problems"] for p in plan.values()) else EXIT_PART_FAILED
    _, _, code = run_gpu(settings, args.out, args.require_gpu)
    return code


if __name__ == "__main__":
    sys.exit(main())
