"""gpudist kernels vs their PyTorch baselines, same run, same tensors.

    python -m benchmarks.kernels [--device auto|cpu|cuda] [--elements 64M] [--ops pack_fp32,adam,...]

Prints the table of ``gpudist bench kernels`` and writes ``benchmarks/results/kernels_<device>.json``
(device name, versions and date inside) with times, GB/s, the fraction of the copy bandwidth measured in
the same run, the speedup over the baseline, and which of the issue's targets each row met.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from gpudist.bench import parse_size
from gpudist.bench.kernels import run_kernels

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--elements", default=None, help="elements per op, comma-separated (default 4M,16M,64M on CUDA, 4M on CPU)"
    )
    parser.add_argument("--ops", default=None, help="comma-separated subset (default: all)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/kernels_<device>.json)")
    args = parser.parse_args()
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device.replace("auto", "cpu")
    if args.out:
        out = Path(args.out)
    else:
        name = torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu"
        out = RESULTS / f"kernels_{re.sub(r'[^a-z0-9]+', '_', name.lower()).strip('_')}.json"
    # "64M" -> 64 * 2^20 (a count, not bytes)
    elements = [parse_size(size) for size in args.elements.split(",")] if args.elements else None
    run_kernels(device, elements, args.ops.split(",") if args.ops else None, args.rounds, json_path=out)


if __name__ == "__main__":
    main()
