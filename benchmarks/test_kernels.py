"""Every gpudist kernel op against its torch baseline (``gpudist.bench.kernels.OPS``: the cases ``gpudist bench
kernels`` runs), on CPU and on CUDA where present. The torch path runs on CPU, Triton on CUDA.

    pytest benchmarks/ --benchmark-only -k kernels [--bench-elements 64K] [--gate]
"""

from __future__ import annotations

import pytest
import torch

from gpudist.bench import parse_size
from gpudist.bench.kernels import OPS, default_elements, measure_kernel

from .conftest import DEVICES


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("device", DEVICES)
def test_kernel(ratio, copy_GBps, rounds, device, op, request):
    dev = torch.device(device)
    option = request.config.getoption("--bench-elements")
    n = parse_size(option) if option else default_elements(dev)
    torch.manual_seed(0)
    target_s = request.config.getoption("--bench-round-ms") / 1e3
    row = measure_kernel(op, n, dev, rounds, copy_GBps(device, n), target_s)
    extra = {k: v for k, v in row.items() if k in ("recall", "k", "block_size", "tensors")}
    ratio.record(
        device,
        row["rounds_s"]["gpudist"],
        row["rounds_s"]["torch"],
        peer_name=PEERS[op.split("_")[0]],
        bytes_moved=row["bytes_moved"],
        size=f"{n} elements",
        iters=row["iters"],
        **extra,
    )


PEERS = {
    "pack": "torch.cat + mul_",
    "unpack": "torch._foreach_copy_ + _foreach_mul_",
    "adam": "torch.optim.Adam(fused=True)",
    "sgd": "torch.optim.SGD(momentum, fused=True)",
    "squared": "torch.linalg.vector_norm().square()",
    "topk": "torch.topk + error-feedback ops",
    "quantize": "the same math in torch elementwise ops",
    "dequantize": "torch elementwise dequantize + add_",
}
"""Each op family's baseline, as gpudist/bench/kernels.py's docstring names them."""
