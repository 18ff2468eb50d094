"""The point-to-point handshake of the CPU process transports (Gloo, MPI): how a validated ``send`` learns the shape
its receiver posted before any payload moves, defined once.

Neither transport can be left to find a mismatch itself: Gloo aborts the process on a message longer than the posted
buffer and silently delivers a short one into a larger buffer, and MPI reports a longer message only as a truncation
error of the receiver's and a shorter one not at all. So the
receiver tells the sender what it posted, on a channel of its own (the *handshake* channel), and the sender answers
on the payload channel with its own signature (the *status*) and then the payload, or zeros of the posted shape when
the two differ, so that the receive completes cleanly and both ends raise :class:`CollectiveMismatchError`::

    receiver (posts all three at once):   send(its signature, handshake) ; recv(status) ; recv(payload)
    sender (blocking, on its own thread): recv(expected, handshake) ; send(status) ; send(payload or zeros)

The handshake has a channel apart from the payloads so that a pair can exchange in both directions at once. The
sender's half runs on one background thread per backend, in issue order, so a blocking ``send`` never waits for a
``recv`` this rank posts later (``isend(); recv(); wait()`` cannot deadlock), and the k-th send to a peer meets the
k-th receive from it (both transports deliver in order per peer and channel). A transport supplies the three moves
on its own wire (:meth:`Handshake.send`'s ``receive_expected`` and ``answer``, :meth:`Handshake.recv`'s ``post``);
everything else is here.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from .signature import SIGNATURE_LEN, Signature, p2p_mismatch_error
from .work import Work

__all__ = ["Handshake"]

Posted = TypeVar("Posted")


class Handshake:
    """One backend's end of the in-order point-to-point handshake (see the module doc).

    Args:
        group: The backend's group name, for the mismatch errors.
        rank: The backend's rank, for the mismatch errors.
        thread_name: Name prefix of the thread that runs the sender's halves (started on the first validated send).
    """

    def __init__(self, group: str, rank: int, thread_name: str):
        self._group, self._rank, self._thread_name = group, rank, thread_name
        self._sender: ThreadPoolExecutor | None = None

    def send(
        self,
        sig: Signature,
        tensor: torch.Tensor,
        dst: int,
        *,
        receive_expected: Callable[[torch.Tensor], None],
        answer: Callable[[torch.Tensor, torch.Tensor], None],
    ) -> Work:
        """Start the sender's half of a send of ``tensor`` to ``dst`` on the send thread, behind the sends before it.

        Args:
            sig: The send's signature (its dtype and shape are compared with what ``dst`` posted).
            tensor: The payload.
            dst: The receiving rank.
            receive_expected: Receives ``SIGNATURE_LEN`` int64 from ``dst`` on the handshake channel into the tensor
                it is given, returning once they arrived (within the transport's timeout, else raising).
            answer: Sends its first tensor (this send's signature) and then its second (the payload, or zeros shaped
                as ``dst`` posted) to ``dst`` on the payload channel, returning once both completed.

        Returns:
            The send's :class:`Work`; its ``wait()`` raises :class:`CollectiveMismatchError` when ``dst`` posted
            another shape or dtype, and whatever the transport's moves raised.
        """

        def exchange() -> None:  # on the send thread
            expected = torch.empty(SIGNATURE_LEN, dtype=torch.int64)
            receive_expected(expected)
            wanted = Signature.decode(expected.tolist())
            matches = (wanted.dtype, wanted.shape) == (sig.dtype, sig.shape)
            payload = tensor if matches else torch.zeros(wanted.shape, dtype=wanted.dtype)
            answer(torch.tensor(sig.encode(), dtype=torch.int64), payload)
            if not matches:
                raise p2p_mismatch_error(self._group, self._rank, dst, sent=sig, posted=wanted, side="send")

        if self._sender is None:
            self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._thread_name)
        future = self._sender.submit(exchange)
        return Work(future.result, future.done)

    def recv(
        self,
        sig: Signature,
        tensor: torch.Tensor,
        src: int,
        *,
        post: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Posted],
    ) -> tuple[Posted, Callable[[], None]]:
        """The receiver's half of a receive into ``tensor`` from ``src``.

        Args:
            sig: The receive's signature, as the matching send carries it.
            tensor: The posted buffer.
            src: The sending rank.
            post: Given (this receive's signature, a status buffer, ``tensor``), posts at once and without waiting a
                send of the first to ``src`` on the handshake channel, then receives from ``src`` of the second and
                the third on the payload channel, in that order; returns what the transport needs to wait for them.

        Returns:
            What ``post`` returned, and the check to run once those completed: it raises
            :class:`CollectiveMismatchError` when ``src`` sent another shape or dtype.
        """
        status = torch.empty(SIGNATURE_LEN, dtype=torch.int64)
        posted = post(torch.tensor(sig.encode(), dtype=torch.int64), status, tensor)

        def check() -> None:
            sent = Signature.decode(status.tolist())
            if (sent.dtype, sent.shape) != (sig.dtype, sig.shape):
                raise p2p_mismatch_error(self._group, self._rank, src, sent=sent, posted=sig, side="recv")

        return posted, check

    def close(self) -> None:
        """Stop the send thread, cancelling the sends not started yet (a send in progress runs on to its timeout)."""
        if self._sender is not None:
            self._sender.shutdown(wait=False, cancel_futures=True)
