"""The tables ``gpudist bench gpu`` prints: one summary line and one table per part."""

from __future__ import annotations

from collections.abc import Callable

from .common import GOOD_FRACTION, TEST_PARTS
from .steps import PHASES

# -- tables -----------------------------------------------------------------------------------------------------------


def _safely(render: Callable[..., str], *args) -> str:
    """``render(*args)``, or why it could not draw its table: printing must never cost the numbers (the JSON has
    them all)."""
    try:
        return render(*args)
    except Exception as e:
        return f"(table not printed: {type(e).__name__}: {e}; the numbers are in the JSON)"


def _part_summary(name: str, r: dict) -> str:
    if r["status"] == "skipped":
        return r["reason"]
    if r["status"] == "error":
        return "ERROR: " + (r["error"].strip().splitlines() or [""])[-1][:100]
    if name in TEST_PARTS:
        stopped = "; stopped at its time limit" if r.get("timed_out") else ""
        return f"{r['passed']} passed, {r['failed']} failed, {r['errors']} errors, {r['skipped']} skipped{stopped}"
    if name == "gate":
        ratios = r["ratios"].values()
        verdict = ("passed" if r["passed"] else "FAILED") if r["gated"] else f"no baseline for {r['device_kind']}"
        return f"{len(r['ratios'])} cases, gpudist/peer {min(ratios):.2f}-{max(ratios):.2f}; gate {verdict}"
    if name == "kernels":
        good = [row for row in r["rows"] if row.get("good") is not None]
        errs = sum("error" in row for row in r["rows"])
        copy = ", ".join(f"{v:.0f}" if v is not None else "failed" for v in r["copy_GBps"].values())
        return (
            f"{len(r['rows'])} rows; copy {copy} GB/s; memory-bound >= {GOOD_FRACTION} of copy: "
            f"{sum(row['good'] for row in good)}/{len(good)}" + (f"; {errs} errors" if errs else "")
        )
    done = [row for row in r.get("rows", ()) if "error" not in row]
    errs = f"; {len(r['rows']) - len(done)} rows failed" if len(done) < len(r.get("rows", ())) else ""
    if name == "collectives":
        big = [row for row in done if row["bytes"] == max(x["bytes"] for x in done)]
        return (
            f"world {r['world_size']}, NCCL {r['nccl']}; largest size: "
            + ", ".join(
                f"{row['op']} "
                + (
                    f"{row['gpudist_us']:.1f} us"
                    if r["world_size"] == 1
                    else f"busbw {row['gpudist_busbw_GBps']:.1f} GB/s"
                )
                + f" (raw/ours {row['raw_over_gpudist']:.2f})"
                for row in big
            )
            + errs
        )
    if name == "profile":
        return "GPU busy share: " + ", ".join(
            f"{k} {v['gpu_busy_share']:.2f}" for k, v in r["variants"].items() if v["gpu_busy_share"] is not None
        )
    if name == "host":
        us = {k: v["median"] for k, v in r["us_per_call"].items()}
        pairs = [
            ("all_reduce_planned", "all_reduce_raw_handed_off"),
            ("pack_300_plan", "pack_300_torch_cat_mul"),
            ("adam_step_plan", "adam_step_torch_fused_adamw"),
        ]
        return "host us per call, gpudist plan / peer: " + ", ".join(
            f"{a} {us[a]:.1f} / {us[b]:.1f}" for a, b in pairs if a in us and b in us
        )
    if name in ("capture", "capture-torch"):
        return (
            "peer time / gpudist time: "
            + "; ".join(
                f"{row['workload']}: "
                + ", ".join(f"{k} {v:.2f}" for k, v in row["peer_over_gpudist"].items())
                + " (replay host share "
                + ", ".join(f"{k} {v:.3f}" for k, v in row["replay_host_share"].items())
                + f"; losses differ by {row['loss_max_abs_diff']:.1e})"
                for row in r["rows"]
                if "peer_over_gpudist" in row
            )
            + "".join(
                "; torch's graphs / gpudist graphed: "
                + ", ".join(f"{k} {v:.2f}" for k, v in row["over_gpudist_graphed"].items())
                + "".join(f", {k} failed" for k in row["errors"])
                for row in r["rows"]
                if "over_gpudist_graphed" in row
            )
            + errs
        )
    if name == "strategies":
        ratios = "; ".join(
            f"{row['workload']}: " + ", ".join(f"{k} {v:.2f}" for k, v in row["peer_over_gpudist"].items())
            for row in done
        )
        return f"world {r['world_size']}; peer time / gpudist time: {ratios}{errs}"
    return "ok"


def _part_table(name: str, r: dict) -> str:
    """The detail table of one finished part."""
    if r["status"] != "ok":
        return f"# {name}: {r['status']}\n{r.get('error') or r.get('reason')}"
    lines = [f"# {name}: {_part_summary(name, r)} ({r['seconds']:.0f}s)"]
    if name in TEST_PARTS:
        lines += [f"  FAILED {t}" for t in r["failed_tests"]]
    elif name == "gate":
        lines += [f"  {ratio:6.2f}  {key}" for key, ratio in r["ratios"].items()]
    elif name == "kernels":
        lines.append(f"{'op':>28} {'elements':>10} {'us':>9} {'GB/s':>8} {'of copy':>8} {'vs torch':>8}")
        for row in r["rows"]:
            if "error" in row:
                lines.append(f"{row['op']:>28} {row['elements']:>10}  ERROR {row['error'].strip().splitlines()[-1]}")
                continue
            mark = {True: "", False: "  < " + str(GOOD_FRACTION), None: "  (not memory-bound)"}[row["good"]]
            lines.append(
                f"{row['op']:>28} {row['elements']:>10} {row['gpudist_us']:>9.1f} {row['gpudist_GBps']:>8.1f} "
                f"{row['fraction_of_copy']:>8.2f} {row['speedup_vs_torch']:>8.2f}{mark}"
            )
    elif name == "collectives":
        lines.append(
            f"{'op':>15} {'bytes':>11} {'ours(us)':>9} {'algbw':>8} {'busbw':>8} {'nocheck':>8} {'raw(us)':>9} "
            f"{'busbw':>8} {'raw/ours':>8} {'raw/nocheck':>11}"
        )
        for row in r["rows"]:
            if "error" in row:
                lines.append(f"{row['op']:>15} {row['bytes']:>11}  ERROR {row['error'].strip().splitlines()[-1]}")
                continue
            lines.append(
                f"{row['op']:>15} {row['bytes']:>11} {row['gpudist_us']:>9.1f} {row['gpudist_algbw_GBps']:>8.2f} "
                f"{row['gpudist_busbw_GBps']:>8.2f} {row['gpudist_nocheck_us']:>8.1f} {row['raw_us']:>9.1f} "
                f"{row['raw_busbw_GBps']:>8.2f} {row['raw_over_gpudist']:>8.2f} "
                f"{row['raw_over_gpudist_nocheck']:>11.2f}"
            )
        if r["note"]:
            lines.append(f"# {r['note']}")
    elif name == "host":
        lines += [f"{k:>40} {v['median']:>9.1f} us (min {v['min']:.1f})" for k, v in r["us_per_call"].items()]
    elif name == "profile":
        lines.append(f"  {r['workload']} autocast {r['autocast']}, batch {r['batch_per_rank']}, {r['steps']} steps")
        lines.append(
            f"{'variant':>15} {'wall ms':>8} {'issue ms':>8} {'fwd':>6} {'bwd':>6} {'step':>6} {'zero':>6} "
            f"{'AccGrad ms':>10} {'calls':>6} {'GPU busy':>8}"
        )
        for k, v in r["variants"].items():
            busy = "-" if v["gpu_busy_share"] is None else f"{v['gpu_busy_share']:.2f}"
            host = " ".join(f"{v['host_ms'].get(p, 0.0):>6.2f}" for p in PHASES)
            lines.append(
                f"{k:>15} {v['wall_ms']:>8.2f} {v['issue_ms']:>8.2f} {host} {v['accumulate_grad_cpu_ms']:>10.2f} "
                f"{v['accumulate_grad_calls']:>6.0f} {busy:>8}"
            )
        lines += [f"  {k} FAILED: {v.strip().splitlines()[-1]}" for k, v in r["errors"].items()]
    elif name in ("capture", "capture-torch"):
        for row in r["rows"]:
            if "error" in row:
                lines.append(f"  {row['workload']} FAILED: {row['error'].strip().splitlines()[-1]}")
                continue
            torch_graphs = ", torch's own graphs" if row.get("torch_graphs") else ""
            lines.append(
                f"  {row['workload']} ({row['model']['parameters'] / 1e6:.1f}M, batch {row['batch_per_rank']})"
                + torch_graphs
            )
            busy = row.get("gpu_busy_share") or {}
            lines += [
                f"{k:>28} {row['step_ms'][k]:>8.2f} ms/step {row['host_ms'][k]:>8.3f} host ms"
                + ("" if busy.get(k) is None else f" {busy[k]:>5.2f} GPU busy")
                for k in row["step_ms"]
            ]
            lines += [f"  {k} FAILED: {v.strip().splitlines()[-1]}" for k, v in row.get("errors", {}).items()]
    elif name == "strategies":
        for row in r["rows"]:
            failures = {"all": row["error"]} if "error" in row else row["errors"]
            if "step_ms" in row:
                times = ", ".join(f"{k} {v:.2f} ms" for k, v in row["step_ms"].items())
                spread = row["final_loss_relative_spread"]
                lines.append(
                    f"  {row['workload']} ({row['model']['parameters'] / 1e6:.1f}M parameters, batch "
                    f"{row['batch_per_rank']}/rank): {times}; final losses agree to {spread or 0:.1e}"
                )
            lines += [f"  {row['workload']} {k} FAILED: {v.strip().splitlines()[-1]}" for k, v in failures.items()]
    return "\n".join(lines)


def format_summary(doc: dict) -> str:
    v, gpus = doc["versions"], doc["machine"]["gpus"]
    where = f"{gpus[0]['name']} x{len(gpus)}" if gpus else "no GPU"
    lines = [
        f"# gpudist bench gpu: {where}; torch {v['torch']}, CUDA {v['cuda']}, triton {v['triton']}, cupy {v['cupy']}, "
        f"NCCL {v['nccl_cupy']} (torch's {v['nccl_torch']}); {doc['date']}",
        f"{'part':<17} {'status':<8} {'seconds':>8}  summary",
    ]
    for name, r in doc["parts"].items():
        lines.append(f"{name:<17} {r['status']:<8} {r.get('seconds', 0):>8.1f}  {_safely(_part_summary, name, r)}")
    total = sum(r.get("seconds", 0) for r in doc["parts"].values())
    lines.append(f"{'total':<17} {'':<8} {total:>8.1f}  (budget {doc['settings']['budget']:g}s)")
    for name, p in (doc.get("plan") or {}).items():
        lines += [f"# plan: {name} would need {problem}" for problem in p["problems"]]
    return "\n".join(lines)
