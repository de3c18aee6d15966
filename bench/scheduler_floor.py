"""How fast could single-GPU reserve+finish be in CPython at all? The map's own path against a flat floor.

``bench/scheduler.py`` times ``Cluster.reserve()`` + ``Cluster.finish()`` through every layer (queue
check, scheduler, record, ledger, lifecycle, events, operation). This script times the same *work*
written as two flat functions with no layers, on a second map built the same way: the free index read,
a new ``Container`` record, the grant written on its GPU and noted for re-sorting, a ``placed`` event,
a create ``Op`` and its ``Command``; then the release, the record's end, the bounded list of ended
records and the final event. It skips what the bench never needs (tenants, the queue, preemption),
so it is a lower bound: the most that restructuring the layers could give, not a second implementation.

Both run in one process, alternating every ``--seconds``, so the ratio is of one run on one machine.

    python bench/scheduler_floor.py [--nodes 1000] [--gpus 8] [--fill 0.8] [--reps 9] [--seconds 0.3]
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import GiB, median, save, table
from bench.scheduler import MIX_GIB, build, time_reserve_release
from gpumgr.manager.model.cluster import Cluster, PlacementSpec
from gpumgr.manager.model.records import Command, Container, Op, OpKind
from gpumgr.wire import defaults
from gpumgr.wire.names import EXITED, EventType


def flat_pair(cluster: Cluster) -> tuple[Callable[[PlacementSpec], Container], Callable[[str], None]]:
    """``(reserve, finish)`` doing the map's work on ``cluster`` in two flat functions (spread only)."""
    ledger, index = cluster.ledger, cluster.ledger.index
    records, gpus, lock, new_id = ledger.records, ledger.gpus, threading.RLock(), cluster.new_id
    events: deque[tuple[object, ...]] = deque(maxlen=defaults.EVENTS_KEPT)
    event_lock, ids, ended = threading.Lock(), itertools.count(1), deque()
    create, placed, exited, kept = OpKind.CREATE, EventType.PLACED, EventType.EXITED, defaults.FINISHED_KEPT

    def reserve(spec: PlacementSpec) -> Container:
        with lock:
            (free, _), slot = index.by_free[-1]
            if free < spec.memory:
                raise RuntimeError("the floor bench expects room")
            cid = new_id()
            record = Container(id=cid, name=spec.name or f"gpumgr-{cid}", node=slot.node, gpus=[slot.uuid],
                               gpu_memory=spec.memory, spec=spec, container_id=spec.container_id,
                               created_at=time.time(), tenant=spec.tenant, priority=spec.priority,
                               preemptible=spec.preemptible)
            records[cid] = record
            ledger.version += 1
            record.held = spec.memory
            slot.reserved += spec.memory
            slot.holders.add(cid)  # type: ignore[attr-defined]
            index._moved[slot.uuid] = slot
            ledger.touched.add(slot.node)
            with event_lock:
                events.append((next(ids), time.time(), placed, slot.node, cid, spec.memory, None))
            record.op = op = Op(create, 1, time.monotonic() + 30.0)
            Command(create, record, op)
            return record

    def finish(cid: str) -> None:
        with lock:
            record = records[cid]
            ledger.version += 1
            for uuid in record.gpus:
                gpu = gpus[uuid]
                gpu.reserved -= record.held
                gpu.holders.discard(cid)
                index._moved[uuid] = gpu
                ledger.touched.add(gpu.node)
            record.held = 0
            record.state, record.reason, record.finished_at = EXITED, "exited", time.time()
            op, record.op = record.op, None
            if op is not None:
                op.ended = True
            ended.append(cid)
            if len(ended) > kept:
                del records[ended.popleft()]
            with event_lock:
                events.append((next(ids), time.time(), exited, record.node, cid, record.reason, None))

    return reserve, finish


def time_flat(pair: tuple[Callable[[PlacementSpec], Container], Callable[[str], None]],
              specs: list[PlacementSpec], seconds: float) -> tuple[int, float]:
    """The flat pair over ``specs`` (cycled) for about ``seconds``: (pairs, elapsed), as the real loop counts."""
    reserve, finish = pair
    n, k = 0, len(specs)
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        for _ in range(256):
            finish(reserve(specs[n % k]).id)
            n += 1
        now = time.perf_counter()
        if now >= deadline:
            return n, now - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpu-size", type=int, default=80, help="GiB per GPU")
    parser.add_argument("--fill", type=float, default=0.8)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--seconds", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    real, _ = build(args.nodes, args.gpus, args.gpu_size, args.fill, args.seed)
    floor, _ = build(args.nodes, args.gpus, args.gpu_size, args.fill, args.seed)
    rng = random.Random(args.seed + 1)
    specs = [PlacementSpec(memory=rng.choice(MIX_GIB) * GiB, count=1, placement="spread", image="img",
                           command=["sleep", "300"]) for _ in range(997)]
    pair = flat_pair(floor)
    time_reserve_release(real, specs, args.seconds)  # warm-up: both fill their lists of ended records
    time_flat(pair, specs, args.seconds)
    rates: dict[str, list[float]] = {"map (Cluster.reserve + finish)": [], "flat floor (same work, no layers)": []}
    ratios = []
    for rep in range(args.reps):
        got = {}
        for name in list(rates) if rep % 2 == 0 else list(rates)[::-1]:
            n, dt = time_reserve_release(real, specs, args.seconds) if name.startswith("map") \
                else time_flat(pair, specs, args.seconds)
            got[name] = n / dt
            rates[name].append(n / dt)
        ratios.append(got["flat floor (same work, no layers)"] / got["map (Cluster.reserve + finish)"])
    table([("single-GPU spread reserve+finish", "36"), ("median/s", "12,.0f"), ("us/pair", "9.2f")],
          [[name, median(values), 1e6 / median(values)] for name, values in rates.items()], lead="\n")
    print(f"\nfloor / map, median of {args.reps} paired runs: {median(ratios):.2f}x")
    save(args.json, "scheduler-floor", args, rates=rates, floor_over_map=median(ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
