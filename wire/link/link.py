"""The agent link's socket-owner loop, written once and used by both ends.

One thread owns one ZeroMQ socket (the manager's ROUTER, or an agent's DEALER). Other threads never
touch it: they hand frames to the owner through a queue and wake it through an ``inproc`` socket.
A request gets a :class:`concurrent.futures.Future` that the owner resolves when the reply with the
matching ``reply_to`` arrives (or fails with :class:`~gpumgr.wire.errors.AgentTimeout` at its
deadline). The owner thread only moves frames: every other incoming message, and every future's
completion (so every callback), runs on a :class:`~gpumgr.wire.link.lanes.Lanes` worker, in order per
sender. Malformed frames are logged and dropped; the loop keeps serving whatever one message does.

A ROUTER follows keys, not connections: a frame sent with the recipient's proven ``key`` leaves on
the connection that key last spoke on, and one that cannot leave (the connection is gone after a
blip, or its pipe is full) waits, within its deadline, for that key's next frame and is sent once
then (:mod:`gpumgr.wire.link.parking`). A request that left on a connection the key has since replaced,
unanswered, is sent once more on the new one (it may have died with the old; agents apply a command
they get twice once, by its operation id). Nothing else is ever sent again. The longest gap
between two polls is kept (:meth:`Link.take_lag`) and logged above ``LINK_LAG_WARN``.

Security lives here too, in one place: the socket is configured by a :class:`~gpumgr.wire.security`
object before it binds or connects, and every incoming frame carries the peer's proven identity.

A DEALER given ``peers`` (an agent given several managers) keeps one socket, one CURVE connection,
to each of them on the same owner thread. Frames addressed to ``b""`` go to the current one (the
leader, as far as the agent can tell; :meth:`Link.reconnect` makes another current without closing
anything); a frame that arrives on one of them names it in ``Peer.routing_id`` (its address), and a
frame sent to that address leaves on that connection, so a command is answered where it came from.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import zmq

from gpumgr.wire import defaults, protocol
from gpumgr.wire.epoch import Epoch
from gpumgr.wire.errors import AgentTimeout, NoAgents, ProtocolError
from gpumgr.wire.link.lanes import Lanes
from gpumgr.wire.link.link_parts import (
    Configure,
    Handler,
    LinkHooks,
    LoopLag,
    Peer,
    Pending,
    Waker,
    bind_socket,
    key_of,
    resolve_future,
    same_sender,
    watch,
)
from gpumgr.wire.link.parking import Parked, Parking

__all__ = ["Configure", "Handler", "Link", "LinkHooks", "Peer"]
log = logging.getLogger(__name__)

#: Frames handled per wake-up before queued replies are sent.
DRAIN_BATCH = 256


class Link:
    """Own a ZeroMQ ROUTER (``bind=True``) or DEALER socket on ``endpoint``; see the module docstring."""

    def __init__(self, kind: int, endpoint: str, handler: Handler, *, bind: bool, configure: Configure,
                 context: zmq.Context[zmq.Socket[bytes]] | None = None, tick: float = defaults.LINK_TICK,
                 hooks: LinkHooks | None = None, name: str = "link",
                 epoch: Callable[[], Epoch | None] | None = None, peers: list[str] | None = None,
                 lanes: Lanes | None = None, park_for: float = defaults.LINK_PARK_FOR) -> None:
        self.kind = kind
        if peers is not None and (bind or kind != zmq.DEALER or endpoint not in peers):
            raise ValueError("peers: a connecting DEALER's addresses, the current endpoint among them")
        #: every address a DEALER keeps a connection to (None: one connection, to ``endpoint``)
        self.peers = list(peers) if peers is not None else None
        self._socks: dict[bytes, zmq.Socket[bytes]] = {}
        self._current = b""
        #: what stamps every frame this link sends (a leader's epoch); None: frames carry no epoch
        self._epoch = epoch
        self._retarget: str | None = None
        self._unreachable_since: float | None = None
        self.endpoint = self.bound_endpoint = endpoint
        self._bind = bind
        self._configure = configure
        self._handler = handler
        self._tick = tick
        self._hooks = hooks or LinkHooks()
        self._ctx = context or zmq.Context.instance()
        self._outbox: queue.SimpleQueue[tuple[bytes, bytes, str | None, str]] = queue.SimpleQueue()
        #: where what was received, and every completion, runs (never on the owner thread)
        self._own_lanes = lanes is None
        self.lanes = lanes if lanes is not None else Lanes(1, name=f"{name}-work")
        self._parking = Parking()
        self._park_for = park_for
        #: the longest time the owner spent between two polls since :meth:`take_lag` last read it
        self._lag = LoopLag(name)
        #: the longest gap between two polls since the last call (seconds): how late the link may have heard
        self.take_lag: Callable[[], float] = self._lag.take
        self._pending: dict[str, Pending] = {}
        self._pending_lock = threading.Lock()
        self._wake_addr = f"inproc://gpumgr-{name}-{id(self)}"
        self._wake = Waker(self._ctx, self._wake_addr)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._startup_error: Exception | None = None
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)

    # --- any thread --------------------------------------------------------------------------
    def start(self) -> None:
        """Open the socket on the owner thread; returns once it is bound or connecting (raises if it cannot be)."""
        self.lanes.start()
        self._thread.start()
        self._ready.wait(10)
        if self._startup_error is not None:
            raise self._startup_error

    def run(self) -> None:
        """Serve on the calling thread until :meth:`stop` (it becomes the socket's owner)."""
        self._thread = threading.current_thread()
        self.lanes.start()
        self._serve()
        if self._startup_error is not None:
            raise self._startup_error

    def stop(self) -> None:
        """Stop the owner thread and close the socket."""
        self._stop.set()
        self._poke()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5)
        if self._own_lanes:
            self.lanes.stop()

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stop.is_set()

    def reconnect(self, endpoint: str) -> None:
        """Point a connecting link at ``endpoint`` instead (done by the owner thread before it next sends).

        With ``peers`` nothing is closed or opened: ``endpoint``'s connection, already up, becomes current.
        """
        self._retarget = endpoint
        self._poke()

    def unreachable_for(self) -> float:
        """Seconds since frames last failed to leave, counted from the first failure; 0 while they leave."""
        return 0.0 if (since := self._unreachable_since) is None else time.monotonic() - since

    def _stamp(self) -> Epoch | None:  # the epoch to stamp on a frame (a manager of several), else None
        return None if self._epoch is None else self._epoch()
    def send(self, peer: bytes, message: protocol.Message, *, reply_to: str | None = None, key: str = "") -> None:
        """Queue ``message`` for ``peer`` (a routing id; ``b""`` on a DEALER); never blocks.

        With ``key`` (a ROUTER's peer's proven key) it leaves on that key's newest connection, and waits
        for the key's next frame if that connection is gone.
        """
        self.send_frame(peer, protocol.encode(message, reply_to=reply_to, epoch=self._stamp()), key=key)

    def send_frame(self, peer: bytes, frame: bytes, msg_id: str | None = None, key: str = "") -> None:
        """Queue an already encoded frame for ``peer``; never blocks. ``msg_id`` names a request waiting on it."""
        self._outbox.put((peer, frame, msg_id, key))
        self._poke()

    def request_async(self, peer: bytes, message: protocol.Message, timeout: float, *,
                      key: str = "") -> Future[protocol.Reply]:
        """Send ``message``; the future gets its reply, or AgentTimeout after ``timeout`` seconds.

        With ``key`` the reply is taken from whichever connection that proven key answers on, so a
        peer whose socket reconnected (a new routing id) still answers what it was asked.
        """
        msg_id = protocol.new_id()
        future: Future[protocol.Reply] = Future()
        frame = protocol.encode(message, msg_id=msg_id, epoch=self._stamp())
        with self._pending_lock:
            self._pending[msg_id] = Pending(future, peer, time.monotonic() + timeout, message.TYPE, key,
                                             frame if key and self.kind == zmq.ROUTER else b"")
        self.send_frame(peer, frame, msg_id, key)
        return future

    def fail_peer(self, peer: bytes, error: Exception, key: str = "") -> int:
        """Fail every request waiting on ``peer`` (or on proven ``key``) at once (its process is gone)."""
        with self._pending_lock:
            gone = [k for k, p in self._pending.items() if (p.key == key if key else p.peer == peer)]
            failed = [self._pending.pop(k) for k in gone]
        for pending in failed:
            self._complete(pending, error=error)
        return len(failed)

    def fail_all(self, error: Exception) -> int:  # issue 21
        """Fail every request still waiting for a reply (a manager that stops leading answers none of them)."""
        with self._pending_lock:
            failed, self._pending = list(self._pending.values()), {}
        for pending in failed:
            self._complete(pending, error=error)
        return len(failed)

    def request(self, peer: bytes, message: protocol.Message, timeout: float) -> protocol.Reply:
        """Send ``message`` and wait up to ``timeout`` seconds for its reply; raises AgentTimeout."""
        future = self.request_async(peer, message, timeout)
        try:
            return future.result(timeout + self._tick + 1)
        except TimeoutError:
            raise AgentTimeout(f"the peer did not answer {message.TYPE} within {timeout:g}s") from None

    # --- owner thread ------------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            pull = self._open()
        except (zmq.ZMQError, OSError) as exc:
            self._startup_error = OSError(f"cannot open the agent link on {self.endpoint}: {exc}")
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop(pull)
        finally:
            if self._hooks.on_stop is not None:
                self._hooks.on_stop()
            for sock in self._socks.values():
                sock.close(linger=0)
            pull.close(linger=0)
            self._wake.close()

    def _loop(self, pull: zmq.Socket[bytes]) -> None:
        poller = zmq.Poller()
        for sock in self._socks.values():
            poller.register(sock, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        watched: set[int] = set()
        wait = 0.0
        polled = time.monotonic()
        while not self._stop.is_set():
            if self._hooks.descriptors is not None:
                watched = watch(poller, watched, self._hooks.descriptors())
            self._lag.note(time.monotonic() - polled)
            events = dict(poller.poll(max(0, int(wait * 1000)) + 1))
            polled = time.monotonic()
            if pull in events:
                while pull.poll(0):
                    pull.recv()
            more = False
            for key, sock in self._socks.items():
                if sock in events:
                    more = self._drain(sock, key) or more
            ready = {fd for fd in events if isinstance(fd, int)}
            if ready and self._hooks.on_ready is not None:
                self._hooks.on_ready(ready)
            wait = self._run_tick()
            if more:  # frames are still waiting: come straight back once what is queued has left
                wait = 0.0
            self._expire()
            self._move()
            self._flush()

    def _run_tick(self) -> float:
        if self._hooks.on_tick is None:
            return self._tick
        try:
            wanted = self._hooks.on_tick()
        except Exception:  # one failing tick must never stop the link
            log.exception("the link's periodic work failed; it runs again next tick")
            return self._tick
        return self._tick if wanted is None else min(self._tick, max(0.0, wanted))

    def _open(self) -> zmq.Socket[bytes]:
        """Open the socket (one per address with ``peers``) and the wake-up socket; returns the latter."""
        try:
            for address in self.peers if self.peers is not None else [self.endpoint]:
                sock = self._ctx.socket(self.kind)
                key = address.encode() if self.peers is not None else b""
                self._socks[key] = sock
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.MAXMSGSIZE, defaults.MAX_MESSAGE_BYTES)
                self._configure(sock)
                if self._bind:
                    self.bound_endpoint = bind_socket(sock, self.endpoint)
                else:
                    sock.connect(address)
        except BaseException:
            for sock in self._socks.values():
                sock.close(linger=0)
            self._socks = {}
            raise
        self._current = self.endpoint.encode() if self.peers is not None else b""
        pull = self._ctx.socket(zmq.PULL)
        pull.bind(self._wake_addr)
        return pull

    def _poke(self) -> None:
        self._wake.poke(stopping=self._stop.is_set())

    def _move(self) -> None:
        target, self._retarget = self._retarget, None
        if target is None or target == self.endpoint or self._bind:
            return
        if self.peers is not None:  # every connection is up already: another one becomes current
            if target.encode() not in self._socks:
                log.warning("no connection to %s among this link's peers: staying with %s", target, self.endpoint)
                return
            self._current = target.encode()
        else:
            sock = self._socks[b""]
            with contextlib.suppress(zmq.ZMQError):  # never connected there: nothing to undo
                sock.disconnect(self.endpoint)
            sock.connect(target)
        self.endpoint, self._unreachable_since = target, None

    def _flush(self) -> None:
        while True:
            try:
                peer, frame, msg_id, key = self._outbox.get_nowait()
            except queue.Empty:
                return
            if key and key in self._parking:  # frames already wait for this key: keep their order
                self._park(Parked(key, frame, msg_id, self._deadline_of(msg_id)))
            else:
                self._send_now(peer, frame, msg_id, key)

    def _send_now(self, peer: bytes, frame: bytes, msg_id: str | None, key: str) -> bool:
        """Hand one frame to ZeroMQ; one that cannot leave now waits for its key's next frame, or fails at once."""
        if self.kind == zmq.ROUTER:
            sock, parts, current = self._socks[b""], [self._parking.route(key, peer), frame], True
        else:  # a DEALER: b"" is the current connection, an address its own (a reply where a command came from)
            conn = peer if peer in self._socks else self._current
            sock, parts, current = self._socks[conn], [frame], conn == self._current
        try:
            sock.send_multipart(parts, zmq.NOBLOCK)
            if msg_id is not None and key:
                self._left(msg_id, parts[0])
        except zmq.ZMQError as exc:
            if current and self._unreachable_since is None:
                self._unreachable_since = time.monotonic()
            if key and self.kind == zmq.ROUTER:
                self._park(Parked(key, frame, msg_id, self._deadline_of(msg_id)))
                return False
            log.debug("cannot reach peer %r now (%s); one message dropped", peer, exc)
            if msg_id is not None:
                who = "the agent is not connected" if self.kind == zmq.ROUTER else "the manager is not reachable"
                self._fail(msg_id, NoAgents(f"{who} now ({exc.strerror}); try again"))
            return False
        if current:
            self._unreachable_since = None
        return True

    def _left(self, msg_id: str, routing_id: bytes) -> None:
        with self._pending_lock:
            pending = self._pending.get(msg_id)
        if pending is not None:
            pending.sent_on = routing_id

    def _deadline_of(self, msg_id: str | None) -> float:
        """How long a frame that cannot leave may wait: its request's deadline, else ``park_for``."""
        with self._pending_lock:
            pending = self._pending.get(msg_id or "")
        return pending.deadline if pending is not None else time.monotonic() + self._park_for

    def _park(self, item: Parked) -> None:
        pushed = self._parking.park(item)
        if pushed is not None and pushed.msg_id is not None:
            self._fail(pushed.msg_id, NoAgents("too many commands wait for this node's connection; not sent"))

    def _heard(self, peer: Peer) -> None:
        """A frame of ``peer.key`` arrived: what waited for the key leaves on this connection; after a reconnect,
        so does each request the old connection took and nobody answered (it may have died with it; the agent
        runs a command it gets twice once, by its operation id)."""
        before = self._parking.heard(peer.key, peer.routing_id)
        if before is not None:
            with self._pending_lock:
                lost = [(i, p) for i, p in self._pending.items()
                        if p.key == peer.key and p.frame and p.sent_on not in (b"", peer.routing_id)]
            for msg_id, pending in lost:
                pending.sent_on = b""
                self._send_now(peer.routing_id, pending.frame, msg_id, peer.key)
        if peer.key in self._parking:
            self._unpark(peer.key)

    def _unpark(self, key: str) -> None:
        """``key`` spoke again: what waited for it leaves now, once, on its newest connection."""
        for index, item in enumerate(waiting := self._parking.take(key)):
            if item.msg_id is not None and item.msg_id not in self._pending:  # a dict read: atomic, no lock
                continue  # its request ended meanwhile: it must not run unasked
            if not self._send_now(b"", item.frame, item.msg_id, key):
                for rest in waiting[index + 1:]:  # still no way out: the rest wait behind it, in order
                    self._park(rest)
                return

    def _fail(self, msg_id: str, error: Exception) -> None:
        """A request whose frame could not leave fails at once instead of waiting out its timeout."""
        with self._pending_lock:
            pending = self._pending.pop(msg_id, None)
        if pending is not None:
            self._complete(pending, error=error)

    def _complete(self, pending: Pending, reply: protocol.Reply | None = None,
                  error: Exception | None = None) -> None:
        """Resolve ``pending``'s future on its sender's lane, never on the owner thread (callbacks run there)."""
        lane = pending.key.encode() if pending.key else pending.peer
        self.lanes.submit(lane, resolve_future, pending.future, reply, error, bounded=False)

    def _drain(self, sock: zmq.Socket[bytes], key: bytes) -> bool:
        """Handle what has arrived, at most DRAIN_BATCH frames; True if more may wait.

        The cap lets replies queued by the handlers leave between batches, so a flood of incoming
        heartbeats cannot starve what we send.
        """
        for _ in range(DRAIN_BATCH):
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
            self._dispatch(parts, key)
        return True

    def _dispatch(self, parts: list[zmq.Frame], key: bytes = b"") -> None:
        """Decode, screen and route one frame; ``key`` names the DEALER connection it came on (b"": the only one)."""
        routed = self.kind == zmq.ROUTER
        if len(parts) != (2 if routed else 1):
            log.warning("dropped a message of %d parts on the link (expected one frame)", len(parts) - routed)
            return
        peer = Peer(parts[0].bytes if routed else key, key_of(parts[-1]))
        if routed and peer.key:
            self._heard(peer)
        try:
            envelope, message = protocol.decode(parts[-1].bytes)
        except ProtocolError as exc:
            log.warning("dropped a malformed message from %r: %s", peer.routing_id, exc)
            return
        refused = self._hooks.screen(peer, envelope, message) if self._hooks.screen is not None else None
        if refused is not None:
            if isinstance(message, protocol.Reply) and envelope.reply_to:
                self._fail(envelope.reply_to, refused)
            return
        if isinstance(message, protocol.Reply) and self._resolve(peer, envelope, message):
            return
        lane = peer.key.encode() if peer.key else peer.routing_id
        if not self.lanes.submit(lane, self._handler, peer, envelope, message):
            log.warning("dropped %s from %r: %d of its messages wait already", envelope.type, peer.routing_id[:16],
                        self.lanes.per_key)

    def _resolve(self, peer: Peer, envelope: protocol.Envelope, reply: protocol.Reply) -> bool:
        """Hand ``reply`` to the request waiting for it; False if none is (the handler then sees it)."""
        with self._pending_lock:
            pending = self._pending.get(envelope.reply_to or "")
            if pending is None or (self.kind == zmq.ROUTER and not same_sender(pending, peer)):
                return False
            del self._pending[envelope.reply_to or ""]
        self._complete(pending, reply)
        return True

    def _expire(self) -> None:
        now = time.monotonic()
        for item in self._parking.expired(now):  # never left: nothing happened, and the request says so
            if item.msg_id is not None:
                self._fail(item.msg_id, NoAgents("not delivered: the node's connection was gone until the "
                                                 "command's deadline"))
        with self._pending_lock:
            late = [k for k, p in self._pending.items() if p.deadline <= now]
            expired = [self._pending.pop(k) for k in late]
        for pending in expired:
            self._complete(pending, error=AgentTimeout(f"the peer did not answer {pending.what} in time"))
