"""The manager's end of the agent link: one thread owns a ZeroMQ ROUTER socket.

Other threads never touch the socket. They hand frames to the owner through a queue and wake it
through an ``inproc`` socket; a request gets a :class:`concurrent.futures.Future` that the owner
resolves when the reply with the matching ``reply_to`` arrives. Incoming requests and reports go to
a handler called on the owner thread, which must be quick (it only updates the in-memory map).
Malformed frames are logged and dropped; the loop keeps serving.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import zmq

from gpumgr.wire import defaults, protocol
from gpumgr.wire.errors import AgentTimeout, ProtocolError

log = logging.getLogger(__name__)

Handler = Callable[[bytes, protocol.Envelope, protocol.Message], None]
_WAKE = b"w"


class ManagerLink:
    """Bind ``endpoint``, route frames to and from agents, tie replies to requests."""

    def __init__(self, endpoint: str, handler: Handler, *, tick: float = 0.5,
                 on_tick: Callable[[], None] | None = None) -> None:
        self.endpoint = endpoint
        self._handler = handler
        self._tick_ms = int(tick * 1000)
        self._on_tick = on_tick
        self._ctx = zmq.Context.instance()
        self._outbox: queue.SimpleQueue[tuple[bytes, bytes]] = queue.SimpleQueue()
        self._pending: dict[str, Future[protocol.Reply]] = {}
        self._pending_lock = threading.Lock()
        self._wake_addr = f"inproc://gpumgr-link-{id(self)}"
        self._wake_lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="agent-link", daemon=True)
        self._wake: zmq.Socket | None = None
        self.bound_endpoint = endpoint

    def start(self) -> None:
        """Bind and start the owner thread; returns once the socket is bound (raises if it cannot be)."""
        self._thread.start()
        self._ready.wait(10)
        if self._startup_error is not None:
            raise self._startup_error

    def stop(self) -> None:
        """Stop the owner thread and close the socket."""
        self._stop.set()
        self._poke()
        self._thread.join(5)

    def send(self, routing_id: bytes, message: protocol.Message, *, reply_to: str | None = None) -> None:
        """Queue ``message`` for the agent at ``routing_id``; never blocks."""
        self._outbox.put((routing_id, protocol.encode(message, reply_to=reply_to)))
        self._poke()

    def request(self, routing_id: bytes, message: protocol.Message, timeout: float) -> protocol.Reply:
        """Send ``message`` and wait up to ``timeout`` seconds for its reply; raises AgentTimeout."""
        msg_id = protocol.new_id()
        future: Future[protocol.Reply] = Future()
        with self._pending_lock:
            self._pending[msg_id] = future
        try:
            self._outbox.put((routing_id, protocol.encode(message, msg_id=msg_id)))
            self._poke()
            return future.result(timeout)
        except FutureTimeout:
            raise AgentTimeout(f"the agent did not answer {message.TYPE} within {timeout:g}s") from None
        finally:
            with self._pending_lock:
                self._pending.pop(msg_id, None)

    # --- owner thread ------------------------------------------------------------------------
    _startup_error: Exception | None = None

    def _serve(self) -> None:
        try:
            router, pull = self._open()
        except zmq.ZMQError as exc:
            self._startup_error = OSError(f"cannot bind the agent link on {self.endpoint}: {exc}")
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(self._tick_ms))
                if pull in events:
                    while pull.poll(0):
                        pull.recv()
                self._flush(router)
                if router in events:
                    self._drain(router)
                if self._on_tick is not None:
                    self._on_tick()
        finally:
            router.close(linger=0)
            pull.close(linger=0)
            with self._wake_lock:
                if self._wake is not None:
                    self._wake.close(linger=0)
                    self._wake = None

    def _open(self) -> tuple[zmq.Socket, zmq.Socket]:
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.MAXMSGSIZE, defaults.MAX_MESSAGE_BYTES)
        if self.endpoint.endswith(":0") or self.endpoint.endswith(":*"):
            port = router.bind_to_random_port(self.endpoint.rsplit(":", 1)[0])
            self.bound_endpoint = f"{self.endpoint.rsplit(':', 1)[0]}:{port}"
        else:
            router.bind(self.endpoint)
        pull = self._ctx.socket(zmq.PULL)
        pull.bind(self._wake_addr)
        return router, pull

    def _poke(self) -> None:
        with self._wake_lock:
            if self._stop.is_set() and self._wake is None:
                return
            if self._wake is None:
                self._wake = self._ctx.socket(zmq.PUSH)
                self._wake.setsockopt(zmq.LINGER, 0)
                self._wake.connect(self._wake_addr)
            with contextlib.suppress(zmq.Again):  # the owner already has wake-ups queued
                self._wake.send(_WAKE, zmq.NOBLOCK)

    def _flush(self, router: zmq.Socket) -> None:
        while True:
            try:
                routing_id, frame = self._outbox.get_nowait()
            except queue.Empty:
                return
            try:
                router.send_multipart([routing_id, frame], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                log.warning("cannot reach agent %r: %s", routing_id, exc)

    def _drain(self, router: zmq.Socket) -> None:
        while True:
            try:
                parts = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._dispatch(parts)

    def _dispatch(self, parts: list[bytes]) -> None:
        if len(parts) != 2:
            log.warning("dropped a message of %d frames from an agent (expected 1)", len(parts) - 1)
            return
        routing_id, frame = parts
        try:
            envelope, message = protocol.decode(frame)
        except ProtocolError as exc:
            log.warning("dropped a malformed message from agent %r: %s", routing_id, exc)
            return
        if isinstance(message, protocol.Reply):
            self._resolve(envelope, message)
            return
        try:
            self._handler(routing_id, envelope, message)
        except Exception:  # one bad message must never stop the link
            log.exception("handling %s from agent %r failed", envelope.type, routing_id)

    def _resolve(self, envelope: protocol.Envelope, reply: protocol.Reply) -> None:
        with self._pending_lock:
            future = self._pending.pop(envelope.reply_to or "", None)
        if future is None:
            log.info("late or unknown reply %s dropped; the heartbeat reconciles its result", envelope.reply_to)
        elif not future.done():
            future.set_result(reply)
