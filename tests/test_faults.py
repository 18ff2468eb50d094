"""The fault-injection tier's own cases (``pytest -m faults``; the tier's other cases are marked where they live:
tests/test_comm_failures.py, test_config_drift.py, test_checkpoint*.py, test_elastic.py, test_async.py).

Each asserts no hang (a bound), no abort (exit codes), nothing lost (the previous checkpoint) and the error text.
Killed ranks are forked from a forkserver that imported torch and gpudist once, so a case costs a fork and a Gloo
rendezvous rather than a process start (about 3 s of imports per rank on a 2-core machine).
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import subprocess
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpudist
from gpudist import CheckpointError, GlooCommunicationBackend, ShardingConfiguration, save_checkpoint
from gpudist.comm import CommunicationError
from gpudist.strategies import DATA_PARALLEL_PAIRS
from gpudist.testing import free_port, run_ranks

from .helpers import batch, fresh_net, initial_state

pytestmark = pytest.mark.faults

OP_TIMEOUT = 60.0  # long: a dead peer must be reported by its closed socket, not by the clock
NO_HANG = 30.0  # every case ends well within this


# -- SIGKILL of one rank mid-step, per data-parallel strategy ----------------------------------------------------


def _train_until_killed(rank: int, world: int, port: int, strategy: str, state: dict, report) -> None:
    """One rank of a Gloo job: train; at step 1 rank 1 is SIGKILLed after its forward (the others are then inside
    that step's collectives); the others report what they raised and how long the failing step took."""
    torch.set_num_threads(1)
    comm = GlooCommunicationBackend.create(rank, world, "127.0.0.1", port, timeout=OP_TIMEOUT, connect_timeout=NO_HANG)
    config = ShardingConfiguration(comm)
    model_cls, opt_cls = DATA_PARALLEL_PAIRS[strategy]
    model = model_cls(fresh_net(state), config)
    opt = opt_cls(torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    result: dict = {"error": None}
    for step in range(4):
        x, y = batch(step, rank, world)
        loss = F.mse_loss(model(x), y)
        if step == 1 and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            loss.backward()
            opt.step()
            opt.zero_grad()
        except Exception as e:
            result = {"type": type(e).__name__, "gpudist": isinstance(e, CommunicationError), "error": str(e)}
            result["elapsed"] = time.monotonic() - start
            break
    report.send(result)


def _forkserver():
    ctx = multiprocessing.get_context("forkserver")
    # torch, gpudist, this module and torch._dynamo (which the first torch optimizer imports: 4-11 s on 2 cores),
    # imported once for every case
    ctx.set_forkserver_preload(["torch._dynamo", __name__])
    return ctx


@pytest.mark.parametrize("strategy", list(DATA_PARALLEL_PAIRS))
def test_sigkill_of_a_rank_mid_step(strategy):
    """Rank 1 of 3 is SIGKILLed in the middle of a training step. Each survivor raises a gpudist CommunicationError
    naming the op within seconds (the op timeout is 60 s), and exits normally: no hang, no SIGABRT from Gloo.
    Catches a strategy whose collectives wait for the timeout on a dead peer, or that lets a transport error through
    as a raw RuntimeError or an abort."""
    ctx, port, world, state = _forkserver(), free_port(), 3, initial_state()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    procs = [
        ctx.Process(target=_train_until_killed, args=(r, world, port, strategy, state, pipes[r][1]), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + NO_HANG
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        assert not [p for p in procs if p.is_alive()], "a rank hung after its peer was killed"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert procs[1].exitcode == -signal.SIGKILL
    for r in (0, 2):
        assert procs[r].exitcode == 0, f"rank {r} exited with {procs[r].exitcode} (SIGABRT is -6)"
        result = pipes[r][0].recv()
        assert result["error"] is not None, f"rank {r} trained on without its peer"
        assert result["gpudist"], result
        # Over TCP: "a peer process closed its connection (it died, ...)"; over shared memory: "rank 1 (pid N) died
        # while this rank waited".
        assert f"failed on rank {r}: " in result["error"] and "died" in result["error"], result["error"]
        assert result["elapsed"] < 10.0, result


# -- a full disk ------------------------------------------------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs at tmp_path/disk (root only; skipped with the reason otherwise), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"could not mount a tmpfs: {mounted.stderr.decode().strip() or mounted.returncode}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_save_on_a_full_disk_keeps_the_previous_checkpoint(small_tmpfs):
    """A 2 MiB tmpfs holds one checkpoint of a ~0.5 MiB model but fills up during an overwrite with a ~1.5 MiB one:
    the save raises CheckpointError naming the full disk, the previous checkpoint still loads with its values, and
    no staging folder is left on the disk. Catches an overwrite that moved the previous folder aside before the new
    one was complete, and a staging folder stranded on the full disk."""
    torch.manual_seed(0)
    small = nn.Linear(256, 512)  # 0.5 MiB of fp32
    path = small_tmpfs / "ckpt"
    save_checkpoint(path, small, step=1)
    big = nn.Linear(256, 1536)  # 1.5 MiB: with the previous one, more than the disk holds
    with pytest.raises(CheckpointError, match="No space left on device"):
        save_checkpoint(path, big, step=2)
    assert sorted(p.name for p in small_tmpfs.iterdir()) == ["ckpt"], "a staging folder was left behind"
    loaded = nn.Linear(256, 512)
    info = gpudist.load_checkpoint(path, loaded)
    assert info.step == 1 and torch.equal(loaded.weight, small.weight)
    shutil.rmtree(path)


# -- a model on the meta device --------------------------------------------------------------------------------------


def _wrap_meta(comm, strategy: str):
    model_cls, _ = DATA_PARALLEL_PAIRS[strategy]
    model_cls(nn.Linear(3, 2, device="meta"), ShardingConfiguration(comm))


@pytest.mark.parametrize("strategy", list(DATA_PARALLEL_PAIRS))
def test_a_meta_model_is_refused_naming_the_device(strategy):
    """A module built on the meta device (shapes, no data) is refused at wrap time with an error naming the device
    and the fix. Catches torch's "Cannot copy out of meta tensor" from inside the first broadcast."""
    with pytest.raises(gpudist.testing.RanksFailedError, match=r"weight is on the meta device.*to_empty"):
        run_ranks(_wrap_meta, 2, "inmemory", strategy=strategy)
