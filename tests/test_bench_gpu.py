"""``gpudist bench gpu`` on the CPU tier: the skip a machine without CUDA prints and writes, the arithmetic behind every
number (busbw, bandwidth as a fraction of copy, JUnit counts), each part's code on CPU stand-ins (the collectives over
the simulated NCCL of tests/fakenccl.py, the strategy step times over Gloo on a tiny model), and a failing or crashing
part being recorded while the parts after it still run. What only a GPU can show (CUDA-event timings, real NCCL, the
numbers themselves) is the command's job on a GPU runner (docs/gpu.md)."""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import time
from pathlib import Path

import pytest
import torch

from gpudist import cli
from gpudist.bench import gpu as G
from gpudist.bench import workloads as W
from gpudist.bench.gpu import report as GR
from gpudist.bench.gpu import steps as GS

from .fakenccl import FakeNccl, run_nccl

REPO = Path(__file__).resolve().parents[1]


def _no_cuda(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_command_skips_without_cuda_and_writes_the_reason(tmp_path, monkeypatch, capsys):
    """Catches a command that crashes, or exits non-zero, on a machine without CUDA (a CPU CI job running it would go
    red), one that skips without saying why, and a GPU runner that lost its GPU passing as a skip (--require-gpu)."""
    _no_cuda(monkeypatch)
    assert cli.main(["bench", "gpu", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert G.NO_CUDA in out
    doc = json.loads((tmp_path / "gpu_no_cuda.json").read_text())
    assert doc["status"] == "skipped" and doc["reason"] == G.NO_CUDA
    assert {p: r["status"] for p, r in doc["parts"].items()} == dict.fromkeys(G.PARTS, "skipped")
    assert doc["versions"]["torch"] == torch.__version__ and doc["date"]
    assert set(doc["plan"]) == set(G.PARTS)  # what would run, and what it lacks here
    assert cli.main(["bench", "gpu", "--require-gpu", "--out", str(tmp_path / "x.json")]) == G.EXIT_NO_GPU
    assert json.loads((tmp_path / "x.json").read_text())["status"] == "skipped"
    assert cli.main(["bench", "gpu", "--parts", "kernels,bogus", "--out", str(tmp_path)]) == 2
    assert "bogus" in capsys.readouterr().err


def test_python_m_benchmarks_gpu_is_the_same_command(tmp_path, monkeypatch, capsys):
    """Catches ``python -m benchmarks.gpu`` drifting from ``gpudist bench gpu`` (a broken entry point would otherwise
    be found on the GPU runner): run as ``__main__``, it takes the same options and exits with the same code."""
    _no_cuda(monkeypatch)
    out = tmp_path / "skip.json"
    monkeypatch.setattr(sys, "argv", ["benchmarks/gpu.py", "--parts", "kernels", "--out", str(out)])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("benchmarks.gpu", run_name="__main__")
    assert exit_.value.code == 0
    assert G.NO_CUDA in capsys.readouterr().out
    assert json.loads(out.read_text())["parts"] == {"kernels": {"status": "skipped", "reason": G.NO_CUDA}}


def test_check_names_what_a_part_lacks():
    """Catches a plan that says a part is ready while the runner lacks what it needs: here no repository (the tests
    and strategies parts read tests/ and benchmarks/) and a kernel op that does not exist."""
    plan = G.check_plan(G.GPUSettings(repo=None, kernel_ops=("adam", "no_such_op"), parts=("tests-nccl", "kernels")))
    assert any("repository root" in p for p in plan["tests-nccl"]["problems"])
    assert any("no_such_op" in p for p in plan["kernels"]["problems"])
    ready = G.check_plan(G.GPUSettings(repo=str(REPO), parts=("tests-nccl", "kernels")))
    assert ready["tests-nccl"]["problems"] == [] and ready["kernels"]["problems"] == []


def test_bus_bandwidth_uses_the_nccl_tests_factors():
    """Catches swapped or off-by-one bus factors (n instead of n-1, all-gather's factor on all-reduce) and a
    broadcast given a ring factor: 1 GB in 10 ms is 100 GB/s algbw; at 8 ranks all-reduce moves 2*7/8 of it over
    each link, all-gather and reduce-scatter 7/8, broadcast all of it; one rank moves nothing."""
    cases = {"all_reduce": 175.0, "all_gather": 87.5, "reduce_scatter": 87.5, "broadcast": 100.0}
    for op, busbw in cases.items():
        assert G.bus_bandwidth(op, 10**9, 0.01, 8) == pytest.approx((100.0, busbw))
    assert G.bus_bandwidth("all_reduce", 10**9, 0.01, 2)[1] == pytest.approx(100.0)
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        assert G.bus_bandwidth(op, 10**9, 0.01, 1) == (pytest.approx(100.0), 0.0)


def test_kernel_rows_divide_by_the_copy_of_the_same_size(monkeypatch):
    """Catches the fraction of copy computed against the wrong copy (another size's), an inverted speedup, and the
    0.8 judgement applied to top-k (not memory-bound). Timings are fixed: squared_norm reads 4 bytes per element;
    at 2^20 elements in 1 us that is 4194.3 GB/s, 0.8 of a 5242.88 GB/s copy; torch at 2 us is 2x slower."""
    from gpudist.bench import kernels as BK

    copies = {1 << 20: 5242.88, 1 << 12: 1.0}
    monkeypatch.setattr(BK, "copy_bandwidth", lambda n, dev, rounds: copies[n])
    monkeypatch.setattr(BK, "time_variants", lambda variants, dev, rounds: ({"gpudist": 1e-6, "torch": 2e-6}, 3))
    settings = G.GPUSettings(kernel_elements=(1 << 12, 1 << 20), kernel_ops=("squared_norm", "topk_exact_1pct"))
    rows = {(r["op"], r["elements"]): r for r in G.kernels_part(settings, device="cpu")["rows"]}
    big = rows[("squared_norm", 1 << 20)]
    assert big["gpudist_GBps"] == pytest.approx(4194.304)
    assert big["fraction_of_copy"] == pytest.approx(0.8) and big["good"] is True
    assert big["speedup_vs_torch"] == pytest.approx(2.0)
    assert rows[("squared_norm", 1 << 12)]["fraction_of_copy"] == pytest.approx(4 * 4096 / 1e-6 / 1e9)
    assert rows[("topk_exact_1pct", 1 << 20)]["good"] is None


def test_kernel_op_error_is_a_row_and_the_others_run(monkeypatch):
    """Catches one kernel's failure (a Triton compile error, an out-of-memory) losing the whole table."""
    from gpudist.bench import kernels as BK

    def broken(n, device):
        raise RuntimeError("triton compile failed")

    monkeypatch.setitem(BK.OPS, "adam", broken)
    settings = G.GPUSettings(kernel_elements=(1024,), kernel_ops=("adam", "squared_norm"), rounds=1)
    rows = G.kernels_part(settings, device="cpu")["rows"]
    assert "triton compile failed" in rows[0]["error"]
    assert rows[1]["op"] == "squared_norm" and rows[1]["gpudist_GBps"] > 0


def _host_rows(comm):
    from gpudist.bench.host_calls import cuda_call_rows

    return cuda_call_rows(comm, calls=5, rounds=1, device="cpu")


def test_host_part_rows_over_simulated_nccl():
    """The host part's rank code with the CPU standing in for CUDA and the simulated NCCL for NCCL: catches a raw
    all-reduce with the wrong arguments (the simulation refuses it), a plan that is not the backend's, and a row the
    summary reads going missing."""
    fake = FakeNccl()
    rows = run_nccl(_host_rows, 1, fake)[0]
    for key in ("all_reduce_planned", "all_reduce_raw_handed_off", "pack_300_plan", "pack_300_torch_cat_mul"):
        assert rows[key]["median"] > 0, key
    assert {"adam_step_plan", "adam_step_torch_fused_adamw", "all_reduce_raw", "all_reduce_unchecked"} <= set(rows)
    doc = {"status": "ok", "seconds": 1.0, "world_size": 1, "calls": 5, "rounds": 1, "us_per_call": rows}
    assert "all_reduce_planned" in GR._part_summary("host", doc) and "pack_300_plan" in GR._part_table("host", doc)
    assert fake.calls["allReduce"] > 0


def test_collective_rows_over_simulated_nccl():
    """Catches a raw cupy.cuda.nccl call with the wrong pointer, count or root (the simulated NCCL refuses ranks that
    disagree and overlaps NCCL does not allow), a missing broadcast baseline, and busbw not following algbw. Two
    ranks; every rank reports the same rows (each time is the slowest rank's)."""
    fake = FakeNccl()
    results = run_nccl(G.collective_rows, 2, fake, sizes=(4096, 1000), rounds=1, target_s=1e-3)
    rows = results[0]
    assert [r["op"] for r in rows] == list(G.COLLECTIVE_OPS) * 2
    assert [r["bytes"] for r in rows] == [4096] * 4 + [1000] * 4
    for r in rows:
        for v in ("raw", "gpudist", "gpudist_nocheck"):
            factor = G.BUS_FACTORS[r["op"]](2)
            assert r[f"{v}_busbw_GBps"] == pytest.approx(r[f"{v}_algbw_GBps"] * factor)
        assert r["raw_over_gpudist"] == pytest.approx(r["raw_us"] / r["gpudist_us"])
    assert results[1] == rows
    assert fake.calls["broadcast"] > 0 and fake.calls["reduceScatter"] > 0


def test_strategy_step_times_on_cpu():
    """The strategies part's rank code with Gloo and the CPU standing in for NCCL and CUDA (one rank in this process, a
    2-layer MLP). Catches a variant that cannot be built (every one must time), peers paired wrongly, and a variant
    that trains a different function: all four start from the same seed, step on the same batch, and must end at
    the same loss."""
    import torch.distributed as dist

    from gpudist.comm import GlooCommunicationBackend

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        comm = GlooCommunicationBackend()
        tiny = {"width": 32, "depth": 2}
        row = G.strategy_rows(comm, dist.group.WORLD, torch.device("cpu"), "mlp", 4, 1, 2, tiny)
    finally:
        dist.destroy_process_group()
    assert row["errors"] == {}
    assert set(row["step_ms"]) == {"gpudist_ddp", "torch_ddp", "gpudist_zero2", "torch_zero", "gpudist_fsdp", "fsdp2"}
    assert set(row["peer_over_gpudist"]) == {"torch_ddp/gpudist_ddp", "torch_zero/gpudist_zero2", "fsdp2/gpudist_fsdp"}
    assert row["final_loss_relative_spread"] < 1e-5, row["final_loss"]


def test_strategy_step_times_under_bf16_autocast_on_cpu():
    """The GPU's 185M GPT row (``gpt-d1024`` under bf16 autocast) shrunk to a tiny GPT on the CPU. Catches the
    autocast setting not reaching the step (the losses would equal the fp32 row's), a variant that cannot be built
    with it, and variants that then train different functions: they start from the same seed on the same batch, so
    their losses after the same steps agree to bf16 rounding (2^-8, a few steps)."""
    import torch.distributed as dist

    from gpudist.comm import GlooCommunicationBackend

    assert G.GPUSettings().autocast.get("gpt-d1024") == "bfloat16" and "gpt-d1024" in G.GPUSettings().workloads
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        comm = GlooCommunicationBackend()
        tiny = {"layers": 1, "width": 16, "heads": 2, "vocab": 64, "positions": 8, "seq": 8}
        rows = [
            G.strategy_rows(comm, dist.group.WORLD, torch.device("cpu"), "gpt-d1024", 2, 1, 2, tiny, autocast=dtype)
            for dtype in (torch.bfloat16, None)
        ]
    finally:
        dist.destroy_process_group()
    row, fp32 = rows
    assert row["errors"] == {} and row["autocast"] == "bfloat16" and fp32["autocast"] is None
    assert all(abs(row["final_loss"][k] - fp32["final_loss"][k]) > 1e-6 for k in row["final_loss"]), (row, fp32)
    assert len(row["step_ms"]) == 6 and len(row["peer_over_gpudist"]) == 3
    assert row["final_loss_relative_spread"] < 4 * 2**-8, row["final_loss"]


def test_kernel_busy_share_is_the_kernels_union_over_the_hosts_span():
    """Catches a busy share taken over the kernels' own span (a GPU that waits for the host before its first kernel,
    or after its last, would read as busy) or counting overlapping kernels twice."""
    from types import SimpleNamespace as NS

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def event(kind, start, end):
        return NS(device_type=kind, time_range=NS(start=start, end=end))

    events = [event(cpu, 0, 3), event(cuda, 2, 4), event(cuda, 3, 5), event(cpu, 8, 10)]
    assert GS.kernel_busy_share(events) == pytest.approx(0.3)
    assert GS.kernel_busy_share([e for e in events if e.device_type == cpu]) is None


def test_profile_rows_on_cpu():
    """The profile part's rank code on the CPU (Gloo for NCCL, a tiny GPT). Catches a variant left out, the
    ``AccumulateGrad`` time read from the wrong events (every variant but FSDP's, which frees its gradients into
    shards, runs one per parameter per step), and the busy-share union counting overlapping intervals twice."""
    import torch.distributed as dist

    from gpudist.comm import GlooCommunicationBackend

    assert GS._busy_share([(0, 2), (1, 3), (5, 6)], 0, 10) == pytest.approx(0.4)
    assert GS._busy_share([(-1, 1), (9, 12)], 0, 10) == pytest.approx(0.2)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        comm = GlooCommunicationBackend()
        tiny = {"layers": 1, "width": 16, "heads": 2, "vocab": 64, "positions": 8, "seq": 8}
        r = G.profile_rows(comm, dist.group.WORLD, torch.device("cpu"), "gpt-d1024", 2, 2, tiny, torch.bfloat16)
    finally:
        dist.destroy_process_group()
    params = sum(1 for _ in W.make("gpt-d1024", **tiny).parameters())
    assert r["errors"] == {} and len(r["variants"]) == 6
    for name, v in r["variants"].items():
        assert v["wall_ms"] > 0 and v["gpu_busy_share"] is None and v["top_self_cpu_ms"], name
        assert set(v["host_ms"]) == set(G.PHASES) and sum(v["host_ms"].values()) <= v["issue_ms"] * 1.001, v
        if name != "gpudist_fsdp":
            assert v["accumulate_grad_calls"] == params and v["accumulate_grad_cpu_ms"] > 0, (name, v)
    assert "GPU busy" in GR._part_table("profile", {"status": "ok", "seconds": 1.0, **r})


def _raises(settings):
    raise ValueError("cupy missing")


def _dies(settings):
    os._exit(7)  # what a segfault or a sticky CUDA error looks like from outside: no reply, the process gone


def _works(settings):
    return {"rows": [], "world_size": 1, "value": 42}


def test_failing_part_is_recorded_and_the_rest_run():
    """Catches one part's exception ending the run (a GPU runner gets one shot): the error is that part's record,
    and the parts after it run."""
    settings = G.GPUSettings(parts=("kernels", "collectives"))
    seen = []
    results = G.run_parts(settings, {"kernels": _raises, "collectives": _works}, isolate=False, on_result=seen.append)
    assert results["kernels"]["status"] == "error" and "cupy missing" in results["kernels"]["error"]
    assert results["collectives"]["status"] == "ok" and results["collectives"]["value"] == 42
    assert len(seen) == 2  # the JSON is rewritten after every part


def test_crashing_part_process_is_recorded_and_the_rest_run():
    """Catches a crash in native code (segfault, sticky CUDA error, os._exit) taking the whole command down, or being
    reported as success: each part runs in its own process, its death is recorded with the exit code, and the next
    part's result comes back whole from its own process."""
    settings = G.GPUSettings(parts=("kernels", "collectives"))
    results = G.run_parts(settings, {"kernels": _dies, "collectives": _works})
    assert results["kernels"]["status"] == "error" and "exit code 7" in results["kernels"]["error"]
    assert results["collectives"]["status"] == "ok" and results["collectives"]["value"] == 42


def test_junit_counts(tmp_path):
    """Catches skips or errors counted as passes and failing test ids lost from the GPU tier's record."""
    report = tmp_path / "junit.xml"
    report.write_text(
        """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="5">
        <testcase classname="tests.test_gpu" name="test_a"/>
        <testcase classname="tests.test_gpu" name="test_b"><failure message="assert 1 == 2"/></testcase>
        <testcase classname="tests.test_gpu" name="test_c"><error message="fixture broke"/></testcase>
        <testcase classname="tests.test_gpu" name="test_d"><skipped message="NCCL 2.27 refuses"/></testcase>
        <testcase classname="tests.test_kernels" name="test_e[cuda]"><skipped message="NCCL 2.27 refuses"/></testcase>
        </testsuite></testsuites>"""
    )
    counts = G.junit_counts(report)
    assert {k: counts[k] for k in ("total", "passed", "failed", "errors", "skipped")} == {
        "total": 5,
        "passed": 1,
        "failed": 1,
        "errors": 1,
        "skipped": 2,
    }
    assert counts["failed_tests"] == ["tests.test_gpu::test_b", "tests.test_gpu::test_c"]
    assert counts["skip_reasons"] == {"NCCL 2.27 refuses": 2}


HANGING_TIER = '''"""A stand-in part of the GPU tier: the middle test hangs in a collective one rank never calls."""
import pytest
import torch

from tests.fakenccl import FakeNccl, run_nccl

pytestmark = pytest.mark.gpu


def test_before():
    pass


def _one_rank_never_calls(comm):
    if comm.rank == 0:
        comm.all_reduce(torch.ones(4, device=comm.device))
        torch.ones(1, device=comm.device).tolist()  # waits for the all-reduce: 600 s on this simulated NCCL


def test_hangs():
    run_nccl(_one_rank_never_calls, 2, FakeNccl(timeout=600))


def test_after():
    pass
'''


@pytest.mark.slow
def test_a_hanging_test_costs_only_its_own_timeout_and_later_parts_run(tmp_path):
    """On the simulated NCCL, a test of a part waits in an all-reduce that one rank never calls (600 s): it fails at
    its own pytest-timeout (3 s here), the tests after it in the part still run and pass, the part reports its
    counts, and the next part runs. Catches the 2026-11-28 run on an H200, where the tier's first test deadlocked
    and the 264 tests after it never ran in the time the GPU was lent."""
    tier = tmp_path / "test_tier.py"
    tier.write_text(HANGING_TIER)
    settings = G.GPUSettings(
        parts=("tests-nccl", "kernels"), tests={"tests-nccl": (str(tier),)}, test_timeout=3, repo=str(REPO)
    )
    results = G.run_parts(settings, {"tests-nccl": G.PARTS["tests-nccl"], "kernels": _works})
    tests = results["tests-nccl"]
    assert tests["status"] == "ok" and not tests["timed_out"], tests
    assert (tests["passed"], tests["failed"], tests["errors"]) == (2, 1, 0), tests["output_tail"]
    assert len(tests["failed_tests"]) == 1 and tests["failed_tests"][0].endswith("::test_hangs")
    assert tests["seconds"] < 100, "the hang cost more than its own timeout (the collective waits 600 s)"
    assert results["kernels"]["status"] == "ok" and results["kernels"]["value"] == 42


def _slow(settings):
    time.sleep(1.0)
    return {"limit": settings.timeouts["kernels"]}


def test_the_budget_bounds_the_whole_run():
    """Catches a run that can outlast a short GPU slot: each part's limit is cut to what is left of ``budget`` (less
    the reserve it keeps to report), and a part with too little left is skipped with the reason, not started."""
    settings = G.GPUSettings(parts=("kernels", "collectives"), budget=G.MIN_PART_SECONDS + 0.5)
    results = G.run_parts(settings, {"kernels": _slow, "collectives": _works}, isolate=False)
    assert results["kernels"]["status"] == "ok"
    assert results["kernels"]["limit"] == pytest.approx(G.MIN_PART_SECONDS + 0.5 - G.PART_RESERVE, abs=0.1)
    assert results["collectives"]["status"] == "skipped"
    assert "out of the time budget" in results["collectives"]["reason"]


def test_parts_run_correctness_first_and_quick_measures_less():
    """Catches the default order drifting from the issue's (kernel tests, NCCL ops, the real-GPU host-sync test, the
    strategies, then the benchmarks), ``--parts tests`` not standing for the four test parts, and ``--quick`` not
    shrinking the measurements (an option given explicitly still wins)."""
    assert G.GPUSettings().parts[:4] == ("tests-kernels", "tests-nccl", "tests-host-sync", "tests-strategies")
    assert G.GPUSettings().parts[4:] == (
        "kernels", "collectives", "host", "strategies", "capture", "profile", "gate", "capture-torch"
    )  # fmt: skip
    parser = argparse.ArgumentParser()
    G.add_arguments(parser)
    full = G.settings_from(parser.parse_args(["--parts", "tests,kernels"]))
    assert full.parts == (*G.TEST_PARTS, "kernels") and full.kernel_elements == (1 << 22, 1 << 24, 1 << 26)
    quick = G.settings_from(parser.parse_args(["--quick", "--rounds", "4"]))
    assert quick.kernel_elements == (1 << 24,) and quick.rounds == 4 and quick.steps < full.steps
    assert sum(quick.collective_bytes) < sum(full.collective_bytes)
    # Together the test parts are the whole GPU tier: every test file of it, and -k selections that cover test_gpu.py.
    selected = " ".join(a for args in G.TEST_PARTS.values() for a in args)
    assert "tests/test_kernels.py" in selected and "tests/test_kernels_compression.py" in selected
    assert "not (nccl_world_one_every_op or compressed_collectives or no_host_sync)" in selected


def _capture_row(comm, group):
    from gpudist.bench.gpu.graphs import capture_rows

    from .graphsim import SimulatedGraph

    tiny = {"layers": 1, "width": 16, "heads": 2, "vocab": 64, "positions": 8, "seq": 8}
    cpu = torch.device("cpu")
    return capture_rows(comm, group, cpu, "gpt", 2, 2, 2, tiny, optimizer="sgd", graph=SimulatedGraph, busy=True)


def _torch_graphed_row(comm, group):
    from gpudist.bench.gpu.graphs import CaptureBench, torch_graphed_row

    from .graphsim import SimulatedGraph

    tiny = {"layers": 1, "width": 16, "heads": 2, "vocab": 64, "positions": 8, "seq": 8}
    bench = CaptureBench(comm, group, torch.device("cpu"), "gpt", 2, tiny, None, "sgd", SimulatedGraph)
    return torch_graphed_row(bench, 2, 2)


def test_torch_graphed_row_records_what_torch_refuses():
    """torch's own graphs (the capture part's last row) on the CPU tier, where torch refuses both (no CUDA): each is
    recorded with its error and the rest is still measured and reported. Catches a refusal that takes the row down
    (the GPU run would lose torch DDP eager against gpudist's captured step too)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        row = run_nccl(_torch_graphed_row, 1, FakeNccl(), group=dist.group.WORLD)[0]
    finally:
        dist.destroy_process_group()
    assert set(row["errors"]) == {"torch_ddp_graphed", "torch_ddp_graphed_callables"}, row["errors"]
    assert set(row["step_ms"]) == {"torch_ddp", "gpudist_ddp_graphed"} and row["over_gpudist_graphed"]["torch_ddp"] > 0
    doc = {"status": "ok", "seconds": 1.0, "world_size": 1, "rows": [{"torch_graphs": True, **row}]}
    assert "torch_ddp_graphed failed" in GR._part_summary("capture-torch", doc)
    assert "torch_ddp_graphed_callables FAILED" in GR._part_table("capture-torch", doc)


def test_capture_rows_on_cpu():
    """The capture part's rank code on the CPU tier (DDP, ZeRO-2, FSDP, each eager, captured and against its peer): the
    simulated NCCL and graph stand in for NCCL and CUDA graphs, Gloo for torch's NCCL group, SGD for the capturable
    AdamW (torch refuses capturable on the CPU). Catches a variant missing or paired wrongly, a captured step that
    trains another function than the eager one (their losses over the same batches must be identical), and host times
    not measured."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        row = run_nccl(_capture_row, 1, FakeNccl(), group=dist.group.WORLD)[0]
    finally:
        dist.destroy_process_group()
    peers = {"ddp": "torch_ddp", "zero2": "torch_zero", "fsdp": "fsdp2"}
    mine = {f"gpudist_{s}{graphed}" for s in peers for graphed in ("", "_graphed")}
    assert set(row["step_ms"]) == set(peers.values()) | mine
    assert set(row["peer_over_gpudist"]) == {f"{peers[name.split('_')[1]]}/{name}" for name in mine}
    assert row["loss_max_abs_diff"] == 0.0 and [len(r["replayed"]) for r in row["losses"].values()] == [3, 3, 3], row
    assert all(v > 0 for v in row["host_ms"].values()) and all(v > 0 for v in row["replay_host_share"].values())
    assert row["gpu_busy_share"] == dict.fromkeys(row["step_ms"]), row["gpu_busy_share"]  # profiled: no CUDA kernel
    doc = {"status": "ok", "seconds": 1.0, "world_size": 1, "rows": [row]}
    assert "gpudist_zero2_graphed" in GR._part_summary("capture", doc) and "host ms" in GR._part_table("capture", doc)


def _clock_decisions(comm, elapsed: float, slowest: list[float]) -> list[bool]:
    from gpudist.bench.gpu.common import PartClock

    clock = PartClock(comm, limit=1.0, now=lambda: elapsed)
    clock.start = 0.0
    decisions = []
    for s in slowest:
        clock.slowest = s if comm.rank == 1 else 0.0  # only rank 1 has seen a slow item
        decisions.append(clock.fits())
    return decisions


def test_part_clock_stops_items_that_would_not_fit_and_the_ranks_agree():
    """Catches the capture part starting a workload its time limit cannot hold (the part would be stopped and lose
    every row it had measured), or ranks deciding differently (one would wait for the other's collectives)."""
    import gpudist
    from gpudist.bench.gpu.common import PartClock
    from gpudist.testing import run_ranks

    t = [0.0]
    clock = PartClock(gpudist.InMemoryCommunicationBackend(0, 1, group="clock"), limit=1.0, now=lambda: t[0])
    assert clock.fits()  # nothing measured yet: the first item starts
    t[0] = 0.3
    clock.done()  # the first item took 0.3 s
    t[0] = 0.4
    assert clock.fits()  # 0.4 + 1.5 x 0.3 = 0.85 <= 0.9 (the limit less its reserve)
    t[0] = 0.6
    assert not clock.fits()  # 0.6 + 0.45 = 1.05
    late = PartClock(gpudist.InMemoryCommunicationBackend(0, 1, group="clock2"), 1.0, now=lambda: 0.0, started=-0.95)
    assert not late.fits()  # the part's processes took 0.95 s to start: its limit counts from then
    # at 0.3 s in, rank 0 has seen no slow item and rank 1 one of 0.3 s (0.75: fits), then of 0.5 s (1.05: not)
    decided = run_ranks(_clock_decisions, 2, "inmemory", elapsed=0.3, slowest=[0.3, 0.5])
    assert decided == [[True, False], [True, False]]
