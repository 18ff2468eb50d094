"""Every GPU number in one go: the GPU test tier, kernel bandwidth against a device-to-device copy, NCCL busbw
against raw ``cupy.cuda.nccl`` calls, and DDP/FSDP step times against torch DDP and FSDP2 (docs/gpu.md).

    python -m benchmarks.gpu [--parts tests,kernels,collectives,strategies] [--out FILE] [--check] [--require-gpu]

The same as ``gpudist bench gpu`` (gpudist/bench/gpu/ has the parts and the exit codes); writes
``benchmarks/results/gpu_<device>.json``. Without a CUDA device it prints and writes the skip with its reason and
exits 0 (3 with ``--require-gpu``).
"""

from __future__ import annotations

import sys

from gpudist.bench.gpu import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m benchmarks.gpu"))
