"""``gpumgr guard``: the guard's two Unix sockets, served by threads, answering from memory.

- The **plugin socket** (``/run/docker/plugins/gpumgr-guard.sock``, where the engine looks for a plugin
  named ``gpumgr-guard``) speaks the engine's plugin protocol: HTTP/1.1 POSTs of JSON.
  ``/Plugin.Activate`` answers ``authz``; ``/AuthZPlugin.AuthZReq`` is judged by
  :class:`gpumgr.agent.guard.Guard`; ``/AuthZPlugin.AuthZRes`` is allowed at once.
- The **control socket** (``/run/gpumgr/guard.sock``, mode 0600, peers checked to be root or this
  user) takes one JSON line per connection from the agent: ``{"ticket": "..."}`` registers a ticket
  for the create the agent is about to make; the answer is ``{"ok": true}`` or an error.

The engine's plugin client has no timeout of its own, so every answer must come quickly: nothing
here calls the agent, the manager or the engine, each connection has a read deadline, and a body
over :data:`MAX_REQUEST` is answered with a denial rather than read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socketserver
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from gpumgr.agent.guard import PREFIX, Decision, Guard, GuardState
from gpumgr.agent.hooklink import trusted_peer
from gpumgr.wire import gpudev

log = logging.getLogger(__name__)

#: The engine forwards bodies under 1 MiB; base64 and the request's other fields make that under 2 MiB.
MAX_REQUEST = 2 * 1024 * 1024
#: Seconds a connection may take to send a request (the engine sends each at once).
READ_TIMEOUT = 10.0
MAX_CONTROL_LINE = 4096
CONTENT_TYPE = "application/vnd.docker.plugins.v1.2+json"


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, path: str, handler: type[socketserver.BaseRequestHandler], mode: int, guard: Guard) -> None:
        Path(path).parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            Path(path).unlink()
        self.guard = guard
        super().__init__(path, handler)
        os.chmod(path, mode)


class PluginHandler(BaseHTTPRequestHandler):
    """The engine's plugin protocol, one keep-alive connection per handler."""

    protocol_version = "HTTP/1.1"
    server: _UnixServer

    def setup(self) -> None:
        """Bound every read on this connection."""
        super().setup()
        self.connection.settimeout(READ_TIMEOUT)

    def do_POST(self) -> None:
        """Answer one plugin call."""
        guard = self.server.guard
        request = self._read()
        if self.path == "/Plugin.Activate":
            self._send({"Implements": ["authz"]})
        elif self.path == "/AuthZPlugin.AuthZReq":
            decision = guard.request(request) if request is not None else \
                Decision(False, f"{PREFIX}the engine's request to the guard could not be read")
            self._send(decision.body())
        elif self.path == "/AuthZPlugin.AuthZRes":
            self._send(guard.response(request or {}).body())
        else:
            self._send({"Err": f"unknown plugin call {self.path}"}, status=404)

    def _read(self) -> dict[str, Any] | None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_REQUEST:
            self.close_connection = True
            return None
        try:
            data = json.loads(self.rfile.read(length) or b"{}")
        except (ValueError, OSError):
            return None
        return data if isinstance(data, dict) else None

    def _send(self, body: Any, status: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """Plugin calls are logged at debug level only: there is one per API call."""
        log.debug("plugin call: " + format, *args)


class ControlHandler(socketserver.StreamRequestHandler):
    """One JSON line from the agent: a ticket to register."""

    server: _UnixServer

    def handle(self) -> None:
        """Read the line, register, answer."""
        self.connection.settimeout(READ_TIMEOUT)
        if not trusted_peer(self.connection):
            log.warning("refused a guard control connection from neither root nor the guard's user")
            return
        try:
            message = json.loads(self.rfile.readline(MAX_CONTROL_LINE))
            ticket = message["ticket"]
            if not isinstance(ticket, str) or not 16 <= len(ticket) <= 128:
                raise ValueError("a ticket is a string of 16 to 128 characters")
            self.server.guard.state.add_ticket(ticket)
            answer: dict[str, Any] = {"ok": True}
        except (ValueError, KeyError, TypeError, OverflowError, OSError) as exc:
            log.warning("dropped a malformed guard control message: %s", exc)
            answer = {"ok": False, "error": str(exc)}
        with contextlib.suppress(OSError):
            self.wfile.write(json.dumps(answer).encode() + b"\n")


class GuardServer:
    """Both sockets, each served on its own thread until :meth:`close`."""

    def __init__(self, guard: Guard, plugin_socket: str, control_socket: str | None) -> None:
        self.guard = guard
        self.plugin = _UnixServer(plugin_socket, PluginHandler, 0o660, guard)
        self.control = _UnixServer(control_socket, ControlHandler, 0o600, guard) if control_socket else None
        self._threads = [threading.Thread(target=server.serve_forever, name=f"guard-{name}", daemon=True)
                         for name, server in (("plugin", self.plugin), ("control", self.control)) if server]

    def start(self) -> GuardServer:
        """Serve in the background."""
        for thread in self._threads:
            thread.start()
        return self

    def close(self) -> None:
        """Stop serving and remove both sockets (the engine then refuses every call until the guard is back)."""
        for server in (self.plugin, self.control):
            if server is None:
                continue
            server.shutdown()
            server.server_close()
            with contextlib.suppress(OSError):
                Path(str(server.server_address)).unlink()


def build_guard(settings: Any) -> Guard:
    """A guard from the agent's settings (``guard_*``, ``hook_max_*``)."""
    policy = gpudev.Policy(majors=gpudev.gpu_majors(), hook_max_priority=settings.hook_max_priority,
                           hook_max_memory=settings.hook_max_memory)
    state = GuardState(Path(settings.guard_state) if settings.guard_state else None)
    state.load()
    return Guard(policy, state, frozenset(settings.guard_allow))
