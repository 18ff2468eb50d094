"""Live elastic recovery (gpudist.live) under repeated SIGKILLs, against restart mode's recorded numbers.

Starts the membership service here and ``--world`` Gloo worker processes of ``gpudist.testing.live_job`` (the elastic
job's MLP and global batches, DDP state). While they train, SIGKILLs a random member at random moments
(``--kills`` times, never the last two; each once the previous kill's survivors completed a step in a later
generation) and starts a replacement for each at once, which imports torch and then
joins the running job, healing from a peer. ``--back-to-back`` of the kills (2 by default) are followed by a second
one as soon as the survivors complete the next step, during or just after the recovery and the replacement's
admission (that one may leave a single member). Reports per kill: the seconds from the kill to the first step a
survivor completes in the next generation, to the first survivor's failed collective and to the next generation
formed (healed) on every survivor, whether a survivor's collective ran into the op timeout (it waited on a live
peer, not the dead one), the steps redone (an applied step undone) and how the state healed; then the final model of
every finisher against single-process training on the same global batches.

With ``--zero-stage 2 --redundancy buddy`` the state is ZeRO-2-sharded and every shard mirrored on the next rank:
a dead member's shard is rebuilt from its buddy's mirror. That run first measures the buddy's cost without kills:
the same job with and without mirrors, one after the other (median seconds per step, and the bytes each rank holds
for the mirrors against its ZeRO state bytes).

``--gpt-overhead`` measures buddy redundancy on a real model instead, without kills: a GPT of
``benchmarks/workloads.py`` under ZeRO-1 and ZeRO-2, jobs without and with mirrors in interleaved rounds; step time
ratio, ``buddy_bytes`` and the measured resident-set delta per rank.

    python -m benchmarks.live_elastic            # writes benchmarks/results/live_elastic.json
    python -m benchmarks.live_elastic --zero-stage 2 --redundancy buddy \\
        --out benchmarks/results/live_elastic_zero2_buddy.json
    python -m benchmarks.live_elastic --gpt-overhead --gpt-steps 10   # benchmarks/results/live_elastic_gpt_buddy.json
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

from benchmarks import workloads
from gpudist.bench.collectives import environment
from gpudist.live import STORE_ENV, LiveElasticTrainer, Membership, MembershipService
from gpudist.memory import peak_rss_bytes, rss_bytes
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
    pairs = set(range(1, args.kills - 1, max(2, (args.kills - 1) // max(args.back_to_back, 1))))
    pairs = set(sorted(pairs)[: args.back_to_back])  # kills followed by a second one a step later
    follows = None  # the kill the next one follows back to back
    deadline = time.monotonic() + args.limit
    try:
        while len(kills) < args.kills and time.monotonic() < deadline:
            time.sleep(0.02 if follows else rng.uniform(args.gap * 0.5, args.gap * 1.5))
            recs = [r for r in _records(root) if r["event"] == "step"]
            if not recs or recs[-1]["step"] >= args.steps - 20:
                continue
            newest = max(recs, key=lambda r: r["time"])
            if follows and (newest["gen"] <= follows["generation"] or newest["step"] <= follows["step"]):
                continue  # the first kill's survivors have not completed the next step yet
            if not follows and kills and newest["gen"] <= kills[-1]["generation"]:
                continue  # a random kill waits for the last one's recovery (a step in a later generation)
            members = {r["member"]: r for r in recs if r["gen"] == newest["gen"]}
            pids = {r["pid"]: r for r in recs if r["gen"] == newest["gen"] and "pid" in r}
            alive = [p for p in procs if p.poll() is None and p.pid in pids]
            # Keep at least two members after a kill; a back-to-back kill may leave one (its peer was just lost).
            if len(members) < (2 if follows else 3) or len(alive) < (2 if follows else 1):
                continue
            victim = rng.choice(alive)
            at = time.time()
            os.kill(victim.pid, signal.SIGKILL)
            kill = {"pid": victim.pid, "time": at, "generation": newest["gen"], "step": newest["step"]}
            kills.append({**kill, "back_to_back": follows is not None})
            follows = kill if len(kills) - 1 in pairs else None
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
        at = kill["time"]
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
                "back_to_back": kill["back_to_back"],
                "after_previous_kill_s": kill["time"] - kills[k - 1]["time"] if k else None,
                "to_next_step_s": None if first is None else first["time"] - kill["time"],
                "steps_redone": redone,
                "heal": sorted({g["heal"] for g in healed}),
                "world_after": healed[0]["world"] if healed else None,
                "survivor_failed_s": min((g["detected"] for g in healed), default=at) - at if healed else None,
                "generation_formed_s": max(g["formed"] for g in healed) - at if healed else None,
                # where the seconds went, the slowest survivor's: membership decided, group connected, state healed
                **{
                    f"{phase}_s": max(g[phase] for g in healed) - at
                    if healed and all(phase in g for g in healed)
                    else None
                    for phase in ("decided", "connected", "healed")
                },
                "generations_failed_to_form": max((len(g.get("trail", [])) for g in healed), default=0),
                "a_survivor_waited_out_the_op_timeout": any("timed out" in g["reason"] for g in healed),
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


def _gpt_worker(args) -> None:
    """One worker of a no-kill GPT job (``--gpt-worker OUT``): ``--gpt-steps`` steps of the ``--workload`` under
    :class:`LiveElasticTrainer`; writes its step times, buddy bytes, ZeRO state bytes and resident set to OUT."""
    torch.set_num_threads(1)  # the workers share the machine's cores
    membership = Membership.connect(min_size=args.world)
    trainer = LiveElasticTrainer(
        lambda: workloads.make(args.workload),
        lambda params: torch.optim.AdamW(params, lr=1e-4),
        membership,
        Path(args.gpt_worker).parent / "checkpoints",
        10**9,  # no checkpoint inside the timed steps
        zero_stage=args.zero_stage,
        timeout=120.0,
        redundancy=args.redundancy,
    )
    vocab = workloads.GPTConfig(**workloads.WORKLOADS[args.workload]).vocab

    def get_batch(step: int):
        return workloads.batch(args.workload, args.gpt_batch, torch.Generator().manual_seed(step))

    def loss_fn(logits, targets):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), reduction="sum")

    times = []
    while trainer.step_count < args.gpt_steps:
        start = time.perf_counter()
        trainer.train_step(get_batch, loss_fn)
        times.append(time.perf_counter() - start)
    record = {
        "rank": trainer.rank,
        "step_s": times,
        "buddy_bytes": trainer.buddy_bytes,
        "state_bytes": sum(trainer.model.memory_per_rank().values()),
        "rss_end": rss_bytes(),
        "peak_rss": peak_rss_bytes(),
    }
    Path(args.gpt_worker).write_text(json.dumps(record))
    trainer.close()


def _gpt_round(args, zero_stage: int, redundancy: str | None) -> list[dict]:
    """One no-kill job of ``--world`` GPT workers; their records (see :func:`_gpt_worker`)."""
    root = Path(tempfile.mkdtemp(prefix="gpudist-live-gpt-"))
    service = MembershipService()
    env = {**os.environ, STORE_ENV: service.address, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "benchmarks.live_elastic", "--world", str(args.world), "--zero-stage", str(zero_stage)]
    cmd += ["--workload", args.workload, "--gpt-steps", str(args.gpt_steps), "--gpt-batch", str(args.gpt_batch)]
    cmd += ["--redundancy", redundancy] if redundancy else []
    procs = [
        subprocess.Popen([*cmd, "--gpt-worker", str(root / f"w{i}.json")], env=env, cwd=ROOT) for i in range(args.world)
    ]
    for p in procs:
        if p.wait(args.limit) != 0:
            raise RuntimeError(f"a GPT worker exited with {p.returncode}; see its output above")
    return sorted((json.loads(f.read_text()) for f in root.glob("w*.json")), key=lambda r: r["rank"])


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def gpt_overhead(args) -> dict:
    """Buddy redundancy's cost on a GPT: for ZeRO-1 and ZeRO-2, no-kill jobs without and with mirrors in interleaved
    rounds (without, with, without, with, ...: drift in the machine's load hits both alike). Per variant: the median
    step time over every round's steps after the first ``--gpt-warmup`` of each rank, the bytes each rank holds for
    the mirrors (``buddy_bytes``) against its ZeRO state, and the resident set (end of the job, and peak) with minus
    without, per rank, median over rounds."""
    stages = {}
    for stage in (1, 2):
        runs: dict[str, list[list[dict]]] = {"without": [], "with": []}
        for _ in range(args.gpt_rounds):
            runs["without"].append(_gpt_round(args, stage, None))
            runs["with"].append(_gpt_round(args, stage, "buddy"))
        step = {
            k: _median([t for rnd in v for r in rnd for t in r["step_s"][args.gpt_warmup :]]) for k, v in runs.items()
        }
        rss = {}
        for field in ("rss_end", "peak_rss"):
            rss[field] = [
                _median([rnd[rank][field] for rnd in runs["with"]])
                - _median([rnd[rank][field] for rnd in runs["without"]])
                for rank in range(args.world)
            ]
        last = runs["with"][-1]
        stages[f"zero{stage}"] = {
            "step_s_median_without": step["without"],
            "step_s_median_with": step["with"],
            "step_time_ratio": step["with"] / step["without"],
            "step_s_per_round": {
                k: [_median([t for r in rnd for t in r["step_s"][args.gpt_warmup :]]) for rnd in v]
                for k, v in runs.items()
            },
            "buddy_bytes_per_rank": [r["buddy_bytes"] for r in last],
            "zero_state_bytes_per_rank": [r["state_bytes"] for r in last],
            "buddy_to_state_ratio_max": max(r["buddy_bytes"] / r["state_bytes"] for r in last),
            "rss_end_delta_bytes_per_rank": rss["rss_end"],
            "peak_rss_delta_bytes_per_rank": rss["peak_rss"],
        }
    model = workloads.make(args.workload)
    return {
        "benchmark": "live_elastic_gpt_buddy_overhead",
        "environment": environment(),
        "settings": {
            "world": args.world,
            "workload": args.workload,
            "model": workloads.describe(model),
            "global_batch": args.gpt_batch,
            "seq": workloads.GPTConfig(**workloads.WORKLOADS[args.workload]).seq,
            "steps_per_round": args.gpt_steps,
            "warmup_steps_dropped": args.gpt_warmup,
            "rounds": args.gpt_rounds,
            "optimizer": "AdamW",
            "threads_per_worker": 1,
            "load_average_before": os.getloadavg(),
        },
        **stages,
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
    parser.add_argument("--back-to-back", type=int, default=2, help="kills followed by another one step later (pairs)")
    parser.add_argument("--gap", type=float, default=4.0, help="mean seconds between kills")
    parser.add_argument("--every", type=int, default=50, help="checkpoint every N steps")
    parser.add_argument("--timeout", type=float, default=10.0, help="collective timeout, seconds")
    parser.add_argument("--failure-timeout", type=float, default=1.0, help="heartbeat silence that means dead")
    parser.add_argument("--limit", type=float, default=400.0, help="seconds before giving up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--zero-stage", type=int, default=0, help="0 (DDP), 1, 2 or 3")
    parser.add_argument("--redundancy", default=None, choices=["buddy"], help="buddy mirrors (ZeRO only)")
    parser.add_argument("--overhead-steps", type=int, default=300, help="steps of each no-kill cost run")
    parser.add_argument("--gpt-overhead", action="store_true", help="buddy cost on a GPT (no kills) instead")
    parser.add_argument("--workload", default="gpt", help="benchmarks/workloads.py model of --gpt-overhead")
    parser.add_argument("--gpt-steps", type=int, default=12, help="steps of each --gpt-overhead job")
    parser.add_argument("--gpt-warmup", type=int, default=3, help="first steps of each job not timed")
    parser.add_argument("--gpt-batch", type=int, default=6, help="global batch (sequences) of --gpt-overhead")
    parser.add_argument("--gpt-rounds", type=int, default=2, help="interleaved rounds of each variant")
    parser.add_argument("--gpt-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/live_elastic[_gpt_buddy].json")
    args = parser.parse_args()
    if args.gpt_worker:
        return _gpt_worker(args)
    result = gpt_overhead(args) if args.gpt_overhead else run(args)
    out = args.out or RESULTS / ("live_elastic_gpt_buddy.json" if args.gpt_overhead else "live_elastic.json")
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=2))


if __name__ == "__main__":
    main()
