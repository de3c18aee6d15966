"""What the ``accounts:`` section adds to one placement: submit+finish pairs on two maps, same tenants, in turn.

Two maps of 200 nodes × 8 GPUs × 80 GiB with the same 8 tenants; on the second the tenants are in 4
accounts whose quotas share the capacity out (nothing borrows, nothing waits). Each repetition times
``--pairs`` single-GPU submit+finish pairs on each map in turn; the medians of ``--reps`` repetitions and
their ratio are printed (issue 34's goal: within 1.3×). Smaller and steadier than ``scheduler.py
--accounts``, whose maps are 1,000 nodes deep in grants.

    python bench/accounts_pairs.py [--pairs 3000] [--reps 9]
"""

from __future__ import annotations

import argparse
import statistics
import time

from gpumgr.manager.model.cluster import Cluster
from gpumgr.manager.model.records import PlacementSpec
from gpumgr.manager.tenancy.accounts import AccountConfig, build_accounts
from gpumgr.manager.tenancy.tenants import Tenant, TenantBook
from gpumgr.wire.names import State
from gpumgr.wire.protocol import GpuInfo

GiB = 1 << 30


def build(accounts: bool) -> tuple[Cluster, list[Tenant]]:
    """A map of 200 × 8 GPUs with 8 tenants, in 4 accounts or in none."""
    cluster = Cluster()
    tenants = {f"t{i}": Tenant(f"t{i}", f"token-t{i}".ljust(16, "x").encode(), None, None, 5) for i in range(8)}
    cluster.tenants = TenantBook(tenants, "operator-token-000000")
    if accounts:
        cluster.accounts = build_accounts({f"a{i}": AccountConfig(quota={"gpu_memory": 400 * 80 * GiB})
                                           for i in range(4)}, {f"t{i}": f"a{i % 4}" for i in range(8)})
    for n in range(200):
        cluster.register(f"n{n}", f"n{n}".encode(), "docker",
                         [GpuInfo(uuid=f"n{n}-g{i}", index=i, name="Sim", memory_total=80 * GiB) for i in range(8)],
                         [])
    return cluster, list(tenants.values())


def pairs(cluster: Cluster, tenants: list[Tenant], count: int) -> float:
    """Microseconds per submit+finish pair."""
    spec = PlacementSpec(memory=GiB, count=1, placement="spread", image="img", command=[])
    began = time.perf_counter()
    for i in range(count):
        record, _ = cluster.submit(spec, tenant=tenants[i % len(tenants)])
        cluster.finish(record.id, State.EXITED, exit_code=0)
    return (time.perf_counter() - began) / count * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3000)
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args(argv)
    plain, accounts = build(False), build(True)
    without, with_ = [], []
    for rep in range(args.reps):
        order = [(plain, without), (accounts, with_)]
        for (cluster, tenants), into in order if rep % 2 == 0 else reversed(order):
            into.append(pairs(cluster, tenants, args.pairs))
    a, b = statistics.median(without), statistics.median(with_)
    print(f"same 8 tenants, submit+finish of 1 GPU, median of {args.reps} x {args.pairs} pairs: "
          f"without accounts {a:.2f} us, with 4 accounts {b:.2f} us: {b / a:.3f}x (goal <= 1.3x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
