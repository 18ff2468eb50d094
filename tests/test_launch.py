"""gpudist.init() from launcher environments, the gpudist command, and the README's main job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import gpudist
from gpudist.comm import CommunicationError, InMemoryCommunicationBackend
from gpudist.launch import detect_environment
from gpudist.testing import free_port, mpi_launcher, mpi_unavailable

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, (0, 1, 0, "none")),
        ({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}, (2, 4, 0, "torchrun")),
        (
            {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
            (1, 3, 1, "openmpi"),
        ),
        ({"PMI_RANK": "3", "PMI_SIZE": "5", "MPI_LOCALRANKID": "0"}, (3, 5, 0, "mpich")),
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, (1, 2, 1, "slurm")),
    ],
)
def test_detect_environment(env, expected):
    """Each launcher's variables map to (rank, world, local rank, launcher). Catches reading the wrong variable
    (e.g. a local rank taken for the global one)."""
    got = detect_environment(env)
    assert (got.rank, got.world_size, got.local_rank, got.launcher) == expected
    assert got.master_addr == "127.0.0.1" and got.master_port == 29500


def test_detect_environment_rejects_nonsense():
    with pytest.raises(ValueError, match="rank 4 of world size 4"):
        detect_environment({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="RANK='x'"):
        detect_environment({"RANK": "x", "WORLD_SIZE": "4"})


def test_init_rejects_unknown_and_unavailable_backends():
    with pytest.raises(ValueError, match="unknown backend 'tcp'"):
        gpudist.init("tcp")
    with pytest.raises(CommunicationError, match="'nccl' is unavailable"):
        gpudist.init("nccl")
    comm = gpudist.init("inmemory")
    assert isinstance(comm, InMemoryCommunicationBackend) and comm.world_size == 1


RANK_SCRIPT = textwrap.dedent("""
    import json, os, torch, gpudist
    comm = gpudist.init(timeout=60)
    t = torch.tensor([float(comm.rank + 1)])
    comm.all_reduce(t)
    listen = None
    if comm.rank == 0 and comm.world_size > 1:  # which address does the rendezvous store listen on?
        port = int(os.environ["MASTER_PORT"])
        for line in open("/proc/net/tcp").read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if int(p, 16) == port and state == "0A":
                listen = ".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0))
    print(json.dumps({"rank": comm.rank, "world": comm.world_size, "sum": t.item(), "listen": listen,
                      "backend": comm.name}), flush=True)
    os._exit(0)
""")


def run_job(world: int, rank_env) -> list[dict]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "OMPI_", "PMI_"))}
        env |= rank_env(rank, world) | {"MASTER_PORT": str(port)}
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", RANK_SCRIPT], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    return outputs


@pytest.mark.parametrize(
    "launcher",
    [
        lambda r, w: {"RANK": str(r), "WORLD_SIZE": str(w), "LOCAL_RANK": str(r)},
        lambda r, w: {"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": str(w)},
    ],
    ids=["torchrun", "openmpi"],
)
def test_init_joins_a_multi_process_job(launcher):
    """Two processes started with torchrun's (or mpirun's) variables form one Gloo group through gpudist.init(),
    and rank 0's rendezvous store listens on loopback only. Catches env parsing bugs and a store bound to every
    interface (torch's TCPStore default)."""
    out = run_job(2, launcher)
    assert [o["sum"] for o in out] == [3.0, 3.0]
    assert [o["backend"] for o in out] == ["gloo", "gloo"]
    assert out[0]["listen"] == "127.0.0.1"


@pytest.mark.mpi
@pytest.mark.skipif(mpi_unavailable() is not None, reason=f"MPI: {mpi_unavailable()}")
def test_init_mpi_under_mpirun(tmp_path):
    """``gpudist.init("mpi")`` in processes mpirun started: one MPI group of 3 with the launcher's ranks, no port.
    Catches the MPI backend failing to import or to take rank and size from the communicator."""
    script = tmp_path / "rank.py"
    text = RANK_SCRIPT.replace("gpudist.init(timeout=60)", 'gpudist.init("mpi", timeout=60)')
    text = text.replace("print(json.dumps(", 'open(f"{os.environ[\'OUT\']}/{comm.rank}.json", "w").write(json.dumps(')
    script.write_text(text.replace("flush=True)", ")"))
    env = dict(os.environ, MASTER_PORT="1", OUT=str(tmp_path), OMPI_MCA_btl_vader_single_copy_mechanism="none")
    out = subprocess.run(
        [*mpi_launcher(3), sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=env
    )
    rows = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*.json"))]
    assert [(r["rank"], r["world"], r["sum"], r["backend"]) for r in rows] == [(i, 3, 6.0, "mpi") for i in range(3)], (
        out.stdout[-2000:] + out.stderr[-2000:]
    )


def test_init_single_process_without_launcher():
    """A plain `python script.py` is rank 0 of 1 with no network rendezvous at all."""
    out = run_job(1, lambda r, w: {})
    assert out == [{"rank": 0, "world": 1, "sum": 1.0, "listen": None, "backend": "gloo"}]


def test_gpudist_info():
    out = subprocess.run([sys.executable, "-m", "gpudist.cli", "info"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "torch" in out.stdout and "backends:" in out.stdout
    assert "gloo       available" in out.stdout


@pytest.mark.slow  # ~11 s: the slow tier (CI runs it)
def test_gpudist_bench_collectives(tmp_path):
    """The command prints the nccl-tests columns and writes JSON with gpudist and torch busbw side by side."""
    path = tmp_path / "c.json"
    cmd = [
        sys.executable,
        "-m",
        "gpudist.cli",
        "bench",
        "collectives",
        "--world-size",
        "2",
        "--max-bytes",
        "4K",
        "--rounds",
        "1",
        "--json",
        str(path),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    header = next(line for line in out.stdout.splitlines() if "size(B)" in line)
    for column in ("time(us)", "algbw", "busbw", "raw(us)", "ratio"):
        assert column in header
    doc = json.loads(path.read_text())
    assert {r["op"] for r in doc["rows"]} == {"all_reduce", "reduce_scatter", "all_gather"}
    assert all(r["gpudist_busbw_GBps"] > 0 and r["baseline_busbw_GBps"] > 0 for r in doc["rows"])
    assert doc["environment"]["torch"]
    bad = subprocess.run(
        [sys.executable, "-m", "gpudist.cli", "bench", "collectives", "--backend", "nccl"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "unavailable" in (bad.stderr + bad.stdout)


def test_init_under_real_torchrun():
    """Catches gpudist.init() trying to host its own store on MASTER_PORT, which torchrun's agent already holds
    ("Address already in use"): under the agent every rank must join the agent's store."""
    from gpudist.testing import free_port

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(ROOT / "examples" / "comm_demo.py"),
        "--numel",
        "1001",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "all ranks ok: True" in out.stdout


@pytest.mark.slow  # ~12 s: the slow tier (CI runs it)
def test_gpudist_bench_kernels(tmp_path):
    """Catches the kernel benchmark breaking (an op builder out of step with the kernels' signatures, a
    missing baseline) or an unknown op passing silently; no timing is asserted."""
    path = tmp_path / "k.json"
    cmd = [
        sys.executable,
        "-m",
        "gpudist.cli",
        "bench",
        "kernels",
        "--device",
        "cpu",
        "--elements",
        "64K",
        "--rounds",
        "1",
        "--json",
        str(path),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    doc = json.loads(path.read_text())
    from gpudist.bench.kernels import OPS

    assert [r["op"] for r in doc["rows"]] == list(OPS)
    assert all(r["gpudist_s"] > 0 and r["torch_s"] > 0 and r["speedup"] > 0 for r in doc["rows"])
    assert all(r["recall"] == 1.0 for r in doc["rows"] if r["op"].startswith("topk_exact"))
    assert all(r["recall"] >= 0.99 for r in doc["rows"] if r["op"].startswith("topk_threshold"))  # 14-bit keys
    assert doc["elements"] == [1 << 16] and list(doc["copy_GBps"]) == [str(1 << 16)]
    assert doc["copy_GBps"][str(1 << 16)] > 0 and doc["environment"]["torch"]
    bad = subprocess.run(
        [sys.executable, "-m", "gpudist.cli", "bench", "kernels", "--ops", "pack,nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "unknown op(s) ['pack', 'nope']" in bad.stderr


def test_main_job_runs():
    """The README's main job (examples/comm_demo.py) runs on 3 spawned ranks and every check passes."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "comm_demo.py"), "--world-size", "3", "--numel", "10007"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all checks passed on every rank" in out.stdout
