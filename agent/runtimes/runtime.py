"""Where containers run: the common ground of the Docker and host-process runtimes.

Both runtimes keep an in-memory table of the managed containers they know, so the heartbeat never
asks Docker anything; Docker is only called to create, stop, remove, and (once, at start) to re-adopt
the containers that outlived a previous agent. Exits (and Swarm task starts) are reported through
``on_change`` as they happen. The runtimes themselves are in :mod:`gpumgr.agent.runtimes.docker_runtime` and
:mod:`gpumgr.agent.runtimes.process_runtime`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpumgr.agent.runtimes import mps as mps_caps
from gpumgr.wire import defaults
from gpumgr.wire.errors import InvalidRequest, NotFound
from gpumgr.wire.names import LABEL_PREFIX, REMOVING, Env, Label, State, burst_limit
from gpumgr.wire.protocol import ContainerReport, ContainerSpec, ContainerStatus, RefusedAdoption


@dataclass
class Managed:
    """A container (or process group) that holds a grant, as its runtime tracks it."""

    grant: str
    container_id: str
    name: str
    gpus: list[str]
    gpu_memory: int
    image: str = ""
    command: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    on_overrun: str = "kill"
    created_at: float = 0.0
    state: str = State.RUNNING
    exit_code: int | None = None
    reason: str | None = None
    pid: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    #: granted through the runtime hook (a Swarm task, or ``docker run`` with a request)
    hook: bool = False
    finished_at: float | None = None
    tenant: str = ""
    priority: int = 0
    preemptible: bool = False
    #: its percentage of each GPU's SMs under MPS (0: no share)
    compute_share: int = 0
    #: the highest usage, summed over its GPUs, any sample has seen
    peak: int = 0
    #: a burstable grant's limit per GPU (0: ``gpu_memory`` is its limit)
    gpu_memory_limit: int = 0

    @property
    def limit(self) -> int:
        """What it may use per GPU before the enforcer acts: its burst limit, or its grant."""
        return burst_limit(self.gpu_memory, self.gpu_memory_limit)

    def report(self, usage: dict[str, int] | None = None, *, compact: bool = False) -> ContainerReport:
        """This container as the wire protocol carries it; ``compact`` leaves out its command and user labels."""
        labels = {k: v for k, v in self.labels.items() if k.startswith(LABEL_PREFIX)} if compact else self.labels
        return ContainerReport(
            grant=self.grant, container_id=self.container_id, name=self.name, image=self.image,
            command=[] if compact else self.command, gpus=self.gpus, gpu_memory=self.gpu_memory, state=self.state,
            exit_code=self.exit_code, reason=self.reason, usage=usage or {}, labels=labels,
            on_overrun=self.on_overrun, created_at=self.created_at, hook=self.hook, finished_at=self.finished_at,
            tenant=self.tenant, priority=self.priority, preemptible=self.preemptible, peak=self.peak,
            compute_share=self.compute_share,
            gpu_memory_limit=self.gpu_memory_limit,
        )

    def status(self, usage: dict[str, int] | None = None) -> ContainerStatus:
        """What a heartbeat carries of this container: the grant id and its figures."""
        return ContainerStatus(grant=self.grant, container_id=self.container_id, state=self.state,
                               exit_code=self.exit_code, reason=self.reason, usage=usage or {},
                               finished_at=self.finished_at, peak=self.peak, gpu_memory=self.gpu_memory,
                               gpu_memory_limit=self.gpu_memory_limit)


ChangeCallback = Callable[[Managed], None]


def grant_env(spec: ContainerSpec, mps: bool = False) -> dict[str, str]:
    """The variables that pin a container to its GPUs and tell it its grant.

    With ``mps`` (the host runs the MPS control daemon) the CUDA driver itself also caps each
    visible device at the limit (a burster's ``gpu_memory_limit``, else the grant), through
    ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``. The cap is per client process, so several processes of one
    container can pass it together: the enforcer's kill stays the fence. A ``compute_share`` becomes
    ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` there (:mod:`gpumgr.agent.runtimes.mps`); without MPS a share
    means nothing to the driver and is not passed.
    """
    limit = burst_limit(spec.gpu_memory, spec.gpu_memory_limit)
    env = {**spec.env, Env.NVIDIA_VISIBLE_DEVICES: ",".join(spec.gpus), Env.GPU_MEMORY: str(spec.gpu_memory),
           Env.GPU_MEMORY_LIMIT: str(limit), Env.GRANT: spec.grant}
    if mps:
        env.update(mps_caps.memory_env(limit, len(spec.gpus)))
        env.update(mps_caps.share_env(spec.compute_share))
    return env


def task_env(managed: Managed, node: str, mps: bool = False) -> dict[str, str]:
    """What the runtime hook writes into a task container's environment: its pinning and its grant."""
    spec = ContainerSpec(grant=managed.grant, name=managed.name, gpus=managed.gpus, gpu_memory=managed.gpu_memory,
                         compute_share=managed.compute_share, gpu_memory_limit=managed.gpu_memory_limit)
    return {**grant_env(spec, mps), Env.NODE: node, Env.ON_OVERRUN: managed.on_overrun}


class Runtime:
    """Common table keeping for both runtimes; subclasses do the creating and stopping."""

    kind = "none"

    def __init__(self, on_change: ChangeCallback, *, mps: bool = False,
                 mps_pipe_directory: str = mps_caps.DEFAULT_PIPE_DIRECTORY) -> None:
        self._on_change = on_change
        self.mps = mps
        #: where the host's MPS daemon listens (given to containers on an ``mps`` node)
        self.mps_pipe_directory = mps_pipe_directory
        self._lock = threading.Lock()
        self._table: dict[str, Managed] = {}
        #: containers that looked managed but could not be adopted, and why (told to the manager on register)
        self.refused: list[RefusedAdoption] = []

    def managed(self) -> list[Managed]:
        """A snapshot of every container this runtime manages."""
        with self._lock:
            return list(self._table.values())

    def get(self, grant: str) -> Managed:
        """The container holding ``grant``; raises NotFound."""
        with self._lock:
            found = self._table.get(grant)
        if found is None:
            raise NotFound(f"no managed container holds grant {grant}")
        return found

    def holder_of(self, container_id: str) -> Managed | None:
        """The live entry for ``container_id``, if this runtime already holds a grant for it."""
        with self._lock:
            return next((m for m in self._table.values() if m.container_id == container_id
                         and m.state in (State.RUNNING, State.CREATING, REMOVING)), None)

    def note_usage(self, usage: dict[str, dict[str, int]]) -> None:
        """Keep each container's peak: the highest usage (summed over its GPUs) of any sample so far."""
        with self._lock:
            for grant, per_gpu in usage.items():
                managed = self._table.get(grant)
                if managed is not None:
                    managed.peak = max(managed.peak, sum(per_gpu.values()))

    def resize(self, grant: str, gpu_memory: int, gpu_memory_limit: int = 0) -> Managed:
        """Grant ``gpu_memory`` per GPU (up to ``gpu_memory_limit`` while the GPU has room) to the container holding
        ``grant`` from now on; raises NotFound."""
        managed = self.get(grant)
        with self._lock:
            managed.gpu_memory, managed.gpu_memory_limit = gpu_memory, gpu_memory_limit
        self._resized(managed)
        return managed

    def _resized(self, managed: Managed) -> None:
        """Keep a resize where a restarted agent finds it (the container's labels hold the first grant)."""

    def owner_of(self, pid: int, started: int | None = None) -> Managed | None:
        """The managed container host process ``pid`` runs in, if any.

        ``started`` (the process's start time, when the caller has just read it) lets a runtime reuse
        what it learned about the same process before; without it everything is read afresh.
        """
        raise NotImplementedError

    def create(self, spec: ContainerSpec) -> Managed:
        """Create and start a container for ``spec``; raise RuntimeFailure with the reason."""
        raise NotImplementedError

    def remove(self, grant: str, stop_grace: float = defaults.STOP_GRACE) -> None:
        """Stop and remove the container holding ``grant``; raises NotFound."""
        raise NotImplementedError

    def logs(self, grant: str, session: str = "", **cursor: Any) -> dict[str, Any]:
        """The next bounded piece of the output of the container holding ``grant``."""
        raise InvalidRequest(f"this node's {self.kind} runtime keeps no output to read; run the container on a "
                             "node with Docker")

    def signal(self, grant: str, signal: str) -> None:
        """Send ``signal`` (a name such as SIGINT, or a number) to the container holding ``grant``."""
        raise InvalidRequest(f"this node's {self.kind} runtime cannot pass signals on")

    def kill(self, grant: str, reason: str, detail: dict[str, Any] | None = None) -> None:
        """Kill the container holding ``grant`` at once and remember why."""
        raise NotImplementedError

    def stop(self, grant: str, reason: str, detail: dict[str, Any] | None = None,
             grace: float = defaults.STOP_GRACE) -> None:
        """SIGTERM the container holding ``grant``, SIGKILL it after ``grace``, without blocking the caller."""
        raise NotImplementedError

    def _removing(self, grant: str) -> Managed:
        """Flag ``grant`` as being removed on request, so its exit is not reported as an exit of its own."""
        managed = self.get(grant)
        with self._lock:
            if managed.state == State.RUNNING:
                managed.state = REMOVING
        return managed

    def _not_removing(self, managed: Managed) -> None:
        """A removal that failed: the container is running again as far as we know, and its end is reported."""
        with self._lock:
            if managed.state == REMOVING:
                managed.state = State.RUNNING

    def _mark(self, grant: str, reason: str, detail: dict[str, Any] | None) -> Managed:
        managed = self.get(grant)
        with self._lock:
            managed.reason = reason
            managed.detail = dict(detail or {})
        return managed

    def close(self) -> None:
        """Stop watching; managed containers keep running."""

    def _exited(self, managed: Managed, exit_code: int | None) -> None:
        with self._lock:
            if managed.state not in (State.RUNNING, State.CREATING):
                return
            managed.state = State.KILLED if managed.reason else State.EXITED
            managed.exit_code = exit_code
            managed.finished_at = time.time()
        self._on_change(managed)


def grant_labels(spec: ContainerSpec) -> dict[str, str]:
    """The labels that carry ``spec``'s grant on its container, where the container cannot change them."""
    return {
        Label.GRANT: spec.grant, Label.GPU: ",".join(spec.gpus), Label.MEMORY: str(spec.gpu_memory),
        Label.NAME: spec.name, Label.COMMAND: json.dumps(spec.command), Label.ON_OVERRUN: spec.on_overrun,
        Label.CREATED_AT: repr(spec.created_at or time.time()),
        Label.USER_LABELS: json.dumps(sorted(spec.labels)), Label.TENANT: spec.tenant,
        Label.PRIORITY: str(spec.priority), Label.PREEMPTIBLE: "1" if spec.preemptible else "0",
        Label.COMPUTE_SHARE: str(spec.compute_share),
        **({Label.MEMORY_LIMIT: str(spec.gpu_memory_limit)} if spec.gpu_memory_limit > spec.gpu_memory else {}),
    }


def managed_from_labels(container_id: str, labels: dict[str, str], image: str, state: str) -> Managed:
    """The managed container that ``labels`` (written by :func:`grant_labels`) describe."""
    user_keys = json.loads(labels.get(Label.USER_LABELS, "[]"))
    return Managed(
        grant=labels[Label.GRANT], container_id=container_id, name=labels.get(Label.NAME, ""),
        gpus=[g for g in labels.get(Label.GPU, "").split(",") if g],
        gpu_memory=int(labels.get(Label.MEMORY, "1")),
        image=image, command=json.loads(labels.get(Label.COMMAND, "[]")),
        labels={k: labels[k] for k in user_keys if k in labels}, on_overrun=labels.get(Label.ON_OVERRUN, "kill"),
        created_at=float(labels.get(Label.CREATED_AT, "0")), state=state, tenant=labels.get(Label.TENANT, ""),
        priority=_int(labels.get(Label.PRIORITY, "0")), preemptible=labels.get(Label.PREEMPTIBLE) == "1",
        compute_share=share_label(labels.get(Label.COMPUTE_SHARE, "0")),
        gpu_memory_limit=max(0, _int(labels.get(Label.MEMORY_LIMIT, "0"))),
    )


def share_label(text: str) -> int:
    """A compute share label as a share: out of range or unreadable reads as none (the manager's wire checks too)."""
    share = _int(text)
    return share if 0 <= share <= defaults.MAX_COMPUTE_SHARE else 0


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return 0
