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
from dataclasses import dataclass, field
from typing import Any

from gpumgr.manager.events import EventLog
from gpumgr.manager.scheduler import FreeIndex, GpuSlot, Placement, Request, place
from gpumgr.manager.views import container_view, node_view
from gpumgr.wire import defaults
from gpumgr.wire.errors import GpuConflict, NotFound
from gpumgr.wire.names import LIVE, EventType, Label, State
from gpumgr.wire.protocol import ContainerReport, GpuInfo, GpuSample
from gpumgr.wire.units import format_bytes

log = logging.getLogger(__name__)




@dataclass(eq=False)
class Gpu(GpuSlot):
    """A GPU on the map: the scheduler's slot plus what the API shows."""

    name: str = ""
    used: int = 0
    holders: set[str] = field(default_factory=set)


@dataclass
class Node:
    """A host with an agent."""

    name: str
    routing_id: bytes
    runtime: str
    gpus: list[Gpu]
    ready: bool = True
    last_seen: float = field(default_factory=time.time)
    last_seen_mono: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class Container:
    """The manager's record of one container and its grant."""

    id: str
    name: str
    node: str
    gpus: list[str]
    gpu_memory: int
    image: str | None = None
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    on_overrun: str = "kill"
    state: State = State.CREATING
    container_id: str | None = None
    exit_code: int | None = None
    reason: str | None = None
    created_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    usage: dict[str, int] = field(default_factory=dict)
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PlacementSpec:
    """A validated request to run a container (see the REST API)."""

    memory: int
    count: int
    placement: str
    image: str | None
    command: list[str]
    name: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    node: str | None = None
    on_overrun: str = "kill"
    container_id: str | None = None


class Cluster:
    """Nodes, GPUs and grants; see the module docstring for the rules."""

    def __init__(self, events: EventLog | None = None, *, headroom: int = 0,
                 down_after: float = defaults.NODE_DOWN_AFTER) -> None:
        self.events = events or EventLog()
        self.headroom = headroom
        self.down_after = down_after
        self._lock = threading.RLock()
        self._index = FreeIndex()
        self._nodes: dict[str, Node] = {}
        self._gpus: dict[str, Gpu] = {}
        self._containers: dict[str, Container] = {}
        self._finished: deque[str] = deque()
        self.map_max_age = defaults.MAP_MAX_AGE
        self._map_version = 0
        self._map_cache: tuple[int, float, bytes] | None = None

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
            if node is not None:
                self._set_ready(node, False, quiet=True)
            node = Node(name, routing_id, runtime, [self._gpu_for(name, info) for info in gpus])
            self._nodes[name] = node
            self._set_ready(node, True)
            return self._reconcile(node, containers)

    def heartbeat(self, name: str, routing_id: bytes, samples: list[GpuSample],
                  containers: list[ContainerReport]) -> list[str] | None:
        """Take one heartbeat; return grants to remove on that node, or None if the node is unknown."""
        with self._lock:
            node = self._nodes.get(name)
            if node is None:
                return None
            node.routing_id, node.last_seen, node.last_seen_mono = routing_id, time.time(), time.monotonic()
            if not node.ready:
                self._set_ready(node, True)
            for sample in samples:
                gpu = self._gpus.get(sample.uuid)
                if gpu is not None and gpu.node == name:
                    gpu.used, gpu.unmanaged = sample.memory_used, sample.memory_unmanaged
                    self._index.update(gpu)
            return self._reconcile(node, containers)

    def forget_node(self, name: str) -> bool:
        """Remove a node that is down from the map; its live grants end as ``removed``. False if unknown."""
        with self._lock:
            node = self._nodes.get(name)
            if node is None:
                return False
            self._set_ready(node, False, quiet=True)
            for record in [c for c in self._containers.values() if c.node == name and c.state in LIVE]:
                self._finish(record, State.REMOVED, "its node was forgotten", None, {})
            for gpu in node.gpus:
                if self._gpus.get(gpu.uuid) is gpu:
                    del self._gpus[gpu.uuid]
            del self._nodes[name]
            self._map_version += 1
        self.events.record(EventType.NODE_DOWN, f"node {name} was forgotten", node=name)
        return True

    def sweep(self, now: float | None = None) -> list[str]:
        """Mark nodes silent for longer than ``down_after`` as down; return their names."""
        now = time.monotonic() if now is None else now
        with self._lock:
            stale = [n for n in self._nodes.values() if n.ready and now - n.last_seen_mono > self.down_after]
            for node in stale:
                self._set_ready(node, False)
            return [n.name for n in stale]

    def routing_id(self, name: str) -> bytes:
        """Where the link reaches ``name``'s agent."""
        with self._lock:
            return self._nodes[name].routing_id

    def node_ready(self, name: str) -> bool:
        """Whether ``name`` is registered and heartbeating."""
        with self._lock:
            node = self._nodes.get(name)
            return node is not None and node.ready

    # --- grants ------------------------------------------------------------------------------
    def reserve(self, spec: PlacementSpec) -> Container:
        """Choose GPUs for ``spec`` and grant the memory at once; the record starts as ``creating``."""
        request = Request(spec.memory, spec.count, spec.node, Placement(spec.placement))
        with self._lock:
            slots = place(self._index, request)
            cid = os.urandom(8).hex()
            record = Container(
                id=cid, name=spec.name or f"gpumgr-{cid}", node=slots[0].node, gpus=[s.uuid for s in slots],
                gpu_memory=spec.memory, image=spec.image, command=spec.command, env=spec.env,
                labels=spec.labels, on_overrun=spec.on_overrun, container_id=spec.container_id,
            )
            self._containers[cid] = record
            self._grant(record)
        self.events.record(EventType.PLACED, f"{format_bytes(spec.memory)} on {', '.join(record.gpus)}",
                           node=record.node, container=cid)
        return record

    def started(self, cid: str, report: ContainerReport) -> Container:
        """The agent created and started ``cid``."""
        with self._lock:
            record = self._get(cid)
            record.container_id = report.container_id
            if record.state is not State.CREATING:
                return record
            record.state = State.RUNNING
        self.events.record(EventType.STARTED, f"container {report.container_id[:12]} running",
                           node=record.node, container=cid)
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

    def finish(self, cid: str, state: State, *, reason: str | None = None, exit_code: int | None = None,
               detail: dict[str, Any] | None = None) -> Container:
        """Move ``cid`` to a final state and free its grant if it still held one."""
        with self._lock:
            record = self._get(cid)
            self._finish(record, state, reason, exit_code, detail or {})
            return record

    def overrun(self, cid: str, detail: dict[str, Any]) -> Container:
        """An agent found ``cid`` over its grant: record it; if it is being killed or stopped, free the grant now."""
        with self._lock:
            record = self._get(cid)
            record.detail["overrun"] = detail
            if detail.get("action") in ("kill", "stop"):
                # Already final means its exit report came first; either way it is not "reported only".
                if record.state in LIVE:
                    self._finish(record, State.KILLED, str(detail.get("reason", "gpu_memory_exceeded")), None, detail)
                return record
        self.events.record(EventType.OVERRUN, f"{detail.get('reason')}: {detail.get('observed')} bytes on "
                           f"{detail.get('gpu')} over a grant of {detail.get('grant_bytes')} (reported only)",
                           node=record.node, container=cid, **detail)
        return record

    def fail(self, cid: str, reason: str) -> Container:
        """Creation failed: free the grant and keep the reason."""
        return self.finish(cid, State.FAILED, reason=reason)

    # --- reads -------------------------------------------------------------------------------
    def get(self, cid: str) -> Container:
        """The record of ``cid``; raises NotFound."""
        with self._lock:
            return self._get(cid)

    def containers(self, state: str | None = None, node: str | None = None) -> list[Container]:
        """Records, oldest first, optionally filtered."""
        with self._lock:
            return [c for c in self._containers.values()
                    if (state is None or c.state == state) and (node is None or c.node == node)]

    def view(self, record: Container) -> dict[str, Any]:
        """``record`` as the REST API shows it, with each GPU's index and name."""
        with self._lock:
            refs = {u: {"uuid": u, "index": g.index, "name": g.name} for u in record.gpus if (g := self._gpus.get(u))}
            return container_view(record, refs)

    def nodes_view(self) -> list[dict[str, Any]]:
        """The machine × GPU map as ``GET /v1/nodes`` shows it."""
        with self._lock:
            return [node_view(n) for n in self._nodes.values()]

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
        for gpu in node.gpus:
            (self._index.add if ready and gpu not in self._index else self._index.discard)(gpu)
        if not quiet:
            kind = EventType.NODE_UP if ready else EventType.NODE_DOWN
            self.events.record(kind, f"node {node.name} is {'ready' if ready else 'down'}", node=node.name)

    def _grant(self, record: Container) -> None:
        self._map_version += 1
        for uid in record.gpus:
            gpu = self._gpus[uid]
            gpu.reserved += record.gpu_memory
            gpu.holders.add(record.id)
            self._index.update(gpu)

    def _release(self, record: Container) -> None:
        self._map_version += 1
        for uid in record.gpus:
            gpu = self._gpus.get(uid)
            if gpu is not None and record.id in gpu.holders:
                gpu.reserved -= record.gpu_memory
                gpu.holders.discard(record.id)
                self._index.update(gpu)

    def _finish(self, record: Container, state: State, reason: str | None, exit_code: int | None,
                detail: dict[str, Any]) -> None:
        was_live = record.state in LIVE
        if not was_live and state is not State.REMOVED:
            # a late exit report for a container already recorded as finished: keep its exit code only
            record.exit_code = record.exit_code if record.exit_code is not None else exit_code
            return
        if was_live:
            self._release(record)
        record.state = state
        record.reason = reason or record.reason
        record.exit_code = exit_code if exit_code is not None else record.exit_code
        record.detail.update(detail)
        record.finished_at = record.finished_at or time.time()
        self._finished.append(record.id)
        self._forget_oldest()
        kind = _FINAL_EVENTS.get(state, EventType.EXITED)
        text = f"{state}" + (f": {reason}" if reason else "")
        text += f" (exit {exit_code})" if exit_code is not None else ""
        self.events.record(kind, text, node=record.node, container=record.id, **detail)

    def _forget_oldest(self) -> None:
        while len(self._finished) > defaults.FINISHED_KEPT:
            old = self._containers.get(self._finished.popleft())
            if old is not None and old.state not in LIVE:
                del self._containers[old.id]

    def _reconcile(self, node: Node, reports: list[ContainerReport]) -> list[str]:
        removals, seen = [], set()
        for report in reports:
            seen.add(report.grant)
            record = self._containers.get(report.grant)
            if record is not None and record.node != node.name:
                log.warning("node %s reports grant %s of node %s; ignored", node.name, report.grant, record.node)
            elif record is None:
                self._adopt(node, report)
            elif record.state in LIVE:
                self._refresh(record, report)
            elif record.state in (State.FAILED, State.REMOVED) and report.state == State.RUNNING:
                removals.append(report.grant)
        holders = {cid for gpu in node.gpus for cid in gpu.holders if cid not in seen}
        for record in [self._containers[cid] for cid in sorted(holders)]:
            if record.state is State.RUNNING:
                self._finish(record, State.REMOVED, "container disappeared from its node", None, {})
        return removals

    def _refresh(self, record: Container, report: ContainerReport) -> None:
        record.usage = dict(report.usage)
        record.container_id = report.container_id
        if record.state is State.CREATING and report.state == State.RUNNING and record.labels.get(Label.TASK):
            # a Swarm task has no REST caller waiting to mark it running: its agent's report does
            record.state = State.RUNNING
            self.events.record(EventType.STARTED, f"task container {report.container_id[:12]} running",
                               node=record.node, container=record.id)
        if report.state in (State.EXITED, State.KILLED) and record.state is State.RUNNING:
            state = State.KILLED if report.state == State.KILLED else State.EXITED
            self._finish(record, state, report.reason, report.exit_code, {})

    def _adopt(self, node: Node, report: ContainerReport) -> None:
        running = report.state == State.RUNNING
        record = Container(
            id=report.grant, name=report.name, node=node.name, gpus=list(report.gpus), gpu_memory=report.gpu_memory,
            image=report.image or None, command=list(report.command), labels=dict(report.labels),
            on_overrun=report.on_overrun, state=State.RUNNING if running else State(_final_state(report.state)),
            container_id=report.container_id, exit_code=report.exit_code, reason=report.reason,
            created_at=report.created_at or time.time(), usage=dict(report.usage),
        )
        known = [u for u in record.gpus if u in self._gpus and self._gpus[u].node == node.name]
        if running and len(known) != len(record.gpus):
            log.warning("container %s names GPUs %s that node %s does not report", record.id, record.gpus, node.name)
            record.gpus = known
        self._containers[record.id] = record
        if running and record.gpus:
            self._grant(record)
        self.events.record(EventType.ADOPTED, f"{report.state} container {report.container_id[:12]} re-adopted",
                           node=node.name, container=record.id)



_FINAL_EVENTS = {State.KILLED: EventType.KILLED, State.FAILED: EventType.FAILED, State.REMOVED: EventType.REMOVED}


def _final_state(state: str) -> str:
    return state if state in {s.value for s in State} and state not in LIVE else State.EXITED.value
