"""Live elastic recovery (gpudist.live) under repeated SIGKILLs, against restart mode's recorded numbers.

Starts the membership service here and ``--world`` Gloo worker processes of ``gpudist.testing.live_job`` (the elastic
job's MLP and global batches, DDP state). While they train, SIGKILLs a random member at random moments
(``--kills`` times, never the last two) and starts a replacement for each at once, which imports torch and then
joins the running job, healing from a peer. Reports per kill: the seconds from the kill to the first step a
survivor completes in the next generation, the steps redone (an applied step undone) and how the state healed;
then the final model of every finisher against single-process training on the same global batches.

With ``--zero-stage 2 --redundancy buddy`` the state is ZeRO-2-sharded and every shard mirrored on the next rank:
a dead member's shard is rebuilt from its buddy's mirror. That run first measures the buddy's cost without kills:
the same job with and without mirrors, one after the other (median seconds per step, and the bytes each rank holds
for the mirrors against its ZeRO state bytes).

    python -m benchmarks.live_elastic            # writes benchmarks/results/live_elastic.json
    python -m benchmarks.live_elastic --zero-stage 2 --redundancy buddy \\
        --out benchmarks/results/live_elastic_zero2_buddy.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gpudist.bench.collectives import environment
from gpudist.live import STORE_ENV, MembershipService
from gpudist.testing import elastic_job

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _records(root: Path) -> list[dict]:
    out = []
    for f in root.glob("worker-*.jsonl"):
        member = int(f.stem.split("-")[1])
        for line in f.read_text().splitlines():
            if line.endswith("}"):
                out.append({"member": member, **json.loads(line)})
    return out


def _last_steps(root: Path, procs: list[subprocess.Popen]) -> list[dict]:
    """The newest step record of every worker process still running (those that have trained at all)."""
    running = {p.pid for p in procs if p.poll() is None}
    newest: dict[int, dict] = {}
    for r in _records(root):
        if r["event"] == "step" and r["pid"] in running:
            newest[r["pid"]] = r
    return list(newest.values())


def run(args) -> dict:
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="gpudist-live-bench-"))
    service = MembershipService()
    env = {**os.environ, STORE_ENV: service.address, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "gpudist.testing.live_job", "--dir", str(root), "--steps", str(args.steps)]
    cmd += ["--min-size", str(args.world), "--sleep", str(args.sleep), "--every", str(args.every)]
    cmd += ["--timeout", str(args.timeout), "--failure-timeout", str(args.failure_timeout)]
    cmd += ["--zero-stage", str(args.zero_stage)] + (["--redundancy", args.redundancy] if args.redundancy else [])
    logs = [open(root / f"proc-{i}.log", "w") for i in range(args.world + args.kills)]  # noqa: SIM115
    procs = [
        subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=logs[i], stderr=subprocess.STDOUT) for i in range(args.world)
    ]
    kills = []
    deadline = time.monotonic() + args.limit
    try:
        while len(kills) < args.kills and time.monotonic() < deadline:
            time.sleep(rng.uniform(args.gap * 0.5, args.gap * 1.5))
            recs = [r for r in _records(root) if r["event"] == "step"]
            if not recs or recs[-1]["step"] >= args.steps - 20:
                continue
            newest = max(recs, key=lambda r: r["time"])
            members = {r["member"]: r for r in recs if r["gen"] == newest["gen"]}
            pids = {r["pid"]: r for r in recs if r["gen"] == newest["gen"] and "pid" in r}
            alive = [p for p in procs if p.poll() is None and p.pid in pids]
            if len(members) < 3 or not alive:  # keep at least two members after the kill
                continue
            victim = rng.choice(alive)
            at = time.time()
            os.kill(victim.pid, signal.SIGKILL)
            kills.append({"pid": victim.pid, "time": at, "generation": newest["gen"], "step": newest["step"]})
            i = len(procs)
            procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=logs[i], stderr=subprocess.STDOUT))
        # A replacement started near the end may still wait to be admitted when the others finish: stop it then.
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            done = list(root.glob("final-*.pt"))
            if done and not any(r["event"] == "step" and r["step"] < args.steps for r in _last_steps(root, procs)):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    recs = _records(root)
    steps = [r for r in recs if r["event"] == "step"]
    gens = [r for r in recs if r["event"] == "generation"]
    report = []
    for k, kill in enumerate(kills):
        after = [
            r for r in steps if r["time"] > kill["time"] and r["gen"] > kill["generation"] and r["pid"] != kill["pid"]
        ]
        first = min(after, key=lambda r: r["time"]) if after else None
        healed = [g for g in gens if g["reason"].startswith("failure") and g["detected"] > kill["time"]]
        healed = [g for g in healed if g["generation"] == min(h["generation"] for h in healed)] if healed else []
        redone = max((g["completed_before"] - g["step"] for g in healed), default=None)
        report.append(
            {
                "kill": k,
                "at_step": kill["step"],
                "to_next_step_s": None if first is None else first["time"] - kill["time"],
                "steps_redone": redone,
                "heal": sorted({g["heal"] for g in healed}),
                "world_after": healed[0]["world"] if healed else None,
            }
        )
    finals = [torch.load(f) for f in sorted(root.glob("final-*.pt"))]
    ref = elastic_job.reference(args.steps)
    ref64 = _reference64(args.steps)
    diffs = [float((f["params"] - ref).abs().max()) for f in finals]
    times = sorted(r["to_next_step_s"] for r in report if r["to_next_step_s"] is not None)
    restart = json.loads((RESULTS / "async_elastic.json").read_text())["recovery"]
    return {
        "benchmark": "live_elastic",
        "environment": environment(),
        "settings": {
            "world": args.world,
            "steps": args.steps,
            "step_sleep_s": args.sleep,
            "op_timeout_s": args.timeout,
            "failure_timeout_s": args.failure_timeout,
            "heartbeat_interval_s": 0.1,
            "checkpoint_every": args.every,
            "global_batch": elastic_job.GLOBAL_BATCH,
            "state": "DDP (replicated), AdamW"
            if not args.zero_stage
            else f"ZeRO-{args.zero_stage}, AdamW, redundancy={args.redundancy}",
        },
        "overhead": _overhead(args) if args.redundancy else None,
        "kills": report,
        "to_next_step_s_median": times[len(times) // 2] if times else None,
        "to_next_step_s_max": times[-1] if times else None,
        "steps_redone_total": sum(r["steps_redone"] or 0 for r in report),
        "finishers": len(finals),
        "finishers_identical": all(torch.equal(f["params"], finals[0]["params"]) for f in finals),
        "final_max_abs_diff_vs_single_process_fp32": max(diffs) if diffs else None,
        "single_process_fp32_vs_fp64_max_abs_diff": float((ref.double() - ref64).abs().max()),
        "restart_mode_recorded": {
            "source": "benchmarks/results/async_elastic.json (recovery)",
            "recovery_s_median": restart.get("recovery_s_median"),
            "steps_redone": [k["steps_redone"] for k in restart.get("kills", [])],
        },
    }


def _job(args, redundancy: str | None, steps: int) -> tuple[float, list[dict]]:
    """Run the job without kills; return the median seconds per step (every worker's step records after the first
    10 steps) and the workers' final records."""
    root = Path(tempfile.mkdtemp(prefix="gpudist-live-cost-"))
    service = MembershipService()
    env = {**os.environ, STORE_ENV: service.address, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "gpudist.testing.live_job", "--dir", str(root), "--steps", str(steps)]
    cmd += ["--min-size", str(args.world), "--zero-stage", str(args.zero_stage), "--timeout", str(args.timeout)]
    cmd += ["--redundancy", redundancy] if redundancy else []
    procs = [subprocess.Popen(cmd, env=env, cwd=ROOT) for _ in range(args.world)]
    for p in procs:
        p.wait(args.limit)
    per_step = []
    for pid in {r["pid"] for r in _records(root) if r["event"] == "step"}:
        times = [r["time"] for r in _records(root) if r["event"] == "step" and r["pid"] == pid][10:]
        per_step += [b - a for a, b in itertools.pairwise(times)]
    per_step.sort()
    return per_step[len(per_step) // 2], [torch.load(f) for f in sorted(root.glob("final-*.pt"))]


def _overhead(args) -> dict:
    """The buddy's cost without kills: the same job with and without mirrors, one after the other."""
    steps = args.overhead_steps
    plain, _ = _job(args, None, steps)
    buddy, finals = _job(args, args.redundancy, steps)
    return {
        "steps": steps,
        "step_s_median_without": plain,
        "step_s_median_with": buddy,
        "step_time_ratio": buddy / plain,
        "buddy_bytes_per_rank": [f["buddy_bytes"] for f in finals],
        "zero_state_bytes_per_rank": [f["state_bytes"] for f in finals],
        "buddy_to_state_ratio_max": max(f["buddy_bytes"] / f["state_bytes"] for f in finals),
        "note": "no simulated compute (step_sleep 0), tiny MLP: the per-step snapshot cost is not hidden by any work",
    }


def _reference64(steps: int) -> torch.Tensor:
    model = elastic_job.build_model().double()
    opt = elastic_job.make_optimizer(model.parameters())
    for step in range(steps):
        x, y = (t.double() for t in elastic_job.batch(step))
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--sleep", type=float, default=0.02, help="simulated compute per step, seconds")
    parser.add_argument("--gap", type=float, default=4.0, help="mean seconds between kills")
    parser.add_argument("--every", type=int, default=50, help="checkpoint every N steps")
    parser.add_argument("--timeout", type=float, default=10.0, help="collective timeout, seconds")
    parser.add_argument("--failure-timeout", type=float, default=1.0, help="heartbeat silence that means dead")
    parser.add_argument("--limit", type=float, default=400.0, help="seconds before giving up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--zero-stage", type=int, default=0, help="0 (DDP), 1 or 2")
    parser.add_argument("--redundancy", default=None, choices=["buddy"], help="buddy mirrors (ZeRO only)")
    parser.add_argument("--overhead-steps", type=int, default=300, help="steps of each no-kill cost run")
    parser.add_argument("--out", default=str(RESULTS / "live_elastic.json"))
    args = parser.parse_args()
    result = run(args)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=2))


if __name__ == "__main__":
    main()
