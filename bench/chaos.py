"""The chaos soak: scripted agents behind chaos proxies, seeded network faults one after another, under load.

A ``gpumgr manager`` process (heartbeat ``--heartbeat``, 0.25 s as in CI) and ``--agents`` scripted agents
in this process, each reaching the manager through a chaos proxy of its own (tests/chaos/harness.py). For
``--minutes``, episode after episode: a schedule drawn by the seed (a blip, all nodes cut at once, a
one-way or two-way silent partition of some nodes or of most, a slow link, a cut that refuses reconnects,
a mix) runs while ``--clients`` threads POST, DELETE and PATCH on every node; then the faults heal, the load
stops, and the CI suite's checks run (every 201 made exactly once and still running unless DELETE'd, every
DELETE'd container gone within 10 s of the heal, nothing mid-operation, map, records and agents agreeing).

Asserted (exit status 1 if missed): during faults, calls that involve no faulted node keep **p99 ≤ 250 ms**;
the manager process stays at **≤ 60% of a core** (every ``--cpu-window`` seconds, from /proc); every call
answered what its node's state allows; every check held after every heal.

    python bench/chaos.py [--minutes 10] [--agents 100] [--seed N] [--clients 6] [--pause 0.1] [--json out.json]

``--ha`` runs the HA soak instead (bench/chaos_ha.py): leaders stopped and killed, etcd members down, agents
restarted, on three managers over a three-member etcd and two real agents, under keyed POST (some queued),
DELETE and PATCH load; exit status 1 if any episode's checks failed:

    python bench/chaos.py --ha [--minutes 10] [--managers 3] [--clients 4] [--seed N] [--json out.json]

``--seed`` (or ``GPUMGR_CHAOS_SEED``) replays a run's episodes: the same schedules in the same order.
"""

from __future__ import annotations

import argparse
import bisect
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import cpu_seconds, machine, machine_line, pct, save, table
from tests.chaos.harness import (
    TEMPLATES,
    Call,
    ChaosStack,
    History,
    Outcome,
    Timing,
    call_problems,
    run_schedule,
    run_seed,
    schedule,
)
from tests.images import IMAGE

P99_GOAL = 0.250
CPU_GOAL = 0.60


class CpuWatch:
    """Samples a process's CPU time every ``window`` seconds on a thread: the share of one core per window."""

    def __init__(self, pid: int, window: float) -> None:
        self.pid, self.window = pid, window
        self.shares: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-watch", daemon=True)

    def start(self) -> CpuWatch:
        self.begun, self.cpu0 = time.monotonic(), cpu_seconds(self.pid)
        self._thread.start()
        return self

    def stop(self) -> float:
        """Stop sampling; the share of a core over the whole run."""
        self._stop.set()
        self._thread.join()
        return (cpu_seconds(self.pid) - self.cpu0) / (time.monotonic() - self.begun)

    def _run(self) -> None:
        last, cpu = time.monotonic(), cpu_seconds(self.pid)
        while not self._stop.wait(self.window):
            now, used = time.monotonic(), cpu_seconds(self.pid)
            self.shares.append((used - cpu) / (now - last))
            last, cpu = now, used


def soak(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Run the episodes and return the figures."""
    timing = Timing(heartbeat=args.heartbeat, create_timeout=args.create_timeout, remove_timeout=args.remove_timeout)
    started = time.monotonic()
    stack = ChaosStack(tmp, args.agents, timing=timing, prefix="soak")
    print(f"{args.agents} scripted agents ready in {time.monotonic() - started:.1f}s; seed {args.seed}", flush=True)
    history, outcomes = History(), []
    rng, few = random.Random(args.seed), max(1, args.agents // 20)
    try:
        watch = CpuWatch(stack.manager.popen.pid, args.cpu_window).start()
        until = time.monotonic() + args.minutes * 60
        while time.monotonic() < until:
            plan = schedule(rng.choice(list(TEMPLATES)), rng.randrange(1 << 32), stack.nodes, few)
            outcome = run_schedule(stack, plan, history, IMAGE, clients=args.clients, pause=args.pause, limit=None,
                                   settle_poll=0.5)
            outcomes.append(outcome)
            print(f"episode {len(outcomes)}: {plan.name} (seed {plan.seed}, {len(plan.faults)} fault(s)): "
                  f"{len(outcome.calls)} calls, settled {outcome.settled_in:.1f}s after the load, "
                  f"{len(outcome.problems)} problem(s)", flush=True)
            for problem in outcome.problems[:20]:
                print(f"  {problem}", flush=True)
        whole = watch.stop()
    finally:
        stack.stop()
    return figures(history, outcomes, watch.shares, whole)


def figures(history: History, outcomes: list[Outcome], shares: list[float], whole: float) -> dict[str, Any]:
    """The asserted figures and the context around them."""
    calls = [c for o in outcomes for c in o.calls]
    healthy = [c for c in calls if not history.faulted(c.node, c.start, c.end)]
    spans = history.fault_spans()
    starts = [begun for begun, _ in spans]

    def during(call: Call) -> bool:  # overlaps a span: the last one that began before the call ended
        at = bisect.bisect_right(starts, call.end) - 1
        return at >= 0 and spans[at][1] >= call.start

    inside = [c.took for c in healthy if during(c)]
    others = [c.took for c in healthy if not during(c)]
    problems = [p for o in outcomes for p in o.problems] + call_problems(calls, history, limit=None)
    return {
        "episodes": len(outcomes), "by_schedule": {n: sum(o.schedule.name == n for o in outcomes) for n in TEMPLATES},
        "calls": len(calls), "faulted_calls": len(calls) - len(healthy),
        "created": len(history.created), "deleted": len(history.deleted),
        "answers": _answers(calls),
        "during_faults": _latency(inside), "outside_faults": _latency(others),
        "cpu_whole": whole, "cpu_max": max(shares, default=whole), "cpu_windows": len(shares),
        "settle_max": max((o.settled_in for o in outcomes), default=0.0), "problems": problems,
    }


def _answers(calls: list[Call]) -> dict[str, int]:
    """How many calls got each answer, per method: {"POST 201": n, ...}."""
    counts: dict[str, int] = {}
    for call in calls:
        key = f"{call.method} {call.status}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def _latency(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0, "p50": 0.0, "p99": 0.0, "max": 0.0}
    return {"n": len(values), "p50": pct(values, 0.5), "p99": pct(values, 0.99), "max": max(values)}


def report(result: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """Print the figures; return the goals missed."""
    during, outside = result["during_faults"], result["outside_faults"]
    kinds = ", ".join(f"{n} {k}" for k, n in result["by_schedule"].items())
    print(f"\n{result['episodes']} episodes ({kinds}); {result['calls']} calls ({result['faulted_calls']} involving a "
          f"faulted node), {result['created']} containers created, {result['deleted']} DELETE'd; slowest settle "
          f"{result['settle_max']:.1f}s after the load")
    print("answers: " + ", ".join(f"{k} ×{n:,}" for k, n in result["answers"].items()))
    table([("calls to healthy nodes", "34"), ("n", "7,d"), ("p50 ms", "8.1f"), ("p99 ms", "8.1f"), ("max ms", "8.1f")],
          [(name, f["n"], f["p50"] * 1000, f["p99"] * 1000, f["max"] * 1000)
           for name, f in (("during faults", during), ("outside faults", outside))])
    print(f"manager CPU: {result['cpu_whole']:.0%} of a core over the run, at most {result['cpu_max']:.0%} in "
          f"{args.cpu_window:g}s windows")
    missed = []
    if during["p99"] > P99_GOAL:
        missed.append(f"p99 of calls to healthy nodes during faults {during['p99'] * 1000:.0f} ms > "
                      f"{P99_GOAL * 1000:.0f} ms")
    if result["cpu_max"] > CPU_GOAL:
        missed.append(f"manager CPU {result['cpu_max']:.0%} of a core > {CPU_GOAL:.0%}")
    if result["problems"]:
        missed.append(f"{len(result['problems'])} check(s) failed after heals (above)")
    return missed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--agents", type=int, default=100)
    parser.add_argument("--seed", type=int, default=None, help="replay a run (default: GPUMGR_CHAOS_SEED or fresh)")
    parser.add_argument("--clients", type=int, default=6, help="client threads doing POST, DELETE and PATCH")
    parser.add_argument("--pause", type=float, default=0.1, help="mean pause of a client between calls, s")
    parser.add_argument("--heartbeat", type=float, default=0.25, help="the manager's heartbeat_interval, s")
    parser.add_argument("--create-timeout", type=float, default=4.0)
    parser.add_argument("--remove-timeout", type=float, default=4.0)
    parser.add_argument("--cpu-window", type=float, default=10.0, help="the manager's CPU is judged per window, s")
    parser.add_argument("--json", help="write the figures there")
    parser.add_argument("--ha", action="store_true", help="the HA soak: leader, etcd and agent faults (chaos_ha.py)")
    parser.add_argument("--managers", type=int, default=3, help="with --ha: how many managers")
    args = parser.parse_args()
    args.seed = run_seed() if args.seed is None else args.seed
    info = machine()
    if args.ha:
        return ha_main(args, info)
    print(f"chaos soak: {args.minutes:g} min, {args.agents} agents, seed {args.seed}; {machine_line(info)}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="gpumgr-chaos-"))
    result = soak(args, tmp)
    missed = report(result, args)
    save(args.json, "chaos", args, machine=info, **result)
    if missed:
        print(f"\nMISSED (replay with --seed {args.seed}): " + "; ".join(missed) + f"\nlogs kept in {tmp}")
        return 1
    shutil.rmtree(tmp, ignore_errors=True)
    print("\nall figures met")
    return 0


def ha_main(args: argparse.Namespace, info: dict[str, Any]) -> int:
    """``--ha``: the HA soak; 1 if any episode failed its checks."""
    from bench import chaos_ha

    clients = 4 if args.clients == 6 else args.clients  # --clients' default is the network soak's
    args.clients = clients
    print(f"HA chaos soak: {args.minutes:g} min, {args.managers} managers, seed {args.seed}; {machine_line(info)}",
          flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="gpumgr-chaos-ha-"))
    result = chaos_ha.soak(args, tmp)
    failed = chaos_ha.report(result)
    save(args.json, "chaos_ha", args, machine=info, **result)
    if failed:
        print(f"\nFAILED {len(failed)} episode(s) (replay with --ha --seed {args.seed}); logs kept in {tmp}")
        return 1
    shutil.rmtree(tmp, ignore_errors=True)
    print("\nevery episode's checks held")
    return 0


if __name__ == "__main__":
    sys.exit(main())
