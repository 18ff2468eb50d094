"""One training step of DDP, ZeRO-1, ZeRO-2 and FSDP against its PyTorch peer (``benchmarks/steps.py`` has the
pairs; ``benchmarks/peers.py`` the peers' exact settings), on the ``gpt-small`` workload (1.3M parameters, 2
sequences of 64 tokens per rank), two Gloo ranks spawned once per session. Each case first checks that both train
the same function: a benchmark of a step that computes something else would be meaningless.

On CUDA, strategy steps against torch DDP and FSDP2 over NCCL are ``gpudist bench gpu --parts strategies``
(docs/gpu.md); here the CUDA cases skip.

    pytest benchmarks/ --benchmark-only -k strategies [--gate]
"""

from __future__ import annotations

import pytest

from .conftest import DEVICES
from .steps import PAIRS, step_rank

WORKLOAD, BATCH, BUCKET_MB, STEPS = "gpt-small", 2, 1.0, 2
"""1 MiB buckets: the 5.4 MB of gradients make several, so bucketing and overlap are exercised."""


@pytest.mark.parametrize("strategy", list(PAIRS))
@pytest.mark.parametrize("device", DEVICES)
def test_step(ratio, gloo_pool, rounds, device, strategy):
    if device == "cuda":
        pytest.skip("the CUDA strategy steps are `gpudist bench gpu --parts strategies` (NCCL, torch DDP and FSDP2)")
    res = gloo_pool.run(step_rank, strategy, WORKLOAD, BATCH, STEPS, rounds, BUCKET_MB, call_timeout=600.0)[0]
    bad = {name: c for name, c in res["checks"].items() if not c["ok"]}
    assert not bad, f"a variant trains another function than the local reference: {bad}"
    ratio.record(
        device,
        res["ours"],
        res["peer"],
        peer_name=res["peer_label"],
        bytes_moved=res["step_bytes"],
        size=f"{WORKLOAD}, batch {BATCH}/rank, world 2, {BUCKET_MB:g} MiB buckets",
        bandwidth="bytes sent per step / step time",
        steps_per_round=STEPS,
    )
