"""Real ``gpumgr`` processes for tests: a manager and agents started as the README starts them."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

from gpumgr.client import Client, ManagerUnreachable

ROOT = Path(__file__).resolve().parent.parent
#: Every node name a test started an agent for: cleanup removes only their containers, never others'.
TEST_NODES: set[str] = set()
START_TIMEOUT = 20.0


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05, what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def remove_containers_of(client: Any, *nodes: str) -> None:
    """Force-remove every container of ``nodes``; one removed meanwhile (the engine is shared) is skipped."""
    import docker.errors

    for node in nodes:
        for container in client.containers.list(all=True, filters={"label": f"gpumgr.node={node}"},
                                                ignore_removed=True):
            with contextlib.suppress(docker.errors.APIError):
                container.remove(force=True)


def process_gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie waiting for its parent counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


class Proc:
    """One ``gpumgr`` subcommand as a child process, with its output in a log file."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log_path = log
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._log = open(log, "ab")  # noqa: SIM115 - held open for the child's lifetime, closed in stop()
        self.popen = subprocess.Popen([sys.executable, "-m", "gpumgr", *args], cwd=ROOT, env=full_env,
                                      stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        """Everything the process printed so far."""
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int | None:
        """Stop the process (and its group) and return its exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout)
        self._log.close()
        return self.popen.returncode


class ManagerProc(Proc):
    """``gpumgr manager`` on free loopback ports.

    ``client`` is the Python client (:mod:`gpumgr.client`) on its API, which the helpers below use;
    ``get``, ``post`` and ``delete`` are raw ``requests`` calls for tests that check the HTTP answer itself.
    """

    def __init__(self, tmp: Path, *extra: str, env: dict[str, str] | None = None, api_port: int | None = None,
                 agent_port: int | None = None) -> None:
        self.api_port = api_port or free_port()
        self.agent_port = agent_port or free_port()
        self.url = f"http://127.0.0.1:{self.api_port}"
        self.endpoint = f"tcp://127.0.0.1:{self.agent_port}"
        self.http = requests.Session()
        self._client = Client(self.url, timeout=30)
        self._probe = Client(self.url, timeout=1)
        self.state_dir = tmp / f"manager-state-{self.api_port}"
        super().__init__(["manager", "--api", f"127.0.0.1:{self.api_port}", "--agents", self.endpoint,
                          "--state-dir", str(self.state_dir), *extra],
                         tmp / f"manager-{self.api_port}.log", env)
        wait_for(self._healthy, START_TIMEOUT, what=f"manager to answer:\n{self.output}")

    @property
    def client(self) -> Client:
        """The Python client, with the token the test gave ``http`` (``manager.http.headers["Authorization"]``)."""
        auth = str(self.http.headers.get("Authorization", ""))
        self._client.api.token = auth.removeprefix("Bearer ") or None
        return self._client

    def token(self) -> str:
        """The join token, as ``gpumgr join-token`` prints it (read from the same state directory)."""
        from gpumgr.manager.link.admission import Admission

        return Admission(self.state_dir).token()

    def _healthy(self) -> bool:
        if self.popen.poll() is not None:
            raise AssertionError(f"manager exited with {self.popen.returncode}:\n{self.output()}")
        try:
            return self._probe.health()["status"] == "ok"
        except ManagerUnreachable:  # not listening yet, or too busy starting to answer within a second
            return False

    def get(self, path: str, **kw: Any) -> requests.Response:
        return self.http.get(self.url + path, timeout=30, **kw)

    def post(self, path: str, **kw: Any) -> requests.Response:
        return self.http.post(self.url + path, timeout=90, **kw)

    def delete(self, path: str, **kw: Any) -> requests.Response:
        return self.http.delete(self.url + path, timeout=60, **kw)

    def node(self, name: str) -> dict[str, Any] | None:
        """The node ``name`` from ``GET /v1/nodes``, or None."""
        return next((n for n in self._nodes() if n["name"] == name), None)

    def gpu(self, uuid: str) -> dict[str, Any]:
        """One GPU's entry on the map."""
        for node in self._nodes():
            for gpu in node["gpus"]:
                if gpu["uuid"] == uuid:
                    return gpu
        raise AssertionError(f"GPU {uuid} not on the map")

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        """Every event still kept (of type ``kind``), as JSON objects."""
        return [e.raw for e in self.client.events(since=0, types=[kind] if kind else None, follow=False)]

    def _nodes(self) -> list[dict[str, Any]]:
        return list(self.client.api.call("GET", "/v1/nodes")["nodes"])


class AgentProc(Proc):
    """``gpumgr agent`` for one node, started and waited for until its node is ready."""

    def __init__(self, tmp: Path, manager: ManagerProc, node: str, gpus: str = "sim:2x24GiB",
                 runtime: str = "docker", env: dict[str, str] | None = None, wait: bool = True,
                 state_dir: Path | None = None, join: bool = True, endpoints: str | None = None,
                 token: str | None = None, extra: list[str] | None = None) -> None:
        self.node = node
        self.manager = manager
        TEST_NODES.add(node)
        self.hook_socket = os.path.join(tempfile.mkdtemp(prefix="gpumgr-"), "hook.sock")
        env = {"GPUMGR_NETWORK_MODE": "none", "GPUMGR_HOOK_SOCKET": self.hook_socket, **(env or {})}
        self.state_dir = state_dir or tmp / f"agent-state-{node}"
        joining = ["--join", token or manager.token()] if join else []  # issue 21: several managers' token
        super().__init__(["agent", "--manager", endpoints or manager.endpoint, "--node", node, "--gpus", gpus,
                          "--runtime", runtime, "--state-dir", str(self.state_dir), *joining,
                          *(extra or [])],  # issue 23
                         tmp / f"agent-{node}.log", env)
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = START_TIMEOUT) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            if self.popen.poll() is not None:
                raise AssertionError(f"agent exited with {self.popen.returncode}:\n{self.output()}")
            node = self.manager.node(self.node)
            return node if node and node["state"] == "ready" else None

        return wait_for(ready, timeout, what=f"node {self.node} to be ready")
