"""A bounded, thread-safe log of what happened in the cluster, served by ``GET /v1/events``."""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from gpumgr.wire import defaults
from gpumgr.wire.names import EventType


class EventLog:
    """Keeps the last ``size`` events, oldest first, each with a growing integer ``id``.

    Ids count from 1 in each process unless ``ids`` hands them out (e.g.
    :meth:`gpumgr.manager.store.EventIds.next`, so they keep rising across restarts and leaders).
    """

    def __init__(self, size: int = defaults.EVENTS_KEPT, ids: Callable[[], int] | None = None) -> None:
        self._events: deque[dict[str, Any]] = deque(maxlen=size)
        self._next_id = ids or itertools.count(1).__next__
        self._lock = threading.Lock()

    def record(self, kind: EventType, message: str, *, node: str | None = None,
               container: str | None = None, **detail: Any) -> dict[str, Any]:
        """Append one event and return it."""
        with self._lock:
            event = {"id": self._next_id(), "time": time.time(), "type": str(kind), "node": node,
                     "container": container, "message": message, **detail}
            self._events.append(event)
        return event

    def since(self, after: int = 0, kinds: set[str] | None = None) -> list[dict[str, Any]]:
        """Events with ``id > after`` (optionally of the given kinds), oldest first."""
        with self._lock:
            return [e for e in self._events if e["id"] > after and (not kinds or e["type"] in kinds)]
