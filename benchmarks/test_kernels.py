"""Every gpudist kernel op against its torch baseline (``gpudist.bench.kernels.OPS``: the cases ``gpudist bench
kernels`` runs), on CPU and on CUDA where present. The torch path runs on CPU, Triton on CUDA.

    pytest benchmarks/ --benchmark-only -k kernels [--bench-elements 64K | 4M,16M,64M] [--gate]
"""

from __future__ import annotations

import pytest
import torch

from gpudist.bench import parse_size
from gpudist.bench.kernels import OPS, default_elements, measure_kernel

from .conftest import DEVICES


def pytest_generate_tests(metafunc):
    """``--bench-elements 4M,16M,64M``: one case per size (ids gain the size); one size or none keeps the ids the
    baselines know."""
    option = metafunc.config.getoption("--bench-elements")
    if "elements" in metafunc.fixturenames and option and "," in option:
        sizes = option.split(",")
        metafunc.parametrize("elements", sizes, ids=sizes)


@pytest.fixture
def elements(request) -> str | None:
    """The one size asked for (``--bench-elements``), or None: the device's default."""
    return request.config.getoption("--bench-elements")


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("device", DEVICES)
def test_kernel(ratio, copy_GBps, rounds, device, op, elements, request):
    dev = torch.device(device)
    n = parse_size(elements) if elements else default_elements(dev)
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
