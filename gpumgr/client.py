"""A Python client for the gpumgr manager's REST API, shaped like docker-py's ``docker.from_env()``.

    from gpumgr.client import Client
    client = Client.from_env()                      # GPUMGR_MANAGER, GPUMGR_TOKEN
    box = client.containers.run("pytorch:2", "python train.py", gpu_memory="8GiB")
    print(box.node, box.gpus[0].index, box.wait().exit_code)

Two layers, as docker-py has: :class:`API` (:mod:`gpumgr.client_http`) makes one REST call and
turns an error answer into the exception for its ``code`` (the classes of :mod:`gpumgr.wire.errors`,
with the API's ``code`` and HTTP ``status``); :class:`Client` gives typed records
(:mod:`gpumgr.client_types`). Several manager URLs may be given: a call that cannot connect to one
goes on to the next. The transport is the standard library's ``http.client``, one kept-alive
connection per thread, because ``docker gpu`` runs on this client and must start fast.
"""

from __future__ import annotations

import builtins
import os
import time
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gpumgr import client_keyed as keyed
from gpumgr.client_http import (
    API,
    DEFAULT_URL,
    IDEMPOTENT,
    TIMEOUT,
    APIError,
    ManagerUnreachable,
    NeverFits,
    Stream,
    Unauthorized,
    _Closing,
    api_error,
)
from gpumgr.wire import defaults
from gpumgr.wire.errors import (
    NotFound,
)

if TYPE_CHECKING:
    from gpumgr.client_types import Account, Container, Event, Gang, Node, WaitResult

#: Seconds between two looks at ``GET /v1/events`` while following.
EVENTS_POLL = 0.5
#: How long ``events()`` keeps trying to reach a manager that went away before it gives up.
RECONNECT_TIMEOUT = 120.0
MULTIPLEXED = "application/vnd.docker.multiplexed-stream"
#: Docker's frame header: stream id, three zero bytes, the payload's length (big-endian).
FRAME_HEADER = 8

class Client(_Closing):
    """The manager's API as objects: ``containers``, ``gangs``, ``nodes``, ``events()``, ``accounts()``.

    ``base_url`` is one URL or several (a list, or one comma-separated string): a call that cannot connect
    to one goes on to the next, and later calls start with the one that answered.
    """

    def __init__(self, base_url: str | Sequence[str] = DEFAULT_URL, token: str | None = None,
                 timeout: float = TIMEOUT) -> None:
        self.api = API(base_url, token, timeout)
        self.containers = ContainerCollection(self)
        self.gangs = GangCollection(self)
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

    def accounts(self) -> list[Account]:
        """``GET /v1/accounts``: each account the caller may see with its fair share and allocation (none: no
        accounts configured); a tenant sees its own account and those above it."""
        from gpumgr.client_types import Account

        return [Account.from_json(a) for a in self.api.call("GET", "/v1/accounts")["accounts"]]

    def events(self, since: int | None = None, types: Sequence[str] | None = None, *, follow: bool = True,
               poll: float = EVENTS_POLL, reconnect_timeout: float = RECONNECT_TIMEOUT) -> Iterator[Event]:
        """Events, oldest first: those with an id above ``since`` (None: only from now on; 0: all still kept).

        With ``follow`` it never ends: it looks again every ``poll`` seconds, and when the manager goes
        away (restarted, or failed over to another URL) it keeps trying for up to ``reconnect_timeout``
        seconds and goes on from the last id it gave, so no event is given twice and none is skipped
        (event ids keep rising across a manager's restarts; see the docs). Without ``follow`` it ends
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

        ``options`` are the API's other fields, as docker-py names them: ``gpu_memory_limit`` (a burstable
        grant's limit), ``name``, ``env``, ``labels``,
        ``node``, ``placement``, ``on_overrun``, ``tenant``, ``priority``, ``preemptible``, ``queue``,
        ``queue_timeout``, ``compute_share``, and how it runs (``mounts``, ``ports``, ``network``, ...). With
        ``queue=True`` a request that does not fit now comes back with state ``queued`` and starts as soon as room
        frees.

        It runs at most once: it is sent with an ``Idempotency-Key`` (``idempotency_key``, or a new one) and
        resent with it while its outcome is unknown (:mod:`gpumgr.client_keyed`); if it stays unknown,
        :class:`~gpumgr.wire.errors.OutcomeUnknown` is raised: look before running it again.
        """
        key = options.pop("idempotency_key", None)
        body: dict[str, Any] = {"gpu_memory": gpu_memory, "gpus": gpus, **options}
        if image is not None:
            body["image"] = image
        if command is not None:
            body["command"] = command if isinstance(command, str) else list(command)
        return self._record(keyed.create(self.api, body, key))

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

    def resize(self, ref: str, gpu_memory: int | str | None = None, *, force: bool = False,
               gpu_memory_limit: int | str | None = None) -> Container:
        """Grow or shrink its grant, or its burst limit, in place (``force``: even below what it uses now)."""
        body: dict[str, Any] = {"gpu_memory": gpu_memory, "gpu_memory_limit": gpu_memory_limit}
        body = {k: v for k, v in body.items() if v is not None} | ({"force": True} if force else {})
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


class GangCollection:
    """``client.gangs``: run, list, get and remove gangs, and read their members (issue 35).

    A gang is ``replicas`` containers placed all at once or not at all, each told its rank and torchrun's
    rendezvous; its members are ordinary container records (``gang``, ``rank``) that ``client.containers`` reads.
    """

    def __init__(self, client: Client) -> None:
        self.api = client.api
        self._containers = client.containers

    def run(self, image: str | None = None, command: str | Sequence[str] | None = None, *, replicas: int,
            gpu_memory: int | str, gpus: int = 1, one_per_node: bool = True, restart: str | None = None,
            max_restarts: int = 0, **options: Any) -> Gang:
        """Place every member at once (``POST /v1/gangs``); the gang once all of them run.

        ``gpus`` and ``gpu_memory`` are each member's. ``restart="gang"`` places a failed gang again whole, up
        to ``max_restarts`` times (given ``max_restarts`` alone, ``restart`` is ``"gang"``). ``options`` are a
        container's other fields (``env``, ``network``, ``queue``, ``queue_timeout``, ``name``, ...): with
        ``queue=True`` a gang that does not fit now comes back ``queued`` and starts whole once every member
        fits. Unlike ``containers.run`` it is sent once: a connection that breaks after sending raises
        :class:`ManagerUnreachable` saying the outcome is unknown (look with ``list()`` before running it again).
        """
        restart = restart or ("gang" if max_restarts else "never")
        body: dict[str, Any] = {"replicas": replicas, "gpu_memory": gpu_memory, "gpus": gpus,
                                "one_per_node": one_per_node, "restart": restart, "max_restarts": max_restarts,
                                **options}
        if image is not None:
            body["image"] = image
        if command is not None:
            body["command"] = command if isinstance(command, str) else list(command)
        return self._gang(self.api.call("POST", "/v1/gangs", body=body))

    def list(self) -> list[Gang]:
        """Every gang the caller may see, ended ones included."""
        return [self._gang(g) for g in self.api.call("GET", "/v1/gangs")["gangs"]]

    def get(self, gid: str) -> Gang:
        """One gang by its id (:class:`~gpumgr.wire.errors.NotFound` if none)."""
        return self._gang(self.api.call("GET", f"/v1/gangs/{_quote(gid)}"))

    def remove(self, gid: str) -> Gang:
        """End it: every member is stopped and removed (a waiting gang is withdrawn). The gang as it ended."""
        return self._gang(self.api.call("DELETE", f"/v1/gangs/{_quote(gid)}"))

    def containers(self, gid: str) -> builtins.list[Container]:
        """Its current members' records, in rank order (none while it waits)."""
        return [self._containers.get(cid) for cid in self.get(gid).members]

    def logs(self, gid: str, *, tail: int | None = None) -> dict[int, bytes]:
        """Each current member's output so far (stdout and stderr together), by rank."""
        return {rank: self._containers.logs(cid, tail=tail) for rank, cid in enumerate(self.get(gid).members)}

    def _gang(self, data: dict[str, Any]) -> Gang:
        from gpumgr.client_types import Gang

        return Gang.from_json(data, self)


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


__all__ = [
    "API",
    "DEFAULT_URL",
    "IDEMPOTENT",
    "TIMEOUT",
    "APIError",
    "Client",
    "ContainerCollection",
    "GangCollection",
    "ManagerUnreachable",
    "NeverFits",
    "NodeCollection",
    "Stream",
    "Unauthorized",
    "api_error",
]
