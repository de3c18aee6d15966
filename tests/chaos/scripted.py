"""Scripted agents for the chaos harness: many on real DEALER sockets with real CURVE keys, one thread for all.

They speak the real protocol (join, register, heartbeat, answer commands once per operation id) to a
manager through their own chaos proxies; :mod:`tests.chaos.harness` runs them beside a real agent.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import zmq

from gpumgr.wire import defaults, protocol, security

log = logging.getLogger(__name__)

GiB = 1 << 30
#: how long a scripted agent waits for an answer before it asks again
RETRY = defaults.ANSWER_WAIT

# --- scripted agents ----------------------------------------------------------------------------------
@dataclass(eq=False)
class Scripted:
    """One scripted agent: its socket, where it is in its life, what it runs and every container it made."""

    node: str
    keys: security.KeyPair
    gpus: list[protocol.GpuInfo]
    sock: zmq.Socket[bytes]
    instance: str = field(default_factory=protocol.new_id)
    state: str = "joining"  # joining → registering → ready; back to registering when told to
    due: float = 0.0
    join_id: str = ""
    containers: dict[str, protocol.ContainerReport] = field(default_factory=dict)
    #: containers made per grant, over its whole life (a grant's container must be made once)
    made: Counter[str] = field(default_factory=Counter)
    #: answers by (grant, op): a command delivered again is answered again, not run again
    answered: dict[tuple[str, str], protocol.Reply] = field(default_factory=dict)


class ScriptedFleet:
    """Scripted agents on real DEALER sockets with real CURVE keys, every one served by one thread.

    Each joins with the token, registers ``gpus`` simulated GPUs, heartbeats every interval the manager
    gives, registers again with its whole report when told to, and answers ``Create``, ``Remove`` and
    ``Resize`` as an engine that did it at once (once per operation id, as the real agent does). ZeroMQ
    reconnects a socket after a cut by itself: the same key on a new connection, a new routing id.
    """

    def __init__(self, token: str, addresses: dict[str, str], gpus: int = 2, size: int = 24 * GiB) -> None:
        server_public, self._secret = security.parse_token(token)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._poller = zmq.Poller()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.interval = defaults.HEARTBEAT_INTERVAL
        self.agents: dict[str, Scripted] = {}
        self._by_socket: dict[zmq.Socket[bytes], Scripted] = {}
        for node, address in addresses.items():
            sock = self._ctx.socket(zmq.DEALER)
            for option, value in ((zmq.LINGER, 0), (zmq.IMMEDIATE, 1), (zmq.SNDHWM, 1000),
                                  (zmq.HEARTBEAT_IVL, 1000), (zmq.HEARTBEAT_TIMEOUT, 3000),
                                  (zmq.RECONNECT_IVL, 100), (zmq.RECONNECT_IVL_MAX, 5000)):
                sock.setsockopt(option, value)  # as the real agent's socket
            keys = security.KeyPair.generate()
            security.connect_curve(sock, keys, server_public)
            sock.connect(address)
            gpu_list = [protocol.GpuInfo(uuid=f"GPU-{node}-{i}", index=i, name="Scripted", memory_total=size)
                        for i in range(gpus)]
            self.agents[node] = self._by_socket[sock] = Scripted(node, keys, gpu_list, sock)
            self._poller.register(sock, zmq.POLLIN)
        self._thread = threading.Thread(target=self._serve, name="scripted-fleet", daemon=True)

    def start(self) -> ScriptedFleet:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        if not self._thread.is_alive():
            self._ctx.destroy(linger=0)

    def ready(self) -> bool:
        with self._lock:
            return all(a.state == "ready" for a in self.agents.values())

    def truth(self) -> dict[str, dict[str, protocol.ContainerReport]]:
        """What each node runs now: node → grant → its container."""
        with self._lock:
            return {node: dict(agent.containers) for node, agent in self.agents.items()}

    def made(self) -> dict[str, Counter[str]]:
        """How many containers each node ever made per grant."""
        with self._lock:
            return {node: Counter(agent.made) for node, agent in self.agents.items()}

    # the thread

    def _serve(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                now = time.monotonic()
                for agent in self.agents.values():
                    if agent.due <= now:
                        self._due(agent, now)
                wait = min((a.due for a in self.agents.values()), default=now + 0.05) - time.monotonic()
            for sock, _ in self._poller.poll(int(max(0.0, min(wait, 0.05)) * 1000)):
                with self._lock:
                    self._receive(self._by_socket[sock])

    def _due(self, agent: Scripted, now: float) -> None:
        if agent.state == "joining":
            agent.join_id = protocol.new_id()
            proof = security.join_proof(self._secret, agent.keys.public, agent.node)
            self._send(agent, protocol.Join(node=agent.node, proof=proof), msg_id=agent.join_id)
            agent.due = now + RETRY
        elif agent.state == "registering":
            self._send(agent, protocol.Register(node=agent.node, runtime="docker", gpus=agent.gpus,
                                                containers=list(agent.containers.values()), instance=agent.instance))
            agent.due = now + RETRY
        else:
            samples = [protocol.GpuSample(uuid=g.uuid, memory_used=0, memory_unmanaged=0) for g in agent.gpus]
            statuses = [protocol.ContainerStatus(grant=c.grant, container_id=c.container_id, state=c.state,
                                                 gpu_memory=c.gpu_memory) for c in agent.containers.values()]
            self._send(agent, protocol.Heartbeat(node=agent.node, gpus=samples, containers=statuses))
            agent.due = now + self.interval

    def _send(self, agent: Scripted, message: protocol.Message, **envelope: str | None) -> None:
        with contextlib.suppress(zmq.Again):  # not connected (IMMEDIATE): dropped, as the real agent's link drops it
            agent.sock.send(protocol.encode(message, **envelope), zmq.NOBLOCK)

    def _receive(self, agent: Scripted) -> None:
        while True:
            try:
                frame = agent.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._handle(agent, *protocol.decode(frame))
            except Exception:  # one bad frame costs its answer, never the other agents' thread
                log.exception("scripted agent %s: a frame from the manager failed", agent.node)

    def _handle(self, agent: Scripted, envelope: protocol.Envelope, message: protocol.Message) -> None:
        now = time.monotonic()
        if isinstance(message, protocol.Reply) and agent.state == "joining" and envelope.reply_to == agent.join_id:
            if message.ok:
                agent.state, agent.due = "registering", now
        elif isinstance(message, protocol.Registered):
            self.interval, agent.state, agent.due = message.heartbeat_interval, "ready", now
        elif isinstance(message, protocol.Reregister):
            agent.state, agent.due = "registering", now
        elif isinstance(message, protocol.Create | protocol.Remove | protocol.Resize):
            grant = message.spec.grant if isinstance(message, protocol.Create) else message.grant
            op = getattr(message, "op", "")  # a tree from before operation ids has none
            reply = agent.answered.get((grant, op)) if op else None
            if reply is None:
                reply = self._run(agent, message)
                if op:
                    agent.answered[(grant, op)] = reply
            self._send(agent, reply, reply_to=envelope.id)

    def _run(self, agent: Scripted, message: protocol.Create | protocol.Remove | protocol.Resize) -> protocol.Reply:
        if isinstance(message, protocol.Create):
            spec = message.spec
            report = agent.containers.get(spec.grant)
            if report is None:  # a grant's live container is answered again, never made twice
                agent.made[spec.grant] += 1
                report = protocol.ContainerReport(
                    grant=spec.grant, container_id=f"scripted-{spec.grant}-{agent.made[spec.grant]}", name=spec.name,
                    image=spec.image or "", gpus=spec.gpus, gpu_memory=spec.gpu_memory, state="running",
                    created_at=time.time())
                agent.containers[spec.grant] = report
            return protocol.Reply(ok=True, result=report.model_dump())
        if isinstance(message, protocol.Remove):
            agent.containers.pop(message.grant, None)
            return protocol.Reply(ok=True, result={"grant": message.grant})
        report = agent.containers.get(message.grant)
        if report is None:
            error = protocol.ErrorBody(code="not_found", message=f"no managed container holds {message.grant}")
            return protocol.Reply(ok=False, error=error)
        agent.containers[message.grant] = report.model_copy(update={"gpu_memory": message.gpu_memory})
        return protocol.Reply(ok=True, result=agent.containers[message.grant].model_dump())
