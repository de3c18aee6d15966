"""``/metrics`` on a large map: scrape time and size, and what scraping every second costs placements.

In-process, no sockets: a :class:`Cluster` of ``--nodes`` nodes × ``--gpus`` GPUs (80 GiB each) with
``--containers`` running grants on every GPU (1,000 × 8 × 4 = 32,000 by default), and the manager's
own :class:`Metrics` registry over it. Measured:

1. a scrape, as ``GET /metrics`` makes it: ``generate_latest(registry)``, ``--scrapes`` times: its time,
   its bytes, and the part spent holding the map's lock (``Cluster.metrics_snapshot``);
2. placements per second (``submit`` 1 GiB + ``finish``, one thread, as the REST threads do) with no
   scraper, against the same with a scraper thread scraping once a second: ``--rounds`` rounds of
   ``--seconds`` each, the two interleaved (order swapped every other round); medians and their ratio.

    python bench/metrics_scrape.py [--nodes 1000] [--gpus 8] [--containers 4] [--scrapes 20]
                                   [--rounds 6] [--seconds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client import generate_latest

from bench.harness import machine, machine_line, median, save, summary, table
from gpumgr.manager.metrics import Metrics
from gpumgr.manager.model.cluster import Cluster
from gpumgr.manager.model.records import PlacementSpec
from gpumgr.wire.names import State
from gpumgr.wire.protocol import ContainerReport, GpuInfo

GiB = 1 << 30


def build(nodes: int, gpus: int, containers: int) -> Cluster:
    """The map: every GPU of every node holds ``containers`` running 1 GiB grants with some usage."""
    cluster = Cluster()
    for n in range(nodes):
        name = f"node-{n:04d}"
        infos = [GpuInfo(uuid=f"GPU-{n:04d}-{g}", index=g, name="NVIDIA H100 80GB HBM3", memory_total=80 * GiB)
                 for g in range(gpus)]
        cluster.register(name, name.encode(), "docker", infos, [])
        for _ in range(gpus * containers):
            record = cluster.submit(PlacementSpec(memory=GiB, count=1, placement="spread", image="img", command=[],
                                                  node=name, name=f"job-{n}-{_}"))
            cluster.started(record.id, ContainerReport(grant=record.id, container_id=f"c{record.id}",
                                                       gpus=record.gpus, gpu_memory=GiB, state="running",
                                                       usage={record.gpus[0]: GiB // 2}))
            record.usage = {record.gpus[0]: GiB // 2}
    return cluster


def scrapes(metrics: Metrics, cluster: Cluster, count: int) -> dict[str, Any]:
    """Time ``count`` whole scrapes and ``count`` lock-held snapshots."""
    whole, held, size = [], [], 0
    for _ in range(count):
        started = time.perf_counter()
        body = generate_latest(metrics.registry)
        whole.append(time.perf_counter() - started)
        size = len(body)
        started = time.perf_counter()
        cluster.metrics_snapshot()
        held.append(time.perf_counter() - started)
    return {"scrape_ms": summary(whole, 1000), "lock_held_ms": summary(held, 1000), "bytes": size,
            "lines": body.count(b"\n")}


def placements(cluster: Cluster, seconds: float, metrics: Metrics | None) -> tuple[float, int]:
    """Placements per second for ``seconds``; with ``metrics``, a thread scrapes once a second meanwhile."""
    stop = threading.Event()
    scraped = [0]

    def scraper() -> None:
        while not stop.wait(1.0):
            generate_latest(metrics.registry)  # type: ignore[union-attr]
            scraped[0] += 1

    thread = threading.Thread(target=scraper, daemon=True) if metrics is not None else None
    if thread is not None:
        thread.start()
    spec = PlacementSpec(memory=GiB, count=1, placement="spread", image="img", command=[])
    done, deadline = 0, time.perf_counter() + seconds
    started = time.perf_counter()
    while time.perf_counter() < deadline:
        record = cluster.submit(spec)
        cluster.finish(record.id, State.REMOVED)
        done += 1
    elapsed = time.perf_counter() - started
    stop.set()
    if thread is not None:
        thread.join()
    return done / elapsed, scraped[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--containers", type=int, default=4)
    parser.add_argument("--scrapes", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--json")
    args = parser.parse_args()
    info = machine()
    started = time.perf_counter()
    cluster = build(args.nodes, args.gpus, args.containers)
    metrics = Metrics(cluster)
    print(f"map: {args.nodes} nodes x {args.gpus} GPUs x {args.containers} containers "
          f"({len(cluster.containers())} grants), built in {time.perf_counter() - started:.1f} s")
    scrape = scrapes(metrics, cluster, args.scrapes)
    table([("one scrape", "26"), ("p50 ms", "10.1f"), ("p99 ms", "10.1f"), ("max ms", "10.1f")],
          [("generate_latest (whole)", scrape["scrape_ms"]["p50"], scrape["scrape_ms"]["p99"],
            scrape["scrape_ms"]["max"]),
           ("of which the lock is held", scrape["lock_held_ms"]["p50"], scrape["lock_held_ms"]["p99"],
            scrape["lock_held_ms"]["max"])],
          note=f"   {args.scrapes} scrapes")
    print(f"body: {scrape['bytes']:,} bytes, {scrape['lines']:,} lines\n")
    rates: dict[str, list[float]] = {"no scraper": [], "scraped every 1 s": []}
    for round_ in range(args.rounds):
        order = [None, metrics] if round_ % 2 == 0 else [metrics, None]
        line = []
        for with_metrics in order:
            rate, scraped = placements(cluster, args.seconds, with_metrics)
            key = "no scraper" if with_metrics is None else "scraped every 1 s"
            rates[key].append(rate)
            line.append(f"{key}={rate:,.0f}/s" + (f" ({scraped} scrapes)" if with_metrics else ""))
        print(f"  round {round_ + 1}/{args.rounds}: " + "  ".join(line))
    base = median(rates["no scraper"])
    table([("placements", "20"), ("per s, median", "14,.0f"), ("min", "10,.0f"), ("max", "10,.0f"),
           ("ratio", "7.3f")],
          [(key, median(v), min(v), max(v), median(v) / base) for key, v in rates.items()],
          lead="\n", note=f"   {args.rounds} rounds of {args.seconds:g} s")
    print(f"\n{machine_line(info)}")
    save(args.json, "metrics_scrape", args, machine=info, scrape=scrape, rates=rates,
         ratio=median(rates["scraped every 1 s"]) / base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
