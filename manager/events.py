"""A bounded, thread-safe log of what happened in the cluster, served by ``GET /v1/events``.

Event ids keep rising across manager restarts, so a client following ``since=`` misses nothing:
ids are handed out in blocks whose upper end is written (fsynced) to ``event_ids.json`` in the
state directory before any id of the block is used; a restarted manager starts above the last end.
An agent's ``detail`` is copied in bounded: its keys never replace the event's own, and nesting is
cut at a fixed depth, so no report can break the log or the JSON that serves it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpumgr.wire import defaults, security
from gpumgr.wire.names import EventType
from gpumgr.wire.protocol import clean_detail

log = logging.getLogger(__name__)

#: the keys every event has; a detail key of the same name is dropped
OWN_KEYS = frozenset({"id", "time", "type", "node", "container", "message"})
IDS_FILE = "event_ids.json"
ID_BLOCK = 10_000
#: how deep an event keeps a detail value (:func:`gpumgr.wire.protocol.clean_detail` cuts it)
DETAIL_DEPTH = 4
#: detail values kept as they are without a call to :func:`clean_detail`
_ATOMS = frozenset({bool, int, float, str})
_NAMES = {kind: str(kind) for kind in EventType}


class _IdBlocks:
    """Event ids that never repeat across restarts of a manager with a state directory."""

    def __init__(self, folder: str | Path | None) -> None:
        self.path = Path(folder, IDS_FILE) if folder is not None else None
        self.next = 1
        self.ceiling = 0
        if self.path is not None and self.path.exists():
            try:
                self.next = int(json.loads(self.path.read_text())["ceiling"]) + 1
            except (ValueError, KeyError, TypeError, OSError) as exc:
                log.warning("%s is unreadable (%s); event ids start at 1", self.path, exc)
        self.ceiling = self.next - 1

    def take(self) -> int:
        """The next id (call under the log's lock); a new block is made durable before it is used."""
        if self.next > self.ceiling:
            self.ceiling = self.next + ID_BLOCK - 1
            if self.path is not None:
                security.write_private_text(self.path, json.dumps({"ceiling": self.ceiling}))
        taken, self.next = self.next, self.next + 1
        return taken


class _ReservedBlocks:
    """Event ids reserved in blocks from a shared store (etcd), so they keep rising across leaders.

    A block that cannot be reserved (the store is unreachable, or this manager was fenced off) must not
    lose the event: the ids go on from the last block, and the next reservation is tried at the next event.
    """

    def __init__(self, reserve: Callable[[int], range]) -> None:
        self._reserve = reserve
        self._ids: range = range(0)
        self._last = 0

    def take(self) -> int:
        """The next id (call under the log's lock)."""
        if not self._ids:
            try:
                self._ids = self._reserve(ID_BLOCK)
            except Exception as exc:  # any store failure: keep counting, reserve again later
                log.warning("could not reserve event ids in the store (%s); counting on from %d", exc, self._last)
                self._ids = range(self._last + 1, self._last + 2)
        taken, self._ids = self._ids[0], self._ids[1:]
        self._last = taken
        return taken

    def renew(self) -> None:
        """Reserve a fresh block now (this manager has just become leader), not under the map's lock later."""
        try:
            self._ids = self._reserve(ID_BLOCK)
        except Exception as exc:  # the next event tries again
            log.warning("could not reserve event ids in the store (%s); trying again at the next event", exc)
            self._ids = range(0)


class EventLog:
    """Keeps the last ``size`` events, oldest first, each with a growing integer ``id``.

    Ids come from blocks noted in ``state_dir``, or, given ``reserve`` (a shared store's
    ``reserve_event_ids``), from blocks reserved there.
    """

    def __init__(self, size: int = defaults.EVENTS_KEPT, state_dir: str | Path | None = None,
                 reserve: Callable[[int], range] | None = None) -> None:
        self._events: deque[dict[str, Any]] = deque(maxlen=size)
        self._lock = threading.Lock()
        self._ids: _IdBlocks | _ReservedBlocks = _ReservedBlocks(reserve) if reserve is not None \
            else _IdBlocks(state_dir)

    def renew_ids(self) -> None:
        """Reserve a fresh block of ids now (a new leader's come after its predecessor's)."""
        with self._lock:
            if isinstance(self._ids, _ReservedBlocks):
                self._ids.renew()

    def record(self, kind: EventType, message: str, /, *, node: str | None = None,
               container: str | None = None, **detail: Any) -> dict[str, Any]:
        """Append one event and return it; ``detail`` never overrides the event's own keys."""
        extra = {k: v if v is None or type(v) in _ATOMS else clean_detail(v, DETAIL_DEPTH)
                 for k, v in detail.items() if k not in OWN_KEYS} if detail else {}
        kind_name = _NAMES.get(kind) or str(kind)
        with self._lock:
            event = {**extra, "id": self._ids.take(), "time": time.time(), "type": kind_name, "node": node,
                     "container": container, "message": message}
            self._events.append(event)
        return event

    def since(self, after: int = 0, kinds: set[str] | None = None) -> list[dict[str, Any]]:
        """Events with ``id > after`` (optionally of the given kinds), oldest first."""
        with self._lock:
            return [e for e in self._events if e["id"] > after and (not kinds or e["type"] in kinds)]
