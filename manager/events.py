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
from collections.abc import Callable, Iterator
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

#: An event's text: a string, or a function and the arguments it formats the text from when the event
#: is read (``(placed_text, memory, gpus)``); a string costs its formatting on every event written.
Message = str | tuple[Any, ...]
#: An event about no tenant's container (a node's): it has no "tenant" key at all.
_NO_TENANT = object()


class _IdBlocks:
    """Event ids that never repeat across restarts of a manager with a state directory."""

    def __init__(self, folder: str | Path | None) -> None:
        self.path = Path(folder, IDS_FILE) if folder is not None else None
        self.next = 1
        if self.path is not None and self.path.exists():
            try:
                self.next = int(json.loads(self.path.read_text())["ceiling"]) + 1
            except (ValueError, KeyError, TypeError, OSError) as exc:
                log.warning("%s is unreadable (%s); event ids start at 1", self.path, exc)

    def block(self, last: int) -> range:
        """The next block of ids (call under the log's lock), made durable before any of it is used."""
        start = max(self.next, last + 1)
        ceiling = start + ID_BLOCK - 1
        if self.path is not None:
            security.write_private_text(self.path, json.dumps({"ceiling": ceiling}))
        self.next = ceiling + 1
        return range(start, ceiling + 1)


class _ReservedBlocks:
    """Event ids reserved in blocks from a shared store (etcd), so they keep rising across leaders.

    A block that cannot be reserved (the store is unreachable, or this manager was fenced off) must not
    lose the event: the ids go on from the last block, and the next reservation is tried at the next event.
    """

    def __init__(self, reserve: Callable[[int], range]) -> None:
        self._reserve = reserve

    def block(self, last: int) -> range:
        """The next block of ids (call under the log's lock); one id above ``last`` if the store fails."""
        try:
            return self._reserve(ID_BLOCK)
        except Exception as exc:  # any store failure: keep counting, reserve again later
            log.warning("could not reserve event ids in the store (%s); counting on from %d", exc, last)
            return range(last + 1, last + 2)


class EventLog:
    """Keeps the last ``size`` events, oldest first, each with a growing integer ``id``.

    Ids come from blocks noted in ``state_dir``, or, given ``reserve`` (a shared store's
    ``reserve_event_ids``), from blocks reserved there.
    """

    def __init__(self, size: int = defaults.EVENTS_KEPT, state_dir: str | Path | None = None,
                 reserve: Callable[[int], range] | None = None) -> None:
        #: (id, time, type, node, container, message, tenant, detail): see :meth:`record`
        self._events: deque[tuple[Any, ...]] = deque(maxlen=size)
        self._lock = threading.Lock()
        self._ids: _IdBlocks | _ReservedBlocks = _ReservedBlocks(reserve) if reserve is not None \
            else _IdBlocks(state_dir)
        #: the block of ids in use, and what is left of it (ids are taken with ``next``: no Python call)
        self._range = range(0)
        self._left: Iterator[int] = iter(self._range)
        #: the highest id of the blocks used up: a block the store cannot give goes on from it
        self._last = 0

    def renew_ids(self) -> None:
        """Reserve a fresh block of ids now (a new leader's come after its predecessor's)."""
        with self._lock:
            if isinstance(self._ids, _ReservedBlocks):
                self._next_block()

    def _next_block(self) -> None:
        """Start a new block of ids (call under the lock); what was left of the last one is skipped."""
        if self._range:
            self._last = max(self._last, self._range[-1])
        self._range = self._ids.block(self._last)
        self._left = iter(self._range)

    def record(self, kind: EventType, message: Message, /, *, node: str | None = None,
               container: str | None = None, **detail: Any) -> int:
        """Append one event and return its id; ``detail`` never overrides the event's own keys.

        The event is kept as a tuple and made a dict only when read (:meth:`since`): most events are
        written many times more often than anyone reads them, on the map's hot path. ``message`` may
        be a :data:`Message` tuple, formatted then too; its arguments must not change afterwards.
        """
        tenant = detail.pop("tenant", _NO_TENANT) if detail else _NO_TENANT
        return self.add(kind, message, node, container, tenant, detail or None)

    def add(self, kind: EventType, message: Message, node: str | None, container: str | None,
            tenant: str | object | None = None, detail: dict[str, Any] | None = None) -> int:
        """:meth:`record` for a container's event, tagged with its ``tenant``; ``detail`` is kept as it is given.

        The caller lets ``detail`` go (it is not copied unless a value in it is not a plain atom).
        """
        if detail:
            for value in detail.values():
                if value is not None and type(value) not in _ATOMS:  # copied now: the caller's may change
                    detail = {k: v if v is None or type(v) in _ATOMS else clean_detail(v, DETAIL_DEPTH)
                              for k, v in detail.items()}
                    break
        with self._lock:
            taken = next(self._left, None)
            if taken is None:
                self._next_block()
                taken = next(self._left)
            self._events.append((taken, time.time(), kind, node, container, message, tenant, detail))
        return taken

    def since(self, after: int = 0, kinds: set[str] | None = None) -> list[dict[str, Any]]:
        """Events with ``id > after`` (optionally of the given kinds), oldest first, as dicts."""
        with self._lock:
            kept = [e for e in self._events if e[0] > after]
        if kinds:
            kept = [e for e in kept if (_NAMES.get(e[2]) or str(e[2])) in kinds]
        return [_as_dict(e) for e in kept]


def _as_dict(event: tuple[Any, ...]) -> dict[str, Any]:
    """A stored event as the API serves it: the detail's keys and its tenant first, its own keys last and winning."""
    taken, when, kind, node, container, message, tenant, detail = event
    if type(message) is tuple:
        message = message[0](*message[1:])
    own = {"id": taken, "time": when, "type": _NAMES.get(kind) or str(kind), "node": node, "container": container,
           "message": message}
    shown = {k: v for k, v in detail.items() if k not in OWN_KEYS} if detail else {}
    if tenant is not _NO_TENANT:
        shown["tenant"] = tenant
    return {**shown, **own} if shown else own
