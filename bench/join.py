"""How long ``--agents`` agents take to join one manager over the CURVE link, all at once.

Each repetition starts a fresh in-process ``Manager`` (its own state directory, so every agent is new
to it) and then, from one thread with a poller, ``--agents`` scripted agents on raw DEALER sockets
(as ``tests/fake_agent.py`` does, without a thread each): each generates a key pair, connects as a
CURVE client of the manager's key from the join token, sends ``Join`` with ``security.join_proof``,
waits for the ``Reply``, sends ``Register`` with ``--gpus`` GPUs and waits for ``Registered``. All are
started back to back, so the manager sees them as a thundering herd (a rack powering on).

Reported per repetition: the wall time from the first agent's key to the last ``Registered``, to
``manager.cluster.ready_nodes()`` counting them all, and each agent's join (key → ``Reply``) and whole
(key → ``Registered``) time; the table gives medians over repetitions. For reference, the cost of
``Admission.admit`` alone (the join's disk write: ``nodes.json`` rewritten and fsynced, on the link
thread) is timed on its own for the same number of nodes, and so is ``Admission.admit_later`` (the
writes batched on a writer thread): from the first call to the last join settled.

    python bench/join.py [--agents 200] [--reps 5] [--gpus 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import zmq

from bench.harness import GiB, machine, machine_line, median, save, summary, table
from gpumgr.manager.config import ManagerSettings
from gpumgr.manager.link.admission import Admission
from gpumgr.manager.service import Manager
from gpumgr.wire import protocol, security


@dataclass
class Agent:
    """One scripted agent's socket and the moments of its join."""

    node: str
    socket: zmq.Socket[bytes]
    start: float
    joined: float = 0.0
    registered: float = 0.0
    gpus: list[protocol.GpuInfo] = field(default_factory=list)


def one_run(n: int, gpus: int, heartbeat_interval: float, timeout: float) -> dict[str, list[float] | float]:
    """Join ``n`` agents to a fresh manager; their times in seconds."""
    tmp = tempfile.mkdtemp(prefix="gpumgr-bench-join-")
    manager = Manager(ManagerSettings(agents="tcp://127.0.0.1:0", state_dir=tmp, heartbeat_interval=heartbeat_interval))
    manager.start()
    server_public, secret = security.parse_token(manager.admission.token())
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    poller = zmq.Poller()
    agents: dict[zmq.Socket[bytes], Agent] = {}
    ready_at = registered = 0.0
    try:
        t0 = time.perf_counter()
        for i in range(n):
            start, keys, node = time.perf_counter(), security.KeyPair.generate(), f"join-{i:04d}"
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            security.connect_curve(sock, keys, server_public)
            sock.connect(manager.link.bound_endpoint)
            sock.send(protocol.encode(protocol.Join(node=node, proof=security.join_proof(secret, keys.public, node))))
            poller.register(sock, zmq.POLLIN)
            agents[sock] = Agent(node, sock, start, gpus=[protocol.GpuInfo(uuid=f"GPU-{node}-{g}", index=g,
                                                                             name="Sim", memory_total=80 * GiB)
                                                          for g in range(gpus)])
        done = 0
        while done < n or not ready_at:
            events = poller.poll(int(timeout * 1000)) if done < n else []
            if done < n and not events:
                raise RuntimeError(f"no answer from the manager within {timeout} s ({done}/{n} registered)")
            for sock, _ in events:
                _, message = protocol.decode(sock.recv())
                now, agent = time.perf_counter(), agents[sock]
                if isinstance(message, protocol.Reply):
                    if not message.ok:
                        raise RuntimeError(f"{agent.node} was refused: {message.error}")
                    agent.joined = now
                    sock.send(protocol.encode(protocol.Register(node=agent.node, runtime="docker", gpus=agent.gpus)))
                elif isinstance(message, protocol.Registered):
                    agent.registered, done = now, done + 1
                    poller.unregister(sock)
                    registered = now if done == n else registered
            if not ready_at and manager.cluster.ready_nodes() == n:
                ready_at = time.perf_counter()
            if done == n and not ready_at:
                time.sleep(0.0005)
    finally:
        for sock in agents:
            sock.close(linger=0)
        ctx.term()
        manager.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"all_registered_s": registered - t0, "all_ready_s": ready_at - t0,
            "started_s": max(a.start for a in agents.values()) - t0,
            "join_s": [a.joined - a.start for a in agents.values()],
            "whole_s": [a.registered - a.start for a in agents.values()]}


def new_joins(tmp: str, n: int) -> tuple[Admission, list[tuple[str, str, str]]]:
    """An Admission in ``tmp`` and ``n`` joins of new nodes for it: (key, node, proof)."""
    admission = Admission(tmp)
    secret = admission.join_secret()
    keys = [(security.KeyPair.generate().public, f"join-{i:04d}") for i in range(n)]
    return admission, [(key, node, security.join_proof(secret, key, node)) for key, node in keys]


def admit_alone(n: int) -> list[float]:
    """Seconds of each ``Admission.admit`` of ``n`` new nodes in a fresh state directory (no link)."""
    tmp = tempfile.mkdtemp(prefix="gpumgr-bench-admit-")
    try:
        admission, joins = new_joins(tmp, n)
        out = []
        for key, node, proof in joins:
            t0 = time.perf_counter()
            admission.admit(key, node, proof)
            out.append(time.perf_counter() - t0)
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def admit_batched(n: int) -> float:
    """Seconds from the first of ``n`` ``Admission.admit_later`` calls to the last join settled (bindings on disk)."""
    tmp = tempfile.mkdtemp(prefix="gpumgr-bench-admit-")
    try:
        admission, joins = new_joins(tmp, n)
        settled = threading.Semaphore(0)
        t0 = time.perf_counter()
        for key, node, proof in joins:
            admission.admit_later(key, node, proof, lambda error: settled.release())
        for _ in range(n):
            settled.acquire()
        return time.perf_counter() - t0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=200, help="agents joining at once")
    parser.add_argument("--reps", type=int, default=5, help="repetitions, each on a fresh manager")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs each agent registers")
    parser.add_argument("--heartbeat-interval", type=float, default=30.0,
                        help="the manager's; long, so that no node is marked down before all are in")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds without any answer before giving up")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    info = machine(zmq=zmq.zmq_version(), pyzmq=zmq.__version__)

    runs = []
    for rep in range(args.reps):
        run = one_run(args.agents, args.gpus, args.heartbeat_interval, args.timeout)
        runs.append(run)
        print(f"  rep {rep + 1}/{args.reps}: all {args.agents} registered in {run['all_registered_s']:.3f} s, "
              f"ready in {run['all_ready_s']:.3f} s", file=sys.stderr)
    admits = admit_alone(args.agents)
    batched = admit_batched(args.agents)

    def med(key: str) -> float:
        return median(r[key] for r in runs)  # type: ignore[misc]

    def quantile(key: str, q: str) -> float:
        return median(summary(r[key], 1e3)[q] for r in runs)  # type: ignore[arg-type]

    rows = [[f"all {args.agents} agents started (keys, sockets)", med("started_s") * 1e3, "", ""],
            [f"all {args.agents} Registered", med("all_registered_s") * 1e3, "", ""],
            [f"all {args.agents} ready in manager.cluster", med("all_ready_s") * 1e3, "", ""],
            ["one agent: key -> join Reply", quantile("join_s", "p50"), quantile("join_s", "p99"),
             quantile("join_s", "max")],
            ["one agent: key -> Registered", quantile("whole_s", "p50"), quantile("whole_s", "p99"),
             quantile("whole_s", "max")]]
    s = summary(admits, 1e3)
    rows.append([f"Admission.admit alone ({args.agents} nodes)", s["p50"], s["p99"], s["max"]])
    table([(f"{args.agents} agents joining at once (median of {args.reps} reps)", "50"), ("ms / p50 ms", "12.1f"),
           ("p99 ms", "8"), ("max ms", "8")],
          [[r[0], r[1], *(f"{v:8.1f}" if v != "" else " " * 8 for v in r[2:])] for r in rows], lead="\n")
    print(f"\nAdmission.admit total for {args.agents} nodes: {sum(admits) * 1e3:.0f} ms; "
          f"Admission.admit_later, first call to last settled: {batched * 1e3:.0f} ms")
    print(machine_line(info))
    save(args.json, "join", args, machine=info, runs=runs, admit_s=admits, admit_later_all_s=batched,
         medians={"all_registered_s": med("all_registered_s"), "all_ready_s": med("all_ready_s"),
                  "join_p50_ms": quantile("join_s", "p50"), "join_p99_ms": quantile("join_s", "p99"),
                  "whole_p50_ms": quantile("whole_s", "p50"), "whole_p99_ms": quantile("whole_s", "p99")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
