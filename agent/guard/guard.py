"""The guard's decisions: which Docker API requests the engine may carry out on a node with gpumgr.

The engine sends every API request to its authorization plugins before it acts (``AuthZReq``). The
guard allows at once everything but the few requests that can give a container a GPU or reach the
guard itself, and judges those from their body, decoded as the engine decodes it
(:mod:`gpumgr.wire.engine.gojson`, :mod:`gpumgr.wire.engine.gpudev`):

- ``POST /containers/create``: denied if it asks for a GPU, unless it carries a ticket the agent
  registered (its own creates, which hold a grant) or its image ID is in ``guard_allow``;
- ``POST /containers/{id}/update``, ``/exec``, ``/start`` with a legacy HostConfig body, service
  create and update, volume create: denied when they add GPU devices, privilege or guarded binds;
- ``start``/``restart``/``unpause``/``update``/``rename`` of a container gpumgr created: allowed once
  (the agent's own start), then denied: its grant ends when it stops, and only gpumgr gives a new one;
- any change under ``/plugins`` (install, enable, disable, set, remove): denied;
- a request the guard must judge whose body the engine did not pass on (empty, chunked, over 1 MiB,
  not ``application/json``) or that cannot be decoded: denied.

Nothing here waits on the agent or the manager: tickets arrive on the guard's own control socket and
are kept in memory, the list of gpumgr's containers in a small state file, so every answer comes
from local state in bounded time and the guard works with the agent and the manager down.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import posixpath
import re
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from gpumgr.agent.guard.engine_watch import EngineWatch
from gpumgr.wire.engine import gojson, gpudev

log = logging.getLogger(__name__)

PLUGIN_NAME = "gpumgr-guard"
#: The label an agent's create carries its single-use ticket in.
TICKET_LABEL = "gpumgr.guard.ticket"
#: A ticket not used this long after it was registered is forgotten.
TICKET_TTL = 60.0
#: Tickets held at most (an agent registers one per create, just before it).
MAX_TICKETS = 4096
#: gpumgr containers remembered at most (the oldest are forgotten first).
MAX_MANAGED = 65536
VERSION_PREFIX = re.compile(r"^/v[0-9][0-9.]*(?=/)")
CONTAINER_ACTION = re.compile(r"^/containers/([^/]+)/(start|restart|unpause|update|rename|exec)$")
SERVICE_WRITE = re.compile(r"^/services/(create|[^/]+/update)$")
#: The message every denial starts with, so a user knows who refused and what to do instead.
PREFIX = "gpumgr guard: "


@dataclass(frozen=True)
class Decision:
    """The answer to one ``AuthZReq``."""

    allow: bool
    message: str = ""

    def body(self) -> dict[str, Any]:
        """The plugin protocol's answer."""
        return {"Allow": self.allow, "Msg": self.message}


ALLOW = Decision(True)


@dataclass
class GuardState:
    """What the guard knows: live tickets, gpumgr's containers (and how many starts each has left)."""

    state_file: Path | None = None
    tickets: dict[str, float] = field(default_factory=dict)
    #: container id → starts left (1 after the agent's create; 0 once started)
    managed: dict[str, int] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)
    #: ticket → container name, between a ticketed create's request and its response
    pending: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_ticket(self, ticket: str) -> None:
        """Register ``ticket`` for one create."""
        now = time.monotonic()
        with self.lock:
            for old in [t for t, expiry in self.tickets.items() if expiry < now]:
                del self.tickets[old]
            if len(self.tickets) >= MAX_TICKETS:
                raise OverflowError(f"{MAX_TICKETS} tickets are waiting already")
            self.tickets[ticket] = now + TICKET_TTL

    def use_ticket(self, ticket: str) -> bool:
        """Whether ``ticket`` is live; it is used up either way."""
        with self.lock:
            expiry = self.tickets.pop(ticket, None)
        return expiry is not None and expiry >= time.monotonic()

    def created(self, container_id: str, name: str) -> None:
        """gpumgr created ``container_id``: its one start is the agent's."""
        with self.lock:
            while len(self.managed) >= MAX_MANAGED:
                forgotten = next(iter(self.managed))
                del self.managed[forgotten]
                for old in [n for n, cid in self.names.items() if cid == forgotten]:
                    del self.names[old]
            self.managed[container_id] = 1
            if name:
                self.names[name.lstrip("/")] = container_id
        self.save()

    def forget_name(self, name: str) -> None:
        """``name`` no longer names a gpumgr container (the engine gave it to another one)."""
        with self.lock:
            forgotten = self.names.pop(name.lstrip("/"), None)
        if forgotten is not None:
            self.save()

    def resolve(self, ref: str) -> str | None:
        """The gpumgr container ``ref`` (an id, a name or an id prefix) may name, or None."""
        with self.lock:
            if ref in self.managed:
                return ref
            if ref.lstrip("/") in self.names:
                return self.names[ref.lstrip("/")]
            if re.fullmatch(r"[0-9a-f]{1,64}", ref):
                return next((cid for cid in self.managed if cid.startswith(ref)), None)
        return None

    def take_start(self, container_id: str) -> bool:
        """Use the one start ``container_id`` has; False when it has none left."""
        with self.lock:
            left = self.managed.get(container_id, 0)
            self.managed[container_id] = 0
        if left:
            self.save()
        return left > 0

    def load(self) -> None:
        """Read the containers remembered in ``state_file`` (a missing or broken file is an empty list)."""
        if self.state_file is None:
            return
        try:
            data = json.loads(self.state_file.read_text())
            self.managed = {str(k): int(v) for k, v in data.get("managed", {}).items()}
            self.names = {str(k): str(v) for k, v in data.get("names", {}).items()}
        except (OSError, ValueError, AttributeError, TypeError) as exc:
            if not isinstance(exc, FileNotFoundError):
                log.warning("guard state %s unreadable (%s): starting with no gpumgr containers known",
                            self.state_file, exc)

    def save(self) -> None:
        """Write the containers to ``state_file`` atomically."""
        if self.state_file is None:
            return
        with self.lock:
            text = json.dumps({"managed": self.managed, "names": self.names})
        try:
            self.state_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.state_file.parent, prefix=".guard-")
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
            os.replace(tmp, self.state_file)
        except OSError as exc:
            log.warning("could not write the guard state %s: %s", self.state_file, exc)


class Guard:
    """Judges the engine's requests under ``policy``, with ``allow`` image IDs as exceptions.

    With ``engines``, the engine's default runtime is learnt from the engine process that asks
    (:mod:`gpumgr.agent.guard.engine_watch`); without, ``policy.default`` says it.
    """

    def __init__(self, policy: gpudev.Policy, state: GuardState, allow: frozenset[str] = frozenset(),
                 engines: EngineWatch | None = None) -> None:
        self.policy = policy
        self.state = state
        self.allow = frozenset(_image_id(image) for image in allow)
        self.engines = engines

    def request(self, plugin_request: dict[str, Any], engine_pid: int | None = None) -> Decision:
        """Judge one ``AuthZReq`` from the engine process ``engine_pid``; any failure to read it is a denial."""
        try:
            return self._judge(plugin_request, engine_pid)
        except gojson.BodyError as exc:
            return _deny(f"the request's body cannot be read as the engine reads it ({exc}); nothing was done")
        except Exception as exc:  # fail closed: a bug here must never let a GPU through
            log.exception("the guard failed on a request")
            return _deny(f"the guard could not judge this request ({type(exc).__name__})")

    def response(self, plugin_request: dict[str, Any]) -> Decision:
        """Always allow; after a create or rename that worked, note which container a name now belongs to."""
        status = plugin_request.get("ResponseStatusCode")
        if str(plugin_request.get("RequestMethod")).upper() != "POST" or (isinstance(status, int) and status >= 300):
            return ALLOW
        path, query, _ = _route(str(plugin_request.get("RequestUri") or ""))
        name = (query.get("name") or [""])[0]
        if path == "/containers/create":
            self._created(plugin_request, name)
        elif name and (match := CONTAINER_ACTION.match(path)) is not None and match[2] == "rename":
            self.state.forget_name(name)  # a gpumgr container's old name now names another container
        return ALLOW

    def _created(self, plugin_request: dict[str, Any], name: str) -> None:
        """Remember a ticketed create's container (its one start is the agent's); any other frees its name."""
        try:
            ticket = (_decoded(plugin_request, gpudev.CREATE).get("Labels") or {}).get(TICKET_LABEL)
            response = json.loads(base64.b64decode(str(plugin_request.get("ResponseBody") or "")) or b"{}")
        except (ValueError, TypeError):
            return  # not a create the engine carried out
        pending = self.state.pending.pop(ticket, None) if isinstance(ticket, str) else None
        if pending is not None and isinstance(response, dict) and isinstance(response.get("Id"), str):
            self.state.created(response["Id"], pending)
        elif name:
            self.state.forget_name(name)

    def _policy(self, engine_pid: int | None) -> gpudev.Policy:
        """The policy with what the asking engine's default runtime is now."""
        return self.policy if self.engines is None else replace(self.policy, default=self.engines.default(engine_pid))

    def _judge(self, request: dict[str, Any], engine_pid: int | None) -> Decision:
        method = str(request.get("RequestMethod") or "").upper()
        path, query, version = _route(str(request.get("RequestUri") or ""))
        if path.startswith("/plugins") and method not in ("GET", "HEAD"):
            return _deny("engine plugins cannot be installed, changed or removed on a node the guard protects")
        if method != "POST":
            return ALLOW
        if path == "/containers/create":
            return self._create(request, query, self._policy(engine_pid))
        if (match := CONTAINER_ACTION.match(path)) is not None:
            return self._container_action(request, match[1], match[2], version, engine_pid)
        if SERVICE_WRITE.match(path):
            return _verdict(gpudev.service_reasons(_decoded(request, gpudev.SERVICE), self.policy))
        if path == "/volumes/create":
            return _verdict(gpudev.volume_reasons(_decoded(request, gpudev.VOLUME), self.policy))
        return ALLOW

    def _create(self, request: dict[str, Any], query: dict[str, list[str]], policy: gpudev.Policy) -> Decision:
        body = _decoded(request, gpudev.CREATE)
        ticket = (body.get("Labels") or {}).get(TICKET_LABEL)
        granted = isinstance(ticket, str) and self.state.use_ticket(ticket)
        if ticket is not None and not granted:
            return _deny(f"the {TICKET_LABEL} label holds no ticket the gpumgr agent gave out")
        reasons = gpudev.create_reasons(body, policy, granted=granted)
        image = str(body.get("Image") or "")
        if reasons and _image_id(image) in self.allow:
            log.warning("guard_allow: image %s is let through although %s", image, "; ".join(reasons))
            reasons = gpudev.self_reasons(body, self.policy)
        if granted and not reasons:
            self.state.pending[str(ticket)] = (query.get("name") or [""])[0]
        return _verdict(reasons)

    def _container_action(self, request: dict[str, Any], ref: str, action: str, version: str | None,
                          engine_pid: int | None) -> Decision:
        managed = self.state.resolve(ref)
        if action == "exec":
            return _verdict(gpudev.exec_reasons(_decoded(request, gpudev.EXEC)))
        if managed is not None:
            if action == "start" and self.state.take_start(managed):
                return ALLOW
            return _deny(f"container {ref} was created by gpumgr and its grant has ended (or is in use): "
                         f"it cannot be {action}ed outside gpumgr; {gpudev.HINT}")
        if action == "update":
            return _verdict(gpudev.update_reasons(_decoded(request, gpudev.UPDATE), self.policy))
        if action == "start" and version is not None and _older(version, "1.24"):
            return self._legacy_start(request, self._policy(engine_pid))
        return ALLOW

    def _legacy_start(self, request: dict[str, Any], policy: gpudev.Policy) -> Decision:
        """API versions before 1.24 still take a HostConfig with ``start``: judge it as a create's."""
        raw = _body(request)
        if not raw:
            length = str(_header(request, "Content-Length") or "")
            if length.isdigit() and int(length) <= 7:
                return ALLOW  # the engine reads no body this short
            return _deny("a start through an old API version must carry a body the guard can read")
        host = gojson.decode(raw, gpudev.HOST_CONFIG)
        return _verdict(gpudev.create_reasons({"HostConfig": host}, policy))


def _decoded(request: dict[str, Any], schema: gojson.Struct) -> dict[str, Any]:
    raw = _body(request)
    if not raw:
        raise gojson.BodyError("the engine passed no body: it was empty, chunked, over 1 MiB or not "
                               "application/json")
    return gojson.decode(raw, schema)


def _body(request: dict[str, Any]) -> bytes:
    value = request.get("RequestBody")
    if not value:
        return b""
    try:
        return base64.b64decode(str(value), validate=True)
    except ValueError as exc:
        raise gojson.BodyError(f"the engine's copy of the body is not base64: {exc}") from None


def _header(request: dict[str, Any], name: str) -> Any:
    headers = request.get("RequestHeaders") or {}
    return next((v for k, v in headers.items() if str(k).lower() == name.lower()), None) \
        if isinstance(headers, dict) else None


def _route(uri: str) -> tuple[str, dict[str, list[str]], str | None]:
    """``(path without its API version, query, version)``: decoded and normalised as the engine's router sees it."""
    parts = urlsplit(uri)
    path = posixpath.normpath("/" + unquote(parts.path).lstrip("/"))
    version = None
    if (match := VERSION_PREFIX.match(path)) is not None:
        version = match[0][2:]
        path = path[match.end():]
    return path, parse_qs(parts.query), version


def _older(version: str, than: str) -> bool:
    def numbers(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in text.split(".") if part.isdigit())
    return numbers(version) < numbers(than)


def _image_id(image: str) -> str:
    image = image.strip().lower()
    return image if image.startswith("sha256:") else f"sha256:{image}" if re.fullmatch(r"[0-9a-f]{64}", image) \
        else image


def _verdict(reasons: list[str]) -> Decision:
    return _deny(f"{'; '.join(reasons)}. {gpudev.HINT}") if reasons else ALLOW


def _deny(message: str) -> Decision:
    log.warning("denied: %s", message)
    return Decision(False, PREFIX + message)
