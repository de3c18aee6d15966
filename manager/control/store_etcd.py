"""The store in etcd, shared by several managers; every write is fenced by the leader's epoch.

Keys, under a prefix (``/gpumgr/`` by default) so several clusters can share one etcd:

- ``nodes/<name>``: the agent's public key bound to that node name;
- ``join_secret``: the join secret (JSON ``{"secret"}``);
- ``queue/<id>``: one queued request (JSON); the queue's order is the keys' create revisions, which
  etcd hands out in the order the writes committed;
- ``intent/<grant>``: an intent not carried out yet (JSON, see :mod:`gpumgr.manager.model.intents`);
- ``event_ids``: the highest event id reserved (JSON ``{"ceiling"}``);
- ``generation`` and ``leader``: written by :mod:`gpumgr.manager.control.leadership`;
- ``asked/<manager>``: the nodes that asked that manager, a follower, to register, and when (JSON
  ``{node: unix time}``; a node its follower does not know yet is ``key:<its public key>``), read by
  the leader's :mod:`gpumgr.manager.headless` rule.

Every write runs as one transaction whose compares are the caller's *guard* (the leader key still
has the create revision of this manager's epoch, in this store's generation); when they fail the
write did nothing, :class:`~gpumgr.manager.control.store.Fenced` is raised and ``on_fenced`` is told, so a
leader that was deposed while paused or cut off changes nothing and steps down. The first creation
of the join secret is not guarded: it only ever creates the key (a compare on its absence),
so any manager can print a token before a leader exists, and racing creators end with one secret.
A follower's ``asked/<manager>`` is not guarded either: a plain put of its own note, not the cluster's state.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any, NoReturn

from gpumgr.manager.control import etcdv3
from gpumgr.manager.control.etcdv3 import EtcdClient
from gpumgr.manager.control.store import Fenced, Store
from gpumgr.manager.model.queue import QueueJournal
from gpumgr.wire import security

log = logging.getLogger(__name__)
DEFAULT_PREFIX = "/gpumgr/"
#: A guard: the compares every write must pass (raises Fenced when this manager holds no epoch).
Guard = Callable[[], list[dict[str, Any]]]


def _dump(data: dict[str, Any]) -> bytes:
    return json.dumps(data, separators=(",", ":"), sort_keys=True).encode()


def _load(raw: bytes, where: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"etcd key {where.decode(errors='replace')} does not hold JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"etcd key {where.decode(errors='replace')} does not hold a JSON object")
    return data


class EtcdStore(Store):
    """The store under ``prefix`` in the etcd that ``client`` reaches, written only while ``guard`` holds."""

    kind = "etcd"

    def __init__(self, client: EtcdClient, guard: Guard, *, prefix: str = DEFAULT_PREFIX,
                 on_fenced: Callable[[], None] | None = None) -> None:
        self.client = client
        self.prefix = prefix.encode() if prefix.endswith("/") else (prefix + "/").encode()
        self._guard = guard
        self._on_fenced = on_fenced

    def key(self, *parts: str) -> bytes:
        """The full etcd key of ``parts`` under this store's prefix."""
        return self.prefix + "/".join(parts).encode()

    # --- node bindings -------------------------------------------------------------------------
    def nodes(self) -> dict[str, str]:
        """Every ``nodes/<name>`` key."""
        start = len(self.key("nodes", ""))
        return {kv.key[start:].decode(errors="replace"): kv.value.decode(errors="replace")
                for kv in self.client.get_prefix(self.key("nodes", ""))}

    def bind(self, node: str, key: str) -> None:
        """Write ``nodes/<node>``, fenced."""
        self.write([etcdv3.put(self.key("nodes", node), key.encode())])

    def forget(self, node: str) -> bool:
        """Delete ``nodes/<node>``, fenced; False if it was absent."""
        path = self.key("nodes", node)
        if self.client.get(path) is None:
            return False
        self.write([etcdv3.delete(path)])
        return True

    # --- the join secret -----------------------------------------------------------------------
    def join_secret(self) -> str:
        """``join_secret``, created if absent (only ever created: racing managers end with one secret)."""
        path = self.key("join_secret")
        found = self.client.get(path)
        if found is None:
            fresh = _dump({"secret": security.new_join_secret()})
            self.client.txn([etcdv3.created_at(path, 0)], [etcdv3.put(path, fresh)])
            found = self.client.get(path)
            if found is None:
                raise etcdv3.EtcdError(f"etcd key {path.decode()} vanished right after it was created")
        return str(_load(found.value, path)["secret"])

    def rotate_secret(self) -> str:
        """Write a fresh ``join_secret``, fenced."""
        secret = security.new_join_secret()
        self.write([etcdv3.put(self.key("join_secret"), _dump({"secret": secret}))])
        return secret

    # --- the wait queue ------------------------------------------------------------------------
    def queued(self) -> list[dict[str, Any]]:
        """Every ``queue/<id>`` request, in the order their keys were created; an unreadable one is skipped."""
        queued = []
        for kv in sorted(self.client.get_prefix(self.key("queue", "")), key=lambda kv: kv.create_revision):
            try:
                queued.append(_load(kv.value, kv.key))
            except ValueError as exc:  # as the state directory's journal does with a torn line
                log.warning("%s; skipped", exc)
        return queued

    def enqueue(self, request: dict[str, Any]) -> None:
        """Write ``queue/<id>``, fenced."""
        self.write([etcdv3.put(self.key("queue", str(request["id"])), _dump(request))])

    def dequeue(self, cid: str) -> None:
        """Delete ``queue/<id>``, fenced."""
        self.write([etcdv3.delete(self.key("queue", cid))])

    def apply_queue(self, changes: list[tuple[str, dict[str, Any] | None]]) -> None:
        """Write queue changes in order (``(id, request)`` queues it, ``(id, None)`` takes it off), fenced.

        At most :data:`~gpumgr.manager.control.etcdv3.MAX_TXN_OPS` operations go in one transaction (etcd's
        default ``--max-txn-ops``), so a burst of a thousand queued requests costs eight writes, not a thousand.
        """
        self._write_batches([etcdv3.put(self.key("queue", cid), _dump(request)) if request is not None
                             else etcdv3.delete(self.key("queue", cid)) for cid, request in changes])

    # --- intents -------------------------------------------------------------------------------
    def intents(self) -> dict[str, dict[str, Any]]:
        """Every ``intent/<grant>`` key; an unreadable one is skipped."""
        start, found = len(self.key("intent", "")), {}
        for kv in self.client.get_prefix(self.key("intent", "")):
            try:
                found[kv.key[start:].decode(errors="replace")] = _load(kv.value, kv.key)
            except ValueError as exc:
                log.warning("%s; skipped", exc)
        return found

    def intend(self, intents: dict[str, dict[str, Any]]) -> None:
        """Write one ``intent/<grant>`` per intent, fenced, in as few transactions as they fit."""
        self._write_batches([etcdv3.put(self.key("intent", grant), _dump(body)) for grant, body in intents.items()])

    def drop_intents(self, grants: list[str]) -> None:
        """Delete ``intent/<grant>`` of each grant, fenced."""
        self._write_batches([etcdv3.delete(self.key("intent", grant)) for grant in dict.fromkeys(grants)])

    def _write_batches(self, operations: list[dict[str, Any]]) -> None:
        for start in range(0, len(operations), etcdv3.MAX_TXN_OPS):
            self.write(operations[start:start + etcdv3.MAX_TXN_OPS])

    # --- event ids -----------------------------------------------------------------------------
    def reserve_event_ids(self, count: int) -> range:
        """Raise ``event_ids`` by ``count`` in one fenced transaction that also checks no one moved it meanwhile."""
        if count < 1:
            raise ValueError("reserve at least one event id")
        path = self.key("event_ids")
        while True:
            found = self.client.get(path)
            start = int(_load(found.value, path)["ceiling"]) + 1 if found else 1
            seen = found.mod_revision if found else 0
            if self.write([etcdv3.put(path, _dump({"ceiling": start + count - 1}))], [etcdv3.modified_at(path, seen)],
                          check=False):
                return range(start, start + count)

    # --- who asked followers to register (gpumgr.manager.headless) ---------------------------------
    def publish_asks(self, manager: str, asks: dict[str, float]) -> None:
        """Write ``asked/<manager>`` unfenced (a follower's own note), or delete it when ``asks`` is empty."""
        path = self.key("asked", manager)
        self.client.txn([], [etcdv3.put(path, _dump(asks)) if asks else etcdv3.delete(path)])

    def asks(self) -> dict[str, dict[str, float]]:
        """Every manager's ``asked/<manager>``: ``{manager: {node: unix time}}``; an unreadable one is skipped."""
        start = len(self.key("asked", ""))
        found: dict[str, dict[str, float]] = {}
        for kv in self.client.get_prefix(self.key("asked", "")):
            try:
                found[kv.key[start:].decode(errors="replace")] = {
                    str(who): float(at) for who, at in _load(kv.value, kv.key).items()}
            except (ValueError, TypeError) as exc:
                log.warning("%s; skipped", exc)
        return found

    # --- writes --------------------------------------------------------------------------------
    def write(self, operations: list[dict[str, Any]], compares: list[dict[str, Any]] | None = None, *,
              check: bool = True) -> bool:
        """Run ``operations`` if the guard (and ``compares``) hold; raises Fenced when the guard failed.

        With ``check=False`` a failure of ``compares`` alone returns False (the caller retries).
        """
        try:
            guard = self._guard()
        except Fenced:
            self._fenced("this manager is not the leader")
        if self.client.txn([*guard, *(compares or [])], operations).succeeded:
            return True
        if compares and self.client.txn(guard, []).succeeded:
            if check:
                raise etcdv3.EtcdError("a guarded write found the store changed under it")
            return False
        self._fenced("a newer leader holds the store")

    def _fenced(self, why: str) -> NoReturn:
        log.warning("store write refused: %s", why)
        if self._on_fenced is not None:
            self._on_fenced()
        raise Fenced(f"store write refused: {why}; this manager steps down")


class EtcdQueueJournal(QueueJournal):
    """The queue's record in etcd, in the shape of :class:`~gpumgr.manager.model.queue.QueueJournal` the model calls.

    The model records queue changes under its lock, where a store round trip (a quorum's fsync, about
    5 ms, or seconds while etcd elects a leader) must not be paid: changes are kept in order here and
    written by :meth:`sync`, outside the lock, as few transactions as they fit in. A request and its
    removal that meet in one batch cancel out on the wire (etcd refuses two operations on one key in one
    transaction). A write that fails for want of quorum is kept and tried again at the next sync; one
    that is fenced is dropped (a newer leader owns the queue now, and this manager steps down).
    """

    def __init__(self, store: EtcdStore) -> None:
        super().__init__(None)
        self.store = store
        self._flush = threading.Lock()
        self._pending: dict[str, dict[str, Any] | None] = {}

    def load(self) -> list[dict[str, Any]]:
        """The requests etcd holds, in the order they were queued."""
        return self.store.queued()

    def open(self, queued: list[dict[str, Any]]) -> None:
        """Nothing to rewrite: etcd holds the restored queue already."""

    def rewrite(self, queued: list[dict[str, Any]]) -> None:
        """Nothing to compact: each request is one key, deleted when it leaves."""

    def needs_compaction(self, queued: int) -> bool:
        """Never (etcd's own compaction, ``--auto-compaction-retention``, reclaims old revisions)."""
        return False

    def add(self, request: dict[str, Any]) -> None:
        """Note a queued (or changed) request; written at the next :meth:`sync`."""
        cid = str(request["id"])
        with self._lock:
            if self._pending.get(cid, request) is None:  # taken off and queued again: its key goes last
                del self._pending[cid]
            self._pending[cid] = request

    def remove(self, cid: str) -> None:
        """Note that ``cid`` left the queue; written at the next :meth:`sync`."""
        with self._lock:
            self._pending[cid] = None

    def sync(self) -> None:
        """Write every change noted so far; raises StoreUnavailable (changes kept) or Fenced (dropped)."""
        with self._flush:
            with self._lock:
                changes, self._pending = list(self._pending.items()), {}
            if not changes:
                return
            try:
                self.store.apply_queue(changes)
            except Fenced:
                raise
            except Exception:
                with self._lock:  # kept, in front of what came meanwhile
                    self._pending = {**dict(changes), **self._pending}
                raise

    def discard(self) -> None:
        """Forget the changes not written yet (this manager no longer leads)."""
        with self._lock:
            self._pending = {}

    def close(self) -> None:
        """Nothing to close."""
