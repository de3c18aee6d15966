"""What agents send the manager: joins, registrations, heartbeats, events, hooks.

Run on the manager's lanes (each node's messages in order), never on the link's thread. Nothing
reaches the model unless the sender's proven key is bound to the node the message speaks for. Each
handler updates the model and sends what the model says to send; every answer goes to the sender's
key, so it leaves on the key's newest connection.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from gpumgr.manager.model.bursts.limits import limit_of
from gpumgr.manager.model.reconcile import end_of
from gpumgr.manager.model.records import Container, PlacementSpec
from gpumgr.manager.tenancy.hook_policy import hook_tenant  # issue 22
from gpumgr.wire import defaults, protocol
from gpumgr.wire.epoch import Epoch
from gpumgr.wire.errors import GpumgrError, NotFound, OutcomeUnknown
from gpumgr.wire.link.link import Peer
from gpumgr.wire.names import LIVE, EventType, State

if TYPE_CHECKING:
    from gpumgr.manager.parts import ManagerParts

log = logging.getLogger(__name__)
#: The oldest agent whose commands this manager's match (a rolling upgrade moves agents first, then managers).
MIN_AGENT_VERSION = "0.3.0"  # 0.3.0: Register says whether the node runs MPS (compute shares)
#: What a manager that does not lead answers an agent: another leads, or none does (the agent's side:
#: ``gpumgr.agent.managers``).
NOT_LEADER = "not_leader"
NO_LEADER = "no_leader"
#: An agent's answer to a frame of an epoch below the one it follows (``gpumgr.agent.screening``).
STALE_EPOCH = "stale_epoch"
#: Why a node takes no grants while its agent cannot write its fence file (``gpumgr.agent.fence``).
FENCE_UNWRITABLE = "fence_unwritable"


def version_tuple(text: str) -> tuple[int, ...]:
    """``"1.2.3rc1"`` as ``(1, 2, 3)``: the leading digits of each dotted part, for ordering versions."""
    parts = []
    for part in text.split(".")[:4]:
        digits = ""
        for char in part:
            if not char.isdigit():
                break
            digits += char
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


class Inbound:
    """The manager's handler for the agent link (called on a lane, in order per node)."""

    def __init__(self, manager: ManagerParts) -> None:
        self.manager = manager
        self.cluster = manager.cluster
        #: queued hook requests (Swarm tasks waiting in their create): grant id → where the answer goes
        self._hook_waiters: dict[str, tuple[str, str]] = {}
        self._waiters_lock = threading.Lock()

    @property
    def link(self) -> Any:
        """The manager's agent link (the real one, or a test's stand-in)."""
        return self.manager.link

    def on_message(self, peer: Peer, envelope: protocol.Envelope, message: protocol.Message) -> None:
        """Route one message from an agent; nothing reaches the map unless the sender's key speaks for its node.

        A manager that does not lead takes nothing in: it tells the agent ``not_leader``, and the agent
        moves on to the next manager it was given.
        """
        if not self.manager.plane.is_leader:
            self._not_leader(peer, envelope, message)
            return
        if not self.manager.leading.loaded:  # elected a moment ago, still reading the store: the agent asks again
            log.info("dropped %s while loading the store after an election", envelope.type)
            return
        if isinstance(message, protocol.Join):
            self._join(peer, envelope, message)
            return
        node = self._speaker(peer, envelope, message)
        if node is None:
            return
        if isinstance(message, protocol.Heartbeat):
            answer = self.cluster.heartbeat(node, peer.routing_id, message.gpus, message.containers)
            if answer is None:
                self.link.send(peer.routing_id, protocol.Reregister(), key=peer.key)
                return
            self._note_fence(node, message.fence_unwritable)
            self._remove_orphans(peer, answer[0])
            self.manager.send(answer[1])
            return
        self.cluster.heard(node, peer.routing_id)  # any frame its key proves shows the node's connection
        if isinstance(message, protocol.Register):
            self._register(peer, envelope, message)
        elif isinstance(message, protocol.ContainerEvent):
            self._on_container_event(node, message)
        elif isinstance(message, protocol.Reserve):
            message.node = node
            reply = self._reserve(message, envelope.id)
            if reply is not None:
                self.link.send(peer.routing_id, reply, reply_to=envelope.id, key=peer.key)
        elif isinstance(message, protocol.Reply) and message.error is not None and \
                message.error.code == STALE_EPOCH:
            self._stale(node, message)
        else:
            log.warning("dropped an unexpected %s message from node %s", envelope.type, node)

    def _not_leader(self, peer: Peer, envelope: protocol.Envelope, message: protocol.Message) -> None:
        leader = self.manager.plane.leader()
        code, text = (NOT_LEADER, f"this manager does not lead; the leader's API is "
                                  f"{leader.get('api') or leader.get('name')}") if leader else \
            (NO_LEADER, "this manager does not lead, and no manager leads right now")
        if isinstance(message, protocol.Join | protocol.Reserve):
            error = protocol.ErrorBody(code=code, message=text)
            self.link.send(peer.routing_id, protocol.Reply(ok=False, error=error), reply_to=envelope.id, key=peer.key)
        elif isinstance(message, protocol.Register | protocol.Heartbeat):
            asks = self.manager.headless
            if asks is not None:  # the node its proven key is bound to, never the one the message claims
                asks.asked(peer.key, self.manager.admission.node_of(peer.key))  # noted before it is answered
            self.link.send(peer.routing_id, protocol.Refused(code=code, message=text), reply_to=envelope.id,
                           key=peer.key)

    def _speaker(self, peer: Peer, envelope: protocol.Envelope, message: protocol.Message) -> str | None:
        """The node ``peer``'s key is bound to, if the message speaks only for it; else None (dropped, logged)."""
        node = self.manager.admission.node_of(peer.key)
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
        """Admit the sender; answered once its binding is stored, which a writer thread does for many at once."""

        def settled(exc: GpumgrError | None) -> None:
            if exc is not None:
                log.warning("refused an agent joining as node %s: %s", message.node, exc.message)
                reply = protocol.Reply(ok=False, error=protocol.ErrorBody(code=exc.code, message=exc.message))
            else:
                reply = protocol.Reply(ok=True, result={"node": message.node})
            self.link.send(peer.routing_id, reply, reply_to=envelope.id, key=peer.key)

        self.manager.admission.admit_later(peer.key, message.node, message.proof, settled)

    def _register(self, peer: Peer, envelope: protocol.Envelope, message: protocol.Register) -> None:
        if self._outranked(peer, envelope, message):
            return
        if message.version and version_tuple(message.version) < version_tuple(MIN_AGENT_VERSION):
            why = (f"this manager needs gpumgr agent {MIN_AGENT_VERSION} or newer to understand its commands; node "
                   f"{message.node} runs {message.version}: upgrade its agent")
            log.warning("refused the registration of node %s: %s", message.node, why)
            self.link.send(peer.routing_id, protocol.Refused(code="agent_too_old", message=why), reply_to=envelope.id,
                           key=peer.key)
            return
        try:
            with self.cluster.lock:  # marked unusable before any placement can see it ready
                orphans, commands, restarted = self.cluster.register(
                    message.node, peer.routing_id, message.runtime, message.gpus, message.containers, key=peer.key,
                    instance=message.instance, labels=message.labels,  # issue 23
                    advertise_addr=message.advertise_addr, mps=message.mps)
                self._note_fence(message.node, message.fence_unwritable)
        except GpumgrError as exc:
            log.warning("refused the registration of node %s: %s", message.node, exc.message)
            self.link.send(peer.routing_id, protocol.Refused(code=exc.code, message=exc.message), reply_to=envelope.id,
                           key=peer.key)
            return
        if restarted:  # a new agent process: the old one answers nothing it was asked
            self.link.fail_peer(b"", OutcomeUnknown(f"the agent of node {message.node} restarted before answering: "
                                                    "what it was asked may have been done"), key=peer.key)
        self.cluster.refuse_adoptions(message.node, message.refused)
        settings = self.manager.settings
        registered = protocol.Registered(heartbeat_interval=settings.heartbeat_interval, headroom=settings.headroom)
        self.link.send(peer.routing_id, registered, reply_to=envelope.id, key=peer.key)
        self._remove_orphans(peer, orphans)
        self.manager.send(commands)
        log.info("node %s registered with %d GPUs", message.node, len(message.gpus))

    # --- epochs and the fence ----------------------------------------------------------------------
    def _outranked(self, peer: Peer, envelope: protocol.Envelope, message: protocol.Register) -> bool:
        """Refuse a registration from an agent that accepted a higher epoch than this leader's; it raises its own.

        The agent hears ``no_leader`` and asks again (this manager, or the next, then leads above its fence).
        """
        if message.epoch is None or not self.manager.plane.outranked(Epoch(*message.epoch)):
            return False
        why = (f"this manager's epoch is below {Epoch(*message.epoch)}, which node {message.node} accepted (the "
               "store's epochs went back): it raises the store's generation and stands again")
        log.warning("refused the registration of node %s: %s", message.node, why)
        self.link.send(peer.routing_id, protocol.Refused(code=NO_LEADER, message=why), reply_to=envelope.id,
                       key=peer.key)
        return True

    def _stale(self, node: str, reply: protocol.Reply) -> None:
        """An agent refused one of this leader's frames (``Registered``, ``Reregister``...) as ``stale_epoch``."""
        try:
            seen: Epoch | None = Epoch.from_wire(reply.result.get("epoch"))
        except ValueError:  # an agent that does not say which epoch it follows
            seen = None
        plane = self.manager.plane
        if seen is None:
            log.warning("node %s refused a frame of this leader: %s", node, reply.error.message if reply.error else "")
            plane.refused(STALE_EPOCH)
        elif plane.outranked(seen):
            log.warning("node %s follows epoch %s, above this leader's: raising the store's generation", node, seen)
        else:
            log.info("node %s refused a frame of an earlier epoch of this manager (it follows %s)", node, seen)

    def _note_fence(self, node: str, why: str) -> None:
        """Place nothing on ``node`` while its agent cannot write its fence file (and again once it can).

        Never a reason to step down: the agent refuses only this leader's commands, for a reason of its own.
        """
        found = self.cluster.ledger.nodes.get(node)
        if found is None or (not why and not found.unusable):  # the common case, without the model's lock
            return
        with self.cluster.lock:
            found = self.cluster.ledger.nodes.get(node)
            if found is None or not self.cluster.ledger.set_unusable(found, f"{FENCE_UNWRITABLE}: {why}" if why
                                                                    else ""):
                return
        if why:
            log.warning("node %s takes no grants: its agent cannot write its fence (%s)", node, why)
        else:
            log.warning("node %s takes grants again: its agent wrote its fence", node)

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
        elif report.state == State.RUNNING and record.state is State.CREATING:
            self.cluster.started(record.id, report)
            self.manager.send(self.cluster.follow_ups(record.id))
        elif report.state in (State.EXITED, State.KILLED):
            state, reason = end_of(report)  # an end with no exit code seen is no exit (see end_of)
            # the overrun that killed it is on record already, under "overrun": do not repeat its keys at the top
            detail = {} if "overrun" in record.detail else event.detail
            self.cluster.finish(record.id, state, reason=reason, exit_code=report.exit_code,
                                detail=detail, finished_at=report.finished_at, container_id=report.container_id)

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
            settings = self.manager.settings
            spec = PlacementSpec(
                memory=request.gpu_memory, count=request.gpus, placement=settings.placement,
                image=request.image or None, command=[], name=request.name or None, labels=request.labels,
                node=request.node, on_overrun=request.on_overrun or settings.on_overrun,
                container_id=request.container_id, hook=True, priority=request.priority,
                preemptible=request.preemptible, constraints=list(request.constraints),  # issue 23
                compute_share=request.compute_share,
            )
            try:
                spec = replace(spec, memory_limit=limit_of(request.gpu_memory, request.gpu_memory_limit))
                record, _ = self.cluster.submit(spec, queue=request.queue, queue_timeout=defaults.HOOK_QUEUE_TIMEOUT
                                                if request.queue else None,
                                                tenant=hook_tenant(self.manager.tenants, request))  # issue 22
                if record.state is State.QUEUED:
                    with self._waiters_lock:
                        self._hook_waiters[record.id] = (request.node, reply_to)
                    place = self.cluster.view(record)["queue"] or {}
                    self.manager.events.record(EventType.QUEUED, f"task {request.name or request.container_id[:12]}"
                                               f" is pending: queued at position {place.get('position')}",
                                               node=request.node, container=record.id, **request.labels)
                    return None
            except GpumgrError as exc:
                self.manager.events.record(EventType.FAILED, f"task {request.name or request.container_id[:12]} "
                                           f"waits: {exc.message}", node=request.node, container=None,
                                           **request.labels)
                return protocol.Reply(ok=False, error=protocol.ErrorBody(**exc.to_dict()))
        return self.grant_reply(record)

    # --- hook answers --------------------------------------------------------------------------
    def answer_hook(self, grant: str, reply: protocol.Reply) -> None:
        """Answer the node whose runtime hook waits for queued ``grant``."""
        with self._waiters_lock:
            waiter = self._hook_waiters.pop(grant, None)
        if waiter is not None:
            node, reply_to = waiter
            routing_id = self.cluster.routing_id_of(node)
            if routing_id is not None:
                self.link.send(routing_id, reply, reply_to=reply_to, key=self.cluster.node_key(node))

    def refuse_hook_waiters(self, why: str) -> int:
        """Refuse every runtime hook waiting in the queue (leadership ended): its agent asks the next leader."""
        with self._waiters_lock:
            waiting = list(self._hook_waiters)
        for grant in waiting:
            self.answer_hook(grant, protocol.Reply(ok=False, error=protocol.ErrorBody(
                code="not_leader", message=f"gpumgr: {why}; the task's request was dropped with the queue it waited "
                                           "in: ask the manager that leads now")))
        return len(waiting)

    def settle_hook_waiters(self) -> None:
        """Tell the hooks whose queued requests ended unplaced (expired, withdrawn) why."""
        with self._waiters_lock:
            waiting = list(self._hook_waiters)
        for grant in waiting:
            try:
                record: Container | None = self.cluster.get(grant)
            except NotFound:
                record = None
            if record is None or record.state not in (State.QUEUED, *LIVE):
                reason = record.reason if record is not None else "its queued request was forgotten"
                code = str(record.state) if record is not None else "not_found"
                self.answer_hook(grant, protocol.Reply(ok=False, error=protocol.ErrorBody(
                    code=code, message=f"gpumgr: the task waited in the queue and left it unplaced: {reason}")))

    @staticmethod
    def grant_reply(record: Container) -> protocol.Reply:
        """What a runtime hook is told of its grant; its tenant too, which the agent keeps with the grant, so a
        restarted manager re-adopts it as that tenant's."""
        return protocol.Reply(ok=True, result={"grant": record.id, "gpus": record.gpus, "gpu_memory": record.gpu_memory,
                                               "on_overrun": record.on_overrun, "priority": record.priority,
                                               "preemptible": record.preemptible, "tenant": record.tenant or "",
                                               "compute_share": record.compute_share,
                                               "gpu_memory_limit": record.gpu_memory_limit})

    def _remove_orphans(self, peer: Peer, grants: list[str]) -> None:
        for grant in grants:
            log.info("removing orphaned container of grant %s", grant)
            self.link.send(peer.routing_id, protocol.Remove(grant=grant), key=peer.key)
