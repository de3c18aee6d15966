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

**Reclaim** (:meth:`FairWalk.plan_reclaim`) compares accounts under their lowest common parent, as KAI
does: for a head in leaf ``R``, a running container ``v`` of leaf ``V`` may be stopped only if it is
``over_quota``, has run its account's ``reclaim_min_runtime``, is not already being stopped, and ``V``'s
side of the split (``V'``) is above its fair share while ``R``'s side (``R'``) is below. Victims are
chosen per GPU by the highest allocated/fair share of ``V'`` first, then the lowest priority, then the
youngest. The chosen set is kept only if, for every ``V'`` it takes from, Kueue's
``LessThanOrEqualToFinalShare`` holds: ``R'``'s share with the request is at most ``V'``'s after the
reclaim (:func:`gpumgr.manager.fairshare.reclaim.allowed`), the rule that cannot loop. Reclaim is paused
while the zone rule holds (many nodes silent at once). Called under the ledger's lock.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Mapping
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
        lines: dict[str, deque[tuple[int, Container]]] = {}
        for order, cid in enumerate(life.queue.ids()):
            record = records[cid]
            lines.setdefault(record.account or "", deque()).append((order, record))
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

    def _reclaim_down(self, account: str, line: deque[tuple[int, Container]], shares: Shares) -> None:
        """Reclaim for the head of ``account``'s line, then for the requests behind it while the account stays
        below its fair share (counting those already provided for): one walk moves an account's whole share,
        not one request's room per stop (at most :data:`RECLAIM_AHEAD` requests a walk)."""
        for _, record in itertools.islice(line, RECLAIM_AHEAD):
            if shares.ratio(account) >= 1.0 or not self.plan_reclaim(record, shares):
                return

    def plan_reclaim(self, head: Container, shares: Shares) -> bool:
        """Stop over-quota containers of accounts above their fair share so that ``head`` fits; see the docstring.

        True when victims were chosen (or are still stopping) for it: ``shares`` then counts ``head`` as placed
        and the victims as gone, so a further call for the next request of the same account weighs the rule
        against the shares as they will be.
        """
        if self.paused() or head.account is None:
            return False
        dispatch = self.dispatch
        if self._being_made(head, shares):
            return True
        judge = _Judge(self, head, shares)
        return self._stop_for(head, dispatch.cheapest_victims(head, judge.eligible, judge.order), judge, shares)

    def _being_made(self, head: Container, shares: Shares) -> bool:
        """Whether containers chosen for ``head`` still stop (the walk's shares count them as moved already)."""
        records = self.ledger.records
        return any(v in records and records[v].state in LIVE and records[v].desired is State.PREEMPTED
                   for v in self.dispatch.making_room.get(head.id, ()))

    def _stop_for(self, head: Container, victims: list[Container], judge: _Judge, shares: Shares) -> bool:
        """Stop ``victims`` for ``head`` if, together, they keep Kueue's rule for every side they are taken from."""
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
        self.dispatch.making_room[head.id] = {v.id for v in victims}
        self.moving.update(v.id for v in victims)
        for victim in victims:
            self.life.desire(victim, State.PREEMPTED, "reclaimed", preempted_for=head.id,
                             reclaimed_for_account=head.account)
            self.life.event(EventType.PREEMPTED, f"reclaimed: stopping over-quota container of account "
                            f"{victim.account} to give account {head.account} its fair share (for queued request "
                            f"{head.id})", victim, preempted_for=head.id, reclaimed_for_account=head.account)
        self._count_as_done(head, victims, shares)
        return True

    def _count_as_done(self, head: Container, victims: list[Container], shares: Shares) -> None:
        """Count ``head`` as placed and ``victims`` as stopped in this walk's ``shares``."""
        tree = self.tree
        for name in tree[head.account or ""].path:
            shares.allocated[name] = shares.allocated.get(name, 0.0) + head.gpu_memory * head.count
        for victim in victims:
            for name in tree[victim.account or ""].path:
                shares.allocated[name] = shares.allocated.get(name, 0.0) - victim.gpu_memory * victim.count

    def view(self, visible: list[str] | None) -> list[dict[str, Any]]:
        """Every account (or the ``visible`` ones) with its settings, fair share, allocation, request and waiting."""
        tree, shares = self.tree, self.shares()
        names = list(tree.accounts) if visible is None else [n for n in visible if n in tree]
        return [{**tree[name].view(), "fair_share": round(shares.fair.get(name, 0.0)),
                 "allocated": int(shares.allocated.get(name, 0)), "requested": int(shares.requested.get(name, 0)),
                 "waiting": int(shares.requested.get(name, 0) - shares.allocated.get(name, 0))}
                for name in sorted(names)]


class _Judge:
    """Which running containers reclaim may stop for ``head``, and in which order (see the module docstring)."""

    def __init__(self, walk: FairWalk, head: Container, shares: Shares) -> None:
        self.walk, self.head, self.shares, self.tree = walk, head, shares, walk.tree
        self.need = float(head.gpu_memory * head.count)
        self.now = walk.life.clock.monotonic()
        self.sides: dict[str, tuple[str, str] | None] = {}

    def side(self, victim: Container) -> tuple[str, str] | None:
        """The two sides under the lowest common parent, if the victim's is above its share and the head's below."""
        account = victim.account or ""
        if account not in self.sides:
            split = self.tree.split(self.head.account or "", account) if account in self.tree else None
            self.sides[account] = split if split is not None and self.shares.ratio(split[0]) < 1.0 < \
                self.shares.ratio(split[1]) else None
        return self.sides[account]

    def eligible(self, victim: Container) -> bool:
        if not (victim.over_quota and victim.state is State.RUNNING and victim.desired is State.RUNNING
                and victim.op is None and victim.account != self.head.account
                and self.walk.dispatch.may_stop(victim, self.now)):
            return False
        if self.now - victim.granted_mono < self.tree[victim.account or ""].reclaim_min_runtime:
            return False
        split = self.side(victim)
        return split is not None and allowed(self.shares, split[0], self.need, split[1],
                                             float(victim.gpu_memory * victim.count))

    def order(self, victim: Container) -> tuple[float, int, float]:
        split = self.side(victim)
        return (-self.shares.ratio(split[1]) if split else 0.0, victim.priority, -victim.created_at)
