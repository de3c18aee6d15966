"""Where containers run: the Docker engine, or plain host process groups on hosts without Docker.

Both runtimes keep an in-memory table of the managed containers they know, so the heartbeat never
asks Docker anything; Docker is only called to create, stop, remove, and (once, at start) to re-adopt
the containers that outlived a previous agent. Exits (and Swarm task starts) are reported through
``on_change`` as they happen.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import docker
import docker.errors
from docker.types import DeviceRequest

from gpumgr.agent import procmap
from gpumgr.wire import defaults
from gpumgr.wire.errors import NotFound, RuntimeFailure
from gpumgr.wire.protocol import ContainerReport, ContainerSpec, Reserve

log = logging.getLogger(__name__)

LABEL_PREFIX = "gpumgr."
LABEL_GRANT = "gpumgr.grant"
LABEL_NODE = "gpumgr.node"
LABEL_TASK = "gpumgr.task"
LABEL_SERVICE = "gpumgr.service"
#: What the runtime hook writes into a task container's environment: the grant travels with it.
ENV_GRANT = "GPUMGR_GRANT"
ENV_MEMORY = "GPUMGR_GPU_MEMORY"
ENV_NODE = "GPUMGR_NODE"
ENV_ON_OVERRUN = "GPUMGR_ON_OVERRUN"
EVENT_RETRY = 1.0
#: Processes whose cgroup is remembered at most; the cache starts over when it is full.
CGROUP_CACHE_SIZE = 65536


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
    state: str = "running"
    exit_code: int | None = None
    reason: str | None = None
    pid: int | None = None
    detail: dict = field(default_factory=dict)

    def report(self, usage: dict[str, int] | None = None) -> ContainerReport:
        """This container as the wire protocol carries it."""
        return ContainerReport(
            grant=self.grant, container_id=self.container_id, name=self.name, image=self.image,
            command=self.command, gpus=self.gpus, gpu_memory=self.gpu_memory, state=self.state,
            exit_code=self.exit_code, reason=self.reason, usage=usage or {}, labels=self.labels,
            on_overrun=self.on_overrun, created_at=self.created_at,
        )


ChangeCallback = Callable[[Managed], None]


def grant_env(spec: ContainerSpec, mps: bool = False) -> dict[str, str]:
    """The variables that pin a container to its GPUs and tell it its grant.

    With ``mps`` (the host runs the MPS control daemon) the CUDA driver itself also caps each
    visible device at the grant, through ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``; the enforcer's kill
    stays the backstop.
    """
    env = {**spec.env, "NVIDIA_VISIBLE_DEVICES": ",".join(spec.gpus), "GPUMGR_GPU_MEMORY": str(spec.gpu_memory),
           "GPUMGR_GRANT": spec.grant}
    if mps:
        mib = max(1, spec.gpu_memory // (1 << 20))
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(f"{i}={mib}M" for i in range(len(spec.gpus)))
    return env


def task_env(managed: Managed, node: str, mps: bool = False) -> dict[str, str]:
    """What the runtime hook writes into a task container's environment: its pinning and its grant."""
    spec = ContainerSpec(grant=managed.grant, name=managed.name, gpus=managed.gpus, gpu_memory=managed.gpu_memory)
    return {**grant_env(spec, mps), ENV_NODE: node, ENV_ON_OVERRUN: managed.on_overrun}


class Runtime:
    """Common table keeping for both runtimes; subclasses do the creating and stopping."""

    kind = "none"

    def __init__(self, on_change: ChangeCallback, *, mps: bool = False) -> None:
        self._on_change = on_change
        self.mps = mps
        self._lock = threading.Lock()
        self._table: dict[str, Managed] = {}

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

    def kill(self, grant: str, reason: str, detail: dict | None = None) -> None:
        """Kill the container holding ``grant`` at once and remember why."""
        raise NotImplementedError

    def stop(self, grant: str, reason: str, detail: dict | None = None, grace: float = defaults.STOP_GRACE) -> None:
        """SIGTERM the container holding ``grant``, SIGKILL it after ``grace``, without blocking the caller."""
        raise NotImplementedError

    def _removing(self, grant: str) -> Managed:
        """Flag ``grant`` as being removed on request, so its exit is not reported as an exit of its own."""
        managed = self.get(grant)
        with self._lock:
            if managed.state == "running":
                managed.state = "removing"
        return managed

    def _mark(self, grant: str, reason: str, detail: dict | None) -> Managed:
        managed = self.get(grant)
        with self._lock:
            managed.reason = reason
            managed.detail = dict(detail or {})
        return managed

    def close(self) -> None:
        """Stop watching; managed containers keep running."""

    def _exited(self, managed: Managed, exit_code: int | None) -> None:
        with self._lock:
            if managed.state not in ("running", "creating"):
                return
            managed.state = "killed" if managed.reason else "exited"
            managed.exit_code = exit_code
        self._on_change(managed)


class DockerRuntime(Runtime):
    """Containers in the local Docker engine, pinned by ``NVIDIA_VISIBLE_DEVICES`` and labelled with their grant."""

    kind = "docker"

    def __init__(self, on_change: ChangeCallback, *, node: str = "", network_mode: str | None = None,
                 device_requests: bool = False, client: docker.DockerClient | None = None, mps: bool = False) -> None:
        super().__init__(on_change, mps=mps)
        self.node = node
        self.client = client or docker.from_env()
        self.network_mode = network_mode
        self.device_requests = device_requests
        self._by_id: dict[str, str] = {}
        #: host pid → (start time, container ids from its cgroup); only the enforcer's thread uses it
        self._cgroups: dict[int, tuple[int, list[str]]] = {}
        self._stop = threading.Event()
        self._events = None
        self._adopt()
        self._watcher = threading.Thread(target=self._watch, name="docker-events", daemon=True)
        self._watcher.start()

    def create(self, spec: ContainerSpec) -> Managed:
        """Create, label and start the container; on any failure nothing is left behind."""
        if not spec.image:
            raise RuntimeFailure("an image is required on a node that runs Docker", code="invalid_request")
        labels = {**spec.labels, **_grant_labels(spec), LABEL_NODE: self.node}
        requests = [DeviceRequest(driver="nvidia", device_ids=spec.gpus, capabilities=[["gpu"]])] \
            if self.device_requests else None
        try:
            container = self.client.containers.create(
                spec.image, spec.command or None, name=spec.name, environment=grant_env(spec, self.mps), labels=labels,
                detach=True, network_mode=self.network_mode, device_requests=requests,
            )
        except docker.errors.ImageNotFound as exc:
            raise RuntimeFailure(f"image {spec.image!r} is not on this node: {exc.explanation}") from exc
        except docker.errors.APIError as exc:
            raise RuntimeFailure(f"docker could not create the container: {exc.explanation}") from exc
        managed = _managed_from_labels(container.id, labels, spec.image, "running")
        self._track(managed)
        try:
            container.start()
            container.reload()
        except docker.errors.APIError as exc:
            self._untrack(spec.grant)
            _force_remove(container)
            raise RuntimeFailure(f"docker could not start the container: {exc.explanation}") from exc
        managed.pid = container.attrs["State"].get("Pid") or None
        if not container.attrs["State"].get("Running"):
            self._exited(managed, container.attrs["State"].get("ExitCode"))
        return managed

    def remove(self, grant: str, stop_grace: float = defaults.STOP_GRACE) -> None:
        """Stop (SIGTERM, then SIGKILL after ``stop_grace``) and remove the container."""
        managed = self._removing(grant)
        try:
            container = self.client.containers.get(managed.container_id)
            container.stop(timeout=int(stop_grace))
            container.remove(force=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            raise RuntimeFailure(f"docker could not remove the container: {exc.explanation}") from exc
        self._untrack(grant)

    def kill(self, grant: str, reason: str, detail: dict | None = None) -> None:
        """SIGKILL the container; its exit is then reported as ``killed`` with ``reason``."""
        managed = self._mark(grant, reason, detail)
        try:
            self.client.api.kill(managed.container_id)
        except docker.errors.APIError as exc:
            log.warning("could not kill %s: %s", managed.container_id[:12], exc)

    def stop(self, grant: str, reason: str, detail: dict | None = None, grace: float = defaults.STOP_GRACE) -> None:
        """Docker's stop (SIGTERM, SIGKILL after ``grace``) on a background thread."""
        managed = self._mark(grant, reason, detail)

        def stop() -> None:
            try:
                self.client.api.stop(managed.container_id, timeout=int(grace))
            except docker.errors.APIError as exc:
                log.warning("could not stop %s: %s", managed.container_id[:12], exc)

        threading.Thread(target=stop, name=f"stop-{grant}", daemon=True).start()

    def owner_of(self, pid: int, started: int | None = None) -> Managed | None:
        """Map a host pid to its managed container through ``/proc/<pid>/cgroup``.

        A process stays in its container's cgroup for life, so with ``started`` the container ids are
        read once per process (pid + start time) rather than once per sample. The ids, not the
        answer, are cached: a container the runtime starts tracking later is still found.
        """
        ids: list[str] | None = None
        if started is not None:
            cached = self._cgroups.get(pid)
            if cached is not None and cached[0] == started:
                ids = cached[1]
        if ids is None:
            ids = procmap.container_ids_of(pid)
            if started is not None:
                if len(self._cgroups) >= CGROUP_CACHE_SIZE:
                    self._cgroups.clear()
                self._cgroups[pid] = (started, ids)
        with self._lock:
            for cid in reversed(ids):
                grant = self._by_id.get(cid)
                if grant is not None:
                    return self._table.get(grant)
        return None

    def close(self) -> None:
        """Stop the Docker events watcher."""
        self._stop.set()
        if self._events is not None:
            self._events.close()

    # --- internals ---------------------------------------------------------------------------
    def _track(self, managed: Managed) -> None:
        with self._lock:
            self._table[managed.grant] = managed
            self._by_id[managed.container_id] = managed.grant

    def _untrack(self, grant: str) -> Managed | None:
        with self._lock:
            managed = self._table.pop(grant, None)
            if managed is not None:
                self._by_id.pop(managed.container_id, None)
            return managed

    def track_task(self, container_id: str, grant: dict, request: Reserve) -> Managed:
        """Manage a container that the runtime hook is creating for a Swarm task, under ``grant``.

        It is ``creating`` until Docker reports it started. A repeated create of the same container
        (``docker start`` of a stopped task) keeps the entry it has.
        """
        with self._lock:
            existing = self._table.get(grant["grant"])
            if existing is not None:
                return existing
        managed = Managed(grant=grant["grant"], container_id=container_id, name=request.name,
                          gpus=list(grant["gpus"]), gpu_memory=int(grant["gpu_memory"]), image=request.image,
                          labels=dict(request.labels),
                          on_overrun=str(grant.get("on_overrun") or "kill"), created_at=time.time(), state="creating")
        self._track(managed)
        return managed

    def expire_creating(self, older_than: float) -> None:
        """Give up on task containers that never started: their grants go back to the manager."""
        cutoff = time.time() - older_than
        for managed in self.managed():
            if managed.state == "creating" and managed.created_at < cutoff:
                managed.reason = "never_started"
                self._exited(managed, None)
                self._untrack(managed.grant)

    def _adopt(self) -> None:
        for container in self.client.containers.list(filters={"label": LABEL_TASK}):
            self._adopt_task(container)
        mine = {"label": [LABEL_GRANT, f"{LABEL_NODE}={self.node}"]}
        for container in self.client.containers.list(all=True, filters=mine):
            state = container.attrs["State"]
            running = bool(state.get("Running"))
            managed = _managed_from_labels(container.id, container.labels, container.attrs["Config"].get("Image", ""),
                                           "running" if running else "exited")
            managed.exit_code = None if running else state.get("ExitCode")
            managed.pid = state.get("Pid") or None
            self._track(managed)
            log.info("re-adopted %s container %s (grant %s)", managed.state, container.id[:12], managed.grant)

    def _adopt_task(self, container: docker.models.containers.Container) -> None:
        """Re-adopt a running task container: its grant lives in its main process's environment."""
        pid = container.attrs["State"].get("Pid") or 0
        env = _environ(pid)
        if env.get(ENV_NODE) != self.node or ENV_GRANT not in env:
            return
        labels = {k: container.labels.get(k, "") for k in (LABEL_TASK, LABEL_SERVICE)}
        managed = Managed(grant=env[ENV_GRANT], container_id=container.id, name=container.name,
                          gpus=env.get("NVIDIA_VISIBLE_DEVICES", "").split(","),
                          gpu_memory=int(env.get(ENV_MEMORY, "1")),
                          image=container.attrs["Config"].get("Image", ""), labels=labels, pid=pid,
                          on_overrun=env.get(ENV_ON_OVERRUN, "kill"), created_at=time.time())
        self._track(managed)
        log.info("re-adopted task container %s (grant %s)", container.id[:12], managed.grant)

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                self._events = self.client.events(
                    decode=True, since=int(time.time()) - 1,
                    filters={"type": "container", "event": ["start", "die", "destroy"]},
                )
                for event in self._events:
                    self._on_event(event)
            except Exception as exc:  # the engine restarted or the stream broke: reconnect
                if not self._stop.is_set():
                    log.warning("docker events stream broke (%s); reconnecting", exc)
            self._stop.wait(EVENT_RETRY)

    def _on_event(self, event: dict) -> None:
        cid = event.get("id") or event.get("Actor", {}).get("ID", "")
        with self._lock:
            grant = self._by_id.get(cid)
            managed = self._table.get(grant) if grant else None
        if managed is None:
            return
        action = event.get("Action")
        if action == "start":
            with self._lock:
                started = managed.state == "creating"
                if started:
                    managed.state = "running"
            if started:
                self._on_change(managed)  # a Swarm task's grant is running now, not at the next heartbeat
        elif action == "die":
            code = event.get("Actor", {}).get("Attributes", {}).get("exitCode")
            self._exited(managed, int(code) if code is not None and str(code).isdigit() else None)
        elif action == "destroy":
            if managed.state == "creating":
                managed.reason = "removed_before_start"
                self._exited(managed, None)
            self._untrack(managed.grant)


class ProcessRuntime(Runtime):
    """Host process groups for hosts without Docker; the ``container_id`` is the group leader's pid.

    Process groups do not outlive the agent's knowledge of them: after an agent restart they are
    no longer managed (documented in the README).
    """

    kind = "process"

    def __init__(self, on_change: ChangeCallback, *, log_dir: str = "/tmp/gpumgr/logs", mps: bool = False) -> None:
        super().__init__(on_change, mps=mps)
        self.log_dir = Path(log_dir)
        self._procs: dict[str, subprocess.Popen] = {}

    def create(self, spec: ContainerSpec) -> Managed:
        """Start the command in a new session (its own process group) with the grant's environment."""
        if not spec.command:
            raise RuntimeFailure("a command is required to run a host process", code="invalid_request")
        env = {**os.environ, **grant_env(spec, self.mps), "CUDA_VISIBLE_DEVICES": ",".join(spec.gpus)}
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            with open(self.log_dir / f"{spec.grant}.log", "ab") as out:
                proc = subprocess.Popen(spec.command, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            raise RuntimeFailure(f"cannot start {spec.command[0]!r}: {exc.strerror or exc}") from exc
        managed = _managed_from_labels(str(proc.pid), {**spec.labels, **_grant_labels(spec)}, spec.image or "",
                                       "running")
        managed.pid = proc.pid
        with self._lock:
            self._table[spec.grant] = managed
            self._procs[spec.grant] = proc
        threading.Thread(target=self._wait, args=(managed, proc), name=f"wait-{proc.pid}", daemon=True).start()
        return managed

    def remove(self, grant: str, stop_grace: float = defaults.STOP_GRACE) -> None:
        """SIGTERM the group, SIGKILL it after ``stop_grace``, and forget it."""
        managed = self._removing(grant)
        proc = self._procs.get(grant)
        _signal_group(managed.pid, signal.SIGTERM)
        if proc is not None:
            try:
                proc.wait(stop_grace)
            except subprocess.TimeoutExpired:
                _signal_group(managed.pid, signal.SIGKILL)
                proc.wait(stop_grace)
        with self._lock:
            self._table.pop(grant, None)
            self._procs.pop(grant, None)

    def kill(self, grant: str, reason: str, detail: dict | None = None) -> None:
        """SIGKILL the whole process group; its exit is reported as ``killed`` with ``reason``."""
        managed = self._mark(grant, reason, detail)
        _signal_group(managed.pid, signal.SIGKILL)

    def stop(self, grant: str, reason: str, detail: dict | None = None, grace: float = defaults.STOP_GRACE) -> None:
        """SIGTERM the group now and SIGKILL it after ``grace`` if it is still there."""
        managed = self._mark(grant, reason, detail)
        _signal_group(managed.pid, signal.SIGTERM)
        timer = threading.Timer(grace, lambda: managed.state == "running"
                                and _signal_group(managed.pid, signal.SIGKILL))
        timer.daemon = True
        timer.start()

    def owner_of(self, pid: int, started: int | None = None) -> Managed | None:
        """Map a host pid to its process group's managed entry (``getpgid``: nothing worth caching)."""
        group = procmap.process_group_of(pid)
        if group is None:
            return None
        with self._lock:
            for managed in self._table.values():
                if managed.pid == group and managed.state == "running":
                    return managed
        return None

    def _wait(self, managed: Managed, proc: subprocess.Popen) -> None:
        code = proc.wait()
        self._exited(managed, 128 - code if code < 0 else code)


def _grant_labels(spec: ContainerSpec) -> dict[str, str]:
    return {
        LABEL_GRANT: spec.grant, "gpumgr.gpu": ",".join(spec.gpus), "gpumgr.memory": str(spec.gpu_memory),
        "gpumgr.name": spec.name, "gpumgr.command": json.dumps(spec.command), "gpumgr.on_overrun": spec.on_overrun,
        "gpumgr.created_at": repr(spec.created_at or time.time()),
        "gpumgr.user_labels": json.dumps(sorted(spec.labels)),
    }


def _managed_from_labels(container_id: str, labels: dict[str, str], image: str, state: str) -> Managed:
    user_keys = json.loads(labels.get("gpumgr.user_labels", "[]"))
    return Managed(
        grant=labels[LABEL_GRANT], container_id=container_id, name=labels.get("gpumgr.name", ""),
        gpus=[g for g in labels.get("gpumgr.gpu", "").split(",") if g],
        gpu_memory=int(labels.get("gpumgr.memory", "1")),
        image=image, command=json.loads(labels.get("gpumgr.command", "[]")),
        labels={k: labels[k] for k in user_keys if k in labels}, on_overrun=labels.get("gpumgr.on_overrun", "kill"),
        created_at=float(labels.get("gpumgr.created_at", "0")), state=state,
    )


def _force_remove(container: docker.models.containers.Container) -> None:
    try:
        container.remove(force=True)
    except docker.errors.APIError as exc:
        log.warning("could not clean up failed container %s: %s", container.id[:12], exc)


def _signal_group(pgid: int | None, sig: signal.Signals) -> None:
    if pgid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(procmap.root(), str(pid), "environ").read_bytes() if pid else b""
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def docker_answers() -> bool:
    """Whether a Docker engine answers on the default socket (``DOCKER_HOST`` respected)."""
    try:
        client = docker.from_env(timeout=3)
        client.ping()
        client.close()
        return True
    except Exception:  # any failure means no usable engine
        return False
