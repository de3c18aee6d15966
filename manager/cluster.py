"""The manager's in-memory truth: nodes × GPUs × memory, and the containers holding grants.

One lock guards everything here and nothing here does I/O, so every method is short and can be
called from the REST threads and the link thread alike. A *grant* is the memory a container in
state ``creating`` or ``running`` holds on each of its GPUs; it is recorded before any agent is
told, so two requests can never be handed the same bytes.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from dataclasses import asdict, replace
from typing import Any

from sortedcontainers import SortedList

from gpumgr.manager.events import EventLog
from gpumgr.manager.queue import QueueJournal, WaitQueue
from gpumgr.manager.records import Container, Gpu, MetricsSnapshot, Node, PlacementSpec
from gpumgr.manager.scheduler import FreeIndex, Placement, Request, place
from gpumgr.manager.tenants import Principal, Tenant, TenantBook, Usage
from gpumgr.manager.views import container_view, node_view
from gpumgr.wire import defaults
from gpumgr.wire.errors import Conflict, GpuConflict, GpumgrError, NoAgents, NoFit, NotFound, QuotaExceeded
from gpumgr.wire.names import LIVE, REMOVING, EventType, State
from gpumgr.wire.protocol import ContainerReport, ContainerStatus, GpuInfo, GpuSample, RefusedAdoption
from gpumgr.wire.units import format_bytes

log = logging.getLogger(__name__)



class Cluster:
    """Nodes, GPUs and grants; see the module docstring for the rules."""

    def __init__(self, events: EventLog | None = None, *, headroom: int = 0,
                 down_after: float = defaults.NODE_DOWN_AFTER,
                 forget_after: float = defaults.NODE_FORGET_AFTER, aging: float = defaults.QUEUE_AGING,
                 state_dir: str | None = None) -> None:
        self.events = events or EventLog()
        self.headroom = headroom
        self.down_after = down_after
        #: a node down this long is dropped from the map (its binding stays: it may come back)
        self.forget_after = forget_after
        self._lock = threading.RLock()
        self._index = FreeIndex()
        self._nodes: dict[str, Node] = {}
        self._gpus: dict[str, Gpu] = {}
        self._containers: dict[str, Container] = {}
        self._finished: deque[str] = deque()
        self.map_max_age = defaults.MAP_MAX_AGE
        self._map_version = 0
        self._map_cache: tuple[int, float, bytes] | None = None
        #: the tenants in force (set by the manager; None: no tenants)
        self.tenants: TenantBook | None = None
        self.queue = WaitQueue(aging)
        self.queue_max = defaults.QUEUE_MAX
        self.journal = QueueJournal(state_dir)
        self._journaled: set[str] = set()
        self._expiries: SortedList = SortedList()
        self._usage: dict[str, Usage] = {}
        #: a grant placed from the queue is released unless confirmed within this many seconds
        self.create_deadline = defaults.CREATE_TIMEOUT + defaults.CREATE_MARGIN
        #: set whenever room may have freed or the queue changed: the dispatcher wakes on it
        self.wake = threading.Event()
        self._to_start: list[Container] = []
        self._to_preempt: list[Container] = []
        #: live preemptible grants: preemption is only planned while there are some
        self._preemptible: set[str] = set()
        #: what ``GET /metrics`` counts: kills for overrun per node, placement requests per outcome
        self._overrun_kills: dict[str, int] = {}
        self._outcomes: dict[str, int] = {}

    # --- nodes -------------------------------------------------------------------------------
    def register(self, name: str, routing_id: bytes, runtime: str, gpus: list[GpuInfo],
                 containers: list[ContainerReport]) -> list[str]:
        """Add or refresh a node with its GPUs and adopt its containers; return grants to remove there.

        Raises GpuConflict, changing nothing, if another live node holds one of the GPUs: two agents
        reading the same NVML devices would otherwise corrupt the free-memory index and overbook.
        """
        with self._lock:
            self._check_gpus_free(name, gpus)
            node = self._nodes.get(name)
            restarted = node is not None and node.routing_id != routing_id
            if node is not None:
                self._set_ready(node, False, quiet=True)
            node = Node(name, routing_id, runtime, [self._gpu_for(name, info) for info in gpus])
            self._nodes[name] = node
            self._set_ready(node, True)
            self._extend_deadlines(name)
            removals = self._reconcile(node, containers, whole=True)
            if restarted:  # a new agent process: creates the old one had not begun are lost with it
                reported = {c.grant for c in containers}
                for record in [c for c in self._containers.values() if c.node == name and c.state is State.CREATING
                               and not c.hook and c.id not in reported]:
                    self._finish(record, State.FAILED, "its node's agent restarted before creating the container",
                                 None, {})
            return removals

    def heartbeat(self, name: str, routing_id: bytes, samples: list[GpuSample],
                  containers: list[ContainerStatus]) -> list[str] | None:
        """Take one heartbeat; return grants to remove on that node, or None if it must register again.

        A heartbeat carries grant ids and figures only; a grant the map does not know (the node's
        state changed behind our back) needs the node's whole report, so it is asked to register.
        """
        with self._lock:
            node = self._nodes.get(name)
            if node is None:
                return None
            if not node.ready:
                try:  # back from down: another node may have taken its GPUs meanwhile
                    self._check_gpus_free(name, [GpuInfo(uuid=g.uuid, index=g.index, name=g.name,
                                                         memory_total=g.total) for g in node.gpus])
                except GpuConflict:
                    return None  # its registration is refused with the reason
                if any(self._gpus.get(g.uuid) is not g for g in node.gpus):
                    return None  # a GPU record was replaced under it: rebuild from a registration
            node.routing_id, node.last_seen, node.last_seen_mono = routing_id, time.time(), time.monotonic()
            if not node.ready:
                self._set_ready(node, True)
                self._extend_deadlines(name)
            for sample in samples:
                gpu = self._gpus.get(sample.uuid)
                if gpu is not None and gpu.node == name:
                    before = gpu.free
                    gpu.used, gpu.unmanaged = sample.memory_used, sample.memory_unmanaged
                    self._index.update(gpu)
                    if gpu.free > before and self.queue:
                        self.wake.set()
            if any(s.grant not in self._containers and s.state in LIVE for s in containers):
                return None  # a live grant we do not know: adopt it from the whole report
            # an ended one we do not know was forgotten under the finished-record cap: it stays forgotten
            return self._reconcile(node, containers)

    def forget_node(self, name: str, reason: str = "its node was forgotten") -> bool:
        """Remove a node that is down from the map; its live grants end as ``removed``. False if unknown."""
        with self._lock:
            node = self._nodes.get(name)
            if node is None:
                return False
            self._set_ready(node, False, quiet=True)
            for record in [c for c in self._containers.values() if c.node == name and c.state in LIVE]:
                self._finish(record, State.REMOVED, reason, None, {})
            for gpu in node.gpus:
                if self._gpus.get(gpu.uuid) is gpu:
                    del self._gpus[gpu.uuid]
            del self._nodes[name]
            self._map_version += 1
        self.events.record(EventType.NODE_DOWN, f"node {name} was forgotten", node=name)
        return True

    def sweep(self, now: float | None = None) -> list[str]:
        """Mark silent nodes down, forget long-gone ones, release unconfirmed grants; return the nodes marked down."""
        now = time.monotonic() if now is None else now
        with self._lock:
            stale = [n for n in self._nodes.values() if n.ready and now - n.last_seen_mono > self.down_after]
            for node in stale:
                self._set_ready(node, False)
            for record in [c for c in self._containers.values() if c.state is State.CREATING]:
                holder = self._nodes.get(record.node)
                if holder is not None and not holder.ready:
                    continue  # its node cannot confirm it now; its deadline restarts when the node returns
                if record.deadline is not None and now > record.deadline:
                    self._finish(record, State.FAILED, "never confirmed by its node in time: grant released",
                                 None, {})
            gone = [n.name for n in self._nodes.values() if not n.ready and now - n.last_seen_mono > self.forget_after]
        for name in gone:
            log.info("forgetting node %s: down for over %gs", name, self.forget_after)
            self.forget_node(name, reason=f"its node was down for over {self.forget_after:g}s")
        return [n.name for n in stale]

    def routing_id(self, name: str) -> bytes:
        """Where the link reaches ``name``'s agent."""
        with self._lock:
            return self._nodes[name].routing_id

    def routing_id_of(self, name: str) -> bytes | None:
        """Where the link reached ``name``'s agent last, or None if ``name`` is not on the map."""
        with self._lock:
            node = self._nodes.get(name)
            return node.routing_id if node is not None else None

    def node_ready(self, name: str) -> bool:
        """Whether ``name`` is registered and heartbeating."""
        with self._lock:
            node = self._nodes.get(name)
            return node is not None and node.ready

    # --- grants ------------------------------------------------------------------------------
    def reserve(self, spec: PlacementSpec, deadline: float = defaults.CREATE_TIMEOUT) -> Container:
        """Choose GPUs for ``spec`` and grant the memory at once; the record starts as ``creating``.

        Unless its container is confirmed within ``deadline`` seconds (the REST create's reply, or the
        node's report of a hook-granted container), the grant is released by :meth:`sweep`. Requests
        queued for room go first: see :meth:`submit`.
        """
        return self.submit(spec, deadline=deadline)

    def submit(self, spec: PlacementSpec, *, deadline: float = defaults.CREATE_TIMEOUT, queue: bool = False,
               queue_timeout: float | None = None, tenant: Tenant | None = None) -> Container:
        """Place ``spec`` now (state ``creating``), or with ``queue`` keep it waiting for room (state ``queued``).

        The tenant's quotas are checked first (QuotaExceeded, 403), then whether the request could ever
        fit a GPU (NoFit at once, queue or not). A request is placed now only if it comes first in the
        queue's order among those that fit: room freed for a waiting request of higher (effective)
        priority is not taken by a newcomer, queued or not.
        """
        with self._lock:
            try:
                record = self._submit(spec, deadline, queue, queue_timeout, tenant)
            except QuotaExceeded:
                self._outcome("quota_exceeded")
                raise
            except NoFit:
                self._outcome("no_fit")
                raise
            if record.state is State.CREATING:
                self._outcome("placed")
        if record.state is State.QUEUED:
            self.journal.sync()
        return record

    def _submit(self, spec: PlacementSpec, deadline: float, queue: bool, queue_timeout: float | None,
                tenant: Tenant | None) -> Container:
        """The body of :meth:`submit`, under the map's lock."""
        self._check_quota(tenant, spec.memory * spec.count, 1)
        if not queue and not self.queue:  # the common case: nothing waits, place as always
            record = self._new_record(spec, tenant, deadline)
            slots = place(self._index, Request(spec.memory, spec.count, spec.node, Placement(spec.placement)))
            self._assign(record, slots, deadline)
            self._containers[record.id] = record
            self._count(record, 1)
            self._grant(record)
            self._event(EventType.PLACED, f"{format_bytes(spec.memory)} on {', '.join(record.gpus)}", record)
            return record
        if queue and len(self.queue) >= self.queue_max:
            raise Conflict(f"the queue is full ({self.queue_max} requests wait); try again later",
                           code="queue_full")
        if not queue and not self._index.by_node:
            raise NoAgents("no agent is ready to take containers; start one with 'gpumgr agent'")
        record = self._new_record(spec, tenant, deadline)
        record.state, record.spec, record.node, record.deadline = State.QUEUED, spec, "", None
        record.queued_at = time.time()
        if queue_timeout is not None:
            record.expires_at = record.queued_at + queue_timeout
        self._containers[record.id] = record
        self._enqueue(record)
        self._walk(own=record.id, own_deadline=deadline, own_waits=queue)
        if record.state is State.CREATING:
            return record
        try:  # after the walk: a request placed at once needs no such check (it costs a pass over the GPUs)
            self._check_could_fit(spec)
        except NoFit:
            self._drop_unplaced(record)
            raise
        if not queue:
            ahead = (self.queue.position(record.id) or 1) - 1
            self._drop_unplaced(record)
            raise NoFit(self._why_waiting(spec, ahead) + "; send \"queue\": true to wait for room")
        if not spec.hook:  # a hook's wait lives in its node's open request, which a restart ends
            self._journaled.add(record.id)
            self.journal.add(self._journal_entry(record))
        position = self.queue.position(record.id)
        self._event(EventType.QUEUED, f"waits for {format_bytes(spec.memory)} on {spec.count} GPU(s) at "
                    f"position {position} of {len(self.queue)}: {self._why_waiting(spec, (position or 1) - 1)}",
                    record, position=position)
        return record

    def started(self, cid: str, report: ContainerReport) -> Container:
        """The agent created and started ``cid``."""
        with self._lock:
            record = self._get(cid)
            record.container_id = report.container_id
            if record.state is not State.CREATING:
                return record
            record.state, record.deadline = State.RUNNING, None
        self._event(EventType.STARTED, f"container {report.container_id[:12]} running", record)
        return record

    def live_grant_of(self, node: str, container_id: str) -> Container | None:
        """The live record already granted to ``container_id`` on ``node`` (a repeated create), if any."""
        with self._lock:
            for gpu in self._node_gpus(node):
                for cid in gpu.holders:
                    record = self._containers[cid]
                    if record.container_id == container_id:
                        return record
        return None

    def note_peak(self, cid: str, report: ContainerStatus) -> None:
        """Keep the highest usage its node has sampled (the sample that killed it included)."""
        with self._lock:
            record = self._containers.get(cid)
            if record is not None:
                record.gpu_memory_peak = max(record.gpu_memory_peak, report.peak, sum(report.usage.values()))

    def queued_for(self, node: str, container_id: str) -> Container | None:
        """The queued hook request of ``container_id`` on ``node`` (the hook asked again while it waits), if any."""
        with self._lock:
            for cid in self.queue.ids():
                record = self._containers[cid]
                if record.hook and record.container_id == container_id and record.spec is not None \
                        and record.spec.node == node:
                    return record
        return None

    def finish(self, cid: str, state: State, *, reason: str | None = None, exit_code: int | None = None,
               detail: dict[str, Any] | None = None, finished_at: float | None = None) -> Container:
        """Move ``cid`` to a final state and free its grant if it still held one."""
        with self._lock:
            record = self._get(cid)
            self._finish(record, state, reason, exit_code, detail or {}, finished_at=finished_at)
            return record

    def overrun(self, cid: str, detail: dict[str, Any]) -> Container:
        """An agent found ``cid`` over its grant and says what it does about it.

        The grant stays until the engine confirms the container's exit (the agent's exit report, or a
        heartbeat without it): a container still dying keeps its bytes, so nobody else is given them.
        """
        with self._lock:
            record = self._get(cid)
            record.detail["overrun"] = detail
        action = str(detail.get("action", "report"))
        what = {"kill": "killing it", "stop": "stopping it"}.get(action, "reported only")
        if detail.get("kill_failed"):
            what = f"the {action} failed ({detail['kill_failed']}); retrying"
        self._event(EventType.OVERRUN, f"{detail.get('reason')}: {detail.get('observed')} bytes on "
                    f"{detail.get('gpu')} over a grant of {detail.get('grant_bytes')}: {what}", record,
                    **{k: v for k, v in detail.items() if k not in _EVENT_KEYS})
        return record

    def request_removal(self, cid: str, why: str = "its node is down: done when it returns") -> Container:
        """``DELETE`` that cannot be done now (node down, container still being created): remember it.

        The grant stays: the container may exist or be about to. It is removed when its node reports
        it (or the create returns), and the grant ends when the node reports it gone.
        """
        with self._lock:
            record = self._get(cid)
            record.remove_requested = True
        self._event(EventType.REMOVED, f"removal requested while {why}", record, pending=True)
        return record

    def fail(self, cid: str, reason: str) -> Container:
        """Creation failed: free the grant and keep the reason."""
        with self._lock:
            self._outcome("failed")
            return self.finish(cid, State.FAILED, reason=reason)

    def metrics_snapshot(self) -> MetricsSnapshot:
        """The map as plain tuples for one ``/metrics`` scrape (the families are built after the lock)."""
        snap = MetricsSnapshot()
        with self._lock:
            for node in self._nodes.values():
                snap.nodes.append((node.name, node.ready))
                for gpu in node.gpus:
                    snap.gpus.append((node.name, gpu.uuid, gpu.index, gpu.name, gpu.total, gpu.used, gpu.reserved,
                                      gpu.unmanaged, gpu.free))
                    for cid in gpu.holders:
                        record = self._containers[cid]
                        snap.containers.append((node.name, gpu.uuid, cid, record.name, record.tenant or "",
                                                record.gpu_memory, record.usage.get(gpu.uuid, 0)))
            snap.overrun_kills = dict(self._overrun_kills)
            snap.outcomes = dict(self._outcomes)
            for cid in self.queue.ids():
                tenant = self._containers[cid].tenant or ""
                snap.queued[tenant] = snap.queued.get(tenant, 0) + 1
            for configured in self.tenants.all() if self.tenants is not None else []:
                snap.queued.setdefault(configured.name, 0)
        return snap

    def _outcome(self, outcome: str) -> None:
        self._outcomes[outcome] = self._outcomes.get(outcome, 0) + 1

    # --- the queue ---------------------------------------------------------------------------
    def dispatch(self) -> tuple[list[Container], list[Container]]:
        """Expire overdue requests, place what fits in queue order; return ``(to start, to preempt)``.

        Called by the manager's dispatcher whenever :attr:`wake` is set (room may have freed) and on a
        short tick. The records to start were granted here (state ``creating``); the manager has their
        nodes start them. The records to preempt were chosen to make room for the queue's head.
        """
        self.wake.clear()
        with self._lock:
            self._expire(time.time())
            if self.queue:
                self._walk()
            started, self._to_start = self._to_start, []
            victims, self._to_preempt = self._to_preempt, []
            if self.journal.needs_compaction(len(self.queue)):
                self.journal.rewrite([self._journal_entry(self._containers[c]) for c in self.queue.ids()])
        return started, victims

    def withdraw(self, cid: str) -> Container:
        """Take a queued request out of the queue: it ends as ``removed``."""
        with self._lock:
            record = self._get(cid)
            if record.state is not State.QUEUED:
                return record
            self._end_queued(record, State.REMOVED, "withdrawn from the queue before it was placed")
            return record

    def restore_queue(self, entries: list[dict[str, Any]]) -> int:
        """Queue again the requests a previous manager process kept in its journal; return how many."""
        restored = 0
        with self._lock:
            for entry in entries:
                try:
                    spec = PlacementSpec(**entry["spec"])
                    record = Container(
                        id=str(entry["id"]), name=str(entry["name"]), node="", gpus=[], gpu_memory=spec.memory,
                        image=spec.image, command=list(spec.command), env=dict(spec.env), labels=dict(spec.labels),
                        on_overrun=spec.on_overrun, state=State.QUEUED, created_at=float(entry["created_at"]),
                        tenant=entry.get("tenant"), priority=int(entry.get("priority", 0)),
                        preemptible=bool(entry.get("preemptible")), spec=spec, queued_at=float(entry["queued_at"]),
                        queue_seq=int(entry.get("seq", 0)), expires_at=entry.get("expires_at"),
                    )
                except (KeyError, TypeError, ValueError) as exc:
                    log.warning("queue journal entry skipped: %s", exc)
                    continue
                if record.id in self._containers:
                    continue
                self._containers[record.id] = record
                self._enqueue(record, seq=record.queue_seq or None)
                self._journaled.add(record.id)
                restored += 1
            self.journal.open([self._journal_entry(self._containers[c]) for c in self.queue.ids()])
        if restored:
            self.events.record(EventType.QUEUED, f"{restored} queued request(s) restored after a manager restart")
            self.wake.set()
        return restored

    def _walk(self, own: str | None = None, own_deadline: float = defaults.CREATE_TIMEOUT,
              own_waits: bool = True) -> None:
        """Place queued requests in order while they fit; stop at the first that does not (it waits whole).

        A request only its tenant's quota holds back (the quota was lowered), or one pinned to a node
        that is not ready, is stepped over: it blocks nobody. The first that does not fit stops the
        walk, and preemptible containers of lower priority may be stopped to make room for it.
        """
        position, now = 0, time.time()
        while position < len(self.queue):
            cid = self.queue.at(position)
            record = self._containers[cid]
            spec = record.spec
            assert spec is not None
            if not self._within_live_quota(record) or (spec.node is not None and spec.node not in self._index.by_node):
                position += 1
                continue
            try:
                slots = place(self._index, Request(spec.memory, spec.count, spec.node, Placement(spec.placement)))
            except NoFit:
                if cid != own or own_waits:  # only a request that waits is worth stopping anything for
                    self._plan_preemption(record, now)
                return
            except (NoAgents, GpumgrError):
                return
            self._leave_queue(record)
            self._count(record, -1)  # it stops counting as queued and counts as live from here
            self._assign(record, slots, own_deadline if cid == own else self.create_deadline)
            record.spec = None
            self._count(record, 1)
            self._grant(record)
            waited = now - (record.queued_at or now)
            if cid != own:
                self._outcome("placed")
            self._event(EventType.PLACED, f"{format_bytes(record.gpu_memory)} on {', '.join(record.gpus)}"
                        + (f" after waiting {waited:.1f}s in the queue" if cid != own else ""), record)
            if cid != own:
                self._to_start.append(record)

    def _plan_preemption(self, head: Container, now: float) -> None:
        """Choose preemptible containers of lower priority whose grants, once freed, let ``head`` fit.

        Per GPU the fewest bytes are taken: the lowest priority first, then the youngest. Nothing is
        chosen again while containers already chosen for ``head`` are still stopping. The comparison is
        of priorities as asked: aging orders the queue, it gives no right to stop anything.
        """
        if not self._preemptible:
            return
        if any(self._containers[v].state in LIVE for v in head.making_room if v in self._containers):
            return
        spec = head.spec
        assert spec is not None
        nodes = [spec.node] if spec.node is not None else list(self._index.by_node)
        best: tuple[int, list[Container]] | None = None
        for name in nodes:
            options: list[tuple[int, list[Container]]] = []
            for gpu in self._node_gpus(name):
                if gpu not in self._index:
                    continue
                free = gpu.free
                if free >= spec.memory:
                    options.append((0, []))
                    continue
                candidates = sorted((self._containers[c] for c in gpu.holders),
                                    key=lambda r: (r.priority, -r.created_at))
                chosen: list[Container] = []
                for victim in candidates:
                    if free >= spec.memory:
                        break
                    if (victim.preemptible and victim.state is State.RUNNING and victim.priority < head.priority
                            and victim.preempted_for is None and not victim.remove_requested):
                        chosen.append(victim)
                        free += victim.gpu_memory
                if free >= spec.memory:
                    options.append((sum(v.gpu_memory for v in chosen), chosen))
            if len(options) < spec.count:
                continue
            options.sort(key=lambda o: o[0])
            victims = list({v.id: v for _, chosen in options[:spec.count] for v in chosen}.values())
            cost = sum(v.gpu_memory for v in victims)
            if victims and (best is None or cost < best[0]):
                best = (cost, victims)
        if best is None:
            return
        head.making_room = [v.id for v in best[1]]
        for victim in best[1]:
            victim.preempted_for = head.id
            self._to_preempt.append(victim)
            self._event(EventType.PREEMPTED, f"stopping preemptible container (priority {victim.priority}) to make "
                        f"room for queued request {head.id} (priority {head.priority})", victim,
                        preempted_for=head.id)

    def preemption_failed(self, cid: str) -> None:
        """Its node could not stop ``cid``: it runs on unmarked, and room is sought again."""
        with self._lock:
            record = self._containers.get(cid)
            if record is not None and record.state in LIVE:
                record.preempted_for = None
            self.wake.set()

    def _expire(self, now: float) -> None:
        while self._expiries and self._expiries[0][0] <= now:
            _, cid = self._expiries[0]
            record = self._containers.get(cid)
            if record is None or record.state is not State.QUEUED:
                self._expiries.pop(0)
                continue
            waited = now - (record.queued_at or now)
            self._end_queued(record, State.EXPIRED, f"waited {waited:.1f}s in the queue without room: its "
                             "queue_timeout ran out")

    def _enqueue(self, record: Container, seq: int | None = None) -> None:
        record.queue_seq = self.queue.add(record.id, record.priority, record.queued_at or time.time(), seq)
        if record.expires_at is not None:
            self._expiries.add((record.expires_at, record.id))
        self._count(record, 1)
        self.wake.set()

    def _leave_queue(self, record: Container) -> None:
        self.queue.discard(record.id)
        if record.expires_at is not None:
            self._expiries.discard((record.expires_at, record.id))
        if record.id in self._journaled:
            self._journaled.discard(record.id)
            self.journal.remove(record.id)
        self.wake.set()  # the requests behind it may go now

    def _drop_unplaced(self, record: Container) -> None:
        """Forget a request that was in the queue only for its own walk and is refused: it leaves no record."""
        self._leave_queue(record)
        self._count(record, -1)
        del self._containers[record.id]

    def _end_queued(self, record: Container, state: State, reason: str) -> None:
        self._leave_queue(record)
        self._count(record, -1)
        record.state, record.reason, record.finished_at = state, reason, time.time()
        self._end(record)

    def _why_waiting(self, spec: PlacementSpec, ahead: int) -> str:
        if ahead:
            return f"{ahead} queued request(s) of higher or equal priority wait for room first"
        largest = self._index.largest_free()
        return (f"no ready GPU has {format_bytes(spec.memory)} free" + (f" on {spec.count} GPUs of one node"
                if spec.count > 1 else "") + f" (the most free on one GPU is {format_bytes(largest)})")

    def _journal_entry(self, record: Container) -> dict[str, Any]:
        assert record.spec is not None
        return {"id": record.id, "name": record.name, "tenant": record.tenant, "priority": record.priority,
                "preemptible": record.preemptible, "created_at": record.created_at, "queued_at": record.queued_at,
                "seq": record.queue_seq, "expires_at": record.expires_at, "spec": asdict(record.spec)}

    # --- tenants and quotas ------------------------------------------------------------------
    def usage_of(self, tenant: str) -> Usage:
        """A copy of what ``tenant`` holds now, its integrals brought up to date."""
        with self._lock:
            use = self._usage.setdefault(tenant, Usage())
            use.advance(time.time())
            return replace(use)

    def _count(self, record: Container, sign: int) -> None:
        """``record`` starts (+1) or stops (-1) counting against its tenant's quota."""
        if record.tenant is None:
            return
        use = self._usage.setdefault(record.tenant, Usage())
        total = record.gpu_memory * record.count
        use.memory += sign * total
        use.containers += sign
        if record.state is State.QUEUED:
            use.queued += sign
            use.queued_memory += sign * total
        else:
            use.advance(time.time())
            use.live_memory += sign * total

    def _count_resized(self, record: Container, delta: int) -> None:
        if record.tenant is None:
            return
        use = self._usage.setdefault(record.tenant, Usage())
        use.memory += delta * record.count
        if record.state is State.QUEUED:
            use.queued_memory += delta * record.count
        else:
            use.advance(time.time())
            use.live_memory += delta * record.count

    def _check_quota(self, tenant: Tenant | None, memory: int, containers: int) -> None:
        """QuotaExceeded unless ``tenant`` can take ``memory`` more bytes and ``containers`` more containers.

        Live and queued requests count alike; :meth:`_within_live_quota` checks a queued one at placement.
        """
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

    def _within_live_quota(self, record: Container) -> bool:
        """Whether placing queued ``record`` keeps its tenant's live grants within the quota now in force."""
        if record.tenant is None or self.tenants is None:
            return True
        tenant = self.tenants.get(record.tenant)
        if tenant is None:
            return True
        use = self._usage.get(tenant.name) or Usage()
        memory = record.gpu_memory * record.count
        if tenant.gpu_memory is not None and use.live_memory + memory > tenant.gpu_memory:
            return False
        return tenant.containers is None or use.containers - use.queued + 1 <= tenant.containers

    def _check_could_fit(self, spec: PlacementSpec) -> None:
        """NoFit at once for a request no GPU could ever hold, empty as it might be (queue or not)."""
        if not self._nodes:
            return  # nothing known yet: a node may join
        if spec.node is not None and spec.node not in self._nodes:
            return
        nodes = [self._nodes[spec.node]] if spec.node is not None else list(self._nodes.values())
        best = 0
        for node in nodes:
            sizes = sorted((g.total - g.headroom for g in node.gpus), reverse=True)
            if len(sizes) >= spec.count:
                best = max(best, sizes[spec.count - 1])
        if best < spec.memory:
            where = f"node {spec.node}" if spec.node else "any node"
            raise NoFit(f"no GPU could ever hold this: {format_bytes(spec.memory)} on {spec.count} GPU(s) of one "
                        f"node, and the largest {where} has is {format_bytes(best)} each; nothing was queued",
                        code="never_fits")

    # --- resizing ----------------------------------------------------------------------------
    def begin_resize(self, cid: str, memory: int, *, force: bool = False,
                     tenant: Tenant | None = None) -> tuple[Container, int, bool]:
        """Check and start a resize of ``cid`` to ``memory`` per GPU; return ``(record, old, needs_node)``.

        The quota is checked first (403), then room (409). A grow is granted on the map at once (the
        node still enforces the smaller figure until told); a shrink is given back only once the node
        enforces it (:meth:`end_resize`), so the freed bytes are never granted while still used.
        Shrinking below what the container uses now is refused unless ``force``.
        """
        with self._lock:
            record = self._get(cid)
            old = record.gpu_memory
            delta = memory - old
            if record.state is State.QUEUED:
                assert record.spec is not None
                if delta > 0:
                    self._check_quota(tenant, delta * record.count, 0)
                spec = replace(record.spec, memory=memory)
                self._check_could_fit(spec)
                record.spec, record.gpu_memory = spec, memory
                self._count_resized(record, delta)
                if record.id in self._journaled:
                    self.journal.add(self._journal_entry(record))
                self.wake.set()
                return record, old, False
            if record.state is not State.RUNNING:
                raise Conflict(f"container {cid} is {record.state}: only a running or queued container can be "
                               "resized")
            if record.resizing:
                raise Conflict(f"container {cid} is being resized already; try again when that is done")
            holder = self._nodes.get(record.node)
            if holder is None or not holder.ready:
                raise NoAgents(f"node {record.node} is down; its containers cannot be resized now")
            if delta > 0:
                self._check_quota(tenant, delta * record.count, 0)
                short = [g for g in record.gpus if self._gpus[g].free < delta]
                if short:
                    gpu = self._gpus[short[0]]
                    raise NoFit(f"GPU {gpu.uuid} has {format_bytes(gpu.free)} free; growing the grant from "
                                f"{format_bytes(old)} to {format_bytes(memory)} needs {format_bytes(delta)} more")
                self._regrant(record, memory)
            elif delta < 0:
                over = {g: used for g, used in record.usage.items() if used > memory}
                if over and not force:
                    uuid, used = next(iter(over.items()))
                    raise Conflict(f"container {cid} uses {format_bytes(used)} on GPU {uuid}, more than the "
                                   f"{format_bytes(memory)} asked for; send \"force\": true to shrink it anyway (its "
                                   f"node then acts on the overrun: {record.on_overrun})", code="below_usage")
            record.resizing = delta != 0
            return record, old, delta != 0

    def end_resize(self, cid: str, old: int, memory: int, ok: bool) -> Container:
        """The node enforces ``memory`` now (``ok``), or could not be told: settle the map either way."""
        with self._lock:
            record = self._get(cid)
            record.resizing = False
            if record.state in LIVE:
                if ok and memory < old and record.gpu_memory == old:
                    self._regrant(record, memory)
                elif not ok and memory > old and record.gpu_memory == memory:
                    self._regrant(record, old)
            if ok:
                self._event(EventType.RESIZED, f"grant resized from {format_bytes(old)} to {format_bytes(memory)} "
                            "per GPU", record, old=old, new=memory)
            return record

    def _regrant(self, record: Container, memory: int) -> None:
        delta = memory - record.gpu_memory
        self._map_version += 1
        for uid in record.gpus:
            gpu = self._gpus.get(uid)
            if gpu is not None and record.id in gpu.holders:
                gpu.reserved += delta
                self._index.update(gpu)
        self._count_resized(record, delta)
        record.gpu_memory = memory
        if delta < 0:
            self.wake.set()

    def grant_mismatches(self, node: str, reports: list[ContainerReport]) -> list[tuple[str, int]]:
        """Live grants ``node`` enforces at another figure than the map's (a resize it missed): ``(grant, bytes)``."""
        with self._lock:
            found = []
            for report in reports:
                record = self._containers.get(report.grant)
                if (record is not None and record.node == node and record.state in LIVE and not record.resizing
                        and report.gpu_memory != record.gpu_memory):
                    found.append((record.id, record.gpu_memory))
            return found

    def tenants_view(self, principal: Principal) -> list[dict[str, Any]]:
        """Each tenant the caller may see: quota, what it holds and has queued, and GiB·hours since start."""
        book = self.tenants
        tenants = book.all() if book is not None else []
        now, gib_hour = time.time(), float(1 << 30) * 3600
        views = []
        with self._lock:
            for tenant in tenants:
                if not principal.sees(tenant.name):
                    continue
                use = self._usage.setdefault(tenant.name, Usage())
                use.advance(now)
                views.append({
                    "name": tenant.name, "quota": tenant.quota_view(),
                    "in_use": {"gpu_memory": use.live_memory, "containers": use.containers - use.queued},
                    "queued": {"gpu_memory": use.queued_memory, "requests": use.queued},
                    "gpu_memory_gib_hours": {"granted": use.granted_byte_seconds / gib_hour,
                                             "used": use.used_byte_seconds / gib_hour},
                })
        return views

    # --- reads -------------------------------------------------------------------------------
    def get(self, cid: str) -> Container:
        """The record of ``cid``; raises NotFound."""
        with self._lock:
            return self._get(cid)

    def containers(self, state: str | None = None, node: str | None = None,
                   principal: Principal | None = None) -> list[Container]:
        """Records, oldest first (queued ones in queue order), optionally filtered (``principal``: those it may see)."""
        with self._lock:
            pool = [self._containers[c] for c in self.queue.ids()] if state == State.QUEUED \
                else self._containers.values()
            return [c for c in pool
                    if (state is None or c.state == state) and (node is None or c.node == node)
                    and (principal is None or principal.sees(c.tenant))]

    def get_for(self, cid: str, principal: Principal) -> Container:
        """The record of ``cid`` if ``principal`` may see it; NotFound otherwise, as if it did not exist."""
        with self._lock:
            record = self._containers.get(cid)
            if record is None or not principal.sees(record.tenant):
                raise NotFound(f"no container with id {cid!r}")
            return record

    def view(self, record: Container) -> dict[str, Any]:
        """``record`` as the REST API shows it, with each GPU's index and name."""
        with self._lock:
            return self._view(record)

    def views(self, records: list[Container]) -> list[dict[str, Any]]:
        """Several records as the REST API shows them, under one hold of the lock."""
        with self._lock:
            return [self._view(r) for r in records]

    def _view(self, record: Container) -> dict[str, Any]:
        refs = {u: {"uuid": u, "index": g.index, "name": g.name} for u in record.gpus if (g := self._gpus.get(u))}
        queue = None
        if record.state is State.QUEUED:
            now = time.time()
            queued_at = record.queued_at or now
            queue = {"position": self.queue.position(record.id), "length": len(self.queue),
                     "effective_priority": round(self.queue.effective(record.priority, queued_at, now), 3),
                     "waited": round(now - queued_at, 3), "expires_at": record.expires_at,
                     "making_room": list(record.making_room)}
        return container_view(record, refs, queue)

    def nodes_view(self, principal: Principal | None = None) -> list[dict[str, Any]]:
        """The machine × GPU map as ``GET /v1/nodes`` shows it; a tenant sees only its own containers' ids."""
        with self._lock:
            if principal is None or principal.operator:
                return [node_view(n) for n in self._nodes.values()]
            return [node_view(n, lambda cid: self._containers[cid].tenant == principal.tenant)
                    for n in self._nodes.values()]

    @property
    def map_version(self) -> int:  # issue 20
        """Bumped whenever a grant or a node changes (``GET /v1/nodes``'s cache keys on it)."""  # issue 20
        return self._map_version  # issue 20

    def nodes_json(self) -> bytes:
        """``{"nodes": nodes_view()}`` encoded, rebuilt when a grant or a node changes or it is ``map_max_age`` old.

        Building and encoding the whole map costs milliseconds on a large cluster; a dashboard polling
        it must not take the lock that often. Heartbeat figures are at most ``map_max_age`` stale.
        """
        now = time.monotonic()
        with self._lock:
            version, cached = self._map_version, self._map_cache
            if cached is not None and cached[0] == version and now - cached[1] < self.map_max_age:
                return cached[2]
            view = [node_view(n) for n in self._nodes.values()]
        body = json.dumps({"nodes": view}, separators=(",", ":")).encode()
        with self._lock:
            self._map_cache = (version, now, body)
        return body

    def needs_image(self) -> bool:
        """True when every ready node runs Docker, so a request without an image cannot run anywhere."""
        with self._lock:
            runtimes = {n.runtime for n in self._nodes.values() if n.ready}
            return bool(runtimes) and runtimes <= {"docker"}

    def ready_nodes(self) -> int:
        """How many nodes are ready."""
        with self._lock:
            return sum(1 for n in self._nodes.values() if n.ready)

    # --- internals ---------------------------------------------------------------------------
    def _new_record(self, spec: PlacementSpec, tenant: Tenant | None, deadline: float) -> Container:
        cid = os.urandom(8).hex()
        return Container(
            id=cid, name=spec.name or f"gpumgr-{cid}", node="", gpus=[], gpu_memory=spec.memory, image=spec.image,
            command=spec.command, env=spec.env, labels=spec.labels, on_overrun=spec.on_overrun,
            container_id=spec.container_id, hook=spec.hook, deadline=time.monotonic() + deadline,
            tenant=tenant.name if tenant is not None else spec.tenant, priority=spec.priority,
            preemptible=spec.preemptible,
        )

    @staticmethod
    def _assign(record: Container, slots: list[Any], deadline: float) -> None:
        record.node, record.gpus = slots[0].node, [s.uuid for s in slots]
        record.state, record.deadline = State.CREATING, time.monotonic() + deadline

    def _event(self, kind: EventType, text: str, record: Container, **extra: Any) -> None:
        """An event about ``record``, tagged with its tenant (a tenant reads only its own events)."""
        self.events.record(kind, text, node=record.node or None, container=record.id, tenant=record.tenant, **extra)

    def _get(self, cid: str) -> Container:
        record = self._containers.get(cid)
        if record is None:
            raise NotFound(f"no container with id {cid!r}")
        return record

    def _node_gpus(self, name: str) -> list[Gpu]:
        node = self._nodes.get(name)
        return node.gpus if node is not None else []

    def _gpu_for(self, node: str, info: GpuInfo) -> Gpu:
        gpu = self._gpus.get(info.uuid)
        if gpu is None or gpu.node != node:
            gpu = Gpu(info.uuid, node, info.index, info.memory_total, headroom=self.headroom, name=info.name)
            self._gpus[info.uuid] = gpu
        gpu.index, gpu.total, gpu.name = info.index, info.memory_total, info.name
        return gpu

    def _extend_deadlines(self, name: str) -> None:
        """A node back from down gets its creating grants' time to confirm them again."""
        later = time.monotonic() + 2 * self.down_after
        for record in self._containers.values():
            if record.node == name and record.state is State.CREATING and record.deadline is not None:
                record.deadline = max(record.deadline, later)

    def _check_gpus_free(self, name: str, gpus: list[GpuInfo]) -> None:
        for info in gpus:
            gpu = self._gpus.get(info.uuid)
            other = self._nodes.get(gpu.node) if gpu is not None and gpu.node != name else None
            if other is not None and other.ready:
                raise GpuConflict(f"GPU {info.uuid} is already held by node {other.name}, which is up: two agents "
                                  "read the same GPUs; stop one of them (or remove the other node once it is down)")

    def _set_ready(self, node: Node, ready: bool, *, quiet: bool = False) -> None:
        self._map_version += 1
        node.ready = ready
        if ready:
            self.wake.set()
        for gpu in node.gpus:
            (self._index.add if ready and gpu not in self._index else self._index.discard)(gpu)
        if not quiet:
            kind = EventType.NODE_UP if ready else EventType.NODE_DOWN
            self.events.record(kind, f"node {node.name} is {'ready' if ready else 'down'}", node=node.name)

    def _grant(self, record: Container) -> None:
        self._map_version += 1
        if record.preemptible:
            self._preemptible.add(record.id)
        for uid in record.gpus:
            gpu = self._gpus[uid]
            gpu.reserved += record.gpu_memory
            gpu.holders.add(record.id)
            self._index.update(gpu)

    def _release(self, record: Container) -> None:
        self._map_version += 1
        self._preemptible.discard(record.id)
        self.wake.set()
        for uid in record.gpus:
            gpu = self._gpus.get(uid)
            if gpu is not None and record.id in gpu.holders:
                gpu.reserved -= record.gpu_memory
                gpu.holders.discard(record.id)
                self._index.update(gpu)

    def _finish(self, record: Container, state: State, reason: str | None, exit_code: int | None,
                detail: dict[str, Any], *, finished_at: float | None = None) -> None:
        """End a live record once: release its grant, keep why and when, and record its one final event."""
        if record.state is State.QUEUED:
            self._end_queued(record, state, reason or "withdrawn from the queue")
            return
        if record.state not in LIVE:
            if state is State.REMOVED and record.state is not State.REMOVED:
                record.state = State.REMOVED  # deleted after it ended: its end stays as it was recorded
                self._event(EventType.REMOVED, "removed", record)
            elif record.exit_code is None:
                record.exit_code = exit_code  # a late exit report: keep its exit code only
            return
        self._release(record)
        self._count(record, -1)
        if record.preempted_for is not None and state in (State.EXITED, State.KILLED, State.REMOVED,
                                                          State.PREEMPTED):
            # stopped to make room: that is its end, whatever exit the stop caused
            state, reason = State.PREEMPTED, (f"preempted to make room for queued request {record.preempted_for}"
                                              f" of higher priority")
            detail = {**detail, "preempted_for": record.preempted_for}
        record.state, record.deadline = state, None
        if state is State.KILLED and ("overrun" in record.detail or "overrun" in detail):
            self._overrun_kills[record.node] = self._overrun_kills.get(record.node, 0) + 1
        record.exit_code = exit_code if exit_code is not None else record.exit_code
        record.reason = reason or record.reason or _default_reason(state, record.exit_code)
        record.detail.update(detail)
        record.finished_at = finished_at or record.finished_at or time.time()
        self._end(record)

    def _end(self, record: Container) -> None:
        self._finished.append(record.id)
        self._forget_oldest()
        kind = _FINAL_EVENTS.get(record.state, EventType.EXITED)
        text = f"{record.state}: {record.reason}"
        text += f" (exit {record.exit_code})" if record.exit_code is not None else ""
        # the final event carries the overrun that ended it flat (reason, observed, grant_bytes, gpu, ...)
        overrun = record.detail.get("overrun")
        flat = {**{k: v for k, v in record.detail.items() if k != "overrun"},
                **(overrun if isinstance(overrun, dict) else {})}
        extra = {k: v for k, v in flat.items() if k not in _EVENT_KEYS}
        self._event(kind, text, record, final=True, **extra)

    def _forget_oldest(self) -> None:
        while len(self._finished) > defaults.FINISHED_KEPT:
            old = self._containers.get(self._finished.popleft())
            if old is not None and old.state not in LIVE:
                del self._containers[old.id]

    def _reconcile(self, node: Node, reports: list[ContainerReport] | list[ContainerStatus], *,
                   whole: bool = False) -> list[str]:
        """Bring ``node``'s records in line with what it reports; return grants to remove there.

        A report is the engine's truth for its node: a live grant the node no longer reports is over
        (or, while ``creating``, waits for its deadline), and one it reports that we do not know is
        adopted from the full report a registration carries. A registration (``whole``) also confirms
        any creating grant its node reports running: the container exists, whoever was waiting for it.
        """
        removals, seen, unknown = [], set(), []
        for report in reports:
            seen.add(report.grant)
            record = self._containers.get(report.grant)
            if record is not None and record.node != node.name:
                log.warning("node %s reports grant %s of node %s; ignored", node.name, report.grant, record.node)
            elif record is None:
                if isinstance(report, ContainerReport):
                    unknown.append(report)
            elif record.state in LIVE:
                self._refresh(record, report, confirm=whole)
                if record.remove_requested and record.state in LIVE and report.state != REMOVING:
                    removals.append(record.id)
            elif record.state in (State.FAILED, State.REMOVED) and report.state in LIVE:
                removals.append(report.grant)
            else:
                record.gpu_memory_peak = max(record.gpu_memory_peak, report.peak)
        holders = {cid for gpu in node.gpus for cid in gpu.holders if cid not in seen}
        for record in [self._containers[cid] for cid in sorted(holders)]:
            if record.state is State.RUNNING:
                reason = "removed on request" if record.remove_requested else "container disappeared from its node"
                self._finish(record, State.REMOVED, reason, None, {})
        # adopted last, against what is still granted once the containers that are gone have ended
        removals += [report.grant for report in unknown if not self._adopt(node, report)]
        return removals

    def _refresh(self, record: Container, report: ContainerStatus, *, confirm: bool = False) -> None:
        now = time.monotonic()
        if record.tenant is not None and record.usage_at:
            use = self._usage.setdefault(record.tenant, Usage())
            use.used_byte_seconds += sum(record.usage.values()) * max(0.0, now - record.usage_at)
        record.usage_at = now
        record.usage = dict(report.usage)
        record.gpu_memory_peak = max(record.gpu_memory_peak, report.peak, sum(record.usage.values()))
        record.container_id = report.container_id
        if record.state is State.CREATING and (record.hook or confirm):
            # a hook grant has no REST caller waiting: its node's report confirms it (or its deadline ends it)
            if report.state == State.RUNNING:
                record.state, record.deadline = State.RUNNING, None
                self._event(EventType.STARTED, f"container {report.container_id[:12]} running", record)
            elif report.state == State.CREATING and record.deadline is not None:
                record.deadline = max(record.deadline, time.monotonic() + defaults.TASK_START_TIMEOUT)
        if report.state in (State.EXITED, State.KILLED) and record.state in LIVE:
            state = State.KILLED if report.state == State.KILLED else State.EXITED
            self._finish(record, state, report.reason, report.exit_code, {}, finished_at=report.finished_at)

    def _adopt(self, node: Node, report: ContainerReport) -> bool:
        """Rebuild a record from a node's report (the manager restarted, or the grant is new to it).

        False if the container must go: its grant no longer fits its GPU, because the bytes were
        granted to another container while the map did not know this one (a create that finished
        after the manager restarted). The containers the map already holds keep their bytes.
        """
        live = report.state in LIVE or report.state == REMOVING  # a container being stopped still holds memory
        record = Container(
            id=report.grant, name=report.name, node=node.name, gpus=list(report.gpus), gpu_memory=report.gpu_memory,
            image=report.image or None, command=list(report.command), labels=dict(report.labels),
            on_overrun=report.on_overrun,
            state=State(_live_state(report.state)) if live else State(_final_state(report.state)),
            container_id=report.container_id, exit_code=report.exit_code, reason=report.reason,
            created_at=report.created_at or time.time(), usage=dict(report.usage), hook=report.hook,
            deadline=time.monotonic() + defaults.TASK_START_TIMEOUT if report.state == State.CREATING else None,
            tenant=report.tenant or None, priority=report.priority, preemptible=report.preemptible,
            gpu_memory_peak=max(report.peak, sum(report.usage.values())),
        )
        record.remove_requested = report.state == REMOVING  # its removal ends it, when the node reports it gone
        known = [u for u in record.gpus if u in self._gpus and self._gpus[u].node == node.name]
        if live and len(known) != len(record.gpus):
            log.warning("container %s names GPUs %s that node %s does not report", record.id, record.gpus, node.name)
            record.gpus = known
        self._containers[record.id] = record
        over = [u for u in record.gpus if self._gpus[u].reserved + record.gpu_memory > self._gpus[u].total]
        if live and over:
            record.state = State.FAILED
            record.reason = (f"not adopted: its {format_bytes(record.gpu_memory)} no longer fit GPU {over[0]}, "
                             "granted to others meanwhile; the container is removed")
            record.finished_at = time.time()
            self._end(record)
            return False
        self._event(EventType.ADOPTED, f"{report.state} container {report.container_id[:12]} re-adopted", record)
        if live and record.gpus:
            self._grant(record)
            self._count(record, 1)
        elif not live:
            # it ended while no manager heard it: its end is recorded now, with its reason and time
            record.finished_at = report.finished_at or time.time()
            record.reason = record.reason or _default_reason(record.state, record.exit_code)
            self._end(record)
        return True

    def refuse_adoptions(self, node: str, refused: list[RefusedAdoption]) -> None:
        """Record why a node could not adopt containers that look managed (no trustworthy grant)."""
        for item in refused:
            self.events.record(EventType.FAILED, f"container {item.container_id[:12]} {item.name} not adopted: "
                               f"{item.reason}", node=node, container=None)


_EVENT_KEYS = frozenset({"id", "time", "type", "node", "container", "message", "final", "tenant"})
_FINAL_EVENTS = {State.KILLED: EventType.KILLED, State.FAILED: EventType.FAILED, State.REMOVED: EventType.REMOVED,
                 State.EXPIRED: EventType.EXPIRED, State.PREEMPTED: EventType.PREEMPTED}


def _default_reason(state: State, exit_code: int | None) -> str:
    if state is State.EXITED:
        return f"exited with code {exit_code}" if exit_code is not None else "exited"
    return str(state)


def _live_state(state: str) -> str:
    return State.RUNNING.value if state == REMOVING else state


def _final_state(state: str) -> str:
    return state if state in {s.value for s in State} and state not in LIVE else State.EXITED.value
