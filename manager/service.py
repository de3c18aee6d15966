"""The manager's use cases: place a container, remove or resize it, and tell the nodes what the model decided.

Every change is decided under the model's lock (:class:`~gpumgr.manager.model.cluster.Cluster`), which
returns the commands its nodes must be told; :meth:`Manager.send` sends them without blocking and
hands each reply (or its absence) back to the model, which may answer with follow-up commands. A
REST call that needs the outcome waits on its operation's ``done`` event, never on a socket.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from concurrent.futures import Future
from functools import partial
from typing import Any

from gpumgr.manager.clock import SYSTEM, Clock
from gpumgr.manager.config import ManagerSettings
from gpumgr.manager.control.ha import DEPOSED, Replicated, Solo, control_plane
from gpumgr.manager.control.store_etcd import EtcdQueueJournal, EtcdStore
from gpumgr.manager.events import EventLog
from gpumgr.manager.forward import DigestWatch
from gpumgr.manager.headless import Headless
from gpumgr.manager.inbound import Inbound
from gpumgr.manager.leading import Leading, NotLeader
from gpumgr.manager.link.admission import Admission
from gpumgr.manager.link.link import ManagerLink
from gpumgr.manager.metrics import Metrics
from gpumgr.manager.model.cluster import Cluster
from gpumgr.manager.model.gangs import GangSpec
from gpumgr.manager.model.records import Command, OpKind, PlacementSpec
from gpumgr.manager.tenancy.accounts import AccountTree, build_accounts
from gpumgr.manager.tenancy.policy import run_fields
from gpumgr.manager.tenancy.tenants import OPERATOR, Principal, Tenant, TenantBook, build_tenants
from gpumgr.wire import defaults, protocol
from gpumgr.wire.errors import (
    AgentTimeout,
    Conflict,
    Forbidden,
    GpumgrError,
    InvalidRequest,
    NoAgents,
    NotFound,
    OutcomeUnknown,
    StoreUnavailable,
)
from gpumgr.wire.link.lanes import Lanes
from gpumgr.wire.names import BURST_RECLAIMED, LIVE, State

log = logging.getLogger(__name__)


class Manager:
    """Owns the cluster model and the agent link; the REST API calls into it."""

    def __init__(self, settings: ManagerSettings, link: Any = None, clock: Clock = SYSTEM,
                 plane: Solo | Replicated | None = None) -> None:
        self.settings = settings
        self.tenants = TenantBook(build_tenants(settings.tenants, settings.token), settings.token)
        #: one manager on its state directory, or one of several on etcd (``--store``)
        self.plane = plane if plane is not None else control_plane(
            settings.store, settings.state_dir, manager_name(settings), api=settings.advertise_api or "",
            ca=settings.store_ca, cert=settings.store_cert, key=settings.store_key)
        shared = isinstance(self.plane.store, EtcdStore)
        self.admission = Admission(settings.state_dir, store=self.plane.store)
        self.events = EventLog(state_dir=self.admission.folder,
                               reserve=self.plane.store.reserve_event_ids if shared else None)
        self.cluster = Cluster(self.events, headroom=settings.headroom,
                               down_after=settings.heartbeat_interval * settings.heartbeat_liveness,
                               forget_after=settings.forget_after, aging=settings.queue_aging,
                               state_dir=None if shared else str(self.admission.folder), clock=clock)
        if isinstance(self.plane.store, EtcdStore):  # the queue's record is the shared store's, written by sync
            self.cluster.journal = self.cluster.life.journal = EtcdQueueJournal(self.plane.store)
        self.cluster.tenants = self.tenants
        self.cluster.accounts = accounts_of(settings)
        self.cluster.reconciler.disruption_threshold = settings.disruption_threshold
        low, _, high = settings.gang_ports.partition("-")
        self.cluster.gangs.port_range = (int(low), int(high))
        self.cluster.gangs.exit_grace, self.cluster.gangs.node_grace = settings.gang_exit_grace, settings.gang_grace
        self.cluster.gangs.reserve_after = settings.gang_reserve_after
        self.cluster.set_timeouts(settings.create_timeout, settings.remove_timeout)
        self.cluster.dispatcher.bursts.min_runtime = settings.burst_min_runtime
        self.metrics = Metrics(self.cluster)
        if not shared:  # several managers: the leader loads the queue and intents when elected
            self.cluster.load_intents(self.plane.store.intents())
            restored = self.cluster.restore_queue(self.cluster.journal.load())
            if restored:
                log.info("restored %d queued requests from %s", restored, self.cluster.journal.path)
        self.leading = Leading(self)
        self.inbound = Inbound(self)
        #: what agents send runs here, each node's messages in order, never on the link's thread
        self.lanes = Lanes(defaults.LINK_LANES, name="inbound")
        self.link = link if link is not None else ManagerLink(
            settings.agents, self.inbound.on_message, self.admission.keys, tick=settings.heartbeat_interval / 2,
            epoch=(lambda: self.plane.epoch) if shared else None, lanes=self.lanes)
        self.metrics.watch_link(self.link.take_lag, self.lanes.backlog)
        #: names this process's operations on the wire: op ids restart with the process, grants do not
        self._ops = os.urandom(4).hex()
        self._stopping = threading.Event()
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="dispatcher", daemon=True)
        self._sweeper = threading.Thread(target=self._sweep_loop, name="sweeper", daemon=True)
        #: several managers: a follower checks in the background that its tenants match the leader's
        self._digests = DigestWatch(self) if shared else None
        #: several managers: followers publish who asks them; a leader its agents cannot reach steps down
        self.headless = Headless(self) if isinstance(self.plane, Replicated) else None

    def start(self) -> None:
        """Bind the agent link and start placing queued requests as room frees."""
        self.lanes.start()
        self.link.start()
        self._dispatcher.start()
        self._sweeper.start()
        log.info("agent link bound on %s", self.link.bound_endpoint)
        self.plane.start()
        if self._digests is not None:
            self._digests.start()

    def stop(self) -> None:
        """Resign leadership, stop the dispatcher and close the agent link (the queue stays in its store)."""
        self.plane.stop()
        if self._digests is not None:
            self._digests.stop()
        self._stopping.set()
        self.cluster.wake.set()
        for thread in (self._dispatcher, self._sweeper):
            if thread.is_alive():
                thread.join(5)
        self.link.stop()
        self.lanes.stop()
        self.cluster.journal.close()

    def reload_tenants(self, settings: ManagerSettings) -> None:
        """Put new tenants, quotas, accounts and tokens in force (SIGHUP); raises ValueError, keeping the old ones."""
        tenants = build_tenants(settings.tenants, settings.token)
        accounts = accounts_of(settings)
        self.tenants.replace(tenants, settings.token)
        self.cluster.accounts = accounts
        self.settings = self.settings.model_copy(update={"tenants": settings.tenants, "token": settings.token,
                                                         "policy": settings.policy, "accounts": settings.accounts})
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
        self.leading.check()
        record, commands = self.cluster.submit(spec, queue=queue, queue_timeout=queue_timeout, tenant=tenant)
        if record.state is State.QUEUED and queue:
            return self.cluster.view(record), 202
        if record.state is State.QUEUED:  # bursters are reclaimed for it; the dispatcher places it and sends its create
            commands = self.cluster.dispatcher.bursts.await_placed(record, self.settings.create_timeout)
        else:
            self.send(commands)
        for command in commands:  # its create's answer (or its absence) settles the operation
            command.op.wait(self.settings.create_timeout + defaults.CREATE_MARGIN)
        if record.state is State.FAILED or record.state is State.CREATING:
            op_error = next((c.op.error for c in commands if c.op.error is not None), None)
            raise unknown(op_error) if op_error is not None else \
                OutcomeUnknown(f"node {record.node} did not confirm the container in time")
        return self.cluster.view(record), 201

    def resize(self, cid: str, memory: int | None, *, force: bool = False, principal: Principal = OPERATOR,
               limit: int | None = None) -> dict[str, Any]:
        """Grow or shrink ``cid``'s grant (or its limit) in place; its node enforces the new figures from its next
        sample."""
        self.leading.check()
        record = self.cluster.get_for(cid, principal)
        tenant = self.tenants.get(record.tenant) if record.tenant is not None else None
        was = record.gpu_memory
        record, command = self.cluster.begin_resize(cid, memory, force=force, tenant=tenant, limit=limit)
        try:
            self.sync_queue(strict=True)
        except GpumgrError:
            if command is None:  # a queued request's new figure never reached the store: not accepted, undone
                self.cluster.undo_queued_resize(cid, was)
            raise
        if command is not None:
            self.send([command])
            self._wait([command], self.settings.remove_timeout)
            if command.op.error is not None:
                raise unknown(command.op.error)
        return self.cluster.view(record)

    def create_gang(self, spec: GangSpec, *, queue: bool = False, queue_timeout: float | None = None,
                    tenant: Tenant | None = None) -> tuple[dict[str, Any], int]:
        """Place every member of a gang at once and have their nodes start them: ``(gang, 201)`` once all run.

        With ``queue`` a gang that does not fit now waits whole: ``(gang, 202)``. If one member's create fails,
        the others are removed and the call answers that failure as a single container's would.
        """
        self.leading.check()
        gang, commands = self.cluster.submit_gang(spec, queue=queue, queue_timeout=queue_timeout, tenant=tenant)
        if not commands:  # it waits: answered 202 only once its journal entry is durable, or not kept at all
            try:
                self.cluster.journal.sync()
            except (OSError, GpumgrError) as exc:
                self.cluster.remove_gang(gang.id)
                raise exc if isinstance(exc, GpumgrError) else \
                    StoreUnavailable(f"the queue could not be written ({exc}); nothing was kept") from exc
            return self.cluster.gang_views(OPERATOR, gang.id)[0], 202
        self.send(commands)
        for command in commands:
            command.op.wait(self.settings.create_timeout + defaults.CREATE_MARGIN)
        failed = next((c for c in commands if c.record.state is State.FAILED or c.record.state is State.CREATING),
                      None)
        if failed is not None:
            if failed.record.state is State.CREATING:  # unanswered: the gang cannot wait on it
                self.remove_gang(gang.id)
            self.cluster.wake.set()  # the others' removals go out with the next dispatch
            error = failed.op.error
            raise unknown(error) if error is not None else \
                OutcomeUnknown(f"node {failed.record.node} did not confirm member {failed.record.rank} in time")
        return self.cluster.gang_views(OPERATOR, gang.id)[0], 201

    def remove_gang(self, gid: str) -> dict[str, Any]:
        """End a gang: every member is stopped and removed (a waiting gang is withdrawn)."""
        self.leading.check()
        members = self.cluster.gang_views(OPERATOR, gid)[0]["members"]
        intents = {cid: intent for cid in members if (intent := self.cluster.removal_intent(cid)) is not None}
        if intents:  # written ahead, as a container's DELETE: a failover carries it out, a failure changes nothing
            self.write_intents(intents)
        gang, commands = self.cluster.remove_gang(gid)
        self.send(commands)
        if commands:
            self._wait(commands, self.settings.remove_timeout)
        return self.cluster.gang_views(OPERATOR, gang.id)[0]

    def remove(self, cid: str) -> tuple[dict[str, Any], int]:
        """Stop and remove ``cid`` on its node and free its grant: ``(record, 200)``.

        When that cannot be done now (its node is down, an operation is in flight on it, its container
        is still being created) the request is kept and carried out as soon as it can be: ``(record, 202)``.
        """
        self.leading.check()
        record = self.cluster.get(cid)
        if record.gang is not None and record.state in LIVE:  # a member's DELETE is its gang's, intents and all
            self.remove_gang(record.gang)
            record = self.cluster.get(cid)
            return self.cluster.view(record), 202 if record.state in LIVE or record.op is not None else 200
        intent = self.cluster.removal_intent(cid)
        if intent is not None:  # written ahead: a restart or a new leader carries it out; a failure changes nothing
            self.write_intents({cid: intent})
        record, commands = self.cluster.request_removal(cid, intent)
        self.sync_queue(strict=True)
        self.send(commands)
        if commands:
            self._wait(commands, self.settings.remove_timeout)
            error = commands[0].op.error
            if isinstance(error, OutcomeUnknown | NotLeader) and intent is None:
                raise unknown(error)
            if error is not None and not isinstance(error, AgentTimeout | NoAgents | OutcomeUnknown | NotLeader):
                raise error  # its node refused: the container is still there
            # unanswered, or never delivered: the desired state stands (in the store too), and the node's next
            # report carries it out, whichever manager leads then
        return self.cluster.view(record), 202 if record.state in LIVE or record.op is not None else 200

    def write_intents(self, intents: dict[str, dict[str, Any]]) -> None:
        """Write ``intents`` to the store (durable before it returns); the model keeps them once written."""
        try:
            self.plane.store.intend(intents)
        except OSError as exc:  # the state directory: a full or read-only disk
            raise StoreUnavailable(f"the state directory could not be written ({exc}); nothing was changed") \
                from exc
        self.cluster.intents_written(intents)

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

    # --- telling nodes -------------------------------------------------------------------------
    def send(self, commands: list[Command]) -> None:
        """Send each command still current to its node; its reply goes back to the model, never blocking here.

        The check and the send happen under the model's lock (sending only queues the frame), so a
        record that ended meanwhile is never created, removed or resized on its node. Only the leader
        sends; the link stamps each frame with its epoch, which agents check (a deposed leader's frames
        are refused with ``stale_epoch``).
        """
        for command in commands:
            future: Future[protocol.Reply] | None = None
            leads = self.plane.is_leader
            with self.cluster.lock:
                if not self.cluster.current_op(command.record.id, command.op):
                    continue
                node = self.cluster.ledger.nodes.get(command.record.node)
                if leads and node is not None and node.ready:
                    timeout = self.settings.create_timeout if command.kind is OpKind.CREATE \
                        else self.settings.remove_timeout
                    message = _message(command, self.settings, self.tenants, self._ops)
                    future = self.link.request_async(node.routing_id, message, timeout,
                                                     key=node.key)  # it follows the key's connection
            if future is None:  # its node is down (or this manager no longer leads): nothing was sent
                down = NoAgents(f"node {command.record.node} is down") if leads else \
                    NotLeader("this manager stopped leading before the command was sent")
                self.send(self.cluster.settle(command, None, down, sent=False))
            else:
                future.add_done_callback(partial(self._replied, command))

    def _replied(self, command: Command, future: Future[protocol.Reply]) -> None:
        try:
            reply, error = future.result(), None
        except Exception as exc:  # a timeout, or its agent restarted: the model decides what that means
            reply, error = None, exc
        if reply is not None and not reply.ok and reply.error is not None and reply.error.code in DEPOSED:
            log.warning("node %s refused a %s: %s", command.record.node, command.kind, reply.error.message)
            self.plane.refused(reply.error.code)
        try:
            self.send(self.cluster.settle(command, reply, error))
        except Exception:
            log.exception("settling the reply to %s of %s failed", command.kind, command.record.id)

    def _wait(self, commands: list[Command], timeout: float) -> None:
        for command in commands:
            command.op.wait(timeout + defaults.CREATE_MARGIN)

    # --- the dispatcher ----------------------------------------------------------------------
    def dispatch_once(self) -> None:
        """One pass: expire, place what fits, start what was placed, stop what is preempted (leading only)."""
        if not self.leading.placing:
            return
        commands, hooks = self.cluster.dispatch()
        # what left the queue is written before its creates go out, and a preemption before its Remove: a leader
        # that dies in between must not leave the next one a queued request whose container already runs, or a
        # victim it does not know to stop. Until both are written nothing goes out (held for the next pass).
        try:
            self.sync_queue(strict=True)
            pending = self.cluster.unwritten_intents()
            if pending:
                self.write_intents(pending)
        except GpumgrError as exc:
            log.warning("holding %d command(s) and %d hook grant(s): the store has not taken the queue's changes "
                        "yet (%s)", len(commands), len(hooks), exc.message)
            self.cluster.hold(commands, hooks)
            self._stopping.wait(defaults.DISPATCH_TICK)
            return
        for record in hooks:
            self.inbound.answer_hook(record.id, self.inbound.grant_reply(record))
        self.inbound.settle_hook_waiters()
        self.send(commands)

    def sync_queue(self, *, strict: bool = False) -> None:
        """Write the queue's changes to a shared store (outside the model's lock); a failure is retried later.

        A fenced write has already made this manager step down; an unreachable store keeps the changes
        for the next pass (the state directory's journal is written as it goes, and has nothing to do).
        With ``strict`` the failure is raised: a DELETE or PATCH of a queued request is answered only
        once the store holds it, or a new leader would bring the old request back.
        """
        if isinstance(self.cluster.journal, EtcdQueueJournal):
            try:
                self.cluster.journal.sync()
            except GpumgrError as exc:
                if strict:
                    raise
                log.warning("queue changes not written to the store yet: %s", exc.message)

    def _dispatch_loop(self) -> None:
        """Place queued requests whenever room may have freed, and start them on their nodes."""
        while not self._stopping.is_set():
            self.cluster.wake.wait(defaults.DISPATCH_TICK)
            if self._stopping.is_set():
                return
            try:
                self.dispatch_once()
            except Exception:  # never let one bad pass stop the queue
                log.exception("dispatch failed; trying again")
                self._stopping.wait(defaults.DISPATCH_TICK)

    def _sweep_loop(self) -> None:
        """Every half heartbeat, on a thread of its own (never the link's): see :meth:`sweep_once`."""
        while not self._stopping.wait(self.settings.heartbeat_interval / 2):
            try:
                self.sweep_once()
            except Exception:  # never let one bad pass stop the sweeps
                log.exception("the sweep failed; it runs again next time")

    def sweep_once(self) -> None:
        """Mark silent nodes down, end what missed its deadline, and send what follows (leading only)."""
        if self.headless is not None:  # before the zone rule: a leader cut off from its agents steps down
            self.headless.tick()
        if not self.plane.is_leader:
            return
        self._drop_spent_intents()
        down, commands = self.cluster.sweep()
        for name in down:
            log.warning("node %s missed %d heartbeats: marked down", name, self.settings.heartbeat_liveness)
        self.send(commands)


    def _drop_spent_intents(self) -> None:
        """Delete the intents carried out (or moot) from the store; a failure only tries again next sweep."""
        spent = self.cluster.take_spent_intents()
        if spent:
            try:
                self.plane.store.drop_intents(spent)
            except (GpumgrError, OSError) as exc:
                self.cluster.respend_intents(spent)
                log.info("%d spent intent(s) stay in the store until the next sweep: %s", len(spent), exc)


def unknown(error: GpumgrError) -> GpumgrError:
    """What a REST caller is told of an operation's error: a command sent and not answered is ``outcome_unknown``.

    (One never sent keeps its own code: ``not_leader`` or ``no_agents`` is safe to retry. One whose leadership
    ended while it waited was answered ``outcome_unknown`` already, by :meth:`Cluster.reset`.)
    """
    if isinstance(error, AgentTimeout):
        return OutcomeUnknown(f"{error.message}: the command was sent and not answered; it may have been carried out")
    return error


def manager_name(settings: ManagerSettings) -> str:
    """How this manager names itself to the others: its advertised API, else its host and process."""
    return settings.advertise_api or f"{socket.gethostname()}:{os.getpid()}"


def _message(command: Command, settings: ManagerSettings, tenants: TenantBook, ops: str) -> protocol.Message:
    """The link message that carries ``command`` out (a create carries the run spec and the policy in force).

    It names its operation (``ops``, this manager process's own prefix, and the operation's number), so an
    agent that gets it twice (a frame re-sent after a reconnect) applies it once.
    """
    record = command.record
    op = f"{ops}.{command.op.id}"
    if command.kind is OpKind.CREATE:
        return protocol.Create(spec=protocol.ContainerSpec(
            grant=record.id, name=record.name, image=record.image, command=record.command, env=record.env,
            labels=record.labels, gpus=record.gpus, gpu_memory=record.gpu_memory, on_overrun=record.on_overrun,
            gpu_memory_limit=record.gpu_memory_limit,
            created_at=record.created_at, tenant=record.tenant or "", priority=record.priority,
            preemptible=record.preemptible, compute_share=record.compute_share,
            **run_fields(record.spec.run, record.tenant, settings.policy, tenants),
        ), op=op)
    if command.kind is OpKind.RESIZE:
        return protocol.Resize(grant=record.id, gpu_memory=command.op.new, gpu_memory_limit=record.gpu_memory_limit,
                               op=op)
    # a reclaimed burster is killed at once: the bytes it holds are wanted by a request waiting now
    grace = 0.0 if record.desired_reason == BURST_RECLAIMED else min(defaults.STOP_GRACE, settings.remove_timeout / 2)
    return protocol.Remove(grant=record.id, stop_grace=grace, op=op)


def accounts_of(settings: ManagerSettings) -> AccountTree | None:
    """The accounts ``settings`` configure, each tenant in its leaf; None without ``accounts:``. Raises ValueError."""
    return build_accounts(settings.accounts, {name: c.account for name, c in settings.tenants.items()})
