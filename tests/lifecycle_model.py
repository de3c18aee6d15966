"""A scripted world for the real manager: a logical clock, a link that holds requests, and agents with engines.

The manager under test is the real one (:class:`gpumgr.manager.service.Manager`, its cluster, its
inbound handler); only its link is replaced by :class:`HeldLink`, which keeps every request until the
test decides its fate: answered, refused, lost (applied on the node, reply never arrives), dropped
(never applied), or answered again after it was settled. Agents are scripted: each owns an engine
(grant → container) and speaks through the manager's real inbound handler with a proven key. Time
is :class:`LogicalClock`, advanced by the test. :func:`engine_violations` is the invariant over the
engines' truth: a container alive on a node on the map always holds at least its enforced bytes.
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from gpumgr.manager.clock import Clock
from gpumgr.wire import protocol, security
from gpumgr.wire.errors import AgentFailed, AgentTimeout
from gpumgr.wire.link import Peer
from gpumgr.wire.names import LIVE
from tests.invariant import model_violations

GiB = 1 << 30


class LogicalClock(Clock):
    """Time that moves only when the test says so."""

    def __init__(self) -> None:
        self.mono, self.wall = 1000.0, 1.7e9

    def monotonic(self) -> float:
        return self.mono

    def time(self) -> float:
        return self.wall

    def advance(self, seconds: float) -> None:
        self.mono += seconds
        self.wall += seconds


@dataclass
class Held:
    """One request the manager sent, waiting for the test to decide its fate."""

    peer: bytes
    message: protocol.Message
    future: Future[protocol.Reply]
    key: str
    deadline: float


@dataclass
class HeldLink:
    """The manager's link, holding requests instead of sending frames."""

    clock: LogicalClock
    held: dict[int, Held] = field(default_factory=dict)
    sent: list[tuple[bytes, protocol.Message]] = field(default_factory=list)
    bound_endpoint: str = "held://"
    _ids: Any = field(default_factory=lambda: itertools.count(1))

    def start(self) -> None:
        """Nothing to bind."""

    def stop(self) -> None:
        """Nothing to close."""

    def send(self, peer: bytes, message: protocol.Message, *, reply_to: str | None = None) -> None:
        self.sent.append((peer, message))

    def request_async(self, peer: bytes, message: protocol.Message, timeout: float, *,
                      key: str = "") -> Future[protocol.Reply]:
        future: Future[protocol.Reply] = Future()
        self.held[next(self._ids)] = Held(peer, message, future, key, self.clock.mono + timeout)
        return future

    def fail_peer(self, peer: bytes, error: Exception, key: str = "") -> int:
        gone = [i for i, h in self.held.items() if (h.key == key if key else h.peer == peer)]
        for i in gone:
            self.held.pop(i).future.set_exception(error)
        return len(gone)

    def expire(self) -> None:
        """What the real link does on its tick: requests past their deadline fail with AgentTimeout."""
        for i in [i for i, h in self.held.items() if h.deadline <= self.clock.mono]:
            self.held.pop(i).future.set_exception(AgentTimeout("the peer did not answer in time"))


@dataclass
class Box:
    """A container in a scripted engine."""

    grant: str
    gpus: list[str]
    gpu_memory: int
    state: str = "running"
    exit_code: int | None = None
    #: when it ended (the manager's monotonic clock); heartbeats repeat an end for 30 s only, as agents do
    ended_at: float | None = None


class ScriptedAgent:
    """One node: its engine, its process instance, and what it says to the manager."""

    def __init__(self, manager: Any, name: str, gpus: int, size: int) -> None:
        self.manager, self.name = manager, name
        self.key = security.KeyPair.generate().public
        self.routing = itertools.count(1)
        self.routing_id = f"{name}-1".encode()
        self.instance = f"{name}-i1"
        self.gpus = [protocol.GpuInfo(uuid=f"{name}-g{i}", index=i, name="Sim", memory_total=size)
                     for i in range(gpus)]
        self.engine: dict[str, Box] = {}
        self.up = True
        self._join()

    def _join(self) -> None:
        secret = self.manager.admission.join_secret()
        proof = security.join_proof(secret, self.key, self.name)
        envelope, message = protocol.decode(protocol.encode(protocol.Join(node=self.name, proof=proof)))
        self.manager.inbound.on_message(Peer(self.routing_id, self.key), envelope, message)
        self._await_join_answer()
        self._obey()

    def _await_join_answer(self) -> None:
        """Take the join's answer, as an agent does before it registers: it comes once the binding is stored,
        from the admission's writer thread, so wait for it here (the rest of the model stays deterministic)."""
        sent = self.manager.link.sent
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            answer = next((i for i, (peer, message) in enumerate(list(sent))
                           if peer == self.routing_id and isinstance(message, protocol.Reply)), None)
            if answer is not None:
                del sent[answer]
                return
            time.sleep(0.001)
        raise AssertionError(f"node {self.name}'s join was never answered")

    def _say(self, message: protocol.Message) -> None:
        envelope, message = protocol.decode(protocol.encode(message))  # what crosses the wire, as it arrives
        self.manager.inbound.on_message(Peer(self.routing_id, self.key), envelope, message)
        self._obey()

    def _obey(self) -> None:
        """Carry out what the manager told this node without waiting for an answer (orphan removals)."""
        sent, self.manager.link.sent[:] = list(self.manager.link.sent), []
        for peer, message in sent:
            if peer == self.routing_id and isinstance(message, protocol.Remove):
                self.engine.pop(message.grant, None)
            elif isinstance(message, protocol.Reregister) and peer == self.routing_id:
                self.register()
            elif peer != self.routing_id:
                self.manager.link.sent.append((peer, message))

    def reports(self) -> list[protocol.ContainerReport]:
        return [protocol.ContainerReport(grant=b.grant, container_id=f"c-{b.grant}", gpus=b.gpus,
                                         gpu_memory=b.gpu_memory, state=b.state, exit_code=b.exit_code,
                                         finished_at=None if b.state in LIVE else 1.7e9)
                for b in self.engine.values()]

    def register(self) -> None:
        self._say(protocol.Register(node=self.name, runtime="docker", gpus=self.gpus, containers=self.reports(),
                                    instance=self.instance))

    def heartbeat(self) -> None:
        now = self.manager.cluster.clock.monotonic()
        recent = {g for g, b in self.engine.items() if b.ended_at is None or now - b.ended_at <= 30}
        statuses = [protocol.ContainerStatus(grant=r.grant, container_id=r.container_id, state=r.state,
                                             exit_code=r.exit_code, gpu_memory=r.gpu_memory)
                    for r in self.reports() if r.grant in recent]
        samples = [protocol.GpuSample(uuid=g.uuid, memory_used=0, memory_unmanaged=0) for g in self.gpus]
        self._say(protocol.Heartbeat(node=self.name, gpus=samples, containers=statuses))

    def reconnect(self) -> None:
        """Its socket reconnects: a new routing id, the same process (and key)."""
        self.routing_id = f"{self.name}-{next(self.routing) + 1}".encode()

    def restart(self) -> None:
        """Its process restarts: requests in flight to the old one are never applied."""
        self.instance = f"{self.instance}+"
        self.reconnect()

    def apply(self, message: protocol.Message) -> protocol.Reply:
        """What the engine does with a request, and the reply it would send."""
        if isinstance(message, protocol.Create):
            spec = message.spec
            self.engine[spec.grant] = Box(spec.grant, list(spec.gpus), spec.gpu_memory)
            report = protocol.ContainerReport(grant=spec.grant, container_id=f"c-{spec.grant}", gpus=spec.gpus,
                                              gpu_memory=spec.gpu_memory, state="running")
            return protocol.Reply(ok=True, result=report.model_dump())
        if isinstance(message, protocol.Remove):
            gone = self.engine.pop(message.grant, None)
            return protocol.Reply(ok=True) if gone is not None else protocol.Reply(
                ok=False, error=protocol.ErrorBody(code="not_found", message="no such container"))
        if isinstance(message, protocol.Resize):
            box = self.engine.get(message.grant)
            if box is None:
                return protocol.Reply(ok=False, error=protocol.ErrorBody(code="not_found", message="no such grant"))
            box.gpu_memory = message.gpu_memory
            return protocol.Reply(ok=True)
        raise AssertionError(f"unexpected request {message!r}")

    def exit(self, grant: str, code: int) -> None:
        """A container ends by itself; its agent reports the exit."""
        box = self.engine[grant]
        box.state, box.exit_code, box.ended_at = "exited", code, self.manager.cluster.clock.monotonic()
        report = protocol.ContainerReport(grant=grant, container_id=f"c-{grant}", gpus=box.gpus,
                                          gpu_memory=box.gpu_memory, state="exited", exit_code=code)
        self._say(protocol.ContainerEvent(node=self.name, container=report))


def refusal(code: str = "runtime_failed") -> protocol.Reply:
    """A node's definitive refusal."""
    return protocol.Reply(ok=False, error=protocol.ErrorBody(code=code, message="the engine refused"))


def lost() -> Exception:
    """What a request whose reply never came ends with."""
    return AgentTimeout("the peer did not answer in time")


def link_error() -> Exception:
    return AgentFailed("the agent restarted before answering")


def engine_violations(manager: Any, agents: list[ScriptedAgent]) -> list[str]:
    """The invariant (``tests/invariant.py``) over the model and these scripted engines."""
    engines = {a.name: {g: (b.state, b.gpu_memory) for g, b in a.engine.items()} for a in agents}
    return model_violations(manager, engines)
