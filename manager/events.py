"""A bounded, thread-safe log of what happened in the cluster, served by ``GET /v1/events``.

Event ids keep rising across manager restarts and leaders, and are never handed out twice, so a
client following ``since=`` misses nothing: they come from blocks reserved in the store ahead of use
(``event_ids.json`` in the state directory, or etcd), on a thread of their own
(:mod:`gpumgr.manager.event_ids`), so recording an event never waits on a store.
An agent's ``detail`` is copied in bounded: its keys never replace the event's own, and nesting is
cut at a fixed depth, so no report can break the log or the JSON that serves it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gpumgr.manager.event_ids import ID_BLOCK, Counter, IdFile, Reserver
from gpumgr.wire import defaults
from gpumgr.wire.names import EventType
from gpumgr.wire.protocol import clean_detail

log = logging.getLogger(__name__)

#: the keys every event has; a detail key of the same name is dropped
OWN_KEYS = frozenset({"id", "time", "type", "node", "container", "message"})
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


class EventLog:
    """Keeps the last ``size`` events, oldest first, each with a rising integer ``id`` no other event had.

    Ids come from blocks noted in ``state_dir``, or, given ``reserve`` (a shared store's
    ``reserve_event_ids``), from blocks reserved there at each term's start (:meth:`renew_ids`); with
    neither, from memory. ``block`` ids are reserved at once (:data:`gpumgr.manager.event_ids.ID_BLOCK`).
    """

    def __init__(self, size: int = defaults.EVENTS_KEPT, state_dir: str | Path | None = None,
                 reserve: Callable[[int], range] | None = None, block: int | None = None) -> None:
        #: (id, time, type, node, container, message, tenant, detail): see :meth:`record`
        self._events: deque[tuple[Any, ...]] = deque(maxlen=size)
        #: events still waiting for an id (no block yet this term, or past the unreserved bound), oldest first
        self._pending: deque[tuple[Any, ...]] = deque(maxlen=size)
        self._lock = threading.Lock()
        stored = reserve is not None or state_dir is not None
        # past a block, one id tells readers the ids went unreserved; in memory one block lasts for ever
        self._block = max(2, block or ID_BLOCK) if stored else 1 << 62
        #: ids each term leaves unused above the store's ceiling, and the most handed out past a reservation
        self._gap = self._block if stored else 0
        source = reserve or (IdFile(state_dir).reserve if state_dir is not None else Counter().reserve)
        self._reserver = Reserver(source, self._wanted, self._reserved)
        #: what is left of the block in use (ids are taken with ``next``: no Python call), and its last id
        self._left: Iterator[int] = iter(())
        self._end = 0
        #: taking this id asks for the next block; the next block, once reserved
        self._low_at = 0
        self._spare: range | None = None
        #: the highest id reserved this term (None: no block yet), and the term
        self._ceiling: int | None = None
        self._term = 0
        if reserve is None:  # one manager on its state directory (or memory): its term starts now
            self.renew_ids()

    def renew_ids(self) -> None:
        """Start a term (a new leader's, or this process's): ids from a block above anything an earlier term used.

        Reserved on the calling thread, which must hold neither the model's lock nor the log's; if the
        store fails, the block is reserved in the background and events wait for their ids meanwhile.
        """
        with self._lock:
            self._term += 1
            term, self._ceiling, self._spare = self._term, None, None
            self._left, self._low_at, self._end = iter(()), 0, 0
        try:
            block = self._reserver.reserve_now(self._gap + self._block)
        except Exception as exc:  # the store is away: the reserver keeps trying
            log.warning("could not reserve event ids at the start of a term (%s); events wait for their ids", exc)
            self._reserver.ask(term)
            return
        self._reserved(term, block, True)

    @property
    def size(self) -> int:
        """How many events the log keeps (the oldest go first)."""
        return self._events.maxlen or 0

    def _handed(self) -> int:
        """The highest id handed out (call under the lock)."""
        return self._events[-1][0] if self._events else 0

    def _wanted(self, term: int) -> tuple[int, bool] | None:
        """How many ids the reserver should ask for now, and whether it is the term's first block; None: none."""
        with self._lock:
            if term != self._term or self._spare is not None:
                return None
            if self._ceiling is None:
                return self._gap + self._block, True
            return self._block + max(0, self._handed() - self._ceiling), False

    def _reserved(self, term: int, block: range, first: bool) -> None:
        """Take a reserved ``block`` for ``term``: the term's first skips the gap; ids at or below any handed out go."""
        with self._lock:
            if term != self._term:
                return  # an ended term's block: its ids stay unused
            usable = block[self._gap:] if first else block
            handed = self._handed()
            usable = range(max(usable.start, handed + 1), usable.stop)
            self._ceiling = max(self._ceiling or 0, block[-1] if block else 0)
            if not usable:
                self._reserver.ask(term)
            elif handed >= self._end:  # the block in use is spent (ids went on unreserved, or wait): use it now
                if self._end and handed > self._end:
                    log.warning("event ids are reserved again from %d on", usable.start)
                self._install(usable)
                self._number_pending()
            else:
                self._spare = usable

    def _install(self, block: range) -> None:
        self._left, self._end, self._spare = iter(block), block[-1], None
        self._low_at = block.start + len(block) // 2

    def _number_pending(self) -> None:
        while self._pending:
            taken = next(self._left, None)
            if taken is None:
                self._reserver.ask(self._term)
                return
            self._events.append((taken, *self._pending.popleft()))

    def _append(self, taken: int | None, event: tuple[Any, ...]) -> int:
        """Keep ``event`` (under the lock) with ``taken``, the id drawn for it; 0 when it must wait for an id.

        ``taken`` is the low-water id (the next block is asked for), or None when the block is spent.
        """
        if taken is not None:
            self._low_at = self._end + 1
            self._reserver.ask(self._term)
        else:
            taken = self._take_slow()
            if taken is None:
                self._pending.append(event)
                return 0
        self._events.append((taken, *event))
        return taken

    def _take_slow(self) -> int | None:
        """An id once the block in use is spent: the spare's, else one past the reservation (bounded), else none."""
        if self._spare is not None:
            self._install(range(max(self._spare.start, self._handed() + 1), self._spare.stop))
            taken = next(self._left, None)
            if taken is not None:
                return taken
        self._reserver.ask(self._term)
        handed = self._handed()
        if self._ceiling is None or self._pending or handed >= self._ceiling + self._gap:
            return None
        if handed == self._end:  # the first past the reservation: readers are told, in the log itself
            log.warning("no event ids are reserved past %d (the store did not answer in time): up to %d more are "
                        "handed out unreserved, and no later block or term uses them", handed, self._gap)
            told = (_unreserved_text, handed + 1, self._ceiling + self._gap)
            self._events.append((handed + 1, time.time(), EventType.IDS_UNRESERVED, None, None, told, _NO_TENANT,
                                 None))
            handed += 1
        return handed + 1

    def record(self, kind: EventType, message: Message, /, *, node: str | None = None,
               container: str | None = None, **detail: Any) -> int:
        """Append one event and return its id (0 while it waits for one); ``detail`` never overrides its own keys.

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
            now, taken = time.time(), next(self._left, None)
            if taken is not None and taken < self._low_at:
                self._events.append((taken, now, kind, node, container, message, tenant, detail))
                return taken
            return self._append(taken, (now, kind, node, container, message, tenant, detail))

    def since(self, after: int = 0, kinds: set[str] | None = None) -> list[dict[str, Any]]:
        """Events with ``id > after`` (optionally of the given kinds), oldest first, as dicts."""
        with self._lock:
            kept = [e for e in self._events if e[0] > after]
        if kinds:
            kept = [e for e in kept if (_NAMES.get(e[2]) or str(e[2])) in kinds]
        return [_as_dict(e) for e in kept]


def _unreserved_text(first: int, last: int) -> str:
    return (f"event ids from {first} on are handed out without a reservation (the store did not answer), at most "
            f"up to {last}: a later block or leader starts above {last}, so ids may jump there")


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
