"""Where event ids come from: blocks reserved in a store ahead of use, on a thread of their own.

A client following ``GET /v1/events?since=`` must never skip an event, so an id is never handed out
twice, and ids only rise, across restarts and leaders. The event path (which runs under the model's
lock) never waits on a store: :class:`Reserver` reserves the next block in the background, before
the current one runs out, and the event log takes ids from memory.

When no block could be reserved in time (the store is unreachable), ids go on past the last block,
at most :data:`UNRESERVED` of them, and the next block the log uses starts above every id it handed
out. Every term (a manager's start on its state directory, an election) begins that many ids above
the store's ceiling, so whatever an earlier term numbered without a reservation lies in a gap that
no later term uses. The log declares that gap with an event (``ids_skipped``). Beyond the bound, or
before a term's first block, an event waits for its id and is shown once it has one.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path

from gpumgr.wire import security

log = logging.getLogger(__name__)

IDS_FILE = "event_ids.json"
#: Ids reserved at once: one store write per this many events.
ID_BLOCK = 10_000
#: The most ids handed out past the last block reserved, and the gap each term leaves above the store's ceiling.
UNRESERVED = ID_BLOCK
#: A failed reservation is tried again after this long, doubling up to :data:`RETRY_MAX` (seconds).
RETRY_MIN = 0.2
RETRY_MAX = 5.0

#: ``reserve(count)``: ``count`` ids above every id the store reserved before (or raises).
Reserve = Callable[[int], range]


class IdFile:
    """``event_ids.json`` in a state directory: the highest id reserved, written (fsynced) before any is used."""

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder, IDS_FILE)
        self._lock = threading.Lock()

    def reserve(self, count: int) -> range:
        """Raise the file's ceiling by ``count`` and return the ids up to it; an unreadable file starts at 1."""
        with self._lock:
            ceiling = 0
            if self.path.exists():
                try:
                    ceiling = int(json.loads(self.path.read_text())["ceiling"])
                except (ValueError, KeyError, TypeError) as exc:
                    log.warning("%s is unreadable (%s); event ids start at 1", self.path, exc)
            security.write_private_text(self.path, json.dumps({"ceiling": ceiling + count}))
        return range(ceiling + 1, ceiling + count + 1)


class Counter:
    """Ids in memory only, for a log that keeps nothing across restarts (tests, tools)."""

    def __init__(self) -> None:
        self._next = 1
        self._lock = threading.Lock()

    def reserve(self, count: int) -> range:
        """The next ``count`` ids."""
        with self._lock:
            start, self._next = self._next, self._next + count
        return range(start, start + count)


class Reserver:
    """Reserves blocks on a thread of its own: never under the log's lock, never under the model's.

    ``wanted(term)`` (which takes the log's lock briefly) says how many ids to ask for and whether the
    block is its term's first, or None when no block is needed now; ``got(term, block, first)`` hands
    the block over. A failure is tried again with a doubling pause until a block comes or none is wanted.
    """

    def __init__(self, reserve: Reserve, wanted: Callable[[int], tuple[int, bool] | None],
                 got: Callable[[int, range, bool], None]) -> None:
        self._reserve = reserve
        self._wanted = wanted
        self._got = got
        self._cond = threading.Condition()
        self._asked: int | None = None
        self._thread: threading.Thread | None = None

    def reserve_now(self, count: int) -> range:
        """Reserve on the calling thread (a term's start, which holds no lock of the model or the log)."""
        return self._reserve(count)

    def ask(self, term: int) -> None:
        """Ask for a block for ``term``; returns at once (safe under the log's lock)."""
        if self._asked == term:  # asked already and not yet taken up: no lock on every event while ids run short
            return
        with self._cond:
            self._asked = term
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="event-ids", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        pause = RETRY_MIN
        while True:
            with self._cond:
                while self._asked is None:
                    self._cond.wait()
                term, self._asked = self._asked, None
            wanted = self._wanted(term)
            if wanted is None:
                continue
            count, first = wanted
            try:
                block = self._reserve(count)
            except Exception as exc:  # the store is away, or this manager does not lead: try again later
                log.log(logging.WARNING if pause == RETRY_MIN else logging.DEBUG,
                        "could not reserve event ids (%s); trying again", exc)
                with self._cond:
                    if self._asked is None:
                        self._asked = term
                    self._cond.wait(pause)
                pause = min(pause * 2, RETRY_MAX)
                continue
            pause = RETRY_MIN
            self._got(term, block, first)
