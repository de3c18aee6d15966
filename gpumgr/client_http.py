"""The transport under :mod:`gpumgr.client`: one REST call over ``http.client``, errors as exceptions.

:class:`API` makes one call to the first of several manager URLs that answers (a call that cannot
connect goes on to the next; one that broke after it was sent is sent again only when its method is
idempotent), keeps one connection alive per thread, and turns an error answer into the exception
for its ``code``: the classes of :mod:`gpumgr.wire.errors`, carrying the API's ``code`` and HTTP
``status``. The standard library only, because ``docker gpu`` runs on it and must start fast.
"""

from __future__ import annotations

import http.client
import json
import select
import threading
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any, Self

from gpumgr.wire import defaults
from gpumgr.wire.errors import (
    AgentFailed,
    AgentTimeout,
    Conflict,
    Forbidden,
    GpuConflict,
    GpumgrError,
    IdempotencyMismatch,
    InProgress,
    InvalidRequest,
    NoAgents,
    NoFit,
    NotFound,
    OutcomeUnknown,
    PolicyDenied,
    QuotaExceeded,
)

DEFAULT_URL = "http://127.0.0.1:9400"
#: Seconds a call waits for its answer (a create waits for its node: the CLI's own bound).
TIMEOUT = defaults.CLI_TIMEOUT
#: Methods that may be sent again (to the same or the next URL) when a connection broke after sending.
IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE"})
#: A request header that makes a POST safe to send again (the manager runs it at most once per key).
KEY_HEADER = "Idempotency-Key"
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
                              GpuConflict, NoAgents, AgentFailed, AgentTimeout, PolicyDenied, Unauthorized,
                              OutcomeUnknown, InProgress, IdempotencyMismatch)}
#: By status, when the code is not one of ours: a 502 whose code is not ``agent_failed`` (a proxy's Bad Gateway)
#: says nothing about whether the request was carried out.
ERRORS_BY_STATUS: dict[int, type[GpumgrError]] = {400: InvalidRequest, 401: Unauthorized, 403: Forbidden,
                                                  404: NotFound, 409: Conflict, 422: InvalidRequest,
                                                  502: OutcomeUnknown, 503: NoAgents, 504: AgentTimeout}


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
             timeout: float | None = None, headers: Mapping[str, str] | None = None) -> Any:
        """One call; its JSON answer. Goes on to the next URL when one cannot be connected to.

        A POST with an ``Idempotency-Key`` in ``headers`` is sent again, as a GET is, when its connection broke.
        """
        data = None if body is None else json.dumps(body).encode()
        headers = self._headers({**({"Content-Type": "application/json"} if data is not None else {}),
                                 **(headers or {})})
        failures: list[str] = []
        for index in self._order():
            target = self.targets[index]
            try:
                status, payload = self._exchange(target, method, self._path(target, path, params), data, headers,
                                                 timeout or self.timeout)
            except _Broken as exc:
                failures.append(f"{target.url} ({exc})")
                if exc.sent and not _resendable(method, headers):
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
        retry = _resendable(method, headers)  # a create sent on a connection that broke may have been carried out
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


def _resendable(method: str, headers: Mapping[str, str]) -> bool:
    """Whether a call whose connection broke after sending may be sent again: the manager runs it at most once."""
    return method in IDEMPOTENT or KEY_HEADER in headers


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
