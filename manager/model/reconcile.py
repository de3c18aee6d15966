"""Reconciliation: bringing the map in line with what each node reports, and carrying out desired states.

A node's report is its engine's truth: a live grant it no longer reports is over (or, while
``creating`` with nothing in flight, waits for its deadline), one it reports that the map does not
know is adopted from the full report a registration carries, and a record whose desired state is
not ``running`` is stopped once nothing else is in flight on it (:meth:`Reconciler.follow_up`).
The node also says which grant it enforces; where that differs from the map, the map holds the
larger figure until the two agree, and tells the node the map's figure. When many nodes go silent at
once (:attr:`Reconciler.disrupted`), it is taken for a partition, not their deaths: no node is forgotten
and no grant's confirm deadline expires until they return. Called under the ledger's lock.
"""

from __future__ import annotations

import logging
from operator import attrgetter

from gpumgr.manager.model.lifecycle import ENDED, Lifecycle
from gpumgr.manager.model.records import Command, Container, Gpu, Node, OpKind, PlacementSpec
from gpumgr.wire import defaults
from gpumgr.wire.errors import GpuConflict, OutcomeUnknown
from gpumgr.wire.names import BURST_RECLAIMED, LIVE, REMOVING, RUNNING, EventType, State
from gpumgr.wire.protocol import ContainerReport, ContainerStatus, GpuInfo, GpuSample, RefusedAdoption
from gpumgr.wire.units import format_bytes

log = logging.getLogger(__name__)
_by_id = attrgetter("id")


class Reconciler:
    """Registrations, heartbeats, sweeps and follow-ups; see the module docstring."""

    def __init__(self, life: Lifecycle, *, down_after: float = defaults.NODE_DOWN_AFTER,
                 forget_after: float = defaults.NODE_FORGET_AFTER,
                 disruption_threshold: float = defaults.DISRUPTION_THRESHOLD) -> None:
        self.life, self.ledger, self.clock = life, life.ledger, life.clock
        self.down_after = down_after
        #: a node down this long is dropped from the map (its binding stays: it may come back)
        self.forget_after = forget_after
        #: the fraction of the ready nodes that, silent within one down timeout, makes a disruption
        self.disruption_threshold = disruption_threshold
        #: when each node still down was marked down by a sweep (monotonic)
        self._down_at: dict[str, float] = {}
        #: while disrupted: the start of the down timeout it began in; nodes marked down since count
        self._disrupted_since: float | None = None
        self.remove_timeout = defaults.REMOVE_TIMEOUT
        #: per node: the agent process (instance) and the refused adoptions already recorded for it
        self._refused: dict[str, tuple[str, set[tuple[str, str]]]] = {}  # issue 20

    # --- nodes ---------------------------------------------------------------------------------
    def register(self, name: str, routing_id: bytes, runtime: str, gpus: list[GpuInfo],
                 containers: list[ContainerReport], *, key: str = "", instance: str = "",
                 labels: dict[str, str] | None = None,
                 advertise_addr: str = "", mps: bool = False) -> tuple[list[str], list[Command], bool]:
        """Add or refresh a node and adopt its containers: ``(orphans to remove, commands, restarted)``.

        Raises GpuConflict, changing nothing, if another live node holds one of the GPUs. A
        registration from the same agent process that is already ready (a repeated Register) changes
        nothing but the figures and writes no event.
        """
        self._check_gpus_free(name, gpus)
        old = self.ledger.nodes.get(name)
        restarted = old is not None and (old.instance != instance if instance or old.instance
                                         else old.routing_id != routing_id)
        quiet = old is not None and old.ready and not restarted
        if old is not None:  # its GPUs leave the free index before their figures change
            self.ledger.set_ready(old, False)
        was = {g.uuid: g.health for g in old.gpus} if old is not None else {}
        node = Node(name, routing_id, runtime, [self.ledger.gpu_for(name, info) for info in gpus], key=key,
                    instance=instance, last_seen=self.clock.time(), last_seen_mono=self.clock.monotonic(),
                    labels=dict(labels or {}), advertise_addr=advertise_addr, mps=mps)
        self.ledger.set_node(node)
        self.ledger.set_ready(node, True)
        if not quiet:
            self.life.events.record(EventType.NODE_UP, f"node {name} is ready", node=name)
        for gpu in node.gpus:
            if gpu.health != was.get(gpu.uuid, ""):
                self._health_event(gpu)
        self._extend_deadlines(name)
        if restarted:  # a new agent process: the old one answers nothing it was asked
            reported = {c.grant for c in containers}
            for record in [r for r in self.ledger.records.values() if r.node == name
                           and r.state is State.CREATING and r.id not in reported]:
                lost_with_agent(self.life, record, name, 2 * self.down_after)
        orphans, commands = self._reconcile(node, containers, whole=True)
        self.ledger.reburst(node.gpus)
        self.life.intents.registered(name, {c.grant for c in containers}, set(self.ledger.records))
        return orphans, commands, restarted

    def clear(self) -> None:
        """Forget what was judged of nodes (the map starts from nothing)."""
        self._down_at.clear()
        self._disrupted_since = None
        self._refused.clear()

    def heartbeat(self, name: str, routing_id: bytes, samples: list[GpuSample],
                  containers: list[ContainerStatus]) -> tuple[list[str], list[Command]] | None:
        """Take one heartbeat: ``(orphans, commands)``, or None if the node must register again."""
        node = self.ledger.nodes.get(name)
        if node is None:
            return None
        if not node.ready:
            # back from down: its heartbeats repeat only recent ends, and another node may have taken its
            # GPUs meanwhile; its registration carries every end with its exit code, and is checked whole
            return None
        node.routing_id, node.last_seen, node.last_seen_mono = routing_id, self.clock.time(), self.clock.monotonic()
        for sample in samples:
            gpu = self.ledger.gpus.get(sample.uuid)
            if gpu is not None and gpu.node == name:
                before = gpu.free
                if gpu.used != sample.memory_used or gpu.unmanaged != sample.memory_unmanaged:
                    self.ledger.touched.add(name)  # issue 20: GET /v1/nodes re-encodes this node
                gpu.used, gpu.unmanaged = sample.memory_used, sample.memory_unmanaged
                self.ledger.index.update(gpu)
                if gpu.free > before and len(self.life.queue):
                    self.ledger.wake.set()
                if sample.health != gpu.health and self.ledger.set_health(gpu, sample.health):
                    self._health_event(gpu)
        records = self.ledger.records
        if any(s.state in LIVE and ((r := records.get(s.grant)) is None or r.state is State.QUEUED)
               for s in containers):
            return None  # a live grant we do not know (or hold queued): adopt it from the whole report
        reconciled = self._reconcile(node, containers)
        self.ledger.reburst(node.gpus)  # its containers' use above their grants is taken
        return reconciled

    def _health_event(self, gpu: Gpu) -> None:
        """Say why ``gpu`` takes no new grants now, or that it takes them again."""
        where = f"GPU {gpu.index} ({gpu.uuid}) of node {gpu.node}"
        if gpu.health:
            holders = len(gpu.holders)
            self.life.events.record(EventType.GPU_UNHEALTHY, f"{where} is unhealthy: {gpu.health}; it takes no new "
                                    f"grants, and the {holders} container(s) on it are left running",
                                    node=gpu.node, gpu=gpu.uuid, health=gpu.health)
            log.warning("%s is unhealthy: %s", where, gpu.health)
        else:
            self.life.events.record(EventType.GPU_HEALTHY, f"{where} is healthy again and takes grants",
                                    node=gpu.node, gpu=gpu.uuid)

    def forget_node(self, name: str, reason: str = "its node was forgotten") -> bool:
        """Remove a node from the map; its live grants end as ``removed``. False if unknown."""
        node = self.ledger.nodes.get(name)
        if node is None:
            return False
        if node.ready:
            self.ledger.set_ready(node, False)
        for record in [r for r in self.ledger.records.values() if r.node == name and r.state in LIVE]:
            self.life.move(record, State.REMOVED, reason)
        self.ledger.drop_node(name)
        self._refused.pop(name, None)  # issue 20
        self.life.intents.registered(name, set(), set())  # intents for its containers the map never saw are moot
        self.life.events.record(EventType.NODE_DOWN, f"node {name} was forgotten", node=name)
        return True

    @property
    def disrupted(self) -> bool:
        """Whether many nodes went silent at once: nothing that ends work on down nodes runs meanwhile."""
        return self._disrupted_since is not None

    def sweep(self, now: float) -> list[str]:
        """Mark silent nodes down, forget long-gone ones, end unconfirmed grants; return the nodes marked down.

        While :attr:`disrupted`, nothing is forgotten and no confirm deadline expires.
        """
        stale = [n for n in self.ledger.nodes.values() if n.ready and now - n.last_seen_mono > self.down_after]
        for node in stale:
            self.ledger.set_ready(node, False)
            self._down_at[node.name] = now
            self.life.events.record(EventType.NODE_DOWN, f"node {node.name} is down", node=node.name)
        self._judge_disruption(now)
        if self._disrupted_since is None:
            self._expire_unconfirmed(now)
            self._forget_gone(now)
        return [n.name for n in stale]

    def _expire_unconfirmed(self, now: float) -> None:
        """End the grants being created whose node did not confirm them by their deadline."""
        for record in [r for r in self.ledger.records.values() if r.state is State.CREATING and r.op is None]:
            holder = self.ledger.nodes.get(record.node)
            if holder is not None and not holder.ready:
                continue  # its node cannot confirm it now; its deadline restarts when the node returns
            if record.deadline is not None and now > record.deadline:
                self.life.move(record, State.FAILED, "never confirmed by its node in time: grant released")

    def _forget_gone(self, now: float) -> None:
        """Forget the nodes down for longer than ``forget_after``."""
        for name in [n.name for n in self.ledger.nodes.values()
                     if not n.ready and now - n.last_seen_mono > self.forget_after]:
            log.info("forgetting node %s: down for over %gs", name, self.forget_after)
            self.forget_node(name, reason=f"its node was down for over {self.forget_after:g}s")

    def _judge_disruption(self, now: float) -> None:
        """Begin or end a disruption: enough of the ready nodes went silent within one down timeout.

        Once begun, the window stays open at its start, so the nodes silent since count until they
        return; a node down from before it (a dead one) never counts.
        """
        if not self._down_at and self._disrupted_since is None:
            return
        nodes = self.ledger.nodes
        for name in [n for n in self._down_at if n not in nodes or nodes[n].ready]:
            del self._down_at[name]  # back, or forgotten
        since = now - self.down_after if self._disrupted_since is None else self._disrupted_since
        silent = sum(1 for at in self._down_at.values() if at >= since)
        before = silent + sum(1 for n in nodes.values() if n.ready)
        disrupted = silent >= defaults.DISRUPTION_MIN_NODES and silent / before >= self.disruption_threshold
        if disrupted and self._disrupted_since is None:
            self._disruption_began(since, silent, before)
        elif not disrupted and self._disrupted_since is not None:
            self._disruption_ended(now, silent)

    def _disruption_began(self, since: float, silent: int, before: int) -> None:
        """Pause forgetting and expiry: ``silent`` of the ``before`` ready nodes went silent since ``since``."""
        self._disrupted_since = since
        text = (f"{silent} of {before} ready nodes went silent within {self.down_after:g}s: taken for a partition, "
                "not their deaths; no node is forgotten and no confirm deadline expires until they return")
        log.warning("disruption: %s", text)
        self.life.events.record(EventType.NODE_DOWN, text, disrupted=True, silent=silent, ready_before=before)

    def _disruption_ended(self, now: float, silent: int) -> None:
        """Resume forgetting and expiry: too few of the nodes are still silent (``silent``)."""
        self._disrupted_since = None
        # deadlines that passed meanwhile get the time a node back from down gets, rather than ending at once
        later = now + 2 * self.down_after
        for record in self.ledger.records.values():
            if record.state is State.CREATING and record.deadline is not None:
                record.deadline = max(record.deadline, later)
        text = (f"the disruption is over ({silent} node(s) of it still silent): nodes down past forget_after are "
                "forgotten and confirm deadlines expire again")
        log.warning("disruption: %s", text)
        self.life.events.record(EventType.NODE_UP, text, disrupted=False, silent=silent)

    # --- desired state -------------------------------------------------------------------------
    def follow_up(self, record: Container) -> Command | None:
        """The operation that moves live ``record`` toward its desired state or figure, if one is due now.

        Nothing while another operation is in flight or its node is down; a record whose desired state
        is removed or preempted is stopped; one its node enforces at another figure is told the map's.
        """
        node = self.ledger.nodes.get(record.node)
        if record.op is not None or record.state not in LIVE or node is None or not node.ready:
            return None
        if record.desired is not State.RUNNING:
            if record.state is State.CREATING and record.container_id is None:
                return None  # nothing to stop yet: its node has not reported a container
            op = self.life.begin(record, OpKind.REMOVE, self.remove_timeout)
            return Command(OpKind.REMOVE, record, op) if op is not None else None
        if record.state is State.RUNNING and record.enforced and record.enforced != record.gpu_memory:
            op = self.life.begin(record, OpKind.RESIZE, self.remove_timeout, old=record.enforced,
                                 new=record.gpu_memory)
            return Command(OpKind.RESIZE, record, op) if op is not None else None
        return None

    def enforced(self, record: Container, figure: int) -> None:
        """Its node says it enforces ``figure`` bytes per GPU: hold the larger of it and the grant until they agree."""
        if not figure or record.state not in LIVE or record.op is not None:
            return
        if figure != record.enforced and figure != record.gpu_memory:
            self.life.event(EventType.RESIZED, f"node {record.node} enforces {format_bytes(figure)} per GPU, the map "
                            f"grants {format_bytes(record.gpu_memory)}: the larger is held until they agree", record,
                            enforced=figure, granted=record.gpu_memory)
        record.enforced = figure
        want = max(figure, record.gpu_memory)
        if want > record.held and self.ledger.room_for(record, want - record.held) is not None:
            want = record.held  # its node enforces more than is free: never overbook; the resize converges
        self.ledger.rehold(record, max(want, record.gpu_memory))

    # --- reports -------------------------------------------------------------------------------
    def _reconcile(self, node: Node, reports: list[ContainerReport] | list[ContainerStatus], *,
                   whole: bool = False) -> tuple[list[str], list[Command]]:
        orphans: list[str] = []
        seen: set[str] = set()
        unknown: list[ContainerReport] = []
        stale: list[Container] = []
        for report in reports:
            seen.add(report.grant)
            record = self.ledger.records.get(report.grant)
            if record is not None and record.state is State.QUEUED and isinstance(report, ContainerReport) and (
                    report.state in LIVE or report.state == REMOVING):
                # queued in the store and running on a node: a leader placed it and lost the store before the
                # dequeue was written; the running container is the request, adopted rather than placed again
                log.warning("node %s runs queued request %s: adopted, and taken off the queue", node.name, record.id)
                self.life.forget(record)
                unknown.append(report)
            elif record is not None and record.node != node.name:
                log.warning("node %s reports grant %s of node %s; ignored", node.name, report.grant, record.node)
            elif record is None:
                if isinstance(report, ContainerReport):
                    unknown.append(report)
            elif record.state in LIVE:
                self._refresh(record, report, whole=whole)
            elif record.state in (State.FAILED, State.REMOVED, State.EXPIRED, State.PREEMPTED) and \
                    report.state in LIVE:
                orphans.append(report.grant)
            elif report.state in LIVE and self._restarted(record):
                orphans.append(report.grant)  # it ended and runs again (docker restart): its grant is gone
            else:
                record.gpu_memory_peak = max(record.gpu_memory_peak, report.peak)
                if record.desired is State.REMOVED and record.state in (State.EXITED, State.KILLED) \
                        and record.op is None and node.ready:
                    stale.append(record)  # DELETEd, stopped, and still in the engine (its removal was cut off)
        records = self.ledger.records
        gone = [r for c in {c for g in node.gpus for c in g.holders} - seen if (r := records[c]).state is RUNNING]
        for record in sorted(gone, key=_by_id):  # RUNNING: see wire.names; in id order, as events are written
            reason = record.desired_reason if record.desired is not RUNNING else None
            self.life.move(record, State.REMOVED, reason or "container disappeared from its node")
        # adopted last, against what is still granted once the containers that are gone have ended
        orphans += [report.grant for report in unknown if not self._adopt(node, report)]
        commands = [c for r in self._unsettled(node.name) if (c := self.follow_up(r)) is not None]
        for record in stale:  # finished as a DELETE asked: the stopped container is removed from the engine too
            if (op := self.life.begin(record, OpKind.REMOVE, self.remove_timeout)) is not None:
                commands.append(Command(OpKind.REMOVE, record, op))
        return orphans, commands

    def _restarted(self, record: Container) -> bool:
        """Whether ``record`` exited (or was killed) long enough ago that its node reporting it live means it
        was started again behind gpumgr, not a heartbeat built before the exit."""
        ended = record.finished_at
        return record.state in (State.EXITED, State.KILLED) and ended is not None and \
            self.clock.time() - ended > self.down_after

    def _unsettled(self, name: str) -> list[Container]:
        """``name``'s live records that may need a follow-up: not as desired, or enforced at another figure."""
        records = self.ledger.records
        found = {cid: record for g in self.ledger.node_gpus(name) for cid in g.holders
                 if (record := records[cid]).op is None and (record.desired is not RUNNING or (
                     record.enforced and record.enforced != record.gpu_memory))}
        return [found[cid] for cid in sorted(found)]

    def _refresh(self, record: Container, report: ContainerStatus, *, whole: bool = False) -> None:
        now = self.clock.monotonic()
        if record.usage_at:
            self.life.quotas.used(record, now - record.usage_at)
        record.usage_at = now
        record.usage = dict(report.usage)
        record.gpu_memory_peak = max(record.gpu_memory_peak, report.peak, sum(record.usage.values()))
        record.container_id = report.container_id or record.container_id
        creating = record.op is not None and record.op.kind is OpKind.CREATE
        if record.state is State.CREATING and (whole or not creating):
            # a create in flight is settled by its answer (the container may still fail to start); a
            # registration, the whole report of a (restarted) agent, shows what exists
            if report.state == State.RUNNING or report.state == REMOVING:
                op = record.op if creating else None
                self.life.move(record, State.RUNNING)
                if op is not None:
                    self.life.end_op(record, op)
            elif report.state == State.CREATING and record.op is None and record.deadline is not None:
                record.deadline = max(record.deadline, now + defaults.TASK_START_TIMEOUT)
        if report.state in (State.EXITED, State.KILLED) and record.state in LIVE:
            state, reason = end_of(report)
            self.life.move(record, state, reason, exit_code=report.exit_code, finished_at=report.finished_at)
            return
        self.enforced(record, report.gpu_memory)

    def _adopt(self, node: Node, report: ContainerReport) -> bool:
        """Rebuild a record from a node's report (the manager restarted, or the grant is new to it).

        False if the container must go: it names GPUs its node does not have, or its grant no longer
        fits its GPU (the bytes were granted to another container while the map did not know this one).
        """
        live = report.state in LIVE or report.state == REMOVING  # a container being stopped still holds memory
        spec = PlacementSpec(memory=report.gpu_memory, count=max(1, len(report.gpus)), placement="spread",
                             image=report.image or None, command=list(report.command), name=report.name,
                             labels=dict(report.labels), node=node.name, on_overrun=report.on_overrun,
                             container_id=report.container_id, hook=report.hook, tenant=report.tenant or None,
                             priority=report.priority, preemptible=report.preemptible,
                             compute_share=report.compute_share, memory_limit=report.gpu_memory_limit)
        record = Container(
            id=report.grant, name=report.name, node=node.name, gpus=list(report.gpus), gpu_memory=report.gpu_memory,
            spec=spec, state=State.CREATING if report.state == State.CREATING else State.RUNNING,
            container_id=report.container_id, created_at=report.created_at or self.clock.time(),
            usage=dict(report.usage), tenant=report.tenant or None, priority=report.priority,
            preemptible=report.preemptible, enforced=report.gpu_memory,
            gpu_memory_peak=max(report.peak, sum(report.usage.values())),
            deadline=self.clock.monotonic() + defaults.TASK_START_TIMEOUT if report.state == State.CREATING else None,
        )
        accounts = self.life.quotas.accounts
        if accounts is not None:  # its over_quota is decided again as it is counted (oldest adopted first)
            record.account = accounts.account_of(record.tenant)
        missing = [u for u in record.gpus if u not in self.ledger.gpus or self.ledger.gpus[u].node != node.name]
        over = [u for u in record.gpus if u not in missing and (self.ledger.gpus[u].reserved + record.gpu_memory
                > self.ledger.gpus[u].total - self.ledger.gpus[u].headroom or self.ledger.gpus[u].compute_shares
                + report.compute_share > defaults.MAX_COMPUTE_SHARE)]
        if live and (missing or over or not record.gpus):
            why = (f"it names GPU(s) {', '.join(missing) or '(none)'} that node {node.name} does not report"
                   if missing or not record.gpus else
                   f"its {format_bytes(record.gpu_memory)} no longer fit GPU {over[0]}, granted to others meanwhile")
            self.life.admit_ended(record, State.FAILED, f"not adopted: {why}; the container is removed")
            return False
        if live:
            self.life.admit(record)
            intended = self.life.intents.adopted(record)
            if intended is not None:  # a DELETE answered 202, or a preemption, before a restart or failover
                self.life.desire(record, intended[0], intended[1], **intended[2])
            elif report.state == REMOVING:
                self.life.desire(record, State.REMOVED, "removed on request")
            self.life.event(EventType.ADOPTED, f"{report.state} container {report.container_id[:12]} re-adopted",
                            record)
            return True
        # it ended while no manager heard it: its end is recorded now, with its reason, exit code and time
        final, reason = end_of(report) if report.state in (State.EXITED, State.KILLED) else (
            State(report.state) if report.state in {s.value for s in ENDED} else State.EXITED, report.reason)
        self.life.admit_ended(record, final, reason, exit_code=report.exit_code, finished_at=report.finished_at)
        return True

    def refuse_adoptions(self, node: str, refused: list[RefusedAdoption]) -> None:
        """Record why a node could not adopt containers that look managed (no trustworthy grant).

        Once per container and reason for each agent process: a repeated Register (an agent retrying
        one whose answer it had not seen yet) carries the same list and records nothing again.
        """
        known = self.ledger.nodes.get(node)
        instance = known.instance if known is not None else ""
        was, told = self._refused.get(node, ("", set()))
        if was != instance or not instance:
            told = set()
        self._refused[node] = instance, told
        for item in refused:
            if (item.container_id, item.reason) in told:
                continue
            told.add((item.container_id, item.reason))  # issue 20: recorded once per agent process
            self.life.events.record(EventType.FAILED, f"container {item.container_id[:12]} {item.name} not "
                                    f"adopted: {item.reason}", node=node, container=None)

    def _extend_deadlines(self, name: str) -> None:
        """A node back from down gets its creating grants' time to confirm them again."""
        later = self.clock.monotonic() + 2 * self.down_after
        for record in self.ledger.records.values():
            if record.node == name and record.state is State.CREATING and record.deadline is not None:
                record.deadline = max(record.deadline, later)

    def _check_gpus_free(self, name: str, gpus: list[GpuInfo]) -> None:
        for info in gpus:
            gpu = self.ledger.gpus.get(info.uuid)
            other = self.ledger.nodes.get(gpu.node) if gpu is not None and gpu.node != name else None
            if other is not None and other.ready:
                raise GpuConflict(f"GPU {info.uuid} is already held by node {other.name}, which is up: two agents "
                                  "read the same GPUs; stop one of them (or remove the other node once it is down)")


def end_of(report: ContainerStatus) -> tuple[State, str | None]:
    """How a container its node reports ended is recorded: ``exited`` needs an exit code, and one that ended with
    none seen never ran to an exit of its own (removed before it started: failed) or is gone from its engine
    (removed while its agent was away: removed)."""
    if report.state == State.KILLED and report.reason == BURST_RECLAIMED:
        return State.PREEMPTED, BURST_RECLAIMED  # its node stopped a burster to keep granted bytes free
    if report.state == State.KILLED or report.exit_code is not None:
        return (State.KILLED if report.state == State.KILLED else State.EXITED), report.reason
    if report.reason == "removed_before_start":
        return State.FAILED, "its container was removed before it started"
    return State.REMOVED, report.reason or "its container is gone from its node (no exit code was seen)"


def lost_with_agent(life: Lifecycle, record: Container, name: str, wait: float) -> None:
    """``record``'s agent restarted before reporting its container. A REST create in flight may still land (its
    engine call may outlive the process): nobody knows, so it waits ``wait`` more; a hook's ended with the agent."""
    op = record.op
    if op is None or op.kind is not OpKind.CREATE or record.hook:
        life.move(record, State.FAILED, "its node's agent restarted before creating the container")
        return
    record.deadline = life.clock.monotonic() + wait + defaults.CREATE_MARGIN
    life.end_op(record, op, OutcomeUnknown(f"the agent of node {name} restarted before answering the create: the "
                                           "container may still appear; look before trying again"))
