"""The typed records :mod:`gpumgr.client` returns: a container, a node and its GPUs, an event, a wait's end,
an account, a gang.

Each mirrors one response shape of the REST API (``manager/openapi.py``) and is built from its JSON by
``from_json``. ``raw`` keeps the whole JSON object, so a field a newer manager adds is still reachable
(``record.raw["new_field"]``) before this module names it. Kept apart from the client's transport so
that ``docker gpu``, which talks JSON, does not pay for ``dataclasses`` at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class ContainerCollection(Protocol):
    """What a record's own methods call back on (``gpumgr.client``'s collection is one): kept here as a
    protocol, so this module does not import the client that imports it."""

    def get(self, ref: str) -> Container: ...

    def remove(self, ref: str) -> Container: ...

    def resize(self, ref: str, gpu_memory: int | str | None = None, *, force: bool = False,
               gpu_memory_limit: int | str | None = None) -> Container: ...

    def wait(self, ref: str, timeout: float | None = None) -> WaitResult: ...

    def kill(self, ref: str, signal: str = "SIGKILL") -> str: ...

    def logs(self, ref: str, *, tail: int | None = None) -> bytes: ...


class GangCollection(Protocol):
    """What a gang's own methods call back on (``gpumgr.client``'s ``client.gangs`` is one)."""

    def get(self, gid: str) -> Gang: ...

    def remove(self, gid: str) -> Gang: ...

    def containers(self, gid: str) -> list[Container]: ...

    def logs(self, gid: str, *, tail: int | None = None) -> dict[int, bytes]: ...


@dataclass(frozen=True)
class GpuRef:
    """A GPU a container holds; ``index`` and ``name`` are None once its node is forgotten."""

    uuid: str
    index: int | None
    name: str | None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GpuRef:
        return cls(uuid=data["uuid"], index=data.get("index"), name=data.get("name"))


@dataclass(frozen=True)
class QueuePlace:
    """Where a queued request stands: its 1-based ``position`` of ``length``, seconds ``waited``."""

    position: int | None
    length: int
    effective_priority: float
    waited: float
    expires_at: float | None
    making_room: list[str]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> QueuePlace:
        return cls(position=data.get("position"), length=data["length"],
                   effective_priority=data["effective_priority"], waited=data["waited"],
                   expires_at=data.get("expires_at"), making_room=list(data.get("making_room") or []))


@dataclass(frozen=True)
class Container:
    """A container and its grant, as ``GET /v1/containers/{id}`` shows it (sizes in bytes).

    The methods act on the container through the client that fetched it and return fresh records;
    the record itself never changes (``reload()`` gives the current one).
    """

    id: str
    name: str
    node: str | None
    tenant: str | None
    state: str
    desired_state: str
    gpus: list[GpuRef]
    gpu_count: int
    gpu_memory: int
    gpu_memory_used: int
    gpu_memory_peak: int
    gpu_memory_held: int
    #: a burstable grant's limit per GPU (``gpu_memory`` when it has none)
    gpu_memory_limit: int
    priority: int
    preemptible: bool
    container_id: str | None
    exit_code: int | None
    reason: str | None
    created_at: float
    finished_at: float | None
    image: str | None
    command: list[str]
    labels: dict[str, str]
    on_overrun: str
    queue: QueuePlace | None
    queued_at: float | None
    confirm_by: float | None
    preempted_for: str | None
    operation: str | None
    detail: dict[str, Any]
    constraints: list[str]  # issue 23
    topology: str | None  # issue 23: the weakest link joining its GPUs
    #: the leaf account it is counted in (None: no accounts configured)
    account: str | None
    #: it borrows past a quota on its account's path: reclaim may stop it
    over_quota: bool
    #: the account reclaim stopped it for (it ended preempted, reason ``reclaimed``), else None
    reclaimed_for_account: str | None
    #: the gang it is a member of, and its rank there (None: a container on its own)
    gang: str | None
    rank: int | None
    #: its percent of each GPU's SMs under MPS (0: none)
    compute_share: int
    raw: dict[str, Any] = field(repr=False, compare=False)
    _collection: ContainerCollection | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_json(cls, data: dict[str, Any], collection: ContainerCollection | None = None) -> Container:
        queue = data.get("queue")
        return cls(
            id=data["id"], name=data["name"], node=data.get("node"), tenant=data.get("tenant"), state=data["state"],
            desired_state=data.get("desired_state", "running"), gpus=[GpuRef.from_json(g) for g in data["gpus"]],
            gpu_count=data["gpu_count"], gpu_memory=data["gpu_memory"], gpu_memory_used=data["gpu_memory_used"],
            gpu_memory_peak=data["gpu_memory_peak"], gpu_memory_held=data.get("gpu_memory_held", 0),
            gpu_memory_limit=data.get("gpu_memory_limit") or data["gpu_memory"], priority=data["priority"],
            preemptible=data["preemptible"], container_id=data.get("container_id"),
            exit_code=data.get("exit_code"), reason=data.get("reason"), created_at=data["created_at"],
            finished_at=data.get("finished_at"), image=data.get("image"), command=list(data.get("command") or []),
            labels=dict(data.get("labels") or {}), on_overrun=data["on_overrun"],
            queue=QueuePlace.from_json(queue) if queue else None, queued_at=data.get("queued_at"),
            confirm_by=data.get("confirm_by"), preempted_for=data.get("preempted_for"),
            operation=data.get("operation"), detail=dict(data.get("detail") or {}),
            constraints=list(data.get("constraints") or []), topology=data.get("topology"),  # issue 23
            account=data.get("account"), over_quota=bool(data.get("over_quota")),
            reclaimed_for_account=data.get("reclaimed_for_account"), gang=data.get("gang"), rank=data.get("rank"),
            compute_share=int(data.get("compute_share") or 0), raw=data, _collection=collection)

    def _through(self) -> ContainerCollection:
        if self._collection is None:
            raise RuntimeError("this record was not fetched through a client")
        return self._collection

    def reload(self) -> Container:
        """The container's record as the manager has it now."""
        return self._through().get(self.id)

    def remove(self) -> Container:
        """Stop and remove it (or withdraw it from the queue); its grant is freed."""
        return self._through().remove(self.id)

    def resize(self, gpu_memory: int | str | None = None, *, force: bool = False,
               gpu_memory_limit: int | str | None = None) -> Container:
        """Grow or shrink its grant, or its burst limit, in place."""
        return self._through().resize(self.id, gpu_memory, force=force, gpu_memory_limit=gpu_memory_limit)

    def wait(self, timeout: float | None = None) -> WaitResult:
        """Block until it ends (or ``timeout`` seconds pass)."""
        return self._through().wait(self.id, timeout=timeout)

    def kill(self, signal: str = "SIGKILL") -> str:
        """Send ``signal`` to it; the signal as sent."""
        return self._through().kill(self.id, signal)

    def logs(self, tail: int | None = None) -> bytes:
        """Its output so far (stdout and stderr together)."""
        return self._through().logs(self.id, tail=tail)


@dataclass(frozen=True)
class Gpu:
    """One GPU on the map and its memory split, in bytes; ``containers`` holds the grant ids on it."""

    uuid: str
    index: int
    name: str
    memory_total: int
    memory_used: int
    memory_reserved: int
    memory_unmanaged: int
    memory_headroom: int
    memory_free: int
    containers: list[str]
    #: held for a gang that has waited long enough: no other request may take it (issue 35)
    memory_reserved_for_gang: int
    #: what containers use here above their grants (bursters): taken, though no grant reserves it
    memory_burst: int
    compute_capability: str | None  # issue 23
    healthy: bool  # issue 23: false: it takes no new grants, and health says why
    health: str | None  # issue 23
    topology: dict[str, int] | None  # issue 23: its NVLink island, PCIe switch and socket
    #: its node runs MPS, and the percent of its SMs its grants' compute shares take (issue 36)
    mps: bool
    compute_shares: int
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Gpu:
        return cls(uuid=data["uuid"], index=data["index"], name=data["name"], memory_total=data["memory_total"],
                   memory_used=data["memory_used"], memory_reserved=data["memory_reserved"],
                   memory_unmanaged=data["memory_unmanaged"], memory_headroom=data.get("memory_headroom", 0),
                   memory_free=data["memory_free"], containers=list(data.get("containers") or []),
                   memory_reserved_for_gang=data.get("memory_reserved_for_gang", 0),
                   memory_burst=data.get("memory_burst", 0),
                   compute_capability=data.get("compute_capability"), healthy=data.get("healthy", True),
                   health=data.get("health"), topology=data.get("topology"),  # issue 23
                   mps=bool(data.get("mps")), compute_shares=int(data.get("compute_shares") or 0), raw=data)


@dataclass(frozen=True)
class Node:
    """A host with an agent: ``state`` is ``ready`` or ``down``; ``unusable`` says why a ready one takes nothing."""

    name: str
    state: str
    last_seen: float
    runtime: str
    gpus: list[Gpu]
    labels: dict[str, str]  # issue 23
    #: why nothing is placed on it though it is ready (its agent cannot write its fence), else None
    unusable: str | None = None
    #: its agent runs with mps: true: compute shares may be placed on its GPUs (issue 36)
    mps: bool = False
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Node:
        return cls(name=data["name"], state=data["state"], last_seen=data["last_seen"], runtime=data["runtime"],
                   gpus=[Gpu.from_json(g) for g in data["gpus"]], labels=dict(data.get("labels") or {}),
                   unusable=data.get("unusable"), mps=bool(data.get("mps")), raw=data)  # issue 23


@dataclass(frozen=True)
class Event:
    """One event; ``raw`` also holds what an event about a container carries beyond these (labels, detail)."""

    id: int
    time: float
    type: str
    node: str | None
    container: str | None
    message: str
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Event:
        return cls(id=data["id"], time=data["time"], type=data["type"], node=data.get("node"),
                   container=data.get("container"), message=data.get("message", ""), raw=data)


@dataclass(frozen=True)
class WaitResult:
    """How a container ended; ``ended`` is False when the wait's timeout passed first."""

    id: str
    state: str
    exit_code: int | None
    reason: str | None
    ended: bool

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WaitResult:
        return cls(id=data["id"], state=data["state"], exit_code=data.get("exit_code"), reason=data.get("reason"),
                   ended=bool(data["ended"]))


@dataclass(frozen=True)
class Account:
    """One account of ``GET /v1/accounts``: its settings and figures, in bytes × GPUs (``limit`` None: no cap)."""

    name: str
    parent: str | None
    #: what it should hold now, and what it holds, asks for in all, and waits for
    fair_share: int
    allocated: int
    requested: int
    waiting: int
    #: its settings (``accounts:`` in the manager's YAML)
    quota: int
    limit: int | None
    over_quota_weight: float
    priority: int
    reclaim_min_runtime: float
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Account:
        return cls(name=data["name"], parent=data.get("parent"), fair_share=data["fair_share"],
                   allocated=data["allocated"], requested=data["requested"], waiting=data["waiting"],
                   quota=data["quota"]["gpu_memory"], limit=(data.get("limit") or {}).get("gpu_memory"),
                   over_quota_weight=data["over_quota_weight"], priority=data["priority"],
                   reclaim_min_runtime=data["reclaim_min_runtime"], raw=data)


@dataclass(frozen=True)
class GangQueuePlace:
    """Where a waiting gang stands among the waiting gangs (1-based)."""

    position: int

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GangQueuePlace:
        return cls(position=data["position"])


@dataclass(frozen=True)
class Gang:
    """A gang, as ``GET /v1/gangs/{id}`` shows it: ``replicas`` members placed all or none, each holding ``gpus`` ×
    ``gpu_memory`` bytes; ``members`` are their container record ids in rank order (empty while it waits).

    Like :class:`Container`, its methods act through the client that fetched it and return fresh objects.
    """

    id: str
    state: str
    reason: str | None
    exit_code: int | None
    tenant: str | None
    replicas: int
    gpus: int
    gpu_memory: int
    one_per_node: bool
    restart: str
    max_restarts: int
    restart_count: int
    members: list[str]
    #: torchrun's rendezvous, as each member's ``PET_MASTER_ADDR``, ``PET_MASTER_PORT`` and ``PET_RDZV_ID``
    master_addr: str | None
    master_port: int | None
    rdzv_id: str
    image: str | None
    created_at: float
    finished_at: float | None
    queued_at: float | None
    queue: GangQueuePlace | None
    raw: dict[str, Any] = field(repr=False, compare=False)
    _collection: GangCollection | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_json(cls, data: dict[str, Any], collection: GangCollection | None = None) -> Gang:
        queue = data.get("queue")
        return cls(
            id=data["id"], state=data["state"], reason=data.get("reason"), exit_code=data.get("exit_code"),
            tenant=data.get("tenant"), replicas=data["replicas"], gpus=data["gpus"], gpu_memory=data["gpu_memory"],
            one_per_node=data["one_per_node"], restart=data["restart"], max_restarts=data["max_restarts"],
            restart_count=data["restart_count"], members=list(data.get("members") or []),
            master_addr=data.get("master_addr"), master_port=data.get("master_port"), rdzv_id=data["rdzv_id"],
            image=data.get("image"), created_at=data["created_at"], finished_at=data.get("finished_at"),
            queued_at=data.get("queued_at"), queue=GangQueuePlace.from_json(queue) if queue else None,
            raw=data, _collection=collection)

    def _through(self) -> GangCollection:
        if self._collection is None:
            raise RuntimeError("this gang was not fetched through a client")
        return self._collection

    def reload(self) -> Gang:
        """The gang as the manager has it now."""
        return self._through().get(self.id)

    def remove(self) -> Gang:
        """End it: every member is stopped and removed (a waiting gang is withdrawn)."""
        return self._through().remove(self.id)

    def containers(self) -> list[Container]:
        """Its members' records now, in rank order."""
        return self._through().containers(self.id)

    def logs(self, tail: int | None = None) -> dict[int, bytes]:
        """Each member's output so far (stdout and stderr together), by rank."""
        return self._through().logs(self.id, tail=tail)
