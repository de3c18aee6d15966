"""What a manager of several does as leadership comes and goes (the control plane's callbacks, wired).

*Elected.* The new leader reads what its predecessor left in the store: node bindings, the queue
(in its order, with its waits), the intents (DELETEs answered 202 and preemptions not carried out
yet, :mod:`~gpumgr.manager.model.intents`) and a fresh block of event ids. The grant map is not there: it is
rebuilt from the agents' registrations, as after a restart. So the leader waits a bounded grace
(:data:`GRACE`) for the nodes it knows (those bound in the store) to register before it runs the queue
or places a REST request: placing before then could put a request on the one node back first while
the queue's head waits for another, or answer "no room" while the room is on a node still moving over.
The grace ends early once every known node is back.

*Lost.* Leadership ends the moment the lease cannot have been renewed (:mod:`~gpumgr.manager.control.leadership`):
from then on :meth:`~gpumgr.manager.service.Manager.send` sends nothing, the REST API forwards or holds,
and here the whole map is dropped (:meth:`~gpumgr.manager.model.cluster.Cluster.reset`): records, desired
states, operations, grants, nodes (their agents must register again, with whichever manager leads) and
queue changes not yet written (the new leader owns the queue). Every REST call waiting on an agent's
reply is answered ``502 outcome_unknown`` and every runtime hook waiting in the queue is refused. A
manager that leads again later (M1 → M2 → M1 is ordinary) starts from the store and the nodes, never
from what it held before. Containers are untouched: agents enforce on their own.

A single manager (:class:`~gpumgr.manager.control.ha.Solo`) leads from the start with no grace.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from gpumgr.manager.control.ha import Replicated
from gpumgr.manager.control.store_etcd import EtcdQueueJournal
from gpumgr.wire import defaults
from gpumgr.wire.epoch import Epoch
from gpumgr.wire.errors import GpumgrError

if TYPE_CHECKING:
    from gpumgr.manager.parts import ManagerParts

log = logging.getLogger(__name__)

#: How long a new leader waits for the nodes it knows to register before it places anyway. An agent
#: finds its manager gone after ``NODE_DOWN_AFTER`` without a frame leaving, then walks its list of
#: managers; twice that covers a walk past a follower or two.
GRACE = 2 * defaults.NODE_DOWN_AFTER


class NotLeader(GpumgrError):
    """This manager does not lead (any more): the request goes to the leader (the REST API forwards it)."""

    code = "not_leader"
    status = 503
    retry_after = 1


class NoLeader(GpumgrError):
    """No manager leads right now (one is being elected); retry in a moment."""

    code = "no_leader"
    status = 503
    retry_after = 1


class NoQuorum(GpumgrError):
    """etcd has lost its quorum: nothing can be placed until enough members are back (containers run on)."""

    code = "no_quorum"
    status = 503
    retry_after = 5


class NotKnownYet(GpumgrError):
    """Not on the map yet: this manager began leading (or started) a moment ago, and a node that may hold it has
    not registered again; a 404 now could deny a container that runs. Retry in a moment."""

    code = "not_known_yet"
    status = 503
    retry_after = 2


#: How long after a term begins a miss is answered 503 ``not_known_yet`` while known nodes have not registered:
#: an agent finds a new leader within a few heartbeats; a node still silent past this is taken as gone.
UNHEARD_FOR = 60.0


class Leading:
    """Runs ``manager``'s side of its control plane's elections and losses; see the module docstring."""

    def __init__(self, manager: ManagerParts, grace: float = GRACE) -> None:
        self.manager = manager
        self.plane = manager.plane
        self.grace = grace
        self._expected: set[str] = set()
        self._grace_until = 0.0
        self._settled = threading.Event()
        self._settled.set()  # a single manager, or one that never led: nothing to wait for
        #: the epoch whose election has been handled (store loaded): leading starts there, not at the lease
        self._loaded: Epoch | None = None
        self._alone = not isinstance(self.plane, Replicated)
        #: when this term began (a single manager: its start), for :meth:`unheard`
        self._term_began = time.monotonic()
        if self._alone:  # its term is its process: the nodes it knows are those bound in its state directory
            self._expected = set(manager.admission.nodes())
        self.plane.on_elected(self.elected)
        self.plane.on_lost(self.lost)

    @property
    def loaded(self) -> bool:
        """Whether this manager leads and has loaded what its predecessor left (a single manager: always)."""
        if self._alone:
            return True
        epoch = self.plane.epoch
        return epoch is not None and epoch == self._loaded

    @property
    def placing(self) -> bool:
        """Whether this manager may place and run the queue now: it leads, has loaded the store, its grace is over."""
        return self.loaded and self.grace_over()

    def grace_over(self) -> bool:
        """Whether the nodes known at election have registered again, or the grace ran out."""
        if self._settled.is_set():
            return True
        cluster = self.manager.cluster
        missing = [n for n in self._expected if not cluster.node_ready(n)]
        if missing and time.monotonic() < self._grace_until:
            return False
        if missing:
            log.warning("placing again without node(s) %s: they did not register within %gs of the election",
                        ", ".join(sorted(missing)[:10]), self.grace)
        else:
            log.info("every known node registered again: placing")
        self._settled.set()
        cluster.wake.set()
        return True

    def unheard(self) -> list[str]:
        """The nodes known when this term began that have not registered since, while the term is young
        (:data:`UNHEARD_FOR`): a record missing from the map may be on one of them."""
        if time.monotonic() - self._term_began > UNHEARD_FOR:
            return []
        known = self.manager.cluster.ledger.nodes  # the map starts empty each term: a node in it has registered
        return sorted(n for n in self._expected if n not in known)

    def wait(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) for the store to be loaded and the grace after an election to end."""
        deadline = time.monotonic() + timeout
        while not self.placing and self.plane.is_leader and time.monotonic() < deadline:
            time.sleep(min(0.02, max(0.0, deadline - time.monotonic())))

    def check(self) -> None:
        """Raise NotLeader unless this manager leads; wait out the grace after an election first."""
        if not self.plane.is_leader:
            raise NotLeader("this manager does not lead the control plane now")
        self.wait(self.grace)
        if not self.loaded:
            raise NotLeader("this manager stopped leading while it waited for the nodes to register")

    # --- the control plane's callbacks ---------------------------------------------------------
    def elected(self, epoch: Epoch) -> None:
        """Start from nothing: load bindings, queue, intents and event ids from the store; wait for the known nodes.

        Whatever this process held in an earlier term is gone (:meth:`lost` dropped it, and it is dropped again
        here in case anything of that term arrived since): the map is the store's and the nodes' reports.
        """
        manager = self.manager
        self._loaded = None
        manager.cluster.reset(f"this manager began a new term of leadership (epoch {epoch})")
        manager.admission.reload()
        manager.events.renew_ids()
        manager.cluster.load_intents(self.plane.store.intents())
        self._expected = set(manager.admission.nodes())
        self._term_began = time.monotonic()
        self._grace_until = time.monotonic() + self.grace
        if self._expected:
            self._settled.clear()
        restored = self._reload_queue()
        self._loaded = epoch
        log.warning("leading (epoch %s): %d queued request(s) loaded; waiting up to %gs for %d known node(s)",
                    epoch, restored, self.grace, len(self._expected))

    def lost(self, epoch: Epoch, why: str) -> None:
        """Stop at once and forget the term: its map, operations, grants and queue go; every waiter is answered.

        REST calls waiting on an agent get ``outcome_unknown`` (the command may have reached its node), runtime
        hooks waiting in the queue are refused (their agent asks the next leader), and queue changes not yet
        written are dropped (the new leader owns the queue). Containers are untouched: agents enforce on their own.
        """
        manager, cluster = self.manager, self.manager.cluster
        text = f"this manager stopped leading (epoch {epoch}): {why}"
        hooks = manager.inbound.refuse_hook_waiters(text)  # before the map, which knows where they wait, goes
        if isinstance(cluster.journal, EtcdQueueJournal):
            cluster.journal.discard()
        waited = cluster.reset(text)
        failed = manager.link.fail_all(NotLeader(text))
        log.warning("no longer leading (epoch %s): %s; the map is dropped: %d REST call(s) answered outcome_unknown, "
                    "%d hook(s) refused, %d request(s) to agents failed", epoch, why, waited, hooks, failed)

    def _reload_queue(self) -> int:
        """Queue what the store holds (the map was reset: nothing of an earlier term is left)."""
        cluster = self.manager.cluster
        entries = self.plane.store.queued()
        if isinstance(cluster.journal, EtcdQueueJournal):
            cluster.journal.discard()  # anything noted since the reset is no change to the store: it holds the truth
        return cluster.restore_queue(entries)
