"""Gangs (issue 35): what placing one costs at 1,000 nodes, and how long a big one waits behind small work.

**Placement.** ``--nodes`` × ``--gpus`` GPUs of 80 GiB (1,000 × 8), filled to ``--fill`` (80%) of their
memory with single-GPU grants of random sizes (1–16 GiB, spread or binpack at random), so free room is
scattered over the GPUs; ``--empty`` of the nodes (10%) are left empty, so that a member of a whole node has
somewhere to go. Two gangs of ``--members`` (64) are timed, one member per node: 1 GPU of 8 GiB each
(scattered room) and 8 GPUs of 80 GiB each (whole nodes). Each repetition times ``Cluster.submit_gang``
(the plan and every member's grant and record, under the map's lock), then, alternating, the same 64
members as 64 ``Cluster.submit`` calls; the pure plan (``placing.gang.plan_gang``) is timed alone for
reference. Between repetitions the members' creates are answered and the gang removed
(``remove_gang``, its removals settled) or the singles finished, untimed, and the map must be back where
it was: every GPU's reserved bytes as before.

**Starvation.** ``--sim-nodes`` (32) nodes of one 80 GiB GPU, on a logical clock in steps of 1 s: small
jobs (10, 20 or 40 GiB on one GPU, spread, submitted with ``queue``) arrive as a Poisson stream sized to
``--load`` (0.9) of the memory, each running 60–600 s (uniform); creates are answered at once. After
``--warmup`` seconds (1,800: the map is full) a gang of ``--gang`` (16) members of one whole GPU is submitted
with ``queue``; once running it ends after ``--gang-runtime`` (0: at the next step, so what the small jobs
lose is the room held for it, not its own work). Each seed is replayed with ``gangs.reserve_after``
infinite (no reservation) and at each of ``--reserve-after`` (300 s, the default, and 60 s), over
``--hours`` (3) after the gang's submit; the same seed draws the same small jobs in every run. Reported:
the gang's wait (submit → running; ``never`` past the horizon) against the bound ``reserve_after`` + the
longest small job, how often the held GPUs moved to others, the room held unused (GPU-seconds of
``gang_hold``, and its share of the capacity while the gang waited), the small jobs' waits, and their
extra wait against the same jobs without the reservation (paired; all of them, and those that arrived
while room was held). The GPUs held for the head gang are chosen once and kept
while it stays the head (they were chosen again at each dispatch before; §27 says what that cost).

    python bench/gangs.py [--nodes 1000] [--gpus 8] [--fill 0.8] [--empty 0.1] [--members 64] [--reps 100] [--seed 1]
                          [--sim-nodes 32] [--gang 16] [--load 0.9] [--seeds 8] [--warmup 1800] [--hours 3]
                          [--gang-runtime 0] [--reserve-after 300 60] [--json PATH]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fairshare import Logical, poisson
from bench.harness import GiB, machine, machine_line, pct, save, summary, table
from bench.scheduler import build
from gpumgr.manager.model.cluster import Cluster
from gpumgr.manager.model.gangs import Gang, GangSpec
from gpumgr.manager.model.records import Command, OpKind, PlacementSpec
from gpumgr.manager.model.walk.dispatch import request_for
from gpumgr.manager.placing.gang import plan_gang
from gpumgr.wire.errors import NoFit
from gpumgr.wire.names import State
from gpumgr.wire.protocol import ContainerReport, GpuInfo, Reply

#: The command line's numeric options and their defaults (the module docstring says what each is).
OPTIONS: dict[str, int | float] = {
    "--nodes": 1000, "--gpus": 8, "--fill": 0.8, "--empty": 0.1, "--members": 64, "--reps": 100, "--seed": 1,
    "--sim-nodes": 32, "--gang": 16, "--load": 0.9, "--gang-runtime": 0.0, "--warmup": 1800.0, "--hours": 3.0,
    "--seeds": 8}
#: One simulated GPU's memory.
GPU = 80 * GiB
#: The fill's single-GPU grant sizes (GiB), drawn at random.
FILL_GIB = (1, 2, 4, 8, 12, 16)
#: The timed gangs' members, GiB per GPU: 1 GPU of scattered room; every GPU of a node, whole.
MEMBER_GIB, WHOLE_GIB = 8, 80
#: The stream's small jobs: sizes (GiB) and runtimes (seconds, uniform between).
SMALL_GIB = (10, 20, 40)
SMALL_RUNTIME = (60.0, 600.0)


# --- answering commands as a node would (at once) ------------------------------------------------
def answer(cluster: Cluster, commands: Iterable[Command]) -> list[Command]:
    """Settle every command as its node would, created and running or removed; return the creates answered."""
    created, todo = [], list(commands)
    while todo:
        command = todo.pop()
        record = command.record
        if command.kind is OpKind.CREATE:
            report = ContainerReport(grant=record.id, container_id=f"c-{record.id}", gpus=record.gpus,
                                     gpu_memory=record.gpu_memory, state="running")
            todo += cluster.settle(command, Reply(ok=True, result=report.model_dump()), None)
            created.append(command)
        else:
            todo += cluster.settle(command, Reply(ok=True), None)
    return created


# --- 1. placement at 1,000 nodes -----------------------------------------------------------------
def scattered_map(nodes: int, gpus: int, fill: float, empty: float, seed: int) -> tuple[Cluster, float]:
    """``nodes`` × ``gpus`` GPUs of 80 GiB, ``fill`` of their memory held by single-GPU grants on all but
    ``empty`` of the nodes (registered after the fill, so they stay empty); returns it and the real fill."""
    kept = round(nodes * empty)
    cluster, _ = build(nodes - kept, gpus, GPU // GiB, 0.0, seed)
    rng = random.Random(seed)
    total, reserved, misses = nodes * gpus * GPU, 0, 0
    while reserved < fill * total and misses < 20_000:
        memory = rng.choice(FILL_GIB) * GiB
        try:
            cluster.reserve(PlacementSpec(memory=memory, count=1, placement=rng.choice(("spread", "binpack")),
                                          image="img", command=["sleep", "300"]))
            reserved += memory
        except NoFit:
            misses += 1
    for n in range(nodes - kept, nodes):
        name = f"node-{n:04d}"
        cluster.register(name, name.encode(), "docker", [GpuInfo(uuid=f"GPU-{n:04d}-{i}", index=i, name="Sim",
                                                                 memory_total=GPU) for i in range(gpus)], [])
    return cluster, reserved / total


def reserved_bytes(cluster: Cluster) -> dict[str, int]:
    """Every GPU's reserved bytes: what a repetition must leave as it found."""
    return {uuid: gpu.reserved for uuid, gpu in cluster.ledger.gpus.items()}


def once_gang(cluster: Cluster, spec: GangSpec) -> tuple[float, Gang]:
    """Time one ``submit_gang``; then answer its creates, remove it and settle the removals (untimed)."""
    start = time.perf_counter()
    gang, commands = cluster.submit_gang(spec)
    took = time.perf_counter() - start
    answer(cluster, commands)
    answer(cluster, cluster.remove_gang(gang.id)[1])
    return took, gang


def once_singles(cluster: Cluster, spec: PlacementSpec, count: int) -> float:
    """Time ``count`` ``submit`` calls of ``spec``; then finish them (untimed)."""
    submit = cluster.submit
    start = time.perf_counter()
    records = [submit(spec)[0] for _ in range(count)]
    took = time.perf_counter() - start
    for record in records:
        cluster.finish(record.id, State.EXITED, exit_code=0)
    return took


def once_plan(cluster: Cluster, spec: GangSpec) -> float:
    """Time the pure plan alone (no grant, no record)."""
    member = spec.member
    request = request_for(member, member.memory)
    start = time.perf_counter()
    plan_gang(cluster.ledger.index, request, spec.replicas, spec.one_per_node)
    return time.perf_counter() - start


def placement(args: argparse.Namespace) -> dict[str, Any]:
    """Part 1: every shape's ``submit_gang``, singles and plan, ``--reps`` times, interleaved."""
    cluster, filled = scattered_map(args.nodes, args.gpus, args.fill, args.empty, args.seed)
    before = reserved_bytes(cluster)
    rows: dict[str, Any] = {}
    shapes = ((1, MEMBER_GIB, f"1 GPU x {MEMBER_GIB} GiB"),
              (args.gpus, WHOLE_GIB, f"{args.gpus} GPUs x {WHOLE_GIB} GiB (whole node)"))
    for count, gib, label in shapes:
        member = PlacementSpec(memory=gib * GiB, count=count, placement="spread", image="img", command=["train"])
        spec = GangSpec(member, args.members)
        gang_s, singles_s, plan_s, nodes_used = [], [], [], set()
        for _ in range(args.reps):
            took, gang = once_gang(cluster, spec)
            gang_s.append(took)
            nodes_used.add(len({cluster.get(m).node for m in gang.members}))
            singles_s.append(once_singles(cluster, member, args.members))
            plan_s.append(once_plan(cluster, spec))
        if reserved_bytes(cluster) != before:
            raise SystemExit(f"{label}: the map was not left as it was found")
        gang_ms, singles_ms = summary(gang_s, 1000), summary(singles_s, 1000)
        rows[label] = {"gpus": count, "gib_per_gpu": gib, "members": args.members, "submit_gang_ms": gang_ms,
                       "singles_ms": singles_ms, "plan_gang_ms": summary(plan_s, 1000),
                       "gang_over_singles": gang_ms["median"] / singles_ms["median"],
                       "distinct_nodes": sorted(nodes_used)}
    table([(f"{args.members} members, {args.nodes} x {args.gpus} GPUs, {filled:.0%} full (ms)", "44"),
           ("gang p50", "9.2f"), ("gang p99", "9.2f"), ("singles p50", "12.2f"), ("singles p99", "12.2f"),
           ("plan p50", "9.2f"), ("gang/singles", "13.2f")],
          [[label, r["submit_gang_ms"]["median"], r["submit_gang_ms"]["p99"], r["singles_ms"]["median"],
            r["singles_ms"]["p99"], r["plan_gang_ms"]["median"], r["gang_over_singles"]] for label, r in rows.items()],
          lead="\n")
    return {"fill": filled, "shapes": rows}


# --- 2. a big gang behind a stream of small jobs -------------------------------------------------
class Stream:
    """One seed's run: the small jobs' stream, the gang submitted after the warm-up, on a logical clock."""

    def __init__(self, args: argparse.Namespace, seed: int, reserve_after: float) -> None:
        self.clock = Logical()
        self.cluster = cluster = Cluster(clock=self.clock)
        ids = itertools.count(1)
        cluster.new_id = lambda: f"{next(ids):016x}"  # a run must replay exactly
        cluster.gangs.reserve_after = reserve_after
        for n in range(args.sim_nodes):
            cluster.register(f"n{n:02d}", f"n{n:02d}".encode(), "docker",
                             [GpuInfo(uuid=f"n{n:02d}-g0", index=0, name="Sim", memory_total=GPU)], [])
        self.args, self.rng = args, random.Random(seed)
        mean_gib, mean_s = sum(SMALL_GIB) / len(SMALL_GIB), sum(SMALL_RUNTIME) / 2
        self.rate = args.load * args.sim_nodes * (GPU // GiB) / (mean_gib * mean_s)  # jobs a second
        self.start = self.clock.t
        self.submit_at = args.warmup
        self.end = args.warmup + args.hours * 3600
        self.arrived: dict[str, tuple[int, float, float]] = {}  # record → (job number, arrival, runtime)
        self.waits: dict[int, tuple[float, float]] = {}  # job number → (arrival, wait)
        self.ends: list[tuple[float, str]] = []
        self.jobs = 0
        self.gang: Gang | None = None
        self.gang_started: float | None = None
        self.held_gpu_s = 0.0
        self.first_hold: float | None = None
        self.held_set: frozenset[str] = frozenset()
        self.moves, self.last_move = 0, None  # GPUs the hold left for another while the gang waited
        self.used: list[float] = []

    def now(self) -> float:
        return self.clock.t - self.start

    def started(self, commands: list[Command]) -> None:
        """Creates answered: small jobs start their runtime; the gang's members theirs."""
        for command in answer(self.cluster, commands):
            record, now = command.record, self.now()
            if record.gang is not None:
                self.gang_started = now if self.gang_started is None else self.gang_started
                heapq.heappush(self.ends, (now + self.args.gang_runtime, record.id))
                continue
            number, arrived, runtime = self.arrived.pop(record.id)
            self.waits[number] = (arrived, now - arrived)
            heapq.heappush(self.ends, (now + runtime, record.id))

    def step(self) -> None:
        """One second: jobs whose time is up end, new ones arrive, the gang is submitted, then dispatch."""
        self.clock.t += 1.0
        now = self.now()
        while self.ends and self.ends[0][0] <= now:
            self.cluster.finish(heapq.heappop(self.ends)[1], State.EXITED, exit_code=0)
        for _ in range(poisson(self.rng, self.rate)):
            memory = self.rng.choice(SMALL_GIB) * GiB
            runtime = self.rng.uniform(*SMALL_RUNTIME)
            record, commands = self.cluster.submit(PlacementSpec(memory=memory, count=1, placement="spread",
                                                                 image="img", command=["small"]), queue=True)
            self.arrived[record.id] = (self.jobs, now, runtime)
            self.jobs += 1
            self.started(commands)
        if self.gang is None and now >= self.submit_at:
            member = PlacementSpec(memory=GPU, count=1, placement="spread", image="img", command=["train"])
            self.gang, commands = self.cluster.submit_gang(GangSpec(member, self.args.gang), queue=True)
            self.started(commands)
        self.started(self.cluster.dispatch()[0])
        self.sample(now)

    def sample(self, now: float) -> None:
        """The room held for the gang (unused, as nothing else may take it) and the memory in use."""
        gpus = self.cluster.ledger.gpus.values()
        held = sum(g.gang_hold for g in gpus)
        if held:
            self.first_hold = now if self.first_hold is None else self.first_hold
            self.held_gpu_s += held / GPU
        chosen = frozenset(g.uuid for g in gpus if g.gang_want)
        if chosen and self.held_set and chosen != self.held_set:
            self.moves += len(self.held_set - chosen)
            self.last_move = now
        self.held_set = chosen or self.held_set
        if now > self.submit_at:
            self.used.append(sum(g.reserved for g in gpus) / (len(self.cluster.ledger.gpus) * GPU))

    def run(self) -> dict[str, Any]:
        """Replay to the horizon; the gang's wait and the small jobs' waits (by job number)."""
        while self.now() < self.end:
            self.step()
        wait = None if self.gang_started is None else self.gang_started - self.submit_at
        return {"gang_wait_s": wait, "held_gpu_s": self.held_gpu_s, "first_hold_s": self.first_hold,
                "hold_moves": self.moves, "last_move_s": None if self.last_move is None else
                self.last_move - self.submit_at,
                "utilisation": sum(self.used) / len(self.used), "waits": self.waits,
                "still_queued": len(self.arrived), "longest_small_s": SMALL_RUNTIME[1]}


def starvation(args: argparse.Namespace) -> dict[str, Any]:
    """Part 2: each seed without the reservation and at each ``--reserve-after``; the figures per setting."""
    settings = [("off", float("inf"))] + [(f"{r:g} s", r) for r in args.reserve_after]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in settings}
    for seed in range(1, args.seeds + 1):
        for name, after in settings:
            runs[name].append(Stream(args, seed, after).run())
    out = {name: figures(runs[name], runs["off"], after, args) for name, after in settings}
    horizon = args.hours * 3600
    table([(f"gang of {args.gang} x 1 GPU, {args.sim_nodes} GPUs, load {args.load:g}", "44"),
           ("wait p50", "9"), ("worst", "6"), ("bound", "6"), ("over", "5"), ("moves", "6"), ("held GPU-s", "11.0f"),
           ("held %", "7.1%"), ("small p50", "10.1f"), ("extra", "6.1f"), ("extra held", "11.1f"), ("used", "6.1%")],
          [[name, seconds(f["gang_wait_s"]["median"], horizon), seconds(f["gang_wait_s"]["worst"], horizon),
            seconds(f["bound_s"], horizon), f["over_bound"], max(f["hold_moves"]), f["held_gpu_s"]["median"],
            f["held_share_while_waiting"], f["small_wait_s"]["median"], f["small_extra_wait_s"]["mean"],
            f["small_extra_wait_while_held_s"]["mean"], f["utilisation"]] for name, f in out.items()], lead="\n",
          note="  (seconds)")
    return {"settings": out, "horizon_s": horizon}


def figures(runs: list[dict[str, Any]], off: list[dict[str, Any]], after: float,
            args: argparse.Namespace) -> dict[str, Any]:
    """One setting's figures over the seeds; the small jobs' extra wait is paired with the same jobs ``off``."""
    horizon = args.hours * 3600
    waits = [r["gang_wait_s"] for r in runs]
    capped = [horizon if w is None else w for w in waits]
    small = [w for r in runs for _, w in r["waits"].values()]
    extra: list[float] = []
    during: list[float] = []
    shares = []
    for run, base in zip(runs, off, strict=True):
        hold_from = run["first_hold_s"]
        hold_to = args.warmup + (horizon if run["gang_wait_s"] is None else run["gang_wait_s"])
        if hold_from is not None and hold_to > hold_from:
            shares.append(run["held_gpu_s"] / (args.sim_nodes * (hold_to - hold_from)))
        for number, (arrived, wait) in run["waits"].items():
            if number in base["waits"] and arrived >= args.warmup:
                extra.append(wait - base["waits"][number][1])
                if hold_from is not None and hold_from <= arrived <= hold_to:
                    during.append(wait - base["waits"][number][1])
    bound = after + SMALL_RUNTIME[1] if after != float("inf") else None
    return {"reserve_after_s": after, "gang_wait_s": {"per_seed": waits, "median": pct(capped, 0.5),
                                                      "worst": None if None in waits else max(capped),
                                                      "never": waits.count(None)},
            "bound_s": bound, "over_bound": sum(1 for w in capped if bound is not None and w > bound + 1),
            "hold_moves": [r["hold_moves"] for r in runs], "last_move_s": [r["last_move_s"] for r in runs],
            "held_gpu_s": {"per_seed": [r["held_gpu_s"] for r in runs],
                           "median": pct([r["held_gpu_s"] for r in runs], 0.5)},
            "held_share_while_waiting": pct(shares, 0.5) if shares else 0.0,
            "small_wait_s": summary(small), "small_extra_wait_s": mean_of(extra),
            "small_extra_wait_while_held_s": mean_of(during),
            "utilisation": pct([r["utilisation"] for r in runs], 0.5),
            "still_queued_at_end": [r["still_queued"] for r in runs]}


def mean_of(values: list[float]) -> dict[str, float]:
    """n, mean and p99 of paired differences (0s when there are none)."""
    return {"n": len(values), "mean": sum(values) / len(values) if values else 0.0,
            "p99": pct(values, 0.99) if values else 0.0}


def seconds(value: float | None, horizon: float) -> str:
    """A wait as printed: ``never`` when the gang did not start within the horizon."""
    return "-" if value is None else "never" if value >= horizon else f"{value:.0f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, default in OPTIONS.items():
        parser.add_argument(flag, type=type(default), default=default)
    parser.add_argument("--reserve-after", type=float, nargs="+", default=[300.0, 60.0])
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    info = machine()
    began = time.perf_counter()
    placed = placement(args)
    waited = starvation(args)
    print(f"\n{machine_line(info)}; {time.perf_counter() - began:.0f} s")
    save(args.json, "gangs", args, machine=info, placement=placed, starvation=waited)
    return 0


if __name__ == "__main__":
    sys.exit(main())
