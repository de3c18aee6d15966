"""What a term of leadership means to the model: forgetting the map, holding commands, keeping intents.

A mixin of :class:`~gpumgr.manager.model.cluster.Cluster` (every method takes the ledger's one lock): the map
a manager builds while it leads belongs to that term. :meth:`Terms.reset` forgets it whole when the term
ends or a new one begins; :meth:`Terms.hold` keeps commands back until what they depend on is in the
store; and the intents (:mod:`gpumgr.manager.model.intents`) are what outlives the term, written to the store
by the manager (:mod:`gpumgr.manager.service`) outside the lock.
"""

from __future__ import annotations

import threading
from typing import Any

from gpumgr.manager.model.gangs import Gangs
from gpumgr.manager.model.intents import KEPT
from gpumgr.manager.model.ledger import Ledger, Wake
from gpumgr.manager.model.lifecycle import Lifecycle
from gpumgr.manager.model.queue import WaitQueue
from gpumgr.manager.model.quotas import Quotas
from gpumgr.manager.model.reconcile import Reconciler
from gpumgr.manager.model.records import Command, Container
from gpumgr.manager.model.walk.dispatch import Dispatch
from gpumgr.wire.errors import NotFound, OutcomeUnknown
from gpumgr.wire.names import LIVE, State


class Terms:
    """The term-of-leadership half of the cluster model; see the module docstring."""

    lock: threading.RLock
    wake: Wake
    ledger: Ledger
    life: Lifecycle
    quotas: Quotas
    queue: WaitQueue
    dispatcher: Dispatch
    reconciler: Reconciler
    gangs: Gangs
    _to_send: list[Command]
    _hooks_placed: list[Container]

    def hold(self, commands: list[Command], hooks: list[Container]) -> None:
        """Send ``commands`` and answer ``hooks`` at a later pass: what left the queue is not in the store yet."""
        with self.lock:
            self._to_send[:0] = commands
            self._hooks_placed[:0] = hooks

    def reset(self, why: str) -> int:
        """Forget the whole map: leadership ended, or begins (it is built again from the store and the nodes).

        Whoever waits on an operation of the ended term is answered at once with ``outcome_unknown``: the
        command may have reached its node, and the next leader learns what it did from that node's report.
        Returns how many waited.
        """
        with self.lock:
            waiting = [r.op for r in self.ledger.records.values() if r.op is not None]
            for op in waiting:
                op.finish(OutcomeUnknown(f"{why}; what became of the {op.kind} is not known here: look at the "
                                         "container before trying again"))
            self.ledger.clear()
            self.quotas.clear()
            self.queue.clear()
            self.life.clear()
            self.dispatcher.making_room.clear()
            self.dispatcher.fair.moving.clear()
            self.dispatcher.refused.clear()
            self.reconciler.clear()
            self.gangs.clear()
            self._to_send, self._hooks_placed = [], []
        self.wake.set()
        return len(waiting)

    # --- intents ---------------------------------------------------------------------------------
    def removal_intent(self, cid: str) -> dict[str, Any] | None:
        """What a DELETE of ``cid`` must write to the store before it acts (None: nothing, it ends at once)."""
        with self.lock:
            record = self.ledger.records.get(cid)
            if record is None:
                raise NotFound(f"no container with id {cid!r}")
            if record.state not in LIVE or record.desired is State.REMOVED:
                return None
            return {"node": record.node, "desired": str(State.REMOVED), "reason": "removed on request"}

    def intents_written(self, intents: dict[str, dict[str, Any]]) -> None:
        """``intents`` are in the store now; one whose record ended (or wants to run) meanwhile is spent at once."""
        with self.lock:
            intents_ = self.life.intents
            intents_.written(intents)
            for grant in intents:
                record = self.ledger.records.get(grant)
                if record is None or record.state not in LIVE or record.desired not in KEPT:
                    intents_.ended(grant)

    def unwritten_intents(self) -> dict[str, dict[str, Any]]:
        """The intents decided in the map (preemptions) and not written yet."""
        with self.lock:
            return dict(self.life.intents.unwritten)

    def load_intents(self, kept: dict[str, dict[str, Any]]) -> None:
        """Start from the intents the store holds (a restart, or a new term of leadership)."""
        with self.lock:
            self.life.intents.load(kept)

    def take_spent_intents(self) -> list[str]:
        """The intents carried out or moot, to delete from the store."""
        with self.lock:
            return self.life.intents.take_spent()

    def respend_intents(self, grants: list[str]) -> None:
        """Deleting ``grants``' intents failed: try again at the next sweep."""
        with self.lock:
            self.life.intents.respend(grants)

    def undo_queued_resize(self, cid: str, memory: int) -> None:
        """Put a queued request back at ``memory`` per GPU: its PATCH could not be written to the store."""
        with self.lock:
            record = self.ledger.records.get(cid)
            if record is not None and record.state is State.QUEUED and record.gpu_memory != memory:
                self.dispatcher.requeue_spec(record, memory)
