"""The parts of the agent link that are not its loop: who sent a frame, what waits for a reply, the owner's hooks.

:mod:`gpumgr.wire.link.link` is the loop; these are the plain records and helpers it works with, kept apart
so the loop reads as what it does.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import zmq

from gpumgr.wire import defaults, protocol

#: What a wake-up carries (its content is never read).
WAKE = b"w"

log = logging.getLogger("gpumgr.wire.link.link")


@dataclass(frozen=True)
class Peer:
    """Who sent a frame: the ROUTER's routing id (empty on a DEALER) and the sender's proven key."""

    routing_id: bytes
    key: str = ""


Handler = Callable[[Peer, protocol.Envelope, protocol.Message], None]
Configure = Callable[[zmq.Socket[bytes]], None]


@dataclass
class Pending:
    """A request waiting for its reply: its future, where and when it went, and its frame (to send it again)."""

    future: Future[protocol.Reply]
    peer: bytes
    deadline: float
    what: str
    #: the proven key the reply must come from ("" to match by routing id, which a reconnect changes)
    key: str = ""
    #: the frame, and the connection it left on (b"": not yet): sent again once if the key reconnects unanswered
    frame: bytes = b""
    sent_on: bytes = b""


@dataclass
class LinkHooks:
    """What the owner of a link does on its thread besides routing frames.

    ``on_tick`` runs every loop and returns how many seconds may pass before it must run again
    (None: the link's default tick); it must only queue work or frames, never wait. ``descriptors``
    lists plain file descriptors to watch for input as well, and ``on_ready`` gets those that were
    readable. ``screen`` sees every decoded frame first, replies included, with who sent it, and
    returns an error to drop it (a request waiting for that reply fails with the error at once), or
    None to let it through.
    """

    on_tick: Callable[[], float | None] | None = None
    descriptors: Callable[[], set[int]] | None = None
    on_ready: Callable[[set[int]], None] | None = None
    on_stop: Callable[[], None] | None = None
    screen: Callable[[Peer, protocol.Envelope, protocol.Message], Exception | None] | None = None


class LoopLag:
    """The longest time a link's owner spent between two polls since it was last read; warns when too long."""

    def __init__(self, name: str) -> None:
        self.name, self.longest, self._warned = name, 0.0, 0.0

    def note(self, busy: float) -> None:
        """The owner was away from its poll for ``busy`` seconds."""
        self.longest = max(self.longest, busy)
        if busy > defaults.LINK_LAG_WARN and time.monotonic() - self._warned > 10 * defaults.LINK_LAG_WARN:
            self._warned = time.monotonic()
            log.warning("the %s loop went %.2fs between two polls: frames waited that long", self.name, busy)

    def take(self) -> float:
        """The longest gap since the last call, and start again."""
        longest, self.longest = self.longest, 0.0
        return longest


def resolve_future(future: Future[protocol.Reply], reply: protocol.Reply | None, error: Exception | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(reply)  # type: ignore[arg-type]


def same_sender(pending: Pending, peer: Peer) -> bool:
    """Whether ``peer`` may answer ``pending``: its proven key when one was named, else its routing id."""
    return pending.key == peer.key if pending.key else pending.peer == peer.routing_id


def key_of(frame: zmq.Frame) -> str:
    """The peer's proven identity (its CURVE public key, as the ZAP handler named it), or ``""``."""
    try:
        return str(frame.get("User-Id"))
    except (zmq.ZMQError, UnicodeDecodeError):
        return ""


def watch(poller: zmq.Poller, watched: set[int], wanted: set[int]) -> set[int]:
    """Make ``poller`` watch exactly the plain descriptors in ``wanted`` for input; returns ``wanted``."""
    for fd in watched - wanted:
        poller.unregister(fd)
    for fd in wanted - watched:
        poller.register(fd, zmq.POLLIN)
    return wanted


class Waker:
    """Wakes a link's owner thread from any other: a PUSH socket to the owner's ``inproc`` PULL, made on first use."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], address: str) -> None:
        self._ctx, self._address = context, address
        self._lock = threading.Lock()
        self._socket: zmq.Socket[bytes] | None = None

    def poke(self, *, stopping: bool = False) -> None:
        """Queue one wake-up (none while the link stops and nothing was opened; a full queue is wake-up enough)."""
        with self._lock:
            if stopping and self._socket is None:
                return
            if self._socket is None:
                self._socket = self._ctx.socket(zmq.PUSH)
                self._socket.setsockopt(zmq.LINGER, 0)
                self._socket.connect(self._address)
            with contextlib.suppress(zmq.Again):  # the owner already has wake-ups queued
                self._socket.send(WAKE, zmq.NOBLOCK)

    def close(self) -> None:
        """Close the wake-up socket (the link stopped)."""
        with self._lock:
            if self._socket is not None:
                self._socket.close(linger=0)
                self._socket = None


def bind_socket(sock: zmq.Socket[bytes], endpoint: str) -> str:
    """Bind ``sock`` to ``endpoint`` (port 0 or ``*``: a free one); the endpoint it is bound to."""
    base, _, port = endpoint.rpartition(":")
    if port in ("0", "*"):
        return f"{base}:{sock.bind_to_random_port(base)}"
    sock.bind(endpoint)
    return endpoint
