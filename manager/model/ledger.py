"""The ledger: nodes, GPUs, the records holding grants, and the free index the scheduler reads.

It owns the manager's one lock: every other part of the model (lifecycle, queue, quotas,
reconciliation, views) takes it through here, so the whole map changes under one hold. A *grant*
is the memory a record in state ``creating`` or ``running`` holds on each of its GPUs
(``record.held`` bytes per GPU); it is written here before any agent is told, so two requests can
never be handed the same bytes. :meth:`Ledger.check` states the invariant over the model.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

from gpumgr.manager.model.records import Container, Gpu, Node, OpKind
from gpumgr.manager.placing import topology
from gpumgr.manager.placing.scheduler import FreeIndex
from gpumgr.manager.placing.shares import shares_problems
from gpumgr.wire import defaults
from gpumgr.wire.constraints import NO_CONSTRAINTS, Constraints
from gpumgr.wire.names import LIVE, QUEUED, State
from gpumgr.wire.protocol import GpuInfo

log = logging.getLogger(__name__)
#: Capacities remembered (per GPU count, node and constraints) before the cache starts again.
CAPACITY_CACHED = 4096


def burst_of(record: Container, uuid: str) -> int:
    """``record``'s use of GPU ``uuid`` above what the map reserves for it there (0: none), from its node's last
    heartbeat: a burster's burst (or an overrun about to be killed). No grant covers it, yet it is in use."""
    used = record.usage.get(uuid, 0)
    return used - record.held if used > record.held else 0


def burst_on(gpu: Gpu, records: dict[str, Container]) -> int:
    """The bytes ``gpu``'s holders use above their grants there, summed (``memory_burst`` on the map)."""
    return sum(burst_of(records[c], gpu.uuid) for c in gpu.holders if c in records)


class Wake(threading.Event):
    """The dispatcher's wake-up: setting it when already set costs no lock (it is set on every release)."""

    def set(self) -> None:
        if not self._flag:  # type: ignore[attr-defined]  # Event.is_set() is a Python call that reads just this
            super().set()


class Ledger:
    """Nodes × GPUs × grants under one lock; no I/O, no events (the lifecycle writes those)."""

    def __init__(self, headroom: int = 0) -> None:
        self.lock = threading.RLock()
        self.headroom = headroom
        self.nodes: dict[str, Node] = {}
        self.gpus: dict[str, Gpu] = {}
        self.records: dict[str, Container] = {}
        self.index = FreeIndex()
        #: grows with every change of a grant or a node: cached views compare it
        self.version = 0
        #: names of the nodes whose shown figures changed since ``GET /v1/nodes`` last took them
        #: (:meth:`take_touched`): its copy re-encodes only those
        self.touched: set[str] = set()
        #: set whenever room may have freed or the queue changed: the dispatcher wakes on it
        self.wake = Wake()
        self._finished: deque[str] = deque()
        #: live preemptible records: preemption is only planned while there are some
        self.preemptible: set[str] = set()
        self._capacity: dict[tuple[int, str | None, tuple[str, ...]], int] = {}
        #: GPUs a node re-registered smaller than the grants on them (the hardware changed under running
        #: containers): their overbooking is the node's truth, nothing more is granted there until it fits
        self.shrunk: set[str] = set()

    def clear(self) -> None:
        """Forget every node, GPU and record (leadership ended or begins: the map starts from nothing)."""
        self.version += 1
        self.touched |= set(self.nodes)
        self.nodes, self.gpus, self.records = {}, {}, {}
        self.index = FreeIndex()
        self._finished.clear()
        self.preemptible.clear()
        self._capacity.clear()
        self.shrunk.clear()

    # --- grants --------------------------------------------------------------------------------
    def grant(self, record: Container) -> None:
        """Reserve ``record.gpu_memory`` on each of its GPUs (it has just been placed or adopted)."""
        self.version += 1
        record.held = record.gpu_memory
        if record.preemptible:
            self.preemptible.add(record.id)
        share = record.spec.compute_share
        for uid in record.gpus:
            gpu = self.gpus[uid]
            gpu.reserved += record.held
            gpu.compute_shares += share
            gpu.holders.add(record.id)
            self.index.update(gpu)
            self.touched.add(gpu.node)

    def release(self, record: Container) -> None:
        """Give back everything ``record`` holds (it ended)."""
        self.version += 1
        self.preemptible.discard(record.id)
        self.wake.set()
        for uid in record.gpus:
            gpu = self.gpus.get(uid)
            if gpu is not None and record.id in gpu.holders:
                gpu.reserved -= record.held
                gpu.compute_shares -= record.spec.compute_share
                gpu.holders.discard(record.id)
                if gpu.burst:  # its burst ends with it
                    gpu.burst = burst_on(gpu, self.records)
                self.index.update(gpu)
                self.touched.add(gpu.node)
                if gpu.gang_want:  # room held for a waiting gang grows as it frees
                    self._hold(gpu)
        record.held = 0

    def rehold(self, record: Container, held: int) -> None:
        """Hold ``held`` bytes per GPU for live ``record`` from now on (a resize, or its node's figure)."""
        delta = held - record.held
        if not delta:
            return
        self.version += 1
        record.held = held
        for uid in record.gpus:
            gpu = self.gpus.get(uid)
            if gpu is not None and record.id in gpu.holders:
                gpu.reserved += delta
                if gpu.burst or record.usage.get(uid, 0) > held:  # its use above its grant moved with the grant
                    gpu.burst = burst_on(gpu, self.records)
                self.index.update(gpu)
                self.touched.add(gpu.node)
        if delta < 0:
            self.wake.set()

    def hold_for_gang(self, gpu: Gpu, want: int) -> None:
        """Hold up to ``want`` bytes of ``gpu`` for a waiting gang (0: none): what is free now, and from now on
        what frees there, in the same step as the release that frees it, until the hold reaches ``want``."""
        gpu.gang_want = want
        self._hold(gpu)

    def _hold(self, gpu: Gpu) -> None:
        held = min(gpu.gang_want, max(0, gpu.total - gpu.headroom - gpu.unmanaged - gpu.reserved - gpu.burst))
        if gpu.gang_hold != held:
            if held < gpu.gang_hold:
                self.wake.set()
            gpu.gang_hold = held
            self.index.update(gpu)
            self.touched.add(gpu.node)

    def reburst(self, gpus: list[Gpu]) -> None:
        """Count again the bytes bursters use above their grants on ``gpus`` (their node's heartbeat came)."""
        for gpu in gpus:
            burst = burst_on(gpu, self.records)
            if burst != gpu.burst:
                if burst < gpu.burst:
                    self.wake.set()  # room freed: a queued request may fit now
                gpu.burst = burst
                self.version += 1
                self.index.update(gpu)
                self.touched.add(gpu.node)

    def room_for(self, record: Container, more: int) -> Gpu | None:
        """The first of ``record``'s GPUs without ``more`` free bytes, or None if all have them."""
        return next((self.gpus[g] for g in record.gpus if g in self.gpus and self.gpus[g].free < more), None)

    # --- nodes ---------------------------------------------------------------------------------
    def gpu_for(self, node: str, info: GpuInfo) -> Gpu:
        """The GPU record for ``info`` on ``node``, made anew if it was another node's or unknown."""
        gpu = self.gpus.get(info.uuid)
        if gpu is None or gpu.node != node:
            gpu = Gpu(info.uuid, node, info.index, info.memory_total, headroom=self.headroom, name=info.name)
            self.gpus[info.uuid] = gpu
        gpu.index, gpu.total, gpu.name = info.index, info.memory_total, info.name
        gpu.compute_capability, gpu.links, gpu.health = info.compute_capability, dict(info.links), info.health
        if gpu.reserved > gpu.total - gpu.headroom:
            if gpu.uuid not in self.shrunk:
                log.warning("GPU %s of node %s now reports %d bytes, less than the %d its live grants hold",
                            gpu.uuid, node, gpu.total, gpu.reserved)
            self.shrunk.add(gpu.uuid)
        else:
            self.shrunk.discard(gpu.uuid)
        return gpu

    def set_node(self, node: Node) -> None:
        """Put ``node`` (and its GPUs) on the map, replacing an older record of the same name.

        Its GPUs share its labels, and get their topology groups from the links its agent reported.
        """
        self.nodes[node.name] = node
        for gpu in node.gpus:
            gpu.labels, gpu.mps = node.labels, node.mps
        topology.assign_groups(node.gpus)
        self._capacity.clear()
        self.version += 1
        self.touched.add(node.name)

    def set_ready(self, node: Node, ready: bool) -> None:
        """Mark ``node`` ready (its GPUs join the free index) or down (they leave it)."""
        self.version += 1
        node.ready = ready
        self.touched.add(node.name)
        if ready:
            self.wake.set()
        for gpu in node.gpus:
            if ready and gpu not in self.index and not gpu.health and not node.unusable:
                self.index.add(gpu)
            elif not ready:
                self.index.discard(gpu)

    def set_unusable(self, node: Node, why: str) -> bool:
        """Record why nothing may be placed on ``node`` though it is up ("": it may again). Whether it changed.

        Its GPUs leave the free index (or join it again); its grants and containers stay as they are.
        """
        if why == node.unusable:
            return False
        self.version += 1
        node.unusable = why
        self.touched.add(node.name)
        for gpu in node.gpus:
            if why:
                self.index.discard(gpu)
            elif node.ready and gpu not in self.index and not gpu.health:
                self.index.add(gpu)
                self.wake.set()
        return True

    def set_health(self, gpu: Gpu, health: str) -> bool:
        """Record why ``gpu`` is unhealthy ("" : healthy); an unhealthy GPU leaves the free index. Whether it changed.

        Its grants stay: the containers on it are left alone, only new grants go elsewhere.
        """
        if health == gpu.health:
            return False
        self.version += 1
        gpu.health = health
        self.touched.add(gpu.node)  # GET /v1/nodes re-encodes its node: the next ?since= answer shows it
        node = self.nodes.get(gpu.node)
        if health:
            self.index.discard(gpu)
        elif node is not None and node.ready and not node.unusable and gpu not in self.index and gpu in node.gpus:
            self.index.add(gpu)
            self.wake.set()
        return True

    def drop_node(self, name: str) -> None:
        """Take node ``name`` and its GPUs off the map (its records must have ended first)."""
        node = self.nodes.pop(name)
        for gpu in node.gpus:
            self.index.discard(gpu)
            if self.gpus.get(gpu.uuid) is gpu:
                del self.gpus[gpu.uuid]
        self._capacity.clear()
        self.version += 1
        self.touched.add(name)
        self.wake.set()

    def take_touched(self) -> set[str]:
        """The names in :attr:`touched`, which starts empty again. Call under :attr:`lock`."""
        touched, self.touched = self.touched, set()
        return touched

    def node_gpus(self, name: str) -> list[Gpu]:
        """``name``'s GPUs, or none if it is not on the map."""
        node = self.nodes.get(name)
        return node.gpus if node is not None else []

    def capacity(self, count: int, node: str | None = None, constraints: Constraints = NO_CONSTRAINTS) -> int:
        """The most bytes per GPU that ``count`` GPUs of one node (``node``, or any) could ever grant, empty.

        What the map *knows*: a request bigger than this waits for a node that does not exist yet. Only
        GPUs ``constraints`` allow count; an unhealthy GPU counts (it may recover). Cached until a node
        joins or leaves the map (not on every grant).
        """
        key = (count, node, constraints.texts)
        cached = self._capacity.get(key)
        if cached is None:
            nodes = [self.nodes[node]] if node is not None and node in self.nodes else \
                ([] if node is not None else list(self.nodes.values()))
            cached = 0
            allows = constraints.allows if constraints else None
            for each in nodes:
                sizes = sorted((g.total - g.headroom for g in each.gpus if allows is None or allows(g)), reverse=True)
                if len(sizes) >= count:
                    cached = max(cached, sizes[count - 1])
            if len(self._capacity) >= CAPACITY_CACHED:  # many distinct constraints: start again
                self._capacity.clear()
            self._capacity[key] = cached
        return cached

    # --- records -------------------------------------------------------------------------------
    def ended(self, record: Container) -> None:
        """``record`` reached a final state: keep it for reading, and forget the oldest past the cap."""
        self._finished.append(record.id)
        while len(self._finished) > defaults.FINISHED_KEPT:
            old = self.records.get(self._finished.popleft())
            if old is not None and old.state not in LIVE and old.state is not QUEUED:
                del self.records[old.id]

    def check(self) -> list[str]:
        """Every way the model breaks the invariant (empty: it holds). Call under :attr:`lock`.

        Per GPU: the live holders' held bytes sum to ``reserved`` and fit ``total - headroom``; every
        holder is a live record of that node; every live record is held on each of its GPUs; queued
        and ended records hold nothing; every ended record has its reason and ``finished_at``.
        """
        found: list[str] = []
        for gpu in self.gpus.values():
            held = shares = 0
            for cid in gpu.holders:
                record = self.records.get(cid)
                if record is None or record.state not in LIVE or record.node != gpu.node:
                    found.append(f"GPU {gpu.uuid} lists holder {cid}, which holds no live grant there")
                else:
                    held += record.held
                    shares += record.spec.compute_share
            found += shares_problems(gpu, shares)
            if held != gpu.reserved:
                found.append(f"GPU {gpu.uuid} shows {gpu.reserved} reserved; its holders hold {held}")
            if held and held > gpu.total - gpu.headroom and gpu.uuid not in self.shrunk:
                found.append(f"GPU {gpu.uuid} is over-granted: {held} of {gpu.total - gpu.headroom}")
            if gpu.gang_hold and held + gpu.gang_hold + gpu.unmanaged > gpu.total - gpu.headroom:
                found.append(f"GPU {gpu.uuid} holds {gpu.gang_hold} for a gang beyond what is free")
        for record in self.records.values():
            if record.state in LIVE:
                for uid in record.gpus:
                    held_on = self.gpus.get(uid)
                    if held_on is not None and record.id not in held_on.holders:
                        found.append(f"live record {record.id} is not held on its GPU {uid}")
                if record.held < record.gpu_memory and record.gpus and all(u in self.gpus for u in record.gpus):
                    found.append(f"live record {record.id} holds {record.held} of its grant {record.gpu_memory}")
                if record.op is None and record.state is State.CREATING and record.deadline is None:
                    found.append(f"creating record {record.id} has no operation and no deadline")
            elif record.held:
                found.append(f"{record.state} record {record.id} still holds {record.held} bytes")
            if record.state is State.QUEUED and (record.gpus or record.node):
                found.append(f"queued record {record.id} holds {record.gpus} on {record.node!r}")
            if record.state not in LIVE and record.state is not State.QUEUED and (
                    not record.reason or record.finished_at is None):
                found.append(f"ended record {record.id} ({record.state}) lacks its reason or finished_at")
            if record.state not in LIVE and record.op is not None and record.op.kind is not OpKind.REMOVE:
                # an ended record may only be having its stopped container removed from the engine
                found.append(f"{record.state} record {record.id} still has a {record.op.kind} in flight")
        return found
