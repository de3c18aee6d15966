"""The queue's walk with accounts configured: accounts below their fair share first, then reclaim.

Only used when ``accounts:`` are configured; without them :meth:`Dispatch.walk` is the one walk.

**The walk.** Each account's waiting requests keep the queue's order among themselves (priority, aging,
first come). The walk repeatedly takes the head of the account with the lowest allocated/fair share
(:mod:`gpumgr.manager.fairshare.shares`) whose line is not blocked, and tries it:

- a head that would pass a ``limit`` on its account's path, or pass a quota and is not preemptible,
  blocks its own account's line (it waits until its account's allocation falls);
- a head that does not fit blocks its own account's line only; if the account is below its fair share
  it is *owed* room: reclaim is planned for it, and from then on in this walk no other account may
  start borrowing (placing past its quota), so the room reclaim frees goes to the one it was made for;
- inside the one account, priority preemption is planned as without accounts (never across accounts).

**Waiting gangs** (:class:`GangEntry`) are entries of their account's line too, one request of their whole
bytes, placed where the queue's order puts a request of their priority that began waiting when they did
(priority with aging, then first come). At its turn a gang is placed whole if it fits (counting the room
held for it), or blocks its account's line as a single request does when a quota or limit holds it back.
One that does not fit steps aside (backfill: the requests behind it may take room it cannot use yet),
but if its account is below its fair share it is owed room as a single request is, reclaim is planned for
it, and while the victims chosen for it stop, its account's line waits for it, so their room goes to it.
A gang submitted while anything waits takes its turn in such a walk at once (owed nothing if it will not wait).

**Reclaim** (:meth:`FairWalk.plan_reclaim`) compares accounts under their lowest common parent, as KAI
does: for a head in leaf ``R``, a running container ``v`` of leaf ``V`` may be stopped only if it is
``over_quota``, has run its account's ``reclaim_min_runtime``, is not already being stopped, and ``V``'s
side of the split (``V'``) is above its fair share while ``R``'s side (``R'``) is below. A member of a
running gang is stopped only with its whole gang (one member's end ends it): every live member must qualify,
and the rule below weighs all their bytes. Victims are chosen per GPU by the highest allocated/fair share of
``V'`` first, then the lowest priority, then the youngest. The chosen set is kept only if, for every ``V'``
it takes from, Kueue's ``LessThanOrEqualToFinalShare`` holds: ``R'``'s share with the request is at most
``V'``'s after the reclaim (:func:`gpumgr.manager.fairshare.reclaim.allowed`), the rule that cannot loop.
For a waiting gang the request is its whole bytes and the victims are chosen by the same rules on the GPUs
where the gang then fits whole (none if it would not). Reclaim is paused while the zone rule holds (many
nodes silent at once). Called under the ledger's lock.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from gpumgr.manager.fairshare.reclaim import allowed
from gpumgr.manager.fairshare.shares import Shares, compute
from gpumgr.manager.model.lifecycle import Lifecycle
from gpumgr.manager.model.records import Container
from gpumgr.manager.placing.scheduler import GpuSlot, Request, place
from gpumgr.manager.tenancy.accounts import AccountTree
from gpumgr.wire.errors import GpumgrError, NoAgents, NoFit
from gpumgr.wire.names import LIVE, EventType, State

#: How many waiting requests of one owed account a walk plans reclaim for.
RECLAIM_AHEAD = 64


class Walker(Protocol):
    """What the fair walk uses of :class:`~gpumgr.manager.model.walk.dispatch.Dispatch` (which owns it)."""

    life: Lifecycle
    making_room: dict[str, set[str]]

    def may_try(self, record: Container) -> bool: ...
    def request_of(self, record: Container) -> Request: ...
    def placed(self, record: Container, slots: list[GpuSlot], own: str | None) -> None: ...
    def plan_preemption(self, head: Container, same_account: bool = False) -> None: ...
    def may_stop(self, victim: Container, now: float) -> bool: ...
    def cheapest_victims(self, head: Container, eligible: Callable[[Container], bool],
                         order: Callable[[Container], Any]) -> list[Container]: ...


@dataclass(frozen=True)
class GangEntry:
    """A waiting gang as the fair walk sees it: one request of its account, of its whole bytes."""

    id: str
    account: str
    priority: int
    #: since when it waits (monotonic): its place in its account's line
    since: float
    #: its members' bytes × GPUs × replicas
    total: int
    preemptible: bool
    #: False for a gang a submit tries without ``queue``: placed if it fits, never owed room
    waits: bool = True


class GangLine(Protocol):
    """What the fair walk uses of the waiting gangs (:class:`~gpumgr.manager.model.gangs.core.Gangs`)."""

    waiting: list[str]
    making_room: dict[str, set[str]]

    def entries(self) -> list[GangEntry]: ...
    def place(self, gid: str) -> bool: ...
    def plan_preemption(self, gid: str) -> None: ...
    def cheapest_victims(self, gid: str, eligible: Callable[[Container], bool],
                         order: Callable[[Container], Any], pool: list[Container] | None = None) -> list[Container]: ...
    def crew(self, gid: str) -> list[Container]: ...


#: One entry of an account's line: its place in the queue's order, and a queued request or a waiting gang.
Entry = tuple[float, Container | GangEntry]


class FairWalk:
    """The walk and reclaim of :mod:`gpumgr.manager.model.walk.sharing` over one :class:`Dispatch`'s queue."""

    def __init__(self, dispatch: Walker) -> None:
        self.dispatch = dispatch
        self.life = dispatch.life
        self.ledger = dispatch.life.ledger
        #: whether reclaim is paused now (the zone rule holds); set by the cluster
        self.paused: Callable[[], bool] = lambda: False
        #: how many reclaims were planned (each may stop several containers)
        self.reclaims = 0
        #: reclaim's victims still stopping, whichever request of their reclaimer takes their room
        self.moving: set[str] = set()
        #: the waiting gangs' bytes per leaf account (set by the cluster: :meth:`Gangs.waiting_by_account`)
        self.gangs_waiting: Callable[[], dict[str, int]] = dict
        #: the waiting gangs, entries of their accounts' lines (set by the cluster)
        self.gangs: GangLine | None = None

    @property
    def tree(self) -> AccountTree:
        tree = self.life.quotas.accounts
        assert tree is not None
        return tree

    def capacity(self) -> int:
        """What the ready nodes' schedulable GPUs could grant, empty (bytes × GPUs): the root's share."""
        return sum(s.total - s.headroom for slots in self.ledger.index.by_node.values() for s in slots)

    def shares(self) -> Shares:
        """This moment's fair shares, allocations and requests of every account."""
        quotas = self.life.quotas
        waiting: Mapping[str, float] = quotas.waiting
        gangs = self.gangs_waiting()
        if gangs:  # a waiting gang asks for the sum of its members' bytes, as one request
            waiting = {**quotas.waiting, **{a: quotas.waiting.get(a, 0) + b for a, b in gangs.items()}}
        return compute(self.tree, quotas.allocated, waiting, self.capacity())

    def _walk_shares(self) -> Shares:
        """The shares a walk weighs: every reclaim victim still stopping counts as room already moved, from its
        account to the account it was stopped for (whichever of that account's requests then takes it)."""
        shares, tree, records = self.shares(), self.tree, self.ledger.records
        for cid in list(self.moving):
            victim = records.get(cid)
            if victim is None or victim.state not in LIVE or victim.desired is not State.PREEMPTED:
                self.moving.discard(cid)  # stopped (its room is the reclaimer's allocation now), or spared
                continue
            to, size = victim.detail.get("reclaimed_for_account"), victim.gpu_memory * victim.count
            if victim.account in tree and to in tree:
                for name in tree[victim.account or ""].path:
                    shares.allocated[name] = shares.allocated.get(name, 0.0) - size
                for name in tree[str(to)].path:
                    shares.allocated[name] = shares.allocated.get(name, 0.0) + size
        return shares

    def walk(self, own: str | None, own_waits: bool) -> list[Container]:
        """Place queued requests while they fit, accounts below their fair share first; return those placed."""
        dispatch, life, tree = self.dispatch, self.life, self.tree
        records, unwritten, quotas = self.ledger.records, life.unwritten, life.quotas
        lines: dict[str, deque[Entry]] = {}
        for order, cid in enumerate(life.queue.ids()):
            queued = records[cid]
            lines.setdefault(queued.account or "", deque()).append((order, queued))
        if self.gangs is not None and self.gangs.waiting:
            self._line_up_gangs(lines)
        shares = self._walk_shares()
        placed: list[Container] = []
        blocked: set[str] = set()
        owed = False  # an account below its fair share waits for room: nobody else starts borrowing
        while True:
            open_lines = [a for a, line in lines.items() if line and a not in blocked]
            if not open_lines:
                return placed
            account = min(open_lines, key=lambda a: (shares.ratio(a), lines[a][0][0]))
            _, record = lines[account][0]
            if isinstance(record, GangEntry):
                owed = self._gang_turn(record, lines[account], blocked, shares, owed)
                continue
            if (unwritten and record.id in unwritten and record.id != own) or not dispatch.may_try(record):
                lines[account].popleft()  # stepped over: it blocks nobody
                continue
            total = record.gpu_memory * record.count
            verdict = quotas.room(account, total)
            if verdict == "limit" or (verdict == "over_quota" and (owed or not record.preemptible)):
                blocked.add(account)
                continue
            try:
                slots = place(self.ledger.index, dispatch.request_of(record))
            except NoFit:
                blocked.add(account)
                if record.id != own or own_waits:
                    if shares.ratio(account) < 1.0:
                        owed = True
                        self._reclaim_down(account, lines[account], shares)
                    dispatch.plan_preemption(record, same_account=True)
                continue
            except (NoAgents, GpumgrError):
                return placed
            lines[account].popleft()
            dispatch.placed(record, slots, own)
            for name in tree[account].path:
                shares.allocated[name] = shares.allocated.get(name, 0.0) + total
            placed.append(record)

    def _line_up_gangs(self, lines: dict[str, deque[Entry]]) -> None:
        """Put each waiting gang in its account's line, where the queue's order puts a request of its priority
        that began waiting when it did (before the requests that tie with it)."""
        assert self.gangs is not None
        queue = self.life.queue
        for entry in self.gangs.entries():
            line = lines.setdefault(entry.account, deque())
            order = queue.before(entry.priority, entry.since) - 0.5
            line.insert(bisect.bisect_left([o for o, _ in line], order), (order, entry))

    def _gang_turn(self, gang: GangEntry, line: deque[Entry], blocked: set[str], shares: Shares, owed: bool) -> bool:
        """A waiting gang's turn at the head of its account's line (see the module docstring); returns ``owed``."""
        assert self.gangs is not None
        verdict = self.life.quotas.room(gang.account, gang.total)
        if verdict == "limit" or (verdict == "over_quota" and (owed or not gang.preemptible)):
            if gang.waits:  # as a single request: its line waits for its account's allocation to fall
                blocked.add(gang.account)
            else:
                line.popleft()
            return owed
        line.popleft()
        if self.gangs.place(gang.id):
            for name in self.tree[gang.account].path:
                shares.allocated[name] = shares.allocated.get(name, 0.0) + gang.total
            return owed
        if not gang.waits:
            return owed
        if shares.ratio(gang.account) < 1.0:
            owed = True
            if self.plan_reclaim(gang, shares):
                blocked.add(gang.account)  # the room its victims free is its own: nothing behind it takes it
                self._reclaim_down(gang.account, line, shares)
        self.gangs.plan_preemption(gang.id)
        return owed

    def _reclaim_down(self, account: str, line: deque[Entry], shares: Shares) -> None:
        """Reclaim for the head of ``account``'s line, then for the requests behind it while the account stays
        below its fair share (counting those already provided for): one walk moves an account's whole share,
        not one request's room per stop (at most :data:`RECLAIM_AHEAD` requests a walk)."""
        for _, record in itertools.islice(line, RECLAIM_AHEAD):
            if shares.ratio(account) >= 1.0 or not self.plan_reclaim(record, shares):
                return

    def plan_reclaim(self, head: Container | GangEntry, shares: Shares) -> bool:
        """Stop over-quota containers of accounts above their fair share so that ``head`` fits; see the docstring.

        ``head`` is a queued request, or a waiting gang (which must fit whole). True when victims were chosen
        (or are still stopping) for it: ``shares`` then counts ``head`` as placed and the victims as gone, so
        a further call for the next request of the same account weighs the rule against the shares as they
        will be.
        """
        if self.paused() or head.account is None:
            return False
        if isinstance(head, GangEntry):
            assert self.gangs is not None
            making_room, need, what = self.gangs.making_room, head.total, f"waiting gang {head.id}"
        else:
            making_room, need = self.dispatch.making_room, head.gpu_memory * head.count
            what = f"queued request {head.id}"
        if self._being_made(making_room.get(head.id, ())):
            return True
        judge = _Judge(self, head.account, float(need), shares)
        victims = judge.whole(self._victims(head, judge))
        if not self._stop_for(victims, judge, shares):
            return False
        making_room[head.id] = {v.id for v in victims}
        for victim in victims:
            self.life.desire(victim, State.PREEMPTED, "reclaimed", preempted_for=head.id,
                             reclaimed_for_account=head.account)
            self.life.event(EventType.PREEMPTED, f"reclaimed: stopping over-quota container of account "
                            f"{victim.account} to give account {head.account} its fair share (for {what})",
                            victim, preempted_for=head.id, reclaimed_for_account=head.account)
        return True

    def _victims(self, head: Container | GangEntry, judge: _Judge) -> list[Container]:
        """Whom reclaim would stop for ``head``: for a gang, on the GPUs where it then fits whole."""
        if isinstance(head, GangEntry):
            assert self.gangs is not None
            return self.gangs.cheapest_victims(head.id, judge.eligible, judge.order, self._running())
        return self.dispatch.cheapest_victims(head, judge.eligible, judge.order)

    def _running(self) -> list[Container]:
        """The running containers on schedulable GPUs: where reclaim for a gang looks for victims."""
        records, gpus = self.ledger.records, self.ledger.gpus
        ids = {c for slots in self.ledger.index.by_node.values() for s in slots for c in gpus[s.uuid].holders}
        return [records[c] for c in ids if c in records and records[c].state is State.RUNNING]

    def _being_made(self, chosen: Any) -> bool:
        """Whether containers chosen for a request still stop (the walk's shares count them as moved already)."""
        records = self.ledger.records
        return any(v in records and records[v].state in LIVE and records[v].desired is State.PREEMPTED
                   for v in chosen)

    def _stop_for(self, victims: list[Container], judge: _Judge, shares: Shares) -> bool:
        """Whether ``victims``, together, keep Kueue's rule for every side they are taken from; if they do, count
        them as stopped and the request as placed in this walk's ``shares``."""
        if not victims:
            return False
        taken: dict[tuple[str, str], float] = {}
        for victim in victims:
            split = judge.side(victim)
            assert split is not None
            taken[split] = taken.get(split, 0.0) + victim.gpu_memory * victim.count
        if not all(allowed(shares, mine, judge.need, theirs, amount) for (mine, theirs), amount in taken.items()):
            return False  # together they would take the victims' side below the reclaimer's: no loop is started
        self.reclaims += 1
        self.moving.update(v.id for v in victims)
        tree = self.tree
        for name in tree[judge.account].path:
            shares.allocated[name] = shares.allocated.get(name, 0.0) + judge.need
        for victim in victims:
            for name in tree[victim.account or ""].path:
                shares.allocated[name] = shares.allocated.get(name, 0.0) - victim.gpu_memory * victim.count
        return True

    def view(self, visible: list[str] | None) -> list[dict[str, Any]]:
        """Every account (or the ``visible`` ones) with its settings, fair share, allocation, request and waiting."""
        tree, shares = self.tree, self.shares()
        names = list(tree.accounts) if visible is None else [n for n in visible if n in tree]
        return [{**tree[name].view(), "fair_share": round(shares.fair.get(name, 0.0)),
                 "allocated": int(shares.allocated.get(name, 0)), "requested": int(shares.requested.get(name, 0)),
                 "waiting": int(shares.requested.get(name, 0) - shares.allocated.get(name, 0))}
                for name in sorted(names)]


class _Judge:
    """Which running containers reclaim may stop for a request of ``account`` of ``need`` bytes, and in which
    order (see the module docstring)."""

    def __init__(self, walk: FairWalk, account: str, need: float, shares: Shares) -> None:
        self.walk, self.account, self.need, self.shares, self.tree = walk, account, need, shares, walk.tree
        self.now = walk.life.clock.monotonic()
        self.sides: dict[str, tuple[str, str] | None] = {}

    def side(self, victim: Container) -> tuple[str, str] | None:
        """The two sides under the lowest common parent, if the victim's is above its share and the head's below."""
        account = victim.account or ""
        if account not in self.sides:
            split = self.tree.split(self.account, account) if account in self.tree else None
            self.sides[account] = split if split is not None and self.shares.ratio(split[0]) < 1.0 < \
                self.shares.ratio(split[1]) else None
        return self.sides[account]

    def eligible(self, victim: Container) -> bool:
        """Whether reclaim may stop ``victim``: with a gang's member, the whole gang (reclaimed as one)."""
        crew = self.crew(victim)
        if not all(self._alone(member) for member in crew):
            return False
        split = self.side(victim)
        return split is not None and allowed(self.shares, split[0], self.need, split[1],
                                             float(sum(m.gpu_memory * m.count for m in crew)))

    def _alone(self, victim: Container) -> bool:
        """Whether ``victim`` itself may be stopped: over quota, running its minimum runtime, not already stopping."""
        return (victim.over_quota and victim.state is State.RUNNING and victim.desired is State.RUNNING
                and victim.op is None and victim.account != self.account
                and self.walk.dispatch.may_stop(victim, self.now)
                and self.now - victim.granted_mono >= self.tree[victim.account or ""].reclaim_min_runtime)

    def crew(self, victim: Container) -> list[Container]:
        """What stopping ``victim`` stops: itself, or every live member of its gang (one member's end ends it)."""
        gangs = self.walk.gangs
        return (gangs.crew(victim.gang) if victim.gang is not None and gangs is not None else None) or [victim]

    def whole(self, victims: list[Container]) -> list[Container]:
        """``victims`` with the other members of their gangs: a running gang is reclaimed whole, all its bytes."""
        return list({m.id: m for victim in victims for m in self.crew(victim)}.values())

    def order(self, victim: Container) -> tuple[float, int, float]:
        split = self.side(victim)
        return (-self.shares.ratio(split[1]) if split else 0.0, victim.priority, -victim.created_at)
