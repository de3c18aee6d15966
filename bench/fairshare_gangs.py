"""A gang reclaimed for, on the fair-share simulator: how long a gang of an account below its fair share waits
for room that another account borrowed, and what reclaim stops for it.

The simulator of ``bench/fairshare.py`` (25 nodes × 4 GPUs of 80 GiB, a logical clock, creates answered
``--create-s`` after they are sent, removes ``--stop-s`` after, a reclaimed job submitted again at once)
replays one workload: account ``a`` (quota 20 GPUs) keeps 300 preemptible jobs of one GPU outstanding
(each runs 300 to 900 s), so it borrows the whole idle cluster; at ``--gang-at`` seconds account ``b``
(quota 40) submits a gang of ``--replicas`` members of ``--member-gpus`` GPUs each, one per node, with
``queue``, that runs to the end. Reported: the gang's wait (submitted → every member placed), the
containers and GPUs stopped for it (and how many of them it needed), reclaims after it was placed (with
demands fixed: a's stopped jobs ask again), both accounts' final allocation against their fair share,
and the fair-share figures of ``bench/fairshare.py`` per phase.

    python bench/fairshare_gangs.py [--replicas 16] [--member-gpus 2] [--gang-at 600] [--end 1800]
                                    [--stop-s 5] [--create-s 1] [--seed 1] [--json [PATH]]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fairshare import GPU, Load, Phase, Scenario, Simulation, account, figures, report
from bench.harness import machine, machine_line, save
from gpumgr.manager.model.gangs import GangSpec
from gpumgr.manager.model.records import PlacementSpec
from gpumgr.manager.tenancy.tenants import OPERATOR
from gpumgr.wire import defaults


def scenario(gang_at: float, end: float) -> Scenario:
    """a borrows the idle cluster with preemptible jobs; b's gang arrives at ``gang_at``."""
    hog = Load(backlog=300, duration=(300.0, 900.0), preemptible=True)
    return Scenario("gang", "a (quota 20) borrows all 100 GPUs; b (quota 40) then submits a gang",
                    {"a": account(20), "b": account(40)},
                    [Phase(0, "a borrows everything", {"a": hog}), Phase(gang_at, "b's gang arrives", {"a": hog})],
                    end)


class GangRun(Simulation):
    """The simulation, with b's gang submitted at ``gang_at`` and followed."""

    def __init__(self, replicas: int, member_gpus: int, gang_at: float, end: float, seed: int = 1,
                 create_s: float = 1.0, stop_s: float = defaults.STOP_GRACE) -> None:
        super().__init__(scenario(gang_at, end), seed=seed, create_s=create_s, stop_s=stop_s)
        self.replicas, self.member_gpus, self.gang_at = replicas, member_gpus, gang_at
        self.gang: str | None = None
        self.placed_s: float | None = None
        self.reclaims_then = 0
        self.stopped_for_gang: list[int] = []  # GPUs of each container stopped for it

    def arrivals(self) -> None:
        super().arrivals()
        if self.gang is None and self.now() >= self.gang_at:
            member = PlacementSpec(memory=GPU, count=self.member_gpus, placement="spread", image="sim", command=[])
            gang, commands = self.cluster.submit_gang(GangSpec(member, self.replicas), tenant=self.tenants["b"],
                                                      queue=True)
            self.gang = gang.id
            self.send(commands)

    def preempted(self, rid: str, victim: str, beneficiary: str | None) -> None:
        record = self.cluster.ledger.records[rid]
        if self.gang is not None and record.preempted_for == self.gang:
            self.stopped_for_gang.append(record.count)
        super().preempted(rid, victim, beneficiary)

    def sample(self) -> None:
        super().sample()
        if self.gang is not None and self.placed_s is None and \
                self.cluster.gang_views(OPERATOR, self.gang)[0]["state"] in ("creating", "running"):
            self.placed_s = self.now()
            self.reclaims_then = self.cluster.dispatcher.fair.reclaims

    def result(self) -> dict[str, Any]:
        out = figures(self)
        placed = self.placed_s is not None
        out["gang"] = {"replicas": self.replicas, "member_gpus": self.member_gpus, "submitted_s": self.gang_at,
                       "wait_s": None if self.placed_s is None else self.placed_s - self.gang_at,
                       "containers_stopped_for_it": len(self.stopped_for_gang),
                       "gpus_stopped_for_it": sum(self.stopped_for_gang),
                       "gpus_it_needs": self.replicas * self.member_gpus,
                       "reclaims_after_placed": self.cluster.dispatcher.fair.reclaims - self.reclaims_then
                       if placed else None}
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--member-gpus", type=int, default=2)
    parser.add_argument("--gang-at", type=float, default=600.0)
    parser.add_argument("--end", type=float, default=1800.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--create-s", type=float, default=1.0)
    parser.add_argument("--stop-s", type=float, default=defaults.STOP_GRACE)
    parser.add_argument("--json", nargs="?", const="-", metavar="PATH",
                        help="print the results as JSON (alone) or write them to PATH")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    run = GangRun(args.replicas, args.member_gpus, args.gang_at, args.end, args.seed, args.create_s, args.stop_s)
    run.run()
    result, wall, info = run.result(), time.perf_counter() - t0, machine()
    if args.json == "-":
        print(json.dumps({"benchmark": "fairshare_gangs", "machine": info, "args": vars(args), "results": [result],
                          "wall_s": wall}, indent=2, default=str))
        return 0
    report(result, wall)
    gang = result["gang"]
    wait = "never" if gang["wait_s"] is None else f"{gang['wait_s']:.0f}s"
    print(f"\ngang of {gang['replicas']} × {gang['member_gpus']} GPUs submitted at {gang['submitted_s']:.0f}s: "
          f"placed whole after {wait}; stopped for it {gang['containers_stopped_for_it']} containers "
          f"({gang['gpus_stopped_for_it']} GPUs, it needs {gang['gpus_it_needs']}); reclaims after it was placed: "
          f"{gang['reclaims_after_placed']}; {machine_line(info)}")
    save(args.json, "fairshare_gangs", args, machine=info, results=[result], wall_s=wall)
    return 0


if __name__ == "__main__":
    sys.exit(main())
