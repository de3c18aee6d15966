"""The records of the manager's map: GPUs, nodes, containers and the requests that place them.

Plain data; the ledger's one lock (:class:`~gpumgr.manager.model.ledger.Ledger`) guards them all.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple

from gpumgr.manager.placing.scheduler import GpuSlot
from gpumgr.wire.errors import GpumgrError
from gpumgr.wire.names import State


@dataclass(eq=False)
class Gpu(GpuSlot):
    """A GPU on the map: the scheduler's slot plus what the API shows."""

    used: int = 0
    holders: set[str] = field(default_factory=set)
    #: why its node says it is unhealthy ("" while healthy): it then takes no new grant
    health: str = ""
    #: its links to the node's other GPUs as its agent reported them (uuid → link name)
    links: dict[str, str] = field(default_factory=dict)
    #: how much a waiting gang wants held here (``gang_hold`` grows toward it as grants end)
    gang_want: int = 0


@dataclass
class Node:
    """A host with an agent: where the link reaches it, and which agent process spoke last."""

    name: str
    routing_id: bytes
    runtime: str
    gpus: list[Gpu]
    ready: bool = True
    last_seen: float = field(default_factory=time.time)
    last_seen_mono: float = field(default_factory=time.monotonic)
    #: the agent's proven (CURVE) key: replies are matched by it, never by the connection
    key: str = ""
    #: the agent process's id from its registration: another one means the agent restarted
    instance: str = ""
    #: the labels its operator gave its agent (``node.labels.KEY`` constraints read them)
    labels: dict[str, str] = field(default_factory=dict)
    #: why nothing is placed here though it is up ("": it takes grants): its agent cannot write its fence file
    unusable: str = ""
    #: where other hosts reach it, as its agent says ("": not said): a gang's rendezvous on its rank 0
    advertise_addr: str = ""
    #: its agent runs with ``mps: true`` (the MPS daemon): compute shares may be placed on its GPUs
    mps: bool = False


class OpKind(StrEnum):
    """What the manager has asked a record's node to do."""

    CREATE = "create"
    REMOVE = "remove"
    RESIZE = "resize"


_OP_LOCK = threading.Lock()


@dataclass(eq=False, slots=True)
class Op:
    """One operation in flight on a record: at most one at a time; a reply for another is ignored.

    Whoever needs its outcome (a REST call) waits with :meth:`wait`; the event behind it is made
    only then, so the operations nobody waits for (most of them) cost no lock or condition.
    """

    kind: OpKind
    id: int
    #: when (monotonic, on the manager's clock) the manager stops waiting for the node's answer
    deadline: float
    #: resize: the figures from and to
    old: int = 0
    new: int = 0
    #: why it failed, once it ended: an error, or the parts :attr:`error` makes one of when first read
    _error: GpumgrError | tuple[Any, ...] | None = None
    ended: bool = False
    _event: threading.Event | None = None

    @property
    def error(self) -> GpumgrError | None:
        """Why it failed, once it ended (None: it succeeded, or has not ended)."""
        error = self._error
        if type(error) is tuple:
            kind, text, *parts = error
            error = self._error = kind(text(*parts))
        return error  # type: ignore[return-value]

    def finish(self, error: GpumgrError | tuple[Any, ...] | None) -> bool:
        """End it with ``error`` (None: success) and wake whoever waits; False if it had ended already.

        ``error`` may be ``(error class, text function, *its arguments)``: most operations that end in
        an error (a record that ended while its create was in flight) are never asked why, so the
        error is made only when :attr:`error` is read.
        """
        with _OP_LOCK:
            if self.ended:
                return False
            self._error, self.ended, event = error, True, self._event
        if event is not None:
            event.set()
        return True

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for it to end; whether it did."""
        with _OP_LOCK:
            if self.ended:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)


@dataclass(slots=True)
class Container:
    """The manager's record of one container and its grant.

    ``state`` is the observed state (what the node reported, or the manager's own deadlines decided);
    ``desired`` is what the API or the manager's policy wants (run, removed, preempted). Both move only
    through :class:`gpumgr.manager.model.lifecycle.Lifecycle`.
    """

    id: str
    name: str
    node: str
    gpus: list[str]
    gpu_memory: int
    spec: PlacementSpec
    state: State = State.CREATING
    desired: State = State.RUNNING
    #: why the desired state changed (the end's reason once it is carried out)
    desired_reason: str | None = None
    op: Op | None = None
    #: bytes per GPU reserved on the map now: ``gpu_memory``, or more while its node enforces more
    held: int = 0
    #: bytes per GPU its node last said it enforces (0: not reported yet)
    enforced: int = 0
    container_id: str | None = None
    exit_code: int | None = None
    reason: str | None = None
    created_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    usage: dict[str, int] = field(default_factory=dict)
    detail: dict[str, Any] = field(default_factory=dict)
    #: while ``creating`` with no operation in flight (a hook grant, an adopted one): when (monotonic)
    #: the grant is released unless its node confirms the container
    deadline: float | None = None
    #: the tenant it belongs to (None: the operator's)
    tenant: str | None = None
    priority: int = 0
    #: may be stopped to make room for a queued request of higher priority
    preemptible: bool = False
    #: the highest usage (summed over its GPUs) ever sampled; kept after it ends
    gpu_memory_peak: int = 0
    #: when it joined the queue (Unix time, shown), if it ever waited
    queued_at: float | None = None
    #: when it joined the queue on the manager's monotonic clock: its place in first-come order and aging
    queued_mono: float | None = None
    queue_seq: int = 0
    #: while ``queued``: when it gives up (monotonic), from its ``queue_timeout``
    expires_mono: float | None = None
    #: when ``usage`` was last refreshed (monotonic), to integrate it over time for its tenant
    usage_at: float = 0.0
    #: the weakest link joining its GPUs (``scheduler.LINKS``, or ``system``); None: one GPU, or no topology known
    topology: str | None = None
    #: the leaf account it is counted in (None: no accounts are configured)
    account: str | None = None
    #: its account's allocation, with it, passed a quota on the account's path when it was placed: it
    #: borrows, and reclaim may stop it (fixed at placement)
    over_quota: bool = False
    #: when it was granted (monotonic): reclaim leaves it alone for its account's ``reclaim_min_runtime``
    granted_mono: float = 0.0
    #: the gang it is a member of, and its rank there (counted from 0); None: a container on its own
    gang: str | None = None
    rank: int | None = None

    @property
    def count(self) -> int:
        """How many GPUs it holds, or asks for while queued."""
        return len(self.gpus) if self.gpus else self.spec.count

    @property
    def hook(self) -> bool:
        """Granted through a node's runtime hook: no REST caller waits for it."""
        return self.spec.hook

    @property
    def image(self) -> str | None:
        return self.spec.image

    @property
    def command(self) -> list[str]:
        return self.spec.command

    @property
    def env(self) -> dict[str, str]:
        return self.spec.env

    @property
    def labels(self) -> dict[str, str]:
        return self.spec.labels

    @property
    def on_overrun(self) -> str:
        return self.spec.on_overrun

    @property
    def compute_share(self) -> int:
        """Its percentage of each of its GPUs' SMs under MPS (0: none; see manager/placing/shares.py)."""
        return self.spec.compute_share

    @property
    def gpu_memory_limit(self) -> int:
        """A burstable grant's limit per GPU (0: ``gpu_memory`` is its limit); the map reserves only the grant."""
        return self.spec.memory_limit

    @property
    def preempted_for(self) -> str | None:
        """The queued request it is being stopped for, while it is (or once it was) preempted."""
        value = self.detail.get("preempted_for")
        return None if value is None else str(value)


class Command(NamedTuple):
    """What the manager must tell a node after a change: built under the map's lock, sent after it.

    A tuple: one is made for every placement, and a frozen dataclass's ``__init__`` costs a call per field.
    """

    kind: OpKind
    record: Container
    #: the operation it carries out; its reply settles it
    op: Op


@dataclass
class MetricsSnapshot:
    """The map as plain tuples, copied under its lock once per ``/metrics`` scrape."""

    #: (node, uuid, index, model, total, used, reserved, unmanaged, free)
    gpus: list[tuple[str, str, int, str, int, int, int, int, int]] = field(default_factory=list)
    #: (node, uuid, bytes bursters use above their grants there)
    bursts: list[tuple[str, str, int]] = field(default_factory=list)
    #: (node, uuid, bytes held there for a waiting gang)
    gang_holds: list[tuple[str, str, int]] = field(default_factory=list)
    #: (node, uuid, percent of its SMs its grants' compute shares take): MPS GPUs only
    shares: list[tuple[str, str, int]] = field(default_factory=list)
    #: (node, gpu uuid, grant id, name, tenant, granted bytes, used bytes): one per container per GPU
    containers: list[tuple[str, str, str, str, str, int, int]] = field(default_factory=list)
    #: (node, ready)
    nodes: list[tuple[str, bool]] = field(default_factory=list)
    #: (node, uuid, why it is unhealthy: "" while healthy)
    health: list[tuple[str, str, str]] = field(default_factory=list)
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
    #: the container spec beyond the image and command (``wire.runspec.RunSpec`` fields), as asked
    run: dict[str, Any] = field(default_factory=dict)
    #: where it may run (``wire.constraints``), as written; validated at the edge
    constraints: list[str] = field(default_factory=list)
    #: its percentage of each GPU's SMs under MPS (1-100; 0: no share), validated at the edge
    compute_share: int = 0
    #: a burstable grant's limit per GPU (0: ``memory``, no burst)
    memory_limit: int = 0


class RandomIds:
    """Record ids: 16 hex digits from the OS's random source, drawn 512 at a time (one system call for many)."""

    BATCH = 512

    def __init__(self) -> None:
        self._ready: deque[str] = deque()

    def __call__(self) -> str:
        try:
            return self._ready.popleft()
        except IndexError:
            drawn = os.urandom(8 * self.BATCH).hex()
            self._ready.extend(drawn[i:i + 16] for i in range(16, len(drawn), 16))
            return drawn[:16]
