"""The GPU tier (marker ``gpu``; runs when CUDA is present, skipped with the reason otherwise): NCCL through every op,
every strategy on CUDA tensors (in-memory ranks at world size 2-4, NCCL at world size 1, and several NCCL ranks on
one GPU where NCCL >= 2.30 allows it). The compiled Triton kernels are tested against their references by the
``cuda`` cases of tests/test_kernels.py and tests/test_kernels_compression.py (same marker).

    pytest -m gpu            # what a single-GPU CI runner runs

Parity tolerance: against single-process training in float64 on the same device, within a multiple of the float32
run's own error (tests/tolerances.py). TF32 is off; the fused CUDA kernels differ from torch.optim by ulps per
step, which is the float32 reference's own kind of error.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from torch import nn

import gpudist
from gpudist.comm import ReductionOperation, split_sizes
from gpudist.testing import run_ranks

from .helpers import (
    GPU_PAIRS,
    LOSSY,
    assert_lossless,
    check_training,
    conservation,
    global_batch,
    gpu_reference,
    gpu_train,
    lossless_vs_plain,
    mlp,
    pipeline_reference,
    pipeline_train,
)
from .tolerances import assert_matches_reference, reference_pair

pytestmark = pytest.mark.gpu

HAS_CUPY = importlib.util.find_spec("cupy") is not None
needs_nccl = pytest.mark.skipif(not HAS_CUPY, reason="CuPy (gpudist[cuda12] or [cuda13]) is not installed")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("strategy", list(GPU_PAIRS))
def test_strategy_on_cuda_inmemory(strategy, world):
    """Catches device mix-ups in the strategies (a CPU temporary on the CUDA path, a stream-ordering bug between the
    compiled pack/step kernels and the copies): N CUDA ranks equal one CUDA process on the global batch."""
    results = run_ranks(gpu_train, world, "inmemory", device="cuda", strategy=strategy)
    expected = reference_pair(gpu_reference, "cuda")
    for r in results:
        assert_matches_reference(r, *expected)


def nccl_solo() -> gpudist.NCCLCommunicationBackend:
    from gpudist.comm.nccl import NCCLCommunicationBackend

    return NCCLCommunicationBackend(0, 1, NCCLCommunicationBackend.unique_id(), device=torch.cuda.current_device())


@needs_nccl
def test_nccl_world_one_every_op():
    """Catches a wrong NCCL dtype/op mapping, pointer offsets, or a missing stream order: every op of the contract
    on one rank gives the identity results, in fp32, bf16 (where CuPy has it) and int64."""
    comm = nccl_solo()
    dtypes = [torch.float32, torch.int64] + ([torch.bfloat16] if torch.bfloat16 in comm._types else [])
    for dtype in dtypes:
        x = (torch.arange(13, device="cuda") - 6).to(dtype)
        for op in ("sum", "max", "min", "product") + (("average",) if dtype.is_floating_point else ()):
            t = x.clone()
            comm.all_reduce(t, op)
            assert torch.equal(t, x), (dtype, op)
        out = torch.empty(split_sizes(13, 1)[0], dtype=dtype, device="cuda")
        comm.reduce_scatter(x, out, ReductionOperation.SUM)
        assert torch.equal(out, x)
        gathered = torch.empty(13, dtype=dtype, device="cuda")
        comm.all_gather(x, gathered)
        assert torch.equal(gathered, x)
        t = x.clone()
        comm.broadcast(t, 0)
        assert torch.equal(t, x)
        moved = torch.empty_like(x[:12])
        comm.all_to_all(x[:12].contiguous(), moved)
        assert torch.equal(moved, x[:12])
        work = comm.all_reduce(t, "sum", async_op=True)
        work.wait()
        torch.cuda.synchronize()
        assert work.is_completed()
    comm.barrier()
    assert comm.new_group([0]).world_size == 1
    with pytest.raises(ValueError, match="cpu"):
        comm.all_reduce(torch.ones(3))  # a CPU tensor on the NCCL backend: clear error before anything is sent
    comm.shutdown()


@needs_nccl
@pytest.mark.parametrize("strategy", list(GPU_PAIRS))
def test_strategy_on_nccl_world_one(strategy):
    """Catches a strategy that cannot drive the NCCL backend (e.g. host tensors handed to it for the norm)."""
    comm = nccl_solo()
    try:
        assert_matches_reference(gpu_train(comm, strategy), *reference_pair(gpu_reference, "cuda"))
    finally:
        comm.shutdown()


@needs_nccl
@pytest.mark.parametrize(
    ("strategy", "capturable"),
    [(s, False) for s in GPU_PAIRS] + [(s, True) for s in ("zero1", "zero2", "zero3", "fsdp")],
)
def test_steady_state_step_makes_no_host_sync_on_a_real_gpu(strategy, capturable):
    """The CPU tier counts host syncs over a simulated device (tests/test_gpu_model.py); this asks CUDA itself.
    Under ``torch.cuda.set_sync_debug_mode("error")`` any synchronizing call (``.item()``, a blocking copy to or
    from the host, a stream synchronize) raises. Catches a sync the simulation cannot see: a pointer table copied
    from pageable memory on a cache miss, a verdict read that blocks, a blocking copy inside a kernel launcher."""
    torch.backends.cuda.matmul.allow_tf32 = False
    comm = nccl_solo()
    try:
        import torch.nn.functional as F

        from .helpers import gpu_batch, gpu_net

        config = gpudist.ShardingConfiguration(comm)
        model_cls, opt_cls = GPU_PAIRS[strategy]
        model = model_cls(gpu_net(comm.device), config)
        # capturable: ZeRO's counts, bias corrections and a tensor learning rate on the device
        adam = {"lr": torch.tensor(1e-2, device=comm.device), "capturable": True} if capturable else {"lr": 1e-2}
        opt = opt_cls(torch.optim.Adam(model.parameters(), **adam), config)
        batches = [gpu_batch(step, comm.device) for step in range(4)]  # made before: their copies are input
        for step, (x, y) in enumerate(batches):
            if step == 2:  # the first steps build layouts, tables and state; the steady state starts here
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        comm.shutdown()


def _on_shared_gpu(comm, body, **kwargs):
    """``body(nccl, **kwargs)`` on an NCCL group of these Gloo ranks, all on GPU 0."""
    os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"  # read when the communicator is created
    torch.backends.cuda.matmul.allow_tf32 = False
    from gpudist.comm.nccl import NCCLCommunicationBackend

    nccl = NCCLCommunicationBackend.from_bootstrap(comm, device=0)
    try:
        return body(nccl, **kwargs)
    finally:
        nccl.shutdown()


def run_on_shared_gpu(body, **kwargs) -> list:
    """Two NCCL ranks sharing one GPU (spawned Gloo processes bootstrap them), or a skip naming the NCCL version:
    NCCL >= 2.30 allows it with NCCL_MULTI_RANK_GPU_ENABLE=1."""
    from gpudist.comm.nccl import nccl_version

    version = nccl_version()
    if version is None or version < (2, 30, 0):
        pytest.skip(f"NCCL {version} refuses two ranks on one GPU (needs >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1)")
    return run_ranks(_on_shared_gpu, 2, "gloo", timeout=120.0, body=body, **kwargs)


def _strategy_on_nccl(nccl, strategy: str) -> torch.Tensor:
    x = torch.full((7,), float(nccl.rank + 1), device="cuda")
    nccl.all_reduce(x)
    assert torch.equal(x.cpu(), torch.full((7,), float(sum(range(1, nccl.world_size + 1)))))
    return gpu_train(nccl, strategy)


@needs_nccl
@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fsdp"])
def test_multi_rank_nccl_on_one_gpu(strategy):
    """Where NCCL >= 2.30 (NCCL_MULTI_RANK_GPU_ENABLE=1) lets two ranks share one GPU: real multi-rank NCCL
    collectives, and a strategy equal to one process. Catches uneven reduce-scatter/all-gather group calls."""
    expected = reference_pair(gpu_reference, "cuda")
    for r in run_on_shared_gpu(_strategy_on_nccl, strategy=strategy):
        assert_matches_reference(r, *expected)


def _cuda_mlp() -> nn.Module:
    return mlp().cuda()


def _cuda_batch(step: int):
    return tuple(t.cuda() for t in global_batch(step))


def _pipeline_on_nccl(nccl, schedule: str):
    params, losses, _, _ = pipeline_train(nccl, micro=4, schedule=schedule, build=_cuda_mlp, batch=_cuda_batch)
    return params.cpu(), losses


@needs_nccl
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_on_multi_rank_nccl(schedule):
    """Two pipeline stages over real NCCL send/recv (NCCL >= 2.30 lets them share one GPU): the in-order path that
    posts each receive when needed, grouped with the sends before it. Catches a deadlock of the stream (the test
    times out) and shape/loss messages left in host memory (NCCL refuses them)."""
    want = reference_pair(pipeline_reference)  # on the CPU: the float64 reference and fp32 rounding's size
    for params, losses in run_on_shared_gpu(_pipeline_on_nccl, schedule=schedule):
        check_training(params, losses, want)


@pytest.mark.parametrize("name", ["topk", "int8", "1bit"])
def test_compressed_collectives_on_cuda(name):
    """The compression channels on CUDA tensors (compiled top-k / quantize kernels, in-memory ranks): lossless codecs
    equal the plain all-reduce, and error feedback conserves the gradient sum. Catches a CPU temporary or generator
    on the CUDA path and a compiled kernel that updates the residual differently from the reference."""
    from gpudist.compression import IdentityCompressor, TopKCompressor

    for compressor in (IdentityCompressor(), TopKCompressor(1.0)):
        for results in run_ranks(lossless_vs_plain, 3, "inmemory", device="cuda", compressor=compressor, n=1001):
            assert_lossless(results, 3)
    for applied, pending, true, bound in run_ranks(
        conservation, 3, "inmemory", device="cuda", compressor=LOSSY[name], n=5000
    ):
        torch.testing.assert_close(applied + pending, true, rtol=0, atol=bound)


def _graph_pair(comm, strategy: str, opt_name: str = "adamw"):
    """A wrapper pair whose step a CUDA graph can replay: DDP with torch's fused AdamW built capturable, the ZeRO and
    FSDP optimizers with capturable AdamW (counts, bias corrections and a tensor learning rate on the device) or SGD
    (counts moved to the device at capture)."""
    config = gpudist.ShardingConfiguration(comm, static_graph=strategy != "fsdp")
    model_cls, opt_cls = GPU_PAIRS[strategy]
    model = model_cls(_cuda_mlp(), config)
    if strategy == "ddp":
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True, capturable=True)
    elif opt_name == "adamw":
        lr = torch.tensor(1e-2, device="cuda")
        inner = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, capturable=True)
    else:
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt_cls(inner, config)


@needs_nccl
@pytest.mark.parametrize(
    ("strategy", "opt_name"),
    [("ddp", "adamw"), ("zero1", "sgd"), ("zero2", "sgd"), ("zero1", "adamw"), ("zero2", "adamw"), ("fsdp", "adamw")],
)
def test_captured_steps_equal_eager_steps_on_a_real_gpu(strategy, opt_name):
    """``gpudist.capture`` on CUDA and NCCL at world 1: the replayed steps give exactly the eager steps' losses (the
    graph replays the same kernels on the same data). Catches what the CPU tier's simulated graph cannot: a CUDA call
    that stream capture refuses (an event query, a pinned allocation, a sync), NCCL's communication stream not joined
    back to the capture, and a replay that reads a stale static input."""
    import torch.nn.functional as F

    def loss_fn(model, x, y):
        return F.mse_loss(model(x), y)

    batches = [_cuda_batch(step) for step in range(6)]
    comm = nccl_solo()
    try:
        model, opt = _graph_pair(comm, strategy, opt_name)
        eager = []
        for i, (x, y) in enumerate([batches[0]] * 3 + batches[1:]):
            opt.zero_grad(set_to_none=False)
            loss = loss_fn(model, x, y)
            loss.backward()
            opt.step()
            if i >= 3:
                eager.append(loss.item())
        step = gpudist.capture(*_graph_pair(comm, strategy, opt_name), loss_fn, batches[0])
        replayed = [step(x, y).item() for x, y in batches[1:]]
    finally:
        comm.shutdown()
    assert replayed == eager, (replayed, eager)
