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
from typing import Any

from gpumgr.manager.events import EventLog
from gpumgr.manager.records import Container, Gpu, Node, PlacementSpec
from gpumgr.manager.scheduler import FreeIndex, Placement, Request, place
from gpumgr.manager.views import container_view, node_view
from gpumgr.wire import defaults
from gpumgr.wire.errors import GpuConflict, NotFound
from gpumgr.wire.names import LIVE, REMOVING, EventType, State
from gpumgr.wire.protocol import ContainerReport, ContainerStatus, GpuInfo, GpuSample, RefusedAdoption
from gpumgr.wire.units import format_bytes

log = logging.getLogger(__name__)




class Cluster:
    """Nodes, GPUs and grants; see the module docstring for the rules."""

    def __init__(self, events: EventLog | None = None, *, headroom: int = 0,
                 down_after: float = defaults.NODE_DOWN_AFTER,
                 forget_after: float = defaults.NODE_FORGET_AFTER) -> None:
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
                    gpu.used, gpu.unmanaged = sample.memory_used, sample.memory_unmanaged
                    self._index.update(gpu)
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
        node's report of a hook-granted container), the grant is released by :meth:`sweep`.
        """
        request = Request(spec.memory, spec.count, spec.node, Placement(spec.placement))
        with self._lock:
            slots = place(self._index, request)
            cid = os.urandom(8).hex()
            record = Container(
                id=cid, name=spec.name or f"gpumgr-{cid}", node=slots[0].node, gpus=[s.uuid for s in slots],
                gpu_memory=spec.memory, image=spec.image, command=spec.command, env=spec.env,
                labels=spec.labels, on_overrun=spec.on_overrun, container_id=spec.container_id, hook=spec.hook,
                deadline=time.monotonic() + deadline,
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
            record.state, record.deadline = State.RUNNING, None
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
        self.events.record(EventType.OVERRUN, f"{detail.get('reason')}: {detail.get('observed')} bytes on "
                           f"{detail.get('gpu')} over a grant of {detail.get('grant_bytes')}: {what}",
                           node=record.node, container=cid, **detail)
        return record

    def request_removal(self, cid: str, why: str = "its node is down: done when it returns") -> Container:
        """``DELETE`` that cannot be done now (node down, container still being created): remember it.

        The grant stays: the container may exist or be about to. It is removed when its node reports
        it (or the create returns), and the grant ends when the node reports it gone.
        """
        with self._lock:
            record = self._get(cid)
            record.remove_requested = True
        self.events.record(EventType.REMOVED, f"removal requested while {why}",
                           node=record.node, container=cid, pending=True)
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
                detail: dict[str, Any], *, finished_at: float | None = None) -> None:
        """End a live record once: release its grant, keep why and when, and record its one final event."""
        if record.state not in LIVE:
            if state is State.REMOVED and record.state is not State.REMOVED:
                record.state = State.REMOVED  # deleted after it ended: its end stays as it was recorded
                self.events.record(EventType.REMOVED, "removed", node=record.node, container=record.id)
            elif record.exit_code is None:
                record.exit_code = exit_code  # a late exit report: keep its exit code only
            return
        self._release(record)
        record.state, record.deadline = state, None
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
        extra = {k: v for k, v in record.detail.items() if k not in _EVENT_KEYS}
        self.events.record(kind, text, node=record.node, container=record.id, final=True, **extra)

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
        holders = {cid for gpu in node.gpus for cid in gpu.holders if cid not in seen}
        for record in [self._containers[cid] for cid in sorted(holders)]:
            if record.state is State.RUNNING:
                reason = "removed on request" if record.remove_requested else "container disappeared from its node"
                self._finish(record, State.REMOVED, reason, None, {})
        # adopted last, against what is still granted once the containers that are gone have ended
        removals += [report.grant for report in unknown if not self._adopt(node, report)]
        return removals

    def _refresh(self, record: Container, report: ContainerStatus, *, confirm: bool = False) -> None:
        record.usage = dict(report.usage)
        record.container_id = report.container_id
        if record.state is State.CREATING and (record.hook or confirm):
            # a hook grant has no REST caller waiting: its node's report confirms it (or its deadline ends it)
            if report.state == State.RUNNING:
                record.state, record.deadline = State.RUNNING, None
                self.events.record(EventType.STARTED, f"container {report.container_id[:12]} running",
                                   node=record.node, container=record.id)
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
        self.events.record(EventType.ADOPTED, f"{report.state} container {report.container_id[:12]} re-adopted",
                           node=node.name, container=record.id)
        if live and record.gpus:
            self._grant(record)
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


_EVENT_KEYS = frozenset({"id", "time", "type", "node", "container", "message", "final"})
_FINAL_EVENTS = {State.KILLED: EventType.KILLED, State.FAILED: EventType.FAILED, State.REMOVED: EventType.REMOVED}


def _default_reason(state: State, exit_code: int | None) -> str:
    if state is State.EXITED:
        return f"exited with code {exit_code}" if exit_code is not None else "exited"
    return str(state)


def _live_state(state: str) -> str:
    return State.RUNNING.value if state == REMOVING else state


def _final_state(state: str) -> str:
    return state if state in {s.value for s in State} and state not in LIVE else State.EXITED.value
