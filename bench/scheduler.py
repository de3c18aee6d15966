"""Place+release decisions per second on the real cluster map (no I/O, no sockets).

Builds ``manager.cluster.Cluster`` with ``--nodes`` nodes of ``--gpus`` GPUs each, fills it to about
``--fill`` of its memory with a random mix of grants, then times loops of ``reserve()`` followed by
``finish(cid, State.EXITED)`` (one decision = one place + one release, with the event log and the
bounded list of finished records doing their real work) for ``spread`` and ``binpack``, interleaved,
``--reps`` times each. The pure ``manager.scheduler.place`` rate on the same index is reported for
reference, and so are the multi-GPU path (``gpus > 1``), which scans every node, and the cost of one
node's heartbeat (8 GPU samples, no container reports) on the same map.

    python bench/scheduler.py [--nodes 1000] [--gpus 8] [--fill 0.8] [--reps 7] [--seconds 1.0] [--json out.json]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import GiB, median, save, table
from gpumgr.manager.cluster import Cluster, PlacementSpec, State
from gpumgr.manager.scheduler import Placement, Request, place
from gpumgr.wire import defaults
from gpumgr.wire.errors import NoFit
from gpumgr.wire.protocol import GpuInfo, GpuSample

#: Single-GPU request sizes (GiB) of the timed mix: all fit on a GPU that is ~80% reserved.
MIX_GIB = (1, 1, 2, 2, 4, 8)


def build(nodes: int, gpus: int, size_gib: int, fill: float, seed: int) -> tuple[Cluster, float]:
    """A cluster of ``nodes`` × ``gpus`` filled to about ``fill`` of its memory; returns it and the real fill."""
    cluster = Cluster()
    for n in range(nodes):
        name = f"node-{n:04d}"
        infos = [GpuInfo(uuid=f"GPU-{n:04d}-{i}", index=i, name="Sim", memory_total=size_gib * GiB)
                 for i in range(gpus)]
        cluster.register(name, name.encode(), "docker", infos, [])
    rng = random.Random(seed)
    total = nodes * gpus * size_gib * GiB
    reserved = 0
    misses = 0
    while reserved < fill * total and misses < 20_000:
        count = rng.choice((1, 1, 1, 1, 2, 4))
        memory = rng.choice((1, 2, 4, 8, 12, 16)) * GiB
        placement = rng.choice(("spread", "binpack"))
        # multi-GPU grants are pinned to a node: unpinned ones scan every node (see the gpus=2|4 rows)
        node = f"node-{rng.randrange(nodes):04d}" if count > 1 else None
        try:
            cluster.reserve(PlacementSpec(memory=memory, count=count, placement=placement, image="img",
                                          command=["sleep", "300"], node=node))
            reserved += memory * count
        except NoFit:
            misses += 1
    return cluster, reserved / total


def time_reserve_release(cluster: Cluster, specs: list[PlacementSpec], seconds: float) -> tuple[int, float]:
    """Run reserve()+finish() over ``specs`` (cycled) for about ``seconds``; return (decisions, elapsed)."""
    n, k = 0, len(specs)
    reserve, finish, exited = cluster.reserve, cluster.finish, State.EXITED
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        for _ in range(256):
            record = reserve(specs[n % k])
            finish(record.id, exited)
            n += 1
        now = time.perf_counter()
        if now >= deadline:
            return n, now - start


def _index_of(cluster: Cluster) -> object:
    """The map's free index (the ledger's; ``_index`` on the map before the cluster was split by idea)."""
    ledger = getattr(cluster, "ledger", None)
    return ledger.index if ledger is not None else cluster._index  # type: ignore[attr-defined]


def time_place(cluster: Cluster, requests: list[Request], seconds: float) -> tuple[int, float]:
    """Run the pure ``place()`` over ``requests`` (cycled) on the cluster's index; return (decisions, elapsed)."""
    n, k, index = 0, len(requests), _index_of(cluster)
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        for _ in range(256):
            place(index, requests[n % k])
            n += 1
        now = time.perf_counter()
        if now >= deadline:
            return n, now - start


def time_heartbeat(cluster: Cluster, nodes: int, gpus: int, seconds: float) -> tuple[int, float]:
    """Heartbeats (GPU samples, no container reports) over every node in turn; return (heartbeats, elapsed)."""
    beats = [(f"node-{n:04d}", [GpuSample(uuid=f"GPU-{n:04d}-{i}", memory_used=0, memory_unmanaged=0)
                                for i in range(gpus)]) for n in range(nodes)]
    n = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        name, samples = beats[n % nodes]
        cluster.heartbeat(name, name.encode(), samples, [])
        n += 1
        now = time.perf_counter()
        if now >= deadline:
            return n, now - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    parser.add_argument("--gpu-size", type=int, default=80, help="GiB per GPU")
    parser.add_argument("--fill", type=float, default=0.8, help="fraction of memory reserved before timing")
    parser.add_argument("--reps", type=int, default=7, help="repetitions of each measurement")
    parser.add_argument("--seconds", type=float, default=1.0, help="length of one repetition")
    parser.add_argument("--multi-seconds", type=float, default=0.5, help="length of one multi-GPU repetition")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--target", type=float, default=50_000, help="place+release/s target")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    cluster, filled = build(args.nodes, args.gpus, args.gpu_size, args.fill, args.seed)
    build_s = time.perf_counter() - t0
    live = len(cluster.containers(state="creating"))
    print(f"map: {args.nodes} nodes x {args.gpus} GPUs x {args.gpu_size} GiB, {filled:.1%} reserved by "
          f"{live} live grants (built in {build_s:.1f}s); FINISHED_KEPT={defaults.FINISHED_KEPT}")

    rng = random.Random(args.seed + 1)
    sizes = [rng.choice(MIX_GIB) * GiB for _ in range(997)]
    specs = {p: [PlacementSpec(memory=m, count=1, placement=p, image="img", command=["sleep", "300"])
                 for m in sizes] for p in ("spread", "binpack")}
    multi = {p: [PlacementSpec(memory=m, count=c, placement=p, image="img", command=["sleep", "300"])
                 for m, c in zip(sizes, [2, 4] * 500, strict=False)] for p in ("spread", "binpack")}
    requests = {p: [Request(m, 1, None, Placement(p)) for m in sizes] for p in ("spread", "binpack")}

    # warm-up: fills the finished-record list to FINISHED_KEPT so the timed loops pay for forgetting
    for p in ("spread", "binpack"):
        time_reserve_release(cluster, specs[p], 0.2)

    rates: dict[str, list[float]] = {}
    for rep in range(args.reps):
        for p in ("spread", "binpack"):  # interleaved, so drift and noise hit both alike
            n, dt = time_reserve_release(cluster, specs[p], args.seconds)
            rates.setdefault(f"reserve+finish {p}", []).append(n / dt)
            n, dt = time_place(cluster, requests[p], args.seconds / 2)
            rates.setdefault(f"place() only {p}", []).append(n / dt)
            n, dt = time_reserve_release(cluster, multi[p], args.multi_seconds)
            rates.setdefault(f"reserve+finish {p} gpus=2|4", []).append(n / dt)
        n, dt = time_heartbeat(cluster, args.nodes, args.gpus, args.multi_seconds)
        rates.setdefault("heartbeat() of one node", []).append(n / dt)
        print(f"  rep {rep + 1}/{args.reps} done", file=sys.stderr)

    after = _index_of(cluster)
    still = sum(s.reserved for _, s in after.by_free) / (args.nodes * args.gpus * args.gpu_size * GiB)
    rows = [{"name": name, "median_per_s": median(values), "min_per_s": min(values), "max_per_s": max(values),
             "us_per_op": 1e6 / median(values), "samples": values} for name, values in rates.items()]
    table([("measurement", "34"), ("median/s", "12,.0f"), ("min/s", "12,.0f"), ("max/s", "12,.0f"), ("us/op", "8.2f")],
          [[r["name"], r["median_per_s"], r["min_per_s"], r["max_per_s"], r["us_per_op"]] for r in rows], lead="\n")
    worst = min(median(rates[f"reserve+finish {p}"]) for p in ("spread", "binpack"))
    met = worst >= args.target
    print(f"\nreserved after timing: {still:.1%}; target >= {args.target:,.0f} place+release/s "
          f"(single-GPU mix, worse placement): {worst:,.0f}/s -> {'MET' if met else 'MISSED'}")
    save(args.json, "scheduler", args, fill_before=filled, fill_after=still, live_grants=live, results=rows,
         target_per_s=args.target, worst_single_gpu_median_per_s=worst, target_met=met)
    return 0


if __name__ == "__main__":
    sys.exit(main())
