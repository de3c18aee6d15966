"""A scripted world for the real manager: a logical clock, a link that holds requests, and agents with engines.

The manager under test is the real one (:class:`gpumgr.manager.service.Manager`, its cluster, its
inbound handler); only its link is replaced by :class:`HeldLink`, which keeps every request until the
test decides its fate: answered, refused, lost (applied on the node, reply never arrives), dropped
(never applied), or answered again after it was settled. Like the real link it follows keys: a
frame for a routing id that is no longer connected (the agent reconnected) waits for the key's next
frame and leaves on its new connection then, or fails as never delivered at its deadline. Agents
are scripted: each owns an engine (grant → container) and speaks through the manager's real
inbound handler with a proven key. Time is :class:`LogicalClock`, advanced by the test.
:func:`engine_violations` is the invariant over the engines' truth: a container alive on a node on
the map always holds at least its enforced bytes, and after a sample no GPU's reserved bytes plus bursts
pass its total. Containers burst (use above their grants, up to their limits); each heartbeat first stops
bursters as the agent's protection does (:func:`protect`).
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from gpumgr.agent.bursts import bursters
from gpumgr.agent.meter import Sample
from gpumgr.agent.runtimes.runtime import Managed
from gpumgr.manager.clock import Clock
from gpumgr.wire import defaults, protocol, security
from gpumgr.wire.errors import AgentFailed, AgentTimeout, NoAgents
from gpumgr.wire.link.link import Peer
from gpumgr.wire.names import BURST_RECLAIMED, LIVE
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
    #: routing ids whose connection is up, each key's newest one, and what waits for a key's next frame
    connected: set[bytes] = field(default_factory=set)
    routes: dict[str, bytes] = field(default_factory=dict)
    parked: dict[str, list[Held]] = field(default_factory=dict)
    _ids: Any = field(default_factory=lambda: itertools.count(1))

    def start(self) -> None:
        """Nothing to bind."""

    def stop(self) -> None:
        """Nothing to close."""

    def take_lag(self) -> float:
        """No loop, so no gap between polls."""
        return 0.0

    def heard(self, key: str, routing_id: bytes) -> None:
        """A frame of ``key`` arrived on ``routing_id``: what waited for the key leaves on it, as the real link does."""
        self.routes[key] = routing_id
        for item in self.parked.pop(key, []):
            item.peer = routing_id
            if item.future.done():
                continue  # its request ended meanwhile: never sent unasked
            if item.deadline < 0:  # a plain frame
                self.sent.append((routing_id, item.message))
            else:
                self.held[next(self._ids)] = item

    def _route(self, peer: bytes, key: str) -> bytes | None:
        """Where a frame for ``peer`` (and ``key``) leaves, or None if that connection is gone."""
        target = self.routes.get(key, peer) if key else peer
        return target if target in self.connected else None

    def send(self, peer: bytes, message: protocol.Message, *, reply_to: str | None = None, key: str = "") -> None:
        target = self._route(peer, key)
        if target is not None:
            self.sent.append((target, message))
        elif key:  # a plain frame: nobody waits on it, so it waits for the key's next frame without a deadline
            self.parked.setdefault(key, []).append(Held(peer, message, Future(), key, -1.0))

    def request_async(self, peer: bytes, message: protocol.Message, timeout: float, *,
                      key: str = "") -> Future[protocol.Reply]:
        future: Future[protocol.Reply] = Future()
        target = self._route(peer, key)
        item = Held(target or peer, message, future, key, self.clock.mono + timeout)
        if target is not None:
            self.held[next(self._ids)] = item
        elif key:
            self.parked.setdefault(key, []).append(item)
        else:  # refused on the sending path, as ROUTER_MANDATORY makes the real link's
            future.set_exception(NoAgents("the agent is not connected now (Host unreachable); try again"))
        return future

    def fail_peer(self, peer: bytes, error: Exception, key: str = "") -> int:
        gone = [i for i, h in self.held.items() if (h.key == key if key else h.peer == peer)]
        for i in gone:
            self.held.pop(i).future.set_exception(error)
        return len(gone)

    def expire(self) -> None:
        """What the real link does on its tick: a frame that never left fails as not delivered, an unanswered
        request with AgentTimeout."""
        for key, items in list(self.parked.items()):
            late = [h for h in items if 0 <= h.deadline <= self.clock.mono]
            self.parked[key] = [h for h in items if h not in late]
            for item in late:
                if not item.future.done():
                    item.future.set_exception(NoAgents("not delivered: the node's connection was gone"))
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
    #: its percent of each GPU's SMs, from its labels (issue 36)
    compute_share: int = 0
    #: bytes it uses on each of its GPUs (what its heartbeats report), and its burst limit (0: its grant)
    used: int = 0
    limit: int = 0
    reason: str | None = None


class ScriptedAgent:
    """One node: its engine, its process instance, and what it says to the manager."""

    def __init__(self, manager: Any, name: str, gpus: int, size: int, mps: bool = False) -> None:
        self.manager, self.name, self.mps = manager, name, mps
        self.key = security.KeyPair.generate().public
        self.routing = itertools.count(1)
        self.routing_id = f"{name}-1".encode()
        self.instance = f"{name}-i1"
        self.gpus = [protocol.GpuInfo(uuid=f"{name}-g{i}", index=i, name="Sim", memory_total=size)
                     for i in range(gpus)]
        self.engine: dict[str, Box] = {}
        self.up = True
        #: what the last sample found broken: GPUs whose map reserves, with the bursts on it, more than it has
        self.after_sample: list[str] = []
        manager.link.connected.add(self.routing_id)
        self._join()

    def _join(self) -> None:
        secret = self.manager.admission.join_secret()
        proof = security.join_proof(secret, self.key, self.name)
        envelope, message = protocol.decode(protocol.encode(protocol.Join(node=self.name, proof=proof)))
        self.manager.link.heard(self.key, self.routing_id)
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
        self.manager.link.heard(self.key, self.routing_id)  # as the real link learns it, before the handler runs
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
                                         finished_at=None if b.state in LIVE else 1.7e9, compute_share=b.compute_share,
                                         gpu_memory_limit=b.limit,
                                         usage={g: b.used for g in b.gpus} if b.state in LIVE else {},
                                         reason=b.reason)
                for b in self.engine.values()]

    def register(self) -> None:
        self._say(protocol.Register(node=self.name, runtime="docker", gpus=self.gpus, containers=self.reports(),
                                    instance=self.instance, mps=self.mps))

    def heartbeat(self) -> None:
        """One sample: the agent's protection stops bursters first (agent/bursts.py's order), then it reports."""
        for grant in protect(self.engine, self.gpus):
            self.end(grant, "killed", None, BURST_RECLAIMED)
        now = self.manager.cluster.clock.monotonic()
        recent = {g for g, b in self.engine.items() if b.ended_at is None or now - b.ended_at <= 30}
        statuses = [protocol.ContainerStatus(grant=r.grant, container_id=r.container_id, state=r.state,
                                             exit_code=r.exit_code, gpu_memory=r.gpu_memory, usage=r.usage,
                                             gpu_memory_limit=r.gpu_memory_limit, reason=r.reason)
                    for r in self.reports() if r.grant in recent]
        samples = [protocol.GpuSample(uuid=g.uuid, memory_used=sum(b.used for b in self.engine.values()
                                                                   if b.state in LIVE and g.uuid in b.gpus),
                                      memory_unmanaged=0) for g in self.gpus]
        self._say(protocol.Heartbeat(node=self.name, gpus=samples, containers=statuses))
        self.after_sample = overbooked(self.manager.cluster.ledger, self.engine, self.name, [g.uuid for g in self.gpus])

    def burst(self, grant: str, use: int) -> None:
        """A running container's use changes to ``use`` per GPU, within its limit and what its GPUs have free."""
        box = self.engine[grant]
        sizes = {g.uuid: g.memory_total for g in self.gpus}
        for uuid in box.gpus:
            others = sum(b.used for b in self.engine.values() if b is not box and b.state in LIVE and uuid in b.gpus)
            use = min(use, sizes[uuid] - others)
        box.used = max(0, min(use, box.limit or box.gpu_memory))

    def reconnect(self) -> None:
        """Its socket reconnects: a new routing id, the same process (and key); the old connection is gone."""
        self.manager.link.connected.discard(self.routing_id)
        self.routing_id = f"{self.name}-{next(self.routing) + 1}".encode()
        self.manager.link.connected.add(self.routing_id)

    def restart(self) -> None:
        """Its process restarts: requests in flight to the old one are never applied."""
        self.instance = f"{self.instance}+"
        self.reconnect()

    def apply(self, message: protocol.Message) -> protocol.Reply:
        """What the engine does with a request, and the reply it would send."""
        if isinstance(message, protocol.Create):
            spec = message.spec
            self.engine[spec.grant] = Box(spec.grant, list(spec.gpus), spec.gpu_memory,
                                          compute_share=spec.compute_share, limit=spec.gpu_memory_limit)
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
            box.gpu_memory, box.limit = message.gpu_memory, message.gpu_memory_limit
            return protocol.Reply(ok=True)
        raise AssertionError(f"unexpected request {message!r}")

    def exit(self, grant: str, code: int) -> None:
        """A container ends by itself; its agent reports the exit."""
        self.end(grant, "exited", code)

    def end(self, grant: str, state: str, code: int | None, reason: str | None = None) -> None:
        """A container ends (by itself, or killed by its agent for ``reason``); its agent reports it."""
        box = self.engine[grant]
        box.state, box.exit_code, box.ended_at = state, code, self.manager.cluster.clock.monotonic()
        box.reason, box.used = reason, 0
        report = protocol.ContainerReport(grant=grant, container_id=f"c-{grant}", gpus=box.gpus, reason=reason,
                                          gpu_memory=box.gpu_memory, state=state, exit_code=code)
        self._say(protocol.ContainerEvent(node=self.name, container=report))


def protect(engine: dict[str, Box], gpus: list[protocol.GpuInfo]) -> list[str]:
    """The grants an agent's protection of granted bytes stops after a sample of ``engine``: per GPU, bursters in
    :func:`gpumgr.agent.bursts.bursters`' order while its ``max(use, request)`` sum passes its total."""
    live = {g: b for g, b in engine.items() if b.state == "running"}
    managed = {g: Managed(g, f"c-{g}", g, b.gpus, b.gpu_memory, gpu_memory_limit=b.limit) for g, b in live.items()}
    sample = Sample([], usage={g: {u: b.used for u in b.gpus} for g, b in live.items()})
    stopped: list[str] = []
    for gpu in gpus:
        spoken = sum(max(b.used, b.gpu_memory) for g, b in live.items() if gpu.uuid in b.gpus and g not in stopped)
        for victim, used in bursters(gpu.uuid, sample, managed, set(stopped)):
            if spoken <= gpu.memory_total:
                break
            stopped.append(victim.grant)
            spoken -= max(used, victim.gpu_memory)
    return stopped


def overbooked(ledger: Any, engine: dict[str, Box], node: str, uuids: list[str]) -> list[str]:
    """After a sample: GPUs whose map reserves, with what bursters use above their grants, more than they have.

    Only GPUs whose every holder runs in the engine at the figure the map holds are judged: a grant whose
    container the node has not created yet is one its agent cannot protect until it does.
    """
    found = []
    with ledger.lock:
        for uuid in uuids:
            gpu = ledger.gpus.get(uuid)
            if gpu is None or gpu.node != node:
                continue
            records = [ledger.records[c] for c in gpu.holders]
            if any((box := engine.get(r.id)) is None or box.state != "running" or box.gpu_memory != r.held
                   for r in records):
                continue
            if gpu.reserved + gpu.burst > gpu.total - gpu.headroom:
                found.append(f"GPU {uuid} reserves {gpu.reserved} and bursters use {gpu.burst} more after a sample: "
                             f"past its {gpu.total - gpu.headroom}")
    return found


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
    return model_violations(manager, engines) + share_violations(manager, agents) + [
        v for a in agents for v in a.after_sample]


def share_violations(manager: Any, agents: list[ScriptedAgent]) -> list[str]:
    """Issue 36: on a node on the map, the containers alive on each GPU hold compute shares of at most 100."""
    found = []
    with manager.cluster.ledger.lock:
        for agent in agents:
            if agent.name not in manager.cluster.ledger.nodes:
                continue
            for gpu in agent.gpus:
                shares = sum(b.compute_share for b in agent.engine.values() if b.state in LIVE and gpu.uuid in b.gpus)
                if shares > defaults.MAX_COMPUTE_SHARE:
                    found.append(f"GPU {gpu.uuid} of {agent.name} runs containers with compute shares of {shares}%")
    return found
