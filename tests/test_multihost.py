"""The multi-host tier: 2 hosts x 2 ranks in network namespaces (tests/netns.py), joined over a 1 Gbit/s bridge,
each running torchrun with a c10d rendezvous at host 0's address. One launch trains every data-parallel strategy
(gpudist/testing/multihost_job.py) and then has host 1 killed; the tests read what it wrote. Needs root."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from gpudist.testing import multihost_job

from . import netns
from .tolerances import assert_matches_reference

ROOT = Path(__file__).resolve().parents[1]
OP_TIMEOUT = 30.0
"""The job's per-op timeout: how soon a survivor must hear that a host died (a bound, not a measured time)."""
START_LIMIT = 240.0
"""Seconds for 6 processes to import torch, rendezvous and train on a loaded 2-core machine."""


def _wait(predicate, limit: float, what: str, logs: list[Path], agents=()) -> None:
    """Poll ``predicate`` until true; fail with the hosts' logs after ``limit`` seconds, or as soon as one of
    ``agents`` has exited (a job that failed at start would otherwise be waited for until the limit)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if predicate():
            return
        if any(agent.poll() is not None for agent in agents):
            what = f"{what} (an agent exited first)"
            break
        time.sleep(0.1)
    tails = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs if log.exists())
    raise AssertionError(f"gave up waiting for {what}\n{tails}")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Run the job on 2 namespaced hosts, kill host 1 once every rank is in its survive loop, and return the
    output folder and the time of the kill."""
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("multihost")
    logs = [out / "host0.log", out / "host1.log"]
    with netns.Hosts(2, rate="1gbit") as hosts:
        agents = []
        for i in range(2):
            job = ["gpudist.testing.multihost_job", f"--out={out}", f"--timeout={OP_TIMEOUT}", "--survive=300"]
            argv = hosts.torchrun(i, "2", job, join_timeout=START_LIMIT, agent_args=["--max-restarts=0"])
            agents.append(hosts.popen(i, argv, logs[i], env={"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}))
        try:
            ready = [out / f"ready-{r}" for r in range(4)]
            _wait(lambda: all(p.exists() for p in ready), START_LIMIT, "every rank to train", logs, agents)
            killed_at = time.time()
            assert hosts.kill_host(1) >= 3  # the agent and its two workers
            survivors = [out / f"survivor-{r}.json" for r in (0, 1)]
            _wait(lambda: all(p.exists() for p in survivors), OP_TIMEOUT + 60, "the survivors' reports", logs)
            # Host 0's agent would now wait in torchrun's exit barrier for the dead host's agent: closing the hosts
            # kills it.
        finally:
            for agent in agents:
                if agent.poll() is None:
                    agent.kill()
    return out, killed_at


@pytest.mark.slow
def test_two_hosts_train_every_strategy_to_the_single_process_result(job):
    """Catches any strategy that is right on one host but wrong across hosts: node groups mixing hosts, HSDP or
    hierarchical DDP missing the cross-node reduction (each host would train on its half of the batch), Gloo bound
    to an interface the other host cannot reach (the job would not start), and a link-class counter that puts
    cross-node traffic on the wrong group."""
    out, _ = job
    results = json.loads((out / "results.json").read_text())
    assert results["layout"] == "2 node(s) x 2 rank(s) = 4 (torchrun)"
    ref32, ref64 = multihost_job.reference(), multihost_job.reference(dtype=__import__("torch").float64)
    assert sorted(results["strategies"]) == sorted(multihost_job.STRATEGIES)
    for name, got in results["strategies"].items():
        assert_matches_reference(got["params"], ref32, ref64, what=name)
        link = got["link_bytes"][-1]
        if name in ("ddp-hierarchical", "ddp-hierarchical-hook", "hsdp"):
            assert link["world"] == 0 and link["intra"] > 0 and 0 < link["inter"] < link["intra"], (name, link)
        elif name != "hybrid":
            assert link["world"] > 0 and link["intra"] == link["inter"] == 0, (name, link)


@pytest.mark.slow
def test_killing_a_host_gives_every_survivor_an_error_within_the_timeout(job):
    """Catches a survivor that hangs (or exits silently) when a whole host dies mid-training: each rank on the
    surviving host must raise a CommunicationError from its collective within the op timeout."""
    out, killed_at = job
    for rank in (0, 1):
        report = json.loads((out / f"survivor-{rank}.json").read_text())
        assert report["error"] is not None, f"rank {rank} saw no error"
        assert report["error"]["type"] in ("CommunicationError", "CommunicationTimeoutError")
        assert report["error"]["op"] == "all_reduce"
        assert report["time"] - killed_at <= report["timeout"] + 10.0  # the timeout, plus writing the report


def _elastic_reference(steps: int, dtype=None):
    """The elastic job's single-process training on its global batches, in ``dtype``."""
    import torch

    from gpudist.testing import elastic_job

    model = elastic_job.build_model().to(dtype)
    opt = elastic_job.make_optimizer(model.parameters())
    for step in range(steps):
        x, y = (t.to(dtype) for t in elastic_job.batch(step))
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


@pytest.mark.slow
def test_killing_a_host_then_elastic_restart_resumes_on_the_remaining_host(tmp_path):
    """Two namespaced hosts x 2 workers train gpudist/testing/elastic_job.py (ElasticOptimizer, checkpoints every 4
    steps) under torchrun --nnodes=1:2; host 1 is killed mid-training. Host 0's agent must restart its workers at
    world size 2 from the newest checkpoint and finish, ending where single-process training ends. Catches survivors
    that hang instead of failing (no restart), a restart that cannot re-rendezvous without the dead host, and a
    resume that loses or repeats steps across the change of world size."""
    import torch

    from gpudist.testing import elastic_job

    from .tolerances import reference_pair

    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(reason)
    steps, every = 30, 4
    root = tmp_path / "run"
    root.mkdir()
    logs = [tmp_path / "host0.log", tmp_path / "host1.log"]

    def reached_at_world_four() -> bool:
        done = [s["step"] for s in elastic_job.read_status(root) if s["event"] == "step" and s["world"] == 4]
        return bool(done) and max(done) >= every + 2  # past the first checkpoint

    with netns.Hosts(2, rate="1gbit") as hosts:
        agents = []
        for i in range(2):
            job = ["gpudist.testing.elastic_job", f"--dir={root}", f"--steps={steps}", f"--every={every}"]
            job += ["--sleep=0.2", f"--timeout={OP_TIMEOUT}"]
            argv = hosts.torchrun(
                i,
                "1:2",
                job,
                join_timeout=START_LIMIT,
                rdzv_conf="last_call_timeout=5",
                agent_args=["--max-restarts=3"],
            )
            env = {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
            agents.append(hosts.popen(i, argv, logs[i], env=env))
        try:
            _wait(reached_at_world_four, START_LIMIT, "steps at world size 4", logs, agents)
            hosts.kill_host(1)
            _wait(lambda: agents[0].poll() is not None, OP_TIMEOUT + 180, "host 0 to restart and finish", logs)
            assert agents[0].returncode == 0, logs[0].read_text()[-3000:]
        finally:
            for agent in agents:
                if agent.poll() is None:
                    agent.kill()
    final = torch.load(root / "final.pt")
    assert_matches_reference(final["params"], *reference_pair(_elastic_reference, steps))
    worlds = [w for _, w in final["history"]]
    assert worlds[0] == 4 and worlds[-1] == 2, final["history"]
    assert final["samples_seen"] == steps * elastic_job.GLOBAL_BATCH
