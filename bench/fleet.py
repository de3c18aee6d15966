"""A fleet of scripted agents against a real manager: a herd joining, heartbeats, polling and placements.

Starts ``gpumgr manager`` as its own process (so its CPU time is its own) and, in this process, ``--agents``
scripted agents on real DEALER sockets speaking the real protocol over real CURVE (as ``bench/join.py``
does: one thread and one poller for all of them, no thread per agent). Each joins with the manager's
token, registers ``--gpus`` simulated GPUs, heartbeats every interval the manager gives, answers
``Create`` and ``Remove`` as an agent whose engine started and removed the container at once, and
retries an unanswered Join or Register with the agent's own policy (``--retry agent``:
:func:`gpumgr.agent.agent.jittered` waits of at least ``ANSWER_WAIT``) or the policy the agent had
before (``--retry old``: the reconnect backoff itself, 0.1 s doubling, unjittered).

Phases, one after the other on the same manager:

1. **herd**: every agent sends its Join at once (a rack powering on); reported: the time from the
   first Join to the last ``Registered`` and to ``GET /v1/nodes`` showing all ready, and how many
   Joins and Registers were sent (duplicates are retries).
2. **heartbeats**: ``--steady`` seconds of heartbeats only; the manager's CPU (share of one core)
   and the link's round trip, probed ``--probe-hz`` times a second by one admitted agent re-sending
   its Join (answered on the link thread behind every queued heartbeat).
3. **polled**: the same, while another process GETs ``/v1/nodes`` at ``--poll-hz``; its latency,
   the body's size and the manager's CPU. ``--poll-etag`` makes the poller send ``If-None-Match``.
   Then **polled since**: the same again, the poller sending the last answer's version as ``?since=``
   (the changes only; a tree without versions is polled whole). Then, as the machine's floor, the
   same with ``GET /healthz`` (a few bytes, no map) polled instead.
4. **placements**: ``--placements`` containers created over REST by ``--clients`` threads of another
   process (gpus 1, then gpus 2-4), then removed; placements per second, and every grant freed.

``--against REV`` also runs every phase on a manager of git revision ``REV`` (laid out from ``git
archive`` and put first on its PYTHONPATH) with the agents' retry policy of then (``--before-retry``,
default ``old``), the two
alternating ``--reps`` times, and reports both and their ratios.

    python bench/fleet.py [--agents 1000] [--gpus 8] [--steady 10] [--poll-hz 20] [--placements 400]
                          [--against main] [--reps 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import gzip
import heapq
import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import requests
import zmq

from bench.harness import (
    ROOT,
    Client,
    GiB,
    Proc,
    answers,
    cpu_seconds,
    free_port,
    join_token,
    machine,
    machine_line,
    median,
    save,
    summary,
    table,
    wait_for,
)
from gpumgr.agent.agent import jittered
from gpumgr.wire import defaults, protocol, security

IMAGE = "busybox"  # the scripted agents start nothing: any name the manager accepts


@dataclass
class Scripted:
    """One scripted agent: its socket, where it is in its life, and what it has sent."""

    number: int
    node: str
    keys: security.KeyPair
    socket: zmq.Socket[bytes]
    gpus: list[protocol.GpuInfo]
    state: str = "joining"  # joining -> registering -> ready
    backoff: float = defaults.RECONNECT_MIN
    join_id: str = ""
    joined: float = 0.0
    registered: float = 0.0
    sent: dict[str, int] = field(default_factory=lambda: {"join": 0, "register": 0, "heartbeat": 0})
    containers: dict[str, protocol.ContainerStatus] = field(default_factory=dict)


class Fleet:
    """``n`` scripted agents of ``gpus`` GPUs each, served by :meth:`run` on the calling thread."""

    def __init__(self, endpoint: str, token: str, n: int, gpus: int, retry: str) -> None:
        self.server_public, self.secret = security.parse_token(token)
        self.endpoint, self.retry = endpoint, retry
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.poller = zmq.Poller()
        self.agents: list[Scripted] = []
        self.by_socket: dict[zmq.Socket[bytes], Scripted] = {}
        self.timers: list[tuple[float, int, str]] = []  # (due, agent number, what)
        self.interval = defaults.HEARTBEAT_INTERVAL
        self.probes: dict[str, float] = {}
        self.round_trips: list[float] = []
        self.refused: list[str] = []
        for i in range(n):
            node = f"fleet-{i:04d}"
            sock = self.ctx.socket(zmq.DEALER)
            for option, value in ((zmq.LINGER, 0), (zmq.IMMEDIATE, 1), (zmq.SNDHWM, 1000)):
                sock.setsockopt(option, value)
            keys = security.KeyPair.generate()
            security.connect_curve(sock, keys, self.server_public)
            agent = Scripted(i, node, keys, sock, [protocol.GpuInfo(uuid=f"GPU-{node}-{g}", index=g, name="Sim",
                                                                 memory_total=80 * GiB) for g in range(gpus)])
            self.agents.append(agent)
            self.by_socket[sock] = agent
            self.poller.register(sock, zmq.POLLIN)

    # --- the herd ------------------------------------------------------------------------------
    def start(self) -> float:
        """Connect every agent and send every Join; returns the moment the first left."""
        for agent in self.agents:
            agent.socket.connect(self.endpoint)
        t0 = time.perf_counter()
        for number in range(len(self.agents)):
            self._send_join(number)
        return t0

    def _wait(self, agent: Scripted) -> float:
        """How long to wait for an answer to what was just sent, by the chosen retry policy."""
        if self.retry == "old":
            return agent.backoff
        return jittered(max(agent.backoff, defaults.ANSWER_WAIT))

    def _send(self, agent: Scripted, frame: bytes) -> bool:
        try:
            agent.socket.send(frame, zmq.NOBLOCK)
            return True
        except zmq.Again:  # not connected yet (IMMEDIATE): as the agent's link, dropped and retried
            return False

    def _send_join(self, number: int) -> None:
        agent = self.agents[number]
        agent.join_id = protocol.new_id()
        proof = security.join_proof(self.secret, agent.keys.public, agent.node)
        sent = self._send(agent, protocol.encode(protocol.Join(node=agent.node, proof=proof), msg_id=agent.join_id))
        agent.sent["join"] += sent
        wait = self._wait(agent) if sent else agent.backoff
        agent.backoff = min(agent.backoff * 2, defaults.RECONNECT_MAX)
        heapq.heappush(self.timers, (time.perf_counter() + wait, number, "join"))

    def _send_register(self, number: int) -> None:
        agent = self.agents[number]
        agent.sent["register"] += self._send(agent, protocol.encode(protocol.Register(
            node=agent.node, runtime="docker", gpus=agent.gpus)))
        wait = self._wait(agent)
        agent.backoff = min(agent.backoff * 2, defaults.RECONNECT_MAX)
        heapq.heappush(self.timers, (time.perf_counter() + wait, number, "register"))

    def _send_heartbeat(self, number: int) -> None:
        agent = self.agents[number]
        samples = [protocol.GpuSample(uuid=g.uuid, memory_used=0, memory_unmanaged=0) for g in agent.gpus]
        agent.sent["heartbeat"] += self._send(agent, protocol.encode(protocol.Heartbeat(
            node=agent.node, gpus=samples, containers=list(agent.containers.values()))))
        heapq.heappush(self.timers, (time.perf_counter() + self.interval, number, "heartbeat"))

    def probe(self) -> None:
        """Re-send one ready agent's Join (admitted already: answered at once) and time its Reply."""
        agent = random.choice(self.agents)
        msg_id = protocol.new_id()
        proof = security.join_proof(self.secret, agent.keys.public, agent.node)
        self.probes[msg_id] = time.perf_counter()
        self._send(agent, protocol.encode(protocol.Join(node=agent.node, proof=proof), msg_id=msg_id))

    # --- the loop --------------------------------------------------------------------------------
    def run(self, until: float, probe_hz: float = 0.0) -> None:
        """Serve every agent until ``time.perf_counter()`` reaches ``until``."""
        next_probe = time.perf_counter() if probe_hz else float("inf")
        while True:
            now = time.perf_counter()
            if now >= until:
                return
            while self.timers and self.timers[0][0] <= now + 0.002:  # due within 2 ms: one wake-up for all
                _, number, what = heapq.heappop(self.timers)
                self._due(number, what)
            if now >= next_probe:
                self.probe()
                next_probe = now + 1 / probe_hz
            due = min(self.timers[0][0] if self.timers else until, until, next_probe)
            for sock, _ in self.poller.poll(max(0, int((due - time.perf_counter()) * 1000))):
                self._receive(self.by_socket[sock])

    def _due(self, number: int, what: str) -> None:
        agent = self.agents[number]
        if what == "join" and agent.state == "joining":
            self._send_join(number)
        elif what == "register" and agent.state == "registering":
            self._send_register(number)
        elif what == "heartbeat" and agent.state == "ready":
            self._send_heartbeat(number)

    def _receive(self, agent: Scripted) -> None:
        while True:
            try:
                frame = agent.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            envelope, message = protocol.decode(frame)
            self._handle(agent, envelope, message)

    def _handle(self, agent: Scripted, envelope: protocol.Envelope, message: protocol.Message) -> None:
        number = agent.number
        if isinstance(message, protocol.Reply) and envelope.reply_to in self.probes:
            self.round_trips.append(time.perf_counter() - self.probes.pop(envelope.reply_to or ""))
        elif isinstance(message, protocol.Reply) and agent.state == "joining" and envelope.reply_to == agent.join_id:
            if not message.ok:
                self.refused.append(f"{agent.node}: {message.error.message if message.error else '?'}")
                agent.state = "refused"
                return
            agent.state, agent.joined, agent.backoff = "registering", time.perf_counter(), defaults.RECONNECT_MIN
            self._send_register(number)
        elif isinstance(message, protocol.Registered) and agent.state == "registering":
            self.interval = message.heartbeat_interval
            agent.state, agent.registered = "ready", time.perf_counter()
            self._send_heartbeat(number)
        elif isinstance(message, protocol.Create):
            spec = message.spec
            report = protocol.ContainerReport(grant=spec.grant, container_id=spec.grant * 4, name=spec.name,
                                              gpus=spec.gpus, gpu_memory=spec.gpu_memory, state="running")
            agent.containers[spec.grant] = protocol.ContainerStatus(grant=spec.grant, container_id=spec.grant * 4,
                                                                    state="running")
            self._send(agent, protocol.encode(protocol.Reply(ok=True, result=report.model_dump()),
                                              reply_to=envelope.id))
        elif isinstance(message, protocol.Remove):
            agent.containers.pop(message.grant, None)
            self._send(agent, protocol.encode(protocol.Reply(ok=True, result={"grant": message.grant}),
                                              reply_to=envelope.id))

    def ready(self) -> int:
        """How many agents have been told they are registered."""
        return sum(a.state == "ready" for a in self.agents)

    def close(self) -> None:
        """Close every socket and the context."""
        for agent in self.agents:
            agent.socket.close(linger=0)
        self.ctx.term()


# --- the other process: REST load ------------------------------------------------------------------
def poll_nodes(url: str, path: str, hz: float, seconds: float, etag: bool, since: bool, out: Any) -> None:
    """GET ``path`` at ``hz`` for ``seconds`` (fixed rate); put (latencies, statuses, sizes) on ``out``.

    ``since``: as a dashboard keeping the map does, send the last answer's version as ``?since=`` (a tree
    whose answers carry no version is polled whole). The latency is to the last byte, before decoding.
    """
    session, latencies, statuses, sizes, tag, version = requests.Session(), [], [], [], None, None
    start = time.perf_counter()
    for i in range(int(hz * seconds)):
        time.sleep(max(0.0, start + i / hz - time.perf_counter()))
        headers = {"If-None-Match": tag} if etag and tag else {}
        params = {"since": version} if since and version else None
        t0 = time.perf_counter()
        reply = session.get(f"{url}{path}", headers=headers, params=params, timeout=30, stream=True)
        raw = reply.raw.read(decode_content=False)
        latencies.append(time.perf_counter() - t0)
        statuses.append(reply.status_code)
        sizes.append(len(raw))
        tag = reply.headers.get("ETag", tag)
        if since and reply.status_code == 200:
            text = gzip.decompress(raw) if reply.headers.get("Content-Encoding") == "gzip" else raw
            version = json.loads(text).get("version")
    out.put((latencies, statuses, sizes))


def place_many(url: str, count: int, clients: int, gpus: list[int], out: Any) -> None:
    """Create ``count`` containers over REST from ``clients`` threads, then remove them; put the figures on ``out``."""
    local = [Client(url) for _ in range(clients)]

    def create(i: int) -> tuple[int, str, float]:
        t0 = time.perf_counter()
        reply = local[i % clients].post("/v1/containers", json={"image": IMAGE, "gpu_memory": "1GiB",
                                                                "gpus": gpus[i % len(gpus)]})
        return reply.status_code, reply.json().get("id", reply.text), time.perf_counter() - t0

    with ThreadPoolExecutor(clients) as pool:
        t0 = time.perf_counter()
        made = list(pool.map(create, range(count)))
        elapsed = time.perf_counter() - t0
        removed = list(pool.map(lambda m: local[0].delete(f"/v1/containers/{m[1]}").status_code, made))
    out.put({"statuses": [m[0] for m in made], "latencies": [m[2] for m in made], "elapsed": elapsed,
             "removed": removed})


def in_child(target: Any, *args: Any, timeout: float) -> Any:
    """Run ``target(*args, queue)`` in a child process while this one serves the fleet; returns what it put."""
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=target, args=(*args, out), daemon=True)
    child.start()
    return child, out


def serve_while(fleet: Fleet, child: Any, out: Any, probe_hz: float, limit: float) -> Any:
    """Serve the fleet until the child has answered (or ``limit`` seconds); return its answer."""
    deadline = time.perf_counter() + limit
    while time.perf_counter() < deadline:
        fleet.run(time.perf_counter() + 0.2, probe_hz)
        if not out.empty():
            result = out.get()
            child.join(5)
            return result
    child.kill()
    raise RuntimeError("the REST load did not finish in time")


# --- the run ---------------------------------------------------------------------------------------
def cpu_share(pid: int, work: Any) -> tuple[Any, float]:
    """Run ``work()``; return its result and the share of one core ``pid`` used meanwhile."""
    c0, t0 = cpu_seconds(pid), time.perf_counter()
    result = work()
    return result, (cpu_seconds(pid) - c0) / (time.perf_counter() - t0)


def herd(fleet: Fleet, api: Client, timeout: float) -> dict[str, Any]:
    """Phase 1: every Join at once; the times to all Registered and to all ready in ``GET /v1/nodes``."""
    n = len(fleet.agents)
    own = cpu_seconds(os.getpid())
    t0 = fleet.start()
    deadline = t0 + timeout
    while fleet.ready() < n and not fleet.refused and time.perf_counter() < deadline:
        fleet.run(time.perf_counter() + 0.05)
    if fleet.refused or fleet.ready() < n:
        raise RuntimeError(f"{fleet.ready()}/{n} agents registered; refused: {fleet.refused[:3]}")
    registered = max(a.registered for a in fleet.agents) - t0
    while time.perf_counter() < deadline:  # the map, as a client sees it
        nodes = api.get("/v1/nodes").json()["nodes"]
        if sum(node["state"] == "ready" for node in nodes) >= n:
            break
        fleet.run(time.perf_counter() + 0.05)
    ready = time.perf_counter() - t0
    return {"all_registered_s": registered, "all_ready_s": ready, "fleet_cpu": (cpu_seconds(os.getpid()) - own) / ready,
            "joins_sent": sum(a.sent["join"] for a in fleet.agents),
            "registers_sent": sum(a.sent["register"] for a in fleet.agents),
            "join_s": [a.joined - t0 for a in fleet.agents], "registered_s": [a.registered - t0 for a in fleet.agents]}


def stage(rev: str, into: Path) -> Path:
    """Git revision ``rev`` laid out as the gpumgr package (as .ci/typecheck does); returns the PYTHONPATH entry."""
    tree, package = into / "tree", into / "path" / "gpumgr"
    tree.mkdir(parents=True)
    package.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    for file in (tree / "gpumgr").glob("*.py"):
        (package / file.name).symlink_to(file)
    for part in ("manager", "agent", "plugin", "wire"):
        (package / part).symlink_to(tree / part)
    return into / "path"


def run(args: argparse.Namespace, retry: str, pythonpath: Path | None = None) -> dict[str, Any]:
    """Every phase on one fresh manager (of the tree on ``pythonpath``, else this one); the figures."""
    tmp = Path(tempfile.mkdtemp(prefix="gpumgr-fleet-"))
    port, agents_port = free_port(), free_port()
    url, endpoint = f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{agents_port}"
    env = {"PYTHONPATH": f"{pythonpath}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"} if pythonpath else None
    # -P: the working directory (this checkout) must not shadow the tree on PYTHONPATH
    manager = Proc([sys.executable, "-P", "-m", "gpumgr", "manager", "--api", f"127.0.0.1:{port}", "--agents",
                    endpoint, "--state-dir", str(tmp / "state"), "--log-level", "WARNING"], tmp / "manager.log", env)
    fleet: Fleet | None = None
    try:
        wait_for(lambda: manager.check() and answers(f"{url}/healthz"), 20, what="the manager")
        api = Client(url)
        fleet = Fleet(endpoint, join_token(tmp / "state"), args.agents, args.gpus, retry)
        # which tree serves: only this one's map carries an ETag
        out: dict[str, Any] = {"map_etag": "ETag" in api.get("/v1/nodes").headers}
        out["herd"], out["herd"]["manager_cpu"] = cpu_share(manager.pid, lambda: herd(fleet, api, args.timeout))
        print(f"  herd: {args.agents} registered in {out['herd']['all_registered_s']:.2f} s", file=sys.stderr)
        fleet.round_trips.clear()
        _, cpu = cpu_share(manager.pid, lambda: fleet.run(time.perf_counter() + args.steady, args.probe_hz))
        out["heartbeats"] = {"manager_cpu": cpu, "round_trip_s": list(fleet.round_trips)}
        for phase, path, since in (("polled", "/v1/nodes", False), ("polled since", "/v1/nodes", True),
                                   ("polled healthz", "/healthz", False)):
            fleet.round_trips.clear()
            child, queue = in_child(poll_nodes, url, path, args.poll_hz, args.steady, args.poll_etag, since,
                                    timeout=args.timeout)
            (latencies, statuses, sizes), cpu = cpu_share(
                manager.pid, lambda c=child, q=queue: serve_while(fleet, c, q, args.probe_hz,
                                                                  args.steady + args.timeout))
            out[phase] = {"manager_cpu": cpu, "latency_s": latencies, "statuses": statuses, "bytes": sizes,
                          "round_trip_s": list(fleet.round_trips)}
        for name, gpus in (("placements gpus=1", [1]), ("placements gpus=2..4", [2, 3, 4])):
            child, queue = in_child(place_many, url, args.placements, args.clients, gpus, timeout=args.timeout)
            placed, cpu = cpu_share(manager.pid, lambda c=child, q=queue: serve_while(fleet, c, q, 0, args.timeout))
            out[name] = {**placed, "manager_cpu": cpu}
        fleet.run(time.perf_counter() + 2 * fleet.interval)  # a heartbeat or two after the removals
        nodes = api.get("/v1/nodes").json()["nodes"]
        out["final"] = {"ready": sum(n["state"] == "ready" for n in nodes), "nodes": len(nodes),
                        "reserved": sum(g["memory_reserved"] for n in nodes for g in n["gpus"]),
                        "heartbeats_sent": sum(a.sent["heartbeat"] for a in fleet.agents),
                        "down_events": len(api.get("/v1/events", params={"type": "node_down"}).json()["events"])}
        manager.check()
        return out
    finally:
        if fleet is not None:
            fleet.close()
        manager.stop()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"logs kept in {tmp}", file=sys.stderr)


def report(args: argparse.Namespace, out: dict[str, Any], title: str) -> None:
    """Print the tables of one run."""
    h = out["herd"]
    print(f"\n{title}: {args.agents} agents x {args.gpus} GPUs; the manager's map has an ETag: {out['map_etag']}")
    table([("herd", "44"), ("value", "12.2f")], [
        ["all Registered (s from first Join)", h["all_registered_s"]],
        ["all ready in GET /v1/nodes (s)", h["all_ready_s"]],
        ["Joins sent (one each is needed)", h["joins_sent"]],
        ["Registers sent (one each is needed)", h["registers_sent"]],
        ["manager CPU meanwhile (cores)", h["manager_cpu"]],
        ["this process (the fleet) meanwhile (cores)", h["fleet_cpu"]]], lead="\n")
    rows = []
    for phase in ("heartbeats", "polled", "polled since", "polled healthz"):
        rt = summary(out[phase]["round_trip_s"], 1e3) if out[phase]["round_trip_s"] else {"p50": 0, "p99": 0, "max": 0}
        rows.append([f"{phase}: manager CPU (cores)", out[phase]["manager_cpu"], "", ""])
        rows.append([f"{phase}: link round trip ms p50/p99/max", rt["p50"], f"{rt['p99']:8.2f}", f"{rt['max']:8.2f}"])
    for phase, form in (("polled", "/v1/nodes"), ("polled since", "/v1/nodes?since="), ("polled healthz", "/healthz")):
        lat = summary(out[phase]["latency_s"], 1e3)
        rows.append([f"GET {form} at {args.poll_hz:g} Hz: ms p50/p99/max", lat["p50"],
                     f"{lat['p99']:8.2f}", f"{lat['max']:8.2f}"])
        sizes = out[phase]["bytes"]
        rows.append([f"GET {form} body bytes (median)", sorted(sizes)[len(sizes) // 2], "", ""])
        codes = sorted(set(out[phase]["statuses"]))
        rows.append([f"GET {form} statuses {codes}", len(out[phase]["statuses"]), "", ""])
    for name in ("placements gpus=1", "placements gpus=2..4"):
        p = out[name]
        lat = summary(p["latencies"], 1e3)
        rows.append([f"{name}: per second ({args.clients} clients)", len(p["statuses"]) / p["elapsed"], "", ""])
        rows.append([f"{name}: ms p50/p99/max", lat["p50"], f"{lat['p99']:8.2f}", f"{lat['max']:8.2f}"])
        rows.append([f"{name}: manager CPU (cores)", p["manager_cpu"], "", ""])
    table([("steady state", "44"), ("value/p50", "12.2f"), ("p99", "8"), ("max", "8")],
          [[r[0], r[1], r[2] or " " * 8, r[3] or " " * 8] for r in rows], lead="\n")
    f = out["final"]
    print(f"\nafterwards: {f['ready']}/{f['nodes']} nodes ready, {f['reserved']} bytes reserved, "
          f"{f['down_events']} node_down events, {f['heartbeats_sent']} heartbeats sent")


def headline(out: dict[str, Any]) -> dict[str, float]:
    """The figures the goals name, of one run."""
    polled = summary(out["polled"]["latency_s"], 1e3)
    since = summary(out["polled since"]["latency_s"], 1e3)
    health = summary(out["polled healthz"]["latency_s"], 1e3)
    quiet = summary(out["heartbeats"]["round_trip_s"], 1e3)
    return {"herd: all Registered s": out["herd"]["all_registered_s"],
            "herd: all ready in GET /v1/nodes s": out["herd"]["all_ready_s"],
            "herd: Joins sent": out["herd"]["joins_sent"], "herd: Registers sent": out["herd"]["registers_sent"],
            "herd: manager CPU cores": out["herd"]["manager_cpu"], "herd: fleet CPU cores": out["herd"]["fleet_cpu"],
            "heartbeats: manager CPU cores": out["heartbeats"]["manager_cpu"],
            "heartbeats: link round trip p50 ms": quiet["p50"], "heartbeats: link round trip p99 ms": quiet["p99"],
            "polled: manager CPU cores": out["polled"]["manager_cpu"],
            "polled: GET /v1/nodes p50 ms": polled["p50"], "polled: GET /v1/nodes p99 ms": polled["p99"],
            "polled: GET /v1/nodes bytes": float(sorted(out["polled"]["bytes"])[len(out["polled"]["bytes"]) // 2]),
            "polled since: manager CPU cores": out["polled since"]["manager_cpu"],
            "polled since: GET p50 ms": since["p50"], "polled since: GET p99 ms": since["p99"],
            "polled since: GET bytes": float(median(out["polled since"]["bytes"])),
            "control: GET /healthz p50 ms": health["p50"], "control: GET /healthz p99 ms": health["p99"],
            **{f"{name}: per s": len(out[name]["statuses"]) / out[name]["elapsed"]
               for name in ("placements gpus=1", "placements gpus=2..4")}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per agent")
    parser.add_argument("--retry", choices=["agent", "old"], default="agent", help="the agents' retry policy")
    parser.add_argument("--steady", type=float, default=10.0, help="seconds of each steady phase")
    parser.add_argument("--probe-hz", type=float, default=20.0, help="link round-trip probes per second")
    parser.add_argument("--poll-hz", type=float, default=20.0, help="GET /v1/nodes per second while polled")
    parser.add_argument("--poll-etag", action="store_true", help="the poller sends If-None-Match")
    parser.add_argument("--placements", type=int, default=400, help="containers created per placement phase")
    parser.add_argument("--clients", type=int, default=8, help="REST clients placing at once")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any phase may take at most")
    parser.add_argument("--against", metavar="REV", help="also run a manager of this git revision, alternating")
    parser.add_argument("--before-retry", choices=["agent", "old"], default="old",
                        help="the retry policy of the agents of --against's manager")
    parser.add_argument("--reps", type=int, default=1, help="runs of each variant")
    parser.add_argument("--keep", action="store_true", help="keep the manager's log")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    info = machine(zmq=zmq.zmq_version(), pyzmq=zmq.__version__)
    staged = Path(tempfile.mkdtemp(prefix="gpumgr-fleet-tree-")) if args.against else None
    try:
        variants: list[tuple[str, str, Path | None]] = [("this tree", args.retry, None)]
        if args.against and staged is not None:
            variants = [(f"before ({args.against})", args.before_retry, stage(args.against, staged)),
                        ("after (this tree)", args.retry, None)]
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in variants}
        for rep in range(args.reps):
            for name, retry, path in variants:
                print(f"rep {rep + 1}/{args.reps}: {name}", file=sys.stderr)
                out = run(args, retry, path)
                report(args, out, f"{name}, rep {rep + 1}")
                runs[name].append(out)
    finally:
        if staged is not None:
            shutil.rmtree(staged, ignore_errors=True)
    heads = {name: {k: median(h[k] for h in map(headline, outs)) for k in headline(outs[0])}
             for name, outs in runs.items()}
    names = list(heads)
    columns = [("medians over reps", "44"), *((n[:16], "16,.2f") for n in names)]
    rows = [[k, *(heads[n][k] for n in names)] for k in heads[names[0]]]
    if len(names) == 2:
        columns.append(("after/before", "12.2f"))
        for row in rows:
            row.append(row[2] / row[1] if row[1] else float("nan"))
    table(columns, rows, lead="\n")
    print(machine_line(info) + f"; load average at start {info['loadavg_at_start']}")
    save(args.json, "fleet", args, machine=info, headline=heads, runs=runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
