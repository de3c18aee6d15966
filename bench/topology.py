"""Multi-GPU placements per second with and without topology scoring, and with constraints, on one map size.

Builds two maps of ``--nodes`` × ``--gpus`` GPUs from the same seed and fills both to ``--fill``: on
one every node reports its links (NVLink islands of ``--island`` GPUs, the islands of a node on two
sockets), so a request for 2 or more GPUs is scored by topology; on the other no node reports any,
which is the scheduler's path without scoring. Then, interleaved over ``--reps`` repetitions, it
times ``reserve()`` + ``finish()`` of 2- and 4-GPU requests (spread and binpack) on each map, the
pure ``place()`` of the same requests, and single-GPU requests with and without a ``gpu.model``
constraint (the map's nodes hold two models). Medians, one run, one machine.

    python bench/topology.py [--nodes 1000] [--gpus 8] [--fill 0.8] [--reps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import GiB, median, save, table
from bench.scheduler import MIX_GIB, time_place, time_reserve_release
from gpumgr.manager.model.cluster import Cluster, PlacementSpec
from gpumgr.manager.model.walk.dispatch import request_for
from gpumgr.manager.placing.scheduler import place
from gpumgr.wire.errors import NoFit
from gpumgr.wire.protocol import GpuInfo

MODELS = ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB")


def links_of(n: int, gpus: int, island: int) -> list[dict[str, str]]:
    """Each GPU's links on node ``n``: NVLink within an island, one socket per half of the node."""
    half = max(1, gpus // 2)

    def link(i: int, j: int) -> str:
        if i // island == j // island:
            return "nvlink"
        return "socket" if i // half == j // half else "system"
    return [{f"GPU-{n:04d}-{j}": link(i, j) for j in range(gpus) if j != i} for i in range(gpus)]


def build(args: argparse.Namespace, topology: bool) -> tuple[Cluster, float]:
    """The map, filled to about ``--fill`` with the same random mix whatever ``topology`` is."""
    cluster = Cluster()
    for n in range(args.nodes):
        name = f"node-{n:04d}"
        links = links_of(n, args.gpus, args.island) if topology else [{} for _ in range(args.gpus)]
        infos = [GpuInfo(uuid=f"GPU-{n:04d}-{i}", index=i, name=MODELS[n % 2], memory_total=80 * GiB,
                         compute_capability="9.0" if n % 2 == 0 else "8.0", links=links[i]) for i in range(args.gpus)]
        cluster.register(name, name.encode(), "docker", infos, [])
    rng = random.Random(args.seed)
    total, reserved, misses = args.nodes * args.gpus * 80 * GiB, 0, 0
    while reserved < args.fill * total and misses < 20_000:
        count, memory = rng.choice((1, 1, 1, 1, 2, 4)), rng.choice((1, 2, 4, 8, 12, 16)) * GiB
        node = f"node-{rng.randrange(args.nodes):04d}" if count > 1 else None
        try:
            cluster.reserve(PlacementSpec(memory=memory, count=count, placement=rng.choice(("spread", "binpack")),
                                          image="img", command=[], node=node))
            reserved += memory * count
        except NoFit:
            misses += 1
    return cluster, reserved / total


def specs(sizes: list[int], placement: str, counts: list[int], constraints: list[str] | None = None) -> list:
    return [PlacementSpec(memory=m, count=c, placement=placement, image="img", command=[],
                          constraints=list(constraints or [])) for m, c in zip(sizes, counts, strict=False)]


def measure(maps: dict[str, Cluster], args: argparse.Namespace, rates: dict[str, list[float]], rep: int) -> None:
    """One repetition of every row; the two maps alternate who goes first."""
    rng = random.Random(args.seed + 1)
    sizes = [rng.choice(MIX_GIB) * GiB for _ in range(997)]
    multi, single = [2, 4] * 500, [1] * 997
    order = list(maps.items()) if rep % 2 == 0 else list(maps.items())[::-1]
    for placement in ("spread", "binpack"):
        for label, cluster in order:
            n, dt = time_reserve_release(cluster, specs(sizes, placement, multi), args.seconds)
            rates.setdefault(f"reserve+finish {placement} gpus=2|4, {label}", []).append(n / dt)
            requests = [request_for(s, s.memory) for s in specs(sizes, placement, multi)]
            n, dt = time_place(cluster, requests, args.seconds / 2, place)
            rates.setdefault(f"place() only {placement} gpus=2|4, {label}", []).append(n / dt)
        cluster = maps["topology scored"]
        for label, constraints in (("no constraint", None), ("gpu.model==*H100*", ["gpu.model==*H100*"])):
            n, dt = time_reserve_release(cluster, specs(sizes, placement, single, constraints), args.seconds)
            rates.setdefault(f"reserve+finish {placement} 1 GPU, {label}", []).append(n / dt)
        n, dt = time_reserve_release(cluster, specs(sizes, placement, multi, ["gpu.model==*H100*"]), args.seconds)
        rates.setdefault(f"reserve+finish {placement} gpus=2|4, gpu.model==*H100*", []).append(n / dt)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    parser.add_argument("--island", type=int, default=4, help="GPUs per NVLink island")
    parser.add_argument("--fill", type=float, default=0.8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.5, help="length of one repetition of one row")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    maps = {}
    for label, topology in (("no topology", False), ("topology scored", True)):
        started = time.perf_counter()
        maps[label], filled = build(args, topology)
        print(f"{label}: {args.nodes} x {args.gpus} GPUs, {filled:.1%} reserved "
              f"(built in {time.perf_counter() - started:.1f}s)")
    rates: dict[str, list[float]] = {}
    for rep in range(args.reps):
        measure(maps, args, rates, rep)
        print(f"  rep {rep + 1}/{args.reps} done", file=sys.stderr)
    rows = [{"name": name, "median_per_s": median(v), "min_per_s": min(v), "max_per_s": max(v), "samples": v}
            for name, v in rates.items()]
    table([("measurement", "52"), ("median/s", "12,.0f"), ("min/s", "12,.0f"), ("max/s", "12,.0f")],
          [[r["name"], r["median_per_s"], r["min_per_s"], r["max_per_s"]] for r in rows], lead="\n")
    ratios = {f"{kind} {p} gpus=2|4": median(rates[f"{kind} {p} gpus=2|4, topology scored"])
              / median(rates[f"{kind} {p} gpus=2|4, no topology"])
              for kind in ("reserve+finish", "place() only") for p in ("spread", "binpack")}
    table([("topology scored / no topology (medians, same run)", "52"), ("ratio", "10.2f")],
          [[name, ratio] for name, ratio in ratios.items()], lead="\n")
    save(args.json, "topology", args, results=rows, ratios=ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
