"""The REST API's views: records of the cluster model turned into the JSON shapes clients see.

Kept apart from the model so that the model holds state and rules only; these functions read a
record and build plain dicts, and callers decide whether they run under the model's lock.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpumgr.manager.records import Container, Gpu, Node


def node_view(node: Node, shown: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """One node of ``GET /v1/nodes``: its state, when it was last heard from, and its GPUs.

    ``shown`` picks the container ids listed (a tenant sees only its own; the figures stay whole).
    """
    return {
        "name": node.name, "state": "ready" if node.ready else "down", "last_seen": node.last_seen,
        "runtime": node.runtime, "gpus": [gpu_view(g, shown) for g in node.gpus],
    }


def gpu_view(gpu: Gpu, shown: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """One GPU's memory split: total, used, reserved by grants, unmanaged and schedulable free."""
    holders = sorted(gpu.holders) if shown is None else sorted(c for c in gpu.holders if shown(c))
    return {
        "uuid": gpu.uuid, "index": gpu.index, "name": gpu.name, "memory_total": gpu.total,
        "memory_used": gpu.used, "memory_reserved": gpu.reserved, "memory_unmanaged": gpu.unmanaged,
        "memory_headroom": gpu.headroom, "memory_free": gpu.free, "containers": holders,
    }


def container_view(record: Container, gpus: dict[str, dict[str, Any]] | None = None,
                   queue: dict[str, Any] | None = None) -> dict[str, Any]:
    """A container record as the REST API shows it.

    Called under the map's lock; everything mutable is copied, so the JSON encoder, which runs after
    the lock is released, never reads a dict the link thread is changing.
    """
    gpus = gpus or {}
    return {
        "id": record.id, "name": record.name, "node": record.node or None, "tenant": record.tenant,
        "gpus": [gpus.get(u, {"uuid": u, "index": None, "name": None}) for u in record.gpus],
        "gpu_count": record.count, "gpu_memory": record.gpu_memory, "gpu_memory_used": sum(record.usage.values()),
        "gpu_memory_peak": record.gpu_memory_peak, "priority": record.priority, "preemptible": record.preemptible,
        "container_id": record.container_id, "state": str(record.state), "exit_code": record.exit_code,
        "reason": record.reason, "created_at": record.created_at, "finished_at": record.finished_at,
        "image": record.image, "command": list(record.command), "labels": dict(record.labels),
        "on_overrun": record.on_overrun,
        # a grant not yet confirmed by its node's engine is released at this (wall-clock) time
        "confirm_by": None if record.deadline is None else time.time() + record.deadline - time.monotonic(),
        "queued_at": record.queued_at, "queue": queue, "preempted_for": record.preempted_for,
        **({"detail": copy.deepcopy(record.detail)} if record.detail else {}),
    }
