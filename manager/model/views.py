"""The REST API's views: records of the cluster model turned into the JSON shapes clients see.

Kept apart from the model so that the model holds state and rules only; these functions read a
record and build plain dicts, and callers decide whether they run under the model's lock.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpumgr.manager.model.records import MetricsSnapshot
from gpumgr.manager.placing.scheduler import LINKS
from gpumgr.manager.tenancy.tenants import Principal, Usage
from gpumgr.wire import defaults
from gpumgr.wire.errors import NoAgents, NotFound
from gpumgr.wire.names import LIVE, State, burst_limit

if TYPE_CHECKING:
    from gpumgr.manager.model.ledger import Ledger
    from gpumgr.manager.model.lifecycle import Lifecycle
    from gpumgr.manager.model.quotas import Quotas
    from gpumgr.manager.model.records import Container, Gpu, Node
    from gpumgr.manager.model.walk.dispatch import Dispatch


def node_view(node: Node, shown: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """One node of ``GET /v1/nodes``: its state, when it was last heard from, and its GPUs.

    ``shown`` picks the container ids listed (a tenant sees only its own; the figures stay whole).
    """
    return {
        "name": node.name, "state": "ready" if node.ready else "down", "last_seen": node.last_seen,
        "runtime": node.runtime, "mps": node.mps, "labels": dict(node.labels),
        "gpus": [gpu_view(g, shown) for g in node.gpus],
        "unusable": node.unusable or None,
    }


def gpu_view(gpu: Gpu, shown: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """One GPU's memory split: total, used, reserved by grants, unmanaged and schedulable free."""
    holders = sorted(gpu.holders) if shown is None else sorted(c for c in gpu.holders if shown(c))
    return {
        "uuid": gpu.uuid, "index": gpu.index, "name": gpu.name, "memory_total": gpu.total,
        "memory_used": gpu.used, "memory_reserved": gpu.reserved, "memory_unmanaged": gpu.unmanaged,
        "memory_headroom": gpu.headroom, "memory_free": gpu.free, "containers": holders,
        "memory_reserved_for_gang": gpu.gang_hold,
        # its node runs MPS, and the percent of its SMs its live grants' compute shares take (at most 100)
        "mps": gpu.mps, "compute_shares": gpu.compute_shares,
        # what containers use above their grants here (bursters): taken, though no grant reserves it
        "memory_burst": gpu.burst,
        "compute_capability": gpu.compute_capability or None, "healthy": not gpu.health, "health": gpu.health or None,
        # its NVLink island, PCIe switch and socket (GPUs sharing an id are joined that well); None: not reported
        "topology": None if gpu.groups is None else dict(zip(LINKS, gpu.groups, strict=True)),
    }


def container_view(record: Container, gpus: dict[str, dict[str, Any]] | None = None,
                   queue: dict[str, Any] | None = None) -> dict[str, Any]:
    """A container record as the REST API shows it.

    Called under the map's lock; everything mutable is copied, so the JSON encoder, which runs after
    the lock is released, never reads a dict the link thread is changing.
    """
    gpus = gpus or {}
    confirm = record.op.deadline if record.op is not None and record.state is State.CREATING else record.deadline
    return {
        "id": record.id, "name": record.name, "node": record.node or None, "tenant": record.tenant,
        "gpus": [gpus.get(u, {"uuid": u, "index": None, "name": None}) for u in record.gpus],
        "gpu_count": record.count, "gpu_memory": record.gpu_memory, "gpu_memory_used": sum(record.usage.values()),
        "gpu_memory_peak": record.gpu_memory_peak, "priority": record.priority, "preemptible": record.preemptible,
        "compute_share": record.compute_share,
        "container_id": record.container_id, "state": str(record.state), "exit_code": record.exit_code,
        "reason": record.reason, "created_at": record.created_at, "finished_at": record.finished_at,
        "image": record.image, "command": list(record.command), "labels": dict(record.labels),
        "on_overrun": record.on_overrun, "constraints": list(record.spec.constraints),
        # the weakest link between its GPUs (nvlink, pcie_switch, socket, system), None for one GPU or no topology
        "topology": record.topology,
        # a grant not yet confirmed by its node's engine is released at this (wall-clock) time
        "confirm_by": None if confirm is None else time.time() + confirm - time.monotonic(),
        "queued_at": record.queued_at, "queue": queue, "preempted_for": record.preempted_for,
        # the leaf account it is counted in (null: no accounts configured), and whether it borrows
        "account": record.account, "over_quota": record.over_quota,
        "reclaimed_for_account": record.detail.get("reclaimed_for_account"),
        # the gang it is a member of, and its rank there (null: a container on its own)
        "gang": record.gang, "rank": record.rank,
        "desired_state": str(record.desired), "operation": str(record.op.kind) if record.op is not None else None,
        # what the map reserves per GPU now: more than gpu_memory while its node still enforces more
        "gpu_memory_held": record.held,
        # a burstable grant's limit per GPU (its grant when it has none)
        "gpu_memory_limit": burst_limit(record.gpu_memory, record.gpu_memory_limit),
        **({"detail": copy.deepcopy(record.detail)} if record.detail else {}),
    }


class MapReads:
    """The read side of the cluster: every method takes the ledger's lock, copies, and changes nothing.

    Mixed into :class:`gpumgr.manager.model.cluster.Cluster`, whose ``ledger``, ``life`` and ``quotas`` it reads.
    """

    ledger: Ledger
    life: Lifecycle
    quotas: Quotas
    dispatcher: Dispatch
    map_max_age: float = defaults.MAP_MAX_AGE

    def get(self, cid: str) -> Container:
        """The record of ``cid``; raises NotFound."""
        with self.ledger.lock:
            record = self.ledger.records.get(cid)
            if record is None:
                raise NotFound(f"no container with id {cid!r}")
            return record

    def get_for(self, cid: str, principal: Principal) -> Container:
        """The record of ``cid`` if ``principal`` may see it; NotFound otherwise, as if it did not exist."""
        with self.ledger.lock:
            record = self.ledger.records.get(cid)
            if record is None or not principal.sees(record.tenant):
                raise NotFound(f"no container with id {cid!r}")
            return record

    def containers(self, state: str | None = None, node: str | None = None,
                   principal: Principal | None = None) -> list[Container]:
        """Records, oldest first (queued ones in queue order), optionally filtered (``principal``: those it may see)."""
        with self.ledger.lock:
            records = self.ledger.records
            pool = [records[c] for c in self.life.queue.ids()] if state == State.QUEUED else records.values()
            return [c for c in pool
                    if (state is None or c.state == state) and (node is None or c.node == node)
                    and (principal is None or principal.sees(c.tenant))]

    def view(self, record: Container) -> dict[str, Any]:
        """``record`` as the REST API shows it, with each GPU's index and name."""
        with self.ledger.lock:
            return self._view(record)

    def views(self, records: list[Container]) -> list[dict[str, Any]]:
        """Several records as the REST API shows them, under one hold of the lock."""
        with self.ledger.lock:
            return [self._view(r) for r in records]

    def _view(self, record: Container) -> dict[str, Any]:
        gpus = self.ledger.gpus
        refs = {u: {"uuid": u, "index": g.index, "name": g.name} for u in record.gpus if (g := gpus.get(u))}
        queue = None
        if record.state is State.QUEUED:
            now = self.life.clock.monotonic()
            queued = record.queued_mono if record.queued_mono is not None else now
            wall = self.life.clock.time() - now
            queue = {"position": self.life.queue.position(record.id), "length": len(self.life.queue),
                     "effective_priority": round(self.life.queue.effective(record.priority, queued, now), 3),
                     "waited": round(now - queued, 3),
                     "expires_at": None if record.expires_mono is None else record.expires_mono + wall,
                     "making_room": sorted(self.dispatcher.making_room.get(record.id, ()))}
        return container_view(record, refs, queue)

    def nodes_view(self, principal: Principal | None = None) -> list[dict[str, Any]]:
        """The machine × GPU map as ``GET /v1/nodes`` shows it; a tenant sees only its own containers' ids."""
        with self.ledger.lock:
            nodes, records = self.ledger.nodes.values(), self.ledger.records
            if principal is None or principal.operator:
                return [node_view(n) for n in nodes]
            return [node_view(n, lambda cid: records[cid].tenant == principal.tenant) for n in nodes]

    def needs_image(self) -> bool:
        """True when every ready node runs Docker, so a request without an image cannot run anywhere."""
        with self.ledger.lock:
            runtimes = {n.runtime for n in self.ledger.nodes.values() if n.ready}
            return bool(runtimes) and runtimes <= {"docker"}

    def ready_nodes(self) -> int:
        """How many nodes are ready."""
        with self.ledger.lock:
            return sum(1 for n in self.ledger.nodes.values() if n.ready)

    def node_ready(self, name: str) -> bool:
        """Whether ``name`` is registered and heartbeating."""
        with self.ledger.lock:
            node = self.ledger.nodes.get(name)
            return node is not None and node.ready

    def routing_id(self, name: str) -> bytes:
        """Where the link reaches ``name``'s agent now; NoAgents if ``name`` is not on the map."""
        found = self.routing_id_of(name)
        if found is None:
            raise NoAgents(f"node {name} is not on the map")
        return found

    def routing_id_of(self, name: str) -> bytes | None:
        """Where the link reached ``name``'s agent last, or None if ``name`` is not on the map."""
        with self.ledger.lock:
            node = self.ledger.nodes.get(name)
            return node.routing_id if node is not None else None

    def tenants_view(self, principal: Principal) -> list[dict[str, Any]]:
        """Each tenant the caller may see: quota, what it holds and has queued, and GiB·hours since start."""
        with self.ledger.lock:
            return self.quotas.view(principal)

    def accounts_view(self, principal: Principal) -> list[dict[str, Any]] | None:
        """Each account the caller may see (a tenant: its own and those above it); None: no accounts configured."""
        with self.ledger.lock:
            tree = self.quotas.accounts
            if tree is None:
                return None
            visible = None if principal.operator else tree.visible_to(tree.account_of(principal.tenant))
            return self.dispatcher.fair.view(visible)

    def usage_of(self, tenant: str) -> Usage:
        """A copy of what ``tenant`` holds now."""
        with self.ledger.lock:
            return self.quotas.usage_of(tenant)

    def metrics_snapshot(self) -> MetricsSnapshot:
        """The map as plain tuples for one ``/metrics`` scrape (the families are built after the lock)."""
        snap = MetricsSnapshot()
        with self.ledger.lock:
            records = self.ledger.records
            for node in self.ledger.nodes.values():
                snap.nodes.append((node.name, node.ready))
                for gpu in node.gpus:
                    snap.gpus.append((node.name, gpu.uuid, gpu.index, gpu.name, gpu.total, gpu.used, gpu.reserved,
                                      gpu.unmanaged, gpu.free))
                    snap.health.append((node.name, gpu.uuid, gpu.health))
                    snap.bursts.append((node.name, gpu.uuid, gpu.burst))
                    snap.gang_holds.append((node.name, gpu.uuid, gpu.gang_hold))
                    if gpu.mps:
                        snap.shares.append((node.name, gpu.uuid, gpu.compute_shares))
                    for cid in gpu.holders:
                        record = records[cid]
                        snap.containers.append((node.name, gpu.uuid, cid, record.name, record.tenant or "",
                                                record.held, record.usage.get(gpu.uuid, 0)))
            snap.overrun_kills = dict(self.life.overrun_kills)
            snap.outcomes = dict(self.life.outcomes)
            for cid in self.life.queue.ids():
                tenant = records[cid].tenant or ""
                snap.queued[tenant] = snap.queued.get(tenant, 0) + 1
            for configured in self.quotas.book.all() if self.quotas.book is not None else []:
                snap.queued.setdefault(configured.name, 0)
        return snap

    # --- hooks ---------------------------------------------------------------------------------
    def live_grant_of(self, node: str, container_id: str) -> Container | None:
        """The live record already granted to ``container_id`` on ``node`` (a repeated create), if any."""
        with self.ledger.lock:
            for gpu in self.ledger.node_gpus(node):
                for cid in gpu.holders:
                    record = self.ledger.records[cid]
                    if record.container_id == container_id:
                        return record
        return None

    def queued_for(self, node: str, container_id: str) -> Container | None:
        """The queued hook request of ``container_id`` on ``node`` (the hook asked again while it waits), if any."""
        with self.ledger.lock:
            for cid in self.life.queue.ids():
                record = self.ledger.records[cid]
                if record.hook and record.container_id == container_id and record.spec.node == node:
                    return record
        return None

    def check(self) -> list[str]:
        """The invariant over the model (empty: it holds), with every tenant's and account's count equal to its
        records' sum."""
        with self.ledger.lock:
            found = self.ledger.check()
            held: dict[str, int] = {}
            for record in self.ledger.records.values():
                if record.tenant is not None and (record.state in LIVE or record.state is State.QUEUED):
                    held[record.tenant] = held.get(record.tenant, 0) + record.gpu_memory * record.count
            for tenant in set(held) | set(self.quotas.tenants()):
                counted = self.quotas.usage_of(tenant).memory
                if counted != held.get(tenant, 0):
                    found.append(f"tenant {tenant} counts {counted} bytes, its records {held.get(tenant, 0)}")
            return found + self._accounts_check()

    def _accounts_check(self) -> list[str]:
        """Every account's allocated, borrowed and waiting bytes equal its records' sums (with accounts)."""
        tree = self.quotas.accounts
        if tree is None:
            return []
        sums: dict[tuple[str, str], int] = {}
        for record in self.ledger.records.values():
            live = record.state in LIVE
            if (live or record.state is State.QUEUED) and record.account in tree:
                kinds = ("allocated", "borrowed") if live and record.over_quota else \
                    ("allocated",) if live else ("waiting",)
                for name in tree[record.account or ""].path:
                    for kind in kinds:
                        sums[name, kind] = sums.get((name, kind), 0) + record.gpu_memory * record.count
        found = []
        quotas = self.quotas
        for name in tree.accounts:
            for kind, counted in (("allocated", quotas.allocated), ("waiting", quotas.waiting),
                                  ("borrowed", quotas.borrowed)):
                if counted.get(name, 0) != sums.get((name, kind), 0):
                    found.append(f"account {name} counts {counted.get(name, 0)} bytes {kind}, its records "
                                 f"{sums.get((name, kind), 0)}")
        return found
