"""``GET /v1/nodes`` throughput with ``--nodes`` fake nodes of ``--gpus`` GPUs registered.

Starts a ``gpumgr manager`` child process (16 waitress threads, its default) on free loopback
ports (``bench.harness.stack``), registers the nodes over real DEALER sockets speaking the agent protocol
(``tests/fake_agent.py``), keeps them heartbeating every ``--beat`` seconds from one thread (the
manager also gets ``GPUMGR_HEARTBEAT_LIVENESS=100000`` so a starved heartbeat thread cannot take a
node down mid-run), and measures requests/s with ``wrk`` (or a threaded Python client when wrk is
missing). For reference, in the same run and interleaved with it (manager, hello, hello-json,
manager, ...), the same load goes to a hello-world Flask app on waitress with the same thread count
(``bench/hello_waitress.py``): ``GET /`` (tiny body), ``GET /json`` (a JSON body of the same
size as the nodes map, serialized per request) and ``GET /cached`` (those bytes serialized once).

    python bench/nodes_map.py [--nodes 100] [--gpus 8] [--duration 10] [--reps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import http.client
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import requests
import zmq

from bench.harness import Proc, Stack, answers, free_port, median, save, stack, table, wait_for
from tests.fake_agent import FakeAgent

HERE = Path(__file__).resolve().parent
UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}


class Heartbeats:
    """One thread that heartbeats every agent every ``interval`` seconds and drains what comes back."""

    def __init__(self, agents: list[FakeAgent], interval: float) -> None:
        self.agents, self.interval = agents, interval
        self.stop = threading.Event()
        self.beats = 0
        self.thread = threading.Thread(target=self._run, name="heartbeats", daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            start = time.monotonic()
            for agent in self.agents:
                agent.heartbeat()
                while agent.socket.poll(0):
                    agent.socket.recv(zmq.NOBLOCK)
                self.beats += 1
            self.stop.wait(max(0.0, self.interval - (time.monotonic() - start)))


def run_wrk(url: str, threads: int, connections: int, duration: float) -> dict:
    """One wrk run; requests/s, latency percentiles (ms) and any errors."""
    out = subprocess.run(["wrk", f"-t{threads}", f"-c{connections}", f"-d{duration:g}s", "--latency", url],
                         capture_output=True, text=True, timeout=duration + 60, check=True).stdout
    result = {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))}
    for q in ("50", "90", "99"):
        m = re.search(rf"^\s+{q}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        result[f"p{q}_ms"] = float(m.group(1)) * UNITS[m.group(2)] if m else None
    m = re.search(r"(\d+) requests in", out)
    result["requests"] = int(m.group(1)) if m else None
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errs = re.search(r"Socket errors:.*", out)
    result["non_2xx"] = int(bad.group(1)) if bad else 0
    result["socket_errors"] = errs.group(0) if errs else None
    return result


def run_python_client(url: str, threads: int, connections: int, duration: float) -> dict:
    """Fallback load generator: ``connections`` keep-alive clients in threads (``threads`` is ignored)."""
    host, port, path = re.match(r"http://([^:/]+):(\d+)(/.*)", url).groups()
    stop_at = time.perf_counter() + duration
    latencies: list[list[float]] = [[] for _ in range(connections)]
    bad = [0] * connections

    def client(i: int) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        while (t0 := time.perf_counter()) < stop_at:
            conn.request("GET", path)
            reply = conn.getresponse()
            reply.read()
            latencies[i].append((time.perf_counter() - t0) * 1000)
            bad[i] += reply.status >= 300
        conn.close()

    start = time.perf_counter()
    workers = [threading.Thread(target=client, args=(i,)) for i in range(connections)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - start
    flat = sorted(x for lat in latencies for x in lat)
    at = lambda q: flat[min(len(flat) - 1, int(q * len(flat)))]  # noqa: E731
    return {"rps": len(flat) / elapsed, "p50_ms": at(0.5), "p90_ms": at(0.9), "p99_ms": at(0.99),
            "requests": len(flat), "non_2xx": sum(bad), "socket_errors": None}


def hello_server(s: Stack, threads: int, json_bytes: int) -> tuple[Proc, str]:
    """``bench/hello_waitress.py`` on a free port, answering; returns it and its URL."""
    port = free_port()
    hello = Proc([sys.executable, str(HERE / "hello_waitress.py"), "--port", str(port), "--threads", str(threads),
                  "--json-bytes", str(json_bytes)], s.tmp / "hello.log")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: answers(url), 20, what="the hello server")
    return hello, url


def measure(args: argparse.Namespace, load: Any) -> tuple[dict[str, list[dict]], int, int]:
    """Register the fake nodes, then load every target in turn; (runs per target, body bytes, nodes ready)."""
    env = {"GPUMGR_HEARTBEAT_LIVENESS": "100000", "GPUMGR_THREADS": str(args.server_threads),
           "GPUMGR_LOG_LEVEL": "WARNING"}
    results: dict[str, list[dict]] = {}
    with stack(agents=0, name="bench-nodes", manager_env=env) as s:
        token = {"token": s.join_token} if s.join_token else {}  # a secured link (gpumgr.wire.security)
        agents = [FakeAgent(s.endpoint, node=f"node-{n:03d}", gpus=args.gpus, **token) for n in range(args.nodes)]
        beats = Heartbeats(agents, args.beat)
        hello = None
        try:
            for agent in agents:
                agent.register()
            if args.beat > 0:
                beats.thread.start()
            nodes = s.api.get("/v1/nodes").json()["nodes"]
            ready = sum(n["state"] == "ready" for n in nodes)
            body_bytes = len(s.api.get("/v1/nodes").content)
            print(f"manager: {len(nodes)} nodes ({ready} ready) x {args.gpus} GPUs; /v1/nodes body {body_bytes:,} B",
                  file=sys.stderr)
            hello, hello_url = hello_server(s, args.server_threads, body_bytes)
            json_bytes = len(requests.get(f"{hello_url}/json", timeout=5).content)
            targets = {"gpumgr GET /v1/nodes": f"{s.url}/v1/nodes",
                       "hello GET / (tiny)": f"{hello_url}/",
                       f"hello GET /json ({json_bytes // 1000} kB)": f"{hello_url}/json",
                       f"hello GET /cached ({json_bytes // 1000} kB)": f"{hello_url}/cached"}
            for url in targets.values():  # warm-up
                load(url, args.wrk_threads, args.connections, 1)
            for rep in range(args.reps):
                for name, url in targets.items():
                    r = load(url, args.wrk_threads, args.connections, args.duration)
                    results.setdefault(name, []).append(r)
                    print(f"  rep {rep + 1}/{args.reps} {name}: {r['rps']:,.0f} req/s, p50 {r['p50_ms']} ms",
                          file=sys.stderr)
            still_ready = sum(n["state"] == "ready" for n in s.api.get("/v1/nodes").json()["nodes"])
        finally:
            beats.stop.set()
            if beats.thread.is_alive():
                beats.thread.join(5)
            for agent in agents:
                agent.close()
            if hello is not None:
                hello.stop()
    return results, body_bytes, still_ready


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    parser.add_argument("--beat", type=float, default=1.0, help="heartbeat interval; 0 sends none")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per load run")
    parser.add_argument("--reps", type=int, default=3, help="load runs per target, interleaved")
    parser.add_argument("--wrk-threads", type=int, default=2)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--server-threads", type=int, default=16, help="waitress threads of both servers")
    parser.add_argument("--python-client", action="store_true", help="use the Python client even if wrk exists")
    parser.add_argument("--target", type=float, default=3000.0, help="requests/s target for /v1/nodes")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    use_wrk = shutil.which("wrk") is not None and not args.python_client
    if not use_wrk:
        print("wrk not found (apt-get install -y wrk): using the threaded Python client", file=sys.stderr)
    results, body_bytes, still_ready = measure(args, run_wrk if use_wrk else run_python_client)

    summary = {}
    for name, runs in results.items():
        rps = [r["rps"] for r in runs]
        summary[name] = {"median_rps": median(rps), "min_rps": min(rps), "max_rps": max(rps),
                         **{f"median_{k}": _median(runs, k) for k in ("p50_ms", "p90_ms", "p99_ms")}, "runs": runs}
    table([("target", "30"), ("median req/s", "13,.0f"), ("min", "9,.0f"), ("max", "9,.0f"), ("p50 ms", "8.2f"),
           ("p90 ms", "8.2f"), ("p99 ms", "8.2f")],
          [[name, *(s[k] for k in ("median_rps", "min_rps", "max_rps", "median_p50_ms", "median_p90_ms",
                                   "median_p99_ms"))] for name, s in summary.items()], lead="\n")
    names = list(summary)
    nodes_rps = summary[names[0]]["median_rps"]
    ratio_tiny = nodes_rps / summary[names[1]]["median_rps"]
    ratio_json = nodes_rps / summary[names[2]]["median_rps"]
    ratio_cached = nodes_rps / summary[names[3]]["median_rps"]
    met = nodes_rps >= args.target
    errors = sum(r["non_2xx"] for runs in results.values() for r in runs)
    print(f"\nload: {'wrk' if use_wrk else 'python client'} -t{args.wrk_threads} -c{args.connections} "
          f"-d{args.duration:g}s x {args.reps}; non-2xx: {errors}; nodes ready at the end: {still_ready}/{args.nodes}")
    print(f"ratio /v1/nodes vs hello tiny = {ratio_tiny:.3f}, vs same-size JSON = {ratio_json:.3f}, "
          f"vs same-size cached bytes = {ratio_cached:.3f}; "
          f"target >= {args.target:,.0f} req/s -> {'MET' if met else 'MISSED'}")
    save(args.json, "nodes_map", args, client="wrk" if use_wrk else "python", nodes_body_bytes=body_bytes,
         results=summary, ratio_vs_hello_tiny=ratio_tiny, ratio_vs_hello_json=ratio_json,
         ratio_vs_hello_cached=ratio_cached, non_2xx=errors, nodes_ready_at_end=still_ready, target_rps=args.target,
         target_met=met)
    return 0


def _median(runs: list[dict], key: str) -> float:
    return median(r[key] for r in runs if r[key] is not None)


if __name__ == "__main__":
    sys.exit(main())
