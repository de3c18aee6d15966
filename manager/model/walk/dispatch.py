"""The queue's work: placing waiting requests as room frees, expiring them, and planning preemption.

Order is the wait queue's (priority, then first come, with aging on the manager's monotonic clock).
A request only its tenant's quota holds back, one pinned to a node that is not ready, or one no
node on the map could hold even empty (its only big node was forgotten) is stepped over: it blocks
nobody. The first that does not fit stops the walk, and preemptible containers of lower priority
may be chosen to make room for it: their desired state becomes ``preempted`` and the reconciler
stops them. A container whose node refused to stop it is left alone for a while, longer after each
refusal (jittered), and after :data:`~gpumgr.wire.defaults.PREEMPT_RETRIES` refusals for good, with an
event: other containers may be chosen meanwhile, never the same one at once. Called under the ledger's lock.

With accounts configured the walk is :class:`~gpumgr.manager.model.walk.sharing.FairWalk`'s: accounts below
their fair share first, a blocked head blocking only its own account, priority preemption only inside
one account, and reclaim between accounts.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from gpumgr.manager.model.bursts.reclaim import BurstReclaim
from gpumgr.manager.model.lifecycle import Lifecycle, placed_text
from gpumgr.manager.model.records import Container, PlacementSpec
from gpumgr.manager.model.walk.sharing import FairWalk
from gpumgr.manager.placing.scheduler import GpuSlot, Placement, Request, link_of, place
from gpumgr.manager.placing.shares import ever_fits, with_share
from gpumgr.wire import defaults
from gpumgr.wire.constraints import NO_CONSTRAINTS, Constraints, compiled
from gpumgr.wire.errors import NO_AGENTS, GpumgrError, InvalidRequest, NoAgents, NoFit
from gpumgr.wire.names import LIVE, EventType, State
from gpumgr.wire.units import format_bytes

log = logging.getLogger(__name__)


#: The placement enum by its value: a dict lookup, not the enum's own call, on every placement.
_PLACEMENTS = {p.value: p for p in Placement}


def request_for(spec: PlacementSpec, memory: int) -> Request:
    """What the scheduler is asked for ``spec`` at ``memory`` bytes per GPU."""
    placement = _PLACEMENTS.get(spec.placement) or Placement(spec.placement)
    if spec.constraints or spec.compute_share:
        return Request(memory, spec.count, spec.node, placement, with_share(constraints_of(spec), spec.compute_share))
    return Request(memory, spec.count, spec.node, placement)  # as bench/scheduler.py's older ones take


def constraints_of(spec: PlacementSpec) -> Constraints:
    """``spec``'s constraints, compiled; InvalidRequest for one that cannot be read.

    They were validated at the edge already; a node's hook request or a journal line is checked here too.
    """
    try:
        return compiled(tuple(spec.constraints)) if spec.constraints else NO_CONSTRAINTS
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"constraints: {exc}") from None


def take_slots(record: Container, slots: list[GpuSlot]) -> None:
    """Assign the GPUs the scheduler chose to ``record``, with the link that joins them (shown in its record)."""
    if len(slots) == 1:  # the common case, without the calls (one GPU has no link to weigh)
        slot = slots[0]
        record.node, record.gpus, record.topology = slot.node, [slot.uuid], None
        return
    record.node, record.gpus, record.topology = slots[0].node, [s.uuid for s in slots], link_of(slots)


def preempt_for(life: Lifecycle, making_room: dict[str, set[str]], victims: list[Container], head: str, what: str,
                priority: int) -> None:
    """Mark ``victims`` to stop for request ``head`` (``what``, of ``priority``); the reconciler stops them."""
    if not victims:
        return
    making_room[head] = {v.id for v in victims}
    for victim in victims:
        life.desire(victim, State.PREEMPTED, preempted_for=head)
        life.event(EventType.PREEMPTED, f"stopping preemptible container (priority {victim.priority}) to make room "
                   f"for {what} (priority {priority})", victim, preempted_for=head)


@dataclass
class Refusals:
    """A preemptible record its node refused to stop: how many times, and when it may be chosen again (monotonic)."""

    count: int = 0
    not_before: float = 0.0


def retry_delay(refusals: int, jitter: float) -> float:
    """How long a record is left alone after its ``refusals``-th refusal: doubling from the least, capped, ×jitter."""
    return min(defaults.PREEMPT_RETRY_MAX, defaults.PREEMPT_RETRY_MIN * 2.0 ** (refusals - 1)) * jitter


def jitter_factor() -> float:
    """A jitter factor in [0.5, 1.5)."""
    return 0.5 + random.random()


class Dispatch:
    """Walks the queue in order; see the module docstring for the rules."""

    def __init__(self, life: Lifecycle) -> None:
        self.life = life
        self.ledger = life.ledger
        #: queued request → the preemptible records being stopped for it
        self.making_room: dict[str, set[str]] = {}
        #: preemptible records whose node refused to stop them, by id (dropped once they end, at the next
        #: preemption planned or refused)
        self.refused: dict[str, Refusals] = {}
        #: the backoff's jitter factor (a test pins it)
        self.jitter: Callable[[], float] = jitter_factor
        #: the walk and reclaim with accounts configured
        self.fair = FairWalk(self)
        #: bursters stopped for a request that needs their bytes (before any priority preemption)
        self.bursts = BurstReclaim(life)

    def walk(self, own: str | None = None, own_waits: bool = True) -> list[Container]:
        """Place queued requests in order while they fit; return those placed (state ``creating``).

        With accounts configured the walk is :meth:`FairWalk.walk` (:mod:`gpumgr.manager.model.walk.sharing`).
        """
        if self.life.quotas.accounts is not None:
            return self.fair.walk(own, own_waits)
        placed: list[Container] = []
        position = 0
        queue, records, unwritten = self.life.queue, self.ledger.records, self.life.unwritten
        while position < len(queue):
            record = records[queue.at(position)]
            if unwritten and record.id in unwritten and record.id != own:
                position += 1  # its queue entry is being written: accepted only once that is done
                continue
            if not self.may_try(record):
                position += 1
                continue
            try:
                slots = place(self.ledger.index, self.request_of(record))
            except NoFit:
                if record.id != own or own_waits:  # only a request that waits is worth stopping anything for
                    self.plan_preemption(record)
                return placed
            except (NoAgents, GpumgrError):
                return placed
            self.placed(record, slots, own)
            placed.append(record)
        return placed

    def request_of(self, record: Container) -> Request:
        """What the scheduler is asked for queued ``record``."""
        return request_for(record.spec, record.gpu_memory)

    def may_try(self, record: Container) -> bool:
        """False for a request stepped over: its tenant's quota holds it back, its node is not ready, or no
        node on the map could hold it even empty."""
        spec = record.spec
        return not (not self.life.quotas.within_live(record)
                    or (spec.node is not None and spec.node not in self.ledger.index.by_node)
                    or self.ledger.capacity(spec.count, spec.node, ever_fits(constraints_of(spec), spec.compute_share))
                    < record.gpu_memory)

    def placed(self, record: Container, slots: list[GpuSlot], own: str | None) -> None:
        """Queued ``record`` takes ``slots``: it moves to ``creating``, with its event."""
        take_slots(record, slots)
        self.life.move(record, State.CREATING)
        self.making_room.pop(record.id, None)
        waited = self.life.clock.monotonic() - (record.queued_mono or 0.0)
        if record.id != own:
            self.life.outcome("placed")
        self.life.event(EventType.PLACED, placed_text(record.gpu_memory, record.gpus)
                        + (f" after waiting {waited:.1f}s in the queue" if record.id != own else ""), record)

    def expire(self) -> None:
        """End queued requests whose ``queue_timeout`` ran out."""
        now = self.life.clock.monotonic()
        expiries = self.life.expiries
        while expiries and expiries[0][0] <= now:
            _, cid = expiries[0]
            record = self.ledger.records.get(cid)
            if record is None or record.state is not State.QUEUED:
                expiries.pop(0)
                continue
            waited = now - (record.queued_mono or now)
            self.life.move(record, State.EXPIRED, f"waited {waited:.1f}s in the queue without room: its "
                           "queue_timeout ran out")

    def check_could_fit(self, spec: PlacementSpec, memory: int | None = None) -> None:
        """NoFit (``never_fits``) at once for a request no GPU on the map could ever hold, queue or not."""
        memory = spec.memory if memory is None else memory
        if not self.ledger.nodes or (spec.node is not None and spec.node not in self.ledger.nodes):
            return  # nothing known yet: a node may join
        constraints = ever_fits(constraints_of(spec), spec.compute_share)
        best = self.ledger.capacity(spec.count, spec.node, constraints)
        if best < memory:
            where = f"node {spec.node}" if spec.node else "any node"
            allowed = f" that {', '.join(constraints.texts)} allow" if constraints else ""
            if spec.compute_share:
                allowed += f" (a compute_share of {spec.compute_share}% runs only on nodes whose agent has mps: true)"
            raise NoFit(f"no GPU could ever hold this: {format_bytes(memory)} on {spec.count} GPU(s){allowed} of one "
                        f"node, and the largest {where} has is {format_bytes(best)} each; nothing was queued",
                        code="never_fits")

    def check_placeable(self, spec: PlacementSpec) -> None:
        """The refusals that outrank an account's ``409 over_quota``: ``never_fits``, and no agent ready (503)."""
        self.check_could_fit(spec)
        if not self.ledger.index.by_node:
            raise NoAgents(NO_AGENTS)

    def plan_preemption(self, head: Container, same_account: bool = False) -> None:
        """Choose preemptible containers of lower priority whose grants, once freed, let ``head`` fit.

        Per GPU the fewest bytes are taken: the lowest priority first, then the youngest. Nothing is
        chosen again while containers already chosen for ``head`` are still stopping, nor one whose node
        refused to stop it while it backs off. The comparison is of priorities as asked: aging orders the
        queue, it gives no right to stop anything. With ``same_account`` (accounts configured) only
        containers of ``head``'s own account are chosen: between accounts only reclaim moves room.
        """
        if self.bursts.reclaim(head, self.making_room, self.may_stop) or not self.ledger.preemptible:
            return
        records = self.ledger.records
        chosen_before = self.making_room.get(head.id, set())
        if any(records[v].state in (State.CREATING, State.RUNNING) and records[v].desired is State.PREEMPTED
               for v in chosen_before if v in records):
            return
        now = self.life.clock.monotonic()

        def eligible(victim: Container) -> bool:
            return (victim.preemptible and victim.state is State.RUNNING and victim.priority < head.priority
                    and victim.desired is State.RUNNING and victim.op is None and self.may_stop(victim, now)
                    and (not same_account or victim.account == head.account))

        victims = self.cheapest_victims(head, eligible, lambda r: (r.priority, -r.created_at))
        preempt_for(self.life, self.making_room, victims, head.id, f"queued request {head.id}", head.priority)

    def may_stop(self, victim: Container, now: float) -> bool:
        """False while ``victim``'s node refused to stop it and it backs off (or for good)."""
        if self.refused:
            self._forget_ended()
        return victim.id not in self.refused or self.refused[victim.id].not_before <= now

    def cheapest_victims(self, head: Container, eligible: Callable[[Container], bool],
                         order: Callable[[Container], Any]) -> list[Container]:
        """The ``eligible`` running containers whose grants, once freed, let ``head`` fit, at the least cost.

        Per GPU the holders are taken in ``order`` until ``head`` fits there; per node the ``count``
        cheapest GPUs; of the nodes, the one that stops the fewest bytes. Empty if none would do.
        """
        records = self.ledger.records
        spec = head.spec
        nodes = [spec.node] if spec.node is not None else list(self.ledger.index.by_node)
        share = spec.compute_share
        allowed = ever_fits(constraints_of(spec), share).allows if spec.constraints or share else None
        best: tuple[int, list[Container]] | None = None
        for name in nodes:
            options: list[tuple[int, list[Container]]] = []
            for gpu in self.ledger.node_gpus(name):
                if gpu not in self.ledger.index or (allowed is not None and not allowed(gpu)):
                    continue  # not schedulable, or not one it may use: nothing there is stopped for it
                free, room = gpu.free, defaults.MAX_COMPUTE_SHARE - gpu.compute_shares - share
                if free >= head.gpu_memory and room >= 0:
                    options.append((0, []))
                    continue
                chosen: list[Container] = []
                for victim in sorted((records[c] for c in gpu.holders), key=order):
                    if free >= head.gpu_memory and room >= 0:
                        break
                    if eligible(victim):
                        chosen.append(victim)
                        free, room = free + victim.held, room + victim.compute_share
                if free >= head.gpu_memory and room >= 0:
                    options.append((sum(v.held for v in chosen), chosen))
            if len(options) < spec.count:
                continue
            options.sort(key=lambda o: o[0])
            victims = list({v.id: v for _, chosen in options[:spec.count] for v in chosen}.values())
            cost = sum(v.held for v in victims)
            if victims and (best is None or cost < best[0]):
                best = (cost, victims)
        return [] if best is None else best[1]

    def preemption_failed(self, victim: Container) -> None:
        """Its node could not stop ``victim``: it runs on unmarked and backs off; room is sought again for the head."""
        head = victim.preempted_for
        self.life.desire(victim, State.RUNNING)
        if head is not None:
            self.making_room.get(head, set()).discard(victim.id)
        self._back_off(victim)
        self.ledger.wake.set()  # another container may make the room meanwhile

    def _back_off(self, victim: Container) -> None:
        """Count one more refusal to stop ``victim``: it may be chosen again after a growing delay, or never."""
        self._forget_ended()
        refused = self.refused.setdefault(victim.id, Refusals())
        refused.count += 1
        if refused.count < defaults.PREEMPT_RETRIES:
            refused.not_before = self.life.clock.monotonic() + retry_delay(refused.count, self.jitter())
            return
        refused.not_before = math.inf
        log.warning("container %s: its node refused to stop it %d times; it is no longer preempted", victim.id,
                    refused.count)
        self.life.event(EventType.FAILED, f"its node refused to stop it {refused.count} times: it is no longer "
                        "chosen to make room for queued requests", victim, refusals=refused.count)

    def _forget_ended(self) -> None:
        """Drop the refusals of records that ended or left the map: nothing is asked of them again."""
        records = self.ledger.records
        for cid in [c for c in self.refused if c not in records or records[c].state not in LIVE]:
            del self.refused[cid]

    def restore(self, entries: list[dict[str, Any]]) -> int:
        """Queue again the requests a previous manager process kept in its journal; return how many."""
        restored = 0
        wall = self.life.clock.time() - self.life.clock.monotonic()
        for entry in entries:
            try:
                spec = PlacementSpec(**entry["spec"])
                request_for(spec, spec.memory)  # its constraints must read as they did when it was queued
                expires = entry.get("expires_at")
                record = Container(
                    id=str(entry["id"]), name=str(entry["name"]), node="", gpus=[], gpu_memory=spec.memory,
                    spec=spec, state=State.QUEUED, created_at=float(entry["created_at"]),
                    tenant=entry.get("tenant"), priority=int(entry.get("priority", 0)),
                    preemptible=bool(entry.get("preemptible")), queued_at=float(entry["queued_at"]),
                    queued_mono=float(entry["queued_at"]) - wall, queue_seq=int(entry.get("seq", 0)),
                    expires_mono=None if expires is None else float(expires) - wall,
                )
            except (KeyError, TypeError, ValueError, InvalidRequest) as exc:
                log.warning("queue journal entry skipped: %s", exc)
                continue
            if record.id in self.ledger.records:
                continue
            if self.life.quotas.accounts is not None:
                record.account = self.life.quotas.accounts.account_of(record.tenant)
            self.life.admit(record)
            self.life.journaled.add(record.id)
            restored += 1
        self.life.journal.open([self.life.journal_entry(self.ledger.records[c]) for c in self.life.queue.ids()])
        return restored

    def requeue_spec(self, record: Container, memory: int) -> None:
        """A queued request's grant per GPU changes to ``memory`` (PATCH while it waits)."""
        record.spec = replace(record.spec, memory=memory)
        self.life.quotas.resized(record, memory - record.gpu_memory)
        record.gpu_memory = memory
        if record.id in self.life.journaled:
            self.life.journal.add(self.life.journal_entry(record))
        self.ledger.wake.set()


