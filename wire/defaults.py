"""Every timeout, interval and limit, defined once and derived from each other where they depend."""

from __future__ import annotations

from typing import Final

API_HOST = "127.0.0.1"
API_PORT = 9400
AGENTS_ENDPOINT = "tcp://127.0.0.1:9401"

#: The agent reports once a second; a node is ``down`` after this many silent intervals.
HEARTBEAT_INTERVAL = 1.0
HEARTBEAT_LIVENESS = 3
NODE_DOWN_AFTER = HEARTBEAT_INTERVAL * HEARTBEAT_LIVENESS
#: The link's owner thread wakes at least this often for its periodic work (timeouts, sweeps).
LINK_TICK = HEARTBEAT_INTERVAL / 2
#: Workers that run what the link receives (each node's messages in order, on the lane of its key).
LINK_LANES = 4
#: Messages one sender may have waiting for its lane; beyond it they are dropped (its next heartbeat repeats them).
LINK_LANE_BACKLOG = 256
#: Frames kept for one node whose connection is gone, sent on its next frame (beyond it the oldest fail).
LINK_PARKED_MAX = 256
#: A frame with nobody waiting on it is kept this long for a node whose connection is gone.
LINK_PARK_FOR = NODE_DOWN_AFTER
#: The link loop's gap between two polls above which a warning is logged.
LINK_LAG_WARN = 1.0
#: Proven keys whose newest connection the link remembers (the oldest is forgotten beyond it).
LINK_ROUTES_MAX = 65536

#: How long the manager waits for an agent to create a container (image already local).
CREATE_TIMEOUT = 60.0
#: A grant being created is released this long after the create's own timeout if nothing settled it.
CREATE_MARGIN = 10.0
#: Seconds a container gets between SIGTERM and SIGKILL, on ``DELETE`` and when the enforcer stops it.
STOP_GRACE = 5.0
#: How long the manager waits for an agent to stop and remove a container: the grace, and room to spare.
REMOVE_TIMEOUT = STOP_GRACE * 6
#: ``docker gpu`` waits this long for the manager's answer: longer than the manager waits for an agent.
CLI_TIMEOUT = CREATE_TIMEOUT + 30.0

#: The enforcer's cheap poll of per-process use, its full sample, and the samples over a grant before acting.
POLL_INTERVAL = 0.1
SAMPLE_INTERVAL = HEARTBEAT_INTERVAL
OVERRUN_SAMPLES = 2
#: The samples that confirm a first over reading are taken this far apart: an independent second read,
#: not a poll interval on every kill's path (issue 36: the kill tail).
OVERRUN_CONFIRM_INTERVAL = 0.02
#: Threads the enforcer acts on (report, re-check, kill), so kills of different containers never queue.
ENFORCER_WORKERS = 8
#: A kill the engine refused is retried after this pause, doubling up to the cap.
KILL_RETRY_MIN = 0.2
KILL_RETRY_MAX = 5.0
#: Simulated GPUs: a new process's usage file is trusted after this settling time; every process
#: is re-identified from /proc this often.
SIM_SETTLE = 2 * SAMPLE_INTERVAL
SIM_REIDENTIFY = 5 * SAMPLE_INTERVAL

#: Threads the agent runs create/remove commands on, and the REST server's threads.
AGENT_WORKERS = 8
#: Answers to commands (by grant and operation id) an agent keeps, so one delivered again is not run again.
AGENT_OPS_KEPT = 1024
API_THREADS = 16

#: How long the runtime hook's request may wait for the manager before the hook is told no, and the
#: hook's own wait for the agent (longer, so the agent's answer, even a timeout, arrives).
HOOK_TIMEOUT = 20.0
HOOK_WAIT = HOOK_TIMEOUT + 5.0
#: A task container that has not started this long after its grant gives the grant back.
TASK_START_TIMEOUT = 2 * CREATE_TIMEOUT
#: How long an agent whose host has a Docker engine waits for it to answer at start before giving up.
ENGINE_WAIT = 60.0
#: Delay before the agent re-opens a broken Docker event stream.
EVENT_RETRY = 1.0
#: Hook connections served at once; more are accepted and closed at once.
HOOK_MAX_CONNECTIONS = 256

#: How long a joining agent waits for the manager's answer before it gives up and says why.
JOIN_TIMEOUT = 30.0

#: Agent reconnect backoff: starts small, doubles, capped.
RECONNECT_MIN = 0.1
RECONNECT_MAX = 5.0
#: How long an agent waits for the manager to answer a Join or a Register it could send before asking
#: again (then doubling, capped at RECONNECT_MAX, each wait jittered): a manager admitting a whole rack
#: at once answers in well under this, and asking sooner only adds duplicates to its queue.
ANSWER_WAIT = 0.5

#: Connections the manager's link lets wait to be accepted (ZeroMQ's default is 100): a whole rack.
LINK_BACKLOG = 2048

#: Bounds on what a peer may make us allocate; a message over them is a ProtocolError.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
#: Per-field bounds inside a frame: no string over 64 KiB, no list or map over this many items.
MAX_FIELD_BYTES = 64 * 1024
MAX_ITEMS = 16 * 1024
#: The largest byte figure gpumgr carries (a signed 64-bit integer); bigger usage readings are clamped to it.
MAX_BYTES = 2**63 - 1
#: The most GPUs one request may ask for.
MAX_GPUS_PER_REQUEST = 64
#: Simulated GPUs per spec, and the most a simulated usage file is read.
MAX_SIM_DEVICES = 1024
MAX_USAGE_FILE_BYTES = 4096
MAX_CONTAINERS_PER_NODE = 4096
#: Labels one agent may give its node, and GPUs per node whose pairwise links are reported.
MAX_NODE_LABELS = 64
MAX_TOPOLOGY_GPUS = 64

#: GPU health (agent side): a GPU is unhealthy from the first sample that finds a fatal Xid since it was
#: last healthy, retired pages pending, more than this many uncorrected (volatile) ECC errors, or a
#: temperature at or over the limit (°C); it is healthy again from the first sample that finds none.
GPU_ECC_UNCORRECTED_LIMIT = 0
GPU_TEMPERATURE_LIMIT = 90
#: How often the agent asks NVML about health (seconds); Xid events are waited for between asks.
GPU_HEALTH_INTERVAL = 5.0

#: How many events ``GET /v1/events`` keeps, oldest dropped first.
EVENTS_KEPT = 1000
#: Finished container records kept for ``GET /v1/containers`` before the oldest are forgotten.
FINISHED_KEPT = 1000
#: An agent repeats a container's end in its heartbeats this long (its exit event may have been lost);
#: registrations carry the newest FINISHED_KEPT ends, so a returning manager records what it missed.
ENDED_REPORTED_FOR = 30 * HEARTBEAT_INTERVAL

#: A node down this long is dropped from the map with its grants (its agent's key binding stays).
NODE_FORGET_AFTER = 24 * 3600.0
#: Kubernetes' rule for a disrupted zone: when at least DISRUPTION_MIN_NODES nodes, and this fraction of those
#: that were ready, went silent within one down timeout, it is taken for a partition (the manager's own, or a
#: switch's), not their deaths: nothing of theirs is forgotten or expired until they return (as Kubernetes'
#: unhealthyZoneThreshold, and its zone of more than two unready nodes).
DISRUPTION_THRESHOLD = 0.55
DISRUPTION_MIN_NODES = 3
#: A leader that hears from fewer than half of the nodes it had for this long, while most of the silent ones ask
#: other managers to register, is cut off from its agents but not from etcd: it steps down (see
#: ``gpumgr.manager.headless``). Followers publish who asked them at most this often, and keep this many askers.
HEADLESS_AFTER = 10.0
ASKS_PUBLISH_INTERVAL = 2.0
ASKS_KEPT = 4096
#: A hook-granted container must show up in its node's reports within this long, or its grant is released.
HOOK_CONFIRM = HOOK_WAIT + 3 * HEARTBEAT_INTERVAL

#: The manager's collector thresholds (young, middle, old; Python's are 700, 10, 10) and GIL hand-over
#: interval (Python's is 5 ms): see ``gpumgr.cli.tune_for_latency``.
GC_THRESHOLD = (20_000, 20, 50)
SWITCH_INTERVAL = 0.002

#: ``GET /v1/nodes`` serves a cached map this old at most while no grant or node changed.
MAP_MAX_AGE = 0.5

#: Queue aging: a waiting request's effective priority rises by one step every this many seconds, so a
#: low-priority request is never starved by a stream of higher ones (it passes one of priority p+k after k steps).
QUEUE_AGING = 60.0
#: The most requests the queue holds; more are refused with 409 (each is a few hundred bytes in memory and on disk).
QUEUE_MAX = 100_000
#: Priorities a request may ask for lie within ± this bound.
MAX_PRIORITY = 1_000_000
#: The sum of compute shares (percentages of a GPU's SMs under MPS) one GPU's live grants may hold.
MAX_COMPUTE_SHARE = 100
#: Longest ``queue_timeout`` (seconds): about a year.
MAX_QUEUE_TIMEOUT = 366 * 24 * 3600.0
#: The dispatcher looks at the queue at least this often even when nothing woke it (deadlines, retries).
DISPATCH_TICK = HEARTBEAT_INTERVAL / 2
#: A preemption its node refused is not asked of the same container again for this long (jittered ×0.5–1.5),
#: doubling per refusal up to the cap: at least one stop's grace, at most two removals' own timeouts. After
#: PREEMPT_RETRIES refusals that container is no longer chosen, and an event says so.
PREEMPT_RETRY_MIN = STOP_GRACE
PREEMPT_RETRY_MAX = 2 * REMOVE_TIMEOUT
PREEMPT_RETRIES = 5
#: Seconds a burster runs before the manager may reclaim its burst for a request (``burst_min_runtime``).
BURST_MIN_RUNTIME = 30.0
#: Threads that start queued containers on their nodes once placed (no REST caller waits for those).
DISPATCH_WORKERS = 8
#: The queue journal is rewritten whole once it holds this many lines more than twice the queue.
QUEUE_JOURNAL_SLACK = 10_000

#: A Swarm task created with ``docker gpu service create --queue`` waits in its runtime hook this long at most
#: for room; its queued request expires a margin earlier, so the hook hears why rather than a timeout.
HOOK_QUEUE_WAIT = 3600.0
HOOK_QUEUE_TIMEOUT = HOOK_QUEUE_WAIT - 2 * HOOK_TIMEOUT

#: Spec used by ``--gpus auto`` when no NVIDIA driver answers.
SIM_SPEC = "sim:2x24GiB"
PLACEMENT: Final = "spread"

# --- a container's output and end (issue 19) -------------------------------------------------
#: Most bytes of output one logs reply carries (each line at most MAX_FIELD_BYTES, as Docker splits at 16 KiB).
LOGS_CHUNK = 1024 * 1024
#: Most frames one logs reply carries (lines of one stream in a row travel joined, up to MAX_FIELD_BYTES a frame).
LOGS_LINES = MAX_ITEMS // 2
#: How often a followed container's node is asked for more output while it has none.
LOGS_POLL = 0.25
#: Longest single ``POST /v1/containers/{id}/wait``; a client waiting longer asks again.
WAIT_MAX = 600.0

# --- gangs ---------------------------------------------------------------------------------------
#: The ports a gang's master (rank 0) listens on, taken per host, lowest free first (torchrun's 29500 first).
GANG_PORTS = (29500, 29999)
#: Once one member of a gang exits 0, the others have this long to exit 0 too, or the gang fails.
GANG_EXIT_GRACE = 60.0
#: A gang member whose node is down is waited for this long before the gang ends (KAI's staleness grace).
GANG_GRACE = 60.0
#: A gang that waited this long at the head of its priority has room held for it as room frees (Volcano's SLA).
GANG_RESERVE_AFTER = 300.0
#: A gang has at least this many members, and at most the larger.
GANG_MIN_REPLICAS = 2
GANG_MAX_REPLICAS = 256
