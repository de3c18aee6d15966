"""A Python client for the gpumgr manager's REST API, shaped like docker-py's ``docker.from_env()``.

    from gpumgr.client import Client
    client = Client.from_env()                      # GPUMGR_MANAGER, GPUMGR_TOKEN
    box = client.containers.run("pytorch:2", "python train.py", gpu_memory="8GiB")
    print(box.node, box.gpus[0].index, box.wait().exit_code)

Two layers, as docker-py has: :class:`API` makes one REST call and turns an error answer into the
exception for its ``code`` (the classes of :mod:`gpumgr.wire.errors`, with the API's ``code`` and
HTTP ``status``); :class:`Client` gives typed records (:mod:`gpumgr.client_types`). Several manager
URLs may be given: a call that cannot connect to one goes on to the next. The transport is the
standard library's ``http.client``, one kept-alive connection per thread, because ``docker gpu``
runs on this client and must start fast.
"""

from __future__ import annotations

import http.client
import json
import os
import select
import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self

from gpumgr.wire import defaults
from gpumgr.wire.errors import (
    AgentFailed,
    AgentTimeout,
    Conflict,
    Forbidden,
    GpuConflict,
    GpumgrError,
    InvalidRequest,
    NoAgents,
    NoFit,
    NotFound,
    PolicyDenied,
    QuotaExceeded,
)

if TYPE_CHECKING:
    from gpumgr.client_types import Container, Event, Node, WaitResult

DEFAULT_URL = "http://127.0.0.1:9400"
#: Seconds a call waits for its answer (a create waits for its node: the CLI's own bound).
TIMEOUT = defaults.CLI_TIMEOUT
#: Seconds between two looks at ``GET /v1/events`` while following.
EVENTS_POLL = 0.5
#: How long ``events()`` keeps trying to reach a manager that went away before it gives up.
RECONNECT_TIMEOUT = 120.0
#: Methods that may be sent again (to the same or the next URL) when a connection broke after sending.
IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE"})
MULTIPLEXED = "application/vnd.docker.multiplexed-stream"
#: Docker's frame header: stream id, three zero bytes, the payload's length (big-endian).
FRAME_HEADER = 8
#: An error answer's body is read up to this many bytes.
MAX_ERROR_BODY = 1 << 16

APIError = GpumgrError  # the root every error below derives from, under docker-py's name


class Unauthorized(GpumgrError):
    """No token, or the wrong one: set ``GPUMGR_TOKEN`` (or ``token=``) to the manager's token."""

    code = "unauthorized"
    status = 401


class ManagerUnreachable(GpumgrError, ConnectionError):
    """No manager URL could be reached (or the connection broke with the outcome unknown); ``status`` is 0."""

    code = "unreachable"
    status = 0


class NeverFits(NoFit):
    """No GPU of any node could ever hold the request, however much is freed: ask for less."""

    code = "never_fits"


#: Which class an error answer's ``code`` becomes; an unknown code falls back on its HTTP status.
ERRORS_BY_CODE: dict[str, type[GpumgrError]] = {
    cls.code: cls for cls in (InvalidRequest, NotFound, Forbidden, QuotaExceeded, NoFit, NeverFits, Conflict,
                              GpuConflict, NoAgents, AgentFailed, AgentTimeout, PolicyDenied, Unauthorized)}
ERRORS_BY_STATUS: dict[int, type[GpumgrError]] = {400: InvalidRequest, 401: Unauthorized, 403: Forbidden,
                                                  404: NotFound, 409: Conflict, 502: AgentFailed, 503: NoAgents,
                                                  504: AgentTimeout}


def api_error(status: int, body: bytes) -> GpumgrError:
    """The exception for an error answer: the class its code names, carrying the API's ``code`` and ``status``."""
    try:
        detail = json.loads(body).get("error") or {}
    except (ValueError, AttributeError):
        detail = {}
    code = str(detail.get("code") or f"http_{status}")
    message = str(detail.get("message") or body[:200].decode(errors="replace") or f"HTTP {status}")
    cls = ERRORS_BY_CODE.get(code) or ERRORS_BY_STATUS.get(status, GpumgrError)
    error = (PolicyDenied(message, rule=str(detail.get("rule") or "unknown")) if cls is PolicyDenied
             else cls(message, code=code))
    error.code, error.status = code, status
    return error


#: What a kept-alive connection the server has closed raises on its next use.
STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


class _Broken(Exception):
    """A connection failed; ``sent``: after the request went out (its outcome is unknown)."""

    def __init__(self, reason: BaseException, *, sent: bool, stale: bool = False) -> None:
        super().__init__(str(reason) or type(reason).__name__)
        self.sent = sent
        #: the server had closed the kept-alive connection: nothing was read, so sending again is safe
        self.stale = stale


class _Target:
    """One manager URL: scheme, host, port and path prefix."""

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidRequest(f"the manager's URL must be http://HOST:PORT or https://..., not {url!r} "
                                 "(tcp:// is an agent's link endpoint, not the REST API)")
        self.url = url.strip().rstrip("/")
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.https else 80)
        self.prefix = parts.path.rstrip("/")

    def connect(self, timeout: float) -> http.client.HTTPConnection:
        """A new connection, connected (a failure here is before anything was sent)."""
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=timeout)
        try:
            conn.connect()
        except OSError as exc:
            conn.close()
            raise _Broken(exc, sent=False) from None
        return conn


class API:
    """Raw REST calls: JSON in, JSON out, an error answer raised as the exception for its code."""

    def __init__(self, urls: str | Sequence[str] = DEFAULT_URL, token: str | None = None,
                 timeout: float = TIMEOUT) -> None:
        words = urls.split(",") if isinstance(urls, str) else list(urls)
        self.targets = [_Target(u) for u in words if u.strip()]
        if not self.targets:
            raise InvalidRequest("no manager URL given")
        self.token = token
        self.timeout = timeout
        #: the target that answered last: calls start there
        self.current = 0
        self._local = threading.local()

    @property
    def url(self) -> str:
        """The manager URL calls go to first."""
        return self.targets[self.current].url

    def call(self, method: str, path: str, *, params: Mapping[str, str] | None = None, body: Any = None,
             timeout: float | None = None) -> Any:
        """One call; its JSON answer. Goes on to the next URL when one cannot be connected to."""
        data = None if body is None else json.dumps(body).encode()
        headers = self._headers({"Content-Type": "application/json"} if data is not None else {})
        failures: list[str] = []
        for index in self._order():
            target = self.targets[index]
            try:
                status, payload = self._exchange(target, method, self._path(target, path, params), data, headers,
                                                 timeout or self.timeout)
            except _Broken as exc:
                failures.append(f"{target.url} ({exc})")
                if exc.sent and method not in IDEMPOTENT:
                    raise ManagerUnreachable(f"the connection to {target.url} broke during {method} {path} "
                                             f"({exc}); whether it was carried out is unknown") from None
                continue
            self.current = index
            if status >= 400:
                raise api_error(status, payload)
            try:
                return json.loads(payload) if payload else {}
            except ValueError:
                raise GpumgrError(f"{target.url} answered {method} {path} with {status} and a body that is not "
                                  "JSON: is it a gpumgr manager?", code="bad_answer") from None
        raise ManagerUnreachable("cannot reach the gpumgr manager at " + ", ".join(failures))

    def stream(self, path: str, params: Mapping[str, str], accept: str) -> Stream:
        """A streamed GET on a connection of its own, with no read timeout (a quiet container may say nothing
        for hours); use it with ``with``."""
        failures: list[str] = []
        for index in self._order():
            target = self.targets[index]
            try:
                conn = target.connect(self.timeout)
            except _Broken as exc:
                failures.append(f"{target.url} ({exc})")
                continue
            self.current = index
            try:
                conn.request("GET", self._path(target, path, params), headers=self._headers({"Accept": accept}))
                response = conn.getresponse()
            except OSError as exc:
                conn.close()
                raise ManagerUnreachable(f"the connection to {target.url} broke: {exc}") from None
            if response.status >= 400:
                payload = response.read(MAX_ERROR_BODY)
                conn.close()
                raise api_error(response.status, payload)
            if conn.sock is not None:
                conn.sock.settimeout(None)
            return Stream(conn, response)
        raise ManagerUnreachable("cannot reach the gpumgr manager at " + ", ".join(failures))

    def close(self) -> None:
        """Close this thread's kept-alive connection."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn[1].close()
            self._local.conn = None

    def _order(self) -> list[int]:
        count = len(self.targets)
        return [(self.current + step) % count for step in range(count)]

    def _headers(self, extra: dict[str, str]) -> dict[str, str]:
        auth = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return {**auth, **extra}

    @staticmethod
    def _path(target: _Target, path: str, params: Mapping[str, str] | None) -> str:
        return target.prefix + path + (f"?{urllib.parse.urlencode(params)}" if params else "")

    def _exchange(self, target: _Target, method: str, path: str, data: bytes | None, headers: dict[str, str],
                  timeout: float) -> tuple[int, bytes]:
        """Send on this thread's kept-alive connection to ``target`` (a fresh one when the server has closed it
        while idle); a GET that finds it closed only once sent is sent again on a fresh one, a create is not.

        A call made while another is under way on this thread (from a signal handler: ``docker gpu run``
        passes Ctrl-C on while it waits) gets a connection of its own, closed after.
        """
        if getattr(self._local, "busy", False):
            conn = target.connect(timeout)
            try:
                return self._send(conn, method, path, data, headers, timeout)
            finally:
                conn.close()
        self._local.busy = True
        try:
            return self._kept(target, method, path, data, headers, timeout)
        finally:
            self._local.busy = False

    def _kept(self, target: _Target, method: str, path: str, data: bytes | None, headers: dict[str, str],
              timeout: float) -> tuple[int, bytes]:
        kept = getattr(self._local, "conn", None)
        if kept is not None and (kept[0] is not target or _dropped(kept[1])):
            kept[1].close()
            kept = None
        retry = method in IDEMPOTENT  # a create sent on a connection that broke may have been carried out
        for reused in ((True, False) if kept is not None and retry else (kept is not None,)):
            conn = kept[1] if reused and kept is not None else target.connect(timeout)
            self._local.conn = (target, conn)
            try:
                return self._send(conn, method, path, data, headers, timeout)
            except _Broken as exc:
                self._local.conn = None
                if not (reused and exc.stale and retry):
                    raise
            finally:
                if self._local.conn is None or self._local.conn[1].sock is None:
                    conn.close()
                    self._local.conn = None
        raise AssertionError("unreachable")  # pragma: no cover - the loop always returns or raises

    @staticmethod
    def _send(conn: http.client.HTTPConnection, method: str, path: str, data: bytes | None,
              headers: dict[str, str], timeout: float) -> tuple[int, bytes]:
        """One request and its whole answer on ``conn`` (closed when the server ends it, or on failure)."""
        try:
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
            conn.request(method, path, body=data, headers=headers)
            response = conn.getresponse()
            payload = response.read()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise _Broken(exc, sent=True, stale=isinstance(exc, STALE)) from None
        if response.will_close:
            conn.close()
        return response.status, payload


class _Closing:
    """``with`` closes it."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _dropped(conn: http.client.HTTPConnection) -> bool:
    """Whether a kept-alive connection was closed by the server while idle (readable with nothing asked: EOF)."""
    if conn.sock is None:
        return True
    readable, _, _ = select.select([conn.sock], [], [], 0)
    return bool(readable)


class Stream(_Closing):
    """A streamed answer: ``read(n)``, then closed with its connection (``with`` does it)."""

    def __init__(self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse) -> None:
        self._conn, self.response = conn, response

    def read(self, size: int | None = None) -> bytes:
        """Up to ``size`` bytes (None: all that is left)."""
        return self.response.read(size)

    def close(self) -> None:
        """Close the answer and its connection."""
        self.response.close()
        self._conn.close()


class Client(_Closing):
    """The manager's API as objects: ``containers``, ``nodes``, ``events()``.

    ``base_url`` is one URL or several (a list, or one comma-separated string): a call that cannot connect
    to one goes on to the next, and later calls start with the one that answered.
    """

    def __init__(self, base_url: str | Sequence[str] = DEFAULT_URL, token: str | None = None,
                 timeout: float = TIMEOUT) -> None:
        self.api = API(base_url, token, timeout)
        self.containers = ContainerCollection(self)
        self.nodes = NodeCollection(self)

    @classmethod
    def from_env(cls, environment: Mapping[str, str] | None = None, timeout: float = TIMEOUT) -> Client:
        """A client for ``GPUMGR_MANAGER`` (one URL or several, comma-separated; default
        ``http://127.0.0.1:9400``) with the token ``GPUMGR_TOKEN``, as ``docker.from_env()`` reads DOCKER_HOST."""
        env = os.environ if environment is None else environment
        return cls(env.get("GPUMGR_MANAGER") or DEFAULT_URL, env.get("GPUMGR_TOKEN") or None, timeout)

    def health(self) -> dict[str, Any]:
        """``GET /healthz``: ``{"status": "ok", "nodes_ready": N, "token_required": bool}``."""
        return dict(self.api.call("GET", "/healthz"))

    def events(self, since: int | None = None, types: Sequence[str] | None = None, *, follow: bool = True,
               poll: float = EVENTS_POLL, reconnect_timeout: float = RECONNECT_TIMEOUT) -> Iterator[Event]:
        """Events, oldest first: those with an id above ``since`` (None: only from now on; 0: all still kept).

        With ``follow`` it never ends: it looks again every ``poll`` seconds, and when the manager goes
        away (restarted, or failed over to another URL) it keeps trying for up to ``reconnect_timeout``
        seconds and goes on from the last id it gave, so no event is given twice and none is skipped
        (event ids keep rising across a manager's restarts; see the README). Without ``follow`` it ends
        once it has given what is there now.
        """
        from gpumgr.client_types import Event

        params = {"type": ",".join(types)} if types else {}
        last = since
        down_since: float | None = None
        while True:
            try:
                if last is None:
                    last = self._newest_event(params)
                batch = self.api.call("GET", "/v1/events", params={**params, "since": str(last)})["events"]
            except ManagerUnreachable:
                if not follow:
                    raise
                down_since = down_since or time.monotonic()
                if time.monotonic() - down_since > reconnect_timeout:
                    raise
                time.sleep(poll)
                continue
            down_since = None
            for data in batch:
                if data["id"] > last:
                    last = data["id"]
                    yield Event.from_json(data)
            if not follow:
                return
            time.sleep(poll)

    def _newest_event(self, params: dict[str, str]) -> int:
        events = self.api.call("GET", "/v1/events", params=params)["events"]
        return max((int(e["id"]) for e in events), default=0)

    def close(self) -> None:
        """Close the kept-alive connection of this thread."""
        self.api.close()


class ContainerCollection:
    """``client.containers``: run, list, get, resize, wait, kill, read the output of and remove containers.

    Each method that takes ``ref`` accepts a container's id, its name, or a prefix of its id that only it has.
    """

    def __init__(self, client: Client) -> None:
        self.api = client.api

    def run(self, image: str | None = None, command: str | Sequence[str] | None = None, *,
            gpu_memory: int | str, gpus: int = 1, **options: Any) -> Container:
        """Place and start a container (``POST /v1/containers``); its record once it runs.

        ``options`` are the API's other fields, as docker-py names them: ``name``, ``env``, ``labels``,
        ``node``, ``placement``, ``on_overrun``, ``tenant``, ``priority``, ``preemptible``, ``queue``,
        ``queue_timeout``, and how it runs (``mounts``, ``ports``, ``network``, ...). With ``queue=True``
        a request that does not fit now comes back with state ``queued`` and starts as soon as room frees.
        """
        body: dict[str, Any] = {"gpu_memory": gpu_memory, "gpus": gpus, **options}
        if image is not None:
            body["image"] = image
        if command is not None:
            body["command"] = command if isinstance(command, str) else list(command)
        return self._record(self.api.call("POST", "/v1/containers", body=body))

    def list(self, *, state: str | None = None, node: str | None = None, tenant: str | None = None,
             service: str | None = None) -> list[Container]:
        """Every container record the caller may see, oldest first, filtered by what is given."""
        wanted = {"state": state, "node": node, "tenant": tenant, "service": service}
        params = {k: v for k, v in wanted.items() if v is not None}
        return [self._record(r) for r in self.api.call("GET", "/v1/containers", params=params)["containers"]]

    def get(self, ref: str) -> Container:
        """One container record (:class:`~gpumgr.wire.errors.NotFound` if none)."""
        return self._record(self.api.call("GET", f"/v1/containers/{_quote(ref)}"))

    def remove(self, ref: str) -> Container:
        """Stop and remove it, or withdraw it from the queue; its grant is freed. The final record."""
        return self._record(self.api.call("DELETE", f"/v1/containers/{_quote(ref)}"))

    def resize(self, ref: str, gpu_memory: int | str, *, force: bool = False) -> Container:
        """Grow or shrink its grant in place (``force``: even below what it uses now)."""
        body = {"gpu_memory": gpu_memory, **({"force": True} if force else {})}
        return self._record(self.api.call("PATCH", f"/v1/containers/{_quote(ref)}", body=body))

    def wait(self, ref: str, timeout: float | None = None) -> WaitResult:
        """Block until it ends, or ``timeout`` seconds pass (None: no limit; then ``ended`` is False)."""
        from gpumgr.client_types import WaitResult

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            step = defaults.WAIT_MAX if deadline is None else max(0.0, min(defaults.WAIT_MAX,
                                                                           deadline - time.monotonic()))
            end = self.api.call("POST", f"/v1/containers/{_quote(ref)}/wait", params={"timeout": f"{step:.3f}"},
                                timeout=step + self.api.timeout)
            if end["ended"] or (deadline is not None and time.monotonic() >= deadline):
                return WaitResult.from_json(end)

    def kill(self, ref: str, signal: str = "SIGKILL") -> str:
        """Send ``signal`` (a name such as SIGTERM, or a number) to a running container; the signal as sent."""
        return str(self.api.call("POST", f"/v1/containers/{_quote(ref)}/kill", params={"signal": signal})["signal"])

    def logs(self, ref: str, *, tail: int | None = None) -> bytes:
        """Its output so far, stdout and stderr together (``tail``: only the last lines)."""
        with self.api.stream(f"/v1/containers/{_quote(ref)}/logs", _logs_params(False, tail), "text/plain") as out:
            return out.read()

    def stream_logs(self, ref: str, *, follow: bool = True, tail: int | None = None) -> Iterator[tuple[int, bytes]]:
        """Its output piece by piece as ``(stream, data)``: stream 1 is stdout, 2 stderr; with ``follow``
        until the container ends and its last lines are out."""
        with self.api.stream(f"/v1/containers/{_quote(ref)}/logs", _logs_params(follow, tail), MULTIPLEXED) as out:
            yield from read_frames(out)

    def _record(self, data: dict[str, Any]) -> Container:
        from gpumgr.client_types import Container

        return Container.from_json(data, self)


class NodeCollection:
    """``client.nodes``: the machine × GPU map."""

    def __init__(self, client: Client) -> None:
        self.api = client.api

    def list(self) -> list[Node]:
        """Every node with its GPUs."""
        from gpumgr.client_types import Node

        return [Node.from_json(n) for n in self.api.call("GET", "/v1/nodes")["nodes"]]

    def get(self, name: str) -> Node:
        """One node by name (:class:`~gpumgr.wire.errors.NotFound` if the map has none)."""
        for node in self.list():
            if node.name == name:
                return node
        raise NotFound(f"no node named {name!r} on the map")

    def forget(self, name: str) -> None:
        """Forget a node that is down, and its agent's binding (the operator only)."""
        self.api.call("DELETE", f"/v1/nodes/{_quote(name)}")


def read_frames(stream: Stream) -> Iterator[tuple[int, bytes]]:
    """Docker's multiplexed frames from ``stream`` as ``(stream id, data)`` until it ends."""
    while len(header := stream.read(FRAME_HEADER)) == FRAME_HEADER:
        size = int.from_bytes(header[4:], "big")
        yield header[0], stream.read(size)


def _logs_params(follow: bool, tail: int | None) -> dict[str, str]:
    return {"follow": "1" if follow else "0", "tail": "all" if tail is None else str(tail)}


def _quote(ref: str) -> str:
    return urllib.parse.quote(ref, safe="")


__all__ = ["API", "APIError", "Client", "ContainerCollection", "ManagerUnreachable", "NeverFits", "NodeCollection",
           "Unauthorized", "api_error"]
