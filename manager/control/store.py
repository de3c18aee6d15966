"""What a manager keeps beyond its memory, behind one interface with two backends.

The grant map is never stored: agents' reports rebuild it after a restart or a failover. What the
engines cannot hold is kept here: node ⇄ key bindings, the join secret, the wait queue (each queued
request, in the order it was queued), event ids, reserved in blocks so they keep rising across
restarts and leaders without a write per event, and *intents*: what a client or the manager's policy
decided about a running container that its node has not carried out yet (a DELETE answered 202, a
preemption), written before anything acts on it, so a restart or a new leader carries it out.

- :class:`FileStore`: the state directory of one manager, the files it has always used
  (``nodes.json``, ``join_secret.json``, ``queue.jsonl``, ``event_ids.json``: the highest event id
  reserved, ``{"ceiling": N}``, the event log's own format); every change is
  on disk (fsynced) before it returns, except queue lines, which :meth:`Store.sync` makes durable so
  a burst of them shares one fsync.
- :class:`gpumgr.manager.control.store_etcd.EtcdStore`: the same things in etcd under a prefix, each write a
  transaction guarded by the leader's epoch, so several managers share them and a deposed leader's
  writes fail with :class:`Fenced`.

The manager's CURVE key pair is not here: it is one identity given to every manager as files.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from gpumgr.manager.model.queue import QueueJournal
from gpumgr.wire import security
from gpumgr.wire.errors import GpumgrError

NODES_FILE = "nodes.json"
SECRET_FILE = "join_secret.json"
EVENT_IDS_FILE = "event_ids.json"
INTENTS_FILE = "intents.json"
#: Event ids reserved at once: one store write per this many events (as the event log reserves them).
EVENT_ID_BLOCK = 10_000


class Fenced(GpumgrError):
    """A write was refused because this manager is no longer the leader (a newer epoch holds the store)."""

    code = "fenced"
    status = 503


class Store(ABC):
    """Node bindings, the join secret, the queue and event ids; every write is durable before it returns."""

    kind = "store"

    # --- node bindings -------------------------------------------------------------------------
    @abstractmethod
    def nodes(self) -> dict[str, str]:
        """Every binding, node name → the agent's public key."""

    @abstractmethod
    def bind(self, node: str, key: str) -> None:
        """Bind ``node`` to ``key`` (replacing any binding it had)."""

    def bind_many(self, bindings: dict[str, str]) -> None:
        """Bind every node of ``bindings`` to its key; a backend that can, in one durable write."""
        for node, key in bindings.items():
            self.bind(node, key)

    @abstractmethod
    def forget(self, node: str) -> bool:
        """Drop ``node``'s binding; False if it had none."""

    # --- the join secret -----------------------------------------------------------------------
    @abstractmethod
    def join_secret(self) -> str:
        """The current join secret; the first caller creates it, and racing callers get the same one."""

    @abstractmethod
    def rotate_secret(self) -> str:
        """Replace the join secret and return the new one."""

    # --- the wait queue ------------------------------------------------------------------------
    @abstractmethod
    def queued(self) -> list[dict[str, Any]]:
        """The requests still queued, in the order they were queued."""

    @abstractmethod
    def enqueue(self, request: dict[str, Any]) -> None:
        """Record a queued request (its ``id`` names it)."""

    @abstractmethod
    def dequeue(self, cid: str) -> None:
        """Record that ``cid`` left the queue; nothing happens if it was not there."""

    def sync(self) -> None:  # noqa: B027 - a backend whose writes are durable at once has nothing to do
        """Make every queue change so far durable."""

    def compact_queue(self, queued: list[dict[str, Any]]) -> bool:
        """Rewrite the queue's record as exactly ``queued`` if it has grown well past it; True if it did."""
        return False

    # --- intents -------------------------------------------------------------------------------
    @abstractmethod
    def intents(self) -> dict[str, dict[str, Any]]:
        """Every intent kept: grant id → ``{"node", "desired", "reason", ...}`` (see :mod:`~.model.intents`)."""

    @abstractmethod
    def intend(self, intents: dict[str, dict[str, Any]]) -> None:
        """Keep each intent of ``intents`` (replacing one the grant had); durable before it returns."""

    @abstractmethod
    def drop_intents(self, grants: list[str]) -> None:
        """Forget the intents of ``grants`` (carried out, or moot); one that is not kept is ignored."""

    # --- event ids -----------------------------------------------------------------------------
    @abstractmethod
    def reserve_event_ids(self, count: int) -> range:
        """``count`` event ids above every id reserved before, in this store's whole life."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release files or connections."""


class FileStore(Store):
    """The state directory ``folder`` (mode 0700, files 0600), as a single manager has always kept it."""

    kind = "dir"

    def __init__(self, folder: str | Path | None) -> None:
        self.folder = security.state_dir(folder)
        self._lock = threading.Lock()
        self._journal = QueueJournal(self.folder)

    def nodes(self) -> dict[str, str]:
        """Every binding in ``nodes.json``."""
        path = self.folder / NODES_FILE
        if not path.exists():
            return {}
        return {str(k): str(v) for k, v in security.read_private(path).get("nodes", {}).items()}

    def bind(self, node: str, key: str) -> None:
        """Rewrite ``nodes.json`` with ``node`` bound to ``key``."""
        with self._lock:
            self._save_nodes({**self.nodes(), node: key})

    def bind_many(self, bindings: dict[str, str]) -> None:
        """Rewrite ``nodes.json`` once with every node of ``bindings`` bound to its key (one fsync for all)."""
        with self._lock:
            self._save_nodes({**self.nodes(), **bindings})

    def forget(self, node: str) -> bool:
        """Rewrite ``nodes.json`` without ``node``."""
        with self._lock:
            nodes = self.nodes()
            if nodes.pop(node, None) is None:
                return False
            self._save_nodes(nodes)
            return True

    def join_secret(self) -> str:
        """The secret in ``join_secret.json``, created on first use (the first creator wins a race)."""
        path = self.folder / SECRET_FILE
        if not path.exists():
            security.create_private(path, {"secret": security.new_join_secret()})
        return str(security.read_private(path)["secret"])

    def rotate_secret(self) -> str:
        """Replace ``join_secret.json`` atomically."""
        secret = security.new_join_secret()
        security.write_private(self.folder / SECRET_FILE, {"secret": secret})
        return secret

    def queued(self) -> list[dict[str, Any]]:
        """The requests ``queue.jsonl`` still holds."""
        return self._journal.load()

    def enqueue(self, request: dict[str, Any]) -> None:
        """Append an ``add`` line to ``queue.jsonl``."""
        self._journal.add(request)

    def dequeue(self, cid: str) -> None:
        """Append a ``del`` line to ``queue.jsonl``."""
        self._journal.remove(cid)

    def sync(self) -> None:
        """fsync ``queue.jsonl``."""
        self._journal.sync()

    def compact_queue(self, queued: list[dict[str, Any]]) -> bool:
        """Rewrite ``queue.jsonl`` whole (atomically) once it holds far more lines than the queue."""
        if not self._journal.needs_compaction(len(queued)):
            return False
        self._journal.rewrite(queued)
        return True

    def intents(self) -> dict[str, dict[str, Any]]:
        """Every intent in ``intents.json``."""
        path = self.folder / INTENTS_FILE
        if not path.exists():
            return {}
        return {str(k): dict(v) for k, v in security.read_private(path).get("intents", {}).items()}

    def intend(self, intents: dict[str, dict[str, Any]]) -> None:
        """Rewrite ``intents.json`` (atomically, fsynced) with ``intents`` added."""
        with self._lock:
            self._save_intents({**self.intents(), **intents})

    def drop_intents(self, grants: list[str]) -> None:
        """Rewrite ``intents.json`` without ``grants`` (not at all if it held none of them)."""
        with self._lock:
            kept = self.intents()
            if any(kept.pop(grant, None) is not None for grant in list(grants)):
                self._save_intents(kept)

    def reserve_event_ids(self, count: int) -> range:
        """Raise ``event_ids.json``'s ceiling by ``count`` (durably) before handing out the ids up to it."""
        if count < 1:
            raise ValueError("reserve at least one event id")
        path = self.folder / EVENT_IDS_FILE
        with self._lock:
            start = int(security.read_private(path).get("ceiling", 0)) + 1 if path.exists() else 1
            security.write_private(path, {"ceiling": start + count - 1})
        return range(start, start + count)

    def close(self) -> None:
        """Close the queue journal."""
        self._journal.close()

    def _save_nodes(self, nodes: dict[str, str]) -> None:
        security.write_private(self.folder / NODES_FILE, {"nodes": nodes})

    def _save_intents(self, intents: dict[str, dict[str, Any]]) -> None:
        security.write_private(self.folder / INTENTS_FILE, {"intents": intents})


class EventIds:
    """Hands out rising event ids from blocks reserved in a store: one store write per block, not per event."""

    def __init__(self, store: Store, block: int = EVENT_ID_BLOCK) -> None:
        self._store = store
        self._block = block
        self._ids: range = range(0)
        self._lock = threading.Lock()

    def next(self) -> int:
        """The next id; reserves a new block when the current one is spent."""
        with self._lock:
            if not self._ids:
                self._ids = self._store.reserve_event_ids(self._block)
            value = self._ids[0]
            self._ids = self._ids[1:]
            return value
