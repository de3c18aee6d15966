"""The Docker runtime: containers pinned to their granted GPUs, the grant written into their labels."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import docker
import docker.errors
from docker.models import containers as sdk_containers
from docker.models.containers import Container
from docker.types import CancellableStream, DeviceRequest

from gpumgr.agent import procmap
from gpumgr.agent.guard.guard_client import ticket_labels
from gpumgr.agent.runtimes import mps
from gpumgr.agent.runtimes.docker_events import EngineEvents, caller_code, exit_code_of, finished_at
from gpumgr.agent.runtimes.docker_run import create_options, read_logs
from gpumgr.agent.runtimes.hook_limits import HookLimits
from gpumgr.agent.runtimes.image_record import requested, task_constraints
from gpumgr.agent.runtimes.logfollow import Followers
from gpumgr.agent.runtimes.resized_file import read_resized
from gpumgr.agent.runtimes.runtime import (
    ChangeCallback,
    Managed,
    grant_env,
    grant_labels,
    managed_from_labels,
)
from gpumgr.wire import defaults, security
from gpumgr.wire.errors import InvalidRequest, NotFound, RuntimeFailure
from gpumgr.wire.names import Env, Label, State, flag_set
from gpumgr.wire.policy import Policy
from gpumgr.wire.protocol import ContainerSpec, RefusedAdoption, Reserve
from gpumgr.wire.units import parse_bytes

log = logging.getLogger(__name__)

#: The Swarm task's identity, from the variables ``docker gpu`` templates into the task's environment.
TASK_LABELS = {Env.TASK: Label.TASK, Env.SERVICE: Label.SERVICE, Env.SLOT: Label.SLOT}
#: The agent's record of the grants it took through the runtime hook (in its state directory).
TASKS_FILE = "tasks.json"
#: Grants resized after their container was created: grant → bytes (a container's labels cannot change).
RESIZED_FILE = "resized.json"
#: A hook-granted container not running this long after its grant has failed to start.
START_CHECK = 10.0
#: Processes whose cgroup is remembered at most; the cache starts over when it is full.
CGROUP_CACHE_SIZE = 65536


class DockerRuntime(EngineEvents):
    """Containers in the local Docker engine, pinned by ``NVIDIA_VISIBLE_DEVICES`` and labelled with their grant."""

    kind = "docker"

    def __init__(self, on_change: ChangeCallback, *, node: str = "", network_mode: str | None = None,
                 device_requests: bool = False, client: docker.DockerClient | None = None, mps: bool = False,
                 state_dir: str | Path | None = None, guard_control: str | None = None,
                 hook_limits: HookLimits | None = None, policy: Policy | None = None,
                 mps_pipe_directory: str = mps.DEFAULT_PIPE_DIRECTORY) -> None:
        super().__init__(on_change, mps=mps, mps_pipe_directory=mps_pipe_directory)
        self.guard_control = guard_control  # issue 22
        self.hook_limits = hook_limits or HookLimits()  # issue 22
        #: the node's own ceiling on what any request may ask for (None: the manager's policy alone)
        self.policy = policy
        #: the grants this agent took for hook-created containers, kept where no container can change them
        self._ledger = Path(state_dir, TASKS_FILE) if state_dir is not None else None
        self._resized_file = Path(state_dir, RESIZED_FILE) if state_dir is not None else None
        self._resized_grants: dict[str, int] = {}
        self.node = node
        self.client = client or docker.from_env()
        self.network_mode = network_mode
        self.device_requests = device_requests
        self._by_id: dict[str, str] = {}
        self._engine_root: str | None = None
        #: host pid → (start time, container ids from its cgroup); only the enforcer's thread uses it
        self._cgroups: dict[int, tuple[int, list[str]]] = {}
        self._stop = threading.Event()
        self._followers = Followers()
        self._events: CancellableStream[dict[str, Any]] | None = None
        self._adopt()
        self._watcher = threading.Thread(target=self._watch, name="docker-events", daemon=True)
        self._watcher.start()

    def create(self, spec: ContainerSpec) -> Managed:
        """Create, label and start the container; on any failure nothing is left behind.

        Two engine calls, as ``docker run -d`` makes: create and start (no inspect after either: the event
        stream watches it from before its start). A create for a grant a container already holds (the
        manager sent it again to this agent's new process) answers with that container, started: once.
        """
        if (held := self._created_before(spec.grant)) is not None:
            return held
        if not spec.image:
            raise RuntimeFailure("an image is required on a node that runs Docker", code="invalid_request")
        labels = {**spec.labels, **grant_labels(spec), Label.NODE: self.node}
        labels.update(ticket_labels(self.guard_control))  # issue 22: the guard lets this one create through
        requests = [DeviceRequest(driver="nvidia", device_ids=spec.gpus, capabilities=[["gpu"]])] \
            if self.device_requests else None
        options = create_options(spec, self.network_mode, self.policy)  # PolicyDenied before anything exists
        environment = grant_env(spec, self.mps)
        if self.mps:  # the node's own additions, after the tenant's asks were checked (see runtimes/mps.py)
            options = mps.docker_options(options, self.mps_pipe_directory)
            environment.update(mps.pipe_env(self.mps_pipe_directory))
        api = self.client.api
        try:
            # the SDK's own split of create()'s arguments into the engine's, without its inspect afterwards
            created = api.create_container(**sdk_containers._create_container_args({  # type: ignore[attr-defined]
                "image": spec.image, "command": spec.command or None, "name": spec.name,
                "environment": environment, "labels": labels, "detach": True,
                "device_requests": requests, "version": api.api_version, **options}))
        except docker.errors.ImageNotFound as exc:
            raise RuntimeFailure(f"image {spec.image!r} is not on this node: {exc.explanation}",
                                 code="image_not_found") from exc
        except docker.errors.APIError as exc:
            raise RuntimeFailure(f"docker could not create the container: {exc.explanation}",
                                 code=caller_code(exc)) from exc
        container_id = str(created["Id"])
        managed = managed_from_labels(container_id, labels, spec.image, State.RUNNING)
        self._track(managed)
        try:
            api.start(container_id)
        except docker.errors.APIError as exc:
            self._untrack(spec.grant)
            self._force_remove(container_id)
            raise RuntimeFailure(f"docker could not start the container: {exc.explanation}",
                                 code=caller_code(exc, starting=True)) from exc
        return managed

    def _force_remove(self, container_id: str) -> None:
        try:
            self.client.api.remove_container(container_id, force=True)
        except docker.errors.APIError as exc:
            log.warning("could not clean up failed container %s: %s", container_id[:12], exc)

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
            self._removal_failed(managed)
            raise RuntimeFailure(f"docker could not remove the container: {exc.explanation}") from exc
        except Exception as exc:  # the engine went away mid-removal: the container's fate is read when it is back
            self._removal_failed(managed)
            raise RuntimeFailure(f"docker could not remove the container: {exc}") from exc
        self._untrack(grant)

    def kill(self, grant: str, reason: str, detail: dict[str, Any] | None = None) -> None:
        """SIGKILL the container; its exit is then reported as ``killed`` with ``reason``.

        Raises RuntimeFailure if the engine refused (the enforcer retries); a container already gone
        counts as killed.
        """
        managed = self._mark(grant, reason, detail)
        try:
            self.client.api.kill(managed.container_id)
        except docker.errors.NotFound:
            self._exited(managed, None)
        except docker.errors.APIError as exc:
            if "is not running" in str(exc):
                return  # it is dying already: its exit is on its way
            raise RuntimeFailure(f"docker could not kill {managed.container_id[:12]}: {exc}") from exc

    def stop(self, grant: str, reason: str, detail: dict[str, Any] | None = None,
             grace: float = defaults.STOP_GRACE) -> None:
        """Docker's stop (SIGTERM, SIGKILL after ``grace``) on a background thread."""
        managed = self._mark(grant, reason, detail)

        def stop() -> None:
            try:
                self.client.api.stop(managed.container_id, timeout=int(grace))
            except docker.errors.APIError as exc:
                log.warning("could not stop %s: %s", managed.container_id[:12], exc)

        threading.Thread(target=stop, name=f"stop-{grant}", daemon=True).start()

    def logs(self, grant: str, session: str = "", **cursor: Any) -> dict[str, Any]:
        """The next bounded piece of the output of the container holding ``grant``; a ``session`` follows it."""
        container_id = self.get(grant).container_id
        if session:
            return self._followers.read(session, self.client, container_id, **cursor)
        return read_logs(self.client, container_id, **cursor)

    def signal(self, grant: str, signal: str) -> None:
        """Send ``signal`` to the container holding ``grant``, as ``docker kill --signal`` does."""
        managed = self.get(grant)
        try:
            self.client.api.kill(managed.container_id, signal=signal)
        except docker.errors.NotFound:
            raise NotFound(f"container {managed.container_id[:12]} is gone from this node") from None
        except docker.errors.APIError as exc:
            raise RuntimeFailure(f"docker could not signal the container: {exc.explanation}",
                                 code="conflict" if "is not running" in str(exc) else None) from exc

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
        self._followers.close()
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
        if managed is not None and managed.hook:
            self._write_ledger()
        return managed

    def engine_request(self, request: Reserve) -> Reserve:
        """``request`` as this node's engine records its container; what the request itself claims counts for nothing.

        The runtime hook's socket is root-only, but the grant must still come from what the container
        was created with (its configuration in the engine, which its own processes cannot change), and
        only for a container that exists here and is not running yet. The engine holds the container's
        lock while the hook runs, so an inspect would wait for the hook that waits for us: the list
        (the engine's lock-free view) proves the container, and the configuration the engine wrote at
        ``docker create`` (``config.v2.json`` under its root directory) gives the request.
        """
        listed = self.client.api.containers(all=True, filters={"id": request.container_id})
        summary = next((c for c in listed if c.get("Id") == request.container_id), None)
        if summary is None:
            raise NotFound(f"no container {request.container_id[:12]} is being created in this node's engine")
        if summary.get("State") == "running":
            raise InvalidRequest(f"container {request.container_id[:12]} is already running")
        attrs = self._engine_record(request.container_id)
        env, engine_labels = requested(attrs, str(self._engine_root))  # issue 32: what the image brought is ignored
        try:
            memory, gpus = parse_bytes(env[Env.REQUEST_MEMORY]), int(env.get(Env.REQUEST_GPUS, "1"))
            labels = {label: env[var] for var, label in TASK_LABELS.items() if env.get(var)}
            limit = parse_bytes(env[Env.REQUEST_MEMORY_LIMIT]) if env.get(Env.REQUEST_MEMORY_LIMIT) else 0
            reserve = Reserve(container_id=summary["Id"], gpu_memory=memory, gpus=gpus, labels=labels,
                              gpu_memory_limit=limit,
                              name=env.get(Env.TASK_NAME) or str(attrs.get("Name", "")).lstrip("/"),
                              image=str(attrs["Config"].get("Image", "")),
                              on_overrun=env.get(Env.REQUEST_ON_OVERRUN) or None,
                              priority=int(env.get(Env.REQUEST_PRIORITY) or 0),
                              preemptible=flag_set(env.get(Env.REQUEST_PREEMPTIBLE)),
                              compute_share=int(env.get(Env.REQUEST_COMPUTE_SHARE) or 0),
                              queue=flag_set(env.get(Env.REQUEST_QUEUE)),
                              constraints=task_constraints(env.get(Env.REQUEST_CONSTRAINTS)))
        except (KeyError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
            raise InvalidRequest(f"container {request.container_id[:12]} asks for no valid GPU memory: {exc}") from None
        return self.hook_limits.apply(reserve, engine_labels)  # issue 22: a plain run is no operator

    def _engine_record(self, container_id: str) -> dict[str, Any]:
        """What the engine wrote for ``container_id`` when it was created; InvalidRequest if it cannot be read."""
        if self._engine_root is None:
            self._engine_root = str(self.client.info().get("DockerRootDir") or "/var/lib/docker")
        path = Path(self._engine_root, "containers", container_id, "config.v2.json")
        try:
            record: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise InvalidRequest(f"cannot read the engine's record of container {container_id[:12]} ({exc}); "
                                 "an agent in a container needs the engine's containers folder mounted") from None
        return record

    def track_task(self, container_id: str, grant: dict[str, Any], request: Reserve) -> Managed:
        """Manage a container that the runtime hook is creating for a Swarm task, under ``grant``.

        It is ``creating`` until Docker reports it started. A repeated create of the same container
        (``docker start`` of a stopped task) keeps the entry it has.
        """
        with self._lock:
            existing = self._table.get(grant["grant"])
            if existing is not None:
                return existing
            # the same container started again under a new grant: its ended entries are over
            stale = [m.grant for m in self._table.values() if m.container_id == container_id]
        for old in stale:
            self._untrack(old)
        managed = Managed(grant=grant["grant"], container_id=container_id, name=request.name,
                          gpus=list(grant["gpus"]), gpu_memory=int(grant["gpu_memory"]), image=request.image,
                          labels=dict(request.labels),
                          on_overrun=str(grant.get("on_overrun") or "kill"), created_at=time.time(),
                          state=State.CREATING, hook=True, tenant=str(grant.get("tenant") or ""),
                          priority=int(grant.get("priority") or 0), preemptible=bool(grant.get("preemptible")),
                          compute_share=int(grant.get("compute_share") or 0),
                          gpu_memory_limit=int(grant.get("gpu_memory_limit") or 0))
        self._track(managed)
        self._write_ledger()
        return managed

    def expire_creating(self, older_than: float) -> None:
        """Settle hook grants whose container never started, from the engine's truth; their grants go back.

        A container still not running ``START_CHECK`` seconds after its grant failed to start (a bad
        command fails runc's create after the hook ran) or was removed; ``older_than`` is the backstop.
        """
        now = time.time()
        for managed in self.managed():
            if managed.state != State.CREATING or now - managed.created_at < START_CHECK:
                continue
            state = self._engine_state(managed.container_id)
            if state == "running":
                continue  # its start event was missed; the next event or resync reports it
            error = self._start_error(managed.container_id) if state == "created" else None
            if state != "created" or error or now - managed.created_at > older_than:
                managed.reason = "never_started" if state is not None else "removed_before_start"
                if error:
                    managed.detail = {"error": error[:1024]}
                self._exited(managed, None)
                self._untrack(managed.grant)

    def _removal_failed(self, managed: Managed) -> None:
        """Back to running, unless the engine says it stopped (its die event was dropped while removing)."""
        self._not_removing(managed)
        try:
            state = self._engine_state(managed.container_id)
        except Exception:  # the engine is away: the re-list after its event stream returns settles it
            return
        if state != "running":
            self._exited(managed, None)

    def _start_error(self, container_id: str) -> str | None:
        """Why the engine could not start ``container_id`` (a created container whose start failed), if it says."""
        try:
            state = self._engine_record(container_id).get("State") or {}
        except InvalidRequest:
            return None
        return str(state.get("Error") or "") or (f"exit code {state['ExitCode']}" if state.get("ExitCode") else None)

    def _engine_state(self, container_id: str) -> str | None:
        """The container's state in the engine's lock-free list (``running``, ``created``, ...); None if gone."""
        listed = self.client.api.containers(all=True, filters={"id": container_id})
        return next((str(c.get("State")) for c in listed if c.get("Id") == container_id), None)

    def _adopt(self) -> None:
        """Re-adopt this node's containers: REST-created ones from their labels, hook-created ones from the ledger.

        The grant never comes from a container's environment or /proc: a container that looks managed
        but has no trustworthy record of its grant is refused, and the manager is told why.
        """
        self._adopt_tasks()
        resized, limits = read_resized(self._resized_file)
        mine: dict[str, str | list[str] | bool] = {"label": [Label.GRANT, f"{Label.NODE}={self.node}"]}
        for container in self.client.containers.list(all=True, filters=mine):
            problem = _label_problem(container.labels)
            if problem is not None:
                self._refuse(container, problem)
                continue
            state = container.attrs["State"]
            # never started ("created": its create was cut off, its start may still land): creating, not an exit
            running, fresh = bool(state.get("Running")), state.get("Status") == "created"
            managed = managed_from_labels(_id(container), container.labels, container.attrs["Config"].get("Image", ""),
                                          State.RUNNING if running else State.CREATING if fresh else State.EXITED)
            managed.exit_code = None if running or fresh else state.get("ExitCode")
            managed.finished_at = None if running or fresh else finished_at(state)
            managed.pid = state.get("Pid") or None
            if managed.grant in resized:
                managed.gpu_memory = self._resized_grants[managed.grant] = resized[managed.grant]
                managed.gpu_memory_limit = limits.get(managed.grant, managed.gpu_memory_limit)
            self._track(managed)
            log.info("re-adopted %s container %s (grant %s)", managed.state, container.short_id, managed.grant)

    def _adopt_tasks(self) -> None:
        """Re-adopt hook-granted containers that the ledger holds and the engine still has."""
        for entry in self._read_ledger():
            listed = self.client.api.containers(all=True, filters={"id": entry["container_id"]})
            summary = next((c for c in listed if c.get("Id") == entry["container_id"]), None)
            if summary is None:
                continue  # gone while we were away: the manager's sweep settles its grant
            state = {"running": State.RUNNING, "created": State.CREATING}.get(str(summary.get("State")), State.EXITED)
            try:
                managed = Managed(**{**entry, "state": state, "hook": True})
            except TypeError as exc:
                log.warning("ignoring a malformed task ledger entry: %s", exc)
                continue
            if state == State.EXITED:
                managed.exit_code, managed.finished_at = exit_code_of(summary), time.time()
            self._track(managed)
            log.info("re-adopted %s task container %s (grant %s)", state, entry["container_id"][:12], managed.grant)
        self._write_ledger()

    def _refuse(self, container: Container, reason: str) -> None:
        log.warning("not adopting container %s: %s", container.short_id, reason)
        self.refused.append(RefusedAdoption(container_id=_id(container), name=container.name or "", reason=reason))

    def _read_ledger(self) -> list[dict[str, Any]]:
        if self._ledger is None or not self._ledger.exists():
            return []
        try:
            return list(security.read_private(self._ledger).get("tasks", []))
        except ValueError as exc:
            log.warning("ignoring the task ledger: %s", exc)
            return []

    def _resized(self, managed: Managed) -> None:
        if managed.hook:
            self._write_ledger()
        else:
            self._write_resized(managed)

    def _write_resized(self, managed: Managed) -> None:
        if self._resized_file is None:
            return
        tracked = {m.grant: m for m in self.managed()}
        with self._lock:
            self._resized_grants = {g: tracked[g].gpu_memory for g in self._resized_grants if g in tracked}
            self._resized_grants.update((m.grant, m.gpu_memory) for m in [managed] if not m.hook)
            grants = dict(self._resized_grants)
            limits = {g: (managed if g == managed.grant else tracked[g]).gpu_memory_limit for g in grants}
        security.write_private(self._resized_file, {"grants": grants, "limits": limits})

    def _write_ledger(self) -> None:
        if self._ledger is None:
            return
        tasks = [{"grant": m.grant, "container_id": m.container_id, "name": m.name, "gpus": m.gpus,
                  "gpu_memory": m.gpu_memory, "image": m.image, "labels": m.labels, "on_overrun": m.on_overrun,
                  "created_at": m.created_at, "tenant": m.tenant, "priority": m.priority,
                  "preemptible": m.preemptible, "compute_share": m.compute_share,
                  "gpu_memory_limit": m.gpu_memory_limit}
                 for m in self.managed() if m.hook]
        security.write_private(self._ledger, {"tasks": tasks})


def _label_problem(labels: dict[str, str]) -> str | None:
    """Why ``labels`` hold no trustworthy grant, or None if they do."""
    memory = labels.get(Label.MEMORY, "")
    if not (memory.isascii() and memory.isdigit() and int(memory) > 0):
        return f"its {Label.MEMORY} label is missing or not a byte count, so its grant is unknown"
    if not labels.get(Label.GPU):
        return f"its {Label.GPU} label is missing, so its GPUs are unknown"
    return None


def _id(container: Container) -> str:
    """The container's id: always there on one the engine returned (the stubs allow None for any model)."""
    assert container.id is not None
    return container.id


def docker_installed() -> bool:
    """Whether this host has a Docker engine to talk to: ``DOCKER_HOST`` or the default socket exists."""
    host = os.environ.get("DOCKER_HOST", "")
    if host:
        return not host.startswith("unix://") or Path(host.removeprefix("unix://")).exists()
    return Path("/var/run/docker.sock").exists()


def docker_answers() -> bool:
    """Whether a Docker engine answers on the default socket (``DOCKER_HOST`` respected)."""
    try:
        client = docker.from_env(timeout=3)
        client.ping()
        client.close()
        return True
    except Exception:  # any failure means no usable engine
        return False

