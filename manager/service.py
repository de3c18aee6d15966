"""The manager's use cases: place a container, remove it, and keep the map in step with the agents."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gpumgr.manager.admission import Admission
from gpumgr.manager.cluster import Cluster
from gpumgr.manager.config import ManagerSettings
from gpumgr.manager.events import EventLog
from gpumgr.manager.link import ManagerLink
from gpumgr.manager.metrics import Metrics
from gpumgr.manager.records import Container, PlacementSpec
from gpumgr.manager.tenants import OPERATOR, Principal, Tenant, TenantBook, build_tenants
from gpumgr.wire import defaults, protocol
from gpumgr.wire.errors import AgentFailed, Conflict, Forbidden, GpumgrError, InvalidRequest, NoAgents, NotFound
from gpumgr.wire.link import Peer
from gpumgr.wire.names import LIVE, EventType, State

log = logging.getLogger(__name__)


class Manager:
    """Owns the cluster map and the agent link; the REST API calls into it."""

    def __init__(self, settings: ManagerSettings) -> None:
        self.settings = settings
        self.tenants = TenantBook(build_tenants(settings.tenants, settings.token), settings.token)
        self.events = EventLog()
        self.admission = Admission(settings.state_dir)
        self.cluster = Cluster(self.events, headroom=settings.headroom,
                               down_after=settings.heartbeat_interval * settings.heartbeat_liveness,
                               forget_after=settings.forget_after, aging=settings.queue_aging,
                               state_dir=str(self.admission.folder))
        self.cluster.tenants = self.tenants
        self.metrics = Metrics(self.cluster)
        self.cluster.create_deadline = settings.create_timeout + defaults.CREATE_MARGIN
        restored = self.cluster.restore_queue(self.cluster.journal.load())
        if restored:
            log.info("restored %d queued requests from %s", restored, self.cluster.journal.path)
        self.link = ManagerLink(settings.agents, self._on_message, self.admission.keys,
                                tick=settings.heartbeat_interval / 2,
                                on_tick=self._on_tick)
        self._next_sweep = 0.0
        self._stopping = threading.Event()
        self._workers = ThreadPoolExecutor(defaults.DISPATCH_WORKERS, thread_name_prefix="dispatch")
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="dispatcher", daemon=True)
        #: queued hook requests (Swarm tasks waiting in their create): grant id → where the answer goes
        self._hook_waiters: dict[str, tuple[str, str]] = {}
        self._waiters_lock = threading.Lock()

    def start(self) -> None:
        """Bind the agent link and start placing queued requests as room frees."""
        self.link.start()
        self._dispatcher.start()
        log.info("agent link bound on %s", self.link.bound_endpoint)

    def stop(self) -> None:
        """Stop the dispatcher and close the agent link (the queue stays in its journal)."""
        self._stopping.set()
        self.cluster.wake.set()
        if self._dispatcher.is_alive():
            self._dispatcher.join(5)
        self._workers.shutdown(wait=False, cancel_futures=True)
        self.link.stop()
        self.cluster.journal.close()

    def reload_tenants(self, settings: ManagerSettings) -> None:
        """Put new tenants, quotas and tokens in force (SIGHUP); raises ValueError, keeping the old ones."""
        tenants = build_tenants(settings.tenants, settings.token)
        self.tenants.replace(tenants, settings.token)
        self.settings = self.settings.model_copy(update={"tenants": settings.tenants, "token": settings.token})
        self.cluster.wake.set()  # a raised quota may let queued requests go
        log.info("tenants reloaded: %s", ", ".join(sorted(tenants)) or "none")

    def acting_as(self, principal: Principal, tenant: str | None) -> Tenant | None:
        """The tenant a request acts for: the caller's own, or (the operator only) the one it names."""
        if tenant is None:
            name = principal.tenant
        elif principal.operator:
            name = tenant
        else:
            raise Forbidden("only the operator may act for a tenant; leave out 'tenant'")
        if name is None:
            return None
        found = self.tenants.get(name)
        if found is None:
            raise InvalidRequest(f"tenant: no tenant named {name!r} is configured")
        return found

    # --- use cases ---------------------------------------------------------------------------
    def create(self, spec: PlacementSpec, *, queue: bool = False, queue_timeout: float | None = None,
               tenant: Tenant | None = None) -> tuple[dict[str, Any], int]:
        """Grant memory and have the chosen node start the container: ``(record, 201)`` once it runs.

        With ``queue`` a request that does not fit now waits: ``(record, 202)`` in state ``queued``; it
        is placed and started as soon as room frees, with no further call.
        """
        # the request below gives up after create_timeout; the deadline is the backstop should it never return
        record = self.cluster.submit(spec, deadline=self.settings.create_timeout + defaults.CREATE_MARGIN,
                                     queue=queue, queue_timeout=queue_timeout, tenant=tenant)
        if record.state is State.QUEUED:
            return self.cluster.view(record), 202
        return self._start(record), 201

    def _start(self, record: Container) -> dict[str, Any]:
        """Have ``record``'s node create and start its container; the grant is released on every failure.

        A create that the agent finishes after we gave up is undone when its next heartbeat reports a
        container whose record is ``failed``.
        """
        create = protocol.Create(spec=protocol.ContainerSpec(
            grant=record.id, name=record.name, image=record.image, command=record.command, env=record.env,
            labels=record.labels, gpus=record.gpus, gpu_memory=record.gpu_memory, on_overrun=record.on_overrun,
            created_at=record.created_at, tenant=record.tenant or "", priority=record.priority,
            preemptible=record.preemptible,
        ))
        try:
            reply = self.link.request(self.cluster.routing_id(record.node), create, self.settings.create_timeout)
        except Exception as exc:
            if self.cluster.get(record.id).state is State.RUNNING:
                # its agent restarted after starting it, and its registration confirmed the container
                return self.cluster.view(self.cluster.get(record.id))
            self.cluster.fail(record.id, f"{getattr(exc, 'code', 'link_error')}: {exc}")
            raise
        if not reply.ok:
            message = reply.error.message if reply.error else "unknown error"
            self.cluster.fail(record.id, message)
            raise AgentFailed(f"node {record.node} could not start the container: {message}")
        started = self.cluster.started(record.id, protocol.ContainerReport(**reply.result))
        if started.remove_requested and started.state in LIVE:  # DELETE came while it was being created
            return self.remove(record.id)[0]
        return self.cluster.view(started)

    def resize(self, cid: str, memory: int, *, force: bool = False, principal: Principal = OPERATOR) -> dict[str, Any]:
        """Grow or shrink ``cid``'s grant in place; its node enforces the new figure from its next sample."""
        record = self.cluster.get_for(cid, principal)
        tenant = self.tenants.get(record.tenant) if record.tenant is not None else None
        record, old, needs_node = self.cluster.begin_resize(cid, memory, force=force, tenant=tenant)
        if not needs_node:
            return self.cluster.view(record)
        ok = False
        try:
            reply = self.link.request(self.cluster.routing_id(record.node),
                                      protocol.Resize(grant=record.id, gpu_memory=memory), self.settings.remove_timeout)
            ok = reply.ok
            if not ok:
                reason = reply.error.message if reply.error else "unknown error"
                raise AgentFailed(f"node {record.node} could not resize the grant: {reason}")
        finally:
            record = self.cluster.end_resize(cid, old, memory, ok)
        return self.cluster.view(record)

    def remove(self, cid: str) -> tuple[dict[str, Any], int]:
        """Stop and remove ``cid`` on its node and free its grant: ``(record, 200)``.

        When its node is down the request is kept and carried out when the node returns: ``(record, 202)``;
        the grant stays until then, since the container may still be running there.
        """
        record = self.cluster.get(cid)
        if record.state is State.QUEUED:
            return self.cluster.view(self.cluster.withdraw(cid)), 200
        if record.state is State.REMOVED:
            return self.cluster.view(record), 200
        if record.state in LIVE and not self.cluster.node_ready(record.node):
            return self.cluster.view(self.cluster.request_removal(cid)), 202
        if record.state is State.CREATING and not record.remove_requested:
            # its node may be creating it right now: removing "nothing" would free bytes it is about to use
            why = "it is being created: done once it is"
            return self.cluster.view(self.cluster.request_removal(cid, why)), 202
        if record.container_id is not None or record.state in LIVE:
            self._remove_on_node(record.node, record.id)
        reason = "removed on request" if record.state in LIVE else record.reason
        return self.cluster.view(self.cluster.finish(cid, State.REMOVED, reason=reason)), 200

    def forget_node(self, name: str) -> dict[str, Any]:
        """Forget a node that is down, with its binding: its agent must join again to come back."""
        if self.cluster.node_ready(name):
            raise Conflict(f"node {name} is up; stop its agent first, then forget it")
        known = self.cluster.forget_node(name)
        bound = self.admission.forget(name)
        if not (known or bound):
            raise NotFound(f"no node named {name!r}")
        log.info("forgot node %s and its binding", name)
        return {"name": name, "forgotten": True}

    # --- the dispatcher ----------------------------------------------------------------------
    def _dispatch_loop(self) -> None:
        """Place queued requests whenever room may have freed, and start them on their nodes."""
        while not self._stopping.is_set():
            self.cluster.wake.wait(defaults.DISPATCH_TICK)
            if self._stopping.is_set():
                return
            try:
                started, victims = self.cluster.dispatch()
            except Exception:  # never let one bad pass stop the queue
                log.exception("dispatch failed; trying again")
                time.sleep(defaults.DISPATCH_TICK)
                continue
            for record in started:
                if record.state is not State.CREATING:
                    continue  # ended (or confirmed) since the walk that placed it: nothing to start
                if record.hook:
                    self._answer_hook(record.id, self._grant_reply(record))
                else:
                    self._workers.submit(self._start_placed, record)
            self._settle_hook_waiters()
            for victim in victims:
                self._workers.submit(self._preempt, victim)

    def _answer_hook(self, grant: str, reply: protocol.Reply) -> None:
        """Answer the node whose runtime hook waits for queued ``grant`` (sent from the link thread)."""
        with self._waiters_lock:
            waiter = self._hook_waiters.pop(grant, None)
        if waiter is not None:
            node, reply_to = waiter
            routing_id = self.cluster.routing_id_of(node)
            if routing_id is not None:
                self.link.send(routing_id, reply, reply_to=reply_to)

    def _settle_hook_waiters(self) -> None:
        """Tell the hooks whose queued requests ended unplaced (expired, withdrawn) why."""
        with self._waiters_lock:
            waiting = list(self._hook_waiters)
        for grant in waiting:
            try:
                record = self.cluster.get(grant)
            except NotFound:
                record = None
            if record is None or record.state not in (State.QUEUED, *LIVE):
                reason = record.reason if record is not None else "its queued request was forgotten"
                code = str(record.state) if record is not None else "not_found"
                self._answer_hook(grant, protocol.Reply(ok=False, error=protocol.ErrorBody(
                    code=code, message=f"gpumgr: the task waited in the queue and left it unplaced: {reason}")))

    @staticmethod
    def _grant_reply(record: Container) -> protocol.Reply:
        return protocol.Reply(ok=True, result={"grant": record.id, "gpus": record.gpus, "gpu_memory": record.gpu_memory,
                                               "on_overrun": record.on_overrun, "priority": record.priority,
                                               "preemptible": record.preemptible})

    def _start_placed(self, record: Container) -> None:
        try:
            self._start(record)
        except GpumgrError as exc:
            log.warning("queued request %s was placed but could not start: %s", record.id, exc.message)
        except Exception:
            log.exception("queued request %s was placed but could not start", record.id)

    def _preempt(self, victim: Container) -> None:
        """Stop a preemptible container chosen to make room; it ends as ``preempted`` once its node confirms."""
        try:
            if not self.cluster.node_ready(victim.node):
                self.cluster.request_removal(victim.id, "its node is down (preempted)")
                return
            self._remove_on_node(victim.node, victim.id)
            self.cluster.finish(victim.id, State.PREEMPTED)
        except GpumgrError as exc:
            log.warning("could not preempt %s on %s: %s", victim.id, victim.node, exc.message)
            self.cluster.preemption_failed(victim.id)

    def _remove_on_node(self, node: str, grant: str) -> None:
        if not self.cluster.node_ready(node):
            raise NoAgents(f"node {node} is down; its container is removed when the node comes back")
        message = protocol.Remove(grant=grant, stop_grace=min(defaults.STOP_GRACE, self.settings.remove_timeout / 2))
        reply = self.link.request(self.cluster.routing_id(node), message, self.settings.remove_timeout)
        if not reply.ok and (reply.error is None or reply.error.code != "not_found"):
            reason = reply.error.message if reply.error else "unknown error"
            raise AgentFailed(f"node {node} could not remove the container: {reason}")

    # --- link handlers (link thread) ---------------------------------------------------------
    def _on_message(self, peer: Peer, envelope: protocol.Envelope, message: protocol.Message) -> None:
        """Route one message from an agent; nothing reaches the map unless the sender's key speaks for its node."""
        if isinstance(message, protocol.Join):
            self._join(peer, envelope, message)
            return
        node = self._speaker(peer, envelope, message)
        if node is None:
            return
        routing_id = peer.routing_id
        if isinstance(message, protocol.Heartbeat):
            removals = self.cluster.heartbeat(node, routing_id, message.gpus, message.containers)
            if removals is None:
                self.link.send(routing_id, protocol.Reregister())
            self._send_removals(routing_id, removals or [])
        elif isinstance(message, protocol.Register):
            self._register(peer, envelope, message)
        elif isinstance(message, protocol.ContainerEvent):
            self._on_container_event(node, message)
        elif isinstance(message, protocol.Reserve):
            message.node = node
            answer = self._reserve(message, envelope.id)
            if answer is not None:
                self.link.send(routing_id, answer, reply_to=envelope.id)
        else:
            log.warning("dropped an unexpected %s message from node %s", envelope.type, node)

    def _speaker(self, peer: Peer, envelope: protocol.Envelope, message: protocol.Message) -> str | None:
        """The node ``peer``'s key is bound to, if the message speaks only for it; else None (dropped, logged)."""
        node = self.admission.node_of(peer.key)
        if node is None:
            log.warning("dropped %s from key %s, which was never admitted (an agent joins with a token first)",
                        envelope.type, peer.key[:8] or "(none)")
            return None
        claimed = getattr(message, "node", "") or node
        if claimed != node:
            log.warning("dropped %s from node %s's key: it speaks for node %s", envelope.type, node, claimed)
            return None
        return node

    def _join(self, peer: Peer, envelope: protocol.Envelope, message: protocol.Join) -> None:
        def settled(exc: GpumgrError | None) -> None:  # issue 20: answered once the binding is on disk
            if exc is not None:
                log.warning("refused an agent joining as node %s: %s", message.node, exc.message)
                reply = protocol.Reply(ok=False, error=protocol.ErrorBody(code=exc.code, message=exc.message))
            else:
                reply = protocol.Reply(ok=True, result={"node": message.node})
            self.link.send(peer.routing_id, reply, reply_to=envelope.id)

        self.admission.admit_later(peer.key, message.node, message.proof, settled)  # issue 20

    def _register(self, peer: Peer, envelope: protocol.Envelope, message: protocol.Register) -> None:
        before = self.cluster.routing_id_of(message.node)
        try:
            removals = self.cluster.register(message.node, peer.routing_id, message.runtime, message.gpus,
                                             message.containers)
        except GpumgrError as exc:
            log.warning("refused the registration of node %s: %s", message.node, exc.message)
            self.link.send(peer.routing_id, protocol.Refused(code=exc.code, message=exc.message), reply_to=envelope.id)
            return
        if before is not None and before != peer.routing_id:  # a new agent process: the old one answers nothing
            self.link.fail_peer(before, AgentFailed(f"the agent of node {message.node} restarted before answering"))
        self.cluster.refuse_adoptions(message.node, message.refused)
        for grant, memory in self.cluster.grant_mismatches(message.node, message.containers):
            log.info("node %s enforces grant %s at another figure than the map: telling it %d", message.node, grant,
                     memory)
            self.link.send(peer.routing_id, protocol.Resize(grant=grant, gpu_memory=memory))
        interval = self.settings.heartbeat_interval
        self.link.send(peer.routing_id, protocol.Registered(heartbeat_interval=interval), reply_to=envelope.id)
        self._send_removals(peer.routing_id, removals)
        log.info("node %s registered with %d GPUs", message.node, len(message.gpus))

    def _on_container_event(self, node: str, event: protocol.ContainerEvent) -> None:
        report = event.container
        try:
            record = self.cluster.get(report.grant)
        except GpumgrError:
            log.info("event for unknown grant %s on %s; its heartbeat will adopt it", report.grant, node)
            return
        if record.node != node:
            log.warning("dropped an event from node %s about grant %s of node %s", node, record.id, record.node)
            return
        self.cluster.note_peak(record.id, report)
        overrun = event.detail.get("overrun")
        if isinstance(overrun, dict):
            self.cluster.overrun(record.id, overrun)
        elif report.state == State.RUNNING and record.state is State.CREATING and record.hook:
            self.cluster.started(record.id, report)
        elif report.state in (State.EXITED, State.KILLED):
            state = State.KILLED if report.state == State.KILLED else State.EXITED
            # the overrun that killed it is on record already, under "overrun": do not repeat its keys at the top
            detail = {} if "overrun" in record.detail else event.detail
            self.cluster.finish(record.id, state, reason=report.reason, exit_code=report.exit_code,
                                detail=detail, finished_at=report.finished_at)

    def _reserve(self, request: protocol.Reserve, reply_to: str) -> protocol.Reply | None:
        """Grant memory on the asking node for a container its runtime hook is creating (a Swarm task).

        With ``queue`` a request that does not fit waits in the queue, and the answer (None here) is
        sent when it is placed, or when it expires just before the hook would give up.
        """
        record = self.cluster.live_grant_of(request.node, request.container_id)
        waiting = self.cluster.queued_for(request.node, request.container_id) if request.queue else None
        if waiting is not None:  # asked again while it waits: the newest question gets the answer
            with self._waiters_lock:
                self._hook_waiters[waiting.id] = (request.node, reply_to)
            return None
        if record is None:
            spec = PlacementSpec(
                memory=request.gpu_memory, count=request.gpus, placement=self.settings.placement,
                image=request.image or None, command=[], name=request.name or None, labels=request.labels,
                node=request.node, on_overrun=request.on_overrun or self.settings.on_overrun,
                container_id=request.container_id, hook=True, priority=request.priority,
                preemptible=request.preemptible,
            )
            try:
                record = self.cluster.submit(spec, deadline=defaults.HOOK_CONFIRM, queue=request.queue,
                                             queue_timeout=defaults.HOOK_QUEUE_TIMEOUT if request.queue else None)
                if record.state is State.QUEUED:
                    with self._waiters_lock:
                        self._hook_waiters[record.id] = (request.node, reply_to)
                    place = self.cluster.view(record)["queue"] or {}
                    self.events.record(EventType.QUEUED, f"task {request.name or request.container_id[:12]} is "
                                       f"pending: queued at position {place.get('position')}", node=request.node,
                                       container=record.id, **request.labels)
                    return None
            except GpumgrError as exc:
                self.events.record(EventType.FAILED, f"task {request.name or request.container_id[:12]} "
                                   f"waits: {exc.message}", node=request.node, container=None, **request.labels)
                return protocol.Reply(ok=False, error=protocol.ErrorBody(**exc.to_dict()))
        return self._grant_reply(record)

    def _send_removals(self, routing_id: bytes, grants: list[str]) -> None:
        for grant in grants:
            log.info("removing orphaned container of grant %s", grant)
            self.link.send(routing_id, protocol.Remove(grant=grant))

    def _on_tick(self) -> None:
        now = time.monotonic()
        if now >= self._next_sweep:
            self._next_sweep = now + self.settings.heartbeat_interval / 2
            for name in self.cluster.sweep(now):
                log.warning("node %s missed %d heartbeats: marked down", name, self.settings.heartbeat_liveness)
