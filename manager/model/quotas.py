"""Tenants' quotas and accounts' allocations: what each holds and has queued, checked before anything is granted.

Live and queued requests count alike, as Kubernetes counts pending pods against a ResourceQuota;
:meth:`Quotas.within_live` checks a queued request again at placement, against the quota in force
then (SIGHUP may have lowered it). Called under the ledger's lock.

With accounts configured (:mod:`gpumgr.manager.tenancy.accounts`) every live and queued record is also
counted in its leaf account and every account above it: ``allocated`` (live grants) and ``waiting``
(queued), in bytes × GPUs. A record's ``over_quota`` is decided here, once, when it is granted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from gpumgr.manager.clock import SYSTEM, Clock
from gpumgr.manager.model.records import Container, PlacementSpec
from gpumgr.manager.tenancy.accounts import DEFAULT, AccountTree
from gpumgr.manager.tenancy.tenants import Principal, Tenant, TenantBook, Usage
from gpumgr.wire.errors import Conflict, QuotaExceeded
from gpumgr.wire.names import LIVE, State
from gpumgr.wire.units import format_bytes

_QUEUED = State.QUEUED
#: one account on a leaf's path, as the hot path reads it: (name, quota, limit), bytes × GPUs (limit None: no cap)
_Step = tuple[str, int, int | None]


class Quotas:
    """Each tenant's :class:`Usage`, kept in step by the lifecycle's one transition function."""

    def __init__(self, clock: Clock = SYSTEM) -> None:
        self.clock = clock
        #: the tenants in force (set by the manager; None: no tenants)
        self.book: TenantBook | None = None
        self._usage: dict[str, Usage] = {}
        #: the accounts in force (None: none configured, and nothing is counted in accounts)
        self.accounts: AccountTree | None = None
        #: every account's live grants and queued requests, bytes × GPUs (a parent's hold its children's)
        self.allocated: dict[str, int] = {}
        self.waiting: dict[str, int] = {}
        #: the part of ``allocated`` that is over quota (borrowed, reclaimable): it uses no quota
        self.borrowed: dict[str, int] = {}
        #: each account's path, top first, as plain tuples (read on every grant: no lookups by name, no attributes)
        self._paths: Mapping[str, tuple[_Step, ...]] = {}
        #: tenant name → its leaf account (the tree's ``members``)
        self._leaf_of: Mapping[str, str] = {}

    def clear(self) -> None:
        """Forget every tenant's counts (the map starts from nothing; the records that count come back)."""
        self._usage = {}
        self.allocated, self.waiting, self.borrowed = {}, {}, {}

    def set_accounts(self, tree: AccountTree | None, records: list[Container]) -> None:
        """Put ``tree`` in force and count ``records`` (every record on the map) in it again from nothing.

        A live or queued record is moved to the account its tenant has now; ``over_quota`` stays as decided.
        """
        self.accounts = tree
        self._paths = {name: tuple((a.name, a.quota, a.limit) for a in chain)
                       for name, chain in tree.chains.items()} if tree is not None else {}
        self._leaf_of = tree.members if tree is not None else {}
        self.allocated, self.waiting, self.borrowed = {}, {}, {}
        for record in records:
            live = record.state in LIVE
            if not live and record.state is not State.QUEUED:
                continue
            record.account = tree.account_of(record.tenant) if tree is not None else None
            if record.account is not None:
                total = record.gpu_memory * record.count
                self._add(record.account, total if live else 0, 0 if live else total,
                          total if live and record.over_quota else 0)

    def _add(self, account: str, allocated: int, waiting: int, borrowed: int = 0) -> None:
        """Add to ``account`` and every account above it."""
        path = self._paths.get(account)
        if path is None:
            return
        for amount, counts in ((allocated, self.allocated), (waiting, self.waiting), (borrowed, self.borrowed)):
            if amount:
                for name, _, _ in path:
                    counts[name] = counts.get(name, 0) + amount

    def _release(self, account: str, total: int, over_quota: bool) -> None:
        """A live grant of ``total`` in ``account`` ends: :meth:`_add` of ``-total`` live (and borrowed if
        ``over_quota``), in one pass."""
        path = self._paths.get(account)
        if path is None:
            return
        allocated, borrowed = self.allocated, self.borrowed
        for name, _, _ in path:
            allocated[name] = allocated.get(name, 0) - total
        if over_quota:
            for name, _, _ in path:
                borrowed[name] = borrowed.get(name, 0) - total

    def room(self, account: str, memory: int) -> str | None:
        """Whether ``account`` may take ``memory`` more bytes now: None (within every quota on its path),
        ``over_quota`` (it would borrow) or ``limit`` (it would pass a limit on its path).

        A quota is held against what is *not* borrowed: an account's containers that are over quota (and may
        be reclaimed) use no part of any quota on their path, so a team within its own quota is never turned
        away because a sibling borrowed its part; a limit caps everything.
        """
        path = self._paths.get(account)
        if path is None:
            return None
        verdict = None
        allocated, borrowed = self.allocated, self.borrowed
        for name, quota, limit in path:
            held = allocated.get(name, 0) + memory
            if limit is not None and held > limit:
                return "limit"
            if held - borrowed.get(name, 0) > quota:
                verdict = "over_quota"
        return verdict

    def _grant(self, record: Container, total: int) -> None:
        """Count live ``record`` in its account's path, deciding in the same pass whether it is over quota."""
        path = self._paths.get(record.account or "")
        record.granted_mono = self.clock.monotonic()
        if path is None:
            record.over_quota = False
            return
        allocated, borrowed = self.allocated, self.borrowed
        over = False
        for name, quota, _ in path:
            held = allocated.get(name, 0) + total
            if held - borrowed.get(name, 0) > quota:
                over = True
            allocated[name] = held
        record.over_quota = over
        if over:
            for name, _, _ in path:
                borrowed[name] = borrowed.get(name, 0) + total

    def admit(self, record: Container, queue: bool,
              refuse_first: Callable[[PlacementSpec], None] | None = None) -> bool:
        """With accounts: count ``record`` in its tenant's leaf account, or ``409 over_quota`` for a request its
        account may not run now and that will not wait.

        A request past its account's quota runs only if preemptible (it borrows); one past a limit on its
        account's path waits for its account's allocation to fall. Returns whether it goes through the queue.
        Before a ``409 over_quota``, ``refuse_first`` may raise what outranks it (``never_fits``, no agent
        ready): those would make its advice to send ``"queue": true`` and wait wrong.
        """
        tree, total = self.accounts, record.gpu_memory * record.count
        assert tree is not None
        tenant = record.tenant  # tree.account_of, without its call
        record.account = account = self._leaf_of.get(tenant, DEFAULT) if tenant is not None else DEFAULT
        verdict = self.room(account, total)
        if verdict is None or (verdict == "over_quota" and record.preemptible):
            return queue
        if not queue and refuse_first is not None:
            refuse_first(record.spec)
        never = self.never(account, total) if verdict == "limit" else None
        if never is not None:
            raise Conflict(f"account {never}'s limit is {format_bytes(tree[never].limit or 0)}; this asks for "
                           f"{format_bytes(total)} alone: it can never run; nothing was queued", code="over_quota")
        why = (f"account {account} would pass a limit on its path" if verdict == "limit" else
               f"account {account} would pass its quota ({format_bytes(tree[account].quota)}) and the request "
               "is not preemptible: past its quota an account borrows only with preemptible requests")
        if not queue:
            raise Conflict(f"{why}; send \"queue\": true to wait until its allocation falls", code="over_quota")
        return True

    def borrow(self, record: Container) -> None:
        """Live ``record`` borrows from now on (a resize grew it past its quota): it is over quota, reclaimable."""
        if record.account is not None and not record.over_quota:
            record.over_quota = True
            self._add(record.account, 0, 0, record.gpu_memory * record.count)

    def never(self, account: str, memory: int) -> str | None:
        """The account on ``account``'s path whose limit ``memory`` alone passes (it can never run), or None."""
        path = self._paths.get(account, ())
        return next((name for name, _, limit in path if limit is not None and memory > limit), None)

    def count(self, record: Container, sign: int) -> None:
        """``record`` starts (+1) or stops (-1) counting against its tenant, as queued or live by its state."""
        account, tenant = record.account, record.tenant
        if account is None and tenant is None:
            return
        total, queued = record.gpu_memory * record.count, record.state is _QUEUED
        if account is not None:
            if queued:
                self._add(account, 0, sign * total)
            elif sign > 0:  # granted: it borrows if its account passes a quota with it, fixed from now
                self._grant(record, total)
            else:
                self._release(account, total, record.over_quota)
        if tenant is None:
            return
        use = self._usage.get(tenant)
        if use is None:  # not setdefault(tenant, Usage()): that builds a Usage on every call
            use = self._usage[tenant] = Usage()
        change = sign * total
        use.memory += change
        use.containers += sign
        if queued:
            use.queued += sign
            use.queued_memory += change
        else:
            use.advance(self.clock.time())
            use.live_memory += change

    def resized(self, record: Container, delta: int) -> None:
        """``record``'s grant per GPU changes by ``delta`` bytes."""
        if record.account is not None:
            queued, change = record.state is State.QUEUED, delta * record.count
            self._add(record.account, 0 if queued else change, change if queued else 0,
                      change if record.over_quota and not queued else 0)
        if record.tenant is None:
            return
        use = self._usage.setdefault(record.tenant, Usage())
        use.memory += delta * record.count
        if record.state is State.QUEUED:
            use.queued_memory += delta * record.count
        else:
            use.advance(self.clock.time())
            use.live_memory += delta * record.count

    def used(self, record: Container, seconds: float) -> None:
        """Integrate ``record``'s sampled usage over ``seconds`` into its tenant's GiB·hours used."""
        if record.tenant is not None:
            use = self._usage.setdefault(record.tenant, Usage())
            use.used_byte_seconds += sum(record.usage.values()) * max(0.0, seconds)

    def check(self, tenant: Tenant | None, memory: int, containers: int) -> None:
        """QuotaExceeded unless ``tenant`` can take ``memory`` more bytes and ``containers`` more containers."""
        if tenant is None:
            return
        use = self._usage.get(tenant.name) or Usage()
        held, count = use.memory, use.containers
        if tenant.gpu_memory is not None and held + memory > tenant.gpu_memory:
            never = " (more than the whole quota: it can never be granted)" if memory > tenant.gpu_memory else ""
            raise QuotaExceeded(
                f"tenant {tenant.name}'s gpu_memory quota is {format_bytes(tenant.gpu_memory)} "
                f"({tenant.gpu_memory} bytes); {format_bytes(held)} is in use or queued and this asks for "
                f"{format_bytes(memory)} more{never}")
        if tenant.containers is not None and containers and count + containers > tenant.containers:
            raise QuotaExceeded(f"tenant {tenant.name}'s containers quota is {tenant.containers}; {count} are "
                                "live or queued")

    def within_live(self, record: Container) -> bool:
        """Whether placing queued ``record`` keeps its tenant's live grants within the quota now in force."""
        if record.tenant is None or self.book is None:
            return True
        tenant = self.book.get(record.tenant)
        if tenant is None:
            return True
        use = self._usage.get(tenant.name) or Usage()
        memory = record.gpu_memory * record.count
        if tenant.gpu_memory is not None and use.live_memory + memory > tenant.gpu_memory:
            return False
        return tenant.containers is None or use.containers - use.queued + 1 <= tenant.containers

    def tenants(self) -> list[str]:
        """Every tenant that ever counted anything."""
        return list(self._usage)

    def usage_of(self, tenant: str) -> Usage:
        """A copy of what ``tenant`` holds now, its integrals brought up to date."""
        use = self._usage.setdefault(tenant, Usage())
        use.advance(self.clock.time())
        return replace(use)

    def view(self, principal: Principal) -> list[dict[str, Any]]:
        """Each tenant the caller may see: quota, what it holds and has queued, and GiB·hours since start."""
        gib_hour = float(1 << 30) * 3600
        views = []
        for tenant in self.book.all() if self.book is not None else []:
            if not principal.sees(tenant.name):
                continue
            use = self.usage_of(tenant.name)
            views.append({
                "name": tenant.name, "quota": tenant.quota_view(),
                "in_use": {"gpu_memory": use.live_memory, "containers": use.containers - use.queued},
                "queued": {"gpu_memory": use.queued_memory, "requests": use.queued},
                "gpu_memory_gib_hours": {"granted": use.granted_byte_seconds / gib_hour,
                                         "used": use.used_byte_seconds / gib_hour},
            })
        return views



