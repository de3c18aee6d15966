"""What a waiting gang does: one entry in the queue's journal, room held for it once it waited long enough,
preemption of lower priority as one request, and its account's and tenant's room (see ``core``).

A mixin of :class:`~gpumgr.manager.model.gangs.core.Gangs`; called under the ledger's lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from gpumgr.manager.model.gangs.spec import Gang, GangSpec
from gpumgr.manager.model.lifecycle import Lifecycle
from gpumgr.manager.model.records import Command, Container, PlacementSpec
from gpumgr.manager.model.walk.dispatch import preempt_for, request_for
from gpumgr.manager.model.walk.sharing import GangEntry
from gpumgr.manager.placing.gang import hold_targets, plan_gang
from gpumgr.wire.errors import NoAgents, NoFit, QuotaExceeded
from gpumgr.wire.names import LIVE, State

log = logging.getLogger(__name__)


class Waiting:
    """The waiting side of :class:`~gpumgr.manager.model.gangs.core.Gangs` (which sets these attributes)."""

    life: Lifecycle
    ledger: Any
    gangs: dict[str, Gang]
    waiting: list[str]
    holding: dict[str, str]
    hold_plan: tuple[str, list[tuple[str, int]]] | None
    making_room: dict[str, set[str]]
    reserve_after: float
    may_stop: Callable[[Container, float], bool]
    #: creates of gangs the fair walk placed, for the next dispatch to send
    to_send: list[Command]

    walk: Callable[[], None]
    trying: tuple[str, bool] | None

    def _start(self, gang: Gang, plan: list[list[Any]]) -> list[Command]:
        raise NotImplementedError  # core's: the plan granted to fresh members

    def _master_host(self, plan: list[list[Any]]) -> str:
        raise NotImplementedError  # core's: the host of rank 0's node in the plan

    def _free_port(self, host: str) -> int | None:
        raise NotImplementedError  # core's: a gang port free on the host, if any

    # --- waiting, kept in the queue's journal ----------------------------------------------------
    def _wait(self, gang: Gang) -> None:
        """``gang`` waits whole: one entry in the queue's journal (the state directory's, or etcd's)."""
        self.waiting.append(gang.id)
        self.life.journal.add(self.journal_entry(gang))
        self.ledger.wake.set()

    def _unwait(self, gang: Gang) -> None:
        self.waiting.remove(gang.id)
        self.life.journal.remove(gang.id)

    def journal_entry(self, gang: Gang) -> dict[str, Any]:
        """What the journal keeps of a waiting gang: enough to wait again after a restart or failover."""
        wall = self.life.clock.time() - self.life.clock.monotonic()
        spec = gang.spec
        return {"id": gang.id, "gang": {
            "member": asdict(spec.member), "replicas": spec.replicas, "one_per_node": spec.one_per_node,
            "restart": spec.restart, "max_restarts": spec.max_restarts, "network": spec.network,
            "tenant": gang.tenant, "created_at": gang.created_at, "queued_at": gang.queued_at,
            "rdzv_id": gang.rdzv_id, "restart_count": gang.restart_count,
            "expires_at": None if gang.expires_mono is None else gang.expires_mono + wall}}

    def waiting_by_account(self) -> dict[str, int]:
        """The bytes each leaf account's waiting gangs ask for (with accounts configured)."""
        accounts = self.life.quotas.accounts
        found: dict[str, int] = {}
        if accounts is not None:
            for gid in self.waiting:
                gang = self.gangs[gid]
                leaf = accounts.account_of(gang.tenant)
                found[leaf] = found.get(leaf, 0) + self.total(gang)
        return found

    @staticmethod
    def total(gang: Gang) -> int:
        """What a gang asks for in all: its members' bytes × GPUs."""
        member = gang.spec.member
        return member.memory * member.count * gang.spec.replicas

    def _tenant_allows(self, gang: Gang) -> bool:
        """Whether the gang's tenant may hold it whole now, under the quota in force (SIGHUP may have lowered it)."""
        book = self.life.quotas.book
        tenant = book.get(gang.tenant) if book is not None and gang.tenant is not None else None
        try:
            self.life.quotas.check(tenant, self.total(gang), gang.spec.replicas)
        except QuotaExceeded:
            return False
        return True

    def _account_allows(self, gang: Gang) -> bool:
        """With accounts: whether the gang's account may run it now (as one request of its whole bytes)."""
        quotas = self.life.quotas
        if quotas.accounts is None:
            return True
        verdict = quotas.room(quotas.accounts.account_of(gang.tenant), self.total(gang))
        return verdict is None or (verdict == "over_quota" and gang.spec.member.preemptible)

    def journal_entries(self) -> list[dict[str, Any]]:
        """Every waiting gang's entry, first come first (a compaction of the journal writes them again)."""
        return [self.journal_entry(self.gangs[g]) for g in self.waiting]

    def restore(self, entries: list[dict[str, Any]]) -> int:
        """Wait again for the gangs a previous manager process (or leader) kept in the journal; return how many."""
        restored = 0
        wall = self.life.clock.time() - self.life.clock.monotonic()
        for entry in entries:
            try:
                body = entry["gang"]
                member = PlacementSpec(**body["member"])
                request_for(member, member.memory)  # its constraints must read as they did
                spec = GangSpec(member, int(body["replicas"]), bool(body["one_per_node"]), str(body["restart"]),
                                int(body["max_restarts"]), body.get("network"))
                gang = Gang(str(entry["id"]), spec, body.get("tenant"), float(body["created_at"]),
                            str(body["rdzv_id"]), restart_count=int(body.get("restart_count", 0)),
                            queued_at=body.get("queued_at"))
                expires = body.get("expires_at")
                gang.expires_mono = None if expires is None else float(expires) - wall
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("queue journal entry of a gang skipped: %s", exc)
                continue
            if gang.id in self.gangs:
                continue
            gang.waiting_mono = self.life.clock.monotonic()
            self.gangs[gang.id] = gang
            self.waiting.append(gang.id)
            restored += 1
        return restored

    def _plan_preemption(self, gang: Gang) -> None:
        """Stop preemptible containers of lower priority (of its own account, with accounts) so the whole gang
        fits, as one request of its priority: nothing is chosen while containers chosen for it still stop."""
        records, ledger = self.ledger.records, self.ledger
        if not ledger.preemptible or any(
                (r := records.get(v)) is not None and r.state in LIVE and r.desired is State.PREEMPTED
                for v in self.making_room.get(gang.id, ())):
            return
        member, accounts = gang.spec.member, self.life.quotas.accounts
        account = accounts.account_of(gang.tenant) if accounts is not None else None
        now = self.life.clock.monotonic()

        def eligible(victim: Container) -> bool:
            return (victim.state is State.RUNNING and victim.desired is State.RUNNING and victim.op is None
                    and victim.priority < member.priority and victim.gang is None
                    and (account is None or victim.account == account) and self.may_stop(victim, now))

        pool = [r for cid in ledger.preemptible if (r := records.get(cid)) is not None]
        chosen = self.cheapest_victims(gang.id, eligible, lambda r: (r.priority, -r.created_at), pool)
        preempt_for(self.life, self.making_room, chosen, gang.id, f"waiting gang {gang.id}", member.priority)

    def plan_preemption(self, gid: str) -> None:
        """The fair walk's call: priority preemption for waiting gang ``gid``, inside its own account."""
        self._plan_preemption(self.gangs[gid])

    def cheapest_victims(self, gid: str, eligible: Callable[[Container], bool], order: Callable[[Container], Any],
                         pool: list[Container] | None = None) -> list[Container]:
        """The ``eligible`` containers of ``pool`` whose grants, once freed, let waiting gang ``gid`` fit whole.

        The gang is planned with what they would free counted as free (and the room held for it), then on each
        GPU of that plan they are taken in ``order`` until its members there fit. Empty if it would not fit.
        """
        gang, ledger = self.gangs[gid], self.ledger
        member = gang.spec.member
        candidates: dict[str, list[Container]] = {}
        for victim in pool or ():
            if eligible(victim):
                for uuid in victim.gpus:
                    if self.holding.get(uuid, gid) == gid:  # what frees on a GPU held for another gang is that gang's
                        candidates.setdefault(uuid, []).append(victim)
        if not candidates:
            return []
        own = self._own_holds(gid)
        more = {uuid: sum(v.held for v in found) + own.get(uuid, 0) for uuid, found in candidates.items()}
        try:
            plan = plan_gang(ledger.index, request_for(member, member.memory), gang.spec.replicas,
                             gang.spec.one_per_node, {**own, **more})
        except (NoFit, NoAgents):
            return []  # it would not fit even so: nothing is stopped for part of it
        wanted: dict[str, int] = {}
        slots = {}
        for slot in (s for member_slots in plan for s in member_slots):
            wanted[slot.uuid] = wanted.get(slot.uuid, 0) + member.memory
            slots[slot.uuid] = slot
        chosen: dict[str, Container] = {}
        for uuid, need in wanted.items():
            free = slots[uuid].free + own.get(uuid, 0) + sum(v.held for v in chosen.values() if uuid in v.gpus)
            for victim in sorted(candidates.get(uuid, []), key=order):
                if free >= need:
                    break
                if victim.id not in chosen:
                    chosen[victim.id] = victim
                    free += victim.held
        return list(chosen.values())

    def crew(self, gid: str) -> list[Container]:
        """The live members of placed gang ``gid`` (none if it is not known): what reclaim stops as one."""
        gang, records = self.gangs.get(gid), self.ledger.records
        return [r for m in (gang.members if gang else ()) if (r := records.get(m)) is not None and r.state in LIVE]

    def _own_holds(self, gid: str) -> dict[str, int]:
        """The bytes held for waiting gang ``gid`` by GPU (its reservation): free for it, and for nothing else."""
        return {uuid: gpu.gang_hold for uuid, holder in self.holding.items()
                if holder == gid and (gpu := self.ledger.gpus.get(uuid)) is not None}

    # --- with accounts: entries of their accounts' lines in the fair walk ---------------------------
    def entries(self) -> list[GangEntry]:
        """The waiting gangs the fair walk tries, as entries of their accounts' lines; one its tenant's quota holds
        back, or whose queue_timeout ran out (it expires in this dispatch), is stepped over."""
        accounts = self.life.quotas.accounts
        assert accounts is not None
        now = self.life.clock.monotonic()
        return [GangEntry(g.id, accounts.account_of(g.tenant), g.spec.member.priority, g.waiting_mono or 0.0,
                          self.total(g), g.spec.member.preemptible, waits=self.trying != (g.id, False))
                for g in (self.gangs[gid] for gid in self.waiting)
                if (g.expires_mono is None or now < g.expires_mono) and self._tenant_allows(g)]

    def _in_line(self) -> bool:
        """With accounts, while anything waits a new gang takes its turn in the fair walk (it jumps no line)."""
        return self.life.quotas.accounts is not None and bool(len(self.life.queue) or self.waiting)

    def _take_turn(self, gang: Gang, waits: bool) -> list[Command]:
        """A new gang's turn in its account's line, in a walk of the fair order (owed room there only if it
        ``waits``): its members' creates if the walk placed it; NoFit if it did not."""
        self.gangs[gang.id], gang.waiting_mono, self.trying = gang, self.life.clock.monotonic(), (gang.id, waits)
        self.waiting.append(gang.id)
        try:
            self.walk()
        finally:
            self.trying = None
        if gang.id in self.waiting:  # not placed: it waits (journaled then) or is refused
            self.waiting.remove(gang.id)
            del self.gangs[gang.id]
            raise NoFit("it does not fit whole now, or requests before it in the fair order take the room")
        mine = [c for c in self.to_send if c.record.gang == gang.id]
        self.to_send = [c for c in self.to_send if c.record.gang != gang.id]
        return mine

    def place(self, gid: str) -> bool:
        """Place waiting gang ``gid`` whole now if it fits (the room held for it counted): its members' creates
        wait in ``to_send`` for the dispatcher. False if it does not fit."""
        gang, ledger = self.gangs[gid], self.ledger
        member, own = gang.spec.member, self._own_holds(gid)
        try:
            plan = plan_gang(ledger.index, request_for(member, member.memory), gang.spec.replicas,
                             gang.spec.one_per_node, own or None)
        except (NoFit, NoAgents):
            return False
        if self._free_port(self._master_host(plan)) is None:
            return False  # its room is there but not a port on its master's host: it waits on, holding nothing
        if own:
            self._release_holds()  # what was held for it is its now
        self.to_send += self._start(gang, plan)
        if self.trying is not None and self.trying[0] == gid:
            self.waiting.remove(gid)  # a submit's own try: never journaled
        else:
            self._unwait(gang)
        self.making_room.pop(gang.id, None)
        ledger.wake.set()
        return True

    def in_order(self) -> list[str]:
        """The waiting gangs in the order they are tried: highest priority first, then first come."""
        return sorted(self.waiting, key=lambda g: (-self.gangs[g].spec.member.priority,
                                                   self.gangs[g].waiting_mono or 0.0))

    def _hold_for_head(self, now: float) -> None:
        """Hold room for the waiting gang at the head (highest priority, then first come) once it waited
        ``reserve_after`` seconds: on the nodes it fits best, the bytes that free up are its alone."""
        waited = [self.gangs[g] for g in self.waiting if self.gangs[g].waiting_mono is not None
                  and now - (self.gangs[g].waiting_mono or now) >= self.reserve_after]
        if not waited:
            return
        head = max(waited, key=lambda g: (g.spec.member.priority, -(g.waiting_mono or 0.0)))
        member = head.spec.member
        kept = self.hold_plan if self.hold_plan is not None and self.hold_plan[0] == head.id else None
        if kept is None or not all((g := self.ledger.gpus.get(uuid)) is not None and g in self.ledger.index
                                   for uuid, _ in kept[1]):
            # chosen once and kept while the head and its GPUs stay: choosing again at each dispatch moves
            # the held room to wherever happens to be freest, and the gang waits past its bound (§27)
            targets = hold_targets(self.ledger.index, request_for(member, member.memory), head.spec.replicas,
                                   head.spec.one_per_node)
            kept = self.hold_plan = (head.id, [(gpu.uuid, held) for gpu, held in targets])
        for uuid, held in kept[1]:
            self.ledger.hold_for_gang(self.ledger.gpus[uuid], held)
            self.holding[uuid] = head.id

    def _release_holds(self) -> None:
        for uuid in list(self.holding):
            gpu = self.ledger.gpus.get(uuid)
            if gpu is not None:
                self.ledger.hold_for_gang(gpu, 0)
        self.holding.clear()

    def held_for(self, uuid: str) -> int:
        """Bytes of GPU ``uuid`` held for a waiting gang (``memory_reserved_for_gang`` on the map)."""
        gpu = self.ledger.gpus.get(uuid)
        return gpu.gang_hold if gpu is not None else 0

