"""The wait queue: requests that asked to wait for room, in the order room goes to them, kept on disk.

Order is by *effective priority*, highest first, then first come. A request's effective priority is
its priority plus one step for every ``aging`` seconds it has waited, so a low-priority request is
never starved: it passes a newer one of priority p+k after k steps. Since every waiting request ages
at the same rate, ``priority - queued_at / aging`` orders them for all time, so the order is a sorted
list kept once, never re-sorted as time passes.

The journal (``queue.jsonl`` in the state directory, mode 0600) holds one JSON line per request
queued and one per request that left; a restarted manager reads it back, and it is rewritten whole
when it has grown well past the queue.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sortedcontainers import SortedList

from gpumgr.wire import defaults, security

log = logging.getLogger(__name__)
JOURNAL = "queue.jsonl"


class WaitQueue:
    """Queued request ids in dispatch order; the caller holds the map's lock around every call."""

    def __init__(self, aging: float = defaults.QUEUE_AGING) -> None:
        self.aging = aging
        self._order: SortedList = SortedList()
        self._keys: dict[str, tuple[float, int, str]] = {}
        self.next_seq = 1

    def key(self, priority: int, queued_at: float, seq: int, cid: str) -> tuple[float, int, str]:
        """The sort key: lower sorts first, so the key is minus the time-free part of the effective priority."""
        return (-(priority - queued_at / self.aging), seq, cid)

    def add(self, cid: str, priority: int, queued_at: float, seq: int | None = None) -> int:
        """Queue ``cid``; return its sequence number (first come is the tie-break)."""
        if seq is None:
            seq = self.next_seq
        self.next_seq = max(self.next_seq, seq + 1)
        key = self.key(priority, queued_at, seq, cid)
        self._keys[cid] = key
        self._order.add(key)
        return seq

    def clear(self) -> None:
        """Forget every queued id (the map starts from nothing; the store keeps the queue)."""
        self._order.clear()
        self._keys.clear()

    def discard(self, cid: str) -> bool:
        """Take ``cid`` out; False if it was not queued."""
        key = self._keys.pop(cid, None)
        if key is None:
            return False
        self._order.remove(key)
        return True

    def at(self, position: int) -> str:
        """The id at 0-based ``position``."""
        return str(self._order[position][2])

    def position(self, cid: str) -> int | None:
        """``cid``'s 1-based place in line, or None."""
        key = self._keys.get(cid)
        return None if key is None else self._order.bisect_left(key) + 1

    def effective(self, priority: int, queued_at: float, now: float) -> float:
        """The effective priority of a request of ``priority`` queued at ``queued_at``, at ``now``."""
        return priority + max(0.0, now - queued_at) / self.aging

    def before(self, priority: int, queued_at: float) -> int:
        """How many queued requests come before one of ``priority`` queued at ``queued_at`` (ahead of its ties)."""
        return int(self._order.bisect_left((-(priority - queued_at / self.aging),)))

    def ids(self) -> Iterator[str]:
        """Ids in order without copying the whole list (the caller must not change the queue meanwhile)."""
        return (key[2] for key in self._order)

    def __len__(self) -> int:
        return len(self._order)


class QueueJournal:
    """An append-only record of the queue, replayed at start; every ``add`` is on disk before it returns."""

    def __init__(self, folder: str | Path | None) -> None:
        self.path = Path(folder, JOURNAL) if folder is not None else None
        self._fd: int | None = None
        self._lines = 0
        self._lock = threading.Lock()

    def load(self) -> list[dict[str, Any]]:
        """The requests still queued, in the order they were queued; a torn last line is ignored."""
        if self.path is None or not self.path.exists():
            return []
        queued: dict[str, dict[str, Any]] = {}
        with open(self.path, encoding="utf-8", errors="replace") as lines:
            for number, line in enumerate(lines, 1):
                try:
                    entry = json.loads(line)
                    if entry["op"] == "add":
                        queued[str(entry["request"]["id"])] = entry["request"]
                    elif entry["op"] == "del":
                        queued.pop(str(entry["id"]), None)
                except (ValueError, KeyError, TypeError):
                    log.warning("queue journal %s line %d is unreadable; skipped", self.path, number)
        return list(queued.values())

    def open(self, queued: list[dict[str, Any]]) -> None:
        """Start a fresh journal holding ``queued`` (written whole, then appended to)."""
        if self.path is None:
            return
        self.rewrite(queued)

    def rewrite(self, queued: list[dict[str, Any]]) -> None:
        """Replace the journal with one ``add`` line per request still queued."""
        if self.path is None:
            return
        body = "".join(json.dumps({"op": "add", "request": r}, separators=(",", ":")) + "\n" for r in queued)
        with self._lock:
            security.write_private_text(self.path, body)
            if self._fd is not None:
                os.close(self._fd)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            self._lines = len(queued)

    def add(self, request: dict[str, Any]) -> None:
        """Record a queued request (call under the map's lock, so lines keep the map's order)."""
        self._write({"op": "add", "request": request})

    def remove(self, cid: str) -> None:
        """Record that ``cid`` left the queue (placed, withdrawn or expired)."""
        self._write({"op": "del", "id": cid})

    def sync(self) -> None:
        """Make every line written so far durable (outside the map's lock: it waits for the disk)."""
        with self._lock:
            fd = self._fd
            if fd is not None:
                os.fsync(fd)

    def needs_compaction(self, queued: int) -> bool:
        """True when the journal holds far more lines than the queue."""
        return self._fd is not None and self._lines > 2 * queued + defaults.QUEUE_JOURNAL_SLACK

    def close(self) -> None:
        """Close the journal file."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _write(self, entry: dict[str, Any]) -> None:
        if self.path is None:
            return
        line = (json.dumps(entry, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._fd is None:  # never opened by a restore: start appending to what is there
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            os.write(self._fd, line)
            self._lines += 1
