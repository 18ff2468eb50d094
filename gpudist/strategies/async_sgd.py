"""AsyncSGDOptimizer: workers push gradients to parameter-server shards and pull parameters, without waiting for
each other (bounded staleness).

Every rank is a worker and serves one shard of the flat parameter vector (``shard_range``), with that shard's
optimizer state. A background thread per rank serves its shard over its own authenticated loopback/TCP sockets
(addresses exchanged once through the backend), so the training loop never enters a collective while it trains.

The rules, per shard (each shard keeps its own version counter):

* The shard applies updates in *rounds*: once it holds ``quorum`` gradients (the number of workers still
  training, at most the world size), it averages them and steps the wrapped optimizer's algorithm once.
  Hyper-parameters (lr, ...) are read from the owning rank's ``param_groups``, so LR schedulers work.
* A gradient computed on version ``v`` that arrives while the shard is at version ``V`` has staleness ``V - v``;
  above ``max_staleness`` it is **dropped** (counted in ``stats["dropped"]``) and the worker simply pulls newer
  parameters.
* A worker computes at most ``max_staleness + 1`` gradients on one version; after that its pull **waits** for
  the next version (up to the backend's timeout).

With ``max_staleness=0`` every round holds exactly one gradient of each worker, all computed on the same version:
synchronous SGD on the global batch, for any wrapped optimizer. With ``max_staleness >= 1`` a slow worker no longer
holds the others back: the fast ones fill rounds with up to ``max_staleness + 1`` gradients each per version.
A worker that stops (``finish()``) leaves the quorum, so the others go on. A rank that dies takes its shard with it:
every other worker's next push or pull to that shard raises :class:`CommunicationError` naming the shard's rank.

Setup is hardened against other local processes: each shard accepts connections until every worker has
authenticated (a shared random key) and said which rank it is, within the backend's timeout; a connection with a
wrong key, garbage or nothing at all is dropped after at most ``_HANDSHAKE_SECONDS`` without holding up the others.
When a worker never connects, every rank raises one error naming the shards and the ranks missing from them.
"""

from __future__ import annotations

import inspect
import ipaddress
import os
import secrets
import socket
import struct
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

import numpy as np
import torch
from torch import nn

from ..comm import CommunicationError, CommunicationTimeoutError, shard_range, stable_hash
from ..config import ShardingConfiguration
from ..flat import broadcast_tensors, exchange_bytes
from .model import same_on_every_rank
from .optimizer import ShardedOptimizer

__all__ = ["AsyncSGDOptimizer"]

_HEADER = struct.Struct("<Biq")  # kind, worker rank, version tag (push) or needed version (pull)
_HELLO, _PUSH, _PULL, _DONE = range(4)
_FINAL = -1
"""A pull that waits until every worker has finished (the last rounds applied): the final parameters."""
_TIMED_OUT = -2
"""The version in a pull's reply when the shard gave up waiting; the reply carries the reason."""


_HANDSHAKE_SECONDS = 10.0
"""Bound (with the backend's timeout, whichever is shorter) on one connection's setup: authentication both ways and
the hello naming the worker's rank. A real worker needs milliseconds; a silent or foreign connection is dropped
after this, in its own thread, so it never delays the real workers."""


def _set_io_timeout(sock: socket.socket, seconds: float) -> None:
    """Make blocking reads and writes on ``sock`` give up after ``seconds`` (0: never). Set as SO_RCVTIMEO/SO_SNDTIMEO
    because a Connection reads and writes the descriptor with os.read/os.write, which Python's socket timeouts (a
    non-blocking descriptor) would turn into immediate BlockingIOErrors; these make them wait, then fail."""
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def _connection(sock: socket.socket, timeout: float) -> Connection:
    """A Connection over a connected socket, Nagle off (a Connection writes a length header and then the payload;
    with Nagle plus delayed ACKs every large message waited ~40 ms for the peer's ACK of the header) and reads and
    writes bounded by ``timeout`` seconds until :func:`_unbounded`."""
    sock.setblocking(True)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _set_io_timeout(sock, timeout)
    return Connection(sock.detach())


def _unbounded(conn: Connection) -> Connection:
    """Lift the setup bound of :func:`_connection`: once set up, a pull may wait as long as the staleness rule says
    (``_receive`` bounds it with the backend's timeout)."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        _set_io_timeout(sock, 0)
    return conn


def _ps_host() -> str:
    """The address this rank's shard server listens on: ``GPUDIST_PS_HOST``, else loopback when the job is on one
    machine (``MASTER_ADDR`` unset or loopback), else the local address that routes to ``MASTER_ADDR``."""
    if os.environ.get("GPUDIST_PS_HOST"):
        return os.environ["GPUDIST_PS_HOST"]
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        if ipaddress.ip_address(socket.gethostbyname(master)).is_loopback:
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master, 9))
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _same_algorithm(optimizer: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class over ``groups`` (its defaults, limited to what the constructor
    takes: AdamW's defaults hold ``decoupled_weight_decay``, which its constructor refuses)."""
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    return cls(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})


class _ShardServer:
    """One rank's parameter-server shard: master values of flat[lo:hi], their optimizer, and the round state."""

    def __init__(self, owner: AsyncSGDOptimizer, lo: int, hi: int, values: torch.Tensor, authkey: bytes):
        self.owner, self.lo, self.hi = owner, lo, hi
        self.rank = owner.comm.rank
        self.world = owner.comm.world_size
        self.max_staleness = owner.max_staleness
        self.master = values.detach().to(torch.float32).clone()
        self.version = 0
        self.pending: list[tuple[int, int, torch.Tensor]] = []  # (worker, arrival, gradient) of the open round
        self.arrivals = 0
        self.active = set(range(self.world))
        self.cond = threading.Condition()
        self.stats = {"rounds": 0, "accepted": 0, "dropped": 0, "max_staleness_seen": 0}
        # The wrapped optimizer's algorithm over views of the master values, one param group per piece.
        self.pieces: list[tuple[int, int, int]] = []  # (group, start, end) in shard coordinates
        begin = 0
        for g, end in enumerate(owner._group_ends):
            a, b = max(lo, begin), min(hi, end)
            if a < b:
                self.pieces.append((g, a - lo, b - lo))
            begin = end
        self.views = [nn.Parameter(self.master[a:b]) for _, a, b in self.pieces]
        groups = [{"params": [v], **owner._hyper(g)} for v, (g, _, _) in zip(self.views, self.pieces, strict=True)]
        self.inner = _same_algorithm(owner.optimizer, groups) if groups else None
        self.authkey = authkey
        self.handshake_seconds = min(_HANDSHAKE_SECONDS, owner.comm.timeout)
        self.deadline = time.monotonic() + owner.comm.timeout
        self.connected: set[int] = set()  # workers that authenticated and said hello
        self.dropped: list[str] = []  # why foreign connections were dropped, for the setup error
        self.closed = False
        host = _ps_host()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.create_server((host, 0), family=family, backlog=max(128, self.world))
        self.listener.settimeout(0.2)  # the acceptor looks at the deadline and `closed` this often
        self.address = self.listener.getsockname()[:2]
        self.acceptor = threading.Thread(target=self._accept, name=f"gpudist-ps{self.rank}", daemon=True)
        self.acceptor.start()

    # -- connections ------------------------------------------------------------------------------------------------

    def _accept(self) -> None:
        """Accept until every worker has connected (or the setup deadline passes, or close()); each connection is set
        up in its own thread, so a silent one cannot hold up the others."""
        try:
            while not self.closed and time.monotonic() < self.deadline:
                with self.cond:
                    if len(self.connected) == self.world:
                        break
                try:
                    sock, peer = self.listener.accept()
                except TimeoutError:
                    continue
                threading.Thread(
                    target=self._handshake, args=(sock, peer), daemon=True, name=f"gpudist-ps{self.rank}-conn"
                ).start()
        except OSError:
            pass  # the listener was closed (close())
        finally:
            self.listener.close()
            with self.cond:
                self.cond.notify_all()

    def _handshake(self, sock: socket.socket, peer: Any) -> None:
        """Authenticate a new connection both ways and read its hello (within ``handshake_seconds``); then serve it,
        or drop it when anything is wrong: a wrong key, garbage, silence, an unknown or duplicate rank."""
        conn = _connection(sock, self.handshake_seconds)
        try:
            deliver_challenge(conn, self.authkey)
            answer_challenge(conn, self.authkey)
            kind, worker, _ = _HEADER.unpack(conn.recv_bytes(_HEADER.size))
            if kind != _HELLO or not 0 <= worker < self.world:
                raise ValueError(f"a hello of kind {kind} from rank {worker}")
            with self.cond:
                if worker in self.connected:
                    raise ValueError(f"a second connection claiming rank {worker}")
                self.connected.add(worker)
                self.cond.notify_all()
        except Exception as e:  # whatever a foreign peer sent or did not send: drop it, keep accepting
            with self.cond:
                if len(self.dropped) < 8:
                    self.dropped.append(f"{peer}: {type(e).__name__}: {e}")
            conn.close()
            return
        self._serve(_unbounded(conn), worker)

    def wait_for_workers(self) -> list[int]:
        """Wait until every worker has connected or the setup deadline passed; return the ranks still missing."""
        with self.cond:
            self.cond.wait_for(
                lambda: len(self.connected) == self.world or self.closed, max(0.0, self.deadline - time.monotonic())
            )
            return sorted(set(range(self.world)) - self.connected)

    def _serve(self, conn: Connection, worker: int) -> None:
        try:
            while True:
                msg = conn.recv_bytes()
                kind, _, tag = _HEADER.unpack_from(msg)  # the sender is `worker`, as authenticated
                if kind == _PUSH:
                    grad = torch.from_numpy(np.frombuffer(msg, dtype=np.float32, offset=_HEADER.size).copy())
                    self._push(worker, tag, grad)
                elif kind == _PULL:
                    try:
                        version, values = self._pull(tag)
                    except CommunicationTimeoutError as e:  # tell the worker why, rather than go quiet
                        conn.send_bytes(struct.pack("<q", _TIMED_OUT) + str(e).encode())
                        continue
                    conn.send_bytes(struct.pack("<q", version) + values.numpy().tobytes())
                elif kind == _DONE:
                    self._leave(worker)
                    conn.send_bytes(b"ok")
        except (EOFError, OSError):
            pass  # the worker closed its connection (finished) or died: either way it leaves the quorum
        finally:
            conn.close()
            self._leave(worker)

    # -- the parameter-server rules ---------------------------------------------------------------------------------

    def _push(self, worker: int, tag: int, grad: torch.Tensor) -> None:
        with self.cond:
            staleness = self.version - tag
            if staleness > self.max_staleness:
                self.stats["dropped"] += 1
                return
            self.stats["accepted"] += 1
            self.stats["max_staleness_seen"] = max(self.stats["max_staleness_seen"], staleness)
            self.pending.append((worker, self.arrivals, grad))
            self.arrivals += 1
            if len(self.pending) >= max(1, len(self.active)):
                self._apply()

    def _leave(self, worker: int) -> None:
        with self.cond:
            if worker not in self.active:
                return
            self.active.discard(worker)
            if self.pending and len(self.pending) >= len(self.active):
                self._apply()  # the round no longer waits for this worker (all gone: the last partial round)
            self.cond.notify_all()

    def _apply(self) -> None:
        """Average the open round's gradients (summed in worker order: reproducible) and step. Holds the lock."""
        grads = [g for _, _, g in sorted(self.pending, key=lambda item: item[:2])]
        mean = grads[0].clone()
        for g in grads[1:]:
            mean += g
        mean /= len(grads)
        self.pending.clear()
        if self.inner is not None:
            for view, (_, a, b) in zip(self.views, self.pieces, strict=True):
                view.grad = mean[a:b]
            for group, (g, _, _) in zip(self.inner.param_groups, self.pieces, strict=True):
                group.update(self.owner._hyper(g))  # follow LR schedulers on the owner's param_groups
            with torch.no_grad():
                self.inner.step()
        self.version += 1
        self.stats["rounds"] += 1
        self.cond.notify_all()

    def _pull(self, need: int) -> tuple[int, torch.Tensor]:
        timeout = self.owner.comm.timeout
        with self.cond:
            ready = (lambda: not self.active) if need == _FINAL else (lambda: self.version >= need)
            if not self.cond.wait_for(ready, timeout):
                raise CommunicationTimeoutError(
                    f"parameter-server shard {self.owner.comm.rank} waited {timeout:g}s for "
                    f"{'every worker to finish' if need == _FINAL else f'version {need}'} (at version "
                    f"{self.version}, {len(self.pending)} of {len(self.active)} gradients of the open round; "
                    f"workers still training: {sorted(self.active)})",
                    op="async_pull",
                    group=self.owner.comm.group,
                    rank=self.owner.comm.rank,
                )
            return self.version, self.master.clone()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        try:
            self.listener.close()
        except OSError:
            pass


class AsyncSGDOptimizer(ShardedOptimizer):
    """Asynchronous data parallelism through parameter-server shards with bounded staleness (see the module doc).

    Use it with a plain module (no model wrapper: a ``DDPModel`` would all-reduce in every backward and wait for
    every rank). Construction is collective: rank 0's parameters are broadcast, and each rank starts serving its
    shard. ``step()`` pushes this rank's gradients and pulls newer parameters; it does not wait for other workers
    unless the staleness bound says so. Call :meth:`finish` (on every rank) when training ends: it leaves the
    quorum, waits for the last rounds, and gives every rank the same final parameters.

    ``stats`` (this rank's shard and worker): rounds applied, gradients accepted and dropped, the largest
    staleness accepted, and the seconds this worker spent waiting in pulls.

    Args:
        optimizer: A ``torch.optim.Optimizer`` over a plain module's fp32 parameters; each shard runs its
            algorithm (and reads its ``param_groups``' hyper-parameters) on the shard's values.
        config: The configuration (its ``backend`` exchanges the shard addresses; ``max_grad_norm`` must be
            None).
        max_staleness: The staleness bound (>= 0; 0 is synchronous SGD), as described in the module doc.

    Raises:
        TypeError: When ``optimizer`` is not a ``torch.optim.Optimizer`` (or is already wrapped), ``config`` is
            not a ``ShardingConfiguration``, or a model wrapper built from ``config`` reduces the parameters.
        ValueError: When ``max_staleness`` is not an int >= 0, ``config.max_grad_norm`` is set, the optimizer has
            no parameter that requires grad or has parameters that are not fp32, or another rank's parameter
            groups or shapes differ.
        CommunicationError: (On every rank) When a worker did not connect to every shard within the backend's
            timeout; the message names the shards and the missing ranks.
    """

    strategy = "async"

    def __init__(self, optimizer: torch.optim.Optimizer, config: ShardingConfiguration, max_staleness: int = 4):
        super().__init__(optimizer, config)
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(
                f"max_staleness={max_staleness!r} must be an integer >= 0 (0 is synchronous SGD; "
                "1-8 lets fast workers run ahead of a straggler)"
            )
        if self.model() is not None:
            raise TypeError(
                f"AsyncSGDOptimizer needs a plain module, but {type(self.model()).__name__} (same config) "
                "reduces gradients in every backward, which waits for every rank; pass the unwrapped "
                "module's parameters"
            )
        if config.max_grad_norm is not None:
            raise ValueError(
                "AsyncSGDOptimizer does not clip gradients (no global norm exists without a collective); "
                "set max_grad_norm=None or clip the local gradients before step()"
            )
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if not params:
            raise ValueError("AsyncSGDOptimizer: the optimizer has no parameters that require grad")
        if any(p.dtype != torch.float32 for p in params):
            raise ValueError(
                f"AsyncSGDOptimizer needs fp32 parameters, got {sorted({str(p.dtype) for p in params})}; "
                "call model.float() first"
            )
        self.max_staleness = max_staleness
        self._flat_params = params
        self._numels = [p.numel() for p in params]
        ends, offset = [], 0
        for g in self.param_groups:
            offset += sum(p.numel() for p in g["params"] if p.requires_grad)
            ends.append(offset)
        self._group_ends = ends
        comm = self.comm
        layout = [len(g["params"]) for g in self.param_groups] + [s for p in params for s in (*p.shape, -1)]
        if not same_on_every_rank(comm, stable_hash(layout)):
            raise ValueError(
                f"AsyncSGDOptimizer: rank {comm.rank}'s parameter groups or shapes differ from another "
                "rank's; every rank must build the same model and optimizer"
            )
        broadcast_tensors(comm, [p.data for p in params], 0)
        total = offset
        self._ranges = [shard_range(total, comm.world_size, r) for r in range(comm.world_size)]
        lo, hi = self._ranges[comm.rank]
        authkey = exchange_bytes(comm, secrets.token_bytes(32))[0]
        self._conns: list[Connection] = []
        self._finished = False
        self._server = _ShardServer(self, lo, hi, self._flat()[lo:hi], authkey)
        host, port = self._server.address
        addresses = [b.decode().rsplit(":", 1) for b in exchange_bytes(comm, f"{host}:{port}".encode())]
        self._set_up([(h, int(p)) for h, p in addresses], authkey)
        self._versions = [0] * comm.world_size  # per shard: the version this worker's parameters come from
        self._used = [0] * comm.world_size  # per shard: gradients pushed on that version
        self.wait_seconds = 0.0
        self.steps = 0
        self.bytes_moved = 0
        """Bytes this worker sent to and received from the shards (gradients out, parameters in)."""

    # -- setup ------------------------------------------------------------------------------------------------------

    def _set_up(self, addresses: list[tuple[str, int]], authkey: bytes) -> None:
        """Connect to every shard, wait until every worker has connected to this rank's shard, and agree on the
        outcome with the other ranks: every rank returns, or every rank raises the same error naming what failed."""
        comm = self.comm
        problem = ""
        try:
            for r, (host, port) in enumerate(addresses):
                self._conns.append(self._connect(r, host, port, authkey))
            missing = self._server.wait_for_workers()
            if missing:
                dropped = f"; connections dropped: {self._server.dropped}" if self._server.dropped else ""
                problem = (
                    f"ranks {missing} never connected to the parameter-server shard of rank {comm.rank} within "
                    f"{comm.timeout:g}s{dropped}"
                )
        except CommunicationError as e:
            problem = str(e)
        problems = [b.decode() for b in exchange_bytes(comm, problem.encode()) if b]
        if problems:
            self.close()
            raise CommunicationError(
                "AsyncSGDOptimizer setup failed: " + "; ".join(problems) + " (check that every rank builds the "
                "optimizer, and that nothing blocks the shards' addresses)",
                op="async_setup",
                group=comm.group,
                rank=comm.rank,
            )

    def _connect(self, shard: int, host: str, port: int, authkey: bytes) -> Connection:
        """This worker's connection to ``shard``'s server: authenticated both ways and introduced by a hello, each
        step bounded by the handshake timeout."""
        seconds = min(_HANDSHAKE_SECONDS, self.comm.timeout)
        try:
            conn = _connection(socket.create_connection((host, port), timeout=seconds), seconds)
            try:
                answer_challenge(conn, authkey)
                deliver_challenge(conn, authkey)
                conn.send_bytes(_HEADER.pack(_HELLO, self.comm.rank, 0))
            except BaseException:
                conn.close()
                raise
        except (OSError, EOFError, AuthenticationError) as e:
            raise self._shard_error(
                shard, "async_setup", f"could not connect to {host}:{port}, the address", e
            ) from None
        return _unbounded(conn)

    def _shard_error(self, shard: int, op: str, what: str, cause: BaseException | None = None) -> CommunicationError:
        detail = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
        return CommunicationError(
            f"{op} on rank {self.comm.rank} failed: {what} of the parameter-server shard of rank {shard}{detail}; "
            f"rank {shard} died, closed its optimizer or cannot be reached",
            op=op,
            group=self.comm.group,
            rank=self.comm.rank,
        )

    def _send(self, shard: int, payload: bytes, op: str) -> None:
        try:
            self._conns[shard].send_bytes(payload)
        except OSError as e:  # BrokenPipeError, ConnectionResetError, ...
            raise self._shard_error(shard, op, "the connection went away while sending to", e) from None

    # -- helpers ----------------------------------------------------------------------------------------------------

    def _hyper(self, group: int) -> dict[str, Any]:
        return {k: v for k, v in self.param_groups[group].items() if k != "params"}

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in self._flat_params])

    def _flat_grads(self) -> torch.Tensor:
        return torch.cat(
            [
                (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).to("cpu", torch.float32)
                for p in self._flat_params
            ]
        )

    def _receive(self, shard: int, op: str) -> bytes:
        conn = self._conns[shard]
        try:
            if not conn.poll(self.comm.timeout + 5.0):  # the shard's own timeout answers first, with its reason
                raise CommunicationTimeoutError(
                    f"{op} on rank {self.comm.rank} failed: no reply from the parameter-server shard of rank {shard} "
                    f"within {self.comm.timeout:g}s",
                    op=op,
                    group=self.comm.group,
                    rank=self.comm.rank,
                )
            return conn.recv_bytes()
        except (EOFError, OSError) as e:  # EOFError, ConnectionResetError, ...
            raise self._shard_error(shard, op, "the connection went away while waiting for a reply", e) from None

    def _pull_all(self, needs: list[int], op: str = "async_pull") -> None:
        start = time.perf_counter()
        for r, need in enumerate(needs):
            self._send(r, _HEADER.pack(_PULL, self.comm.rank, need), op)
        shards = []
        for r in range(len(self._conns)):
            reply = self._receive(r, op)
            (version,) = struct.unpack_from("<q", reply)
            if version == _TIMED_OUT:
                raise CommunicationTimeoutError(
                    reply[8:].decode(), op="async_pull", group=self.comm.group, rank=self.comm.rank
                )
            if version != self._versions[r]:
                self._versions[r], self._used[r] = version, 0
            shards.append(torch.from_numpy(np.frombuffer(reply, dtype=np.float32, offset=8).copy()))
            self.bytes_moved += len(reply) - 8
        self.wait_seconds += time.perf_counter() - start
        flat = torch.cat(shards)
        with torch.no_grad():
            for p, values in zip(self._flat_params, flat.split(self._numels), strict=True):
                p.copy_(values.view_as(p))

    # -- the optimizer ----------------------------------------------------------------------------------------------

    def reduce_gradients(self) -> None:
        """Nothing to reduce: gradients go to the parameter-server shards as they are (see :meth:`step`)."""

    def capture_refusal(self) -> str | None:
        """Asynchronous SGD waits on other ranks' progress on the host: not captured."""
        return "asynchronous SGD waits on other ranks' progress on the host; run it eagerly"

    def step(self, closure=None):
        """Push this rank's gradients to every shard and pull newer parameters (waits only as the bound says).

        Args:
            closure: Re-evaluates the model and returns the loss; None: use the gradients already computed.

        Returns:
            The closure's loss, or None without a closure.

        Raises:
            RuntimeError: When called after :meth:`finish` (or :meth:`close`).
            CommunicationTimeoutError: When a pull waited longer than the backend's timeout for a newer version.
            CommunicationError: When a shard's rank went away (died).
        """
        if self._finished:
            raise RuntimeError("AsyncSGDOptimizer.step() after finish(); build a new optimizer to train again")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = self._flat_grads()
        for r in range(len(self._conns)):
            lo, hi = self._ranges[r]
            header = _HEADER.pack(_PUSH, self.comm.rank, self._versions[r])
            self._send(r, header + grads[lo:hi].numpy().tobytes(), "async_push")
            self._used[r] += 1
            self.bytes_moved += (hi - lo) * 4
        # Another gradient on the same version is allowed up to max_staleness + 1 times; then wait for the next one.
        self._pull_all(
            [v + 1 if used > self.max_staleness else 0 for v, used in zip(self._versions, self._used, strict=True)]
        )
        self.steps += 1
        return loss

    def finish(self) -> None:
        """Leave the quorum, wait until every worker has finished and the last rounds are applied, and load the final
        parameters (the same on every rank). Call it on every rank after the last step; then the shards stop.

        Raises:
            CommunicationTimeoutError: When the other workers did not all finish within the backend's timeout.
            CommunicationError: When a shard's rank went away (died).
        """
        if self._finished:
            return
        for r in range(len(self._conns)):
            self._send(r, _HEADER.pack(_DONE, self.comm.rank, 0), "async_finish")
        for r in range(len(self._conns)):
            self._receive(r, "async_finish")
        self._pull_all([_FINAL] * len(self._conns), "async_finish")
        self._finished = True
        for conn in self._conns:
            conn.close()
        self._server.close()

    def close(self) -> None:
        """Stop serving without waiting for the others (e.g. on an error); ``finish`` is the normal way out."""
        self._finished = True
        for conn in self._conns:
            conn.close()
        self._server.close()

    @property
    def stats(self) -> dict[str, float]:
        """This rank's shard (``rounds``, ``accepted``, ``dropped``, ``max_staleness_seen``, ``version``) and worker
        (``steps``, ``wait_seconds``, ``bytes_moved``) counters."""
        with self._server.cond:
            out = dict(self._server.stats)
        out["version"] = self._server.version
        out["steps"] = self.steps
        out["wait_seconds"] = self.wait_seconds
        out["bytes_moved"] = self.bytes_moved
        return out

    def state_dict(self) -> dict[str, Any]:
        """Not supported: the optimizer state lives on the parameter-server shards.

        Raises:
            NotImplementedError: Always; save the model after :meth:`finish` instead.
        """
        raise NotImplementedError(
            "AsyncSGDOptimizer keeps its optimizer state on the parameter-server shards and "
            "has no checkpoint format yet; save the model after finish()"
        )

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
