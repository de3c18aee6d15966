"""The wait queue: how soon a queued request runs once room frees, and what 10,000 waiting cost placements.

Part 1, the real stack (``bench.harness.stack``: a ``gpumgr manager`` and one ``gpumgr agent`` on the
Docker runtime with one simulated 8 GiB GPU, network mode ``none``), ``--trials`` interleaved pairs
after ``--warmup`` untimed ones (the order A, B / B, A alternates):

  A  queued:  POST a 6 GiB blocker (201), POST 5 GiB with "queue": true (202, queued), then
     DELETE the blocker (200). Room freed is the blocker's final ``removed`` event (the manager
     records it as it releases the grant); from it to the queued record's ``placed`` event is the
     dispatch latency, to its ``started`` event (the agent's reply to the create) the time to running.
     All three times are the manager's clock (``GET /v1/events``); the same gaps from the client's
     receipt of the DELETE's 200 are reported too.
  B  plain:   POST 5 GiB on the free GPU until its 201 (state running), timed by the client; its
     placed→started gap from the events is the agent's share, the same work as in A.

Containers run ``sh`` that exits on SIGTERM, so no DELETE waits out the stop grace; each is removed
after its trial, outside the timed part, and the stack removes whatever this run made even on failure.

Part 2, in-process (no Docker, no sockets): a ``Cluster`` of ``--nodes`` × ``--gpus`` GPUs of 80 GiB,
each GPU holding a 2 GiB grant, plus node ``full`` (8 GPUs, each wholly granted). Placements per second
of submit(1 GiB, priority 10, queue false) + finish(removed), in ``--rounds`` interleaved rounds of
``--seconds`` each, on four maps:

  empty    nothing queued (submit's fast path)
  pinned1  1 request queued: 1 GiB pinned to node ``full`` (priority 0), it stays queued
  pinned   ``--queued`` such requests
  big      ``--queued`` requests of 79 GiB, any node (priority 0): no GPU has 79 GiB free while each
           holds its 2 GiB grant, so they stay queued; being unpinned, the blocked head makes every
           walk consider preemption on every GPU

Queue aging is ``--aging`` (3600 s) so that the priority-10 requests stay ahead of the waiting ones
for the whole run (a new request is placed now only if it is first, in queue order, among those that
fit). Also timed: ``Cluster.dispatch()`` with the queue's head blocked, enqueueing ``--queued``
requests with and without the journal (``state_dir`` set and opened as the manager does: one fsync
per queued request), and the memory each queued request adds (tracemalloc).

    python bench/wait_queue.py [--trials 20] [--warmup 2] [--seconds 2] [--rounds 5] [--queued 10000] [--json out.json]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import GiB, Stack, machine, machine_line, median, save, stack, summary, table, wait_for
from gpumgr.manager.model.cluster import Cluster
from gpumgr.manager.model.records import PlacementSpec
from gpumgr.wire.names import State
from gpumgr.wire.protocol import GpuInfo
from tests.images import IMAGE

#: A container that ends at once on SIGTERM (``wait`` is interrupted by the trapped signal).
POLITE = ["sh", "-c", "trap 'exit 0' TERM; while :; do sleep 1 & wait $!; done"]
FULL = "full"
CASES = ("empty", "pinned1", "pinned", "big")


# --- part 1: the real stack ------------------------------------------------------------------------
class StackTrials:
    """The two trials on one stack; each returns its timings in seconds."""

    def __init__(self, s: Stack) -> None:
        self.s = s
        self.mark = max((e["id"] for e in s.events()), default=0)

    def body(self, memory: str, **extra: Any) -> dict[str, Any]:
        return {"image": IMAGE, "command": POLITE, "gpu_memory": memory, "labels": self.s.labels, **extra}

    def events(self) -> dict[str, dict[str, float]]:
        """Per container, the manager's times of its placed, started and final removed events since the last call."""
        found: dict[str, dict[str, float]] = {}
        for event in self.s.events(self.mark, type="placed,started,removed"):
            self.mark = max(self.mark, int(event["id"]))
            if event["container"] and (event["type"] != "removed" or event.get("final")):
                found.setdefault(str(event["container"]), {}).setdefault(str(event["type"]), float(event["time"]))
        return found

    def delete(self, cid: str) -> float:
        """DELETE ``cid``; the client's time.time() when its 200 arrived."""
        reply = self.s.api.delete(f"/v1/containers/{cid}")
        at = time.time()
        if reply.status_code != 200:
            raise RuntimeError(f"DELETE {cid} answered {reply.status_code}: {reply.text}")
        return at

    def queued(self) -> dict[str, float]:
        """A: blocker, queued request, DELETE the blocker; the gaps from room freed to placed and to running."""
        blocker = self.s.create(self.body("6GiB"))["id"]
        reply = self.s.api.post("/v1/containers", json=self.body("5GiB", queue=True))
        if reply.status_code != 202 or reply.json()["state"] != "queued":
            raise RuntimeError(f"the queued POST answered {reply.status_code}: {reply.text}")
        qid = reply.json()["id"]
        self.events()  # move the mark past the blocker's own placed/started events
        freed_client = self.delete(blocker)

        def running() -> bool:
            state = self.s.api.get(f"/v1/containers/{qid}").json()["state"]
            if state not in ("queued", "creating", "running"):
                raise RuntimeError(f"queued request {qid} ended {state} instead of running")
            return bool(state == "running")

        try:
            wait_for(running, 30, interval=0.01, what=f"queued request {qid} to run")
            found = self.events()
        finally:
            self.delete(qid)
        times, freed = found.get(qid, {}), found.get(blocker, {}).get("removed")
        if freed is None or "placed" not in times or "started" not in times:
            raise RuntimeError(f"missing events for blocker {blocker} / queued {qid}: {found}")
        return {"placed": times["placed"] - freed, "running": times["started"] - freed,
                "agent": times["started"] - times["placed"], "placed_client": times["placed"] - freed_client,
                "running_client": times["started"] - freed_client}

    def plain(self) -> dict[str, float]:
        """B: POST 5 GiB on a free GPU until its 201; the client's time and the manager's placed→started."""
        t0 = time.perf_counter()
        record = self.s.create(self.body("5GiB"))
        dt = time.perf_counter() - t0
        try:
            times = self.events().get(record["id"], {})
        finally:
            self.delete(record["id"])
        return {"created": dt, "agent": times["started"] - times["placed"]}


def run_stack(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """``--warmup`` + ``--trials`` pairs of A and B, alternating which goes first."""
    samples: dict[str, dict[str, list[float]]] = {"queued": {}, "plain": {}}
    with stack(1, name="bench-queue", gpus="sim:1x8GiB") as s:
        trials = StackTrials(s)
        arms: dict[str, Callable[[], dict[str, float]]] = {"queued": trials.queued, "plain": trials.plain}
        for i in range(args.warmup + args.trials):
            order = ["queued", "plain"] if i % 2 == 0 else ["plain", "queued"]
            for arm in order:
                result = arms[arm]()
                if i >= args.warmup:
                    for key, value in result.items():
                        samples[arm].setdefault(key, []).append(value)
                time.sleep(args.settle)
            if i >= args.warmup:
                q, p = samples["queued"], samples["plain"]
                print(f"  {i - args.warmup + 1:3}/{args.trials}: freed→placed {q['placed'][-1] * 1e3:6.2f} ms  "
                      f"freed→running {q['running'][-1] * 1e3:6.1f} ms  "
                      f"plain POST→201 {p['created'][-1] * 1e3:6.1f} ms",
                      file=sys.stderr)
    return samples


def report_stack(samples: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    rows = [("A room freed → placed (manager's events)", samples["queued"]["placed"]),
            ("A room freed → running (started event)", samples["queued"]["running"]),
            ("A  its placed → started (agent create+start)", samples["queued"]["agent"]),
            ("A DELETE's 200 at client → placed", samples["queued"]["placed_client"]),
            ("A DELETE's 200 at client → running", samples["queued"]["running_client"]),
            ("B plain POST → 201 (client)", samples["plain"]["created"]),
            ("B  its placed → started (agent create+start)", samples["plain"]["agent"])]
    stats = {name: summary(values, 1000) for name, values in rows}
    table([("", "46"), ("p50 ms", "9.2f"), ("p99 ms", "9.2f"), ("min ms", "9.2f"), ("max ms", "9.2f")],
          [[name, s["p50"], s["p99"], s["min"], s["max"]] for name, s in stats.items()], lead="\n")
    ratio = stats[rows[1][0]]["p50"] / stats[rows[5][0]]["p50"]
    paired = median(a / b for a, b in zip(samples["queued"]["running"], samples["plain"]["created"], strict=True))
    print(f"\nA room freed → running p50 / B POST → 201 p50 = {ratio:.3f} (median of per-pair ratios {paired:.3f})")
    return {"stats_ms": stats, "ratio_running_p50_over_plain_p50": ratio, "median_paired_ratio": paired,
            "samples_ms": {arm: {k: [v * 1e3 for v in vals] for k, vals in d.items()} for arm, d in samples.items()}}


# --- part 2: in-process ----------------------------------------------------------------------------
def spec(memory: int, *, priority: int = 0, node: str | None = None) -> PlacementSpec:
    return PlacementSpec(memory=memory, count=1, placement="spread", image="img", command=["sleep", "300"],
                         node=node, priority=priority)


def base(args: argparse.Namespace, state_dir: str | None = None) -> Cluster:
    """``--nodes`` × ``--gpus`` GPUs of 80 GiB, 2 GiB granted on each, and node ``full`` granted whole."""
    cluster = Cluster(aging=args.aging, state_dir=state_dir)
    if state_dir is not None:
        cluster.restore_queue([])  # what Manager() does at start: it opens the journal
    size = 80 * GiB
    for n in range(args.nodes):
        name = f"node-{n:04d}"
        cluster.register(name, name.encode(), "docker",
                         [GpuInfo(uuid=f"GPU-{n:04d}-{i}", index=i, name="Sim", memory_total=size)
                          for i in range(args.gpus)], [])
    cluster.register(FULL, FULL.encode(), "docker",
                     [GpuInfo(uuid=f"GPU-full-{i}", index=i, name="Sim", memory_total=size) for i in range(8)], [])
    for _ in range(8):  # first, or spread would put 2 GiB grants on them
        cluster.submit(spec(size, node=FULL))
    for _ in range(args.nodes * args.gpus):
        cluster.submit(spec(2 * GiB))
    return cluster


def waiting(case: str) -> PlacementSpec:
    """What the ``case``'s waiting requests ask for (priority 0)."""
    return spec(79 * GiB) if case == "big" else spec(GiB, node=FULL)


def _record(submitted: Any) -> Any:
    """The record ``submit`` placed or queued (it returns ``(record, commands)`` since the lifecycle split)."""
    return submitted[0] if isinstance(submitted, tuple) else submitted


def enqueue(cluster: Cluster, case: str, count: int) -> float:
    """Queue ``count`` requests that stay queued; return the seconds it took."""
    request = waiting(case)
    t0 = time.perf_counter()
    for _ in range(count):
        record = _record(cluster.submit(request, queue=True))
        if record.state is not State.QUEUED:
            raise RuntimeError(f"a waiting request was placed: {record.state} on {record.gpus}")
    return time.perf_counter() - t0


def placements(cluster: Cluster, seconds: float) -> tuple[int, float]:
    """submit(1 GiB, priority 10) + finish(removed) for about ``seconds``; (placed, elapsed); each must place."""
    request, submit, finish, removed = spec(GiB, priority=10), cluster.submit, cluster.finish, State.REMOVED
    creating, n = State.CREATING, 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        for _ in range(64):
            record = _record(submit(request))
            if record.state is not creating:
                raise RuntimeError(f"the measured request was not placed: {record.state}")
            finish(record.id, removed)
            n += 1
        now = time.perf_counter()
        if now >= deadline:
            return n, now - start


def dispatch_times(cluster: Cluster, calls: int) -> list[float]:
    """Seconds of each of ``calls`` ``dispatch()`` passes; none may place or preempt anything."""
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        started, victims = cluster.dispatch()
        out.append(time.perf_counter() - t0)
        if started or victims:
            raise RuntimeError(f"dispatch placed {len(started)} and chose {len(victims)} victims")
    return out


def memory_per_request(args: argparse.Namespace) -> float:
    """Bytes that tracemalloc sees added per queued request (pinned case, no journal)."""
    cluster = base(args)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    enqueue(cluster, "pinned", args.queued)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / int(args.queued)


def run_inprocess(args: argparse.Namespace) -> dict[str, Any]:
    clusters, counts = {}, {"empty": 0, "pinned1": 1, "pinned": args.queued, "big": args.queued}
    build_s: dict[str, float] = {}
    for case in CASES:
        clusters[case] = base(args)
        build_s[case] = enqueue(clusters[case], "big" if case == "big" else "pinned", counts[case])
    rates: dict[str, list[float]] = {c: [] for c in CASES}
    dispatch: dict[str, list[float]] = {c: [] for c in CASES if c != "empty"}
    enq: dict[str, list[float]] = {"no journal": [], "journal": []}
    placed_total = dict.fromkeys(CASES, 0)
    for r in range(args.rounds):
        order = list(CASES) if r % 2 == 0 else list(reversed(CASES))
        for case in order:
            n, elapsed = placements(clusters[case], args.seconds)
            placed_total[case] += n
            rates[case].append(n / elapsed)
            if len(clusters[case].queue) != counts[case]:
                raise RuntimeError(f"{case}: {len(clusters[case].queue)} queued, expected {counts[case]}")
        for case in dispatch:
            dispatch[case].extend(dispatch_times(clusters[case], args.dispatch_calls))
        for kind in (["no journal", "journal"] if r % 2 == 0 else ["journal", "no journal"]):
            folder = tempfile.mkdtemp(prefix="gpumgr-bench-queue-", dir=args.journal_dir) if kind == "journal" else None
            try:
                cluster = base(args, folder)
                enq[kind].append(args.journal_queued / enqueue(cluster, "pinned", args.journal_queued))
                cluster.journal.close()
            finally:
                if folder:
                    shutil.rmtree(folder, ignore_errors=True)
        print(f"  round {r + 1}/{args.rounds}: " + "  ".join(f"{c}={rates[c][-1]:,.0f}/s" for c in CASES)
              + "  enqueue " + "  ".join(f"{k}={v[-1]:,.0f}/s" for k, v in enq.items()), file=sys.stderr)

    base_rate = median(rates["empty"])
    table([("map (queued requests)", "34"), ("placements/s", "14,.0f"), ("min", "10,.0f"), ("max", "10,.0f"),
           ("/empty", "8.3f")],
          [[f"{c} ({counts[c]:,})", median(v), min(v), max(v), median(v) / base_rate] for c, v in rates.items()],
          lead="\n", note=f"   median of {args.rounds} rounds of {args.seconds:g} s")
    dstats = {c: summary(v, 1e6) for c, v in dispatch.items()}
    table([("dispatch() pass, head blocked", "34"), ("p50 µs", "10.1f"), ("p99 µs", "10.1f"), ("max µs", "10.1f")],
          [[f"{c} ({counts[c]:,} queued)", s["p50"], s["p99"], s["max"]] for c, s in dstats.items()], lead="\n",
          note=f"   {len(next(iter(dispatch.values()))):,} passes each")
    table([(f"enqueue {args.journal_queued:,} (pinned, queue=true)", "34"), ("requests/s", "14,.0f"),
           ("min", "10,.0f"), ("max", "10,.0f")],
          [[k, median(v), min(v), max(v)] for k, v in enq.items()], lead="\n")
    journal_ratio = median(enq["journal"]) / median(enq["no journal"])
    print(f"journal / no journal = {journal_ratio:.3f}; building the maps: "
          + ", ".join(f"{c} {build_s[c]:.2f} s ({counts[c] / build_s[c]:,.0f}/s)" for c in CASES if counts[c] > 1))
    per_request = memory_per_request(args) if args.memory else None
    if per_request is not None:
        print(f"memory per queued request (tracemalloc, {args.queued:,} pinned): {per_request:,.0f} B")
    return {"placements_per_s": {c: {"median": median(v), "min": min(v), "max": max(v), "rounds": v,
                                     "ratio_to_empty": median(v) / base_rate, "queued": counts[c],
                                     "placed": placed_total[c]} for c, v in rates.items()},
            "dispatch_us": dstats, "enqueue_per_s": {k: {"median": median(v), "rounds": v} for k, v in enq.items()},
            "enqueue_journal_ratio": journal_ratio, "build_enqueue_s": build_s,
            "memory_per_queued_request_bytes": per_request,
            "placements_per_s_stdev": {c: statistics.pstdev(v) for c, v in rates.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="timed pairs of the stack part (A and B once each)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed pairs first")
    parser.add_argument("--settle", type=float, default=0.1, help="seconds of rest after each stack trial")
    parser.add_argument("--seconds", type=float, default=2.0, help="length of one in-process placement round")
    parser.add_argument("--rounds", type=int, default=5, help="in-process rounds (each runs every map once)")
    parser.add_argument("--queued", type=int, default=10_000, help="requests waiting in the pinned and big maps")
    parser.add_argument("--nodes", type=int, default=100, help="nodes of the in-process map (besides 'full')")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    parser.add_argument("--aging", type=float, default=3600.0, help="queue aging step, seconds")
    parser.add_argument("--dispatch-calls", type=int, default=1000, help="dispatch() passes timed per map per round")
    parser.add_argument("--journal-queued", type=int, default=10_000, help="requests enqueued per journal trial")
    parser.add_argument("--journal-dir", help="where the journal trials write (default: the temporary folder)")
    parser.add_argument("--no-memory", dest="memory", action="store_false", help="skip the tracemalloc figure")
    parser.add_argument("--no-stack", dest="stack", action="store_false", help="skip part 1 (Docker)")
    parser.add_argument("--no-inprocess", dest="inprocess", action="store_false", help="skip part 2")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    info = machine()
    results: dict[str, Any] = {}
    if args.inprocess:
        results["inprocess"] = run_inprocess(args)
    if args.stack:
        results["stack"] = report_stack(run_stack(args))
    print(f"\n{machine_line(info)}")
    save(args.json, "wait_queue", args, machine=info, **results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
