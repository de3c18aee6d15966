"""A bounded, thread-safe log of what happened in the cluster, served by ``GET /v1/events``."""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from typing import Any

from gpumgr.wire import defaults
from gpumgr.wire.names import EventType


class EventLog:
    """Keeps the last ``size`` events, oldest first, each with a growing integer ``id``."""

    def __init__(self, size: int = defaults.EVENTS_KEPT) -> None:
        self._events: deque[dict[str, Any]] = deque(maxlen=size)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def record(self, kind: EventType, message: str, *, node: str | None = None,
               container: str | None = None, **detail: Any) -> dict[str, Any]:
        """Append one event and return it."""
        with self._lock:
            event = {"id": next(self._ids), "time": time.time(), "type": str(kind), "node": node,
                     "container": container, "message": message, **detail}
            self._events.append(event)
        return event

    def since(self, after: int = 0, kinds: set[str] | None = None) -> list[dict[str, Any]]:
        """Events with ``id > after`` (optionally of the given kinds), oldest first."""
        with self._lock:
            return [e for e in self._events if e["id"] > after and (not kinds or e["type"] in kinds)]
