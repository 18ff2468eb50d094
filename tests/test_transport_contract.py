"""The transport contract is complete: what strategies and live mode ask of a transport is a declared member of
:class:`~gpudist.comm.CommunicationBackend` (``shared_memory``, ``abort()``, ``shutdown()`` and the transport
properties), every transport honours it, nothing above ``gpudist/comm/`` probes which transport it holds, and the
point-to-point handshake of the CPU process transports is written once (``gpudist/comm/handshake.py``).

The probe check reads the source (``ast``), so it needs nothing importable and names the file and line. MPI is
exercised through a small simulated ``mpi4py`` (:class:`_FakeMPI`: in-process ranks, matched point-to-point), so its
handshake and abort run where mpi4py is not installed too.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import pkgutil
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import gpudist.comm
from gpudist.comm import (
    AgreedOps,
    CollectiveMismatchError,
    CommunicationBackend,
    CommunicationError,
    GlooCommunicationBackend,
)
from gpudist.comm import mpi as mpi_module
from gpudist.comm.mpi import MPICommunicationBackend
from gpudist.comm.nccl import NCCLCommunicationBackend
from gpudist.testing import run_ranks

from .fakenccl import FakeNccl, installed

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gpudist"
COMM = PACKAGE / "comm"

TRANSPORT_NAMES = ("comm", "group", "backend")
"""Names (of a variable or an attribute) that hold a transport above gpudist/comm/, besides ``*_comm``."""

CAPABILITIES = (
    "shared_memory",
    "abort",
    "shutdown",
    "ordered_p2p",
    "averages_in_transport",
    "chunked_overlap",
    "check_syncs_host",
)
"""What a strategy or live mode may ask of a transport: each declared on the contract with a default."""


def _comm_modules() -> list:
    return [gpudist.comm] + [
        importlib.import_module(f"gpudist.comm.{info.name}") for info in pkgutil.iter_modules(gpudist.comm.__path__)
    ]


def _comm_classes() -> dict[str, type]:
    """Every class gpudist.comm defines, by name (the optional transports import without their extras)."""
    return {
        name: value
        for module in _comm_modules()
        for name, value in vars(module).items()
        if inspect.isclass(value) and value.__module__.startswith("gpudist.comm")
    }


TRANSPORT_MODULES = ("inmemory", "gloo", "shm", "mpi", "nccl", "handshake")
"""The modules of gpudist.comm that implement transports (rather than the contract and its value types)."""


@functools.cache
def _probed_classes() -> frozenset[str]:
    """The gpudist.comm classes an ``isinstance`` above comm/ may not test against: the transports, their parts and
    wrappers (``AgreedOps``). Not the contract itself (an argument check: "is this a transport at all"), its errors
    (``except``-side checks) or its value types (``ReductionOperation``, ``Work``...), which say nothing of the
    transport."""
    transport_modules = {f"gpudist.comm.{name}" for name in TRANSPORT_MODULES}
    return frozenset(
        name
        for name, cls in _comm_classes().items()
        if not issubclass(cls, BaseException)
        and (
            (issubclass(cls, CommunicationBackend) and cls is not CommunicationBackend)
            or cls is AgreedOps
            or cls.__module__ in transport_modules
        )
    )


def _transports() -> list[type]:
    """The concrete transports gpudist.comm defines."""
    found = {cls for cls in _comm_classes().values() if issubclass(cls, CommunicationBackend)}
    return sorted((cls for cls in found if not inspect.isabstract(cls)), key=lambda cls: cls.__name__)


# -- (a) nothing above gpudist/comm/ probes a transport ----------------------------------------------------------------


def _names_in(node: ast.expr) -> list[str]:
    """The class names an ``isinstance`` second argument mentions (``A``, ``mod.A``, ``(A, B)``)."""
    if isinstance(node, ast.Tuple):
        return [name for element in node.elts for name in _names_in(element)]
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    return []


def _holds_transport(node: ast.expr, imported: set[str]) -> bool:
    """Whether ``node`` is named as a transport: ``comm``, ``x_comm``, ``self.comm``, ``group``, ``backend`` (a
    name bound by an import, such as ``from . import comm``, is a module, not a transport)."""
    if isinstance(node, ast.Name):
        name = node.id
        if name in imported:
            return False
    elif isinstance(node, ast.Attribute):
        name = node.attr
    else:
        return False
    return name in TRANSPORT_NAMES or name.endswith("_comm")


def probes(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """``(line, text)`` of every transport probe in ``source``: an ``isinstance``/``issubclass`` against a gpudist.comm
    class other than the contract and its errors, and a ``hasattr``/``getattr`` whose subject is named as a transport
    or whose attribute is one of the contract's capabilities."""
    tree = ast.parse(source, filename)
    imported = {  # names bound by an import are modules or classes, never a transport made at run time
        (alias.asname or alias.name).partition(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    probed = _probed_classes()
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2):
            continue
        func, subject, second = node.func.id, node.args[0], node.args[1]
        if func in ("isinstance", "issubclass"):
            hit = any(name in probed for name in _names_in(second))
        elif func in ("hasattr", "getattr"):
            capability = isinstance(second, ast.Constant) and second.value in CAPABILITIES
            hit = capability or _holds_transport(subject, imported)
        else:
            continue
        if hit:
            found.append((node.lineno, ast.get_source_segment(source, node) or func))
    return found


def test_the_probe_check_tells_probes_from_legitimate_uses():
    """Catches a probe check too loose to see a probe or so eager that it flags argument checks and modules (the
    check below would then pass vacuously or be allow-listed into uselessness)."""
    flagged = [
        "isinstance(comm, (InMemoryCommunicationBackend, GlooCommunicationBackend))",
        "isinstance(self.comm, gpudist.comm.NCCLCommunicationBackend)",
        'hasattr(comm, "shutdown")',
        'getattr(self.comm, "shared_memory", False)',
        'getattr(intra_comm, "topology", None)',
        'hasattr(self.model, "abort")',
        'getattr(group, "ordered_p2p")',
    ]
    for text in flagged:
        assert probes(text), f"not flagged: {text}"
    legitimate = [
        "isinstance(group, CommunicationBackend)",
        "isinstance(e, CommunicationTimeoutError)",
        'getattr(config, "backend", None)',
        'getattr(model, "checkpoint_group", model.comm)',
        "from . import comm\ngetattr(comm, name)",
        "isinstance(zero_stage, bool)",
        "isinstance(op, ReductionOperation)",
    ]
    for text in legitimate:
        assert not probes(text), f"flagged: {text}"


def test_nothing_above_comm_probes_a_transport():
    """Catches code above gpudist/comm/ asking which transport it holds or whether it has a member (the live trainer's
    ``isinstance(comm, (InMemory..., Gloo..., NCCL...))`` before abort and ``hasattr(comm, "shutdown")``, DDP's
    ``getattr(self.comm, "shared_memory", False)``): a new transport, or a wrapper, silently takes the wrong branch
    there. Ask the contract instead (every capability is declared on CommunicationBackend with a default)."""
    found = [
        f"{path.relative_to(ROOT)}:{line}: {text}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if COMM not in path.parents
        for line, text in probes(path.read_text(), str(path))
    ]
    assert not found, "transport probes above gpudist/comm/ (use the contract's members):\n" + "\n".join(found)


# -- (b) every transport honours the contract --------------------------------------------------------------------------


def test_every_capability_is_declared_on_the_contract():
    """Catches a capability that strategies or live mode use but the contract does not declare (so a transport
    without it raises AttributeError, or callers go back to probing with getattr/hasattr)."""
    for name in CAPABILITIES:
        assert name in vars(CommunicationBackend), f"CommunicationBackend does not declare {name}"
    assert CommunicationBackend.shared_memory is False
    assert inspect.signature(CommunicationBackend.abort).parameters["reason"].default is None
    assert list(inspect.signature(CommunicationBackend.shutdown).parameters) == ["self"]


def test_every_transport_takes_the_contract_s_signatures():
    """Catches a transport whose abort or shutdown cannot be called as the contract says (MPI's ``abort(code)``
    ended the whole job, the in-memory ``abort(reason)`` required its reason): live mode calls ``comm.abort(reason)``
    and ``comm.shutdown()`` on whatever transport it holds."""
    assert {cls.__name__ for cls in _transports()} == {
        "GlooCommunicationBackend",
        "InMemoryCommunicationBackend",
        "MPICommunicationBackend",
        "NCCLCommunicationBackend",
    }, "a new transport: add it to the contract tests below"
    for cls in _transports():
        abort = inspect.signature(cls.abort)
        assert list(abort.parameters)[:2] == ["self", "reason"], cls
        assert abort.parameters["reason"].default is None, cls
        assert all(p.default is not p.empty for p in list(abort.parameters.values())[1:]), cls
        shutdown = inspect.signature(cls.shutdown)
        assert all(p.default is not p.empty for p in list(shutdown.parameters.values())[1:]), cls


def _honours(comm: CommunicationBackend, first: str) -> dict:
    """abort and shutdown, each twice, ``first`` first; what an op said after."""
    shared = comm.shared_memory
    agreed = comm.agreed.shared_memory  # the wrapper reads through
    calls = [lambda: comm.abort("leaving"), lambda: comm.shutdown()]
    for call in calls if first == "abort" else calls[::-1]:
        call()
        call()  # idempotent
    try:
        comm.barrier()
        after = None
    except CommunicationError as e:
        after = str(e)
    return {"shared": shared, "agreed": agreed, "after": after, "healthy": comm.healthy}


def _assert_honoured(results: list[dict], shared: bool) -> None:
    for res in results:
        assert type(res["shared"]) is bool and res["shared"] is shared and res["agreed"] is shared
        assert res["after"] is not None, "an op after abort and shutdown did not raise"
        assert not res["healthy"]


@pytest.mark.parametrize("first", ["abort", "shutdown"])
def test_inmemory_honours_the_contract(first):
    """Catches an in-memory group whose abort needs its reason or whose shutdown is missing (live mode's retired
    groups), or one that reports shared memory (DDP would then launch its buckets at the end of backward)."""
    _assert_honoured(run_ranks(_honours, 2, "inmemory", first=first), shared=False)


def _on_threads(rank, size: int) -> list:
    """``rank(r)`` for every rank ``r`` of ``size``, each on a thread of its own; the results in rank order."""
    results, errors = [None] * size, []

    def run(r: int) -> None:
        try:
            results[r] = rank(r)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


def _gloo_pair(shm: bool, first: str) -> list[dict]:
    """Two Gloo ranks as threads of this process (one store), fresh groups: the contract on each."""
    store, name = dist.HashStore(), f"contract-{uuid.uuid4().hex[:8]}"

    def rank(r: int) -> dict:
        pg = dist.ProcessGroupGloo(store, r, 2, dist.default_pg_timeout)
        comm = GlooCommunicationBackend(
            timeout=30.0, _gloo=pg, _store=store, _rank_world=(r, 2), _group_name=name, shm=shm
        )
        comm.barrier()  # both formed before either leaves
        return _honours(comm, first)

    return _on_threads(rank, 2)


@pytest.mark.parametrize("first", ["abort", "shutdown"])
@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
def test_gloo_honours_the_contract(shm, first):
    """Catches Gloo's shared_memory not being a bool that says which path its collectives take (DDP reads it through
    the contract now), and an abort or shutdown that is not idempotent in either order."""
    _assert_honoured(_gloo_pair(shm, first), shared=shm)


@pytest.mark.parametrize("first", ["abort", "shutdown"])
def test_nccl_honours_the_contract(first):
    """Catches an NCCL backend without the contract's shared_memory, or whose ops still reach the destroyed
    communicator after shutdown instead of raising a CommunicationError."""
    fake = FakeNccl()
    with installed(fake):
        comm = NCCLCommunicationBackend(0, 1, fake.get_unique_id(), timeout=5.0)
        _assert_honoured([_honours(comm, first)], shared=False)


# -- a simulated mpi4py: in-process ranks, point-to-point matched in posting order -------------------------------------


class _Request:
    def __init__(self):
        self.done = False


class _Fabric:
    """The wire between fake MPI ranks: the k-th send from a to b on a tag meets b's k-th receive from a on it."""

    def __init__(self, size: int):
        self.size, self.lock = size, threading.Lock()
        self.sends: dict[tuple[int, int, int], list] = {}
        self.recvs: dict[tuple[int, int, int], list] = {}

    def post(self, side: str, key: tuple[int, int, int], buf: np.ndarray) -> _Request:
        request = _Request()
        with self.lock:
            mine, theirs = (self.sends, self.recvs) if side == "send" else (self.recvs, self.sends)
            if theirs.get(key):
                other, other_request = theirs[key].pop(0)
                source, target = (buf, other) if side == "send" else (other, buf)
                assert source.nbytes == target.nbytes, "MPI_ERR_TRUNCATE: the handshake let a mismatch through"
                target.view(np.uint8)[:] = source.view(np.uint8)
                request.done = other_request.done = True
            else:
                mine.setdefault(key, []).append((buf, request))
        return request


class _FakeComm:
    def __init__(self, fabric: _Fabric, rank: int):
        self.fabric, self.rank, self.freed, self.aborted = fabric, rank, 0, None

    def Set_errhandler(self, handler) -> None:
        pass

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.fabric.size

    def Isend(self, buf, dest: int, tag: int) -> _Request:
        return self.fabric.post("send", (self.rank, dest, tag), buf)

    def Irecv(self, buf, source: int, tag: int) -> _Request:
        return self.fabric.post("recv", (source, self.rank, tag), buf)

    def Free(self) -> None:
        self.freed += 1

    def Abort(self, code: int) -> None:
        self.aborted = code


class _FakeMPI:
    """What MPICommunicationBackend uses of ``mpi4py.MPI`` for point-to-point, abort and shutdown."""

    ERRORS_RETURN, SUM, MAX, MIN, PROD, UNDEFINED, IN_PLACE, THREAD_MULTIPLE = range(8)

    class Request:
        @staticmethod
        def Testall(requests: list) -> bool:
            return all(r.done for r in requests)

    def __init__(self):
        self.COMM_WORLD = object()  # the fake ranks' communicators are sub-groups: shutdown frees them

    def Query_thread(self) -> int:
        return self.THREAD_MULTIPLE


@pytest.fixture
def fake_mpi(monkeypatch):
    fake = _FakeMPI()
    monkeypatch.setattr(mpi_module, "_mpi", lambda: fake)
    return fake


def _mpi_ranks(fn, size: int = 2, **kwargs) -> list:
    """``fn(comm, **kwargs)`` on ``size`` fake MPI ranks (threads); the results in rank order."""
    fabric = _Fabric(size)
    return _on_threads(lambda r: fn(MPICommunicationBackend(_FakeComm(fabric, r), timeout=10.0), **kwargs), size)


@pytest.mark.parametrize("first", ["abort", "shutdown"])
def test_mpi_honours_the_contract(fake_mpi, first):
    """Catches MPI's abort ending the whole job (``MPI_Abort``: live mode calls abort on a group it leaves and goes
    on) and a shutdown that frees its communicator twice."""
    comm = MPICommunicationBackend(_FakeComm(_Fabric(1), 0), timeout=5.0)
    _assert_honoured([_honours(comm, first)], shared=False)
    assert comm._comm.aborted is None and comm._comm.freed == 1
    comm.abort_job(3)
    assert comm._comm.aborted == 3


def _pending_recv_released_by_abort(comm: MPICommunicationBackend) -> dict:
    if comm.rank == 1:
        return {}
    work = comm.recv(torch.zeros(4), 1, async_op=True)  # rank 1 never sends
    threading.Timer(0.2, comm.abort, args=("a member died",)).start()
    start = time.monotonic()
    try:
        work.wait()
        error = None
    except CommunicationError as e:
        error = str(e)
    return {"error": error, "elapsed": time.monotonic() - start}


def test_mpi_abort_releases_a_pending_wait(fake_mpi):
    """Catches an MPI abort that leaves this rank's pending receive waiting out the op timeout (10 s here)."""
    res = _mpi_ranks(_pending_recv_released_by_abort)[0]
    assert "a member died" in res["error"] and res["elapsed"] < 5.0


# -- (c) one point-to-point handshake ----------------------------------------------------------------------------------


def _exchange(comm: MPICommunicationBackend | GlooCommunicationBackend, sent: int, posted: int) -> dict:
    """Rank 0 sends ``sent`` elements to rank 1, which posts ``posted``; each side's outcome."""
    try:
        if comm.rank == 0:
            comm.send(torch.arange(sent, dtype=torch.float32), 1)
            return {"error": None}
        got = torch.zeros(posted)
        comm.recv(got, 0)
        return {"error": None, "got": got.tolist()}
    except CollectiveMismatchError as e:
        return {"error": str(e)}


def test_mpi_runs_the_shared_handshake(fake_mpi):
    """Catches a break in MPI's half of the shared handshake (its tags, buffers or the order of its moves), which
    the MPI tier alone would see: a matching pair delivers, a mismatched one raises on both ranks naming both."""
    assert _mpi_ranks(_exchange, sent=3, posted=3)[1]["got"] == [0.0, 1.0, 2.0]
    sender, receiver = _mpi_ranks(_exchange, sent=4, posted=3)
    for res in (sender, receiver):
        assert "rank 0 sent shape=(4,)" in res["error"] and "rank 1 posted recv(shape=(3,)" in res["error"]


def _defined_and_used(path: Path) -> tuple[set[str], set[str]]:
    """(functions defined, dotted names used) in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    used |= {ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    return defined, used


@pytest.mark.parametrize("transport", ["gloo", "mpi"])
def test_gloo_and_mpi_share_one_handshake(transport):
    """Catches the handshake written again inside a transport (Gloo and MPI each had their own ``_send_checked``, the
    signature decode and compare, the dummy payload and both mismatch errors): a fix to one would miss the other."""
    defined, used = _defined_and_used(COMM / f"{transport}.py")
    assert "_send_checked" not in defined
    own = {"SIGNATURE_LEN", "p2p_mismatch_error", "Signature.decode", "ThreadPoolExecutor"} & used
    assert not own, f"{transport}.py handles the handshake itself: {sorted(own)}"
    assert {"self._handshake.send", "self._handshake.recv"} <= used, f"{transport}.py does not use the handshake"
