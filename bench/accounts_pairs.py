"""What tenants and the ``accounts:`` section add to one placement: submit+finish pairs on three maps, in turn.

Three maps of 200 nodes × 8 GPUs × 80 GiB: **plain** (no tenants: the operator's requests), **tenants**
(8 tenants, no accounts) and **accounts** (the same 8 tenants, two to an account, in 4 accounts whose
quotas share the capacity out: nothing borrows, nothing waits). Each repetition times ``--pairs``
single-GPU submit+finish pairs on each map, the three in an order that rotates every repetition; many
short repetitions, so a burst of other work on the machine spoils few of them. Printed: each map's median
µs per pair (and the range), and the ratios of the medians, accounts / plain and accounts / tenants (issue
34's goal: within 1.3×). Smaller and steadier than ``scheduler.py --accounts``, whose maps are 1,000 nodes
deep in grants.

    python bench/accounts_pairs.py [--pairs 1000] [--reps 51] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from gpumgr.manager.model.cluster import Cluster
from gpumgr.manager.model.records import PlacementSpec
from gpumgr.manager.tenancy.accounts import AccountConfig, build_accounts
from gpumgr.manager.tenancy.tenants import Tenant, TenantBook
from gpumgr.wire.names import State
from gpumgr.wire.protocol import GpuInfo

GiB = 1 << 30
MODES = ("plain", "tenants", "accounts")


def build(mode: str) -> tuple[Cluster, list[Tenant | None]]:
    """A map of 200 × 8 GPUs: with no tenants (``plain``), 8 tenants (``tenants``), or them in 4 accounts."""
    cluster = Cluster()
    tenants = {f"t{i}": Tenant(f"t{i}", f"token-t{i}".ljust(16, "x").encode(), None, None, 5) for i in range(8)}
    if mode != "plain":
        cluster.tenants = TenantBook(tenants, "operator-token-000000")
    if mode == "accounts":
        cluster.accounts = build_accounts({f"a{i}": AccountConfig(quota={"gpu_memory": 400 * 80 * GiB})
                                           for i in range(4)}, {f"t{i}": f"a{i % 4}" for i in range(8)})
    for n in range(200):
        cluster.register(f"n{n}", f"n{n}".encode(), "docker",
                         [GpuInfo(uuid=f"n{n}-g{i}", index=i, name="Sim", memory_total=80 * GiB) for i in range(8)],
                         [])
    return cluster, [None] if mode == "plain" else list(tenants.values())


def pairs(cluster: Cluster, tenants: list[Tenant | None], count: int) -> float:
    """Microseconds per submit+finish pair."""
    spec = PlacementSpec(memory=GiB, count=1, placement="spread", image="img", command=[])
    began = time.perf_counter()
    for i in range(count):
        record, _ = cluster.submit(spec, tenant=tenants[i % len(tenants)])
        cluster.finish(record.id, State.EXITED, exit_code=0)
    return (time.perf_counter() - began) / count * 1e6


def run(count: int, reps: int) -> dict[str, Any]:
    """Time the three maps in turn, ``reps`` times; each map's medians and the ratios of them."""
    maps = {mode: build(mode) for mode in MODES}
    for cluster, tenants in maps.values():  # warm each map (first grants, caches) before anything counts
        pairs(cluster, tenants, min(count, 200))
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for rep in range(reps):
        order = MODES[rep % 3:] + MODES[:rep % 3]
        for mode in order if rep % 6 < 3 else reversed(order):
            times[mode].append(pairs(*maps[mode], count))
    medians = {mode: statistics.median(t) for mode, t in times.items()}
    return {"pairs": count, "reps": reps,
            "us_per_pair": {mode: {"median": medians[mode], "min": min(t), "max": max(t)} for mode, t in times.items()},
            "ratios": {"accounts/plain": medians["accounts"] / medians["plain"],
                       "accounts/tenants": medians["accounts"] / medians["tenants"],
                       "tenants/plain": medians["tenants"] / medians["plain"]}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=1000, help="submit+finish pairs per map per repetition")
    parser.add_argument("--reps", type=int, default=51)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    result = run(args.pairs, args.reps)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"submit+finish of 1 GPU, median of {args.reps} x {args.pairs} pairs per map (us per pair, range):")
    for mode, figures in result["us_per_pair"].items():
        print(f"  {mode:8} {figures['median']:6.2f}  ({figures['min']:.2f}-{figures['max']:.2f})")
    ratios = result["ratios"]
    print(f"accounts / plain {ratios['accounts/plain']:.3f}x, accounts / tenants {ratios['accounts/tenants']:.3f}x, "
          f"tenants / plain {ratios['tenants/plain']:.3f}x (goal: accounts within 1.3x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
