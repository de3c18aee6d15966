"""``Idempotency-Key`` on ``POST /v1/containers``: a create sent twice runs at most once.

A client that does not know whether its create ran (the connection broke, or the answer was 502
``outcome_unknown``) sends it again with the same key, and gets what the first one got:

- The key is claimed before anything is sent: an ``in_progress`` entry (see
  :mod:`gpumgr.manager.control.idempotency`) naming the record id the request will be given, written to the
  state directory or etcd before the create goes out. The id is reserved here and handed to the
  model when it draws the record's id (:class:`ReservedIds`), so after a restart or a failover the
  next manager finds the container under that id once its node reports it.
- A repeat of a request that has its answer gets that answer again (status and body, with
  ``Idempotent-Replayed: true``); a repeat while it runs here gets 409 ``in_progress``; the same key
  with another body (or route) gets 422 ``idempotency_mismatch``. Keys are per principal: a tenant's
  key never meets another tenant's, nor the operator's.
- Which answers are kept: 201 and 202, and every 4xx the manager gave once the key was claimed
  (``no_fit``, ``quota_exceeded``, ...): the request was carried out or refused, and a repeat is told
  so. A 4xx from reading the request (a bad body, a bad key, a refused policy) comes before the claim
  and is not kept: the request is checked again. A 5xx that says nothing ran (``no_agents``,
  ``agent_failed``, ``not_leader``, ``store_unavailable``) releases the key, so a repeat runs the
  request. ``outcome_unknown`` (and ``agent_timeout``, and any unexpected failure) keeps the key in
  progress: nobody knows yet.
- A key left in progress by a request that is no longer running here (its manager died, lost its
  leadership, or the outcome was unknown) is settled from the map: if the record it names is there,
  its answer is the record (202 if it never reached a node, 201 otherwise) and is kept; while it is
  being created, or while the map may still be missing it (less than :data:`SETTLE` seconds of this
  term, or less than a create's whole timeout since the claim), the repeat gets 409 ``in_progress``
  with ``Retry-After``; after that, a record that is absent or ``failed`` never ran, and the repeat
  takes the key over and runs the request.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from flask import Response, jsonify

from gpumgr.manager.clock import SYSTEM, Clock
from gpumgr.manager.control.idempotency import (
    DONE,
    IN_PROGRESS,
    REPLAYED,
    TTL,
    Entry,
    KeyBook,
    book_for,
    digest,
    fingerprint,
)
from gpumgr.manager.leading import GRACE
from gpumgr.manager.tenancy.tenants import Principal
from gpumgr.wire import defaults
from gpumgr.wire.errors import GpumgrError, IdempotencyMismatch, InProgress, NotFound
from gpumgr.wire.names import State

if TYPE_CHECKING:
    from gpumgr.manager.service import Manager

log = logging.getLogger(__name__)

#: How long a term (or a process) must have run before a record missing from its map is taken as never
#: created: the nodes known when it began have registered again by then, or are taken as gone.
SETTLE = GRACE
#: Expired entries are purged at most this often (by the request that finds the hour over).
PURGE_EVERY = 3600.0
#: Error codes of a 5xx that do not say whether the request ran: its key stays in progress.
UNKNOWN = frozenset({"outcome_unknown", "agent_timeout"})
#: Tries to claim a key that other requests keep changing before answering 409 ``in_progress``.
CLAIM_TRIES = 3

#: A create's outcome as the view builds it: the record and its status.
Outcome = tuple[dict[str, Any], int]


class ReservedIds:
    """A cluster's record-id source, wrapped: a thread that reserved an id gets it at its next draw."""

    def __init__(self, draw: Callable[[], str]) -> None:
        self.draw = draw
        self._local = threading.local()

    def __call__(self) -> str:
        """The id reserved by this thread (once), else a fresh one."""
        cid: str | None = getattr(self._local, "cid", None)
        if cid is None:
            return self.draw()
        self._local.cid = None
        return cid

    @contextmanager
    def reserved(self, cid: str) -> Iterator[None]:
        """Within the block, this thread's next record gets ``cid``."""
        self._local.cid = cid
        try:
            yield
        finally:
            self._local.cid = None

    @classmethod
    def install(cls, cluster: Any) -> ReservedIds:
        """Wrap ``cluster.new_id`` (once)."""
        if not isinstance(cluster.new_id, ReservedIds):
            cluster.new_id = cls(cluster.new_id)
        ids: ReservedIds = cluster.new_id
        return ids


def scope_of(principal: Principal) -> str:
    """The principal a key belongs to: ``operator`` or ``tenant:<name>``."""
    return "operator" if principal.tenant is None else f"tenant:{principal.tenant}"


class Idempotency:
    """The keys of one manager, and what a keyed create does with them; see the module docstring."""

    def __init__(self, manager: Manager, book: KeyBook | None = None, clock: Clock = SYSTEM) -> None:
        self.manager = manager
        self.book = book if book is not None else book_for(manager.plane.store)
        self.clock = clock
        self.ids = ReservedIds.install(manager.cluster)
        #: names this process's claims, so a key it left behind is told from one it is running
        self.owner = os.urandom(8).hex()
        self._flying: set[str] = set()
        self._lock = threading.Lock()
        self._term: tuple[str, float] = (self._epoch(), clock.monotonic())
        self._purged_at = -math.inf
        self._purging = threading.Lock()

    def respond(self, key: str, principal: Principal, route: str, body: Any,
                create: Callable[[], Outcome]) -> tuple[Response, int]:
        """The answer to a keyed create: the first answer again, 409, 422, or ``create`` run once."""
        self._maybe_purge()
        name, wanted = digest(scope_of(principal), key), fingerprint(route, body)
        for _ in range(CLAIM_TRIES):
            entry = self.book.read(name)
            if entry is None or entry.expired(self.clock.time()):
                claimed = self._claim(name, wanted, entry)
            elif entry.data.get("fingerprint") != wanted:
                raise IdempotencyMismatch(f"this Idempotency-Key was used with another request to {route} "
                                          "(another body): use a new key for a new request")
            elif entry.state == DONE:
                return _replay(entry)
            else:
                found = self._repeat(entry)
                if isinstance(found, tuple):
                    return _answer(*found, replayed=True)
                claimed = found
            if claimed is not None:
                return self._execute(claimed, create)
        raise InProgress("the request with this Idempotency-Key is being changed by another request; ask again")

    # --- claiming --------------------------------------------------------------------------------
    def _claim(self, name: str, wanted: str, old: Entry | None) -> Entry | None:
        """Write this request's in-progress entry (replacing ``old``, expired or taken over); None if it lost."""
        with self._lock:
            if name in self._flying:
                raise InProgress("a request with this Idempotency-Key is being carried out; ask again for its answer")
            self._flying.add(name)
        now = self.clock.time()
        keep = old is not None and not old.expired(now)
        data = {"state": IN_PROGRESS, "fingerprint": wanted, "record": self.ids.draw(), "owner": self.owner,
                "epoch": self._epoch(), "started": now,
                "expires": float(old.data["expires"]) if keep and old is not None else now + TTL}
        try:
            entry = self.book.create(name, data) if old is None else self.book.replace(old, data)
        except BaseException:
            self._land(name)
            raise
        if entry is None:
            self._land(name)
        return entry

    def _repeat(self, entry: Entry) -> Entry | tuple[dict[str, Any], int] | None:
        """A repeat of a request whose key is in progress: its claim to run it, the answer the map gives
        (kept as the key's), None to read again; raises InProgress while it may still be running."""
        with self._lock:
            if entry.name in self._flying:
                raise InProgress("a request with this Idempotency-Key is being carried out; ask again for its answer")
        cid = str(entry.data.get("record") or "")
        try:
            record = self.manager.cluster.get(cid) if cid else None
        except NotFound:
            record = None
        if record is not None and record.state is State.CREATING:
            raise InProgress(f"container {cid} of this Idempotency-Key is being created; ask again for its answer")
        if record is not None and record.state is not State.FAILED:
            view = self.manager.cluster.view(record)
            status = 201 if view.get("node") else 202
            self._finish(entry, status, view)
            return view, status
        if not self._settled(entry):
            raise InProgress(f"the request of this Idempotency-Key may still be running (container {cid or '?'} "
                             "is not on the map yet); ask again in a moment")
        return self._claim(entry.name, str(entry.data.get("fingerprint")), entry)

    def _settled(self, entry: Entry) -> bool:
        """Whether a record missing from the map now means its create never ran."""
        epoch, now = self._epoch(), self.clock.monotonic()
        if epoch != self._term[0]:
            self._term = (epoch, now)
        create = self.manager.settings.create_timeout + defaults.CREATE_MARGIN
        age = self.clock.time() - float(entry.data.get("started", 0))
        return now - self._term[1] >= SETTLE and age >= create + SETTLE

    # --- running and answering -------------------------------------------------------------------
    def _execute(self, claimed: Entry, create: Callable[[], Outcome]) -> tuple[Response, int]:
        """Run ``create`` under the claim and keep what it answered, as the module docstring says."""
        try:
            with self.ids.reserved(str(claimed.data["record"])):
                record, status = create()
        except GpumgrError as exc:
            if exc.status < 500:
                self._finish(claimed, exc.status, {"error": exc.to_dict()})
            elif exc.code not in UNKNOWN and exc.status != 500:
                self._release(claimed)
            raise
        finally:
            self._land(claimed.name)
        self._finish(claimed, status, record)
        return _answer(record, status, replayed=False)

    def _finish(self, entry: Entry, status: int, body: dict[str, Any]) -> Entry | None:
        """Keep the answer; a failed write leaves the key in progress, and the map answers a repeat."""
        try:
            return self.book.replace(entry, {**entry.data, "state": DONE, "status": status, "body": body})
        except GpumgrError as exc:
            log.warning("the answer of an idempotency key could not be kept (%s); a repeat is answered from the map",
                        exc)
            return None

    def _release(self, entry: Entry) -> None:
        try:
            self.book.delete(entry)
        except GpumgrError as exc:
            log.warning("an idempotency key whose request did not run could not be released (%s)", exc)

    def _land(self, name: str) -> None:
        with self._lock:
            self._flying.discard(name)

    def _maybe_purge(self) -> None:
        now = self.clock.monotonic()
        if now - self._purged_at < PURGE_EVERY or not self._purging.acquire(blocking=False):
            return
        try:
            self._purged_at = now
            gone = self.book.purge(self.clock.time())
            if gone:
                log.info("purged %d idempotency keys older than %g h", gone, TTL / 3600)
        except GpumgrError as exc:
            log.warning("purging expired idempotency keys failed (%s); trying again in an hour", exc)
        finally:
            self._purging.release()

    def _epoch(self) -> str:
        return str(getattr(self.manager.plane, "epoch", None))


def _replay(entry: Entry) -> tuple[Response, int]:
    return _answer(entry.data.get("body") or {}, int(entry.data.get("status") or 200), replayed=True)


def _answer(body: dict[str, Any], status: int, *, replayed: bool) -> tuple[Response, int]:
    response = jsonify(body)
    if replayed:
        response.headers[REPLAYED] = "true"
    return response, status
