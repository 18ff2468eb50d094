"""Hosts on one machine: Linux network namespaces joined by veth pairs to a bridge, links capped with ``tc tbf``.

Each host is a namespace ``gd<pid>h<i>`` with loopback and ``eth0`` at ``10.213.0.<i+1>/24``; the other end of its
veth (``gd<pid>v<i>``) is a port of the bridge ``gd<pid>br`` in the root namespace, which has no address: the hosts
reach one another and nothing else. Names carry the test process's pid, so parallel runs never share one, and
:meth:`Hosts.close` (also on failure) kills every process left in the namespaces and removes them, the veths and
the bridge. Needs root and ``ip``; :func:`unavailable` says why not, for a skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

SUBNET = "10.213.0"
"""The hosts' addresses: ``10.213.0.<i+1>``, inside their own namespaces only."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (not root, no ``ip``, no netns support), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the ip and tc commands (iproute2) are not installed"
    name = f"gd{os.getpid()}probe"
    made = _ip("netns", "add", name, check=False)
    if made.returncode:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


_HOST_LOCAL = (
    "GLOO_SOCKET_IFNAME",
    "GPUDIST_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
)
"""Variables of the launching process that must not reach a namespaced host (see :meth:`Hosts.command`)."""


class Hosts:
    """``count`` hosts as network namespaces; each host's egress capped at ``rate`` (``tc tbf``; None: uncapped).

    Use as a context manager; every namespace, veth and the bridge are gone after it, and so is every process
    still running in a namespace.
    """

    def __init__(self, count: int, rate: str | None = None):
        self.tag = f"gd{os.getpid()}"
        self.count, self.rate = count, rate
        self.names = [f"{self.tag}h{i}" for i in range(count)]
        self.bridge = f"{self.tag}br"
        self.veths = [f"{self.tag}v{i}" for i in range(count)]

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def __enter__(self) -> Hosts:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for i, (ns, veth) in enumerate(zip(self.names, self.veths, strict=True)):
                _ip("netns", "add", ns)
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                if self.rate is not None:
                    tbf = ["tbf", "rate", self.rate, "burst", "256kb", "latency", "100ms"]
                    subprocess.run(
                        ["tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", *tbf],
                        check=True,
                        capture_output=True,
                        timeout=20,
                    )
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def command(self, i: int, argv: Sequence[str], env: dict[str, str] | None = None) -> list[str]:
        """``argv`` run inside host ``i`` (with ``env`` set there), without the launching process's rendezvous and
        interface variables: a host is another machine, and a ``GLOO_SOCKET_IFNAME=lo`` that an earlier in-process
        job of the same pytest run set (``GlooCommunicationBackend.create`` does for a loopback rendezvous) would make
        its ranks announce 127.0.0.1 to the other host."""
        pairs = [f"{k}={v}" for k, v in (env or {}).items()]
        unset = [arg for name in _HOST_LOCAL if name not in (env or {}) for arg in ("-u", name)]
        return ["ip", "netns", "exec", self.names[i], "env", *unset, *pairs, *argv]

    def popen(self, i: int, argv: Sequence[str], log: Path, env: dict[str, str] | None = None, **kw):
        """Start ``argv`` on host ``i``, output to ``log``."""
        return subprocess.Popen(
            self.command(i, argv, env), stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True, **kw
        )

    def torchrun(
        self,
        i: int,
        nnodes: str,
        module_argv: Sequence[str],
        *,
        join_timeout: float,
        rdzv_conf: str = "",
        agent_args: Sequence[str] = (),
    ) -> list[str]:
        """The torchrun command host ``i`` runs: ``--nproc-per-node 2`` workers of ``python -m <module_argv>``,
        joining a c10d rendezvous that host 0's agent hosts (``is_host``; every port is free in a fresh namespace),
        each agent announcing its own address (``--local-addr``: the host name resolves to loopback in every
        namespace, and torchrun would hand that to the other hosts). ``rdzv_conf``: more ``key=value,...`` for
        ``--rdzv-conf``; ``agent_args``: more torchrun options."""
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nnodes}",
            "--nproc-per-node=2",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.address(0)}:29500",
            f"--rdzv-id={self.tag}",
            f"--rdzv-conf=is_host={int(i == 0)},join_timeout={int(join_timeout)}"
            + (f",{rdzv_conf}" if rdzv_conf else ""),
            f"--local-addr={self.address(i)}",
            "--monitor-interval=0.2",
            *agent_args,
            "-m",
            *module_argv,
        ]

    def pids(self, i: int) -> list[int]:
        out = _ip("netns", "pids", self.names[i], check=False).stdout
        return [int(p) for p in out.split()]

    def kill_host(self, i: int) -> int:
        """A host dies: SIGKILL every process in its namespace at once. Returns how many there were."""
        pids = self.pids(i)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    def tx_bytes(self, i: int) -> int:
        """Bytes host ``i`` sent onto the link so far (what its bridge port received)."""
        return int(Path(f"/sys/class/net/{self.veths[i]}/statistics/rx_bytes").read_text())

    def close(self) -> None:
        for i, ns in enumerate(self.names):
            if ns in _ip("netns", "list", check=False).stdout.split():
                self.kill_host(i)
                _ip("netns", "del", ns, check=False)
        for veth in self.veths:
            _ip("link", "del", veth, check=False)  # gone with its namespace already, normally
        _ip("link", "del", self.bridge, check=False)
