"""Followed output: one open ``docker logs --follow`` stream per reader, read ahead into a bounded buffer.

Reading a container's log from a point means the engine scans its log file from the start, so a
reader that follows a running container must not ask anew every poll. The first request of a
session (the manager's id for one client's stream) opens the engine's follow stream from the
cursor; a thread reads it ahead, at most ``FOLLOW_BUFFER`` bytes (then it waits: the engine holds
the rest); each request of that session takes what is there without waiting, so no agent worker
is ever held. A session unread for ``FOLLOW_IDLE`` seconds is closed; one that is lost (an agent
restart) is opened again from the cursor the manager sends with every request.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import docker

from gpumgr.agent.runtimes.docker_run import Piece, lines, open_logs
from gpumgr.wire import defaults

#: Bytes read ahead per session before its reader waits.
FOLLOW_BUFFER = 4 * defaults.LOGS_CHUNK
#: A session unread this long is closed.
FOLLOW_IDLE = 30.0
#: Open sessions at most; the least recently read goes first.
MAX_SESSIONS = 64


class Follower:
    """One session: the engine's follow stream of one container, read ahead by a thread."""

    def __init__(self, client: docker.DockerClient, container_id: str, since: str, skip: int,
                 tail: int | None) -> None:
        self.response = open_logs(client, container_id, since=since, tail=tail, follow=True)
        self.since, self.skip = since, skip
        self.used = time.monotonic()
        self._lines: deque[tuple[int, str, bytes]] = deque()
        self._size, self._ended, self._closed = 0, False, False
        self._cond = threading.Condition()
        threading.Thread(target=self._pump, args=(since, skip), name=f"logs-{container_id[:12]}", daemon=True).start()

    def read(self, limit: int) -> dict[str, Any]:
        """What has come since the last read, at most ``limit`` bytes: ``{frames, since, skip, more, ended}``."""
        with self._cond:
            self.used = time.monotonic()
            piece = Piece(self.since, self.skip, limit)
            while self._lines and piece.take(*self._lines[0]):
                self._size -= len(self._lines.popleft()[2])
            self.since, self.skip = piece.since, piece.skip
            piece.more = bool(self._lines)
            self._cond.notify_all()
            return piece.result(ended=self._ended and not self._lines)

    def close(self) -> None:
        """Stop reading: the engine's stream is closed, the reader thread ends."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.response.close()

    def _pump(self, since: str, skip: int) -> None:
        try:
            for line in lines(self.response, since, skip):
                with self._cond:
                    while self._size >= FOLLOW_BUFFER and not self._closed:
                        self._cond.wait(1.0)
                    if self._closed:
                        return
                    self._lines.append(line)
                    self._size += len(line[2])
        except Exception:  # closed under it, or the engine went away: the stream has ended
            pass
        finally:
            with self._cond:
                self._ended = True


class Followers:
    """The open sessions of one agent, by session id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, Follower] = {}

    def read(self, session: str, client: docker.DockerClient, container_id: str, *, since: str, skip: int,
             tail: int | None, limit: int) -> dict[str, Any]:
        """The next piece of session ``session``, opening it from the cursor if it is not open."""
        with self._lock:
            self._expire()
            follower = self._open.get(session)
        if follower is None:
            follower = Follower(client, container_id, since, skip, tail)
            with self._lock:
                self._open[session] = follower
                while len(self._open) > MAX_SESSIONS:
                    oldest = min(self._open, key=lambda s: self._open[s].used)
                    self._open.pop(oldest).close()
        piece = follower.read(limit)
        if piece["ended"]:
            with self._lock:
                self._open.pop(session, None)
            follower.close()
        return piece

    def close(self) -> None:
        """Close every session (the agent stops)."""
        with self._lock:
            followers, self._open = list(self._open.values()), {}
        for follower in followers:
            follower.close()

    def _expire(self) -> None:
        now = time.monotonic()
        for session in [s for s, f in self._open.items() if now - f.used > FOLLOW_IDLE]:
            self._open.pop(session).close()
