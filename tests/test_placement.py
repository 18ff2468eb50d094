"""No tensor that gpudist creates in host memory by accident reaches a backend: every strategy, the checkpoint
and optimizer helpers run with gpudist's un-placed tensors on ``meta`` (tests/placement.py), where the CPU
backends refuse them. On NCCL, which takes GPU memory only, each such tensor is an error at the first op of a
real job; on Gloo it goes unnoticed. This is how the CPU tier sees what only a GPU run would otherwise show.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import gpudist
from gpudist.compression import TopKCompressor
from gpudist.testing import run_ranks

from .helpers import GPU_PAIRS, gpu_batch, gpu_net, gpu_train, hybrid_train, pipeline_train, tp_lm_batch, tp_train_lm
from .placement import run_checked


def helpers(comm, path: str) -> float:
    """Checkpoint save/load (byte exchange, verdict), state broadcast (Adam's CPU ``step`` next to its moments),
    early-stop votes, the seeds' ``optimize`` loop, norm clipping and gradient compression."""
    x, y = gpu_batch(0, "cpu", comm.rank, comm.world_size)
    config = gpudist.ShardingConfiguration(comm, max_grad_norm=1.0)
    model = gpudist.ZeRO2Model(gpu_net("cpu"), config)
    opt = gpudist.ZeRO2Optimizer(torch.optim.Adam(model.parameters(), lr=1e-2), config)
    F.mse_loss(model(x), y).backward()
    opt.step()
    gpudist.save_checkpoint(path, model, opt, step=1)
    gpudist.load_checkpoint(path, model, opt)
    plain = gpudist.ShardingConfiguration(comm)
    ddp = gpudist.DDPModel(gpu_net("cpu"), plain)
    dopt = gpudist.DDPOptimizer(torch.optim.Adam(ddp.parameters(), lr=1e-2), plain)
    result = dopt.optimize(ddp, [(x, y)] * 2, F.mse_loss, patience=1)
    dopt.synchronize_optimizer_state()
    assert dopt.should_early_stop(comm.rank == 0, require="any")
    fsdp = gpudist.FSDPModel(gpu_net("cpu"), plain)
    F.mse_loss(fsdp(x), y).backward()
    fsdp.clip_grad_norm_(0.1)
    squeezed = gpudist.DDPModel(gpu_net("cpu"), plain)
    copt = gpudist.GradientCompressionOptimizer(
        torch.optim.SGD(squeezed.parameters(), lr=0.1), plain, TopKCompressor(0.1)
    )
    for _ in range(2):
        F.mse_loss(squeezed(x), y).backward()
        copt.step()
        copt.zero_grad()
    return result.losses[-1]


CASES = {f"{s}": (gpu_train, 2, {"strategy": s}) for s in GPU_PAIRS} | {
    "pipeline-1f1b": (pipeline_train, 2, {"micro": 2}),
    "pipeline-replicas": (pipeline_train, 4, {"stages": 2, "micro": 2, "schedule": "gpipe"}),
    "tensor": (tp_train_lm, 2, {"tp": 2, "opt_name": "adamw"}),
    "hybrid-zero2": (hybrid_train, 4, {"pp": 2, "tp": 2, "zero_stage": 2}),
    "hybrid-clipped": (hybrid_train, 4, {"pp": 2, "tp": 1, "zero_stage": 1, "max_grad_norm": 0.05}),
    "helpers": (helpers, 2, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_no_host_tensor_reaches_the_backend(case, tmp_path):
    """Catches gpudist code that makes a tensor without ``device=`` and hands it to a collective (for example a
    vote or a norm total built on the CPU): NCCL would refuse it on the first step of every GPU job."""
    fn, world, kwargs = CASES[case]
    if case == "tensor":
        kwargs = {**kwargs, "x": tp_lm_batch()[0], "y": tp_lm_batch()[1]}
    if case == "helpers":
        kwargs = {"path": str(tmp_path / "ckpt")}
    run_ranks(run_checked, world, "inmemory", timeout=60.0, body=fn, kwargs=kwargs)
