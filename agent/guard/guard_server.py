"""``gpumgr guard``: the guard's two Unix sockets, served by threads, answering from memory.

- The **plugin socket** (``/run/docker/plugins/gpumgr-guard.sock``, where the engine looks for a plugin
  named ``gpumgr-guard``) speaks the engine's plugin protocol: HTTP/1.1 POSTs of JSON.
  ``/Plugin.Activate`` answers ``authz``; ``/AuthZPlugin.AuthZReq`` is judged by
  :class:`gpumgr.agent.guard.guard.Guard`; ``/AuthZPlugin.AuthZRes`` is allowed at once.
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
from pathlib import Path
from typing import Any

from gpumgr.agent.guard.engine_watch import EngineWatch, peer_pid
from gpumgr.agent.guard.guard import PREFIX, Decision, Guard, GuardState
from gpumgr.wire.engine import gpudev
from gpumgr.wire.security import trusted_peer

log = logging.getLogger(__name__)

#: The engine forwards bodies under 1 MiB; base64 and the request's other fields make that under 2 MiB.
MAX_REQUEST = 2 * 1024 * 1024
#: Seconds a connection may take to send a request (the engine sends each at once).
READ_TIMEOUT = 10.0
MAX_CONTROL_LINE = 4096
#: An HTTP request line or header longer than this, or more headers than this, ends the connection.
MAX_LINE = 8192
MAX_HEADERS = 64
CONTENT_TYPE = "application/vnd.docker.plugins.v1.2+json"


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, path: str, handler: type[socketserver.BaseRequestHandler], mode: int, guard: Guard) -> None:
        # the engine's plugin folder is world-readable; the control socket's is root's alone, as the hook's
        Path(path).parent.mkdir(mode=0o755 if mode & 0o060 else 0o700, parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            Path(path).unlink()
        self.guard = guard
        super().__init__(path, handler)
        os.chmod(path, mode)


class PluginHandler(socketserver.StreamRequestHandler):
    """The engine's plugin protocol: HTTP/1.1 POSTs with a Content-Length, on one keep-alive connection.

    Written by hand rather than with ``http.server``: the engine calls the guard twice for every API
    call, and the standard handler's header parsing and ``Date`` formatting were most of each answer's time.
    """

    server: _UnixServer

    def handle(self) -> None:
        """Answer calls until the engine closes the connection (or sends something that is not one)."""
        self.connection.settimeout(READ_TIMEOUT)
        self.engine_pid = peer_pid(self.connection)  # dockerd: the guard learns its settings from its files
        if self.server.guard.engines is not None:
            self.server.guard.engines.connected(self.engine_pid)
        with contextlib.suppress(OSError):  # the engine went away or stalled: its connection ends
            while self._one():
                pass

    def _one(self) -> bool:
        line = self.rfile.readline(MAX_LINE)
        if not line:
            return False
        method, path, keep = _request_line(line)
        length, keep = self._headers(keep)
        if method is None or length is None or not 0 <= length <= MAX_REQUEST:
            self._send({"Err": "the guard reads HTTP/1.1 POSTs of JSON with a Content-Length"}, 400, keep=False)
            return False
        self._send(*self._answer(path, _json(self.rfile.read(length))), keep=keep)
        return keep

    def _headers(self, keep: bool) -> tuple[int | None, bool]:
        length: int | None = 0
        for _ in range(MAX_HEADERS):
            line = self.rfile.readline(MAX_LINE)
            if line in (b"\r\n", b"\n", b""):
                return length, keep
            name, _, value = line.decode("latin-1").partition(":")
            name, value = name.strip().lower(), value.strip()
            if name == "content-length":
                length = int(value) if value.isdigit() else None
            elif name == "transfer-encoding":
                length = None  # the engine's plugin client always sends a length
            elif name == "connection":
                keep = value.lower() != "close"
        return None, False

    def _answer(self, path: str, request: dict[str, Any] | None) -> tuple[dict[str, Any], int]:
        guard = self.server.guard
        if path == "/AuthZPlugin.AuthZReq":
            decision = guard.request(request, self.engine_pid) if request is not None else \
                Decision(False, f"{PREFIX}the engine's request to the guard could not be read")
            return decision.body(), 200
        if path == "/AuthZPlugin.AuthZRes":
            return guard.response(request or {}).body(), 200
        if path == "/Plugin.Activate":
            return {"Implements": ["authz"]}, 200
        return {"Err": f"unknown plugin call {path}"}, 404

    def _send(self, body: dict[str, Any], status: int, *, keep: bool) -> None:
        data = json.dumps(body).encode()
        head = (f"HTTP/1.1 {status} {'OK' if status == 200 else 'Error'}\r\nContent-Type: {CONTENT_TYPE}\r\n"
                f"Content-Length: {len(data)}\r\n{'' if keep else 'Connection: close' + chr(13) + chr(10)}\r\n")
        self.wfile.write(head.encode() + data)


def _request_line(line: bytes) -> tuple[str | None, str, bool]:
    """``(method, path, keep-alive by default)``; method None if the line is not an HTTP/1.x POST."""
    parts = line.decode("latin-1").split()
    if len(parts) != 3 or parts[0] != "POST" or not parts[2].startswith("HTTP/1."):
        return None, "", False
    return parts[0], parts[1], parts[2] == "HTTP/1.1"


def _json(raw: bytes) -> dict[str, Any] | None:
    try:
        data = json.loads(raw or b"{}")
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


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
    """A guard from the agent's settings (``guard_*``, ``hook_max_*``), learning each engine's from its files."""
    policy = gpudev.Policy(majors=gpudev.gpu_majors(), hook_max_priority=settings.hook_max_priority,
                           hook_max_memory=settings.hook_max_memory,
                           runtimes=gpudev.FENCED_RUNTIMES | frozenset(settings.guard_runtimes),
                           cap_add=frozenset(settings.policy.cap_add if settings.policy else ()))
    state = GuardState(Path(settings.guard_state) if settings.guard_state else None)
    state.load()
    return Guard(policy, state, frozenset(settings.guard_allow), EngineWatch())
