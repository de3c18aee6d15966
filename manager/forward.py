"""Any manager answers: a REST call to a manager that does not lead goes to the leader's API.

As Swarm and Nomad do, a follower forwards each ``/v1/...`` call to the leader's advertised API
(``--advertise-api``, published in the leader key) and hands back its answer as is. While no manager
leads (one died and its lease has not run out yet, or an election is under way) the call is held for
:data:`HOLD` seconds, then answered 503 ``no_leader`` with ``Retry-After``; when the store itself is
unreachable (etcd lost its quorum) the answer is 503 ``no_quorum``. A call the leader got but did not
answer (it died meanwhile) is never sent twice: it may have been placed, so the caller is told 502 and
decides. ``/healthz``, ``/metrics``, ``/openapi.json`` and the dashboard's files are served by every
manager itself; ``/healthz`` says who leads and whether this manager's tenants match the leader's.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import requests
from flask import Response, request, stream_with_context

from gpumgr import __version__
from gpumgr.manager.control.ha import Solo
from gpumgr.manager.control.leadership import LEASE_TTL
from gpumgr.manager.leading import NoLeader, NoQuorum
from gpumgr.wire import defaults
from gpumgr.wire.errors import OutcomeUnknown

if TYPE_CHECKING:
    from gpumgr.manager.parts import ManagerParts

log = logging.getLogger(__name__)

#: How long a call waits for a leader before 503 ``no_leader``: a killed leader's lease runs out within
#: its TTL, and the next leader is elected a poll later.
HOLD = LEASE_TTL + 2.0
#: What a caller is told to wait before trying again.
RETRY_AFTER = 1
#: Marks a call one manager forwarded to another: it is never forwarded again (no loops).
FORWARDED = "X-Gpumgr-Forwarded"
#: Request headers that travel to the leader (the leader checks the token itself).
PASSED = ("Authorization", "Content-Type", "Accept", "If-None-Match", "User-Agent", "Idempotency-Key")
#: Answer headers that travel back.
RETURNED = ("Content-Type", "ETag", "Retry-After", "Location", "WWW-Authenticate", "Cache-Control",
            "Idempotent-Replayed")
POLL = 0.05
_local = threading.local()


def front(manager: ManagerParts) -> Response | None:
    """Before a ``/v1/...`` call: None to serve it here (this manager leads), else the leader's answer."""
    plane = manager.plane
    if isinstance(plane, Solo) or not request.path.startswith("/v1/"):
        return None
    deadline = time.monotonic() + HOLD
    while True:
        if plane.is_leader:
            manager.leading.wait(max(0.0, deadline - time.monotonic()))
            return None
        leader = plane.leader()
        if leader and leader.get("api") and not request.headers.get(FORWARDED):
            answer = _forward(str(leader["api"]))
            if answer is not None:
                return answer
        if time.monotonic() >= deadline:
            break
        time.sleep(POLL)
    if plane.store_unreachable:
        raise NoQuorum("the store (etcd) cannot be reached or has lost its quorum: nothing can be placed until "
                       "enough etcd members are back; running containers are not affected")
    raise NoLeader(f"no manager leads right now (an election is under way); retry in {RETRY_AFTER}s")


def _forward(api: str) -> Response | None:
    """The leader's answer to this call; None if the leader could not be reached (nothing was sent)."""
    headers = {h: request.headers[h] for h in PASSED if h in request.headers}
    headers[FORWARDED] = "1"
    headers["Accept-Encoding"] = "identity"
    try:
        answer = _session().request(request.method, api.rstrip("/") + request.full_path.rstrip("?"),
                                    data=request.get_data(), headers=headers, stream=True,
                                    timeout=(1.0, defaults.CLI_TIMEOUT))
    except requests.ConnectionError as exc:
        if _never_sent(exc):
            log.info("the leader's API at %s is not reachable (%s); waiting for a leader", api, exc)
            return None
        raise OutcomeUnknown(f"the call was forwarded to the leader at {api}, which went away before answering; "
                             "it may have been carried out: look before sending it again") from exc
    except requests.RequestException as exc:
        raise OutcomeUnknown(f"the call was forwarded to the leader at {api}, which did not answer ({exc}); it may "
                             "have been carried out: look before sending it again") from exc
    response = Response(stream_with_context(_body(answer)), status=answer.status_code)
    for name in RETURNED:
        if name in answer.headers:
            response.headers[name] = answer.headers[name]
    return response


def _session() -> requests.Session:
    """This REST thread's own keep-alive session to the leader (a session is not shared between threads)."""
    session: requests.Session | None = getattr(_local, "session", None)
    if session is None:
        session = _local.session = requests.Session()
    return session


def _body(answer: requests.Response) -> Iterator[bytes]:
    try:
        yield from answer.iter_content(64 * 1024)
    finally:
        answer.close()


def _never_sent(exc: requests.ConnectionError) -> bool:
    """Whether the connection was refused or never opened, so the leader saw nothing of the call."""
    cause: BaseException | None = exc
    while cause is not None:
        name = type(cause).__name__
        if name in ("NewConnectionError", "ConnectTimeoutError", "ConnectionRefusedError"):
            return True
        cause = cause.args[0] if cause.args and isinstance(cause.args[0], BaseException) else \
            getattr(cause, "reason", None) if isinstance(getattr(cause, "reason", None), BaseException) else None
    return isinstance(exc, requests.ConnectTimeout)


def tenants_digest(manager: ManagerParts) -> str:
    """A short digest of this manager's tenants, accounts, tokens and policy: every manager of a plane must agree.

    ``/healthz`` is open, and the settings hold tokens: the digest is an HMAC keyed by the managers'
    shared CURVE secret key, so it says "same or not" to anyone and lets no one test guesses of a token.
    """
    settings = manager.settings
    data = {"token": settings.token, "policy": settings.policy.model_dump(mode="json"),
            "tenants": {name: config.model_dump(mode="json") for name, config in sorted(settings.tenants.items())},
            **({"accounts": {name: c.model_dump(mode="json") for name, c in sorted(settings.accounts.items())}}
               if settings.accounts else {})}
    body = json.dumps(data, sort_keys=True, default=str).encode()
    return hmac.new(manager.admission.keys.secret.encode(), body, hashlib.sha256).hexdigest()[:16]


#: Seconds between a follower's checks that its tenants and tokens match the leader's.
DIGEST_EVERY = 10.0
#: While they differ, the error is repeated this often (and at once when the leader or either digest changes).
DIGEST_REPEAT = 300.0


class DigestWatch:
    """A follower compares its tenants' digest with the leader's every :data:`DIGEST_EVERY` seconds and
    logs an error while they differ, without waiting for anyone to read ``/healthz``.

    Tenants and tokens live in each manager's YAML, not in the store: a manager left with an old file
    (a token rotated everywhere but there) would forward calls with tokens the leader no longer takes,
    or accept ones it refuses. Nothing is changed automatically: the operator fixes the file and sends
    SIGHUP, and the watch says so once they agree again.
    """

    def __init__(self, manager: ManagerParts, every: float | None = None) -> None:
        self.manager = manager
        self.every = DIGEST_EVERY if every is None else every
        #: the last mismatch logged as (leader API, ours, theirs), or None while they agree
        self.mismatch: tuple[str, str, str] | None = None
        self._logged_at = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="digest-watch", daemon=True)

    def start(self) -> None:
        """Check in the background until :meth:`stop`."""
        self._thread.start()

    def stop(self) -> None:
        """Stop checking."""
        self._stop.set()

    def check(self) -> tuple[str, str, str] | None:
        """Compare once now; returns (leader API, ours, theirs) while they differ, else None."""
        plane = self.manager.plane
        leader = None if isinstance(plane, Solo) or plane.is_leader else plane.leader()
        api = str(leader.get("api") or "") if leader else ""
        theirs = _leader_digest(api) if api else None
        if theirs is None:  # this manager leads, none does, or the leader did not answer: nothing to compare
            return self.mismatch
        ours = tenants_digest(self.manager)
        found = (api, ours, theirs) if theirs != ours else None
        now = time.monotonic()
        if found is not None and (found != self.mismatch or now - self._logged_at >= DIGEST_REPEAT):
            log.error("this manager's tenants and tokens (digest %s) differ from the leader's at %s (%s): give "
                      "every manager the same tenants and tokens in its YAML and send it SIGHUP", ours, api, theirs)
            self._logged_at = now
        elif found is None and self.mismatch is not None:
            log.warning("this manager's tenants and tokens match the leader's again (digest %s)", ours)
        self.mismatch = found
        return found

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.check()
            except Exception:  # a failed check must never stop the next
                log.exception("comparing tenants with the leader failed; trying again")


def health(manager: ManagerParts) -> dict[str, Any]:
    """``/healthz``'s fields about the control plane: role, leader, epoch, version, the tenants' digest."""
    plane = manager.plane
    digest = tenants_digest(manager)
    info: dict[str, Any] = {"version": __version__, "tenants_digest": digest}
    if isinstance(plane, Solo):
        return {**info, "role": "leader", "leader": None, "epoch": None, "store": "dir"}
    leader = plane.leader()
    epoch = plane.epoch
    info.update(role="leader" if plane.is_leader else "follower", leader=leader.get("api") if leader else None,
                epoch=str(epoch) if epoch is not None else None, store="etcd",
                store_reachable=not plane.store_unreachable)
    if not plane.is_leader and leader and leader.get("api"):
        theirs = _leader_digest(str(leader["api"]))
        if theirs is not None and theirs != digest:
            info["warning"] = (f"this manager's tenants and tokens (digest {digest}) differ from the leader's "
                               f"({theirs}): give every manager the same tenants in its YAML")
            log.error("%s", info["warning"])
    return info


def _leader_digest(api: str) -> str | None:
    try:
        answer = requests.get(api.rstrip("/") + "/healthz", headers={FORWARDED: "1"}, timeout=1.0)
        found = answer.json().get("tenants_digest")
        return str(found) if found else None
    except (requests.RequestException, ValueError, AttributeError):
        return None
