"""The chaos harness: a manager process, agents behind chaos proxies, seeded fault schedules under load, a checker.

The CI suite (tests/faults/test_chaos.py) and the soak (bench/chaos.py) both run on it:

- :class:`ChaosStack`: ``gpumgr manager`` as its own process, and agents that each reach it through a
  :class:`~tests.chaos.proxy.ChaosProxy` of their own (so a fault is one node's): scripted agents
  (:class:`ScriptedFleet`, one thread for all of them) and, optionally, one real ``gpumgr agent`` on the
  real Docker engine.
- :class:`Schedule`: faults as data. A ``random.Random`` seeded with the run's seed and the schedule's
  name picks which nodes get which fault, when, and for how long; the same seed gives the same schedule.
- :class:`Load`: client threads that POST (to a chosen node), DELETE and PATCH, and :class:`History`,
  the record of every call (start, end, status, the node it involved) and of every fault's window.
- :func:`run_schedule`: load, the faults and their heals, then the checks: the answers and timings of
  the calls (:func:`call_problems`) and, polled until they hold or a deadline passes, what must be true
  once the network healed (:meth:`ChaosStack.settle`): every 201 is a container that exists exactly once
  (or is gone, if DELETE'd, within ``GONE_WITHIN`` of the heal), nothing is mid-operation, and the map,
  the records and what each agent runs agree (the invariant of tests/invariant.py over both kinds of agent).

The seed decides the schedule and each client's choices; the threads' interleaving stays the machine's,
so a replay repeats the faults and the mix of calls, not every race.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from gpumgr.wire import protocol
from gpumgr.wire.names import Label
from tests.chaos.proxy import ChaosProxy
from tests.chaos.scripted import ScriptedFleet
from tests.invariant import violations
from tests.procs import AgentProc, ManagerProc, remove_containers_of, wait_for

log = logging.getLogger(__name__)

GiB = 1 << 30
SEED_ENV = "GPUMGR_CHAOS_SEED"
#: the one timing the CI suite asserts: a call that involves no faulted node answers within this
HEALTHY_CALL = 2.0
#: every DELETE'd container is gone from its node within this long of the heal (or of its answer, if later)
GONE_WITHIN = 10.0
#: after the last heal the checks are polled this long before the schedule fails with what still differs
SETTLE_WITHIN = 15.0
#: load goes on this long after a schedule's last heal
LOAD_AFTER = 1.5
#: what a call may answer: (method, whether its node was faulted) → statuses (0: no answer at all)
ALLOWED = {
    ("POST", False): {201}, ("DELETE", False): {200, 202}, ("PATCH", False): {200},
    ("POST", True): {201, 409, 502, 503}, ("DELETE", True): {200, 202, 502, 503},
    ("PATCH", True): {200, 409, 502, 503},
}
#: a container that ends at once on SIGTERM (a shell as PID 1 ignores the signals it has no trap for)
COMMAND = ["sh", "-c", "trap 'exit 0' TERM; sleep 3600 & wait"]
SIZES = (GiB, 2 * GiB)
CLIENT_TIMEOUT = 60.0
#: a grant's id as records, labels and messages carry it; a failure explains at most this many
GRANT_ID = re.compile(r"\b[0-9a-f]{16}\b")
MAX_EXPLAINED = 12
LIVE = {"creating", "running"}


def run_seed() -> int:
    """The run's seed: ``GPUMGR_CHAOS_SEED`` to replay one, else a fresh one."""
    given = os.environ.get(SEED_ENV)
    return int(given) if given else random.SystemRandom().randrange(1 << 32)


def say(text: str) -> None:
    """A progress line on stderr, where pytest shows it for a failed test and a bench leaves stdout alone."""
    print(f"chaos: {text}", file=sys.stderr, flush=True)


# --- the faults -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fault:
    """One fault on one node's proxy: ``cut`` (``refuse_for`` seconds refusing reconnects), ``swallow``
    (a silent partition going ``direction``) or ``delay`` (``seconds`` plus up to ``jitter``), ``at``
    seconds after the load starts, healed ``lasts`` seconds later."""

    node: str
    kind: str
    at: float
    lasts: float = 0.0
    direction: str = "both"
    refuse_for: float = 0.0
    seconds: float = 0.0
    jitter: float = 0.0

    def apply(self, proxy: ChaosProxy) -> None:
        if self.kind == "cut":
            proxy.cut(self.refuse_for)
        elif self.kind == "swallow":
            proxy.swallow(self.direction)
        else:
            proxy.delay(self.seconds, self.direction, self.jitter)

    def __str__(self) -> str:
        what = {"cut": f"cut (refusing {self.refuse_for:g}s)", "swallow": f"swallow {self.direction}",
                "delay": f"delay {self.seconds:g}s±{self.jitter:g} {self.direction}"}[self.kind]
        return f"{self.node}: {what} at {self.at:.2f}s for {self.lasts:.2f}s"


@dataclass(frozen=True)
class Schedule:
    """A named, seeded list of faults; the load runs until ``LOAD_AFTER`` past the last heal."""

    name: str
    seed: int
    faults: tuple[Fault, ...]

    @property
    def load_for(self) -> float:
        return max(f.at + f.lasts for f in self.faults) + LOAD_AFTER

    def __str__(self) -> str:
        return f"schedule {self.name} (seed {self.seed}): " + "; ".join(map(str, self.faults))


Template = Callable[[random.Random, list[str], int], list[Fault]]


def _blip(rng: random.Random, nodes: list[str], few: int) -> list[Fault]:
    """``few`` nodes' connections reset twice, a second or so apart: each reconnects with a new routing id."""
    first = rng.uniform(0.5, 1.0)
    picked = rng.sample(nodes, few)
    return [Fault(n, "cut", first + rng.uniform(0.0, 0.3)) for n in picked] + \
        [Fault(n, "cut", first + rng.uniform(1.0, 1.8)) for n in picked]


def _blip_all(rng: random.Random, nodes: list[str], few: int) -> list[Fault]:
    at = rng.uniform(0.5, 1.0)
    return [Fault(n, "cut", at) for n in nodes]


def _swallow(direction: str) -> Template:
    def template(rng: random.Random, nodes: list[str], few: int) -> list[Fault]:
        """A one-way silent partition, long enough that a silent agent's node is marked down."""
        return [Fault(n, "swallow", rng.uniform(0.5, 1.0), rng.uniform(1.5, 2.5), direction=direction)
                for n in rng.sample(nodes, few)]
    return template


def _partition_many(rng: random.Random, nodes: list[str], few: int) -> list[Fault]:
    """Most nodes silent at once (a switch, or the manager's own link): a disruption, nothing of theirs ends."""
    at, lasts = rng.uniform(0.5, 1.0), rng.uniform(1.5, 2.0)
    return [Fault(n, "swallow", at, lasts) for n in rng.sample(nodes, max(3, math.ceil(0.6 * len(nodes))))]


def _slow(rng: random.Random, nodes: list[str], few: int) -> list[Fault]:
    return [Fault(n, "delay", rng.uniform(0.3, 0.8), 3.0, seconds=0.3, jitter=0.1)
            for n in rng.sample(nodes, min(len(nodes), 2 * few))]


def _refuse(rng: random.Random, nodes: list[str], few: int) -> list[Fault]:
    """A cut after which reconnects are refused for 2 s: the node goes down and comes back."""
    return [Fault(n, "cut", rng.uniform(0.5, 1.0), 2.0, refuse_for=2.0) for n in rng.sample(nodes, few)]


def _mix(rng: random.Random, nodes: list[str], few: int) -> list[Fault]:
    """One-node faults of every kind on distinct nodes, at random times, overlapping."""
    faults = []
    for node in rng.sample(nodes, min(len(nodes), 3 * few)):
        kind = rng.choice(("cut", "refuse", "up", "down", "both", "delay"))
        at, lasts = rng.uniform(0.3, 2.0), rng.uniform(1.0, 2.5)
        faults.append(Fault(node, "cut", at) if kind == "cut" else
                      Fault(node, "cut", at, lasts, refuse_for=lasts) if kind == "refuse" else
                      Fault(node, "delay", at, lasts, seconds=0.3, jitter=0.1) if kind == "delay" else
                      Fault(node, "swallow", at, lasts, direction=kind))
    return faults


TEMPLATES: dict[str, Template] = {
    "blip": _blip, "blip_all": _blip_all, "swallow_up": _swallow("up"), "swallow_down": _swallow("down"),
    "partition_many": _partition_many, "slow": _slow, "refuse": _refuse, "mix": _mix,
}


def schedule(name: str, seed: int, nodes: Sequence[str], few: int = 1) -> Schedule:
    """The schedule ``name`` for ``seed`` over ``nodes``; ``few`` is how many nodes a one-node fault takes."""
    rng = random.Random(f"{seed}/{name}")
    return Schedule(name, seed, tuple(TEMPLATES[name](rng, sorted(nodes), few)))




class EngineWatch:
    """Counts the containers the real engine creates for one node's grants, from the engine's event stream."""

    def __init__(self, docker_client: Any, node: str) -> None:
        self._made: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stream = docker_client.events(decode=True, filters={
            "type": "container", "event": "create", "label": f"{Label.NODE}={node}"})
        self._thread = threading.Thread(target=self._read, name=f"engine-watch-{node}", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with contextlib.suppress(Exception):  # the stream ends when closed
            for event in self._stream:
                grant = (event.get("Actor") or {}).get("Attributes", {}).get(Label.GRANT)
                if grant:
                    with self._lock:
                        self._made[grant] += 1

    def made(self) -> Counter[str]:
        """How many containers the engine created per grant so far."""
        with self._lock:
            return Counter(self._made)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._stream.close()


# --- the history ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Call:
    """One REST call: what it asked of which node and container, when, and what it was answered."""

    method: str
    node: str
    container: str | None
    start: float
    end: float
    status: int  # 0: no answer (the client's own timeout, a refused connection)
    detail: str = ""
    #: a DELETE answered otherwise (its node faulted) whose record had ended when asked right after
    removed: bool = False

    @property
    def took(self) -> float:
        return self.end - self.start

    def __str__(self) -> str:
        return (f"{self.method} {self.container or ''} on {self.node} answered {self.status or 'nothing'} after "
                f"{self.took:.2f}s {self.detail[:200]}")


@dataclass
class History:
    """Every call and fault window of a run, and what the clients were told exists."""

    calls: list[Call] = field(default_factory=list)
    #: node → (from, to) of each of its faults, aftermath included: a call to it overlapping one involves a
    #: faulted node
    windows: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    #: every container answered 201: id → node
    created: dict[str, str] = field(default_factory=dict)
    #: every container whose DELETE was answered 200 or 202: id → (node, when answered)
    deleted: dict[str, tuple[str, float]] = field(default_factory=dict)
    #: per node, the containers answered 201 and not DELETE'd that no client is working on now
    idle: dict[str, list[str]] = field(default_factory=dict)
    live: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def faulted(self, node: str, start: float, end: float) -> bool:
        return any(a <= end and start <= b for a, b in self.windows.get(node, ()))

    def fault_spans(self) -> list[tuple[float, float]]:
        """The times when any node was faulted, as disjoint spans in order."""
        spans: list[tuple[float, float]] = []
        for begun, ends in sorted(w for windows in self.windows.values() for w in windows):
            if spans and begun <= spans[-1][1]:
                spans[-1] = (spans[-1][0], max(spans[-1][1], ends))
            else:
                spans.append((begun, ends))
        return spans


class Load:
    """``clients`` threads that POST (to a node they choose), DELETE and PATCH containers, keeping each node
    between ``low`` and ``high`` containers, and record every call in ``history``."""

    def __init__(self, url: str, nodes: Sequence[str], image: str, history: History, seed: int, *,
                 clients: int = 4, pause: float = 0.05, low: int = 1, high: int = 4) -> None:
        self.url, self.nodes, self.image, self.history, self.seed = url, sorted(nodes), image, history, seed
        self.pause, self.low, self.high = pause, low, high
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), name=f"chaos-client-{i}", daemon=True)
                         for i in range(clients)]

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        """Stop asking; each client finishes the call it is in."""
        self._stop.set()
        for thread in self._threads:
            thread.join(CLIENT_TIMEOUT + 5)

    def _client(self, index: int) -> None:
        rng = random.Random(f"{self.seed}/client/{index}")
        with requests.Session() as session:
            while not self._stop.is_set():
                node = rng.choice(self.nodes)
                method, container = self._choose(rng, node)
                if method:
                    self._call(session, rng, method, node, container)
                self._stop.wait(rng.expovariate(1 / self.pause) if self.pause else 0)

    def _choose(self, rng: random.Random, node: str) -> tuple[str, str | None]:
        """What to ask of ``node``: POST below ``low`` containers, DELETE at ``high``, else any of the three."""
        h = self.history
        with h.lock:
            idle, live = h.idle.setdefault(node, []), h.live[node]
            method = "POST" if live < self.low else "DELETE" if live >= self.high else \
                rng.choice(("POST", "DELETE", "PATCH"))
            if method == "POST":
                h.live[node] += 1  # counted from now, so that concurrent clients keep under ``high``
                return method, None
            if not idle:
                return "", None
            return method, idle.pop(rng.randrange(len(idle)))

    def _call(self, session: requests.Session, rng: random.Random, method: str, node: str,
              container: str | None) -> None:
        url, body = f"{self.url}/v1/containers", None
        if method == "POST":
            body = {"image": self.image, "gpu_memory": SIZES[0], "node": node, "command": COMMAND}
        else:
            url += f"/{container}"
            body = {"gpu_memory": rng.choice(SIZES)} if method == "PATCH" else None
        start = time.monotonic()
        try:
            answer = session.request(method, url, json=body, timeout=CLIENT_TIMEOUT)
            status, detail = answer.status_code, answer.text if answer.status_code >= 300 else ""
            record = answer.json() if answer.status_code == 201 else {}
        except requests.RequestException as exc:
            status, detail, record = 0, repr(exc), {}
        end = time.monotonic()
        gone = method == "DELETE" and status not in (200, 202) and self._ended(session, container)
        self._note(Call(method, node, container or record.get("id"), start, end, status, detail, gone))

    def _ended(self, session: requests.Session, container: str | None) -> bool:
        """Whether ``container``'s record has ended (or is forgotten): a DELETE answered otherwise may have
        removed it all the same, and then it is DELETE'd, to be checked as such."""
        try:
            answer = session.get(f"{self.url}/v1/containers/{container}", timeout=CLIENT_TIMEOUT)
        except requests.RequestException:
            return False
        return answer.status_code == 404 or (answer.ok and answer.json()["state"] not in LIVE)

    def _note(self, call: Call) -> None:
        h = self.history
        with h.lock:
            h.calls.append(call)
            if call.method == "POST":
                if call.status == 201 and call.container:
                    h.created[call.container] = call.node
                    h.idle[call.node].append(call.container)
                else:
                    h.live[call.node] -= 1
            elif call.method == "DELETE" and (call.status in (200, 202) or call.removed):
                assert call.container is not None
                h.deleted[call.container] = (call.node, call.end)
                h.live[call.node] -= 1
            elif call.container is not None:
                h.idle[call.node].append(call.container)


def call_summary(calls: Sequence[Call], history: History) -> str:
    """One line: the answers per method, for the healthy and the faulted nodes, and the slowest healthy call."""
    counts: Counter[tuple[bool, str, int | str]] = Counter()
    slowest: Call | None = None
    for call in calls:
        faulted = history.faulted(call.node, call.start, call.end)
        counts[(faulted, call.method, call.status)] += 1
        if not faulted and (slowest is None or call.took > slowest.took):
            slowest = call
    parts = [f"{'faulted' if f else 'healthy'} {m} {s}×{n}" for (f, m, s), n in sorted(counts.items(), key=str)]
    return f"{len(calls)} calls: {', '.join(parts)}; slowest healthy call: {slowest or 'none'}"


def call_problems(calls: Sequence[Call], history: History, limit: float | None = HEALTHY_CALL) -> list[str]:
    """Every call answered what its node's state does not allow, or (with ``limit``) that involved no faulted
    node and took longer than ``limit`` seconds."""
    found = []
    for call in calls:
        faulted = history.faulted(call.node, call.start, call.end)
        if call.status not in ALLOWED[(call.method, faulted)]:
            found.append(f"{'faulted' if faulted else 'healthy'} node: {call}")
        elif limit is not None and not faulted and call.took > limit:
            found.append(f"a call to a healthy node took over {limit:g}s: {call}")
    return found


# --- the stack ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Timing:
    """The manager's clock for a chaos run (its settings, as ``GPUMGR_*`` variables)."""

    heartbeat: float = 0.25
    create_timeout: float = 4.0
    remove_timeout: float = 4.0

    def env(self) -> dict[str, str]:
        return {"GPUMGR_HEARTBEAT_INTERVAL": str(self.heartbeat), "GPUMGR_CREATE_TIMEOUT": str(self.create_timeout),
                "GPUMGR_REMOVE_TIMEOUT": str(self.remove_timeout)}

    @property
    def aftermath(self) -> float:
        """How long after a heal a call to the healed node still involves a faulted node: its agent
        reconnects (ZeroMQ's backoff) and registers again, and a command lost in the fault ends at its deadline."""
        return max(self.create_timeout, self.remove_timeout) + 2.0 + 4 * self.heartbeat


class _Engines:
    """What the invariant reads as "the engine": the real engine's containers, and the scripted agents' as
    the engine would list them (``violations`` calls ``engines.api.containers(all=True)``)."""

    def __init__(self, docker_client: Any | None, truth: dict[str, dict[str, protocol.ContainerReport]]) -> None:
        self.api, self._docker, self._truth = self, docker_client, truth

    def containers(self, **_: Any) -> list[dict[str, Any]]:
        real = list(self._docker.api.containers(all=True)) if self._docker is not None else []
        return real + [{"Id": c.container_id, "State": c.state, "Names": [f"/{c.name}"],
                        "Labels": {Label.NODE: node, Label.GRANT: c.grant}}
                       for node, containers in self._truth.items() for c in containers.values()]


class ChaosStack:
    """A manager process and its agents, each behind a chaos proxy of its own; see the module docstring.

    ``scripted`` scripted agents (nodes ``PREFIX-sN``) and, given a ``docker_client``, one real agent
    (node ``PREFIX-real``) with two simulated 24 GiB GPUs on that engine.
    """

    def __init__(self, tmp: Path, scripted: int, *, timing: Timing | None = None, docker_client: Any | None = None,
                 prefix: str | None = None, fleet: type[ScriptedFleet] = ScriptedFleet) -> None:
        self.timing = timing or Timing()
        self.docker = docker_client
        self.real: AgentProc | None = None
        self.watch: EngineWatch | None = None
        self.fleet: ScriptedFleet | None = None
        self._fleet_class = fleet
        self.proxies: dict[str, ChaosProxy] = {}
        self.manager = ManagerProc(tmp, env=self.timing.env())
        try:
            # node names of this process's own: two runs on one engine must not clean up each other's containers
            self._start(tmp, scripted, prefix or f"chaos{os.getpid()}")
        except BaseException:
            self.stop()
            raise

    def _start(self, tmp: Path, scripted: int, prefix: str) -> None:
        target = ("127.0.0.1", self.manager.agent_port)
        names = [f"{prefix}-s{i}" for i in range(scripted)]
        self.proxies = {name: ChaosProxy(target).start() for name in names}
        self.fleet = self._fleet_class(self.manager.token(), {n: self.proxies[n].address for n in names}).start()
        if self.docker is not None:
            node = self.real_node = f"{prefix}-real"
            remove_containers_of(self.docker, node)  # a killed run's leftovers would be adopted
            self.proxies[node] = ChaosProxy(target).start()
            self.watch = EngineWatch(self.docker, node)
            self.real = AgentProc(tmp, self.manager, node, endpoints=self.proxies[node].address, wait=False)
        wait_for(self.all_ready, 60, interval=0.2, what="every node to be ready")

    @property
    def nodes(self) -> list[str]:
        return sorted(self.proxies)

    def all_ready(self) -> bool:
        if self.real is not None and self.real.popen.poll() is not None:
            raise AssertionError(f"the real agent exited:\n{self.real.output()[-3000:]}")
        states = {n["name"]: n["state"] for n in self.manager.get("/v1/nodes").json()["nodes"]}
        return all(states.get(node) == "ready" for node in self.proxies)

    def stop(self) -> None:
        if self.watch is not None:
            self.watch.close()
        for part in (self.real, self.fleet, *self.proxies.values(), self.manager):
            if part is not None:
                with contextlib.suppress(Exception):
                    part.stop()
        if self.docker is not None and self.real is not None:
            remove_containers_of(self.docker, self.real.node)

    # the checks once healed

    def settle(self, history: History, healed: float, within: float = SETTLE_WITHIN, poll: float = 0.25) -> list[str]:
        """Poll :meth:`problems` until there are none (``[]``) or ``within`` seconds after ``healed`` have
        passed (what still differs); a DELETE'd container seen on its node past its deadline stays a problem."""
        late: set[str] = set()
        while True:
            found = self.problems(history, healed, late)
            if not found:
                return found
            if time.monotonic() > healed + within:
                return found + self.explain(found, history)
            time.sleep(poll)

    def explain(self, problems: list[str], history: History) -> list[str]:
        """For each grant the problems name: its calls, its record and its events, for whoever reads the failure."""
        lines = []
        for grant in sorted(set(GRANT_ID.findall("\n".join(problems))))[:MAX_EXPLAINED]:
            calls = [f"{c.method} {c.status} ({c.took:.2f}s)" for c in history.calls if c.container == grant]
            answer = self.manager.get(f"/v1/containers/{grant}")
            record = answer.json() if answer.ok else {}
            fields = {k: record.get(k) for k in ("node", "state", "reason", "exit_code", "desired_state", "operation")}
            events = [f"{e['type']}: {e.get('message', '')}" for e in self.manager.get("/v1/events").json()["events"]
                      if e.get("container") == grant]
            engine = [] if self.docker is None else [
                f"{c['Id'][:12]} {c['State']} on {c['Labels'].get(Label.NODE)} ({c['Status']})"
                for c in self.docker.api.containers(all=True, filters={"label": f"{Label.GRANT}={grant}"})]
            lines.append(f"about {grant}: calls {calls or 'none'}; record "
                         f"{fields if answer.ok else answer.status_code}; events {events}; engine {engine}")
        return lines

    def problems(self, history: History, healed: float, late: set[str]) -> list[str]:
        """What differs now between the clients' answers, the manager's map and records, and each agent's truth."""
        assert self.fleet is not None
        truth, made = self.fleet.truth(), self.fleet.made()
        records = {r["id"]: r for r in self.manager.get("/v1/containers").json()["containers"]
                   if r["node"] in self.proxies}
        states = {n["name"]: n["state"] for n in self.manager.get("/v1/nodes").json()["nodes"]}
        found = [f"node {n} is {states.get(n, 'not on the map')}" for n in self.nodes if states.get(n) != "ready"]
        found += [f"{r['id']} on {r['node']} is mid-{r['operation']} ({r['state']})" for r in records.values()
                  if r["operation"] is not None]
        found += [f"{r['id']} on {r['node']} holds {r['gpu_memory_held']} bytes for a grant of {r['gpu_memory']}"
                  for r in records.values() if r["state"] in LIVE and r["gpu_memory_held"] != r["gpu_memory"]]
        for node, containers in truth.items():  # a resize reached the scripted agent (the real one's: held)
            found += [f"{node} enforces {c.gpu_memory} bytes for {grant}, its record {record['gpu_memory']}"
                      for grant, c in containers.items() if (record := records.get(grant)) is not None
                      and record["state"] in LIVE and c.gpu_memory != record["gpu_memory"]]
        engines = _Engines(self.docker if self.real is not None else None, dict(truth))
        if self.real is not None and self.docker is not None:
            engine = self.docker.api.containers(all=True, filters={"label": f"{Label.NODE}={self.real.node}"})
            truth[self.real.node] = {c["Labels"][Label.GRANT]: _engine_report(c) for c in engine
                                     if Label.GRANT in c["Labels"]}
            made[self.real.node] = self.watch.made() if self.watch is not None else Counter()
        found += self._created(history, records, truth, made, healed, late)
        return found + violations(self.manager, engines, set(self.proxies))

    def _created(self, history: History, records: dict[str, dict[str, Any]],
                 truth: dict[str, dict[str, protocol.ContainerReport]], made: dict[str, Counter[str]], healed: float,
                 late: set[str]) -> list[str]:
        """Every 201 is a container made exactly once that runs unless DELETE'd; a DELETE'd one is gone in time."""
        found, now = [], time.monotonic()
        with history.lock:
            created, deleted = dict(history.created), dict(history.deleted)
        for cid, node in created.items():
            present, record = truth.get(node, {}).get(cid), records.get(cid)
            runs = present is not None and present.state == "running"
            if made.get(node, Counter())[cid] != 1:
                found.append(f"{cid} (answered 201) was made {made.get(node, Counter())[cid]} times on {node}")
            if cid in deleted:
                gone_by = max(deleted[cid][1], healed) + GONE_WITHIN
                if present is not None and now > gone_by:
                    late.add(cid)
                if present is not None:
                    found.append(f"{cid} (DELETE'd) is still on {node} ({present.state})")
                elif record is not None and record["state"] in LIVE:
                    found.append(f"{cid} (DELETE'd) is gone from {node} but its record is {record['state']}")
            elif not runs or record is None or record["state"] != "running":
                found.append(f"{cid} (answered 201, never DELETE'd): runs on {node}: {runs}; record: "
                             f"{record['state'] if record else 'none'}")
        return found + [f"{cid} (DELETE'd) still ran on its node {GONE_WITHIN:g}s after the heal" for cid in late]


def _engine_report(summary: dict[str, Any]) -> protocol.ContainerReport:
    labels = summary["Labels"]
    return protocol.ContainerReport(grant=labels[Label.GRANT], container_id=summary["Id"], state=summary["State"],
                                    gpus=[], gpu_memory=int(labels.get(Label.MEMORY, 1) or 1))


# --- one schedule ---------------------------------------------------------------------------------
@dataclass
class Outcome:
    """What one schedule did: its calls and the problems found (none: it passed)."""

    schedule: Schedule
    calls: list[Call]
    problems: list[str]
    healed: float
    settled_in: float


def run_schedule(stack: ChaosStack, plan: Schedule, history: History, image: str, *, clients: int = 4,
                 pause: float = 0.05, limit: float | None = HEALTHY_CALL, high: int = 4,
                 settle_poll: float = 0.25, settle_within: float = SETTLE_WITHIN) -> Outcome:
    """Run ``plan`` under load on ``stack``, heal, and check everything (see the module docstring)."""
    say(str(plan))
    first = len(history.calls)
    load = Load(stack.manager.url, stack.nodes, image, history, plan.seed, clients=clients, pause=pause,
                high=high).start()
    start = time.monotonic()
    steps = sorted([(f.at, 0, f) for f in plan.faults] + [(f.at + f.lasts, 1, f) for f in plan.faults],
                   key=lambda step: (step[0], step[1]))
    began: dict[Fault, float] = {}
    try:
        for at, heal, fault in steps:
            time.sleep(max(0.0, start + at - time.monotonic()))
            if heal:
                stack.proxies[fault.node].heal()
                ends = time.monotonic() + stack.timing.aftermath
                history.windows.setdefault(fault.node, []).append((began[fault], ends))
            else:
                began[fault] = time.monotonic()
                fault.apply(stack.proxies[fault.node])
        healed = time.monotonic()
        time.sleep(max(0.0, start + plan.load_for - time.monotonic()))
    finally:
        load.stop()
        for proxy in stack.proxies.values():
            proxy.heal()
    calls = history.calls[first:]
    problems = call_problems(calls, history, limit)
    settle_from = time.monotonic()
    problems += stack.settle(history, healed, within=settle_within, poll=settle_poll)
    settled = time.monotonic()
    if not problems:  # nothing is mid-operation and every node is back: the faults' aftermath is over
        history.windows = {node: [(begun, min(ends, settled)) for begun, ends in windows]
                           for node, windows in history.windows.items()}
    return Outcome(plan, calls, problems, healed, settled - settle_from)
