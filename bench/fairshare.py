"""Fair share over time: workloads replayed on the real cluster map with accounts, on a logical clock.

Each scenario builds ``Cluster`` (25 nodes × 4 simulated GPUs of 80 GiB: 100 GPUs), puts an account
tree in force (one tenant per leaf) and replays a workload second by second on a :class:`Logical`
clock, doing what the manager's dispatcher and the agents do: jobs whose time is up end
(``finish(..., EXITED)``, as a node's report ends them), every node heartbeats what runs on it, new
jobs are submitted (``submit(queue=True)``), and ``dispatch()`` runs until a pass sends nothing.
Creates are answered ``--create-s`` after they are sent, removes ``--stop-s`` after (the stop grace:
a container that ignores SIGTERM). A job that reclaim stops (its record ends ``preempted``, reason
``reclaimed``) is submitted again at once, as a Swarm service restarts its task. A job submitted past
its account's quota (its live and queued GPUs, with it, pass the quota) is preemptible, one within
it is not (``--preemptible all``: every job is).

Each second every account's allocation and fair share (``Cluster.accounts_view``) are sampled. Per
account, in GPUs (of 100, so also % of the capacity): **MAE**, the mean of ``|allocated - fair|``,
and its **max**; **within**, the share of samples within the *tolerance* (1 GPU or 5% of the fair
share, whichever is larger). After each change of the workload (a phase's start): **reach**, the
seconds to the first sample within the tolerance, and **settle**, to the first after which every
sample stays within it until the next change (``never``: out of it at the phase's last sample); a
phase's figure is its slowest account's. Counted: reclaims planned (``dispatcher.fair.reclaims``),
containers stopped, jobs preempted twice or more, and *reversals* (two leaves that reclaimed from
each other both ways within one phase).

    python bench/fairshare.py [--scenario turns|bursts|hog|tree|kai|all] [--preemptible over|all]
                              [--stop-s 5] [--create-s 1] [--seed 1] [--json [PATH]]

``--json`` alone prints the results as JSON instead of the tables; ``--json PATH`` writes them there.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import GiB, machine, machine_line, save, table
from gpumgr.manager.clock import Clock
from gpumgr.manager.model.cluster import Cluster
from gpumgr.manager.model.records import Command, OpKind, PlacementSpec
from gpumgr.manager.tenancy.accounts import DEFAULT, AccountConfig, build_accounts
from gpumgr.manager.tenancy.tenants import OPERATOR, Tenant, TenantBook
from gpumgr.wire import defaults
from gpumgr.wire.errors import GpumgrError
from gpumgr.wire.names import State
from gpumgr.wire.protocol import ContainerReport, ContainerStatus, GpuInfo, GpuSample, Reply

#: One simulated GPU's memory; every job takes whole GPUs, so allocations are counted in GPUs.
GPU = 80 * GiB
#: 25 nodes × 4 GPUs: 100 GPUs, so an error in GPUs is also a percentage of the capacity.
NODES, GPUS_PER_NODE = 25, 4
#: The simulation's step, seconds: jobs end, arrive and are dispatched on these boundaries.
TICK = 1.0
#: Within this many GPUs, or this fraction of the fair share if larger, an account is at its share.
TOLERANCE_GPUS, TOLERANCE_SHARE = 1.0, 0.05
#: dispatch() passes in one step at most (each after the removes and creates of the one before).
PASSES = 20


class Logical(Clock):
    """A clock the simulation moves: ``monotonic()`` is its time, ``time()`` that after a fixed epoch."""

    def __init__(self) -> None:
        self.t = 1000.0

    def monotonic(self) -> float:
        return self.t

    def time(self) -> float:
        return 1.7e9 + self.t


@dataclass(frozen=True)
class Load:
    """One account's demand during a phase.

    ``backlog``: jobs kept outstanding (live or queued; a new one is submitted as one ends); ``rate``:
    Poisson arrivals a second; ``burst``: jobs submitted at the phase's start. Durations are drawn
    uniformly from ``duration`` (None: jobs never end); GPUs a job from ``gpus``.
    """

    backlog: int = 0
    rate: float = 0.0
    burst: int = 0
    duration: tuple[float, float] | None = (120.0, 600.0)
    gpus: tuple[int, ...] = (1,)
    #: every job preemptible, whatever ``--preemptible`` says (the hog's)
    preemptible: bool = False


@dataclass(frozen=True)
class Phase:
    """From ``start`` (seconds) on, each named leaf account's load (an account not named submits nothing)."""

    start: float
    label: str
    loads: dict[str, Load]


@dataclass(frozen=True)
class Scenario:
    """Accounts (path → config), phases in time order, and the end of the run (seconds)."""

    name: str
    about: str
    accounts: dict[str, AccountConfig]
    phases: list[Phase]
    end: float


def account(quota_gpus: float, weight: float = 1.0, **extra: Any) -> AccountConfig:
    """An account with a quota of ``quota_gpus`` whole GPUs."""
    return AccountConfig(quota={"gpu_memory": int(quota_gpus * GPU)}, over_quota_weight=weight, **extra)


def leaf_paths(accounts: Iterable[str]) -> list[str]:
    """The accounts with no children, in order."""
    names = list(accounts)
    return [a for a in names if not any(b.startswith(a + "/") for b in names)]


def scenarios() -> dict[str, Scenario]:
    """The workloads: (a) turns, (b) bursts, (c) a hog, (d) a deep tree, and KAI's fixture."""
    busy, hog = Load(backlog=150), Load(backlog=300, duration=(300.0, 900.0), preemptible=True)
    trickle = Load(rate=0.06, duration=(120.0, 480.0))
    burst = Load(rate=0.05, duration=(120.0, 360.0), gpus=(1, 1, 1, 2))

    def bursting(n: int) -> Load:
        return Load(rate=0.05, burst=n, duration=(60.0, 240.0), gpus=(1, 1, 1, 2))

    tree = {"research": account(50, 2), "research/vision": account(25), "research/vision/det": account(10),
            "research/vision/seg": account(15), "research/nlp": account(25), "research/nlp/llm": account(15, 2),
            "research/nlp/mt": account(10), "prod": account(50), "prod/serving": account(30),
            "prod/batch": account(20), "prod/batch/etl": account(10), "prod/batch/train": account(10)}
    deep = Load(backlog=60)
    return {s.name: s for s in (
        Scenario("turns", "(a) two accounts (quota 50 each) take turns: one busy while the other idles, then both",
                 {"a": account(50), "b": account(50)},
                 [Phase(0, "a busy, b idle", {"a": busy}), Phase(900, "a idle, b busy", {"b": busy}),
                  Phase(1800, "a busy, b idle", {"a": busy}), Phase(2700, "both busy", {"a": busy, "b": busy})],
                 3600),
        Scenario("bursts", "(b) three accounts (quota 40/30/30) trickle, and in turn submit bursts of 1-2 GPU jobs",
                 {"a": account(40), "b": account(30), "c": account(30)},
                 [Phase(0, "trickle", {n: burst for n in "abc"}),
                  Phase(300, "a bursts 120", {"a": bursting(120), "b": burst, "c": burst}),
                  Phase(900, "b bursts 100", {"a": burst, "b": bursting(100), "c": burst}),
                  Phase(1200, "c bursts 80", {"a": burst, "b": burst, "c": bursting(80)}),
                  Phase(1800, "a and b burst 80", {"a": bursting(80), "b": bursting(80), "c": burst})], 2700),
        Scenario("hog", "(c) one account (quota 25) keeps 300 preemptible jobs waiting; three (quota 25) trickle",
                 {"hog": account(25), "o1": account(25), "o2": account(25), "o3": account(25)},
                 [Phase(0, "trickle at 0.06/s", {"hog": hog, "o1": trickle, "o2": trickle, "o3": trickle}),
                  Phase(1500, "trickle doubles", {"hog": hog, **{f"o{i}": Load(rate=0.12, duration=(120.0, 480.0))
                                                                 for i in (1, 2, 3)}}),
                  Phase(3000, "trickle halves", {"hog": hog, **{f"o{i}": Load(rate=0.03, duration=(120.0, 480.0))
                                                                for i in (1, 2, 3)}})], 4200),
        Scenario("tree", "(d) a tree of 3 levels and 7 leaves, research (weight 2) and prod, leaves busy in turns",
                 tree,
                 [Phase(0, "det, llm, serving", {a: deep for a in ("research/vision/det", "research/nlp/llm",
                                                                   "prod/serving")}),
                  Phase(900, "+seg +etl -llm", {a: deep for a in ("research/vision/det", "research/vision/seg",
                                                                  "prod/serving", "prod/batch/etl")}),
                  Phase(1800, "all seven", dict.fromkeys(leaf_paths(tree), deep)),
                  Phase(2700, "det, etl, train", {a: deep for a in ("research/vision/det", "prod/batch/etl",
                                                                    "prod/batch/train")})], 3600),
        Scenario("kai", "KAI's fixture: quota 10 each, weights 3:1; a holds all 100 GPUs, then b asks for 100",
                 {"a": account(10, 3), "b": account(10, 1)},
                 [Phase(0, "a asks 100", {"a": Load(backlog=100, duration=None, preemptible=True)}),
                  Phase(300, "b asks 100", {"a": Load(backlog=100, duration=None, preemptible=True),
                                            "b": Load(backlog=100, duration=None, preemptible=True)})], 900),
    )}


@dataclass
class Job:
    """A unit of work; each time it is (re)submitted it gets a new record."""

    account: str
    gpus: int
    duration: float | None
    preemptible: bool
    preemptions: int = 0
    #: preemptions per phase index
    by_phase: dict[int, int] = field(default_factory=dict)


class Simulation:
    """One scenario replayed on a cluster map; see the module docstring."""

    def __init__(self, scenario: Scenario, preemptible_all: bool = False, seed: int = 1, create_s: float = 1.0,
                 stop_s: float = defaults.STOP_GRACE) -> None:
        self.scenario, self.preemptible_all = scenario, preemptible_all
        self.create_s, self.stop_s = create_s, stop_s
        self.pending: list[tuple[float, int, Command]] = []  # commands sent, by when they are answered
        self.sent = itertools.count()
        self.rng = random.Random(seed)
        self.clock = Logical()
        self.start = self.clock.t
        self.cluster = cluster = Cluster(clock=self.clock)
        ids = itertools.count(1)
        cluster.new_id = lambda: f"{next(ids):016x}"  # drawn at random otherwise: a run must replay exactly
        self.tenants = {leaf: Tenant(f"t{i}", f"t{i}".encode() * 8, None, None, 0)
                        for i, leaf in enumerate(leaf_paths(scenario.accounts))}
        cluster.tenants = TenantBook({t.name: t for t in self.tenants.values()}, "operator-token-000000")
        tree = build_accounts(scenario.accounts, {t.name: leaf for leaf, t in self.tenants.items()})
        assert tree is not None
        cluster.accounts = tree
        self.names = [n for n in sorted(tree.accounts) if n != DEFAULT]
        self.leaves = sorted(self.tenants)
        self.quota = {n: tree[n].quota / GPU for n in self.names}
        self.samples_of: dict[str, list[GpuSample]] = {}
        self.running: dict[str, dict[str, ContainerStatus]] = {}  # node → what it would report running
        for n in range(NODES):
            name = f"n{n:02d}"
            cluster.register(name, name.encode(), "docker", [GpuInfo(uuid=f"{name}-g{i}", index=i, name="Sim",
                             memory_total=GPU) for i in range(GPUS_PER_NODE)], [])
            self.samples_of[name] = [GpuSample(uuid=f"{name}-g{i}", memory_used=0, memory_unmanaged=0)
                                     for i in range(GPUS_PER_NODE)]
            self.running[name] = {}
        self.jobs: dict[str, Job] = {}  # record id → its job, while live or queued
        self.ends: list[tuple[float, str]] = []
        self.outstanding = dict.fromkeys(self.leaves, 0)  # GPUs live or queued, per leaf
        self.numbers = 0
        self.phase = -1
        self.samples: list[tuple[float, int, dict[str, tuple[float, float]]]] = []
        self.victims = self.rejected = 0
        self.idle = 0.0  # GPU-seconds idle while some request waited
        self.repeated = self.looped = self.worst = 0  # jobs preempted twice or more (in one phase); most of one
        self.flows: dict[int, set[tuple[str, str]]] = {}

    # --- the workload ----------------------------------------------------------------------------
    def now(self) -> float:
        return self.clock.t - self.start

    def new_job(self, leaf: str, load: Load) -> None:
        gpus = self.rng.choice(load.gpus)
        duration = None if load.duration is None else self.rng.uniform(*load.duration)
        past_quota = self.outstanding[leaf] + gpus > self.quota[leaf]
        self.numbers += 1
        job = Job(leaf, gpus, duration, load.preemptible or self.preemptible_all or past_quota)
        self.outstanding[leaf] += gpus
        self.submit(job)

    def submit(self, job: Job) -> None:
        spec = PlacementSpec(memory=GPU, count=job.gpus, placement="spread", image="sim", command=[],
                             preemptible=job.preemptible)
        try:
            record, commands = self.cluster.submit(spec, queue=True, tenant=self.tenants[job.account])
        except GpumgrError:
            self.rejected += 1
            self.outstanding[job.account] -= job.gpus
            return
        self.jobs[record.id] = job
        self.send(commands)

    def arrivals(self) -> None:
        """This second's new jobs: the phase's bursts at its start, Poisson arrivals, backlogs topped up."""
        phases = self.scenario.phases
        while self.phase + 1 < len(phases) and phases[self.phase + 1].start <= self.now():
            self.phase += 1
            for leaf, load in phases[self.phase].loads.items():
                for _ in range(load.burst):
                    self.new_job(leaf, load)
        for leaf, load in phases[self.phase].loads.items():
            for _ in range(poisson(self.rng, load.rate * TICK)):
                self.new_job(leaf, load)
            while self.outstanding[leaf] < load.backlog:
                self.new_job(leaf, load)

    def endings(self) -> None:
        """Jobs whose time is up end by themselves (as their node reports them exited)."""
        while self.ends and self.ends[0][0] <= self.clock.t:
            _, rid = heapq.heappop(self.ends)
            job = self.jobs.pop(rid, None)
            if job is None:
                continue  # it was reclaimed before its time was up
            # (one being stopped ends "preempted" here, but its work is done: it is not submitted again)
            record = self.cluster.finish(rid, State.EXITED, exit_code=0)
            self.running[record.node].pop(rid, None)
            self.outstanding[job.account] -= job.gpus

    def heartbeats(self) -> None:
        """Every node reports what runs on it; the manager answers with what must change there (a container
        chosen to be stopped whose remove was not sent with the walk, say)."""
        for name, samples in self.samples_of.items():
            answer = self.cluster.heartbeat(name, name.encode(), samples, list(self.running[name].values()))
            if answer is not None:
                self.send(answer[1])

    # --- what the dispatcher and the agents do ---------------------------------------------------
    def send(self, commands: Iterable[Command]) -> None:
        """Hand ``commands`` to their nodes: each is answered ``create_s`` or ``stop_s`` seconds from now."""
        for command in commands:
            delay = self.create_s if command.kind is OpKind.CREATE else self.stop_s
            heapq.heappush(self.pending, (self.clock.t + delay, next(self.sent), command))

    def answer(self) -> int:
        """Settle every command due by now as its node would (created and running; removed); return how many."""
        done = 0
        while self.pending and self.pending[0][0] <= self.clock.t:
            command = heapq.heappop(self.pending)[2]
            record = command.record
            done += 1
            if command.kind is OpKind.CREATE:
                report = ContainerReport(grant=record.id, container_id=f"c-{record.id}", gpus=record.gpus,
                                         gpu_memory=record.gpu_memory, state="running")
                self.send(self.cluster.settle(command, Reply(ok=True, result=report.model_dump()), None))
                job = self.jobs.get(record.id)
                if record.state is State.RUNNING:
                    self.running[record.node][record.id] = ContainerStatus(
                        grant=record.id, container_id=f"c-{record.id}", state="running")
                    if job is not None and job.duration is not None:
                        heapq.heappush(self.ends, (self.clock.t + job.duration, record.id))
                continue
            self.send(self.cluster.settle(command, Reply(ok=True), None))  # a remove: the only other command here
            self.running[record.node].pop(record.id, None)
            if record.state is State.PREEMPTED and record.id in self.jobs:
                self.preempted(record.id, record.account or "", record.detail.get("reclaimed_for_account"))
        return done

    def preempted(self, rid: str, victim: str, beneficiary: str | None) -> None:
        """A job stopped to make room: counted, and submitted again (a Swarm service restarts its task)."""
        self.victims += 1
        if beneficiary is not None:
            self.flows.setdefault(self.phase, set()).add((victim, beneficiary))
        job = self.jobs.pop(rid)
        job.preemptions += 1
        job.by_phase[self.phase] = job.by_phase.get(self.phase, 0) + 1
        self.repeated += job.preemptions == 2
        self.looped += job.by_phase[self.phase] == 2
        self.worst = max(self.worst, job.preemptions)
        self.submit(job)

    def pump(self) -> None:
        """Answer what is due, then ``dispatch()`` and answer again until nothing more is due now (the
        dispatcher is woken by every change; a command answered later waits for its second)."""
        self.answer()
        for _ in range(PASSES):
            commands, _ = self.cluster.dispatch()
            self.send(commands)
            if not self.answer():
                return

    def sample(self) -> None:
        """Every account's allocation and fair share now, and the GPUs idle while requests wait."""
        view = self.cluster.accounts_view(OPERATOR) or []
        self.samples.append((self.now(), self.phase, {a["name"]: (a["allocated"] / GPU, a["fair_share"] / GPU)
                                                      for a in view if a["name"] != DEFAULT}))
        tops = [a for a in view if a["parent"] is None]
        if any(a["waiting"] for a in tops):
            self.idle += NODES * GPUS_PER_NODE - sum(a["allocated"] for a in tops) / GPU

    def run(self) -> dict[str, Any]:
        """Replay the scenario to its end; return its figures (see :func:`figures`)."""
        while self.now() < self.scenario.end:
            self.clock.t += TICK
            self.endings()
            self.heartbeats()
            self.arrivals()
            self.pump()
            self.sample()
        return figures(self)


def poisson(rng: random.Random, mean: float) -> int:
    """A Poisson draw (Knuth's; ``mean`` is small here)."""
    if mean <= 0:
        return 0
    limit, k, p = math.exp(-mean), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def tolerance(fair: float) -> float:
    """How far from its fair share an account may be and still count as at it (GPUs)."""
    return max(TOLERANCE_GPUS, TOLERANCE_SHARE * fair)


def converged(series: list[tuple[float, float, float]], start: float) -> tuple[float | None, float | None]:
    """For ``series`` (time, allocated, fair) after a change at ``start``: seconds to the first sample within
    the tolerance (*reach*), and to the first after which every sample is within it (*settle*); None: never."""
    reach = next((t - start for t, alloc, fair in series if abs(alloc - fair) <= tolerance(fair)), None)
    first = None
    for t, alloc, fair in reversed(series):
        if abs(alloc - fair) > tolerance(fair):
            break
        first = t
    return reach, None if first is None else max(0.0, first - start)


def slowest(times: dict[str, float | None]) -> tuple[float | None, str]:
    """The slowest account's time (None if any never got there) and its name."""
    name = max(times, key=lambda n: math.inf if (v := times[n]) is None else v)
    return times[name], name


def figures(sim: Simulation) -> dict[str, Any]:
    """Per account: MAE, max error, time within the tolerance, final figures; per phase: convergence;
    and the reclaim counters."""
    per: dict[str, list[tuple[float, int, float, float]]] = {n: [] for n in sim.names}
    for t, index, values in sim.samples:
        for name in sim.names:
            per[name].append((t, index, *values.get(name, (0.0, 0.0))))
    accounts = {}
    for name, rows in per.items():
        errors = [abs(a - f) for _, _, a, f in rows]
        accounts[name] = {"quota_gpus": sim.quota[name], "leaf": name in sim.leaves,
                          "mae_gpus": sum(errors) / len(errors), "max_error_gpus": max(errors),
                          "within_tolerance": sum(e <= tolerance(f) for e, (*_, f) in zip(errors, rows, strict=True))
                          / len(rows), "final_allocated_gpus": rows[-1][2], "final_fair_share_gpus": rows[-1][3]}
    phases = []
    for index, phase in enumerate(sim.scenario.phases):
        times = {name: converged([(t, a, f) for t, p, a, f in rows if p == index], phase.start)
                 for name, rows in per.items()}
        reach, settle = ({n: v[i] for n, v in times.items()} for i in (0, 1))
        flows = sim.flows.get(index, set())
        phases.append({"start_s": phase.start, "label": phase.label, "reach_s": reach, "settle_s": settle,
                       "slowest_reach_s": slowest(reach)[0], "slowest_settle_s": slowest(settle)[0],
                       "slowest_settle_account": slowest(settle)[1],
                       "reversals": sorted(f"{a}<->{b}" for a, b in flows if a < b and (b, a) in flows)})
    return {"scenario": sim.scenario.name, "about": sim.scenario.about, "capacity_gpus": NODES * GPUS_PER_NODE,
            "seconds": sim.scenario.end, "preemptible": "all" if sim.preemptible_all else "over quota",
            "create_s": sim.create_s, "stop_s": sim.stop_s,
            "accounts": accounts, "phases": phases, "reclaims": sim.cluster.dispatcher.fair.reclaims,
            "containers_stopped": sim.victims, "jobs": sim.numbers, "rejected": sim.rejected,
            "jobs_preempted_twice_or_more": sim.repeated, "jobs_preempted_twice_in_one_phase": sim.looped,
            "most_preemptions_of_one_job": sim.worst, "still_waiting_or_live": len(sim.jobs),
            "idle_gpus_while_waiting": sim.idle / len(sim.samples)}


def report(result: dict[str, Any], wall: float) -> None:
    """Print one scenario's tables."""
    print(f"\n== {result['scenario']}: {result['about']}")
    print(f"   {result['capacity_gpus']} GPUs, {result['seconds']:.0f} simulated s, {result['jobs']} jobs, "
          f"preemptible: {result['preemptible']}, creates answered in {result['create_s']:g}s, removes in "
          f"{result['stop_s']:g}s; simulated in {wall:.1f}s")
    table([("account", "24"), ("quota", "6.0f"), ("MAE GPUs", "9.2f"), ("% cap", "6.2f"), ("max err", "8.1f"),
           ("within", "7.1%"), ("final alloc", "11.1f"), ("final fair", "10.1f")],
          [[n + ("" if a["leaf"] else "/"), a["quota_gpus"], a["mae_gpus"],
            100 * a["mae_gpus"] / result["capacity_gpus"], a["max_error_gpus"], a["within_tolerance"],
            a["final_allocated_gpus"], a["final_fair_share_gpus"]] for n, a in result["accounts"].items()], lead="\n")
    table([("phase (change at)", "30"), ("reach s", ">7"), ("settle s", ">8"), ("slowest to settle", "20"),
           ("reversals", "10")],
          [[f"{p['start_s']:>5.0f}s {p['label']}", *("never" if p[k] is None else f"{p[k]:.0f}" for k in
            ("slowest_reach_s", "slowest_settle_s")), p["slowest_settle_account"], ", ".join(p["reversals"]) or "none"]
           for p in result["phases"]], lead="\n")
    print(f"\nreclaims planned {result['reclaims']}, containers stopped {result['containers_stopped']}, "
          f"jobs preempted twice or more {result['jobs_preempted_twice_or_more']} "
          f"(twice in one phase {result['jobs_preempted_twice_in_one_phase']}), most preemptions of one job "
          f"{result['most_preemptions_of_one_job']}, submissions refused {result['rejected']}; GPUs idle while "
          f"requests waited: {result['idle_gpus_while_waiting']:.2f} on average")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    every = scenarios()
    parser.add_argument("--scenario", choices=[*every, "all"], default="all")
    parser.add_argument("--preemptible", choices=("over", "all"), default="over",
                        help="which jobs are preemptible: those submitted past their account's quota, or every one")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--create-s", type=float, default=1.0, help="seconds a node takes to answer a create")
    parser.add_argument("--stop-s", type=float, default=defaults.STOP_GRACE, help="seconds a node takes to "
                        "answer a remove (default: the stop grace, a container that ignores SIGTERM)")
    parser.add_argument("--json", nargs="?", const="-", metavar="PATH",
                        help="print the results as JSON (alone) or write them to PATH")
    args = parser.parse_args(argv)
    chosen = list(every) if args.scenario == "all" else [args.scenario]
    results, walls = [], {}
    for name in chosen:
        t0 = time.perf_counter()
        results.append(Simulation(every[name], args.preemptible == "all", args.seed, args.create_s, args.stop_s).run())
        walls[name] = time.perf_counter() - t0
        if args.json is None or args.json != "-":
            report(results[-1], walls[name])
    info = machine()
    if args.json == "-":
        print(json.dumps({"benchmark": "fairshare", "machine": info, "args": vars(args), "results": results,
                          "wall_s": walls}, indent=2, default=str))
    else:
        print(f"\ntolerance: within max({TOLERANCE_GPUS:g} GPU, {TOLERANCE_SHARE:.0%} of the fair share); errors in "
              f"GPUs of {GPU // GiB} GiB; {machine_line(info)}; wall {sum(walls.values()):.1f}s")
        save(args.json, "fairshare", args, machine=info, results=results, wall_s=walls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
