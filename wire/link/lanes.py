"""Lanes: the workers that run what a link receives, so the link's own thread only moves frames.

A link hands every incoming message, and every reply's completion, to a lane by who sent it (a
node's proven key, or a connection). One lane is one thread working through its own queue in order.
A sender with work waiting stays on its lane, so one node's messages and replies are handled in the
order they arrived; a sender with nothing waiting goes to the least loaded lane, so a node whose
handling is slow (a store write, a full lock) holds up only senders already queued behind it, never
one that arrives later. What waits for one sender is bounded: a peer that floods is dropped beyond
``per_key`` waiting items (its next heartbeat says it all again), but a completion is never dropped
(someone waits on it).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from gpumgr.wire import defaults

log = logging.getLogger(__name__)

_STOP = object()


class Lanes:
    """``count`` serial workers; :meth:`submit` runs work on the one lane of its key, in submission order."""

    def __init__(self, count: int = defaults.LINK_LANES, *, name: str = "lane",
                 per_key: int = defaults.LINK_LANE_BACKLOG) -> None:
        self.per_key = per_key
        self._queues: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(max(1, count))]
        self._waiting: dict[bytes, int] = {}
        #: the lane of each sender with work waiting, and how much waits on each lane
        self._lane_of: dict[bytes, int] = {}
        self._load = [0] * len(self._queues)
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._work, args=(q,), name=f"{name}-{i}", daemon=True)
                         for i, q in enumerate(self._queues)]
        self._started = False
        #: messages dropped because their sender already had ``per_key`` waiting
        self.dropped = 0

    def start(self) -> None:
        """Start the workers (idempotent)."""
        with self._lock:
            if self._started:
                return
            self._started = True
        for thread in self._threads:
            thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Let each lane finish what it holds, then stop it (bounded by ``timeout`` per lane)."""
        for q in self._queues:
            q.put(_STOP)
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(timeout)

    def submit(self, key: bytes, work: Callable[..., None], *args: Any, bounded: bool = True) -> bool:
        """Queue ``work(*args)`` on ``key``'s lane; False (dropped) if ``bounded`` and ``key`` has too much waiting."""
        with self._lock:
            waiting = self._waiting.get(key, 0)
            if bounded and waiting >= self.per_key:
                self.dropped += 1
                return False
            self._waiting[key] = waiting + 1
            lane = self._lane_of.get(key)
            if lane is None:  # nothing of its waits anywhere: it may go where the least waits
                lane = self._lane_of[key] = min(range(len(self._load)), key=self._load.__getitem__)
            self._load[lane] += 1
            # queued under the lock: two submits of one sender reach its lane in the order they were made
            self._queues[lane].put((key, work, args))
        return True

    def backlog(self) -> int:
        """Items waiting in every lane together."""
        with self._lock:
            return sum(self._waiting.values())

    def _work(self, q: queue.SimpleQueue[Any]) -> None:
        while True:
            item = q.get()
            if item is _STOP:
                return
            key, work, args = item
            try:
                work(*args)
            except Exception:  # one bad message must never stop the lane
                log.exception("handling a message from %r failed", key[:16])
            finally:
                self._done(key)

    def _done(self, key: bytes) -> None:
        with self._lock:
            self._load[self._lane_of[key]] -= 1
            left = self._waiting.get(key, 1) - 1
            if left > 0:
                self._waiting[key] = left
            else:
                self._waiting.pop(key, None)
                self._lane_of.pop(key, None)
