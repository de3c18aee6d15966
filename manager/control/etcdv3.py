"""A small etcd v3 client over etcd's JSON gateway (``/v3/...``), with failover across endpoints.

Why not a library: ``etcd3`` is unmaintained and fails to import with protobuf 4+; ``etcd3gw`` and
``aetcd`` work but each talks to one endpoint, and failover is the one thing a manager in front of
every GPU needs from its store client. What gpumgr uses is small (range, transaction, lease grant,
keep-alive, revoke, status), so this module speaks it over ``requests`` the way Patroni's etcd3
module does.

Gateway facts this module absorbs: keys and values travel base64-encoded; int64 fields arrive as
strings; fields that are false or zero are left out (a failed transaction has no ``succeeded``, a
lease that is gone answers a keep-alive without a ``TTL``).

Failover: the client sticks to the endpoint that last answered. A refused or timed-out connection,
or an answer that says the member cannot serve (no leader, not ready: HTTP 5xx), moves it to the next
endpoint; rounds over every endpoint go on for :data:`RETRY_FOR` seconds (etcd's own leader election),
then the call raises :class:`StoreUnavailable`. An answer that
is the store's own refusal (a lease not found, a bad request) is raised as :class:`EtcdError` at once.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import requests

from gpumgr.wire import errors
from gpumgr.wire.errors import GpumgrError

log = logging.getLogger(__name__)

#: Seconds one gateway call may take before the next endpoint is tried.
REQUEST_TIMEOUT = 1.0
#: A call goes on trying the endpoints in turn this long: etcd elects a new leader of its own in about a
#: second (its default election timeout), during which every member answers "no leader".
RETRY_FOR = 2.0
RETRY_PAUSE = 0.1
#: etcd's default ``--max-txn-ops``: the most operations one transaction may hold.
MAX_TXN_OPS = 128


class EtcdError(GpumgrError):
    """etcd refused a request (the message carries etcd's own words); retrying as is will not help."""

    code = "store_error"
    status = 500


class StoreUnavailable(EtcdError, errors.StoreUnavailable):
    """No etcd endpoint answered (down, partitioned or without quorum); retry once the store is back."""

    code = "store_unavailable"
    status = 503


class StoreTooLarge(EtcdError):
    """etcd refused a write as larger than its ``--max-request-bytes``: the caller's request was too large."""

    code = "too_large"
    status = 413


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd returns it: decoded bytes and the revisions that fence writes."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int = 0


@dataclass
class TxnResult:
    """A transaction's outcome: whether its compares held, the revision it ran at, and its answers."""

    succeeded: bool
    revision: int
    cluster_id: str
    responses: list[dict[str, Any]] = field(default_factory=list)

    def ranges(self) -> list[list[KeyValue]]:
        """The key-values of each range operation among the answers, in order."""
        return [_kvs(r["response_range"]) for r in self.responses if "response_range" in r]


def b64(data: bytes | str) -> str:
    """``data`` as the gateway carries it."""
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode("ascii")


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key starting with ``prefix`` (etcd's ``range_end`` for a prefix)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


def parse_endpoints(text: str) -> list[str]:
    """``host:port,host:port`` (or full ``http(s)://`` URLs) as base URLs; raises ValueError when malformed."""
    endpoints = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            raise ValueError(f"empty etcd endpoint in {text!r}")
        url = item if "://" in item else f"http://{item}"
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
            raise ValueError(f"etcd endpoint {item!r} is not host:port or http(s)://host:port")
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"etcd endpoint {item!r} has a bad port") from exc
        if port is None:
            raise ValueError(f"etcd endpoint {item!r} names no port (etcd's client port is usually 2379)")
        endpoints.append(f"{parts.scheme}://{parts.netloc}")
    return endpoints


class EtcdClient:
    """Calls etcd's JSON gateway on ``endpoints`` in turn; thread-safe (one ``requests`` session per thread)."""

    def __init__(self, endpoints: list[str], *, timeout: float = REQUEST_TIMEOUT, retry_for: float = RETRY_FOR,
                 ca: str | None = None, cert: tuple[str, str] | None = None) -> None:
        if not endpoints:
            raise ValueError("an etcd client needs at least one endpoint")
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.retry_for = retry_for
        self._verify: str | bool = ca if ca else True
        self._cert = cert
        self._current = 0
        self._local = threading.local()

    @property
    def current(self) -> str:
        """The endpoint the next call goes to first (the one that last answered)."""
        return self.endpoints[self._current]

    # --- key-value ---------------------------------------------------------------------------
    def get(self, key: bytes) -> KeyValue | None:
        """The key's current value and revisions, or None when absent."""
        found = _kvs(self.call("/v3/kv/range", {"key": b64(key)}))
        return found[0] if found else None

    def get_prefix(self, prefix: bytes) -> list[KeyValue]:
        """Every key under ``prefix``, in key order."""
        return _kvs(self.call("/v3/kv/range", {"key": b64(prefix), "range_end": b64(prefix_end(prefix))}))

    def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
            failure: list[dict[str, Any]] | None = None) -> TxnResult:
        """One transaction; raises EtcdError when it has more operations than etcd takes in one."""
        if len(success) > MAX_TXN_OPS or len(failure or []) > MAX_TXN_OPS:
            raise EtcdError(f"a transaction may hold at most {MAX_TXN_OPS} operations")
        answer = self.call("/v3/kv/txn", {"compare": compare, "success": success, "failure": failure or []})
        header = answer.get("header", {})
        return TxnResult(bool(answer.get("succeeded", False)), int(header.get("revision", 0)),
                         str(header.get("cluster_id", "")), list(answer.get("responses", [])))

    # --- leases ------------------------------------------------------------------------------
    def lease_grant(self, ttl: int) -> tuple[int, int]:
        """A new lease: ``(id, ttl granted)``."""
        answer = self.call("/v3/lease/grant", {"TTL": ttl})
        if answer.get("error"):
            raise EtcdError(f"etcd granted no lease: {answer['error']}")
        return int(answer["ID"]), int(answer.get("TTL", 0))

    def lease_keepalive(self, lease: int) -> int:
        """Renew ``lease``; the TTL it has now, 0 when it is gone (expired or revoked)."""
        answer = self.call("/v3/lease/keepalive", {"ID": lease})
        return int(answer.get("result", {}).get("TTL", 0))

    def lease_revoke(self, lease: int) -> None:
        """End ``lease`` now, deleting its keys; a lease already gone is not an error."""
        try:
            self.call("/v3/lease/revoke", {"ID": lease})
        except EtcdError as exc:
            if "not found" not in exc.message:
                raise

    def status(self) -> dict[str, Any]:
        """The answering member's status (version, leader, raft term)."""
        return self.call("/v3/maintenance/status", {})

    # --- transport ---------------------------------------------------------------------------
    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``path`` on the current endpoint, moving on to the next while one fails.

        Every endpoint is tried at least once, and the round is repeated until :data:`RETRY_FOR` seconds
        have passed, so the second or so etcd needs to elect a new leader of its own is ridden out.
        """
        failures: list[str] = []
        deadline = time.monotonic() + self.retry_for
        while True:
            answer = self._round(path, body, failures)
            if answer is not None:
                return answer
            if time.monotonic() >= deadline:
                raise StoreUnavailable("no etcd endpoint answered: " + "; ".join(failures[-len(self.endpoints):]))
            time.sleep(RETRY_PAUSE)

    def _round(self, path: str, body: dict[str, Any], failures: list[str]) -> dict[str, Any] | None:
        """Try each endpoint once, from the current one; the first answer, or None (``failures`` says why)."""
        for _ in range(len(self.endpoints)):
            index = self._current
            endpoint = self.endpoints[index]
            try:
                return self._post(endpoint, path, body)
            except StoreUnavailable as exc:
                failures.append(f"{endpoint}: {exc.message}")
                if self._current == index:
                    self._current = (index + 1) % len(self.endpoints)
                log.info("etcd endpoint %s failed (%s); trying the next", endpoint, exc.message)
        return None

    def _post(self, endpoint: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = self._session().post(endpoint + path, json=body, timeout=self.timeout, verify=self._verify,
                                            cert=self._cert)
        except requests.RequestException as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from exc
        try:
            answer = response.json()
        except ValueError:
            answer = {}
        if not isinstance(answer, dict):
            answer = {}
        if response.status_code >= 500 or answer.get("code") == 14:  # 14: gRPC UNAVAILABLE (no leader)
            raise StoreUnavailable(f"HTTP {response.status_code}: {answer.get('error') or response.text[:200]}")
        if response.status_code >= 400 or ("error" in answer and "code" in answer):
            error = str(answer.get("error") or response.text[:200])
            if "request is too large" in error:  # the caller's request, whole, exceeds etcd's --max-request-bytes
                raise StoreTooLarge(f"the request is too large for the store (etcd: {error}); send a smaller one")
            raise EtcdError(f"etcd refused {path}: {error}")
        return answer

    def _session(self) -> requests.Session:
        session: requests.Session | None = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            self._local.session = session
        return session


def _kvs(answer: dict[str, Any]) -> list[KeyValue]:
    return [KeyValue(base64.b64decode(kv["key"]), base64.b64decode(kv.get("value", "")),
                     int(kv.get("create_revision", 0)), int(kv.get("mod_revision", 0)), int(kv.get("lease", 0)))
            for kv in answer.get("kvs", [])]


# --- transaction parts -----------------------------------------------------------------------
def created_at(key: bytes, revision: int) -> dict[str, Any]:
    """Compare: ``key`` was created at ``revision`` (0: ``key`` is absent)."""
    return {"key": b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": revision}


def modified_at(key: bytes, revision: int) -> dict[str, Any]:
    """Compare: ``key`` was last written at ``revision`` (0: ``key`` is absent)."""
    return {"key": b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": revision}


def holds(key: bytes, value: bytes) -> dict[str, Any]:
    """Compare: ``key`` holds exactly ``value``."""
    return {"key": b64(key), "target": "VALUE", "result": "EQUAL", "value": b64(value)}


def put(key: bytes, value: bytes, lease: int = 0) -> dict[str, Any]:
    """Operation: write ``value`` to ``key`` (bound to ``lease`` when given)."""
    request: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease:
        request["lease"] = lease
    return {"request_put": request}


def delete(key: bytes) -> dict[str, Any]:
    """Operation: delete ``key``."""
    return {"request_delete_range": {"key": b64(key)}}


def read(key: bytes) -> dict[str, Any]:
    """Operation: read ``key``."""
    return {"request_range": {"key": b64(key)}}
