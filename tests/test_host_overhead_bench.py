"""benchmarks/host_overhead.py's ``steps`` section runs and counts what each strategy's steady-state step issues on
the GPU's path (CUDA, NCCL and Triton launches stubbed)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow  # (11 s: every strategy and torch peer built and stepped; CI's slow tier runs it)
def test_steps_section_counts_each_strategys_launches_and_collectives(tmp_path):
    """Catches the section timing a strategy off the GPU's path (its Triton kernels not forced: no launch counted
    where ZeRO's step launches its norm and update), collectives that escape the counting communicator, or a
    strategy whose NCCL calls per step stop matching its design: DDP one all-reduce per bucket; ZeRO-2 a
    reduce-scatter and an all-gather per bucket and the norm's all-reduce; ZeRO-3 and FSDP two gathers (forward,
    backward) and a reduce-scatter per unit and the norm's all-reduce."""
    import torch

    pytest.importorskip("triton", reason="the section takes the GPU's path: the Triton kernels (stubbed, but chosen)")
    from benchmarks import host_overhead

    out, threads = tmp_path / "steps.json", torch.get_num_threads()
    try:
        host_overhead.main(["--sections", "steps", "--rounds", "1", "--steps", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)  # (the benchmark runs on one)
    rows = json.loads(out.read_text())["steps"]["us"]
    assert {"plain", "torch_ddp", "torch_zero", "torch_fsdp2"} <= set(rows)
    for name in ("gpudist_ddp", "gpudist_ddp_static"):
        assert rows[name]["units"] > 1, rows[name]
        assert rows[name]["collectives_per_step"] == rows[name]["units"], (name, rows[name])
    for name in ("gpudist_zero2", "gpudist_zero2_static"):
        assert rows[name]["collectives_per_step"] == 2 * rows[name]["units"] + 1, (name, rows[name])
        assert rows[name]["launches_per_step"] == 2, (name, rows[name])  # the norm, the update of every piece
    for name in ("gpudist_zero3", "gpudist_fsdp"):
        assert rows[name]["collectives_per_step"] == 3 * rows[name]["units"] + 1, (name, rows[name])
    assert rows["gpudist_ddp_int8"]["launches_per_step"] > 0  # its codec's kernels
    assert all(r["step_total_us"] > 0 and r["python_calls_per_step"] > 0 for r in rows.values())
    # one hook per bucket instead of one per parameter: fewer Python calls in the same step, counted, not timed
    assert rows["gpudist_ddp_static"]["python_calls_per_step"] < rows["gpudist_ddp"]["python_calls_per_step"]
