"""Shared test setup.

Without CUDA, Triton kernels run in Triton's interpreter on CPU tensors. ``TRITON_INTERPRET`` is
read when a kernel is decorated, so it must be set here, before any test imports gpudist.
"""

import os
import threading

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gpudist.kernels import _triton  # noqa: E402  (after TRITON_INTERPRET is set)

#: Devices the kernel tests run on: CPU always, CUDA when present.
KERNEL_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=["torch", "triton"])
def kernel_impl(request, monkeypatch):
    """Run the test once with the torch reference forced and once with the Triton kernels forced."""
    impl = request.param
    if impl == "triton" and not _triton.HAS_TRITON:
        pytest.skip("Triton is not installed")
    monkeypatch.setenv("GPUDIST_KERNELS", impl)
    return impl


@pytest.fixture(params=KERNEL_DEVICES)
def device(request, kernel_impl):
    """The device kernel inputs live on; Triton on CPU needs the interpreter, CUDA needs a GPU."""
    dev = request.param
    if dev == "cuda" and not CUDA:
        pytest.skip("needs CUDA (GPU tier)")
    if dev == "cpu" and kernel_impl == "triton" and not _triton.interpreter_active():
        pytest.skip("Triton kernels are compiled for CUDA in this process; the cuda cases test them")
    # With its index: a tensor's device is cuda:0, never plain cuda, and torch.device("cuda") != "cuda:0".
    return torch.device(dev, torch.cuda.current_device()) if dev == "cuda" else torch.device(dev)


@pytest.fixture
def serial_interpreter(monkeypatch):
    """The Triton kernels forced, in Triton's interpreter, for ranks that run as threads. The interpreter patches the
    language module while a kernel runs, so two rank threads must not run kernels at once: one at a time (a test-only
    lock; processes need none). A kernel's first call also parses its source (``ast.parse``), which CPython 3.11 does
    not make safe across threads (two ranks parsing at once raised "AST constructor recursion depth mismatch" in a CI
    run), so the rewrite takes the same lock (reentrant: a kernel's nested jit calls may rewrite while it runs)."""
    if not _triton.interpreter_active():
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1 on a machine without CUDA)")
    from triton.runtime import interpreter

    lock = threading.RLock()
    run, rewrite = interpreter.GridExecutor.__call__, getattr(interpreter.InterpretedFunction, "rewrite", None)

    def one_at_a_time(self, *args, **kwargs):
        with lock:
            return run(self, *args, **kwargs)

    def rewrite_alone(self):
        with lock:
            return rewrite(self)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", one_at_a_time)
    if rewrite is not None:  # (triton 3.6-3.9 name it so)
        monkeypatch.setattr(interpreter.InterpretedFunction, "rewrite", rewrite_alone)
    monkeypatch.setenv("GPUDIST_KERNELS", "triton")


SLOW_CASES = {
    # Repeated cases, in the slow tier to keep the default one under 10 minutes on 2 cores: each op, strategy or
    # error path below is tested on the other backends (or parameters) in the default tier; these twins start an
    # mpirun (or 4 Gloo processes) each, 4-7 s apiece.
    "tests/test_comm_ops.py::test_stats_count_payload_bytes[mpi]",
    "tests/test_comm_ops.py::test_reduce_scatter_in_place_and_on_scratch_input[mpi]",
    "tests/test_comm_ops.py::test_planned_reduce_scatter_all_gather_and_broadcast_are_their_ops[mpi]",
    "tests/test_comm_ops.py::test_a_planned_all_reduce_is_the_all_reduce_without_per_call_checks[mpi]",
    "tests/test_comm_ops.py::test_coalesced_plans_are_their_ops_issued_together[mpi]",
    "tests/test_comm_ops.py::test_op_matches_numpy[all_reduce_SUM-mpi-2-float32]",
    "tests/test_comm_ops.py::test_op_matches_numpy[all_reduce_SUM-gloo-4-float32]",
    "tests/test_comm_failures.py::test_mismatch_raises_on_every_rank[mpi-shape]",
    "tests/test_comm_failures.py::test_bad_input_is_rejected_before_sending[mpi]",
    "tests/test_comm_failures.py::test_send_recv_mismatch_raises_on_both_sides[mpi]",
    "tests/test_ddp.py::test_ddp_matches_single_process[adam-mpi-2]",
    "tests/test_ddp.py::test_ddp_matches_single_process[sgd-mpi-2]",
    "tests/test_zero.py::test_zero_step_on_the_triton_kernels_clips_and_skips_inside_the_step[fsdp]",
}
"""Test ids marked ``slow`` at collection (parametrized twins that cannot be marked where they are declared)."""


@pytest.hookimpl(tryfirst=True)  # (before the marker selection sees the items)
def pytest_collection_modifyitems(config, items):
    """Mark :data:`SLOW_CASES` slow; the ``gpu`` marker means 'needs CUDA': skip those items with a reason when there
    is none."""
    for item in items:
        if item.nodeid in SLOW_CASES:
            item.add_marker(pytest.mark.slow)
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA (GPU tier); none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
