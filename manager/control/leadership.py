"""Leader election on etcd: one manager leads, the others stand by, and a deposed leader is fenced out.

Design
------
*The leader key.* ``<prefix>leader`` is created only if absent (a transaction comparing its create
revision with 0), bound to a lease of :data:`LEASE_TTL` seconds, and holds the leader's name and API
URL so followers and clients can find it. The lease ends when the leader stops renewing it (it
died, was paused or was cut off from etcd's quorum), etcd deletes the key, and a standby that polls
the key every :data:`CAMPAIGN_POLL` seconds creates it next.

*The epoch.* The leader key's create revision, paired with the store's generation
(:class:`gpumgr.wire.epoch.Epoch`): etcd hands out revisions in commit order, so a later leader always
has a larger one. The generation is a counter in ``<prefix>generation`` (1 in a new store), never a
clock. An etcd restored from a snapshot hands out revisions again under the same generation, and one
rebuilt from scratch starts both again, so agents that followed a later leader refuse the new one.
They say so (their fence comes in every registration and ``stale_epoch`` answer), and a leader told
of an epoch above its own raises the generation above it in one transaction, guarded by its own
epoch, steps down and stands again (:meth:`Leadership.rise_above`): epochs only rise, and no agent
has to forget its fence.

*Fencing.* Every store write is a transaction whose compares are :meth:`Leadership.guard`: the leader
key still has this epoch's create revision and the generation key still holds this generation. A
manager that lost the key (or a store rebuilt under it) writes nothing. Every command to an agent
carries the epoch and agents refuse lower ones, so a leader that was paused past its lease and comes
back changes nothing anywhere, hears ``stale_epoch`` or ``fenced``, and steps down.

*Stepping aside.* A leader cut off from its agents but not from etcd (:mod:`gpumgr.manager.headless`)
steps down with a hold-off: it revokes its lease and does not campaign again for that long, so a
manager the agents can reach is elected instead of the same one at once.

*Time.* The TTL is 3 s: etcd 3.4's floor is 2 s, and a 3 s lease renewed every second
(:data:`RENEW_EVERY`) survives two lost renewals or an etcd leader election (about one second with
etcd's default 1 s election timeout; etcd also extends leases when its own leader changes) without
a needless failover, while a dead leader is replaced in about 3 s, under Swarm's own 10–20 s. The
leader counts its lease from just *before* each renewal was sent (the server counts from after it
received it), less :data:`SAFETY_MARGIN`, and :attr:`Leadership.is_leader` turns False on its own when
that deadline passes, even while a renewal is still hanging on a slow endpoint: it stops placing
before etcd could have let anyone else lead.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from gpumgr.manager.control import etcdv3
from gpumgr.manager.control.etcdv3 import EtcdClient, EtcdError, KeyValue
from gpumgr.manager.control.store import Fenced
from gpumgr.manager.control.store_etcd import DEFAULT_PREFIX
from gpumgr.wire.epoch import Epoch

log = logging.getLogger(__name__)

LEASE_TTL = 3
RENEW_EVERY = LEASE_TTL / 3
CAMPAIGN_POLL = 0.2
SAFETY_MARGIN = LEASE_TTL / 6

ElectedCallback = Callable[[Epoch], None]
LostCallback = Callable[[Epoch, str], None]


class Leadership:
    """Campaigns for ``<prefix>leader`` as ``name`` (reachable at ``api``) and keeps it while it can."""

    def __init__(self, client: EtcdClient, name: str, *, api: str = "", prefix: str = DEFAULT_PREFIX,
                 ttl: int = LEASE_TTL, on_elected: ElectedCallback | None = None,
                 on_lost: LostCallback | None = None) -> None:
        self.client = client
        self.name = name
        self.api = api
        self.prefix = prefix.encode() if prefix.endswith("/") else (prefix + "/").encode()
        self.ttl = ttl
        self.on_elected = on_elected
        self.on_lost = on_lost
        self._lock = threading.Lock()
        self._epoch: Epoch | None = None
        self._generation_raw = b""
        self._lease = 0
        self._deadline = 0.0
        self._leader: dict[str, Any] | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        #: no campaign before this (monotonic): it stepped down so that a manager its agents can reach leads
        self._hold_until = 0.0
        #: when etcd last stopped answering (no endpoint, or no quorum), until a call gets through again
        self.unreachable_since: float | None = None
        #: the highest epoch an agent said it accepted: a leader at or below it raises the generation above it
        self._above: Epoch | None = None
        #: set to end the loop's wait early (stopping, or told of a higher epoch)
        self._wake = threading.Event()

    @property
    def leader_key(self) -> bytes:
        """The etcd key the leader holds."""
        return self.prefix + b"leader"

    @property
    def generation_key(self) -> bytes:
        """The etcd key naming this store's generation."""
        return self.prefix + b"generation"

    # --- what the manager asks ---------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        """True while this manager holds the key and its lease cannot yet have run out."""
        with self._lock:
            return self._epoch is not None and time.monotonic() < self._deadline

    @property
    def epoch(self) -> Epoch | None:
        """This manager's epoch while it leads, else None."""
        with self._lock:
            return self._epoch if self._epoch is not None and time.monotonic() < self._deadline else None

    def leader(self) -> dict[str, Any] | None:
        """The leader as last seen: ``{name, api}``, or None while there is none."""
        with self._lock:
            return dict(self._leader) if self._leader else None

    def guard(self) -> list[dict[str, Any]]:
        """The compares that fence a store write to this epoch; raises Fenced while this manager does not lead."""
        with self._lock:
            if self._epoch is None or time.monotonic() >= self._deadline:
                raise Fenced("this manager is not the leader")
            return self.guard_for(self._epoch, self._generation_raw)

    def guard_for(self, epoch: Epoch, generation_raw: bytes) -> list[dict[str, Any]]:
        """The compares that hold only while ``epoch`` leads the store whose generation key holds ``generation_raw``."""
        return [etcdv3.created_at(self.leader_key, epoch.revision), etcdv3.holds(self.generation_key, generation_raw)]

    # --- the loop ------------------------------------------------------------------------------
    def start(self) -> None:
        """Campaign and renew on a background thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self.run, name=f"leadership-{self.name}", daemon=True)
        self._thread.start()

    def rise_above(self, seen: Epoch) -> None:
        """An agent accepted ``seen``: while this manager leads at or below it, raise the store's generation above
        it, step down and stand again. Returns at once; the leadership's thread makes the store call."""
        with self._lock:
            if self._above is None or seen > self._above:
                self._above = seen
        self._wake.set()

    def stop(self, resign: bool = True) -> None:
        """Stop the loop; with ``resign``, give the key up at once (revoke the lease) so another leads now."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.client.retry_for + self.client.timeout * len(self.client.endpoints) + 1)
        if resign:
            self.step_down("stopped")

    def run(self) -> None:
        """Campaign while no one leads; renew while this manager leads; step down when the lease is lost."""
        while not self._stopping.is_set():
            try:
                if self._outranked():
                    wait = self._rise()
                else:
                    wait = self._renew() if self._epoch is not None else self._campaign()
                self.unreachable_since = None
            except EtcdError as exc:  # unavailable or refused: the deadline still decides
                log.warning("leadership: %s", exc.message)
                if isinstance(exc, etcdv3.StoreUnavailable):
                    self._unreachable()
                wait = CAMPAIGN_POLL if self._epoch is None else RENEW_EVERY / 4
            if self._epoch is not None and time.monotonic() >= self._deadline:
                self.step_down("the lease ran out before it could be renewed")
            self._wake.wait(max(wait, 0.0))
            self._wake.clear()

    def _unreachable(self) -> None:
        """etcd does not answer: note since when, and forget who led (it cannot be known now)."""
        if self.unreachable_since is None:
            self.unreachable_since = time.monotonic()
        with self._lock:
            if self._epoch is None:
                self._leader = None

    def step_down(self, why: str, hold_off: float = 0.0) -> None:
        """Stop leading now (a fenced write, a ``stale_epoch`` from an agent, a lost lease, shutdown).

        With ``hold_off`` this manager does not campaign again for that many seconds, so another leads first.
        """
        with self._lock:
            self._hold_until = max(self._hold_until, time.monotonic() + hold_off)
            epoch, lease, self._epoch, self._lease, self._deadline = self._epoch, self._lease, None, 0, 0.0
            if epoch is not None:
                self._leader = None
        if epoch is None:
            return
        log.warning("%s steps down as leader (epoch %s): %s", self.name, epoch, why)
        if lease:
            try:  # let a standby lead at once rather than when the lease runs out
                self.client.lease_revoke(lease)
            except EtcdError as exc:
                log.info("could not revoke the lease (%s); it runs out by itself", exc.message)
        if self.on_lost is not None:
            try:
                self.on_lost(epoch, why)
            except Exception:  # a failing callback must not keep a deposed leader's loop from going on
                log.exception("on_lost callback failed")

    # --- one turn ------------------------------------------------------------------------------
    def _outranked(self) -> bool:
        with self._lock:
            return self._epoch is not None and self._above is not None and self._above >= self._epoch

    def _rise(self) -> float:
        """Raise the store's generation above the epoch an agent accepted, then step down to stand again."""
        with self._lock:
            epoch, raw, above = self._epoch, self._generation_raw, self._above
        if epoch is None or above is None:
            return 0.0
        generation = max(epoch.generation, above.generation) + 1
        raised = self._raise_generation(epoch, raw, generation)
        self.step_down(f"a node accepted epoch {above}, above its own: the store's generation is now {generation}, "
                       "and it stands again" if raised else "it no longer led when it raised the store's generation")
        return 0.0

    def _raise_generation(self, epoch: Epoch, raw: bytes, generation: int) -> bool:
        """Write ``generation`` and give up the leader key in one transaction, only while ``epoch`` leads."""
        result = self.client.txn(self.guard_for(epoch, raw),
                                 [etcdv3.put(self.generation_key, _generation_value(generation)),
                                  etcdv3.delete(self.leader_key)])
        if result.succeeded:
            log.warning("%s raised the store's generation to %d", self.name, generation)
        return result.succeeded

    def _campaign(self) -> float:
        current = self.client.get(self.leader_key)
        if current is not None:
            self._seen(current)
            return CAMPAIGN_POLL
        with self._lock:
            self._leader = None
            if time.monotonic() < self._hold_until:  # it stepped down for its agents' sake: another goes first
                return CAMPAIGN_POLL
        generation, raw = self._generation()
        sent = time.monotonic()
        lease, granted = self.client.lease_grant(self.ttl)
        value = json.dumps({"name": self.name, "api": self.api, "pid": os.getpid()}).encode()
        result = self.client.txn([etcdv3.created_at(self.leader_key, 0), etcdv3.holds(self.generation_key, raw)],
                                 [etcdv3.put(self.leader_key, value, lease)])
        if not result.succeeded:
            self.client.lease_revoke(lease)
            return 0.0  # someone else was first: read who
        epoch = Epoch(generation, result.revision)
        with self._lock:
            above = self._above
        if above is not None and above >= epoch:  # won below an epoch an agent accepted: raise it before leading
            self._raise_generation(epoch, raw, max(generation, above.generation) + 1)
            self.client.lease_revoke(lease)
            return 0.0
        with self._lock:
            self._epoch, self._lease, self._generation_raw = epoch, lease, raw
            self._deadline = sent + granted - SAFETY_MARGIN
            self._leader = {"name": self.name, "api": self.api}
        log.warning("%s leads (epoch %s)", self.name, epoch)
        if self.on_elected is not None:
            try:
                self.on_elected(epoch)
            except Exception:
                log.exception("on_elected callback failed")
        return RENEW_EVERY

    def _renew(self) -> float:
        with self._lock:
            lease, epoch = self._lease, self._epoch
        sent = time.monotonic()
        granted = self.client.lease_keepalive(lease)
        if granted <= 0:
            self.step_down("its lease expired")
            return 0.0
        current = self.client.get(self.leader_key)
        if current is None or epoch is None or current.create_revision != epoch.revision:
            self.step_down("the leader key is no longer its own")
            return 0.0
        with self._lock:
            if self._epoch == epoch:
                self._deadline = sent + granted - SAFETY_MARGIN
            left = self._deadline - time.monotonic()
        # a renewal that took long (etcd electing a leader of its own) leaves little lease: renew again soon
        return min(RENEW_EVERY, max(0.0, left / 2))

    def _generation(self) -> tuple[int, bytes]:
        """This store's generation (1 in a new store, written by whichever manager comes first) and its raw value."""
        self.client.txn([etcdv3.created_at(self.generation_key, 0)],
                        [etcdv3.put(self.generation_key, _generation_value(1))])
        found = self.client.get(self.generation_key)
        if found is None:
            raise EtcdError("the store's generation key vanished right after it was written")
        return generation_of(found.value), found.value

    def _seen(self, current: KeyValue) -> None:
        try:
            info = json.loads(current.value)
            leader = {"name": str(info.get("name", "")), "api": str(info.get("api", ""))}
        except (ValueError, AttributeError):
            leader = {"name": "", "api": ""}
        with self._lock:
            self._leader = leader


def _generation_value(generation: int) -> bytes:
    """What ``<prefix>generation`` holds: the counter, and a random id so that no two writes hold the same bytes."""
    return json.dumps({"generation": generation, "id": secrets.token_hex(8)}).encode()


def generation_of(raw: bytes) -> int:
    """The generation ``<prefix>generation`` holds (``ms``: the clock time written before it was a counter)."""
    try:
        data = json.loads(raw)
        return int(data["generation"] if "generation" in data else data["ms"])
    except (ValueError, KeyError, TypeError) as exc:
        raise EtcdError(f"the store's generation key holds {raw[:80]!r}, not a generation") from exc
