"""Every timeout, interval and limit, defined once and derived from each other where they depend."""

from __future__ import annotations

API_HOST = "127.0.0.1"
API_PORT = 9400
AGENTS_ENDPOINT = "tcp://127.0.0.1:9401"

#: The agent reports once a second; a node is ``down`` after this many silent intervals.
HEARTBEAT_INTERVAL = 1.0
HEARTBEAT_LIVENESS = 3
NODE_DOWN_AFTER = HEARTBEAT_INTERVAL * HEARTBEAT_LIVENESS

#: How long the manager waits for an agent to create a container (image already local).
CREATE_TIMEOUT = 60.0
REMOVE_TIMEOUT = 30.0
#: Seconds Docker gives a container between SIGTERM and SIGKILL on ``DELETE``.
STOP_GRACE = 5

#: Agent reconnect backoff: starts small, doubles, capped.
RECONNECT_MIN = 0.1
RECONNECT_MAX = 5.0

#: Bounds on what a peer may make us allocate; a message over them is a ProtocolError.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MAX_CONTAINERS_PER_NODE = 4096

#: How many events ``GET /v1/events`` keeps, oldest dropped first.
EVENTS_KEPT = 1000
#: Finished container records kept for ``GET /v1/containers`` before the oldest are forgotten.
FINISHED_KEPT = 1000

#: ``GET /v1/nodes`` serves a cached map this old at most while no grant or node changed.
MAP_MAX_AGE = 0.5

#: Spec used by ``--gpus auto`` when no NVIDIA driver answers.
SIM_SPEC = "sim:2x24GiB"
PLACEMENT = "spread"
