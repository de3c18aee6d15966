"""The agent's end of the runtime hook's socket: a Unix stream socket, one request per connection.

The OCI runtime hook is a fresh process for every GPU container created, so its side of the link
must be cheap to start: the standard library's ``socket`` and the msgpack envelope, each message
a 4-byte big-endian length and then the frame (``wire.envelope.frame``). Here the listening socket
and its connections are plain file descriptors in the agent's ZeroMQ poller, read without
blocking, so a slow or broken client never stalls the agent's link to the manager. The socket is
made readable and writable by root only: whoever may create containers may ask for grants.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpumgr.wire import defaults, envelope
from gpumgr.wire.security import trusted_peer

log = logging.getLogger(__name__)

#: Connections served at once; more are accepted and closed at once (each hook then says so).
READ_SIZE = 64 * 1024


@dataclass(eq=False)
class HookConnection:
    """One hook process waiting for its answer."""

    sock: socket.socket
    deadline: float
    buffer: bytearray = field(default_factory=bytearray)

    def fileno(self) -> int:
        """The descriptor the poller watches."""
        return self.sock.fileno()


class HookListener:
    """Accepts hook connections and reads one framed request from each, never blocking."""

    def __init__(self, path: str, timeout: float) -> None:
        Path(path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        Path(path).unlink(missing_ok=True)
        self.path = path
        self.timeout = timeout
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.bind(path)
            os.chmod(path, 0o600)
            self.sock.listen(64)
            self.sock.setblocking(False)
        except OSError:
            self.sock.close()
            raise
        self._reading: dict[int, HookConnection] = {}
        self._waiting: set[HookConnection] = set()

    def fileno(self) -> int:
        """The listening descriptor, for the poller."""
        return self.sock.fileno()

    def descriptors(self) -> list[int]:
        """Every descriptor the poller should watch for input now: the listener and unread connections."""
        return [self.fileno(), *self._reading]

    def ready(self, fds: set[int]) -> list[tuple[HookConnection, bytes]]:
        """Serve the descriptors the poller found readable; return each request that is now complete."""
        complete = []
        if self.fileno() in fds:
            self._accept()
        for fd in [fd for fd in fds if fd in self._reading]:
            conn = self._reading[fd]
            frame = self._read(conn)
            if frame is not None:
                del self._reading[fd]
                self._waiting.add(conn)
                complete.append((conn, frame))
        return complete

    def answer(self, conn: HookConnection, frame: bytes) -> None:
        """Send ``frame`` as the reply and close; a hook that gave up is not an error."""
        self._waiting.discard(conn)
        with contextlib.suppress(OSError):
            conn.sock.setblocking(True)
            conn.sock.settimeout(1.0)
            conn.sock.sendall(envelope.frame(frame))
        self._close(conn)

    def drop(self, conn: HookConnection) -> None:
        """Close ``conn`` without an answer (its request could not be read)."""
        self._reading.pop(conn.fileno(), None)
        self._waiting.discard(conn)
        self._close(conn)

    def expire(self) -> None:
        """Close connections that have not sent a whole request in time."""
        now = time.monotonic()
        for conn in [c for c in self._reading.values() if c.deadline < now]:
            log.warning("dropped a runtime hook connection that sent no whole request in %gs", self.timeout)
            self.drop(conn)

    def close(self) -> None:
        """Close every connection and the listener, and remove the socket file."""
        for conn in [*self._reading.values(), *self._waiting]:
            self._close(conn)
        self._reading.clear()
        self._waiting.clear()
        self.sock.close()
        with contextlib.suppress(OSError):
            Path(self.path).unlink()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("could not accept a runtime hook connection: %s", exc)
                return
            if not trusted_peer(sock):
                log.warning("refused a runtime hook connection from neither root nor this agent's user")
                sock.close()
                continue
            if len(self._reading) + len(self._waiting) >= defaults.HOOK_MAX_CONNECTIONS:
                log.warning("refused a runtime hook connection: %d already open", defaults.HOOK_MAX_CONNECTIONS)
                sock.close()
                continue
            sock.setblocking(False)
            conn = HookConnection(sock, time.monotonic() + self.timeout)
            self._reading[conn.fileno()] = conn

    def _read(self, conn: HookConnection) -> bytes | None:
        """Read what is there; the frame once whole, None while incomplete (or after dropping ``conn``)."""
        try:
            data = conn.sock.recv(READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            log.warning("dropped a runtime hook connection: %s", exc)
            self.drop(conn)
            return None
        if not data:
            self.drop(conn)  # the hook went away before its request was whole
            return None
        conn.buffer += data
        if len(conn.buffer) < envelope.FRAME_HEADER.size:
            return None
        (size,) = envelope.FRAME_HEADER.unpack_from(conn.buffer)
        if size > defaults.MAX_MESSAGE_BYTES:
            log.warning("dropped a runtime hook request of %d bytes (over the %d bound)", size,
                        defaults.MAX_MESSAGE_BYTES)
            self.drop(conn)
            return None
        end = envelope.FRAME_HEADER.size + size
        return bytes(conn.buffer[envelope.FRAME_HEADER.size:end]) if len(conn.buffer) >= end else None

    @staticmethod
    def _close(conn: HookConnection) -> None:
        with contextlib.suppress(OSError):
            conn.sock.close()
