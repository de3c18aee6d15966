"""Names that cross process boundaries, defined once: container labels, environment variables, states, events.

The manager, the agent, the runtime hook and the ``docker gpu`` plugin are separate processes that
agree on these strings; a typo in one of them would silently break the agreement, so every use goes
through the enums below. They are ``StrEnum``s: each member *is* its string on the wire, in JSON and
in Docker's labels.
"""

from __future__ import annotations

from enum import StrEnum

#: Every label gpumgr writes starts with this; users may not set labels under it.
LABEL_PREFIX = "gpumgr."


class Label(StrEnum):
    """Container labels (and OCI annotations) that carry a grant where the container cannot change it."""

    GRANT = "gpumgr.grant"
    NODE = "gpumgr.node"
    GPU = "gpumgr.gpu"
    MEMORY = "gpumgr.memory"
    NAME = "gpumgr.name"
    COMMAND = "gpumgr.command"
    ON_OVERRUN = "gpumgr.on_overrun"
    CREATED_AT = "gpumgr.created_at"
    USER_LABELS = "gpumgr.user_labels"
    TASK = "gpumgr.task"
    SERVICE = "gpumgr.service"
    SLOT = "gpumgr.slot"
    TENANT = "gpumgr.tenant"
    PRIORITY = "gpumgr.priority"
    PREEMPTIBLE = "gpumgr.preemptible"
    COMPUTE_SHARE = "gpumgr.compute_share"
    #: a burstable grant's limit in bytes per GPU (absent: the grant is its limit)
    MEMORY_LIMIT = "gpumgr.memory_limit"


class Env(StrEnum):
    """Environment variables gpumgr sets in containers or reads from them and from its own processes."""

    # set in a managed container: what it was granted (informative; never read back as its grant)
    GRANT = "GPUMGR_GRANT"
    GPU_MEMORY = "GPUMGR_GPU_MEMORY"
    GPU_MEMORY_LIMIT = "GPUMGR_GPU_MEMORY_LIMIT"
    NODE = "GPUMGR_NODE"
    ON_OVERRUN = "GPUMGR_ON_OVERRUN"
    NVIDIA_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
    CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
    # set in a managed container on an MPS node: the driver's caps for its processes, and where its daemon listens
    MPS_THREAD_PERCENTAGE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
    MPS_MEM_LIMIT = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
    MPS_PIPE_DIRECTORY = "CUDA_MPS_PIPE_DIRECTORY"
    # a simulated GPU process declares its use through the file this names
    SIM_USAGE_FILE = "GPUMGR_SIM_USAGE_FILE"
    # set by `docker gpu` on a Swarm task: what the runtime hook asks the agent for
    REQUEST_MEMORY = "GPUMGR_REQUEST_MEMORY"
    REQUEST_MEMORY_LIMIT = "GPUMGR_REQUEST_MEMORY_LIMIT"
    REQUEST_GPUS = "GPUMGR_REQUEST_GPUS"
    REQUEST_ON_OVERRUN = "GPUMGR_REQUEST_ON_OVERRUN"
    REQUEST_PRIORITY = "GPUMGR_REQUEST_PRIORITY"
    REQUEST_PREEMPTIBLE = "GPUMGR_REQUEST_PREEMPTIBLE"
    REQUEST_COMPUTE_SHARE = "GPUMGR_REQUEST_COMPUTE_SHARE"
    REQUEST_QUEUE = "GPUMGR_REQUEST_QUEUE"
    #: a task's ``gpu.*`` constraints, a JSON list (``docker gpu service create --constraint``)
    REQUEST_CONSTRAINTS = "GPUMGR_REQUEST_CONSTRAINTS"
    TASK = "GPUMGR_TASK"
    TASK_NAME = "GPUMGR_TASK_NAME"
    SERVICE = "GPUMGR_SERVICE"
    SLOT = "GPUMGR_SLOT"
    # read by gpumgr's own processes
    TOKEN = "GPUMGR_TOKEN"
    MANAGER = "GPUMGR_MANAGER"
    RUNC = "GPUMGR_RUNC"
    HOOK_SOCKET = "GPUMGR_HOOK_SOCKET"
    RUNTIME_CONFIG = "GPUMGR_RUNTIME_CONFIG"
    #: Seconds the shell launcher waits for the agent to take its request off the hook pipe (tests shorten it).
    HOOK_PIPE_WAIT = "GPUMGR_HOOK_PIPE_WAIT"


class State(StrEnum):
    """A container's life, as the manager records it and the agent reports it."""

    CREATING = "creating"
    RUNNING = "running"
    EXITED = "exited"
    KILLED = "killed"
    FAILED = "failed"
    REMOVED = "removed"
    #: waiting in the manager's queue for room; holds no grant
    QUEUED = "queued"
    #: left the queue unplaced when its ``queue_timeout`` ran out
    EXPIRED = "expired"
    #: a preemptible container stopped to make room for a queued request of higher priority
    PREEMPTED = "preempted"


def flag_set(value: str | None) -> bool:
    """Whether an environment flag such as ``GPUMGR_REQUEST_QUEUE`` is set: ``1``, ``true`` or ``yes``."""
    return (value or "").strip().lower() in ("1", "true", "yes")


#: Environment names gpumgr sets or reads to grant memory: a REST request may not set them itself
#: (a container asking the runtime hook for a second grant, or claiming one, is refused at the API).
RESERVED_ENV = frozenset({Env.GRANT, Env.GPU_MEMORY, Env.GPU_MEMORY_LIMIT, Env.REQUEST_MEMORY_LIMIT, Env.NODE,
                          Env.ON_OVERRUN, Env.REQUEST_MEMORY,
                          Env.REQUEST_GPUS, Env.REQUEST_ON_OVERRUN, Env.REQUEST_PRIORITY, Env.REQUEST_PREEMPTIBLE,
                          Env.REQUEST_QUEUE, Env.REQUEST_CONSTRAINTS, Env.TASK, Env.TASK_NAME, Env.SERVICE, Env.SLOT,
                          Env.REQUEST_COMPUTE_SHARE, Env.MPS_THREAD_PERCENTAGE, Env.MPS_MEM_LIMIT,
                          Env.MPS_PIPE_DIRECTORY})

#: States that hold a grant.
LIVE = frozenset({State.CREATING, State.RUNNING})
#: The states as plain module globals, for the map's hot paths (every placement and every end): reading
#: ``State.X`` goes through the enum class's attribute lookup, about ten times a global's cost.
QUEUED, CREATING, RUNNING, EXITED, KILLED, FAILED, REMOVED, PREEMPTED = (
    State.QUEUED, State.CREATING, State.RUNNING, State.EXITED, State.KILLED, State.FAILED, State.REMOVED,
    State.PREEMPTED)
#: What an agent reports for a container it is stopping on request: still running, still holding its grant.
REMOVING = "removing"


#: Why a burster was stopped to give bytes back to a grant (by the manager's reclaim or its node's protection):
#: it ends ``preempted`` with this reason.
BURST_RECLAIMED = "burst_reclaimed"


def burst_limit(gpu_memory: int, gpu_memory_limit: int) -> int:
    """What a grant of ``gpu_memory`` with ``gpu_memory_limit`` may use per GPU (0: no burst, the grant itself)."""
    return gpu_memory_limit if gpu_memory_limit > gpu_memory else gpu_memory


class EventType(StrEnum):
    """Kinds of events in ``GET /v1/events``, as clients see them."""

    PLACED = "placed"
    STARTED = "started"
    EXITED = "exited"
    KILLED = "killed"
    OVERRUN = "overrun"
    REMOVED = "removed"
    FAILED = "failed"
    ADOPTED = "adopted"
    NODE_UP = "node_up"
    NODE_DOWN = "node_down"
    QUEUED = "queued"
    EXPIRED = "expired"
    PREEMPTED = "preempted"
    RESIZED = "resized"
    GPU_UNHEALTHY = "gpu_unhealthy"
    GPU_HEALTHY = "gpu_healthy"
    #: the store did not answer in time: event ids from here on (up to a bound) are handed out unreserved, and
    #: a later block or leader starts above that bound, so a client following ``since=`` sees ids jump there
    IDS_UNRESERVED = "ids_unreserved"
