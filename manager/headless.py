"""A leader cut off from its agents but not from etcd steps down, so the cluster is not left headless.

Agents register and heartbeat with the leader only. A leader whose network to the agents is gone
while its etcd still renews its lease would lead forever with nobody to place on, and the agents,
refused ``not_leader`` by every follower, could register nowhere. So:

*Followers publish who asks them.* A manager that does not lead notes each Register or Heartbeat it
refuses: the node its admission binds the sender's proven key to, or ``key:<key>`` when it does not
know the key yet (never the node the message claims). It writes them to etcd as
``<prefix>asked/<manager>`` (JSON ``{node: unix time}``), only when they changed, at most every
:data:`~gpumgr.wire.defaults.ASKS_PUBLISH_INTERVAL` seconds, keeping the newest
:data:`~gpumgr.wire.defaults.ASKS_KEPT` asks of the last two ``headless_after``; none left deletes the key.

*The leader's rule* (:func:`judge`, :class:`Rule`), checked every sweep before the zone rule of
:mod:`gpumgr.manager.model.reconcile`. Its *bound* nodes are those on its map that were ready at some
point in the last two ``headless_after`` (heard from within that plus the down timeout), and, for
that long after its election, the nodes bound in the store, as if heard from at the election. It
*hears from* a node last heard from within the down timeout. When it hears from fewer than half of
its bound nodes for ``headless_after`` seconds in a row (:data:`~gpumgr.wire.defaults.HEADLESS_AFTER`,
10 s), and more than half of the silent ones asked another manager to register within the last
``headless_after``, it steps down, logs it and records a ``node_down`` event with ``"headless": true``
naming how many nodes it heard and how many asked followers; then it stays out of elections for
:data:`HOLD_OFF_LEASES` lease TTLs, so that a manager the agents reach is elected instead.
Silent nodes that ask nobody are a rack that went down, or a partition of theirs: the leader stays,
and the zone rule keeps their work. A single manager (no etcd) never steps down.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpumgr.manager.control.ha import Replicated
from gpumgr.manager.control.store_etcd import EtcdStore
from gpumgr.wire import defaults
from gpumgr.wire.epoch import Epoch
from gpumgr.wire.errors import GpumgrError
from gpumgr.wire.names import EventType

if TYPE_CHECKING:
    from gpumgr.manager.parts import ManagerParts

log = logging.getLogger(__name__)

#: A leader that stepped down for want of its agents stays out of elections this many lease TTLs.
HOLD_OFF_LEASES = 2
#: While it hears from too few of its nodes, the leader reads the followers' asks at most this often.
READ_EVERY = defaults.ASKS_PUBLISH_INTERVAL / 2
#: How a follower names a sender whose key it has not seen bound (the leader resolves it).
KEY_MARK = "key:"


@dataclass(frozen=True)
class Verdict:
    """What the leader knows of its nodes at one check."""

    bound: int
    heard: int
    #: silent bound nodes that asked another manager to register within the window
    asking: int

    @property
    def cut_off(self) -> bool:
        """Whether it hears from fewer than half of its bound nodes."""
        return self.heard * 2 < self.bound

    @property
    def headless(self) -> bool:
        """Whether it is cut off and more than half of the silent nodes ask other managers."""
        return self.cut_off and self.asking * 2 > self.bound - self.heard


def judge(silent_for: Mapping[str, float], asked_ago: Mapping[str, float], *, down_after: float,
          after: float) -> Verdict:
    """The verdict from each node's seconds since it was last heard and since it last asked a follower."""
    bound = {n for n, silent in silent_for.items() if silent <= down_after + 2 * after}
    heard = {n for n in bound if silent_for[n] <= down_after}
    asking = sum(1 for n in bound - heard if asked_ago.get(n, math.inf) <= after)
    return Verdict(len(bound), len(heard), asking)


class Rule:
    """Steps down once cut off for ``after`` seconds in a row and headless at that check."""

    def __init__(self, after: float) -> None:
        self.after = after
        #: since when (monotonic) it has heard from too few of its nodes, None while it hears enough
        self.since: float | None = None

    def due(self, verdict: Verdict, now: float) -> bool:
        """Whether to step down now."""
        if not verdict.cut_off:
            self.since = None
            return False
        if self.since is None:
            self.since = now
        return now - self.since >= self.after and verdict.headless


class Asks:
    """A follower's note of who asked it to register (thread-safe): ``{who: unix time}``, bounded."""

    def __init__(self, keep: float, most: int = defaults.ASKS_KEPT) -> None:
        self.keep = keep
        self.most = most
        self._lock = threading.Lock()
        self._at: dict[str, float] = {}
        self._sent: dict[str, float] = {}  # what etcd holds (nothing at first)

    def note(self, who: str, at: float) -> None:
        """``who`` asked at ``at``."""
        with self._lock:
            self._at[who] = at
            if len(self._at) > 2 * self.most:
                self._at = dict(sorted(self._at.items(), key=lambda item: item[1])[-self.most:])

    def changed(self, now: float) -> dict[str, float] | None:
        """What to publish now (the asks of the last ``keep`` seconds, newest ``most``), or None if unchanged."""
        with self._lock:
            fresh = sorted(((w, round(at, 1)) for w, at in self._at.items() if now - at <= self.keep),
                           key=lambda item: item[1])[-self.most:]
            self._at = dict(fresh)
            return None if self._at == self._sent else dict(self._at)

    def published(self, asks: dict[str, float]) -> None:
        """etcd holds ``asks`` now."""
        with self._lock:
            self._sent = asks


class Headless:
    """``manager``'s side of the rule: a follower publishes its asks, a leader checks the rule (each sweep)."""

    def __init__(self, manager: ManagerParts) -> None:
        assert isinstance(manager.plane, Replicated) and isinstance(manager.plane.store, EtcdStore)
        self.manager = manager
        self.plane: Replicated = manager.plane
        self.store: EtcdStore = manager.plane.store
        settings = manager.settings
        self.after = settings.headless_after
        self.down_after = settings.heartbeat_interval * settings.heartbeat_liveness
        self.rule = Rule(self.after)
        self.asks = Asks(keep=2 * self.after)
        self._term: Epoch | None = None
        self._term_start = 0.0
        self._known: set[str] = set()
        self._asked: dict[str, float] = {}
        self._read_at = -math.inf
        self._published_at = -math.inf

    @property
    def name(self) -> str:
        """This manager's name, as its ``asked/<name>`` key says it."""
        return self.plane.leadership.name

    def asked(self, key: str, node: str | None) -> None:
        """An agent whose proven key is ``key`` (bound to ``node``, if this manager knows) asked to register."""
        self.asks.note(node or KEY_MARK + key, self.manager.cluster.clock.time())

    def tick(self) -> None:
        """Publish this manager's asks when due; while leading, step down if the rule says so."""
        now = self.manager.cluster.clock.monotonic()
        self._publish(now)
        epoch = self.plane.epoch
        if epoch is None:
            self._term = None
            return
        if epoch != self._term:
            self._new_term(epoch, now)
        verdict = self.verdict(now)
        if self.rule.due(verdict, now):
            self._step_down(verdict)

    def verdict(self, now: float) -> Verdict:
        """The rule's verdict now; the followers' asks are read only while too few nodes are heard."""
        cluster = self.manager.cluster
        last = dict.fromkeys(self._known, self._term_start)
        with cluster.lock:
            for node in cluster.ledger.nodes.values():
                last[node.name] = max(node.last_seen_mono, last.get(node.name, -math.inf))
        silent_for = {name: now - at for name, at in last.items()}
        verdict = judge(silent_for, {}, down_after=self.down_after, after=self.after)
        if not verdict.cut_off:
            return verdict
        wall = cluster.clock.time()
        return judge(silent_for, {n: wall - at for n, at in self._read_asks(now).items()},
                     down_after=self.down_after, after=self.after)

    def _new_term(self, epoch: Epoch, now: float) -> None:
        self._term, self._term_start = epoch, now
        self._known = set(self.manager.admission.nodes())
        self.rule.since, self._asked, self._read_at = None, {}, -math.inf

    def _read_asks(self, now: float) -> dict[str, float]:
        """The other managers' asks by node (newest time of each), read from etcd at most every READ_EVERY."""
        if now - self._read_at < READ_EVERY:
            return self._asked
        self._read_at = now
        try:
            published = self.store.asks()
        except GpumgrError as exc:  # no asks known is no reason to step down
            log.info("could not read the followers' asks: %s", exc.message)
            return self._asked
        merged: dict[str, float] = {}
        for manager, asks in published.items():
            if manager == self.name:
                continue  # what it was asked while it followed: those nodes reach it now
            for who, at in asks.items():
                node = self.manager.admission.node_of(who[len(KEY_MARK):]) if who.startswith(KEY_MARK) else who
                if node is not None:
                    merged[node] = max(at, merged.get(node, -math.inf))
        self._asked = merged
        return merged

    def _publish(self, now: float) -> None:
        if now - self._published_at < defaults.ASKS_PUBLISH_INTERVAL:
            return
        asks = self.asks.changed(self.manager.cluster.clock.time())
        if asks is None:
            return
        self._published_at = now
        try:
            self.store.publish_asks(self.name, asks)
        except GpumgrError as exc:  # tried again at the next interval
            log.info("could not publish which nodes asked this manager to register: %s", exc.message)
            return
        self.asks.published(asks)

    def _step_down(self, verdict: Verdict) -> None:
        hold_off = HOLD_OFF_LEASES * self.plane.leadership.ttl
        text = (f"heard from {verdict.heard} of its {verdict.bound} node(s) for {self.after:g}s while "
                f"{verdict.asking} of the silent ones asked other managers to register: cut off from its "
                f"agents, it steps down and stays out of elections for {hold_off:g}s")
        log.warning("headless: %s", text)
        self.manager.events.record(EventType.NODE_DOWN, text, headless=True, heard=verdict.heard,
                                   bound=verdict.bound, asking=verdict.asking)
        self.rule.since = None
        self.plane.step_down(f"cut off from its agents ({verdict.heard} of {verdict.bound} heard, "
                             f"{verdict.asking} asking other managers)", hold_off=hold_off)
