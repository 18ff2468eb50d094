"""The ``gpudist`` command: ``gpudist info``, ``gpudist bench collectives``, ``gpudist bench kernels``,
``gpudist bench gpu`` (every GPU number in one go: gpudist/bench/gpu/) and ``gpudist plan`` (gpudist/plan/)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _info(_: argparse.Namespace) -> int:
    import torch

    from .bench import environment
    from .launch import available_backends, detect_environment

    env = environment()
    print("gpudist", env["gpudist"])
    for key in ("torch", "triton", "numpy", "cupy", "mpi4py", "python", "platform", "cpu", "cpu_count", "cuda"):
        print(f"  {key:<10} {env[key] if env[key] is not None else '-'}")
    print("devices:")
    print(f"  cpu        {env['cpu_count']} cores")
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        props = torch.cuda.get_device_properties(i)
        print(f"  cuda:{i}     {props.name}, {props.total_memory / 2**30:.1f} GiB")
    if not torch.cuda.is_available():
        print("  cuda       none")
    print("backends:")
    for name, state in available_backends().items():
        print(f"  {name:<10} {state}")
    launch = detect_environment()
    print(
        f"launcher:    {launch.launcher} (rank {launch.rank} of {launch.world_size}, "
        f"store {launch.master_addr}:{launch.master_port})"
    )
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .bench import parse_size, run_collectives

    if args.name == "gpu":
        from .bench.gpu import run_from_args

        return run_from_args(args)
    if args.name == "kernels":
        from .bench.kernels import OPS, run_kernels

        ops = args.ops.split(",") if args.ops else None
        unknown = [o for o in ops or () if o not in OPS]
        if unknown:
            print(f"gpudist bench kernels: unknown op(s) {unknown}; available: {', '.join(OPS)}", file=sys.stderr)
            return 2
        elements = [parse_size(size) for size in args.elements.split(",")] if args.elements else None
        run_kernels(args.device, elements, ops, args.rounds, json_path=args.json)
        return 0
    from .bench.collectives import BUS_FACTORS, SWEEP_OPS

    ops = tuple(args.ops.split(",")) if args.ops else SWEEP_OPS
    unknown = [o for o in ops if o not in BUS_FACTORS]
    if unknown:
        print(f"gpudist bench: unknown op(s) {unknown}; use {', '.join(BUS_FACTORS)}", file=sys.stderr)
        return 2
    run_collectives(
        backend=args.backend,
        world_size=args.world_size,
        json_path=args.json,
        ops=ops,
        min_bytes=parse_size(args.min_bytes),
        max_bytes=parse_size(args.max_bytes),
        factor=args.factor,
        rounds=args.rounds,
        baseline=not args.no_baseline,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpudist", description="gpudist: distributed training for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, devices and available backends")
    info.set_defaults(func=_info)
    bench = sub.add_parser("bench", help="run a benchmark and print an nccl-tests-style table")
    names = bench.add_subparsers(dest="name", required=True, metavar="{collectives,kernels,gpu}")
    # collectives and kernels share one set of options (each reads its own); gpu has its own.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--backend", default="gloo", help="gloo (default), inmemory, nccl, mpi")
    common.add_argument("--world-size", type=int, default=2)
    common.add_argument(
        "--ops",
        default=None,
        help="collectives: all_reduce,reduce_scatter,all_gather (default), broadcast, all_to_all; "
        "kernels: a subset of the kernel ops (default all)",
    )
    common.add_argument("--device", default="auto", help="kernels: auto (CUDA if present), cpu or cuda")
    common.add_argument(
        "--elements",
        default=None,
        help="kernels: elements per op, comma-separated (default 4M,16M,64M on CUDA, 4M on CPU)",
    )
    common.add_argument("--min-bytes", default="1K")
    common.add_argument("--max-bytes", default="64M")
    common.add_argument("--factor", type=int, default=4, help="size step between rows (default 4)")
    common.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median is reported")
    common.add_argument("--no-baseline", action="store_true", help="skip the torch.distributed comparison")
    common.add_argument("--json", default=None, help="also write the results to this JSON file")
    for name, what in (
        ("collectives", "an nccl-tests-style sweep against the transport's own calls"),
        ("kernels", "each kernel against its PyTorch baseline"),
    ):
        names.add_parser(name, parents=[common], help=what).set_defaults(func=_bench)
    from .bench.gpu import add_arguments as gpu_arguments

    gpu = names.add_parser("gpu", help="on a GPU machine: the GPU tests and every GPU number, into one JSON")
    gpu_arguments(gpu)
    gpu.set_defaults(func=_bench)
    from .plan import add_arguments as plan_arguments
    from .plan import run_from_args as run_plan

    planner = sub.add_parser("plan", help="rank strategies and layouts by predicted memory, traffic and step time")
    plan_arguments(planner)
    planner.set_defaults(func=run_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "world_size", None) is not None and args.world_size < 1:
        print("gpudist: --world-size must be >= 1", file=sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
