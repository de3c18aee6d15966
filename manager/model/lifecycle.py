"""A container's life, written once: the transition table and the one function that applies it.

As in SwarmKit's task model, each record has an *observed* state, moved only by its node's reports
and the manager's own deadlines, and a *desired* state (run, removed, preempted), set only by the
API and the manager's policy (preemption). Observed states only move forward, through
:data:`TRANSITIONS`; :meth:`Lifecycle.move` checks the table and, in the same step, moves the grant
(ledger), the tenant's counts (quotas), the queue and the journal, ends the operation in flight, and
writes the one event. An operation (create, remove, resize) has an id; at most one is in flight per
record, and a reply for another is ignored. A DELETE that arrives during one only sets the desired
state; the reconciler carries it out when the operation ends.

::

    queued ──▶ creating ──▶ running ──▶ exited | killed | failed | removed | preempted
      │            │
      └─▶ removed | expired | failed     └─▶ failed | removed | exited | killed | preempted

An ended record may still become ``removed`` (DELETE after it ended: its container is gone too).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from sortedcontainers import SortedList

from gpumgr.manager.clock import SYSTEM, Clock
from gpumgr.manager.events import EventLog, Message
from gpumgr.manager.model.intents import Intents
from gpumgr.manager.model.ledger import Ledger
from gpumgr.manager.model.queue import QueueJournal, WaitQueue
from gpumgr.manager.model.quotas import Quotas
from gpumgr.manager.model.records import Container, Op, OpKind
from gpumgr.wire.errors import AgentFailed, Conflict, GpumgrError
from gpumgr.wire.names import (
    CREATING,
    EXITED,
    FAILED,
    KILLED,
    LIVE,
    PREEMPTED,
    QUEUED,
    REMOVED,
    RUNNING,
    EventType,
    State,
)
from gpumgr.wire.units import format_bytes

log = logging.getLogger(__name__)

ENDED = frozenset({State.EXITED, State.KILLED, State.FAILED, State.REMOVED, State.EXPIRED, State.PREEMPTED})
#: Every move an observed state may make; anything else is refused (and logged).
TRANSITIONS: dict[State, frozenset[State]] = {
    State.QUEUED: frozenset({State.CREATING, State.REMOVED, State.EXPIRED, State.FAILED}),
    State.CREATING: frozenset({State.RUNNING, State.EXITED, State.KILLED, State.FAILED, State.REMOVED,
                               State.PREEMPTED}),
    State.RUNNING: frozenset({State.EXITED, State.KILLED, State.FAILED, State.REMOVED, State.PREEMPTED}),
    **{s: frozenset({State.REMOVED}) for s in ENDED if s is not State.REMOVED},
    State.REMOVED: frozenset(),
}
#: What the desired state may be: run it, remove it, or stop it to make room (preempt).
DESIRED = frozenset({State.RUNNING, State.REMOVED, State.PREEMPTED})
#: Ends that a desired preemption turns into ``preempted``: whatever exit the stop caused.
_PREEMPTION_ENDS = frozenset({State.EXITED, State.KILLED, State.REMOVED, State.PREEMPTED})
_EXITED_EVENT = EventType.EXITED
_FINAL_EVENTS = {State.KILLED: EventType.KILLED, State.FAILED: EventType.FAILED, State.REMOVED: EventType.REMOVED,
                 State.EXPIRED: EventType.EXPIRED, State.PREEMPTED: EventType.PREEMPTED}


class Lifecycle:
    """The transition table applied: the only code that changes a record's state or desired state."""

    def __init__(self, ledger: Ledger, quotas: Quotas, events: EventLog, queue: WaitQueue, journal: QueueJournal,
                 clock: Clock = SYSTEM) -> None:
        self.ledger, self.quotas, self.events, self.queue, self.journal = ledger, quotas, events, queue, journal
        self.clock = clock
        self._op_ids = itertools.count(1)
        #: queued records that wait on disk too (a hook's wait lives in its node's open request instead)
        self.journaled: set[str] = set()
        #: journaled records whose queue entry is not durable yet: not placed until it is (write ahead)
        self.unwritten: set[str] = set()
        #: (expires at, monotonic; id) of queued records with a queue_timeout
        self.expiries: SortedList = SortedList()
        #: what ``GET /metrics`` counts: kills for overrun per node, placement requests per outcome
        self.overrun_kills: dict[str, int] = {}
        self.outcomes: dict[str, int] = {}
        #: desired states decided and not carried out yet, as the store keeps them (:mod:`gpumgr.manager.model.intents`)
        self.intents = Intents()
        #: a gang's member ended (:mod:`gpumgr.manager.model.gangs` sets it): called after its end is recorded
        self.member_ended: Callable[[Container], None] | None = None
        #: a live member was adopted from its node's report (a restart or failover): its gang is rebuilt
        self.member_adopted: Callable[[Container], None] | None = None
        #: records whose final event this process wrote, oldest first, as many as the event log keeps; kept across
        #: terms (the event log is), so a leader that leads again and re-adopts a container it saw end writes no
        #: second final event for it
        self.finals_written: dict[str, None] = {}

    def clear(self) -> None:
        """Forget what belongs to the records (the map starts from nothing); counters and op ids go on."""
        self.journaled.clear()
        self.unwritten.clear()
        self.expiries.clear()
        self.intents.load({})

    # --- entering ------------------------------------------------------------------------------
    def admit(self, record: Container, *, journal: bool = False) -> None:
        """A new record joins the map: ``queued`` (it waits in line) or ``creating`` (already assigned GPUs)."""
        self.ledger.records[record.id] = record
        if record.state is State.QUEUED:
            self._enqueue(record, journal)
        else:
            if record.tenant is not None or record.account is not None:
                self.quotas.count(record, 1)
            self.ledger.grant(record)
            if self.member_adopted is not None and record.labels.get("gpumgr.gang"):
                self.member_adopted(record)  # a gang's member adopted from its node: the gang is rebuilt

    def place_new(self, record: Container, timeout: float | None) -> None:
        """A new record placed at once (its GPUs assigned) joins the map ``creating``: its event, its tenant's count,
        its create operation begun (none for a hook's: its node confirms it), and last its grant."""
        self.ledger.records[record.id] = record
        self.event(EventType.PLACED, (placed_text, record.gpu_memory, record.gpus), record)
        if record.tenant is not None or record.account is not None:
            self.quotas.count(record, 1)
        if timeout is not None:
            record.op = Op(OpKind.CREATE, next(self._op_ids), self.clock.monotonic() + timeout)
        self.ledger.grant(record)

    def admit_ended(self, record: Container, state: State, reason: str | None, *, exit_code: int | None = None,
                    finished_at: float | None = None) -> None:
        """A record that ended where no manager saw it (adopted after the fact, or refused) joins the map ended."""
        assert state in ENDED
        record.state, record.exit_code, record.held = state, exit_code, 0
        record.reason = reason or _default_reason(state, exit_code)
        record.finished_at = finished_at or self.clock.time()
        self.ledger.records[record.id] = record
        self.ledger.ended(record)
        self._final_event(record)

    def forget(self, record: Container) -> None:
        """Drop a queued record that was in line only for its own placement attempt and is refused."""
        self._leave_queue(record)
        self.quotas.count(record, -1)
        del self.ledger.records[record.id]

    def journal_entry(self, record: Container) -> dict[str, Any]:
        """What the queue journal keeps of a queued record (enough to queue it again after a restart)."""
        wall = self.clock.time() - self.clock.monotonic()
        return {"id": record.id, "name": record.name, "tenant": record.tenant, "priority": record.priority,
                "preemptible": record.preemptible, "created_at": record.created_at, "queued_at": record.queued_at,
                "seq": record.queue_seq, "expires_at": None if record.expires_mono is None
                else record.expires_mono + wall, "spec": asdict(record.spec)}

    # --- the one transition function -----------------------------------------------------------
    def move(self, record: Container, to: State, reason: str | None = None, *, exit_code: int | None = None,
             detail: dict[str, Any] | None = None, finished_at: float | None = None,
             error: GpumgrError | None = None) -> bool:
        """Move ``record``'s observed state to ``to`` if the table allows it; False (nothing changed) if not.

        Placing (``queued`` → ``creating``) grants the GPUs already assigned to it; ending releases the
        grant, ends the operation in flight (with ``error`` for whoever waits on it) and writes the one
        final event. A record whose desired state is ``preempted`` ends as ``preempted`` however it stops.
        """
        now_from = record.state
        if to not in TRANSITIONS[now_from]:  # no state moves to itself
            if to is not now_from:
                log.info("record %s: %s → %s is not a transition; ignored", record.id, now_from, to)
            return False
        if now_from is QUEUED:
            self._leave_queue(record)
            self.quotas.count(record, -1)
            if to is CREATING:
                record.state = CREATING
                self.quotas.count(record, 1)
                self.ledger.grant(record)
                return True
        if to is RUNNING:
            record.state, record.deadline = RUNNING, None
            self.event(EventType.STARTED, (started_text, record.container_id), record)
            return True
        if now_from in ENDED:  # deleted after it ended: the end stays as it was recorded
            record.state = REMOVED
            self.event(EventType.REMOVED, "removed", record)
            return True
        if now_from in LIVE:
            self.ledger.release(record)
            if record.tenant is not None or record.account is not None:
                self.quotas.count(record, -1)
        if record.desired is PREEMPTED and to in _PREEMPTION_ENDS:
            to = PREEMPTED
            # reclaim's victims end "reclaimed" (their record names the account it was for)
            reason = record.desired_reason or \
                f"preempted to make room for queued request {record.preempted_for} of higher priority"
        record.state, record.deadline = to, None
        if to is KILLED and ("overrun" in record.detail or (detail is not None and "overrun" in detail)):
            self.overrun_kills[record.node] = self.overrun_kills.get(record.node, 0) + 1
        if exit_code is not None:
            record.exit_code = exit_code
        record.reason = reason or record.desired_reason or record.reason or _default_reason(to, record.exit_code)
        if detail:
            record.detail.update(detail)
        record.finished_at = finished_at or record.finished_at or self.clock.time()
        self.intents.ended(record.id)
        op = record.op
        if op is not None and op.kind is OpKind.REMOVE and error is None and to in (EXITED, KILLED) \
                and record.desired is not RUNNING:
            pass  # the stop its removal asked for, reported first: the Remove's reply (container gone) ends the op
        elif op is not None:
            record.op = None
            if op.kind is OpKind.REMOVE and error is None and to in (REMOVED, PREEMPTED):
                # its node's report showed it gone before the Remove's reply came: the removal did what it was asked
                op.finish(None)
            else:
                # a record that failed while an operation waited failed on its node (502), whatever noticed it
                # first; the error is made only if someone asks (see Op.finish)
                op.finish(error or (AgentFailed if to is FAILED else Conflict, ended_text, record.id, to,
                                    record.reason))
        self.ledger.ended(record)
        self._final_event(record)
        if record.gang is not None and self.member_ended is not None:
            self.member_ended(record)  # its gang ends, or waits for the others (manager/model/gangs.py)
        return True

    def desire(self, record: Container, desired: State, reason: str | None = None, **detail: Any) -> bool:
        """Set what should become of ``record`` (the API or policy); False if it is ended or already so."""
        assert desired in DESIRED
        if record.state in ENDED or record.desired is desired:
            return False
        record.desired, record.desired_reason = desired, reason
        if desired is State.PREEMPTED:
            record.detail.update(detail)
        elif desired is State.RUNNING:
            record.detail.pop("preempted_for", None)
        self.intents.desired(record)
        return True

    # --- operations ----------------------------------------------------------------------------
    def begin(self, record: Container, kind: OpKind, timeout: float, *, old: int = 0, new: int = 0) -> Op | None:
        """Start an operation on ``record``; None if one is in flight already (at most one at a time)."""
        if record.op is not None:
            return None
        record.op = Op(kind, next(self._op_ids), self.clock.monotonic() + timeout, old, new)
        return record.op

    def current(self, record: Container, op: Op) -> bool:
        """Whether ``op`` is still the operation in flight on ``record`` (its reply is not stale)."""
        return record.op is op

    def end_op(self, record: Container, op: Op, error: GpumgrError | None = None) -> None:
        """``op`` is over (with ``error`` if it failed): wake whoever waits on it."""
        if record.op is op:
            record.op = None
        op.finish(error)

    # --- events --------------------------------------------------------------------------------
    def event(self, kind: EventType, text: Message, record: Container, /, **extra: Any) -> None:
        """An event about ``record``, tagged with its tenant (a tenant reads only its own events)."""
        self.events.add(kind, text, record.node or None, record.id, record.tenant, extra)

    def outcome(self, outcome: str) -> None:
        """Count one placement request's outcome for ``/metrics``."""
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def _final_event(self, record: Container) -> None:
        written = self.finals_written
        if record.id in written:  # its end is in the log already, from an earlier term of this process's
            return
        written[record.id] = None
        if len(written) > self.events.size:
            del written[next(iter(written))]
        kind = _FINAL_EVENTS.get(record.state, _EXITED_EVENT)
        text = (final_text, record.state, record.reason, record.exit_code)
        if not record.detail:  # the common end: the event written directly, one call fewer than event()
            self.events.add(kind, text, record.node or None, record.id, record.tenant, {"final": True})
            return
        # the final event carries the overrun that ended it flat (reason, observed, grant_bytes, gpu, ...)
        overrun = record.detail.get("overrun")
        flat = {**{k: v for k, v in record.detail.items() if k != "overrun"},
                **(overrun if isinstance(overrun, dict) else {})}
        self.event(kind, text, record, final=True, **{k: v for k, v in flat.items() if k not in ("tenant", "final")})

    # --- the queue -----------------------------------------------------------------------------
    def _enqueue(self, record: Container, journal: bool) -> None:
        now = self.clock.monotonic()
        record.queued_mono = now if record.queued_mono is None else record.queued_mono
        record.queue_seq = self.queue.add(record.id, record.priority, record.queued_mono, record.queue_seq or None)
        if record.expires_mono is not None:
            self.expiries.add((record.expires_mono, record.id))
        self.quotas.count(record, 1)
        if journal:
            self.journaled.add(record.id)
            self.journal.add(self.journal_entry(record))
        self.ledger.wake.set()

    def _leave_queue(self, record: Container) -> None:
        self.queue.discard(record.id)
        if record.expires_mono is not None:
            self.expiries.discard((record.expires_mono, record.id))
        if record.id in self.journaled:
            self.journaled.discard(record.id)
            self.journal.remove(record.id)
        self.ledger.wake.set()  # the requests behind it may go now

    def why_waiting(self, memory: int, count: int, ahead: int) -> str:
        """Why a request of ``count`` × ``memory`` waits with ``ahead`` requests in front of it."""
        if ahead:
            return f"{ahead} queued request(s) of higher or equal priority wait for room first"
        largest = self.ledger.index.largest_free()
        return (f"no ready GPU has {format_bytes(memory)} free" + (f" on {count} GPUs of one node"
                if count > 1 else "") + f" (the most free on one GPU is {format_bytes(largest)})")


def placed_text(memory: int, gpus: list[str]) -> str:
    """A placed event's text, made when it is read: the grant per GPU and the GPUs."""
    return f"{format_bytes(memory)} on {', '.join(gpus)}"


def started_text(container_id: str | None) -> str:
    """A started event's text, made when it is read."""
    return f"container {(container_id or '')[:12]} running"


def ended_text(cid: str, state: State, reason: str | None) -> str:
    """Why an operation failed because its record ended first."""
    return f"container {cid} {state}: {reason}"


def final_text(state: State, reason: str | None, exit_code: int | None) -> str:
    """A record's final event's text, made when it is read: how it ended and why."""
    return f"{state}: {reason}" + (f" (exit {exit_code})" if exit_code is not None else "")


def _default_reason(state: State, exit_code: int | None) -> str:
    if state is EXITED:
        return f"exited with code {exit_code}" if exit_code is not None else "exited"
    return str(state)
