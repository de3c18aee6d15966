"""The Docker runtime's view of the engine's own events: starts, deaths and removals it did not cause.

An agent learns a Swarm task started, or any container ended, from the engine's event stream; when
the stream breaks it reconnects and re-lists every managed container, so nothing that happened during
the gap is missed (an exit, or a start whose event was lost). Also here: reading the engine's words
(exit codes in list entries, end times, which refusals are the caller's mistake).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime
from typing import Any

import docker
import docker.errors
from docker.types import CancellableStream

from gpumgr.agent.runtimes.runtime import Managed, Runtime
from gpumgr.wire import defaults
from gpumgr.wire.errors import RuntimeFailure
from gpumgr.wire.names import Label, State

log = logging.getLogger(__name__)


class EngineEvents(Runtime):
    """The event-stream half of :class:`gpumgr.agent.runtimes.docker_runtime.DockerRuntime`."""

    client: docker.DockerClient
    _stop: threading.Event
    _events: CancellableStream[dict[str, Any]] | None
    _by_id: dict[str, str]

    def _untrack(self, grant: str) -> Any:
        """Stop managing ``grant`` (the runtime's own bookkeeping)."""
        raise NotImplementedError

    def _watch(self) -> None:
        first = True
        while not self._stop.is_set():
            try:
                self._events = self.client.events(
                    decode=True, since=int(time.time()) - 1,
                    filters={"type": "container", "event": ["start", "die", "destroy"]},
                )
                if not first:
                    self._resync()  # exits during the gap would otherwise never be reported
                first = False
                for event in self._events:
                    self._on_event(event)
            except Exception as exc:  # the engine restarted or the stream broke: reconnect
                if not self._stop.is_set():
                    log.warning("docker events stream broke (%s); reconnecting", exc)
            self._stop.wait(defaults.EVENT_RETRY)

    def _on_event(self, event: dict[str, Any]) -> None:
        cid = event.get("id") or event.get("Actor", {}).get("ID", "")
        with self._lock:
            grant = self._by_id.get(cid)
            managed = self._table.get(grant) if grant else None
        if managed is None:
            return
        action = event.get("Action")
        if action == "start":
            with self._lock:
                started = managed.state == State.CREATING
                ended = managed.state in (State.EXITED, State.KILLED)
                if started:
                    managed.state = State.RUNNING
            if started:
                self._on_change(managed)  # a Swarm task's grant is running now, not at the next heartbeat
            elif ended:
                self._stop_restarted(managed)
        elif action == "die":
            code = event.get("Actor", {}).get("Attributes", {}).get("exitCode")
            self._exited(managed, int(code) if code is not None and str(code).isdigit() else None)
        elif action == "destroy":
            if managed.state == State.CREATING:
                managed.reason = "removed_before_start"
                self._exited(managed, None)
            self._untrack(managed.grant)


    def _created_before(self, grant: str) -> Managed | None:
        """The container that already holds ``grant`` (an earlier agent process created it, and the manager sent
        its create again to this one), started if it never was; None if there is none."""
        with self._lock:
            managed = self._table.get(grant)
        if managed is None or managed.state != State.CREATING or managed.hook:
            return managed
        try:
            self.client.api.start(managed.container_id)
        except docker.errors.APIError as exc:
            raise RuntimeFailure(f"docker could not start the container: {exc.explanation}",
                                 code=caller_code(exc, starting=True)) from exc
        with self._lock:
            managed.state = State.RUNNING
        return managed

    def _stop_restarted(self, managed: Any) -> None:
        """A container whose grant ended with its exit was started again behind gpumgr (``docker restart``, or
        ``docker start``): its grant is gone, so it may not hold GPU memory. It is killed (kept, as it ended),
        on a thread of its own so the event stream is never held up."""
        log.warning("container %s of ended grant %s was started again outside gpumgr: it has no grant, so it is "
                    "stopped (ask gpumgr for a new one instead)", managed.container_id[:12], managed.grant)
        threading.Thread(target=self._kill_quietly, args=(managed.container_id,), name="stop-restarted",
                         daemon=True).start()

    def _kill_quietly(self, container_id: str) -> None:
        try:
            self.client.api.kill(container_id)
        except docker.errors.APIError as exc:  # it stopped by itself meanwhile, or is gone
            log.info("could not stop restarted container %s: %s", container_id[:12], exc.explanation)

    def _resync(self) -> None:
        """Compare every managed container with the engine's list and report what changed unseen."""
        listed = {c["Id"]: c for c in self.client.api.containers(all=True, filters={"label": Label.GRANT})}
        hooked = {c["Id"]: c for c in self.client.api.containers(all=True) if c["Id"] in self._by_id}
        listed.update(hooked)
        for managed in self.managed():
            summary = listed.get(managed.container_id)
            state = str(summary.get("State")) if summary is not None else None
            if managed.state in (State.RUNNING, State.CREATING) and state not in ("running", "created"):
                log.info("container %s ended while the event stream was down", managed.container_id[:12])
                self._exited(managed, exit_code_of(summary) if summary is not None else None)
            elif managed.state in (State.EXITED, State.KILLED) and state == "running":
                self._stop_restarted(managed)
            elif managed.state == State.CREATING and state == "running":
                # its start event was missed: it runs, so its grant is enforced and reported running from now
                with self._lock:
                    managed.state = State.RUNNING
                log.info("container %s started while the event stream was down", managed.container_id[:12])
                self._on_change(managed)
        log.info("re-listed containers after the event stream came back")


def caller_code(exc: docker.errors.APIError, *, starting: bool = False) -> str | None:
    """The error code for an engine refusal that is the caller's mistake, or None (the node's fault).

    A reference the engine rejects (400), a name already in use (409), and a command it cannot
    execute are what the caller sent; the manager answers them with a 4xx and the engine's words.
    """
    text = str(exc.explanation or "").lower()
    if starting and ("executable file not found" in text or "no such file or directory" in text
                     or ("permission denied" in text and "exec" in text)):
        return "bad_command"
    status = exc.status_code or 0
    if status == 409:
        return "conflict"
    if status == 400 or "invalid reference format" in text or "repository name must" in text:
        return "invalid_request"
    return None


def exit_code_of(summary: dict[str, Any]) -> int | None:
    """The exit code in a list entry's status text (``Exited (137) 2 seconds ago``), if any."""
    status = str(summary.get("Status", ""))
    inside = status.partition("(")[2].partition(")")[0]
    return int(inside) if inside.lstrip("-").isdigit() else None


def finished_at(state: dict[str, Any]) -> float:
    """When the engine says the container ended (its ``State.FinishedAt``); now if it never ran or cannot say."""
    text = str(state.get("FinishedAt") or "")
    try:  # RFC 3339 with nanoseconds: keep microseconds, which is what fromisoformat reads
        head, _, rest = text.rstrip("Z").partition(".")
        stamp = datetime.fromisoformat(head + ("." + rest[:6] if rest else "") + "+00:00")
    except ValueError:
        return time.time()
    return stamp.timestamp() if stamp.year > 1 else time.time()
