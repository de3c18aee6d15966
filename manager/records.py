"""The records of the manager's map: GPUs, nodes, containers and the requests that place them.

Plain data; :class:`~gpumgr.manager.cluster.Cluster` owns them and guards them with its one lock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from gpumgr.manager.scheduler import GpuSlot
from gpumgr.wire.names import State


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
    #: granted through a node's runtime hook: no REST caller waits to mark it running
    hook: bool = False
    #: while ``creating``: when (monotonic) the grant is released unless the container was confirmed
    deadline: float | None = None
    #: ``DELETE`` came while its node was down: it is removed when the node returns
    remove_requested: bool = False
    #: the tenant it belongs to (None: the operator's)
    tenant: str | None = None
    priority: int = 0
    #: may be stopped to make room for a queued request of higher priority
    preemptible: bool = False
    #: the highest usage (summed over its GPUs) ever sampled; kept after it ends
    gpu_memory_peak: int = 0
    #: while ``queued``: what it waits to be placed as (it holds no GPUs yet)
    spec: PlacementSpec | None = None
    #: when it joined the queue (Unix time), if it ever waited; its place in the queue's first-come order
    queued_at: float | None = None
    queue_seq: int = 0
    #: while ``queued``: when it gives up (Unix time), from its ``queue_timeout``
    expires_at: float | None = None
    #: being preempted: the queued request it makes room for
    preempted_for: str | None = None
    #: while ``queued``: the preemptible containers being stopped to make room for it
    making_room: list[str] = field(default_factory=list)
    #: a resize is being carried out on its node (one at a time)
    resizing: bool = False
    #: when ``usage`` was last refreshed (monotonic), to integrate it over time for its tenant
    usage_at: float = 0.0
    run: dict[str, Any] = field(default_factory=dict)  # issue 19: the RunSpec fields it was asked with

    @property
    def count(self) -> int:
        """How many GPUs it holds, or asks for while queued."""
        return self.spec.count if self.spec is not None and not self.gpus else len(self.gpus)


@dataclass
class MetricsSnapshot:
    """The map as plain tuples, copied under its lock once per ``/metrics`` scrape."""

    #: (node, uuid, index, model, total, used, reserved, unmanaged, free)
    gpus: list[tuple[str, str, int, str, int, int, int, int, int]] = field(default_factory=list)
    #: (node, gpu uuid, grant id, name, tenant, granted bytes, used bytes): one per container per GPU
    containers: list[tuple[str, str, str, str, str, int, int]] = field(default_factory=list)
    #: (node, ready)
    nodes: list[tuple[str, bool]] = field(default_factory=list)
    overrun_kills: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    #: tenant ("" for the operator) -> requests waiting
    queued: dict[str, int] = field(default_factory=dict)


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
    #: asked for by a node's runtime hook rather than the REST API
    hook: bool = False
    tenant: str | None = None
    priority: int = 0
    preemptible: bool = False
    run: dict[str, Any] = field(default_factory=dict)  # issue 19: the RunSpec fields it was asked with
