"""What ``GET /v1/nodes`` costs the manager itself, step by step, on a map of ``--nodes`` × ``--gpus`` in one process.

No sockets and no other threads: a :class:`~gpumgr.manager.model.cluster.Cluster` is filled as
``bench/scheduler.py`` fills it (80% reserved), served by the real :class:`NodesCache` through Flask's
test client, and each step is timed ``--reps`` times (median and p99, in ms):

* whole map, first build: every node's part encoded (what the first poll after start pays);
* ``?since=`` with nothing changed: what a poller at 20 Hz usually asks for;
* ``?since=`` after one grant: one node re-encoded, the whole body joined again, the changes sent;
* whole map after one grant, plain and gzipped (the gzip made on the request's thread);
* the background pass, every half second while polled: ``last_seen`` moved half a second on every
  node (the nodes past their step are listed again) and a slice of the nodes compared whole.

What it shows is the server's own share of a poll's latency; the rest (``bench/fleet.py``'s p99)
is the HTTP server, the network stack and waiting for a CPU.

    python bench/nodes_since.py [--nodes 1000] [--gpus 8] [--reps 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flask import Flask, request

from bench.harness import GiB, machine, machine_line, pct, save, table
from bench.scheduler import build
from gpumgr.manager.api import nodes_cache
from gpumgr.manager.api.nodes_cache import NodesCache
from gpumgr.manager.model.cluster import PlacementSpec, State


def timed(step: Callable[[], Any], reps: int, before: Callable[[], Any] = lambda: None) -> list[float]:
    """``step()`` ``reps`` times, ``before()`` untimed ahead of each; the times in ms."""
    out = []
    for _ in range(reps):
        before()
        t0 = time.perf_counter()
        step()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    info = machine()
    cluster, _ = build(args.nodes, args.gpus, 80, 0.8, 1)
    cache = NodesCache(cluster)
    flask_app = Flask(__name__, root_path=str(Path(__file__).parent))

    @flask_app.get("/v1/nodes")
    def nodes() -> Any:
        return cache.response(request)

    client = flask_app.test_client()
    spec = PlacementSpec(memory=GiB, count=1, placement="spread", image="img", command=["sleep", "1"])
    cache._asked = float("inf")  # no background thread: the passes are timed here, one at a time

    made: list[str] = []

    def grant() -> None:  # one grant more (ended at the end): its node's figures change
        made.append(cluster.reserve(spec).id)

    def beat() -> None:
        with cluster.ledger.lock:
            for node in cluster.ledger.nodes.values():
                node.last_seen += 0.5  # every node heartbeat since the last pass (half a second), figures unchanged

    rows: dict[str, list[float]] = {}
    rows["whole map, first build (1 rep)"] = timed(lambda: client.get("/v1/nodes"), 1)
    version = client.get("/v1/nodes").json["version"]
    rows["?since= nothing changed"] = timed(lambda: client.get(f"/v1/nodes?since={version}"), args.reps)
    held = {"version": version}

    def changes() -> None:  # as a poller does: the next asks since this answer's version
        held["version"] = client.get(f"/v1/nodes?since={held['version']}").json["version"]

    rows["?since= after one grant"] = timed(changes, args.reps, grant)
    rows["whole map after one grant, plain"] = timed(
        lambda: client.get("/v1/nodes", headers={"Accept-Encoding": "identity"}), args.reps // 4, grant)
    rows["whole map after one grant, gzip"] = timed(
        lambda: client.get("/v1/nodes", headers={"Accept-Encoding": "gzip"}), args.reps // 4, grant)
    rows["background pass (heartbeats between)"] = timed(lambda: cache._refresh(whole=True), args.reps // 4, beat)
    for cid in made:
        cluster.finish(cid, State.EXITED)
    table([("step", "40"), ("p50 ms", "9.3f"), ("p99 ms", "9.3f"), ("max ms", "9.3f")],
          [[name, pct(v, 0.5), pct(v, 0.99), max(v)] for name, v in rows.items()], lead="\n")
    size = len(client.get("/v1/nodes", headers={"Accept-Encoding": "identity"}).data)
    print(f"\n{args.nodes} nodes x {args.gpus} GPUs: whole body {size:,} bytes; SEEN_STEP {nodes_cache.SEEN_STEP} s")
    print(machine_line(info) + f"; load average at start {info['loadavg_at_start']}")
    save(args.json, "nodes_since", args, machine=info, ms=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
