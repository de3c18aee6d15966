"""Intents: what was decided about a running container and not carried out yet, kept beyond one process.

A DELETE answered 202 (its node is down, or an operation is in flight) and a preemption both set a
record's desired state and wait for its node. The map lives in memory, so a restart or a failover
would forget them and the container would run on. An intent is that desired state written to the
store (:meth:`~gpumgr.manager.control.store.Store.intend`) *before* anything acts on it: a DELETE writes it
ahead of changing the map (a failed write leaves nothing, and the caller gets 503), a preemption
before its Remove goes out.

The map keeps the intents it knows here. When leadership starts (or a single manager starts) they
are loaded from the store; a node that registers with a container of an intent's grant gets that
desired state on the adopted record (and its Remove). An intent is *spent* once its record ends or
its node registers without the container; spent intents are deleted from the store later, in the
background (a failure there only leaves a moot key behind). Called under the ledger's lock.
"""

from __future__ import annotations

from typing import Any

from gpumgr.manager.model.records import Container
from gpumgr.wire.names import State

#: Desired states an intent keeps (running is the default, and needs no keeping).
KEPT = frozenset({State.REMOVED, State.PREEMPTED})


def intent_of(record: Container) -> dict[str, Any]:
    """What the store keeps of ``record``'s desired state: its node, the state, why, and for whom."""
    body: dict[str, Any] = {"node": record.node, "desired": str(record.desired),
                            "reason": record.desired_reason or ""}
    if record.desired is State.PREEMPTED and record.preempted_for:
        body["for"] = record.preempted_for
    if record.desired is State.PREEMPTED and record.detail.get("reclaimed_for_account"):
        body["account"] = record.detail["reclaimed_for_account"]
    return body


class Intents:
    """The intents the map knows: kept in the store, not yet written, and spent (to delete)."""

    def __init__(self) -> None:
        #: written to the store: grant id → intent
        self.kept: dict[str, dict[str, Any]] = {}
        #: decided in the map (a preemption) and not written yet: written before its Remove goes out
        self.unwritten: dict[str, dict[str, Any]] = {}
        #: carried out or moot: deleted from the store in the background
        self.spent: set[str] = set()

    def load(self, kept: dict[str, dict[str, Any]]) -> None:
        """Start from what the store holds (a fresh map: a restart or a new term of leadership)."""
        self.kept, self.unwritten, self.spent = dict(kept), {}, set()

    def written(self, intents: dict[str, dict[str, Any]]) -> None:
        """``intents`` are in the store now."""
        for grant, body in intents.items():
            self.unwritten.pop(grant, None)
            self.spent.discard(grant)
            self.kept[grant] = body

    def desired(self, record: Container) -> None:
        """``record``'s desired state changed: a kept state not written yet waits to be; back to running is spent."""
        if record.desired in KEPT:
            body = intent_of(record)
            if self.kept.get(record.id) != body:
                self.unwritten[record.id] = body
        else:
            self.unwritten.pop(record.id, None)
            self.ended(record.id)

    def ended(self, grant: str) -> None:
        """``grant``'s record ended (or its desired state is running again): its intent is spent."""
        self.unwritten.pop(grant, None)
        if self.kept.pop(grant, None) is not None:
            self.spent.add(grant)

    def adopted(self, record: Container) -> tuple[State, str, dict[str, Any]] | None:
        """The desired state a kept intent gives ``record`` (adopted from its node): ``(state, reason, detail)``."""
        body = self.kept.get(record.id)
        if body is None:
            return None
        try:
            desired = State(body.get("desired", ""))
        except ValueError:
            desired = State.REMOVED
        if desired not in KEPT:
            desired = State.REMOVED
        detail = {"preempted_for": body["for"]} if desired is State.PREEMPTED and body.get("for") else {}
        if desired is State.PREEMPTED and body.get("account"):
            detail["reclaimed_for_account"] = str(body["account"])
        return desired, str(body.get("reason") or "removed on request"), detail

    def registered(self, node: str, reported: set[str], known: set[str]) -> None:
        """``node`` registered with ``reported``: its intents for grants neither it nor the map has are moot."""
        for grant in [g for g, body in self.kept.items() if body.get("node") == node
                      and g not in reported and g not in known]:
            self.ended(grant)

    def take_spent(self) -> list[str]:
        """The spent grants to delete from the store (the caller puts them back with :meth:`respend` on failure)."""
        spent, self.spent = sorted(self.spent), set()
        return spent

    def respend(self, grants: list[str]) -> None:
        """Deleting ``grants`` failed: try again next time (unless one was kept again meanwhile)."""
        self.spent.update(g for g in grants if g not in self.kept)
