"""Several managers on etcd: how long a failover takes, and what a store write costs on each backend.

Part 1, failover. A three-member etcd cluster on loopback (``tests.etcd``: Debian's etcd-server, data in
a temporary folder) and three campaigning processes (``python -m tests.campaigner``: the leadership and
fenced store the manager uses, nothing else). Each trial waits for exactly one leader, waits a random
0–1 s more (so the fault lands anywhere in the leader's 1 s renewal cycle), then:

  kill   kill -9 the leader: its lease must run out (TTL 3 s) before a standby's poll finds the key gone
  term   SIGTERM the leader: it resigns (revokes its lease), so a standby leads at its next poll

and times from the signal (this process's wall clock) to the ``elected`` line of the next leader (the
campaigner's wall clock, the same host's). The killed or stopped campaigner is replaced before the
next trial. Kinds alternate, ``--trials`` of each.

Part 2, one store write. Queue a request and take it off again (``enqueue`` + ``sync`` + ``dequeue`` +
``sync``, what a manager writes for a request that waits) on the state directory (``FileStore``: an
append and an fsync each) and on etcd (``EtcdStore``: one fenced transaction each, committed by a
quorum that fsyncs its log) with one member and with three, in ``--rounds`` interleaved rounds of
``--seconds`` each.

    python bench/store.py [--trials 20] [--rounds 5] [--seconds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import logging
import random
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import machine, machine_line, save, summary, table, wait_for
from gpumgr.manager.control.leadership import LEASE_TTL, Leadership
from gpumgr.manager.control.store import FileStore, Store
from gpumgr.manager.control.store_etcd import EtcdStore
from tests.campaigner import CampaignerProc as Campaigner
from tests.etcd import EtcdCluster


def failover(folder: Path, trials: int) -> dict[str, list[float]]:
    """Seconds from the signal to the next leader's election, per kind."""
    cluster = EtcdCluster(folder / "etcd3", size=3)
    serial = iter(range(1_000_000))
    procs = [Campaigner(folder, f"c{next(serial)}", cluster.endpoints) for _ in range(3)]
    times: dict[str, list[float]] = {"kill": [], "term": []}
    try:
        for trial in range(2 * trials):
            kind = "kill" if trial % 2 == 0 else "term"
            leader = wait_for(lambda now=procs: _sole_leader(now), 10 * LEASE_TTL, what="one leader")
            time.sleep(random.uniform(0.0, 1.0))
            signalled = time.time()
            leader.popen.send_signal(signal.SIGKILL if kind == "kill" else signal.SIGTERM)
            others = [p for p in procs if p is not leader]
            elected = wait_for(lambda rest=others, at=signalled: _elected_after(rest, at), 10 * LEASE_TTL,
                               what="the next leader")
            times[kind].append(elected - signalled)
            print(f"  trial {trial + 1:2d} {kind}: {elected - signalled:.3f} s", flush=True)
            leader.stop()
            procs = [*others, Campaigner(folder, f"c{next(serial)}", cluster.endpoints)]
    finally:
        for proc in procs:
            proc.stop()
        cluster.stop()
    return times


def _sole_leader(procs: list[Campaigner]) -> Campaigner | None:
    leading = [p for p in procs if p.leads()]
    return leading[0] if len(leading) == 1 else None


def _elected_after(procs: list[Campaigner], since: float) -> float | None:
    found = [e["time"] for p in procs for e in p.events("elected") if e["time"] > since]
    return min(found) if found else None


def writes(folder: Path, rounds: int, seconds: float) -> dict[str, list[float]]:
    """Seconds per queued-and-dequeued request, one figure per round, per backend."""
    one, three = EtcdCluster(folder / "etcd1", size=1), EtcdCluster(folder / "etcd3w", size=3)
    leaders = [Leadership(c.client(), "bench") for c in (one, three)]
    try:
        for leadership in leaders:
            leadership.start()
            wait_for(lambda lead=leadership: lead.is_leader, 10 * LEASE_TTL, what="the bench to lead")
        stores: dict[str, Store] = {"state directory": FileStore(folder / "state"),
                                    "etcd, 1 member": EtcdStore(one.client(), leaders[0].guard),
                                    "etcd, 3 members": EtcdStore(three.client(), leaders[1].guard)}
        per: dict[str, list[float]] = {name: [] for name in stores}
        for r in range(rounds):
            order = list(stores) if r % 2 == 0 else list(reversed(stores))
            for name in order:
                per[name].append(_round(stores[name], seconds))
        return per
    finally:
        for leadership in leaders:
            leadership.stop()
        one.stop()
        three.stop()


def _round(store: Store, seconds: float) -> float:
    done, start = 0, time.perf_counter()
    step: Callable[[int], None] = lambda n: _queue_and_take(store, f"r{n}")  # noqa: E731
    while time.perf_counter() - start < seconds:
        step(done)
        done += 1
    return (time.perf_counter() - start) / done


def _queue_and_take(store: Store, cid: str) -> None:
    store.enqueue({"id": cid, "priority": 0, "queued_at": time.time(), "body": {"gpu_memory": 1 << 30}})
    store.sync()
    store.dequeue(cid)
    store.sync()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="failovers of each kind")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the leaders' own step-down lines are not results
    info = machine()
    with tempfile.TemporaryDirectory(prefix="gpumgr-bench-store-") as tmp:
        folder = Path(tmp)
        print(f"failover, {args.trials} of each kind (lease TTL {LEASE_TTL} s):", flush=True)
        times = failover(folder, args.trials)
        per = writes(folder, args.rounds, args.seconds)
    failovers = {kind: summary(values) for kind, values in times.items()}
    table([("failover", "24"), ("n", "3d"), ("p50 s", "7.3f"), ("p99 s", "7.3f"), ("min s", "7.3f"),
           ("max s", "7.3f")],
          [(kind, s["n"], s["p50"], s["p99"], s["min"], s["max"]) for kind, s in failovers.items()])
    base = summary(per["state directory"])["median"]
    table([("queue + dequeue", "24"), ("ms, median", "11.2f"), ("min", "7.2f"), ("max", "7.2f"), ("ratio", "7.2f")],
          [(name, summary(v, 1000)["median"], min(v) * 1000, max(v) * 1000, summary(v)["median"] / base)
           for name, v in per.items()])
    print(machine_line(info))
    save(args.json, "store", args, machine=info, failover=failovers, failover_raw=times,
         writes={name: summary(v, 1000) for name, v in per.items()})


if __name__ == "__main__":
    main()
