"""A TCP proxy for tests and benchmarks that cuts, swallows and delays the traffic it forwards.

Put it between a ZeroMQ peer and the address that peer connects to: ``ChaosProxy(("127.0.0.1", port))``
listens on a free loopback port, and every connection made to :attr:`ChaosProxy.address` is forwarded
to the target byte for byte until a fault says otherwise. One thread owns every socket (a selector
loop); the fault methods only replace the fault state and wake that thread, so they may be called from
any thread and act on live connections at once. Delayed bytes wait in a queue per connection and
direction with the time they are due, so nothing ever sleeps in the loop.

From a shell: ``python -m tests.chaos.proxy --target 127.0.0.1:5555`` prints the listen address and
serves until Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import ipaddress
import logging
import random
import selectors
import signal
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType

log = logging.getLogger(__name__)

#: "up" is client → target, "down" is target → client
DIRECTIONS = ("up", "down")
CHUNK = 64 * 1024
#: a side is not read while this many of its bytes wait for the other side to take them (back-pressure)
MAX_PENDING = 4 * 1024 * 1024
#: the loop wakes at least this often whatever happens, so stop() is seen within it
TICK = 0.2
ACCEPT_BATCH = 64
#: cut() and heal() wait at most this long for the loop to have applied them
APPLY_TIMEOUT = 2.0
JOIN_TIMEOUT = 5.0
LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
#: SO_LINGER on with a zero timeout: close() sends a reset instead of a FIN
LINGER_RESET = struct.pack("ii", 1, 0)
READ, WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE
DESCRIPTION = "A loopback TCP proxy that can cut, swallow and delay what it forwards."


@dataclass(frozen=True)
class _Faults:
    """The faults in force; replaced whole on every change, so the loop reads it without a lock."""

    swallow: frozenset[str] = frozenset()
    #: direction → (seconds, jitter)
    delay: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    refuse_until: float = 0.0


@dataclass(eq=False)
class _Pipe:
    """One direction of one connection: chunks read from ``src`` wait in ``queue`` until due, then go to ``dst``."""

    direction: str
    src: socket.socket
    dst: socket.socket
    queue: deque[tuple[float, bytes]] = field(default_factory=deque)
    queued: int = 0
    out: bytearray = field(default_factory=bytearray)
    eof: bool = False
    shut: bool = False

    def pending(self) -> int:
        """Bytes read from ``src`` that ``dst`` has not taken yet."""
        return self.queued + len(self.out)

    def drained(self) -> bool:
        """Whether ``src`` has ended and every byte it sent has been written to ``dst``."""
        return self.eof and not self.queue and not self.out


@dataclass(eq=False)
class _Link:
    """One proxied connection: the accepted client socket and the socket to the target."""

    client: socket.socket
    upstream: socket.socket
    connected: bool
    swallowed: bool = False
    closed: bool = False
    events: dict[str, int] = field(default_factory=lambda: {"client": 0, "upstream": 0})
    pipes: dict[str, _Pipe] = field(init=False)

    def __post_init__(self) -> None:
        self.pipes = {"up": _Pipe("up", self.client, self.upstream), "down": _Pipe("down", self.upstream, self.client)}

    def sock(self, role: str) -> socket.socket:
        """The socket playing ``role`` ("client" or "upstream")."""
        return self.client if role == "client" else self.upstream


class ChaosProxy:
    """A loopback TCP proxy to ``target`` whose connections can be cut, silently partitioned and delayed.

    ``bytes_up`` and ``bytes_down`` count the bytes delivered in each direction, ``swallowed`` those
    thrown away, and ``connections`` the live proxied connections.
    """

    def __init__(self, target: tuple[str, int], listen_host: str = "127.0.0.1") -> None:
        self.target = (_loopback(target[0]), _port(target[1]))
        host = _loopback(listen_host)
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self.address = f"tcp://{host}:{self.port}"
        self.swallowed = 0
        self._bytes = {"up": 0, "down": 0}
        self._faults = _Faults()
        self._lock = threading.Lock()
        self._requests: deque[tuple[Callable[[], None], threading.Event]] = deque()
        self._links: list[_Link] = []
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def bytes_up(self) -> int:
        """Bytes delivered from clients to the target."""
        return self._bytes["up"]

    @property
    def bytes_down(self) -> int:
        """Bytes delivered from the target to clients."""
        return self._bytes["down"]

    @property
    def connections(self) -> int:
        """Live proxied connections."""
        return len(self._links)

    def start(self) -> ChaosProxy:
        """Start forwarding on a thread of its own."""
        self._selector.register(self._listener, READ, "listener")
        self._selector.register(self._wake_r, READ, "wake")
        self._thread = threading.Thread(target=self._serve, name=f"chaos-proxy-{self.port}", daemon=True)
        self._thread.start()
        log.info("chaos proxy %s → %s:%d", self.address, *self.target)
        return self

    def stop(self) -> None:
        """Close every connection and the listener and end the thread (waiting at most JOIN_TIMEOUT)."""
        self._stopping.set()
        if self._thread is None:
            self._close_all()
            return
        self._wake()
        self._thread.join(JOIN_TIMEOUT)
        if self._thread.is_alive():
            log.warning("chaos proxy %s: the loop did not end within %.1fs", self.address, JOIN_TIMEOUT)

    def __enter__(self) -> ChaosProxy:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()

    # faults

    def cut(self, refuse_for: float = 0.0) -> None:
        """Reset every live connection on both sides at once; then, for ``refuse_for`` seconds, accept
        new connections only to reset them at once, so a client keeps failing to reconnect."""
        until = time.monotonic() + refuse_for
        self._set_faults(lambda faults: dataclasses.replace(faults, refuse_until=until))
        self._apply(lambda: self._close_links(list(self._links)))

    def swallow(self, direction: str = "both") -> None:
        """A silent partition: keep connections open but read and throw away the bytes going ``direction``
        ("up", "down" or "both"), including delayed ones that fall due meanwhile. An end of stream going that
        way is held back too; new connections are still accepted and treated the same."""
        names = _directions(direction)
        self._set_faults(lambda faults: dataclasses.replace(faults, swallow=faults.swallow | names))

    def delay(self, seconds: float, direction: str = "both", jitter: float = 0.0) -> None:
        """Deliver each chunk going ``direction`` ``seconds`` (plus up to ``jitter``) after it was read,
        in order; a delay of 0 ends the delay."""
        if seconds < 0 or jitter < 0:
            raise ValueError("chaos proxy: a delay and its jitter cannot be negative")
        change = dict.fromkeys(_directions(direction), (seconds, jitter))
        self._set_faults(lambda faults: dataclasses.replace(faults, delay={**faults.delay, **change}))

    def heal(self, reset_swallowed: bool = True) -> None:
        """End every fault: swallowing, delays (bytes still waiting go at once) and a refusal window.

        A connection that lost bytes to :meth:`swallow` carries a corrupt stream (a ZeroMQ or CURVE peer
        cannot resynchronise), so by default it is reset, as a long partition ends in a TCP reset, and the
        peers reconnect cleanly; ``reset_swallowed=False`` keeps it open.
        """
        self._set_faults(lambda faults: _Faults())
        self._apply(lambda: self._heal_links(reset_swallowed))

    def _set_faults(self, change: Callable[[_Faults], _Faults]) -> None:
        with self._lock:
            self._faults = change(self._faults)
        self._wake()

    def _apply(self, action: Callable[[], None]) -> None:
        """Run ``action`` on the loop thread, which owns the sockets, and wait until it ran."""
        done = threading.Event()
        with self._lock:
            self._requests.append((action, done))
        if self._thread is None or not self._thread.is_alive():
            self._run_requests()
            return
        self._wake()
        if not done.wait(APPLY_TIMEOUT):
            log.warning("chaos proxy %s: a fault was not applied within %.1fs", self.address, APPLY_TIMEOUT)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    # the loop: everything below runs on the proxy's thread

    def _serve(self) -> None:
        try:
            while not self._stopping.is_set():
                self._step()
        except Exception:
            log.exception("chaos proxy %s: the loop failed; closing everything", self.address)
        finally:
            self._close_all()

    def _step(self) -> None:
        for key, mask in self._selector.select(self._timeout()):
            if key.data == "listener":
                self._accept()
            elif key.data == "wake":
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
            else:
                link, role = key.data
                self._on_socket(link, role, mask)
        self._run_requests()
        self._release_due()

    def _timeout(self) -> float:
        """Seconds until the next delayed chunk falls due, at most TICK."""
        heads = [pipe.queue[0][0] for link in self._links for pipe in link.pipes.values() if pipe.queue]
        return max(0.0, min([TICK, *(due - time.monotonic() for due in heads)]))

    def _run_requests(self) -> None:
        while True:
            with self._lock:
                if not self._requests:
                    return
                action, done = self._requests.popleft()
            try:
                action()
            finally:
                done.set()

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:
                log.warning("chaos proxy %s: accept failed: %s", self.address, error)
                return
            if time.monotonic() < self._faults.refuse_until:
                _reset(client)
            else:
                self._open(client)

    def _open(self, client: socket.socket) -> None:
        upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        for sock in (client, upstream):
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        status = upstream.connect_ex(self.target)
        if status not in (0, errno.EINPROGRESS):
            log.info("chaos proxy %s: target refused: %s", self.address, errno.errorcode.get(status, status))
            _reset(client)
            _reset(upstream)
            return
        link = _Link(client, upstream, connected=status == 0)
        self._links.append(link)
        self._settle(link)

    def _on_socket(self, link: _Link, role: str, mask: int) -> None:
        if link.closed:
            return
        sock = link.sock(role)
        try:
            if mask & WRITE:
                self._on_writable(link, sock)
            if mask & READ:
                self._on_readable(link, sock)
        except OSError as error:
            log.debug("chaos proxy %s: connection lost: %s", self.address, error)
            self._close_link(link)
            return
        self._settle(link)

    def _on_writable(self, link: _Link, sock: socket.socket) -> None:
        if sock is link.upstream and not link.connected:
            status = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if status:
                raise OSError(status, f"connect to the target failed: {errno.errorcode.get(status, status)}")
            link.connected = True
        pipe = link.pipes["down" if sock is link.client else "up"]
        if pipe.out:
            sent = sock.send(pipe.out)
            del pipe.out[:sent]
            self._bytes[pipe.direction] += sent

    def _on_readable(self, link: _Link, sock: socket.socket) -> None:
        pipe = link.pipes["up" if sock is link.client else "down"]
        data = sock.recv(CHUNK)
        if not data:
            pipe.eof = True
            return
        faults = self._faults
        if pipe.direction in faults.swallow:
            self._discard(link, data)
            return
        seconds, jitter = faults.delay.get(pipe.direction, (0.0, 0.0))
        due = time.monotonic() + seconds + (random.uniform(0.0, jitter) if jitter else 0.0)
        pipe.queue.append((due, data))
        pipe.queued += len(data)

    def _discard(self, link: _Link, data: bytes) -> None:
        self.swallowed += len(data)
        link.swallowed = True

    def _release_due(self) -> None:
        """Move the chunks that fell due into their pipe's output, in order (a later chunk waits for an
        earlier one however its jitter fell), and bring every connection's state up to date."""
        now, swallow = time.monotonic(), self._faults.swallow
        for link in list(self._links):
            for pipe in link.pipes.values():
                while pipe.queue and pipe.queue[0][0] <= now:
                    data = pipe.queue.popleft()[1]
                    pipe.queued -= len(data)
                    if pipe.direction in swallow:
                        self._discard(link, data)
                    else:
                        pipe.out += data
            self._settle(link)

    def _settle(self, link: _Link) -> None:
        """Pass on a drained end of stream, close a connection both of whose directions ended, and
        watch each socket for exactly what its connection waits for."""
        if link.closed:
            return
        try:
            for pipe in link.pipes.values():
                if pipe.drained() and not pipe.shut and pipe.direction not in self._faults.swallow:
                    pipe.dst.shutdown(socket.SHUT_WR)
                    pipe.shut = True
        except OSError:
            self._close_link(link)
            return
        if all(pipe.shut for pipe in link.pipes.values()):
            self._close_link(link, reset=False)
            return
        up, down = link.pipes["up"], link.pipes["down"]
        self._watch(link, "client", _events(link.connected and _readable(up), bool(down.out)))
        self._watch(link, "upstream", _events(_readable(down), not link.connected or bool(up.out)))

    def _watch(self, link: _Link, role: str, events: int) -> None:
        old = link.events[role]
        if events == old:
            return
        if not old:
            self._selector.register(link.sock(role), events, (link, role))
        elif not events:
            self._selector.unregister(link.sock(role))
        else:
            self._selector.modify(link.sock(role), events, (link, role))
        link.events[role] = events

    def _heal_links(self, reset_swallowed: bool) -> None:
        for link in list(self._links):
            if reset_swallowed and link.swallowed:
                self._close_link(link)
                continue
            for pipe in link.pipes.values():
                pipe.queue = deque((0.0, data) for _, data in pipe.queue)

    def _close_links(self, links: list[_Link]) -> None:
        for link in links:
            self._close_link(link)

    def _close_link(self, link: _Link, reset: bool = True) -> None:
        """Close both sockets of ``link``: with a reset (the default) or, after both ends finished, gracefully."""
        if link.closed:
            return
        link.closed = True
        for role in ("client", "upstream"):
            if link.events[role]:
                self._selector.unregister(link.sock(role))
            if reset:
                _reset(link.sock(role))
            else:
                link.sock(role).close()
        self._links.remove(link)

    def _close_all(self) -> None:
        self._close_links(list(self._links))
        self._run_requests()
        self._selector.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()


def _events(read: bool, write: bool) -> int:
    return (READ if read else 0) | (WRITE if write else 0)


def _readable(pipe: _Pipe) -> bool:
    """Whether ``pipe``'s source should be read now: it has not ended and its bytes are being taken."""
    return not pipe.eof and pipe.pending() < MAX_PENDING


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a TCP reset rather than a FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RESET)
    sock.close()


def _loopback(host: str) -> str:
    """``host`` as a loopback IPv4 address; anything outside 127.0.0.0/8 is refused with ValueError."""
    literal = "127.0.0.1" if host == "localhost" else host
    try:
        address = ipaddress.ip_address(literal)
    except ValueError:
        raise ValueError(f"chaos proxy: {host!r} is not an IP address in {LOOPBACK}") from None
    if address.version != 4 or address not in LOOPBACK:
        raise ValueError(f"chaos proxy: {host!r} is outside {LOOPBACK}; it only ever connects to loopback")
    return literal


def _port(port: int) -> int:
    if not 0 < port < 65536:
        raise ValueError(f"chaos proxy: {port} is not a TCP port")
    return port


def _directions(direction: str) -> frozenset[str]:
    if direction == "both":
        return frozenset(DIRECTIONS)
    if direction in DIRECTIONS:
        return frozenset({direction})
    raise ValueError(f"chaos proxy: direction must be 'up', 'down' or 'both', not {direction!r}")


def main(argv: list[str] | None = None) -> None:
    """Serve a proxy to ``--target`` until Ctrl-C, after printing the address to connect to."""
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.proxy", description=DESCRIPTION)
    parser.add_argument("--target", required=True, help="HOST:PORT on loopback to forward to")
    parser.add_argument("--listen", default="127.0.0.1", help="loopback address to listen on")
    args = parser.parse_args(argv)
    host, _, port = args.target.rpartition(":")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    # Ctrl-C stops it even when started in the background of a shell, which starts it with SIGINT ignored (Python then
    # keeps it ignored); the interrupt may come as soon as the address is out, so it is caught around all of it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with contextlib.suppress(KeyboardInterrupt), ChaosProxy((host, int(port)), args.listen) as proxy:
        print(proxy.address, flush=True)
        threading.Event().wait()


if __name__ == "__main__":
    main()
