"""The manager's model, composed: ledger, lifecycle, queue, quotas, reconciliation, resizing and reads.

Every public method takes the ledger's one lock, changes the model only through the lifecycle's
transition function, and returns the :class:`~gpumgr.manager.model.records.Command` s its nodes must be
told; the manager (:mod:`gpumgr.manager.service`) sends them after, and hands each reply back to
:meth:`Cluster.settle`. Nothing here does I/O but the queue journal's appends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from gpumgr.manager.clock import SYSTEM, Clock
from gpumgr.manager.events import EventLog
from gpumgr.manager.model.gangs import Gangs
from gpumgr.manager.model.gangs.calls import GangCalls
from gpumgr.manager.model.ledger import Ledger
from gpumgr.manager.model.lifecycle import ENDED, Lifecycle
from gpumgr.manager.model.queue import QueueJournal, WaitQueue
from gpumgr.manager.model.quotas import Quotas
from gpumgr.manager.model.reconcile import Reconciler
from gpumgr.manager.model.records import Command, Container, Op, OpKind, PlacementSpec, RandomIds
from gpumgr.manager.model.replies import Replies
from gpumgr.manager.model.resize import Resizer
from gpumgr.manager.model.terms import Terms
from gpumgr.manager.model.views import MapReads
from gpumgr.manager.model.walk.dispatch import Dispatch, request_for, take_slots
from gpumgr.manager.placing.scheduler import place
from gpumgr.manager.placing.shares import no_share_room
from gpumgr.manager.tenancy.accounts import AccountTree
from gpumgr.manager.tenancy.tenants import Tenant, TenantBook
from gpumgr.wire import defaults
from gpumgr.wire.errors import (
    NO_AGENTS,
    Conflict,
    NoAgents,
    NoFit,
    NotFound,
    OutcomeUnknown,
    QuotaExceeded,
    StoreUnavailable,
)
from gpumgr.wire.names import CREATING, LIVE, QUEUED, EventType, State
from gpumgr.wire.protocol import ContainerReport, ContainerStatus, GpuInfo, GpuSample, RefusedAdoption
from gpumgr.wire.units import format_bytes

log = logging.getLogger(__name__)

#: Read at every placement: an enum member as a global costs a tenth of ``OpKind.CREATE`` (see wire.names).
_CREATE, _PLACED = OpKind.CREATE, EventType.PLACED


class Cluster(Terms, MapReads, GangCalls):
    """Nodes, GPUs, grants and every record's life; see the module docstring."""

    def __init__(self, events: EventLog | None = None, *, headroom: int = 0,
                 down_after: float = defaults.NODE_DOWN_AFTER, forget_after: float = defaults.NODE_FORGET_AFTER,
                 aging: float = defaults.QUEUE_AGING, state_dir: str | None = None, clock: Clock = SYSTEM) -> None:
        self.events = events or EventLog()
        self.ledger = Ledger(headroom)
        self.lock = self.ledger.lock
        self.wake = self.ledger.wake
        self.quotas = Quotas(clock)
        self.queue = WaitQueue(aging)
        self.journal = QueueJournal(state_dir)
        self.life = Lifecycle(self.ledger, self.quotas, self.events, self.queue, self.journal, clock)
        self.clock = clock
        self.dispatcher = Dispatch(self.life)
        self.reconciler = Reconciler(self.life, down_after=down_after, forget_after=forget_after)
        self.resizer = Resizer(self.life, self.dispatcher, defaults.REMOVE_TIMEOUT)
        self.replies = Replies(self.life, self.dispatcher, self.resizer, self.reconciler)
        self.dispatcher.fair.paused = lambda: self.reconciler.disrupted  # the zone rule pauses reclaim
        self.gangs = Gangs(self.life, self.reconciler.follow_up, lambda: self.new_id(), lambda: self.create_timeout,
                           lambda: self.reconciler.disrupted)
        self.dispatcher.fair.gangs_waiting = self.gangs.waiting_by_account
        self.dispatcher.fair.gangs = self.gangs  # with accounts a waiting gang is an entry of its account's line
        self.gangs.walk = lambda: self._placed_by_walk(self.dispatcher.walk())
        self.gangs.may_stop = self.dispatcher.may_stop
        #: a node answered a command (``reply``), or did not (``error``): the follow-up commands (under the lock)
        self.settle: Callable[..., list[Command]] = self.replies.answer
        self.queue_max = defaults.QUEUE_MAX
        #: how long a node has to answer a create before the manager stops waiting
        self.create_timeout = defaults.CREATE_TIMEOUT
        #: how record ids are drawn (a test replaying a sequence makes them deterministic)
        self.new_id: Callable[[], str] = RandomIds()
        #: creates begun by a walk another request caused, and hook records it placed: the dispatcher sends them
        self._to_send: list[Command] = []
        self._hooks_placed: list[Container] = []

    # --- settings ------------------------------------------------------------------------------
    @property
    def tenants(self) -> TenantBook | None:
        """The tenants in force (None: no tenants)."""
        return self.quotas.book

    @tenants.setter
    def tenants(self, book: TenantBook | None) -> None:
        self.quotas.book = book

    @property
    def accounts(self) -> AccountTree | None:
        """The accounts in force (None: none configured, and the queue is one line as always)."""
        return self.quotas.accounts

    @accounts.setter
    def accounts(self, tree: AccountTree | None) -> None:
        with self.lock:
            self.quotas.set_accounts(tree, list(self.ledger.records.values()))
        self.wake.set()  # new shares may let queued requests go, or owe reclaim

    @property
    def down_after(self) -> float:
        """A node silent this long is marked down."""
        return self.reconciler.down_after

    @down_after.setter
    def down_after(self, seconds: float) -> None:
        self.reconciler.down_after = seconds

    @property
    def forget_after(self) -> float:
        """A node down this long is dropped from the map."""
        return self.reconciler.forget_after

    @forget_after.setter
    def forget_after(self, seconds: float) -> None:
        self.reconciler.forget_after = seconds

    def set_timeouts(self, create: float, remove: float) -> None:
        """How long nodes have to answer a create, and a remove or resize."""
        self.create_timeout = self.dispatcher.bursts.wait_limit = create
        self.reconciler.remove_timeout = self.resizer.timeout = remove

    # --- nodes ---------------------------------------------------------------------------------
    def register(self, name: str, routing_id: bytes, runtime: str, gpus: list[GpuInfo],
                 containers: list[ContainerReport], *, key: str = "", instance: str = "",
                 labels: dict[str, str] | None = None,
                 advertise_addr: str = "", mps: bool = False) -> tuple[list[str], list[Command], bool]:
        """A node registers: ``(orphan grants to remove there, commands, whether its agent restarted)``."""
        with self.lock:
            return self.reconciler.register(name, routing_id, runtime, gpus, containers, key=key, instance=instance,
                                            labels=labels, advertise_addr=advertise_addr, mps=mps)

    def heartbeat(self, name: str, routing_id: bytes, samples: list[GpuSample],
                  containers: list[ContainerStatus]) -> tuple[list[str], list[Command]] | None:
        """A node's heartbeat: ``(orphans, commands)``, or None if it must register again."""
        with self.lock:
            return self.reconciler.heartbeat(name, routing_id, samples, containers)

    def heard(self, name: str, routing_id: bytes) -> None:
        """``name``'s proven key spoke on ``routing_id``: its commands go there from now on (a blip changes it)."""
        node = self.ledger.nodes.get(name)
        if node is not None and node.routing_id != routing_id:
            with self.lock:
                node.routing_id = routing_id

    def forget_node(self, name: str, reason: str = "its node was forgotten") -> bool:
        """Remove a node from the map; its live grants end as ``removed``. False if unknown."""
        with self.lock:
            return self.reconciler.forget_node(name, reason)

    def sweep(self, now: float | None = None) -> tuple[list[str], list[Command]]:
        """Mark silent nodes down, end what missed its deadline: ``(nodes marked down, commands)``.

        ``now`` (monotonic) stands for the clock's reading, to ask what a sweep at another time does.
        """
        with self.lock:
            now = self.clock.monotonic() if now is None else now
            down, commands = self.reconciler.sweep(now), []
            for record in [r for r in self.ledger.records.values() if r.op is not None
                           and now > r.op.deadline + defaults.CREATE_MARGIN]:
                assert record.op is not None  # an answer the link never delivered: settle it as lost
                lost = OutcomeUnknown(f"node {record.node} never answered the {record.op.kind}")
                commands += self.replies.settle(Command(record.op.kind, record, record.op), None, lost)
            return down, commands

    def refuse_adoptions(self, node: str, refused: list[RefusedAdoption]) -> None:
        """Record why a node could not adopt containers that look managed."""
        with self.lock:
            self.reconciler.refuse_adoptions(node, refused)

    def node_key(self, name: str) -> str:
        """The proven key of ``name``'s agent ("" if unknown)."""
        with self.lock:
            node = self.ledger.nodes.get(name)
            return node.key if node is not None else ""

    # --- placing -------------------------------------------------------------------------------
    def submit(self, spec: PlacementSpec, *, queue: bool = False, queue_timeout: float | None = None,
               tenant: Tenant | None = None,
               deadline: float = defaults.HOOK_CONFIRM) -> tuple[Container, list[Command]]:
        """Place ``spec`` now (``creating``, with its create command), or with ``queue`` keep it waiting.

        The tenant's quotas are checked first (403), then whether the request could ever fit a GPU on
        the map (409 ``never_fits``, queue or not). A request is placed now only if it comes first in
        the queue's order among those that fit.
        """
        with self.lock:
            try:
                record = self._submit(spec, queue, queue_timeout, tenant)
            except QuotaExceeded:
                self.life.outcome("quota_exceeded")
                raise
            except NoFit:
                self.life.outcome("no_fit")
                raise
            commands = []
            if record.state is CREATING:
                self.life.outcome("placed")
                op = record.op  # placed at once, its create begun with it; else (a walk placed it, a hook's) now
                commands = [Command(_CREATE, record, op)] if op is not None else self._start_commands((record,),
                                                                                                   deadline)
        if record.id in self.life.unwritten:
            self._write_ahead(record)
        return record, commands

    def _write_ahead(self, record: Container) -> None:
        """Make ``record``'s queue entry durable before the request is accepted; if that fails, nothing of it stays.

        Until written the dispatcher passes it by (:attr:`Lifecycle.unwritten`), so it is never placed, and so
        never run, on the strength of a write that may yet fail.
        """
        try:
            self.journal.sync()
        except Exception as exc:
            with self.lock:
                self.life.unwritten.discard(record.id)
                if record.state is QUEUED:
                    self.life.forget(record)
            if isinstance(exc, OSError):
                raise StoreUnavailable(f"the queue could not be written ({exc}); nothing was kept") from exc
            raise
        with self.lock:
            self.life.unwritten.discard(record.id)
        self.wake.set()

    def _submit(self, spec: PlacementSpec, queue: bool, queue_timeout: float | None,
                tenant: Tenant | None) -> Container:
        if tenant is not None:
            self.quotas.check(tenant, spec.memory * spec.count, 1)
        # the record first, then placing, then the lifecycle: one pass through each (bench/request_path.py)
        record = self._new_record(spec, tenant)
        request = request_for(spec, spec.memory)  # an InvalidRequest here leaves nothing behind
        if self.quotas.accounts is not None:
            queue = self.quotas.admit(record, queue, self.dispatcher.check_placeable)
        if not queue and not len(self.queue) and not self._gangs_in_line():  # the common case: nothing waits
            try:
                slots = place(self.ledger.index, request)
            except NoFit as exc:
                self.dispatcher.check_could_fit(spec)  # never_fits, rather than "no room now", when it never will
                if not self.dispatcher.bursts.holding():
                    raise no_share_room(exc, spec.compute_share) from None
                slots = []  # bursters hold bytes it may need: it waits below while they are reclaimed
            except NoAgents:
                if any(n.ready and any(g.health for g in n.gpus) for n in self.ledger.nodes.values()):
                    # ready nodes, whose every GPU is unhealthy
                    raise NoFit("no GPU takes grants now: every GPU of the ready nodes is unhealthy "
                                "(GET /v1/nodes says why)") from None
                raise
            if slots:
                take_slots(record, slots)
                self.life.place_new(record, None if spec.hook else self.create_timeout)
                return record
        if queue and len(self.queue) >= self.queue_max:
            raise Conflict(f"the queue is full ({self.queue_max} requests wait); try again later", code="queue_full")
        if not queue and not self.ledger.index.by_node:
            raise NoAgents(NO_AGENTS)
        record.state, record.queued_at = State.QUEUED, self.clock.time()
        if queue_timeout is not None:
            record.expires_mono = self.clock.monotonic() + queue_timeout
        self.life.admit(record)
        self._placed_by_walk([r for r in self.dispatcher.walk(own=record.id, own_waits=queue) if r is not record])
        if record.state is State.CREATING:
            return record
        try:
            self.dispatcher.check_could_fit(spec)
        except NoFit:
            self.life.forget(record)
            raise
        position = self.queue.position(record.id) or 1
        if not queue and self.dispatcher.bursts.wait_for(record, self.dispatcher):
            return record  # queued, unjournaled, while bursters are reclaimed for it: its caller waits to place it
        if not queue:
            self.life.forget(record)
            raise no_share_room(NoFit(self.life.why_waiting(spec.memory, spec.count, position - 1)
                                      + "; send \"queue\": true to wait for room"), spec.compute_share)
        if not spec.hook:  # a hook's wait lives in its node's open request, which a restart ends
            self.life.journaled.add(record.id)
            self.life.unwritten.add(record.id)
            try:
                self.journal.add(self.life.journal_entry(record))
            except OSError as exc:  # the state directory's disk is full or read-only: nothing of it stays
                self.life.unwritten.discard(record.id)
                self.life.forget(record)
                raise StoreUnavailable(f"the queue could not be written ({exc}); nothing was kept") from exc
        why = self.life.why_waiting(spec.memory, spec.count, position - 1)
        self.life.event(EventType.QUEUED, f"waits for {format_bytes(spec.memory)} on {spec.count} GPU(s) at position "
                        f"{position} of {len(self.queue)}: {why}", record, position=position)
        return record

    def _new_record(self, spec: PlacementSpec, tenant: Tenant | None) -> Container:
        cid = self.new_id()
        return Container(id=cid, name=spec.name or f"gpumgr-{cid}", node="", gpus=[], gpu_memory=spec.memory,
                         spec=spec, container_id=spec.container_id, created_at=self.clock.time(),
                         tenant=tenant.name if tenant is not None else spec.tenant, priority=spec.priority,
                         preemptible=spec.preemptible)

    def _start_commands(self, placed: Iterable[Container], deadline: float = defaults.HOOK_CONFIRM) -> list[Command]:
        """Begin the create of each placed record; a hook's waits ``deadline`` seconds for its node's report."""
        commands = []
        for record in placed:
            if record.hook:
                record.deadline = self.clock.monotonic() + deadline
                continue
            op = self.life.begin(record, _CREATE, self.create_timeout)
            if op is not None:
                commands.append(Command(_CREATE, record, op))
        return commands

    def dispatch(self) -> tuple[list[Command], list[Container]]:
        """Expire overdue requests, place what fits in queue order: ``(creates to send, hook records placed)``."""
        self.wake.clear()
        with self.lock:
            self.dispatcher.expire()
            if len(self.queue) or self._gangs_in_line():
                self._placed_by_walk(self.dispatcher.walk())
            commands, self._to_send = self._to_send, []
            placed, self._hooks_placed = [r for r in self._hooks_placed if r.state is State.CREATING], []
            commands += [c for r in self._victims() if (c := self.reconciler.follow_up(r)) is not None]
            commands += self.gangs.dispatch()
            if self.journal.needs_compaction(len(self.queue) + len(self.gangs.waiting)):
                self.journal.rewrite([self.life.journal_entry(self.ledger.records[c]) for c in self.queue.ids()]
                                     + self.gangs.journal_entries())
        return commands, placed

    def _gangs_in_line(self) -> bool:
        """With accounts, waiting gangs are in the fair walk's lines: nothing is placed but by a walk."""
        return bool(self.gangs.waiting) and self.quotas.accounts is not None

    def _placed_by_walk(self, placed: list[Container]) -> None:
        """Records a walk placed for others: their creates begin now (under the lock) and are sent by the dispatcher."""
        self._to_send += self._start_commands(placed)
        self._hooks_placed += [r for r in placed if r.hook]
        if placed:
            self.wake.set()

    def _victims(self) -> list[Container]:
        records = self.ledger.records
        return [records[v] for chosen in self.dispatcher.making_room.values() for v in chosen
                if v in records and records[v].desired is State.PREEMPTED and records[v].op is None]

    def restore_queue(self, entries: list[dict[str, Any]]) -> int:
        """Queue again the requests a previous manager process kept in its journal; return how many."""
        with self.lock:
            restored = self.dispatcher.restore([e for e in entries if "gang" not in e])
            gangs = self.gangs.restore([e for e in entries if "gang" in e])
            if gangs:  # the journal is started afresh holding the queue's requests and the waiting gangs
                self.journal.open([self.life.journal_entry(self.ledger.records[c]) for c in self.queue.ids()]
                                  + self.gangs.journal_entries())
            restored += gangs
        if restored:
            self.events.record(EventType.QUEUED, f"{restored} queued request(s) restored after a manager restart")
        return restored

    # --- what nodes answer and report ----------------------------------------------------------
    def current(self, command: Command) -> bool:
        """Whether ``command`` may still be sent (its operation is still the one in flight, in this map)."""
        return self.current_op(command.record.id, command.op)

    def current_op(self, cid: str, op: Op) -> bool:
        """Whether ``op`` is still the operation in flight on record ``cid`` of this map."""
        record = self.ledger.records.get(cid)
        return record is not None and record.op is op

    def finish(self, cid: str, state: State, *, reason: str | None = None, exit_code: int | None = None,
               detail: dict[str, Any] | None = None, finished_at: float | None = None,
               container_id: str | None = None) -> Container:
        """``cid`` ended (its node's report) or must end now; frees its grant if it still held one.

        A container that ends at once may be reported ended before its create's answer arrives: the
        report's ``container_id`` is kept, so its output and record stay reachable.
        """
        with self.lock:
            record = self._get(cid)
            record.container_id = record.container_id or container_id or None
            self.life.move(record, state, reason, exit_code=exit_code, detail=detail, finished_at=finished_at)
            return record

    def started(self, cid: str, report: ContainerReport) -> Container:
        """Its node reports ``cid`` running (a hook grant's container started); see :meth:`follow_ups`."""
        with self.lock:
            record = self._get(cid)
            record.container_id = report.container_id
            if record.state is State.CREATING:
                self.life.move(record, State.RUNNING)
                if record.op is not None and record.op.kind is OpKind.CREATE:
                    self.life.end_op(record, record.op)
            return record

    def follow_ups(self, cid: str) -> list[Command]:
        """What must be sent now to move ``cid`` toward its desired state (a DELETE that waited, say)."""
        with self.lock:
            record = self.ledger.records.get(cid)
            follow = self.reconciler.follow_up(record) if record is not None else None
            return [follow] if follow is not None else []

    def reserve(self, spec: PlacementSpec, *, tenant: Tenant | None = None,
                deadline: float = defaults.HOOK_CONFIRM) -> Container:
        """Place ``spec`` now or raise (no queue); the create command is the caller's to send."""
        return self.submit(spec, tenant=tenant, deadline=deadline)[0]

    def fail(self, cid: str, reason: str) -> Container:
        """``cid`` could not be created: it ends ``failed`` and its grant is freed."""
        with self.lock:
            self.life.outcome("failed")
            record = self._get(cid)
            self.life.move(record, State.FAILED, reason)
            return record

    def overrun(self, cid: str, detail: dict[str, Any]) -> Container:
        """An agent found ``cid`` over its grant and says what it does about it (the grant stays until it exits)."""
        with self.lock:
            record = self._get(cid)
            record.detail["overrun"] = detail
            action = str(detail.get("action", "report"))
            what = {"kill": "killing it", "stop": "stopping it"}.get(action, "reported only")
            if detail.get("kill_failed"):
                what = f"the {action} failed ({detail['kill_failed']}); retrying"
            self.life.event(EventType.OVERRUN, f"{detail.get('reason')}: {detail.get('observed')} bytes on "
                            f"{detail.get('gpu')} over a grant of {detail.get('grant_bytes')}: {what}", record,
                            **{k: v for k, v in detail.items() if k not in ("tenant", "final")})
            return record

    def note_peak(self, cid: str, report: ContainerStatus) -> None:
        """Keep the highest usage its node has sampled (the sample that killed it included)."""
        with self.lock:
            record = self.ledger.records.get(cid)
            if record is not None:
                record.gpu_memory_peak = max(record.gpu_memory_peak, report.peak, sum(report.usage.values()))

    # --- the API's changes ---------------------------------------------------------------------
    def request_removal(self, cid: str, intent: dict[str, Any] | None = None) -> tuple[Container, list[Command]]:
        """``DELETE``: withdraw a queued request, or make ``removed`` the desired state and act when possible.

        The commands hold the removal to send now; none when it must wait (an operation in flight, its
        node down, its container not created yet): it is carried out when that ends. ``intent`` is what the
        caller wrote to the store first (:meth:`removal_intent`).
        """
        with self.lock:
            record = self._get(cid)
            if intent is not None:
                self.life.intents.written({cid: intent})
            if record.state is State.QUEUED:
                self.life.move(record, State.REMOVED, "withdrawn from the queue before it was placed")
                return record, []
            if record.state in ENDED:
                return record, self._remove_ended(record)
            if record.gang is not None and record.gang in self.gangs.gangs:  # a member's DELETE ends its gang
                self.gangs.remove(record.gang)
                return record, [c for m in self.gangs.gangs[record.gang].members
                                if (r := self.ledger.records.get(m)) is not None and r.state in LIVE
                                and (c := self.reconciler.follow_up(r)) is not None]
            self.life.desire(record, State.REMOVED, "removed on request")
            follow = self.reconciler.follow_up(record)
            return record, [follow] if follow is not None else []

    def _remove_ended(self, record: Container) -> list[Command]:
        """An ended record's DELETE: its stopped container (with its logs and name) is removed from the engine
        first, and the record says removed once its node confirms; one with no container is removed at once."""
        if not record.container_id or record.state is State.REMOVED:
            self.life.move(record, State.REMOVED)
            return []
        op = self.life.begin(record, OpKind.REMOVE, self.reconciler.remove_timeout)
        return [Command(OpKind.REMOVE, record, op)] if op is not None else []

    def withdraw(self, cid: str) -> Container:
        """Take a queued request out of the queue: it ends as ``removed``."""
        with self.lock:
            record = self._get(cid)
            self.life.move(record, State.REMOVED, "withdrawn from the queue before it was placed")
            return record

    def begin_resize(self, cid: str, memory: int | None, *, force: bool = False, tenant: Tenant | None = None,
                     limit: int | None = None) -> tuple[Container, Command | None]:
        """Check and start a resize of ``cid`` to ``memory`` per GPU (None: kept) and its limit to ``limit``
        (None: kept): ``(record, command for its node)``."""
        with self.lock:
            record = self._get(cid)
            memory = record.gpu_memory if memory is None else memory
            return record, self.resizer.begin(record, memory, force=force, tenant=tenant, limit=limit)

    def _get(self, cid: str) -> Container:
        record = self.ledger.records.get(cid)
        if record is None:
            raise NotFound(f"no container with id {cid!r}")
        return record
