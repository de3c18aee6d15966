"""The host-process runtime: process groups for hosts without Docker."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from gpumgr.agent import procmap
from gpumgr.agent.runtimes import mps as mps_caps
from gpumgr.agent.runtimes.runtime import (
    ChangeCallback,
    Managed,
    Runtime,
    grant_env,
    grant_labels,
    managed_from_labels,
)
from gpumgr.wire import defaults
from gpumgr.wire.errors import RuntimeFailure
from gpumgr.wire.names import REMOVING, Env, State
from gpumgr.wire.protocol import ContainerSpec

#: How often a group's members are looked for once its leader has exited (or while it is being stopped).
GROUP_POLL = 0.2


class ProcessRuntime(Runtime):
    """Host process groups for hosts without Docker; the ``container_id`` is the group leader's pid.

    A "container" is its whole process group: it runs (and is charged for the GPU memory of every
    member) until the last member is gone, not only the leader. Signals go to the group only while it
    has members: its number cannot be reused as a PID until then, so a signal never reaches a stranger
    who was given the same number after the group ended. Process groups do not outlive the agent's
    knowledge of them: after an agent restart they are no longer managed (documented in docs/concepts).
    """

    kind = "process"

    def __init__(self, on_change: ChangeCallback, *, log_dir: str = "/tmp/gpumgr/logs", mps: bool = False,
                 mps_pipe_directory: str = mps_caps.DEFAULT_PIPE_DIRECTORY) -> None:
        super().__init__(on_change, mps=mps, mps_pipe_directory=mps_pipe_directory)
        self.log_dir = Path(log_dir)
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    def create(self, spec: ContainerSpec) -> Managed:
        """Start the command in a new session (its own process group) with the grant's environment."""
        if not spec.command:
            raise RuntimeFailure("a command is required to run a host process", code="invalid_request")
        if spec.run is not None and spec.run.given():
            raise RuntimeFailure(f"{', '.join(spec.run.given())} need a node that runs Docker; this one runs host "
                                 "processes", code="invalid_request")
        env = {**os.environ, **grant_env(spec, self.mps), Env.CUDA_VISIBLE_DEVICES: ",".join(spec.gpus)}
        if self.mps:
            env.update(mps_caps.pipe_env(self.mps_pipe_directory))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            with open(self.log_dir / f"{spec.grant}.log", "ab") as out:
                proc = subprocess.Popen(spec.command, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            raise RuntimeFailure(f"cannot start {spec.command[0]!r}: {exc.strerror or exc}") from exc
        managed = managed_from_labels(str(proc.pid), {**spec.labels, **grant_labels(spec)}, spec.image or "",
                                       State.RUNNING)
        managed.pid = proc.pid
        with self._lock:
            self._table[spec.grant] = managed
            self._procs[spec.grant] = proc
        threading.Thread(target=self._wait, args=(managed, proc), name=f"wait-{proc.pid}", daemon=True).start()
        return managed

    def remove(self, grant: str, stop_grace: float = defaults.STOP_GRACE) -> None:
        """SIGTERM the group, SIGKILL it after ``stop_grace``, and forget it."""
        managed = self._removing(grant)
        self._signal(managed, signal.SIGTERM)
        deadline = time.monotonic() + stop_grace
        while self._alive(managed) and time.monotonic() < deadline:
            time.sleep(GROUP_POLL)
        if self._alive(managed):
            self._signal(managed, signal.SIGKILL)
        with self._lock:
            self._table.pop(grant, None)
            self._procs.pop(grant, None)

    def kill(self, grant: str, reason: str, detail: dict[str, Any] | None = None) -> None:
        """SIGKILL the whole process group; its exit is reported as ``killed`` with ``reason``."""
        managed = self._mark(grant, reason, detail)
        self._signal(managed, signal.SIGKILL)

    def stop(self, grant: str, reason: str, detail: dict[str, Any] | None = None,
             grace: float = defaults.STOP_GRACE) -> None:
        """SIGTERM the group now and SIGKILL it after ``grace`` if it is still there."""
        managed = self._mark(grant, reason, detail)
        self._signal(managed, signal.SIGTERM)

        def kill_if_running() -> None:
            self._signal(managed, signal.SIGKILL)

        timer = threading.Timer(grace, kill_if_running)
        timer.daemon = True
        timer.start()

    def owner_of(self, pid: int, started: int | None = None) -> Managed | None:
        """Map a host pid to its process group's managed entry (``getpgid``: nothing worth caching)."""
        group = procmap.process_group_of(pid)
        if group is None:
            return None
        with self._lock:
            for managed in self._table.values():
                if managed.pid == group and managed.state == State.RUNNING:
                    return managed
        return None

    def _wait(self, managed: Managed, proc: subprocess.Popen[bytes]) -> None:
        """Reap the leader, then wait for the rest of its group: the container ends with its last process."""
        code = proc.wait()
        while managed.pid is not None and procmap.group_members(managed.pid):
            time.sleep(GROUP_POLL)
        with self._lock:
            self._procs.pop(managed.grant, None)
        self._exited(managed, 128 - code if code < 0 else code)

    def _alive(self, managed: Managed) -> bool:
        """Whether the group still runs: its exit is not yet reported and it has a member."""
        return managed.state in (State.RUNNING, REMOVING) and managed.pid is not None \
            and bool(procmap.group_members(managed.pid))

    def _signal(self, managed: Managed, sig: signal.Signals) -> None:
        """Signal the group only while it lives (its number cannot belong to anyone else until then)."""
        if managed.pid is None or not self._alive(managed):
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(managed.pid, sig)
