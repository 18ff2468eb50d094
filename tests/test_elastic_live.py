"""Live elastic training (gpudist.live): survivors retrain the failed step in-process, newcomers heal from peers.

Most cases run the workers as threads over in-memory groups, with a real membership service (a TCPStore server in
this process, one client per worker): a "death" raises out of the worker at the chosen point, aborts its group (as a
killed process's TCP connections reset) and stops its heartbeat. One case runs Gloo processes and SIGKILLs one.

Every final model is compared with single-process training on the same global batches (the elastic job's), within a
multiple of the float32 reference's own distance from the float64 one (tests/tolerances.py): live training splits
each global batch over however many members there are, which changes only the summation order. Members that finish
together must hold bit-identical parameters (replicated state).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from gpudist.live import STORE_ENV, Membership, MembershipService, newest_covered
from gpudist.testing import elastic_job
from gpudist.testing.live_job import TINY_BUCKETS, Faults, FaultyTrainer

from .helpers_elastic import reference
from .tolerances import assert_matches_reference

pytestmark = pytest.mark.faults

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 120.0
"""Seconds a thread-run case may take in all before it counts as hung (normally a few)."""


class Death(BaseException):
    """A simulated kill: not an Exception, so nothing in the trainer catches it."""


class OutputFaults(Faults):
    """:class:`Faults` whose ``backward`` point is reached when the first layer's output gradient is computed (the
    later layers' gradients are in flight then, as with the weight hook): ZeRO-3 replaces the module's parameters by
    its shards, so a hook on the first layer's weight never fires there."""

    def build_module(self):
        module = super().build_module()
        if self.where == "backward":

            def watch(layer, inputs, output) -> None:  # returning anything would replace the output
                output.register_hook(lambda grad: self.at("backward"))

            module[0].register_forward_hook(watch)
        return module


@functools.cache
def _refs(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    return reference(steps, torch.float32), reference(steps, torch.float64)


def _run(
    tmp_path,
    job: str,
    plans: list,
    steps: int,
    *,
    zero_stage=0,
    every=100,
    newcomer_after=None,
    hold=None,
    redundancy=None,
    together=False,
    backend="inmemory",
    timeout=LIMIT,
):
    """Run ``len(plans)`` workers (threads; ``plans[i] = (step, where)`` to die there, or None) and, once generation
    ``newcomer_after`` is decided and a member has reached step ``hold``, one newcomer; the first members wait at
    step ``hold`` until it has asked to join (so it is admitted at step ``hold + 1`` however fast the steps are).
    ``together``: the members that die wait for each other at their fault point first (so all die in one
    generation). ``backend="nccl"`` runs the groups on the simulated NCCL (install it around the call): a killed
    worker's communicators are aborted locally, so its peers learn of the death only at their op ``timeout``, as on
    GPUs. Return {worker: (final parameters, events)} for those that finished."""
    service = MembershipService()
    first = len(plans)
    results: dict[str, object] = {}
    errors: dict[str, str] = {}
    doomed = threading.Barrier(sum(p is not None for p in plans), timeout=LIMIT) if together else None

    def worker(name: str, plan, after: int | None = None) -> None:
        step, where = plan or (None, None)
        groups = []  # every group this worker formed: a "killed" thread aborts them all, as a killed process would

        class Recording(FaultyTrainer):
            def _group(self, g):
                groups.append(super()._group(g))
                return groups[-1]

            def _form(self, g):
                heal = super()._form(g)
                # ZeRO's fused update never calls the torch optimizer's step, whose pre-hook Faults uses: hook the
                # data-parallel optimizer's own step (before its gradient-norm all-reduce) as well.
                self.optimizer.inner.register_step_pre_hook(lambda *_: faults.at("optimizer"))
                return heal

        def kill():
            if doomed is not None:
                doomed.wait()
            raise Death

        faults = OutputFaults(step, where, kill)
        membership = Membership.connect(
            service.address, job=job, min_size=first, failure_timeout=1.0, join_timeout=LIMIT
        )
        try:
            _wait(lambda: after is None or membership.store.check([f"gen/{after}", f"held/{hold}"]))
            trainer = Recording(
                faults.build_module,
                faults.build_optimizer,
                membership,
                tmp_path / "checkpoints",
                every,
                zero_stage=zero_stage,
                backend=backend,
                timeout=timeout,
                config_options=TINY_BUCKETS,
                redundancy=redundancy,
                faults=faults,
            )
            faults.trainer, faults.forming = trainer, True
            while trainer.step_count < steps:
                if trainer.step_count == hold:
                    membership.store.set(f"held/{hold}", "1")
                    _wait(lambda: membership.store.add("joins", 0) > first)
                trainer.train_step(elastic_job.batch, faults.loss)
            trainer.finish()
            flat = trainer.model.gather_full_parameters()  # ZeRO-3: collective over the last generation
            results[name] = (flat, trainer.events)
        except Death:
            for comm in groups:
                comm.abort() if backend == "nccl" else comm.abort(f"{name} was killed")
        except BaseException as e:  # reported below
            errors[name] = f"{type(e).__name__}: {e}"
        finally:
            membership.close()

    threads = [threading.Thread(target=worker, args=(f"w{i}", p), daemon=True) for i, p in enumerate(plans)]
    if newcomer_after is not None:
        threads.append(threading.Thread(target=worker, args=("newcomer", None, newcomer_after), daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(LIMIT)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    assert not errors, errors
    return results


def _wait(condition) -> None:
    """Poll ``condition`` until true, at most ``LIMIT`` seconds."""
    pause = threading.Event()
    for _ in range(int(LIMIT / 0.02)):
        if condition():
            return
        pause.wait(0.02)
    raise TimeoutError("condition not met")


def _check(results: dict, steps: int, expect_finishers: set[str]) -> None:
    assert set(results) == expect_finishers
    finals = [flat for flat, _ in results.values()]
    ref32, ref64 = _refs(steps)
    for flat in finals:
        assert_matches_reference(flat, ref32, ref64, what="live-trained parameters")
        assert torch.equal(flat, finals[0]), "members that finished together differ"
    for _, events in results.values():  # no applied step is ever undone, and none applied twice
        for e in events:
            if e["step_before"] is not None and e["heal"] != "disk":
                assert e["step"] >= e["step_before"], e


def test_deaths_in_forward_backward_and_optimizer_step_are_survived(tmp_path):
    """Catches a survivor that does not retry the failed step at the new world size (or retries it with the lost
    rank's share missing, or applies it twice): three members die one after another (forward of step 2; backward
    of step 4, while the later layers' gradient buckets are being all-reduced; inside the optimizer step of step 6),
    and the last survivor must end where single-process training on every global batch ends."""
    results = _run(tmp_path, "fbo", [None, (6, "optimizer"), (4, "backward"), (2, "forward")], steps=8)
    _check(results, 8, {"w0"})
    events = results["w0"][1]
    assert [e["world"] for e in events] == [4, 3, 2, 1]
    assert all(e["heal"] == "local" for e in events[1:]), events  # the survivor's own state; nothing redone


def test_two_deaths_in_a_row_one_during_the_heal_then_a_newcomer_heals_from_the_survivor(tmp_path):
    """Catches a reconfiguration that cannot survive a second failure while it forms the next generation (w1 dies
    inside the heal that follows w2's death), and a newcomer that does not receive the survivor's parameters and
    optimizer state (its final model would then differ from the survivor's and from the reference)."""
    results = _run(
        tmp_path,
        "heal",
        [None, (3, "heal"), (3, "backward")],
        steps=9,
        newcomer_after=3,
        hold=6,
    )
    _check(results, 9, {"w0", "newcomer"})
    survivor, newcomer = results["w0"][1], results["newcomer"][1]
    assert [(e["generation"], e["world"]) for e in survivor[:2]] == [(1, 3), (3, 1)]  # generation 2 never formed
    assert newcomer[0]["heal"] == "peer" and newcomer[0]["world"] == 2


def test_a_death_while_a_newcomer_is_admitted_is_detected_by_heartbeat(tmp_path):
    """Catches a group connect that waits for a dead member: w2 dies after the generation admitting a newcomer was
    decided, before it joins that generation's group. The others must give up on the connect once its heartbeat
    stops (one ``failure_timeout``), not wait out the connect or op timeout (here LIMIT: "a worker hung"), and form
    the next generation, where the newcomer heals from a survivor; the failure is recorded as one."""
    results = _run(tmp_path, "admit", [None, None, (4, "admission")], steps=6, newcomer_after=1, hold=3)
    _check(results, 6, {"w0", "w1", "newcomer"})
    failed = results["w0"][1][1]
    assert failed["reason"].startswith("failure while forming generation 2"), failed
    assert "died while generation 2's group connected" in failed["reason"], failed  # the heartbeat, not a timeout
    assert failed["world"] == 3 and failed["lost"] and failed["step"] == failed["completed_before"] == 4, failed
    assert results["newcomer"][1][0]["heal"] == "peer"


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_zero_falls_back_to_the_checkpoint_when_a_shard_is_lost_and_reshards_live_on_a_join(tmp_path, zero_stage):
    """Catches ZeRO state handled as if it were replicated: when a member dies (in backward: ZeRO-3's parameter
    gathers and gradient reduce-scatters in flight) its shard is gone, so the survivors must reload the newest
    checkpoint (redoing the steps since it, in-process), and when a newcomer joins with nobody lost, the shards
    (ZeRO-3: the parameters' too) must be resharded live over the new group, the joiner ending equal to the
    survivors (heal "peers"); a lost or misplaced shard moves the final model far from the reference."""
    results = _run(
        tmp_path,
        f"zero{zero_stage}",
        [None, None, (5, "backward")],
        steps=9,
        zero_stage=zero_stage,
        every=2,
        newcomer_after=2,
        hold=6,
    )
    _check(results, 9, {"w0", "w1", "newcomer"})
    heals = [e["heal"] for e in results["w0"][1]]
    assert heals[:3] == ["initial", "disk", "peers"], results["w0"][1]
    fallback = results["w0"][1][1]
    # Step 4's checkpoint was committed by the optimizer step that made step 5: one step is redone.
    assert fallback["step_before"] == 5 and fallback["step"] == 4


@pytest.mark.slow  # ~18 s of real processes: the slow tier (CI runs it; benchmarks/live_elastic.py kills 10 more)
def test_gloo_processes_survive_a_sigkill_and_a_replacement_heals_over_gloo(tmp_path):
    """Catches what in-memory groups cannot show: a worker process SIGKILLed during backward's all-reduces (its Gloo
    connections reset; some survivors may have completed the collective, others not), survivors that must form a
    new Gloo group in the same processes, and a replacement process whose state arrives by a Gloo broadcast. Every
    process is bounded by a timeout."""
    service = MembershipService()
    env = {**os.environ, STORE_ENV: service.address, "PYTHONPATH": str(ROOT)}
    steps, go = 12, tmp_path / "go"
    cmd = [sys.executable, "-m", "gpudist.testing.live_job", "--dir", str(tmp_path), "--steps", str(steps)]
    cmd += ["--min-size", "3", "--hold", "8:4"]  # at step 8 the survivors wait for the replacement to ask
    procs = [subprocess.Popen(cmd, env=env, cwd=ROOT) for _ in range(2)]
    victim = subprocess.Popen([*cmd, "--die", "4:backward"], env=env, cwd=ROOT)
    replacement = subprocess.Popen([*cmd, "--wait-for", str(go)], env=env, cwd=ROOT)  # imports torch meanwhile
    try:
        assert victim.wait(LIMIT) == -9
        go.touch()
        for p in [*procs, replacement]:
            assert p.wait(LIMIT) == 0
    finally:
        for p in [*procs, victim, replacement]:
            if p.poll() is None:
                p.kill()
    finals = [torch.load(f) for f in sorted(tmp_path.glob("final-*.pt"))]
    results = {str(r["id"]): (r["params"], r["events"]) for r in finals}
    _check(results, steps, set(results))
    assert len(results) == 3
    # The replacement may be admitted by the same generation that drops the victim, or by the next one.
    assert any(e["reason"].startswith("failure") and e["lost"] for _, ev in results.values() for e in ev)
    assert any(e["heal"] == "peer" for _, ev in results.values() for e in ev)


@pytest.mark.parametrize(
    "zero_stage", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)]
)
def test_buddy_mirrors_rebuild_a_dead_members_zero_shard_without_redoing_a_step(tmp_path, zero_stage):
    """Catches a buddy mirror that is missing, stale or loaded into the wrong ranges: two members die one after the
    other (backward of step 3, while ZeRO-2/3's reduce-scatters are in flight; forward of step 6), each time the
    survivors must rebuild the dead member's optimizer shard (ZeRO-3: and parameter shard) from its buddy's mirror (heal
    "buddy", no checkpoint exists) at the step they had reached (0 steps redone) and end where single-process training
    ends."""
    results = _run(
        tmp_path,
        f"buddy{zero_stage}",
        [None, (3, "backward"), (6, "forward")],
        steps=9,
        zero_stage=zero_stage,
        redundancy="buddy",
    )
    _check(results, 9, {"w0"})
    events = results["w0"][1]
    assert [(e["world"], e["heal"]) for e in events] == [(3, "initial"), (2, "buddy"), (1, "buddy")], events
    assert [e["step"] - e["completed_before"] for e in events[1:]] == [0, 0], events  # nothing redone
    assert [e["step"] for e in events[1:]] == [3, 6]


def test_zero3_buddy_rebuilds_a_member_that_died_inside_the_optimizer_step(tmp_path):
    """Catches a ZeRO-3 death inside the optimizer step (the survivors wait in its gradient-norm all-reduce) that is
    not survived, or not rebuilt from the mirrors: the survivors must rebuild the dead member's parameter and
    optimizer shards from its buddy's mirror at the step they had completed (0 steps redone), retry the failed step
    at two ranks and end where single-process training ends."""
    results = _run(tmp_path, "buddy3-step", [None, None, (4, "optimizer")], steps=6, zero_stage=3, redundancy="buddy")
    _check(results, 6, {"w0", "w1"})
    events = results["w0"][1]
    assert [(e["world"], e["heal"]) for e in events] == [(3, "initial"), (2, "buddy")], events
    assert events[1]["step"] == events[1]["completed_before"] == 4, events


def test_buddy_falls_back_to_the_checkpoint_when_a_member_dies_with_its_buddy(tmp_path):
    """Catches a heal that trusts mirrors which do not cover the state: in a ring of three every two members are
    buddies, so when two die at once one shard (its only mirror was on the other dead member) is nowhere; the
    survivor must say so and load the newest checkpoint (steps since it redone), not train on a partial state."""
    results = _run(
        tmp_path,
        "buddy-pair",
        [None, (5, "forward"), (5, "forward")],
        steps=8,
        zero_stage=2,
        every=2,
        redundancy="buddy",
        together=True,
    )
    _check(results, 8, {"w0"})
    fallback = results["w0"][1][1]
    assert fallback["heal"] == "disk" and fallback["world"] == 1, fallback
    assert "both members of a buddy pair were lost" in fallback["detail"], fallback
    assert fallback["step"] < fallback["completed_before"] == 5, fallback


def test_newest_covered_picks_the_newest_step_every_shard_is_held_at():
    """Catches a rebuild at a step some shard is missing at: generation 4 had members 7, 8, 9 (buddy of 7 is 8, of 8
    is 9, of 9 is 7). Member 8 died after finishing step 12 but before its mirror of step 12 reached 9: the
    survivors hold their own shards at 11 and 12 and 9 holds 8's at 11 only, so 11 is the newest whole step (and
    newcomers, holding nothing, change nothing). With 8 and 9 both gone, 9's shard is nowhere: None."""

    def report(member, own, mirror, layout=4):
        return {"layout": layout, "members": [7, 8, 9], "id": member, "own": own, "mirror": mirror}

    newcomer = {"layout": None, "members": [], "id": 10, "own": [], "mirror": []}
    assert newest_covered([report(7, [11, 12], [11, 12]), report(9, [11, 12], [11]), newcomer]) == (11, 4)
    assert newest_covered([report(7, [11, 12], [11, 12]), report(9, [11, 12], [11, 12])]) == (12, 4)
    assert newest_covered([report(7, [11, 12], [11, 12])]) is None
    assert newest_covered([newcomer]) is None


@pytest.mark.parametrize(
    ("zero_stage", "redundancy", "where"), [(0, None, "backward"), (2, "buddy", "optimizer"), (3, "buddy", "optimizer")]
)
def test_nccl_survivors_abort_and_rebuild_the_communicator(tmp_path, zero_stage, redundancy, where):
    """The same protocol on the simulated NCCL (GPU-like async runtime): a member dies in backward with buckets in
    flight; NCCL tells nobody, so the survivors' ops hang until the trainer's heartbeat watch aborts the
    communicator (its heartbeat stopped: 1 s here, well before the 20 s op timeout); each generation forms a new
    communicator from a fresh unique id. Catches a trainer that cannot leave a hung NCCL group (a worker would hang:
    "a worker hung"), that waits for the op timeout, that reuses the old communicator or id, or that moves the
    healed state or the batch share off the backend's device; the survivors must end where single-process training
    ends, 0 steps redone: DDP heals locally; ZeRO-2/3 with buddy mirrors rebuild the dead member's shard from the
    mirror exchanged in one grouped send/receive per step (a receive posted a step ahead, as on Gloo, would stall
    the stream: the variant hung before). ZeRO's member dies in the optimizer step: this simulator runs a stream's
    ops only once its host waits, so a member killed in backward never sent its last frame (one step redone, as the
    trainer documents for a frame that did not arrive); a GPU sends it during that forward."""
    from .fakenccl import AsyncRuntime, FakeNccl, installed

    with installed(FakeNccl(timeout=LIMIT), AsyncRuntime):
        results = _run(
            tmp_path,
            f"nccl{zero_stage}",
            [None, None, (3, where)],
            steps=6,
            zero_stage=zero_stage,
            redundancy=redundancy,
            backend="nccl",
            timeout=20.0,
        )
    _check(results, 6, {"w0", "w1"})
    failed = results["w0"][1][1]
    assert failed["world"] == 2 and "stopped heartbeating" in failed["reason"], failed
    assert failed["heal"] == ("buddy" if redundancy else "local"), failed
    assert failed["step"] == failed["completed_before"] == 3, failed
