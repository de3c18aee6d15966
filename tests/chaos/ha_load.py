"""Keyed load for the HA chaos schedules, the record of what each client was told, and the checks against it.

:class:`KeyedLoad` runs client threads that POST (some with ``"queue": true``), DELETE and PATCH through
*any* manager (a follower forwards to the leader), as a careful client would:

- every POST carries an ``Idempotency-Key`` header and the same key in the label ``chaos.key`` (and the
  run's name in ``chaos.run``), and is resent with that key, to any manager, after a connection error,
  502 ``outcome_unknown`` or 409 ``in_progress``, for at most :data:`RESEND_FOR` seconds;
- a DELETE is resent the same way until it is answered 200, 202 or 404 (then the client takes the container
  as gone, and so must the engine); a PATCH is sent once.

:class:`Told` keeps, per key and per record, what the clients were finally told, and :func:`problems`
compares it with the engine's containers (found by their ``chaos.key`` label, so nothing here depends on
how the manager implements the key) and with the leader's records:

- no key ever had more than one container (:class:`KeyWatch` counts every create the engine reports for
  the run, so a duplicate removed again is still caught);
- a 201 runs, or, if its DELETE was answered 200/202, is removed from the engine (not only stopped) within
  :data:`GONE_WITHIN` of the heal;
- a 202 queued request runs, is still queued with no container, or ended with a reason;
- a POST only ever refused (never answered ``outcome_unknown`` nor left unanswered) never ran;
- a PATCH answered 200 is the record's figure, and the agent confirmed it (held = granted).
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import requests

from tests.chaos.harness import History, Load

GiB = 1 << 30
KEY_LABEL = "chaos.key"
RUN_LABEL = "chaos.run"
#: a keyed POST (or a DELETE) is resent for at most this long while its outcome is unknown
RESEND_FOR = 20.0
#: pauses between resends (doubling)
BACKOFF, BACKOFF_MAX = 0.3, 2.0
#: one call's own timeout: a stopped manager holds the connection open
CALL_TIMEOUT = 15.0
#: every container whose DELETE was answered 200/202 is gone from the engine this long after the heal
GONE_WITHIN = 10.0
#: a container that ends at once on SIGTERM (a shell as PID 1 ignores the signals it has no trap for)
COMMAND = ["sh", "-c", "trap 'exit 0' TERM; sleep 3600 & wait"]
SIZES = (2 * GiB, 4 * GiB)
#: 5xx codes that say the request was not carried out (nobody leads, no quorum, the store refused, ...)
REFUSALS = frozenset({"no_quorum", "not_leader", "no_leader", "store_unavailable", "no_agents", "agent_failed",
                      "not_known_yet",
                      "fenced"})
LIVE = {"creating", "running"}
ENDED = {"exited", "killed", "failed", "removed", "expired", "preempted"}


def unknown(status: int, code: str) -> bool:
    """Whether an answer leaves the outcome unknown: none at all, ``outcome_unknown`` (or the old
    ``agent_timeout``), or ``in_progress`` (the first send is still being carried out)."""
    return status == 0 or code in ("outcome_unknown", "agent_timeout", "in_progress")


@dataclass
class Post:
    """One keyed POST, every send of it, and what it finally was: ``created`` (201), ``queued`` (202),
    ``unknown`` (some send got no answer or ``outcome_unknown``, and no later one said) or ``refused``."""

    key: str
    queue: bool
    sends: list[tuple[str, int, str]] = field(default_factory=list)  # (manager, status, code)
    id: str | None = None
    verdict: str = "unknown"
    #: the record's state in the answer that gave the verdict (201 or 202)
    state: str = ""

    def __str__(self) -> str:
        answers = ", ".join(f"{s or 'nothing'} {c}".strip() + f" via {m}" for m, s, c in self.sends)
        said = f" (the answer's record: {self.state})" if self.state else ""
        return f"POST key {self.key[:8]}{' (queue)' if self.queue else ''}: {answers}{said}"


@dataclass
class Told:
    """What the clients were told, per key and per record id."""

    posts: dict[str, Post] = field(default_factory=dict)
    #: record id → when its DELETE was answered 200/202
    deleted: dict[str, float] = field(default_factory=dict)
    #: record ids (answered 201 or 202) whose DELETE was answered 404: the client takes them as gone
    not_found: set[str] = field(default_factory=set)
    #: record ids whose DELETE got no definite answer: they may run or not
    doubtful: set[str] = field(default_factory=set)
    #: record id → the figure its last PATCH answered 200 set, or None after a PATCH with no definite answer
    patched: dict[str, int | None] = field(default_factory=dict)
    answers: Counter[str] = field(default_factory=Counter)
    #: answers no call may ever get (a 500, a 504): what was asked and what came back
    odd: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def by_id(self) -> dict[str, Post]:
        return {p.id: p for p in self.posts.values() if p.id}


def code_of(answer: requests.Response) -> str:
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
        return str(answer.json()["error"]["code"])
    return ""


class KeyedLoad(Load):
    """``clients`` threads keeping between ``low`` and ``high`` of the run's requests alive, through the
    managers ``urls()`` names (any of them, each call drawn at random). Its threads start and stop as the
    network harness's :class:`~tests.chaos.harness.Load` (a client finishes its resends before it stops)."""

    def __init__(self, urls: Callable[[], Sequence[str]], image: str, run: str, told: Told, seed: int, *,
                 clients: int = 4, pause: float = 0.05, low: int = 2, high: int = 5, queue_share: float = 0.3) -> None:
        super().__init__("", [], image, History(), seed, clients=clients, pause=pause, low=low, high=high)
        self.urls, self.run, self.told, self.queue_share = urls, run, told, queue_share
        self._pool: list[str] = []  # ids no client works on now
        self._live = 0
        self._lock = threading.Lock()

    def _client(self, index: int) -> None:
        rng = random.Random(f"{self.seed}/{self.run}/client/{index}")
        with requests.Session() as session:
            while not self._stop.is_set():
                with self._lock:
                    method = "POST" if self._live < self.low else "DELETE" if self._live >= self.high else \
                        rng.choice(("POST", "DELETE", "PATCH"))
                    cid = None
                    if method == "POST":
                        self._live += 1
                    elif self._pool:
                        cid = self._pool.pop(rng.randrange(len(self._pool)))
                if method == "POST":
                    self._post(session, rng)
                elif cid is not None:
                    (self._delete if method == "DELETE" else self._patch)(session, rng, cid)
                self._stop.wait(rng.expovariate(1 / self.pause))

    def _send(self, session: requests.Session, rng: random.Random, method: str, path: str,
              **kw: Any) -> tuple[str, int, str, dict[str, Any]]:
        """One call to a manager drawn at random: (its URL, status (0: no answer), error code, JSON body)."""
        url = rng.choice(list(self.urls()))
        try:
            answer = session.request(method, url + path, timeout=CALL_TIMEOUT, **kw)
        except requests.RequestException:
            self._count(method, 0, "", "")
            return url, 0, "", {}
        code = code_of(answer) if answer.status_code >= 300 else ""
        self._count(method, answer.status_code, code, answer.text[:300])
        body = answer.json() if answer.status_code < 300 else {}
        return url, answer.status_code, code, body

    def _count(self, method: str, status: int, code: str, text: str) -> None:
        with self.told.lock:
            self.told.answers[f"{method} {status or 'none'}{' ' + code if code else ''}"] += 1
            if status >= 500 and code not in REFUSALS | {"outcome_unknown"}:
                self.told.odd.append(f"{method} answered {status}: {text}")

    def _post(self, session: requests.Session, rng: random.Random) -> None:
        key, queue = str(uuid.uuid4()), rng.random() < self.queue_share
        body = {"image": self.image, "gpu_memory": str(rng.choice(SIZES)), "command": COMMAND, "queue": queue,
                "labels": {KEY_LABEL: key, RUN_LABEL: self.run}}
        post = Post(key, queue)
        with self.told.lock:
            self.told.posts[key] = post
        deadline, pause, vague = time.monotonic() + RESEND_FOR, BACKOFF, False
        while True:
            url, status, code, answer = self._send(session, rng, "POST", "/v1/containers", json=body,
                                                   headers={"Idempotency-Key": key})
            post.sends.append((url.rsplit(":", 1)[1], status, code))
            if not unknown(status, code):
                break
            vague = True
            if time.monotonic() + pause > deadline:
                break
            time.sleep(pause * (1 + rng.random() / 2))
            pause = min(2 * pause, BACKOFF_MAX)
        with self.told.lock, self._lock:
            if status in (201, 202):
                post.id, post.verdict = answer["id"], "created" if status == 201 else "queued"
                post.state = str(answer.get("state", ""))
                self._pool.append(post.id)
            else:
                post.verdict = "unknown" if vague or unknown(status, code) else "refused"
                self._live -= 1

    def _delete(self, session: requests.Session, rng: random.Random, cid: str) -> None:
        deadline, pause = time.monotonic() + RESEND_FOR, BACKOFF
        while True:
            _, status, _code, _ = self._send(session, rng, "DELETE", f"/v1/containers/{cid}")
            if status in (200, 202, 404) or (status and status < 500) or time.monotonic() + pause > deadline:
                break
            time.sleep(pause)
            pause = min(2 * pause, BACKOFF_MAX)
        with self.told.lock, self._lock:
            if status in (200, 202, 404):  # 404: told there is no such container, so it must not run
                self.told.deleted[cid] = time.monotonic()
                self.told.doubtful.discard(cid)
                if status == 404:
                    self.told.not_found.add(cid)
                self._live -= 1
            elif status == 0 or status >= 500:
                self.told.doubtful.add(cid)  # it may be gone or not: no longer the load's
                self._live -= 1
            else:
                self._pool.append(cid)  # refused (409 mid-operation): still the load's

    def _patch(self, session: requests.Session, rng: random.Random, cid: str) -> None:
        post = self.told.by_id().get(cid)
        if post is None or post.verdict != "created":  # only what was placed at once: a queued one may not run
            with self._lock:
                self._pool.append(cid)
            return
        size = rng.choice(SIZES)
        _, status, _code, answer = self._send(session, rng, "PATCH", f"/v1/containers/{cid}",
                                             json={"gpu_memory": str(size)})
        with self.told.lock, self._lock:
            if status == 200:
                self.told.patched[cid] = int(answer["gpu_memory"])
            elif status == 0 or status >= 500:
                self.told.patched[cid] = None
            self._pool.append(cid)


class KeyWatch:
    """Counts, per ``chaos.key``, every container the engine creates and starts for the run ``run`` (its event
    stream): ``made`` and ``started``."""

    def __init__(self, docker_client: Any, run: str) -> None:
        self.made: Counter[str] = Counter()
        self.started: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stream = docker_client.events(decode=True, filters={
            "type": "container", "event": ["create", "start"], "label": f"{RUN_LABEL}={run}"})
        self._thread = threading.Thread(target=self._read, name=f"key-watch-{run}", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with contextlib.suppress(Exception):  # the stream ends when closed
            for event in self._stream:
                key = (event.get("Actor") or {}).get("Attributes", {}).get(KEY_LABEL)
                if key:
                    with self._lock:
                        (self.made if event.get("status", event.get("Action")) == "create" else self.started)[key] += 1

    def counts(self) -> tuple[Counter[str], Counter[str]]:
        """(made, started) per key, so far."""
        with self._lock:
            return Counter(self.made), Counter(self.started)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._stream.close()


def problems(told: Told, records: list[dict[str, Any]], engine: list[dict[str, Any]],
             counts: tuple[Counter[str], Counter[str]], healed: float, late: set[str]) -> list[str]:
    """Every way the engine's containers and the leader's ``records`` of the run differ from what the clients
    were told (see the module docstring); ``late`` collects DELETE'd containers seen past their bound."""
    now = time.monotonic()
    with told.lock:
        posts, deleted = list(told.posts.values()), dict(told.deleted)
        doubtful, patched, not_found = set(told.doubtful), dict(told.patched), set(told.not_found)
        found: list[str] = []
    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for container in engine:
        by_key[(container.get("Labels") or {}).get(KEY_LABEL, "")].append(container)
    record_of, (made, started) = {r["id"]: r for r in records}, counts
    for post in posts:
        ran, mine = made[post.key], by_key.get(post.key, [])
        running = [c for c in mine if c["State"] == "running"]
        if ran > 1 or len(mine) > 1:
            found.append(f"{post} ran {max(ran, len(mine))} times under one key")
        if post.verdict == "refused":
            if started[post.key] or running:
                found.append(f"{post} was refused, yet its container was started {started[post.key]} time(s) "
                             f"(made {ran}; now {[c['State'] for c in mine] or 'gone'})")
            continue
        if post.id is None or post.id in doubtful:
            continue
        record = record_of.get(post.id)
        state = record["state"] if record else "no record"
        if post.id in deleted:
            if mine and now > max(deleted[post.id], healed) + GONE_WITHIN:
                late.add(post.id)
            if mine:
                how = "answered 404 to its DELETE" if post.id in not_found else "DELETE'd"
                found.append(f"{post}: {how} {post.id}, still on the engine ({mine[0]['State']}; record {state})")
            elif state in LIVE or state == "queued":
                found.append(f"{post}: DELETE'd {post.id} is gone from the engine, its record is {state}")
        elif post.verdict == "created" and (len(running) != 1 or state != "running"):
            found.append(f"{post}: 201 {post.id}, never DELETE'd: {len(running)} running on the engine "
                         f"({ran} ever made), record {state} ({(record or {}).get('reason')})")
        elif post.verdict == "queued":
            if state == "queued" and mine:
                found.append(f"{post}: 202 {post.id} is queued, yet has a container ({mine[0]['State']})")
            elif state == "running" and len(running) != 1:
                found.append(f"{post}: 202 {post.id} is running, with {len(running)} running on the engine")
            elif state in ENDED and (running or not record or not record.get("reason")):
                found.append(f"{post}: 202 {post.id} ended ({state}, reason {(record or {}).get('reason')}), "
                             f"{len(running)} running on the engine")
            elif state not in ("queued", "running", "creating") and state not in ENDED:
                found.append(f"{post}: 202 {post.id} is {state}")
    for cid, figure in patched.items():
        record = record_of.get(cid)
        if figure is None or cid in deleted or cid in doubtful or record is None or record["state"] != "running":
            continue
        if record["gpu_memory"] != figure:
            found.append(f"{cid}: PATCH answered 200 with {figure} bytes, the record says {record['gpu_memory']}")
        elif record["gpu_memory_held"] != figure:
            found.append(f"{cid}: PATCH answered 200 with {figure} bytes, the node holds {record['gpu_memory_held']}")
    return found + [f"{cid} (DELETE'd) was still on the engine {GONE_WITHIN:g}s after the heal" for cid in sorted(late)]
