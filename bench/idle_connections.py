"""``GET /v1/nodes`` requests/s and p99 with no idle connections open, and with ``--idle`` of them open.

Starts a ``gpumgr manager`` child process on free loopback ports (``bench.harness.stack``) with
``--nodes`` fake nodes registered (``tests/fake_agent.py``, real DEALER sockets), then, in the same
run and interleaved (baseline, idle, baseline, idle, ...), loads ``GET /v1/nodes`` with ``wrk`` (or a
threaded Python client when wrk is missing) while this process holds either no extra connection or
``--idle`` TCP connections to the API that send nothing, of which ``--slow`` have sent half a request
(a request line and a header, never the blank line) and add one byte to it every second.

Before each loaded phase it checks that the manager has accepted every held connection (its open
file descriptors grew by as many), so the connections sit in the server, not in the kernel's backlog.

    python bench/idle_connections.py [--idle 500] [--slow 100] [--nodes 20] [--duration 10] [--reps 3] [--json out]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import machine, machine_line, median, save, stack, table, wait_for
from bench.nodes_map import run_python_client, run_wrk
from tests.fake_agent import FakeAgent


def raise_open_files(need: int) -> int:
    """Raise this process's soft open-file limit to at least ``need`` (up to the hard limit); return it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        soft = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft


def open_fds(pid: int) -> int:
    """How many file descriptors ``pid`` holds."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def settled(pid: int, quiet: float = 0.5) -> int:
    """``open_fds(pid)`` once it has not changed for ``quiet`` seconds."""
    last = open_fds(pid)
    while True:
        time.sleep(quiet)
        if (now := open_fds(pid)) == last:
            return now
        last = now


class Held:
    """``idle`` connections to ``port``; the last ``slow`` of them trickle an unfinished request, a byte a second."""

    def __init__(self, port: int, idle: int, slow: int) -> None:
        self.socks: list[socket.socket] = []
        self.slow = slow
        self.stop = threading.Event()
        for i in range(idle):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            if i >= idle - slow:
                sock.sendall(b"GET /v1/nodes HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            self.socks.append(sock)
        self.thread = threading.Thread(target=self._trickle, daemon=True)
        self.thread.start()

    def _trickle(self) -> None:
        while not self.stop.wait(1.0):
            for sock in self.socks[len(self.socks) - self.slow:]:
                with contextlib.suppress(OSError):
                    sock.sendall(b"a")

    def alive(self) -> int:
        """How many held connections the server has not closed (a peek that finds EOF means closed)."""
        count = 0
        for sock in self.socks:
            sock.setblocking(False)
            try:
                count += sock.recv(1, socket.MSG_PEEK) != b""
            except BlockingIOError:
                count += 1
            except OSError:
                pass
            finally:
                sock.setblocking(True)
        return count

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for sock in self.socks:
            with contextlib.suppress(OSError):
                sock.close()


def measure(args: argparse.Namespace, load: Any) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    env = {"GPUMGR_HEARTBEAT_LIVENESS": "100000", "GPUMGR_LOG_LEVEL": "WARNING"}
    results: dict[str, list[dict[str, Any]]] = {}
    facts: dict[str, Any] = {}
    with stack(agents=0, name="bench-idle", manager_env=env) as s:
        port = int(s.url.rsplit(":", 1)[1])
        token = {"token": s.join_token} if s.join_token else {}
        agents = [FakeAgent(s.endpoint, node=f"node-{n:03d}", gpus=args.gpus, **token) for n in range(args.nodes)]
        try:
            for agent in agents:
                agent.register()
            url = f"{s.url}/v1/nodes"
            facts["body_bytes"] = len(s.api.get("/v1/nodes").content)
            load(url, args.wrk_threads, args.connections, 1)  # warm-up
            quiet = settled(s.manager.pid)
            names = {0: "0 idle connections", args.idle: f"{args.idle} idle ({args.slow} of them half-sent)"}
            for rep in range(args.reps):
                for count, name in names.items():
                    # the connections of the last phase closed: back to the descriptors the manager holds at rest
                    base_fds = wait_for(lambda: (n := settled(s.manager.pid)) <= quiet and n, 30,
                                        what=f"the manager to close the last phase's connections (at rest: {quiet})")
                    held = Held(port, count, args.slow if count else 0)
                    try:
                        # every held connection accepted by the server, not waiting in the kernel's backlog
                        try:
                            # (less a few: a descriptor of the last phase may still have been closing)
                            wait_for(lambda c=count, b=base_fds: open_fds(s.manager.pid) >= b + c - 4, 30)
                        except TimeoutError:
                            raise RuntimeError(f"the manager holds {open_fds(s.manager.pid)} descriptors, not "
                                               f"{base_fds} + {count}; {held.alive()} of the held connections are "
                                               "open") from None
                        fds = open_fds(s.manager.pid)
                        result = load(url, args.wrk_threads, args.connections, args.duration)
                        result["manager_fds"] = fds
                        result["held_alive_after"] = held.alive()
                    finally:
                        held.close()
                    results.setdefault(name, []).append(result)
                    print(f"  rep {rep + 1}/{args.reps} {name}: {result['rps']:,.0f} req/s, p99 {result['p99_ms']} ms, "
                          f"manager fds {fds}, held still open {result['held_alive_after']}/{count}", file=sys.stderr)
        finally:
            for agent in agents:
                agent.close()
    return results, facts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle", type=int, default=500, help="connections held open in the loaded phase")
    parser.add_argument("--slow", type=int, default=100, help="of those, how many trickle a half-sent request")
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per load run")
    parser.add_argument("--reps", type=int, default=3, help="load runs per phase, interleaved")
    parser.add_argument("--wrk-threads", type=int, default=2)
    parser.add_argument("--connections", type=int, default=8, help="the load generator's own connections")
    parser.add_argument("--python-client", action="store_true", help="use the Python client even if wrk exists")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if not 0 <= args.slow <= args.idle:
        parser.error("--slow must be between 0 and --idle")

    files = raise_open_files(args.idle + args.connections + 256)
    if files < args.idle + args.connections + 64:
        parser.error(f"the open-file limit ({files}) is too low for --idle {args.idle}")
    use_wrk = shutil.which("wrk") is not None and not args.python_client
    if not use_wrk:
        print("wrk not found (apt-get install -y wrk): using the threaded Python client", file=sys.stderr)
    info = machine()
    started = time.monotonic()
    results, facts = measure(args, run_wrk if use_wrk else run_python_client)

    summary: dict[str, Any] = {}
    for name, runs in results.items():
        rps = [r["rps"] for r in runs]
        p99 = [r["p99_ms"] for r in runs if r["p99_ms"] is not None]
        summary[name] = {"median_rps": median(rps), "min_rps": min(rps), "max_rps": max(rps),
                         "median_p50_ms": median(r["p50_ms"] for r in runs if r["p50_ms"] is not None),
                         "median_p99_ms": median(p99) if p99 else float("nan"), "max_p99_ms": max(p99, default=0.0),
                         "non_2xx": sum(r["non_2xx"] for r in runs), "runs": runs}
    table([("GET /v1/nodes with", "34"), ("median req/s", "13,.0f"), ("min", "9,.0f"), ("max", "9,.0f"),
           ("p50 ms", "8.2f"), ("p99 ms", "8.2f"), ("max p99", "8.2f")],
          [[name, *(s[k] for k in ("median_rps", "min_rps", "max_rps", "median_p50_ms", "median_p99_ms",
                                   "max_p99_ms"))] for name, s in summary.items()], lead="\n")
    base, loaded = (summary[n]["median_rps"] for n in summary)
    errors = [r.get("socket_errors") for runs in results.values() for r in runs if r.get("socket_errors")]
    print(f"\nload: {'wrk' if use_wrk else 'python client'} -t{args.wrk_threads} -c{args.connections} "
          f"-d{args.duration:g}s x {args.reps} per phase; {args.nodes} nodes x {args.gpus} GPUs, body "
          f"{facts['body_bytes']:,} B; non-2xx {sum(s['non_2xx'] for s in summary.values())}; "
          f"socket errors: {errors or 'none'}")
    print(f"idle/baseline req/s = {loaded / base:.3f}; {time.monotonic() - started:.0f} s; {machine_line(info)}")
    save(args.json, "idle_connections", args, machine=info, client="wrk" if use_wrk else "python",
         results=summary, ratio=loaded / base, **facts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
