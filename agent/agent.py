"""The agent: one host's GPUs and containers, connected to the manager over the shared link.

It registers with its GPUs and its managed containers, heartbeats every interval with a fresh
memory sample, runs create/remove commands on a small thread pool (so a slow Docker call never
delays a heartbeat), and reports container exits as they happen. The link's thread only moves
frames and decides what is due: registrations and heartbeats are built (a GPU sample, the engine's
containers) on a worker thread of their own, the fence is written by its own thread, and a command
delivered twice runs once (:mod:`gpumgr.agent.ops`). ZeroMQ reconnects with capped
backoff on its own; registration is retried with the same backoff until the manager answers, and
repeated whenever the manager says it does not know this node (it restarted). The socket belongs to
a :class:`~gpumgr.wire.link.link.Link` (a DEALER) whose owner thread is the one that calls :meth:`Agent.run`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import zmq

from gpumgr import __version__
from gpumgr.agent.enforcer import Enforcer, EnforcerSettings
from gpumgr.agent.fence import Fence, FenceUnwritable
from gpumgr.agent.gpus.source import GpuSource
from gpumgr.agent.hook.hookrelay import MANAGER, HookRelay, bind_relay
from gpumgr.agent.identity import Identity
from gpumgr.agent.managers import (
    NO_LEADER,
    NO_LEADER_PAUSE,
    NOT_LEADER_PAUSE,
    SILENT_AFTER,
    ManagerSet,
    parse_managers,
)
from gpumgr.agent.meter import Sample, take_sample
from gpumgr.agent.ops import OpKey, Ops, op_key
from gpumgr.agent.runtimes import swarm_labels
from gpumgr.agent.runtimes.runtime import Managed, Runtime
from gpumgr.agent.screening import Screen, not_leader
from gpumgr.wire import defaults, protocol, security
from gpumgr.wire.epoch import Epoch
from gpumgr.wire.errors import AgentFailed, AgentTimeout, GpumgrError, PolicyDenied, ProtocolError
from gpumgr.wire.link.link import Link, LinkHooks, Peer

log = logging.getLogger(__name__)
DEFAULT_ENFORCEMENT = EnforcerSettings()


class Agent:
    """Connects ``node``'s GPUs (``source``) and containers (``runtime``) to the manager at ``endpoint``.

    ``endpoint`` may name several managers, comma-separated: the agent follows the leader among them
    (:mod:`gpumgr.agent.managers`) and refuses commands from deposed leaders (:mod:`gpumgr.agent.fence`).
    """

    def __init__(self, node: str, endpoint: str, source: GpuSource, runtime: Runtime, identity: Identity, *,
                 heartbeat_interval: float = defaults.HEARTBEAT_INTERVAL,
                 enforcement: EnforcerSettings | None = DEFAULT_ENFORCEMENT, hook_socket: str | None = None,
                 join_timeout: float = defaults.JOIN_TIMEOUT, labels: dict[str, str] | None = None,
                 advertise_addr: str = "") -> None:
        self.node, self.advertise_addr = node, advertise_addr  # where other hosts reach it (gangs)
        #: the node's labels from its operator, sent with each registration
        self.labels = dict(labels or {})
        self.endpoint = endpoint
        #: this process's id in registrations: the manager tells a restart (new id) from a reconnect
        self.instance = os.urandom(8).hex()
        self.source = source
        self.devices = source.devices()
        self.runtime = runtime
        self.interval = heartbeat_interval
        self.registered = threading.Event()
        self.hook_socket = hook_socket
        self.identity = identity
        #: the managers given (the leader among them is followed) and the highest leader epoch seen
        self.managers = ManagerSet(parse_managers(endpoint))
        self.fence = Fence(identity.folder)
        #: Why the agent stopped on its own (refused by the manager); None while it serves or after stop().
        self.failure: str | None = None
        self._join = identity.join
        self._join_deadline = time.monotonic() + join_timeout
        self._joining = False
        self._pool = ThreadPoolExecutor(defaults.AGENT_WORKERS, thread_name_prefix="agent-cmd")
        #: builds what the link's tick sends (one at a time, apart from commands, so a busy pool delays no beat)
        self._work = ThreadPoolExecutor(1, thread_name_prefix="agent-work")
        self._beating = self._registering = False
        #: the commands run, by operation: one delivered again is answered, not run again
        self.ops = Ops()
        self._expiring: Future[None] | None = None
        self._relay: HookRelay | None = None
        self._backoff, self._next_register, self._next_beat = defaults.RECONNECT_MIN, 0.0, 0.0
        screen = Screen(self.fence)  # drops a deposed leader's frames and tells it so
        hooks = LinkHooks(on_tick=self._tick, descriptors=self._descriptors, on_ready=self._on_ready,
                          on_stop=self._on_stop, screen=screen)
        # one CURVE connection to every manager given: registration and heartbeats go to the one followed,
        # commands are taken (fenced by epoch) from any, and answered on the connection they came on
        self.link = Link(zmq.DEALER, self.managers.current, self._handle, bind=False, configure=self._configure,
                         tick=defaults.LINK_TICK, hooks=hooks, name="agent-link",
                         peers=self.managers.endpoints if self.managers.several else None)
        screen.send = self.link.send
        self.enforcer = None if enforcement is None else Enforcer(source, self.devices, runtime, self.report_overrun,
                                                                  enforcement)

    # --- called from any thread --------------------------------------------------------------
    def report_change(self, managed: Managed) -> None:
        """Tell the manager at once that a managed container started or stopped (runtime callback)."""
        self.link.send(MANAGER, protocol.ContainerEvent(node=self.node, container=managed.report(),
                                                        detail=managed.detail))

    def report_overrun(self, managed: Managed, detail: dict[str, Any]) -> None:
        """Tell the manager at once that a container went over its grant and what was done (enforcer callback)."""
        self.link.send(MANAGER, protocol.ContainerEvent(node=self.node, container=managed.report(),
                                                        detail={"overrun": detail}))

    def stop(self) -> None:
        """Ask the owner thread to finish."""
        if self.enforcer is not None:
            self.enforcer.stop()
        self.link.stop()

    # --- owner thread ------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until :meth:`stop`; the calling thread becomes the socket's owner."""
        if self.enforcer is not None:
            threading.Thread(target=self.enforcer.run, name="enforcer", daemon=True).start()
        if self.hook_socket:
            self._relay = bind_relay(self.hook_socket, self.link, self.runtime, self.node, self.registered,
                                     self._pool)
        client = getattr(self.runtime, "client", None)
        if client is not None:  # the engine's API may be slow: never on the link's thread
            threading.Thread(target=swarm_labels.publish, args=(client, self.devices, self.runtime.mps),
                             name="swarm-labels", daemon=True).start()
        self.link.run()

    def _configure(self, sock: zmq.Socket[bytes]) -> None:
        _dealer_options(sock)
        security.connect_curve(sock, self.identity.keys, self.identity.server_public)

    def _tick(self) -> float:
        """Join once if needed, register until accepted, then heartbeat every interval.

        It only decides what is due: the worker thread builds each message and sends it. Returns the
        seconds until the next thing is due.
        """
        now = time.monotonic()
        if self._join is not None:
            return self._join_tick(now)
        if self.managers.several and self.registered.is_set() and self.link.unreachable_for() > SILENT_AFTER:
            self.registered.clear()
            self._move_on(f"nothing reached it for {SILENT_AFTER:g}s", silent=True)
        if not self.registered.is_set() and now >= self._next_register and not self._registering:
            if self.managers.unanswered():
                self._move_on("it did not answer this node's registration")
            self._next_register = now + jittered(max(self._backoff, defaults.ANSWER_WAIT))
            self._backoff = min(self._backoff * 2, defaults.RECONNECT_MAX)
            self._registering = True
            self._off_link(self._send_registration)
        if self.registered.is_set() and now >= self._next_beat and not self._beating:
            self._next_beat = now + self.interval
            self._beating = True
            self._off_link(self._send_heartbeat)
        if self._relay is not None:
            self._relay.expire()
        due = self._next_beat if self.registered.is_set() else self._next_register
        # one still being built wakes the link when it is sent: no need to come back sooner
        return max(due - time.monotonic(), defaults.LINK_TICK if self._beating or self._registering else 0.0)

    def _off_link(self, work: Callable[..., None], *args: Any) -> None:
        """Run ``work(*args)`` on the worker thread: a GPU sample, a disk or the engine never holds the link's."""
        def guarded() -> None:
            try:
                work(*args)
            except Exception:  # the next tick asks again
                log.exception("the agent's %s failed", getattr(work, "__name__", "work"))

        with contextlib.suppress(RuntimeError):  # stopping: the worker is gone, and nothing is due any more
            self._work.submit(guarded)

    def _send_registration(self) -> None:
        try:
            message = self._register_message()
        finally:
            self._registering = False
        self.link.send(MANAGER, message)

    def _send_heartbeat(self) -> None:
        try:
            message = self._heartbeat_message()
        finally:
            self._beating = False
        self.link.send(MANAGER, message)

    def _join_tick(self, now: float) -> float:
        if now >= self._join_deadline:
            self._fail(f"no answer from a manager at {self.endpoint} to this agent's join: check --manager, and "
                       "that the token was printed by that manager (its key is in the token)")
        elif not self._joining and self._join is not None:
            self._joining = True
            future = self.link.request_async(MANAGER, self._join, jittered(max(self._backoff, defaults.ANSWER_WAIT)))
            # its answer is recorded on disk: not on the link's thread
            future.add_done_callback(functools.partial(self._off_link, self._joined))
        return self._backoff

    def _joined(self, done: Future[protocol.Reply]) -> None:
        try:
            self._settle_join(done)
        finally:
            self._joining = False

    def _settle_join(self, done: Future[protocol.Reply]) -> None:
        if done.exception() is not None:  # unanswered: ZeroMQ may still be connecting; ask again
            self._backoff = min(self._backoff * 2, defaults.RECONNECT_MAX)
            # a frame that could not leave yet (still connecting) is no sign the manager is gone; long silence is
            if self.managers.several and self.link.unreachable_for() > SILENT_AFTER:
                self._move_on(f"nothing reached it for {SILENT_AFTER:g}s", silent=True)
            elif isinstance(done.exception(), AgentTimeout) and self.managers.unanswered():
                self._move_on("it did not answer this agent's join")
            return
        reply = done.result()
        if not_leader(reply) and self.managers.several:
            self._move_on("it does not lead: the join goes to the leader")
            return
        if not reply.ok:
            self._fail(f"the manager refused this agent: {reply.error.message if reply.error else 'no reason'}")
            return
        self.identity.remember(self.node)
        self._join, self._backoff, self._next_register = None, defaults.RECONNECT_MIN, 0.0
        log.info("joined the manager at %s as node %s", self.managers.current, self.node)

    def _move_on(self, why: str, *, silent: bool = False, pause: float = 0.0) -> None:
        """Talk to the next manager given (several were): the one in use is gone or does not lead.

        Requests still waiting on the one left (a Swarm task's grant) fail now: a manager that is gone or
        does not lead will not grant them, and the task's hook then refuses at once, so Swarm starts the
        task again and it asks the next leader, instead of holding the hook until it times out.
        """
        left = self.managers.current
        if self._join is None:  # a join's own retry is its callback's business
            self.link.fail_peer(MANAGER, AgentFailed(f"the manager at {left} was left before it answered ({why})"))
        self.link.reconnect(self.managers.advance(why, silent=silent))
        self._backoff, self._next_register = defaults.RECONNECT_MIN, time.monotonic() + pause

    def _fail(self, reason: str) -> None:
        log.error("%s", reason)
        self.failure = reason
        self.stop()

    def _descriptors(self) -> set[int]:
        return self._relay.descriptors() if self._relay is not None else set()

    def _on_ready(self, fds: set[int]) -> None:
        if self._relay is not None:
            self._relay.on_ready(fds)

    def _on_stop(self) -> None:
        if self._relay is not None:
            self._relay.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._work.shutdown(wait=False, cancel_futures=True)
        self.fence.close()

    def _followed(self, peer: Peer) -> bool:
        """Whether ``peer`` is the connection to the manager this agent follows (the only one, or the current)."""
        return peer.routing_id in (MANAGER, self.managers.current.encode())

    def _handle(self, peer: Peer, envelope: protocol.Envelope, message: protocol.Message) -> None:
        if isinstance(message, protocol.Registered | protocol.Refused | protocol.Reregister) and \
                not self._followed(peer):
            # a late answer of a manager this agent has left: registration is with the one it follows now
            log.info("a %s from %s, which this agent no longer follows, dropped", envelope.type,
                     peer.routing_id.decode(errors="replace"))
        elif isinstance(message, protocol.Registered):
            self.interval = message.heartbeat_interval
            if self.enforcer is not None:  # its protection of granted bytes keeps the manager's headroom clear too
                self.enforcer.bursts.headroom = message.headroom
            self.managers.answered()
            self.registered.set()
            self._backoff, self._next_beat = defaults.RECONNECT_MIN, 0.0
            log.info("registered with the manager at %s", self.managers.current)
        elif not_leader(message):
            if not self._followed(peer):
                return
            pause = NO_LEADER_PAUSE if getattr(message, "code", "") == NO_LEADER else NOT_LEADER_PAUSE
            if self.managers.several:
                self._move_on(f"it does not lead: {getattr(message, 'message', '')}", pause=jittered(pause))
            else:  # the one address given (a name in front of several managers): ask it again in a moment
                self._next_register = time.monotonic() + jittered(pause)
        elif isinstance(message, protocol.Refused):
            self._fail(f"the manager refused this node's registration: {message.message}")
        elif isinstance(message, protocol.Reregister):
            log.info("the manager does not know this node (it restarted?): registering again")
            self.registered.clear()
            # Swarm tasks waiting in the old manager's queue are not in the new one's: their hooks hear it now,
            # and Swarm starts them again, to queue afresh
            self.link.fail_peer(MANAGER, AgentFailed("the manager restarted while the task waited in its queue"))
        elif isinstance(message, protocol.Create):
            self._command(peer.routing_id, envelope, message, self._create)
        elif isinstance(message, protocol.Remove):
            self._command(peer.routing_id, envelope, message, self._remove)
        elif isinstance(message, protocol.Resize):
            self._command(peer.routing_id, envelope, message, self._resize)
        elif isinstance(message, protocol.Logs):
            self._pool.submit(self._answer, peer.routing_id, envelope.id, self._logs, message)
        elif isinstance(message, protocol.Signal):
            self._command(peer.routing_id, envelope, message, self._signal)
        elif isinstance(message, protocol.Reply):
            log.info("late reply %s from the manager dropped", envelope.reply_to)
        else:
            log.warning("dropped an unexpected %s message from the manager", envelope.type)

    def _register_message(self) -> protocol.Register:
        """Who we are, our GPUs and every managed container; compact reports if whole ones are over the bound."""
        health = self.source.health()
        gpus = [protocol.GpuInfo(uuid=d.uuid, index=d.index, name=d.name, memory_total=d.memory_total,
                                 compute_capability=d.compute_capability, links=dict(d.links),
                                 health=health.get(d.uuid, "")) for d in self.devices]
        managed = _newest_ends(self.runtime.managed(), defaults.FINISHED_KEPT)
        refused = list(self.runtime.refused)
        message = protocol.Register(node=self.node, runtime=self.runtime.kind, gpus=gpus,
                                    containers=[m.report() for m in managed], refused=refused,
                                    instance=self.instance, version=__version__, labels=self.labels,
                                    epoch=None if self.fence.highest is None else self.fence.highest.to_wire(),
                                    fence_unwritable=self.fence.unwritable(), advertise_addr=self.advertise_addr,
                                    mps=self.runtime.mps)
        try:
            protocol.encode(message)
        except ProtocolError:  # long commands or labels: the grants matter, those do not
            log.warning("registering %d containers without their commands and labels: whole, they are over "
                        "the message bound", len(managed))
            message.containers = [m.report(compact=True) for m in managed]
        return message

    def _heartbeat_message(self) -> protocol.Heartbeat:
        expire_creating = getattr(self.runtime, "expire_creating", None)
        if expire_creating is not None and (self._expiring is None or self._expiring.done()):
            # it asks the engine, which may be slow or away: never on the link thread
            self._expiring = self._pool.submit(self._guarded, expire_creating, defaults.TASK_START_TIMEOUT)
        sample = self._fresh_sample()
        self.runtime.note_usage(sample.usage)
        since = time.time() - defaults.ENDED_REPORTED_FOR
        containers = [m.status(sample.usage.get(m.grant)) for m in self.runtime.managed()
                      if m.finished_at is None or m.finished_at > since]
        return protocol.Heartbeat(node=self.node, gpus=sample.gpus, containers=containers,
                                  fence_unwritable=self.fence.unwritable())

    @staticmethod
    def _guarded(work: Callable[[float], None], argument: float) -> None:
        try:
            work(argument)
        except Exception:  # the engine is away or slow: the next heartbeat tries again
            log.warning("could not settle creating task grants now", exc_info=True)

    def _fresh_sample(self) -> Sample:
        """The enforcer's newest full sample when it is recent enough, else a new one."""
        enforcer = self.enforcer
        # The enforcer samples every sample_interval (plus the sample's own time and up to one poll);
        # accept that age, so heartbeats do not take a second sample of their own.
        if enforcer is not None and enforcer.latest is not None and \
                time.monotonic() - enforcer.latest_at < self.interval + enforcer.settings.sample_interval:
            return enforcer.latest
        return take_sample(self.source, self.devices, self.runtime)

    def _command(self, to: bytes, envelope: protocol.Envelope, message: Any,
                 work: Callable[[Any], dict[str, Any]]) -> None:
        """Run a command that acts on the pool; a delivery of one already run or running is only answered."""
        key = op_key(envelope, message)
        if key is not None:
            run, kept = self.ops.arrive(key, to, envelope.id)
            if kept is not None:
                log.info("a %s of grant %s delivered again: answered as before", envelope.type, key[0])
                self.link.send(to, kept, reply_to=envelope.id)
            if not run:
                return
        epoch = None if envelope.epoch is None else Epoch(*envelope.epoch)
        self._pool.submit(self._act, to, envelope.id, key, functools.partial(self._fenced, epoch, work), message)

    # --- worker threads ----------------------------------------------------------------------
    def _fenced(self, epoch: Epoch | None, work: Callable[[Any], dict[str, Any]], message: Any) -> dict[str, Any]:
        """``work(message)`` once ``epoch`` is on disk: a restarted agent still refuses every older leader."""
        self.fence.durable(epoch)
        return work(message)

    def _act(self, to: bytes, request_id: str, key: OpKey | None, work: Callable[[Any], dict[str, Any]],
             message: Any) -> None:
        """Run ``work`` and answer every delivery of it; a refusal that changed nothing is not kept."""
        reply = self._outcome(work, message)
        ids = [request_id]
        if key is not None:
            unwritable = reply.error is not None and reply.error.code == FenceUnwritable.code
            to, ids = self.ops.settle(key, reply, keep=not unwritable)
        for each in ids:
            self.link.send(to, reply, reply_to=each)

    def _create(self, message: protocol.Create) -> dict[str, Any]:
        return self.runtime.create(message.spec).report().model_dump()

    def _remove(self, message: protocol.Remove) -> dict[str, Any]:
        self.runtime.remove(message.grant, message.stop_grace)
        return {"grant": message.grant}

    def _resize(self, message: protocol.Resize) -> dict[str, Any]:
        managed = self.runtime.resize(message.grant, message.gpu_memory, message.gpu_memory_limit)
        log.info("grant %s resized to %d bytes per GPU (limit %d)", message.grant, message.gpu_memory, managed.limit)
        return managed.report().model_dump()

    def _logs(self, message: protocol.Logs) -> dict[str, Any]:
        return self.runtime.logs(message.grant, message.session, since=message.since, skip=message.skip,
                                 tail=None if message.tail < 0 else message.tail, limit=message.limit)

    def _signal(self, message: protocol.Signal) -> dict[str, Any]:
        self.runtime.signal(message.grant, message.signal)
        return {"grant": message.grant, "signal": message.signal}

    def _answer(self, to: bytes, request_id: str, work: Callable[[Any], dict[str, Any]], argument: Any) -> None:
        """Run ``work`` and answer ``request_id`` on the connection ``to`` it came on, whatever happens."""
        self.link.send(to, self._outcome(work, argument), reply_to=request_id)

    def _outcome(self, work: Callable[[Any], dict[str, Any]], argument: Any) -> protocol.Reply:
        """The reply to ``work(argument)``: its result, or the error it raised in the link's error shape."""
        try:
            reply = protocol.Reply(ok=True, result=work(argument))
        except PolicyDenied as exc:  # the rule travels in the message: the link's error shape has no room for it
            reply = protocol.Reply(ok=False, error=protocol.ErrorBody(code=exc.code, message=exc.wire_message()))
        except GpumgrError as exc:
            reply = protocol.Reply(ok=False, error=protocol.ErrorBody(code=exc.code, message=exc.message))
        except Exception as exc:  # report every failure to the manager rather than lose it
            log.exception("command failed")
            reply = protocol.Reply(ok=False, error=protocol.ErrorBody(code="runtime_failed", message=str(exc)))
        return reply


def jittered(seconds: float) -> float:
    """``seconds`` scaled by a random factor in [0.5, 1.5): a rack of agents retrying does not retry in step."""
    return seconds * (0.5 + random.random())  # spreading retries, not a secret


def _newest_ends(managed: list[Managed], keep: int) -> list[Managed]:
    """Every live container, and only the ``keep`` most recent ended ones (the manager keeps no more)."""
    ended = sorted((m for m in managed if m.finished_at is not None), key=lambda m: m.finished_at or 0.0)
    dropped = {m.grant for m in ended[:-keep]} if len(ended) > keep else set()
    return [m for m in managed if m.grant not in dropped]


def _dealer_options(sock: zmq.Socket[bytes]) -> None:
    """Connect lazily and keep only what the manager can take: queued frames wait for a connection."""
    # ZeroMQ's own heartbeats find a manager that stopped answering (paused, or its host gone) and drop
    # the connection, so frames stop leaving and the agent moves to the next manager
    for option, value in ((zmq.IMMEDIATE, 1), (zmq.SNDHWM, 1000),
                          (zmq.HEARTBEAT_IVL, int(defaults.HEARTBEAT_INTERVAL * 1000)),
                          (zmq.HEARTBEAT_TIMEOUT, int(defaults.NODE_DOWN_AFTER * 1000)),
                          (zmq.RECONNECT_IVL, int(defaults.RECONNECT_MIN * 1000)),
                          (zmq.RECONNECT_IVL_MAX, int(defaults.RECONNECT_MAX * 1000))):
        sock.setsockopt(option, value)
