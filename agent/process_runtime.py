"""The host-process runtime: process groups for hosts without Docker."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

from gpumgr.agent import procmap
from gpumgr.agent.runtime import (
    ChangeCallback,
    Managed,
    Runtime,
    grant_env,
    grant_labels,
    managed_from_labels,
)
from gpumgr.wire import defaults
from gpumgr.wire.errors import RuntimeFailure
from gpumgr.wire.names import Env, State
from gpumgr.wire.protocol import ContainerSpec


class ProcessRuntime(Runtime):
    """Host process groups for hosts without Docker; the ``container_id`` is the group leader's pid.

    Process groups do not outlive the agent's knowledge of them: after an agent restart they are
    no longer managed (documented in the README).
    """

    kind = "process"

    def __init__(self, on_change: ChangeCallback, *, log_dir: str = "/tmp/gpumgr/logs", mps: bool = False) -> None:
        super().__init__(on_change, mps=mps)
        self.log_dir = Path(log_dir)
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    def create(self, spec: ContainerSpec) -> Managed:
        """Start the command in a new session (its own process group) with the grant's environment."""
        if not spec.command:
            raise RuntimeFailure("a command is required to run a host process", code="invalid_request")
        env = {**os.environ, **grant_env(spec, self.mps), Env.CUDA_VISIBLE_DEVICES: ",".join(spec.gpus)}
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

    def kill(self, grant: str, reason: str, detail: dict[str, Any] | None = None) -> None:
        """SIGKILL the whole process group; its exit is reported as ``killed`` with ``reason``."""
        managed = self._mark(grant, reason, detail)
        _signal_group(managed.pid, signal.SIGKILL)

    def stop(self, grant: str, reason: str, detail: dict[str, Any] | None = None,
             grace: float = defaults.STOP_GRACE) -> None:
        """SIGTERM the group now and SIGKILL it after ``grace`` if it is still there."""
        managed = self._mark(grant, reason, detail)
        _signal_group(managed.pid, signal.SIGTERM)

        def kill_if_running() -> None:
            if managed.state == State.RUNNING:
                _signal_group(managed.pid, signal.SIGKILL)

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
        code = proc.wait()
        self._exited(managed, 128 - code if code < 0 else code)


def _signal_group(pgid: int | None, sig: signal.Signals) -> None:
    if pgid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)
