"""The manager ⇄ agent wire protocol: typed messages in one msgpack envelope.

Every frame is ``{v, type, id, reply_to, body}`` (and ``epoch`` from a leader of several managers), packed
with msgpack (never pickle) and bounded in size. ``type`` names one of the message classes below;
``body`` is validated against it, so a malformed, unknown or oversized frame raises
:class:`~wire.errors.ProtocolError` and nothing else.
Requests that expect an answer get a :class:`Reply` whose ``reply_to`` is the request's ``id``.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gpumgr.wire import defaults, envelope
from gpumgr.wire.envelope import VERSION, new_id
from gpumgr.wire.epoch import Epoch
from gpumgr.wire.errors import ProtocolError
from gpumgr.wire.policy import Policy
from gpumgr.wire.runspec import SIGNAL, RunSpec

__all__ = ["VERSION", "ProtocolError", "decode", "encode", "new_id"]
_REGISTRY: dict[str, type[Message]] = {}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class Message(_Model):
    """Base of every message; subclasses set ``TYPE`` and are registered by it."""

    TYPE: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.TYPE:
            _REGISTRY[cls.TYPE] = cls


#: How two GPUs of a node are joined (best first), as ``GpuInfo.links`` names it.
LINK_NAMES = ("nvlink", "pcie_switch", "socket", "system")
LinkName = Literal["nvlink", "pcie_switch", "socket", "system"]


class GpuInfo(_Model):
    """A GPU as the agent found it at start-up."""

    uuid: str
    index: int = Field(ge=0)
    name: str
    memory_total: int = Field(ge=0)
    #: ``"8.0"``; empty when the source cannot tell
    compute_capability: str = Field(default="", max_length=16)
    #: how it is joined to each other GPU of the node (by uuid); empty: the source knows no topology
    links: dict[str, LinkName] = Field(default_factory=dict, max_length=defaults.MAX_TOPOLOGY_GPUS)
    #: why it is unhealthy now ("" while healthy), as in ``GpuSample.health``
    health: str = Field(default="", max_length=512)


class GpuSample(_Model):
    """One GPU's memory at one heartbeat: all used bytes, and the part no managed container explains."""

    uuid: str
    memory_used: int = Field(ge=0)
    memory_unmanaged: int = Field(ge=0)
    #: why the GPU is unhealthy ("" while healthy): a fatal Xid, retired pages, ECC errors, heat
    health: str = Field(default="", max_length=512)


class ContainerStatus(_Model):
    """What a heartbeat says of one managed container: its grant id and figures, never its spec."""

    grant: str
    container_id: str
    state: str
    exit_code: int | None = None
    reason: str | None = None
    usage: dict[str, int] = Field(default_factory=dict)
    finished_at: float | None = None
    #: the highest usage (summed over its GPUs) its agent ever sampled
    peak: int = Field(default=0, ge=0)
    #: the grant (bytes per GPU) its agent enforces now; 0 from an agent that does not say
    gpu_memory: int = Field(default=0, ge=0)
    #: the burst limit (bytes per GPU) its agent kills above; 0: the grant itself (no burst)
    gpu_memory_limit: int = Field(default=0, ge=0)


class ContainerReport(ContainerStatus):
    """A managed container as its agent sees it; carries the whole grant so a manager can rebuild it.

    Sent on registration and with each change, never in heartbeats. ``hook`` marks a grant the runtime
    hook asked for (a Swarm task or a plain ``docker run`` with a request): no REST caller waits for it.
    """

    name: str = ""
    image: str = ""
    command: list[str] = Field(default_factory=list)
    gpus: list[str]
    gpu_memory: int = Field(gt=0)
    labels: dict[str, str] = Field(default_factory=dict)
    on_overrun: str = "kill"
    created_at: float = 0.0
    hook: bool = False
    tenant: str = ""
    priority: int = 0
    preemptible: bool = False
    #: its percentage of each GPU's SMs under MPS (0: no share), from its labels
    compute_share: int = Field(default=0, ge=0, le=defaults.MAX_COMPUTE_SHARE)


class RefusedAdoption(_Model):
    """A container that looks managed but cannot be adopted (no trustworthy grant), and why."""

    container_id: str
    name: str = ""
    reason: str


class ContainerSpec(_Model):
    """What the manager asks an agent to run: the grant decides the GPUs and the bytes."""

    grant: str
    name: str
    image: str | None = None
    command: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    gpus: list[str] = Field(min_length=1)
    gpu_memory: int = Field(gt=0)
    #: what it may use per GPU while the GPU has room (a burstable grant); 0: ``gpu_memory``, no burst
    gpu_memory_limit: int = Field(default=0, ge=0)
    on_overrun: str = "kill"
    created_at: float = 0.0
    #: who it belongs to, its priority and whether it may be preempted: kept on the container, so a
    #: restarted manager adopts it whole
    tenant: str = ""
    priority: int = 0
    preemptible: bool = False
    #: its percentage of each GPU's SMs under MPS (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``; 0: no share)
    compute_share: int = Field(default=0, ge=0, le=defaults.MAX_COMPUTE_SHARE)
    #: mounts, ports, namespaces, limits: how it runs beyond its GPUs (None: as the node's defaults)
    run: RunSpec | None = None
    #: what the tenant may ask for; the node checks ``run`` against it again (None: the operator's request)
    policy: Policy | None = None


class Join(Message):
    """Agent → manager, once: admit my key (the link's CURVE key) as node ``node``; answered by a Reply.

    ``proof`` is :func:`gpumgr.wire.security.join_proof` of the join token's secret; the secret itself
    never crosses the wire. It is the only message the manager takes from a key it has not admitted.
    """

    TYPE: ClassVar[str] = "join"
    node: str = Field(min_length=1, max_length=253)
    proof: str = Field(min_length=64, max_length=64)


class Refused(Message):
    """Manager → agent: your registration is refused and retrying will not help; ``message`` says why."""

    TYPE: ClassVar[str] = "refused"
    code: str = Field(max_length=64)
    message: str = Field(max_length=4096)


#: one half of an epoch on the wire: a strict non-negative 64-bit integer (never a string or a bool)
_EpochPart = Annotated[int, Field(strict=True, ge=0, lt=2**63)]


class Register(Message):
    """Agent → manager on connect: who I am, my GPUs, and the managed containers I already run."""

    TYPE: ClassVar[str] = "register"
    node: str = Field(min_length=1, max_length=253)
    runtime: str
    gpus: list[GpuInfo]
    containers: list[ContainerReport] = Field(default_factory=list, max_length=defaults.MAX_CONTAINERS_PER_NODE)
    refused: list[RefusedAdoption] = Field(default_factory=list, max_length=defaults.MAX_CONTAINERS_PER_NODE)
    #: drawn once per agent process: a registration with another one is a restart, not a reconnect
    instance: str = Field(default="", max_length=64)
    #: the agent's gpumgr version, so a manager can refuse one too old for its commands ("": before 0.1.0)
    version: str = Field(default="", max_length=32, pattern=r"^[0-9A-Za-z.+-]*$")  # issue 21
    #: the node's labels from its operator (``node.labels.KEY`` constraints)
    labels: dict[str, str] = Field(default_factory=dict, max_length=defaults.MAX_NODE_LABELS)
    #: the highest leader epoch the agent accepted (its fence), ``[generation, revision]``; a leader below it takes
    #: a higher generation in the store and stands again (an etcd restored from a snapshot, or rebuilt)
    epoch: tuple[_EpochPart, _EpochPart] | None = None
    #: why its fence file cannot be written ("": it can); the manager places nothing there meanwhile
    fence_unwritable: str = Field(default="", max_length=512)
    #: where other hosts reach this node (a gang's rendezvous on its rank 0's node); "": not said
    advertise_addr: str = Field(default="", max_length=253, pattern=r"^[0-9A-Za-z.:_\[\]-]*$")
    #: the node runs the MPS control daemon (its YAML's ``mps``): compute shares may be placed on its GPUs
    mps: bool = False


class Registered(Message):
    """Manager → agent: registration accepted; report every ``heartbeat_interval`` seconds."""

    TYPE: ClassVar[str] = "registered"
    heartbeat_interval: float = Field(gt=0)
    #: bytes per GPU the manager keeps back from grants: the agent stops bursters before they eat into it
    headroom: int = Field(default=0, ge=0)


class Heartbeat(Message):
    """Agent → manager every interval: memory per GPU and usage per managed container."""

    TYPE: ClassVar[str] = "heartbeat"
    node: str
    gpus: list[GpuSample]
    containers: list[ContainerStatus] = Field(default_factory=list, max_length=defaults.MAX_CONTAINERS_PER_NODE)
    #: as in :class:`Register`: why the fence cannot be written now ("" once it can, and the node takes commands)
    fence_unwritable: str = Field(default="", max_length=512)


class Reregister(Message):
    """Manager → agent: I do not know you (I restarted, or declared you down); register again."""

    TYPE: ClassVar[str] = "reregister"


class Create(Message):
    """Manager → agent: create and start this container; answered by a Reply with a ContainerReport."""

    TYPE: ClassVar[str] = "create"
    spec: ContainerSpec
    #: the manager's operation id: a delivery of the same (grant, op) again runs once ("": no dedupe)
    op: str = Field(default="", max_length=64)


class Remove(Message):
    """Manager → agent: stop and remove the container holding ``grant``; answered by a Reply."""

    TYPE: ClassVar[str] = "remove"
    grant: str
    stop_grace: float = Field(default=defaults.STOP_GRACE, ge=0)
    #: as in :class:`Create`
    op: str = Field(default="", max_length=64)


class Resize(Message):
    """Manager → agent: the container holding ``grant`` is now granted ``gpu_memory`` on each GPU; answered by a Reply.

    The enforcer judges it against the new figures (``gpu_memory_limit`` for a burster) from its next sample on.
    """

    TYPE: ClassVar[str] = "resize"
    grant: str
    gpu_memory: int = Field(gt=0)
    #: the burst limit from now on (0: ``gpu_memory``, no burst)
    gpu_memory_limit: int = Field(default=0, ge=0)
    #: as in :class:`Create`
    op: str = Field(default="", max_length=64)


class Logs(Message):
    """Manager → agent: the next piece of the output of the container holding ``grant``; answered by a Reply.

    The manager keeps the cursor: ``since`` is the engine's timestamp (``seconds.nanoseconds``) of the
    last line it has, and ``skip`` how many lines at exactly that time it has. The reply's result is
    ``{frames: [[stream, bytes], ...], since, skip, more}`` (stream 1 stdout, 2 stderr), at most
    ``limit`` bytes; ``tail`` (first call only) starts that many lines from the end.
    """

    TYPE: ClassVar[str] = "logs"
    grant: str = Field(min_length=1, max_length=64)
    since: str = Field(default="", max_length=32, pattern=r"^([0-9]{1,12}\.[0-9]{9})?$")
    skip: int = Field(default=0, ge=0, le=defaults.MAX_ITEMS)
    #: only the last this many lines (first request only); -1: all
    tail: int = Field(default=-1, ge=-1, le=defaults.MAX_ITEMS)
    limit: int = Field(default=defaults.LOGS_CHUNK, gt=0, le=defaults.LOGS_CHUNK)
    #: one reader following the container: the node keeps the engine's follow stream open between requests,
    #: and its result adds ``ended`` once the container stopped and everything was read
    session: str = Field(default="", max_length=64)


class Signal(Message):
    """Manager → agent: send ``signal`` to the container holding ``grant`` (``docker kill``); answered by a Reply."""

    TYPE: ClassVar[str] = "signal"
    grant: str = Field(min_length=1, max_length=64)
    signal: str = Field(pattern=SIGNAL.pattern, max_length=20)


#: How deep and how wide a node's free-form ``detail`` is kept: an overrun report is two levels deep,
#: and nothing a node sends may be nested so deep that the views serving it run out of stack.
DETAIL_DEPTH = 6
DETAIL_ITEMS = 64


def clean_detail(value: Any, depth: int = DETAIL_DEPTH) -> Any:
    """``value`` as plain JSON data, nested at most ``depth`` deep and at most ``DETAIL_ITEMS`` wide."""
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if depth <= 0:
        return "…"
    if isinstance(value, dict):
        return {str(k): clean_detail(v, depth - 1) for k, v in list(value.items())[:DETAIL_ITEMS]}
    if isinstance(value, list | tuple):
        return [clean_detail(v, depth - 1) for v in list(value)[:DETAIL_ITEMS]]
    return str(value)


class ContainerEvent(Message):
    """Agent → manager, as it happens: a managed container changed state (exited, killed, removed)."""

    TYPE: ClassVar[str] = "container_event"
    node: str
    container: ContainerReport
    detail: dict[str, Any] = Field(default_factory=dict)

    @field_validator("detail")
    @classmethod
    def _bounded(cls, value: dict[str, Any]) -> dict[str, Any]:
        """Cut at the boundary: the manager keeps and serves this, and a node may send anything."""
        cut: dict[str, Any] = clean_detail(value)
        return cut


class Reserve(Message):
    """Runtime hook → agent → manager: grant memory for a container Docker is creating right now.

    Swarm tasks cannot carry devices, so their GPU is chosen when the node's OCI runtime hook sees
    the container being created; the agent fills in ``node`` before forwarding. Answered by a Reply
    whose result is ``{grant, gpus, gpu_memory}``. Asking again for the same ``container_id`` while
    its grant lives returns the same grant.
    """

    TYPE: ClassVar[str] = "reserve"
    container_id: str = Field(min_length=1, max_length=128)
    gpu_memory: int = Field(gt=0)
    #: the burst limit per GPU (0: ``gpu_memory``, no burst)
    gpu_memory_limit: int = Field(default=0, ge=0)
    gpus: int = Field(default=1, ge=1, le=defaults.MAX_GPUS_PER_REQUEST)
    name: str = Field(default="", max_length=256)
    image: str = Field(default="", max_length=512)
    labels: dict[str, str] = Field(default_factory=dict)
    on_overrun: str | None = None
    node: str = ""
    priority: int = Field(default=0, ge=-defaults.MAX_PRIORITY, le=defaults.MAX_PRIORITY)
    preemptible: bool = False
    #: its percentage of each GPU's SMs under MPS (0: no share)
    compute_share: int = Field(default=0, ge=0, le=defaults.MAX_COMPUTE_SHARE)
    #: wait in the manager's queue for room (the task's container waits in its create) instead of failing
    queue: bool = False
    #: where the task may run (``wire.constraints``): checked against the node Swarm chose
    constraints: list[str] = Field(default_factory=list, max_length=32)
    #: the tenant a plain ``docker run``'s hook request counts against (the agent's ``hook_tenant``); a
    #: Swarm task's is empty: it acts as the operator
    tenant: str = Field(default="", max_length=128)


class ErrorBody(_Model):
    """The one error shape on the link, the same as on REST."""

    code: str
    message: str


class Reply(Message):
    """The answer to any request: ``ok`` with a ``result``, or an ``error``."""

    TYPE: ClassVar[str] = "reply"
    ok: bool
    result: dict[str, Any] = Field(default_factory=dict)
    error: ErrorBody | None = None


class Envelope(_Model):
    """One frame on the wire."""

    v: int
    type: str
    id: str = Field(min_length=1, max_length=64)
    reply_to: str | None = Field(default=None, max_length=64)
    body: dict[str, Any]
    #: the sending leader's epoch ``[generation, revision]`` (several managers on etcd); absent from one manager
    epoch: tuple[_EpochPart, _EpochPart] | None = None


def encode(message: Message, *, msg_id: str | None = None, reply_to: str | None = None,
           epoch: Epoch | None = None) -> bytes:
    """Pack ``message`` into one frame, stamped with ``epoch`` when given.

    Raises ProtocolError if the frame would be over the size bound.
    """
    return envelope.pack(message.TYPE, message.model_dump(mode="python"), msg_id=msg_id, reply_to=reply_to,
                         epoch=None if epoch is None else epoch.to_wire())


def decode(frame: bytes) -> tuple[Envelope, Message]:
    """Unpack and validate one frame into its envelope and typed message.

    Raises ProtocolError, chained to the cause, for anything oversized, unparseable, of another
    protocol version, of an unknown type or with a body that does not fit its type.
    """
    raw = envelope.unpack(frame)
    try:
        head = Envelope.model_validate(raw)
    except ValidationError as exc:
        raise ProtocolError(f"bad envelope: {_first_error(exc)}") from exc
    if head.v != VERSION:
        raise ProtocolError(f"protocol version {head.v} is not {VERSION}")
    cls = _REGISTRY.get(head.type)
    if cls is None:
        raise ProtocolError(f"unknown message type {head.type!r}")
    try:
        return head, cls.model_validate(head.body)
    except ValidationError as exc:
        raise ProtocolError(f"bad {head.type} body: {_first_error(exc)}") from exc


def message_types() -> dict[str, type[Message]]:
    """Every registered message type by name (for tests and documentation)."""
    return dict(_REGISTRY)


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ())) or "(root)"
    return f"{where}: {err.get('msg')}"
