"""Kill latency: from a container's usage jumping over its grant to the container being gone.

Starts a ``gpumgr manager`` and one ``gpumgr agent`` (``--gpus``, default ``sim:8x24GiB``, Docker
runtime, network mode ``none``, every enforcement setting at its default) as child processes on free
loopback ports (``bench.harness.stack``), then runs ``--trials`` sequential trials, reusing that manager and agent:

  1. (untimed) POST /v1/containers {grant 1 GiB, GPUMGR_SIM_USAGE_FILE=/tmp/use, 0.5 GiB written};
     wait until the manager shows 0.5 GiB used (so the agent has seen the process and its usage),
     then sleep a random 0..``--phase`` s so the write lands at a random point of the enforcer's cycle
  2. t0 = time.time(); write 2 GiB into /proc/<container pid>/root/tmp/use from the host
  3. the container's Docker ``die`` event (one events stream, subscribed before the first trial)
     gives die_time = timeNano; **latency = die_time - t0**
  4. from the manager: ``detail.overrun.at`` (when the agent decided to act, just before it calls
     Docker's kill) and the ``killed`` event's ``time`` (when the manager marked it killed)
  5. (untimed) DELETE the record (Docker removal of the dead container)

``--neighbours N`` first starts N long-lived containers using half of their grants on the same
agent, to measure the latency of a busier agent. ``--mask`` puts a neighbour (8 GiB grant, 7 GiB
used) on the trial's GPU that drops by exactly the trial's growth in the same instant, so the GPU's
total does not change: the worst case of the enforcer's cheap growth check, which sees only totals.
All clocks are this host's wall clock. Every container carries a per-run label and is force-removed
at the end, even if the run fails.

``--concurrent N`` measures the tail instead (issue 36): each of ``--rounds`` rounds starts N
containers (1 GiB grants using 0.5 GiB, binpacked, so all share one GPU as ten jobs on one H200
did), waits until the manager shows each one's use, then writes 2 GiB into each usage file at
staggered times, random over ``--spread`` s (so each crossing lands at a random point of the
enforcer's cycle, and later ones cross while earlier ones are being killed and their bytes freed).
Each latency is from its own write to its own ``die`` event; every container must end ``killed``
for ``gpu_memory_exceeded``. ``--tree DIR`` runs the manager and agent of another checkout
(``DIR/.venv/bin/python -m gpumgr``) under this measuring code: the same bench before and after.

    python bench/enforcement_latency.py [--trials 50] [--warmup 2] [--neighbours 0] [--json out.json]
    python bench/enforcement_latency.py --concurrent 10 [--rounds 5] [--spread 1.0] [--tree DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import docker
import docker.errors

from bench import harness
from bench.harness import GiB, Stack, interval_env, machine, machine_line, stack, summary, table, wait_for, write_usage


class DieEvents:
    """One Docker events stream for this run's containers; remembers each container's ``die`` time."""

    def __init__(self, labels: dict[str, str]) -> None:
        self._client = docker.from_env(timeout=60)
        self._stream = self._client.events(decode=True, filters={
            "type": "container", "event": ["die"], "label": [f"{k}={v}" for k, v in labels.items()]})
        self._died: dict[str, float] = {}
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, name="die-events", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with contextlib.suppress(Exception):  # closed at the end of the run
            for event in self._stream:
                cid = event.get("id") or event.get("Actor", {}).get("ID", "")
                with self._cond:
                    self._died[cid] = event["timeNano"] / 1e9
                    self._cond.notify_all()

    def wait(self, cid: str, timeout: float) -> float | None:
        """The die time (epoch seconds) of container ``cid``, or None after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while cid not in self._died:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._died[cid]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._stream.close()
        self._client.close()


def create(s: Stack, grant: int | str, use: int, placement: str | None = None) -> dict[str, Any]:
    """A container granted ``grant`` using ``use``, killed on overrun; with ``placement`` if given."""
    return s.create_using(grant, use, on_overrun="kill", **({"placement": placement} if placement else {}))


def wait_usage(s: Stack, cid: str, value: int, timeout: float = 15.0) -> None:
    """Until the manager shows ``value`` bytes used by container ``cid``."""
    wait_for(lambda: s.api.get(f"/v1/containers/{cid}").json()["gpu_memory_used"] == value, timeout,
             what=f"the manager to show {value} bytes used by {cid}")


class Masker:
    """A neighbour on the trial's GPU (8 GiB grant, 7 GiB used) that frees what the trial grows by, at once."""

    GRANT, USE = 8 * GiB, 7 * GiB

    def __init__(self, s: Stack) -> None:
        record = create(s, self.GRANT, self.USE, placement="binpack")
        wait_usage(s, record["id"], self.USE)
        self.gpu = record["gpus"][0]["uuid"]
        self.pid = s.pid(record["container_id"])

    def drop(self, by: int) -> None:
        write_usage(self.pid, self.USE - by)

    def restore(self) -> None:
        write_usage(self.pid, self.USE)


def trial(s: Stack, events: DieEvents, phase: float, rng: random.Random, last_event: list[int],
          masker: Masker | None = None) -> dict[str, Any]:
    """One timed kill; returns its timings (seconds after t0) or raises."""
    record = create(s, "1GiB", GiB // 2, placement="binpack" if masker else None)
    if masker is not None and record["gpus"][0]["uuid"] != masker.gpu:
        s.api.delete(f"/v1/containers/{record['id']}")
        raise RuntimeError("the trial container did not land on the masker's GPU")
    wait_usage(s, record["id"], GiB // 2)
    pid = s.pid(record["container_id"])
    time.sleep(rng.uniform(0, phase))

    t0 = time.time()
    if masker is not None:
        masker.drop(2 * GiB - GiB // 2)  # first, so no poll can see the growth alone
    write_usage(pid, 2 * GiB)
    died = events.wait(record["container_id"], timeout=20)
    if masker is not None:
        masker.restore()

    result = {"id": record["id"], "gpu": record["gpus"][0]["index"], "die_s": None if died is None else died - t0}
    result.update(manager_view(s, record["id"], died, t0, last_event))
    gone = s.api.delete(f"/v1/containers/{record['id']}")
    if gone.status_code != 200:
        with contextlib.suppress(docker.errors.APIError):
            s.docker.api.remove_container(record["container_id"], force=True)
    return result


def manager_view(s: Stack, cid: str, died: float | None, t0: float, last_event: list[int]) -> dict[str, Any]:
    """What the manager recorded of the kill: its state, when the agent decided, when it marked it killed."""
    # The manager learns of the kill twice (the container's exit, the enforcer's overrun report), in either
    # order; wait for both so that detail.overrun is there.
    deadline = time.monotonic() + 10
    state: dict = {}
    while time.monotonic() < deadline:
        state = s.api.get(f"/v1/containers/{cid}").json()
        if state["state"] not in ("running", "creating") and "overrun" in state.get("detail", {}):
            break
        if state["state"] == "exited" and died is not None and time.monotonic() > deadline - 8:
            break  # died without the enforcer: removed by someone else
        time.sleep(0.02)
    detail = state.get("detail", {})
    overrun = detail.get("overrun") or detail
    every = s.events(last_event[0])
    mine = [e for e in every if e["container"] == cid]
    killed = [e for e in mine if e["type"] == "killed"]
    if every:
        last_event[0] = every[-1]["id"]
    return {"state": state.get("state"), "reason": state.get("reason"), "observed": overrun.get("observed"),
            "decided_s": overrun["at"] - t0 if "at" in overrun else None,
            "manager_killed_s": killed[0]["time"] - t0 if killed else None, "events": [e["type"] for e in mine],
            "overrun_events": sum(1 for e in mine if e["type"] == "overrun")}


#: How every crossing of ``--concurrent`` must end: killed by the enforcer.
KILLED = ("killed", "gpu_memory_exceeded")


def ms(v: float | None) -> str:
    return "   -   " if v is None else f"{v * 1000:7.1f}"


def crossings(s: Stack, events: DieEvents, args: argparse.Namespace, rng: random.Random) -> list[dict[str, Any]]:
    """One round of ``--concurrent``: N containers cross their grants at staggered times; each one's latency."""
    records = [create(s, "1GiB", GiB // 2, placement="binpack") for _ in range(args.concurrent)]
    try:
        for record in records:
            wait_usage(s, record["id"], GiB // 2)
        pids = [s.pid(record["container_id"]) for record in records]
        time.sleep(rng.uniform(0, args.phase))
        offsets = sorted(rng.uniform(0, args.spread) for _ in records)
        start, written = time.time(), []
        for pid, offset in zip(pids, offsets, strict=True):
            time.sleep(max(0.0, start + offset - time.time()))
            written.append(time.time())
            write_usage(pid, 2 * GiB)
        return [ended(s, events, record, t0) for record, t0 in zip(records, written, strict=True)]
    finally:
        for record in records:
            if s.api.delete(f"/v1/containers/{record['id']}").status_code != 200:
                with contextlib.suppress(docker.errors.APIError):
                    s.docker.api.remove_container(record["container_id"], force=True)


def ended(s: Stack, events: DieEvents, record: dict[str, Any], t0: float) -> dict[str, Any]:
    """How one crossing ended: its die time after ``t0`` and the state and reason the manager gave it."""
    died = events.wait(record["container_id"], timeout=20)
    state = wait_for(lambda: (r := s.api.get(f"/v1/containers/{record['id']}").json())["state"]
                     not in ("running", "creating") and r, 10, what=f"{record['id']} to end")
    overrun = state.get("detail", {}).get("overrun", {})
    return {"id": record["id"], "gpu": record["gpus"][0]["index"], "die_s": None if died is None else died - t0,
            "decided_s": overrun["at"] - t0 if "at" in overrun else None, "state": state["state"],
            "reason": state.get("reason")}


def run_concurrent(args: argparse.Namespace, out: dict[str, list]) -> None:
    """Start the stack and run ``--rounds`` rounds of ``--concurrent`` crossings into ``out["rounds"]``."""
    rng = random.Random(args.seed)
    with stack(name="enf-tail", gpus=args.gpus, agent_env=interval_env(args), keep_logs=True, tree=args.tree) as s:
        events = DieEvents(s.labels)
        try:
            for number in range(args.warmup + args.rounds):
                results = crossings(s, events, args, rng)
                wrong = [r for r in results if r["die_s"] is None or (r["state"], r["reason"]) != KILLED]
                out["failures"].extend(f"round {number + 1}: {r}" for r in wrong)
                latencies = [r["die_s"] for r in results if r["die_s"] is not None]
                label = "warmup" if number < args.warmup else f"round {number + 1 - args.warmup}"
                print(f"  {label}: " + " ".join(f"{v * 1000:.0f}" for v in sorted(latencies)) + " ms",
                      file=sys.stderr, flush=True)
                if number >= args.warmup:
                    out["rounds"].append(results)
        finally:
            events.close()


def report_concurrent(args: argparse.Namespace, out: dict[str, list], info: dict[str, Any]) -> int:
    """Print each round's p50/p90/p99/max and all rounds pooled; PASS when the pooled p99 meets ``--target``."""
    rows, pooled = [], []
    for number, results in enumerate(out["rounds"], 1):
        latencies = [r["die_s"] for r in results if r["die_s"] is not None]
        pooled += latencies
        if latencies:
            rows.append([f"round {number}", *_cells(summary(latencies))])
    if not pooled:
        print("no round completed", file=sys.stderr)
        return 1
    stats = summary(pooled)
    rows.append([f"all {len(out['rounds'])} rounds", *_cells(stats)])
    settings = ", ".join(f"{k}={v}" for k, v in interval_env(args).items()) or "default enforcement settings"
    table([("crossing write -> die", "22"), ("n", "4"), *((c, "8.1f") for c in ("p50", "p90", "p99", "max"))],
          rows, note="  (ms)", lead=f"\nkill tail: {args.concurrent} containers on one GPU crossing over "
                                   f"{args.spread:g} s, agent {args.gpus}, {settings}; {tree_line(args)}; "
                                   f"{machine_line(info)}\n")
    verdict = "PASS" if stats["p99"] <= args.target and not out["failures"] else "MISS"
    print(f"\ntarget p99 <= {args.target:.2f} s: {verdict} (p99 {stats['p99']:.3f} s, max {stats['max']:.3f} s)")
    for failure in out["failures"]:
        print("  problem: " + failure)
    harness.save(args.json, "enforcement_latency_concurrent", args, machine=info, stats=stats, rounds=out["rounds"],
                 failures=out["failures"], verdict=verdict, tree_commit=harness.commit(args.tree or harness.ROOT))
    return 0 if verdict == "PASS" else 1


def tree_line(args: argparse.Namespace) -> str:
    """Whose manager and agent ran: ``--tree``'s checkout and its commit, or this one."""
    return f"tree {args.tree} ({harness.commit(args.tree)})" if args.tree else "this tree"


def _cells(stats: dict[str, float]) -> list[float]:
    return [stats["n"], *(stats[c] * 1000 for c in ("p50", "p90", "p99", "max"))]


def run(args: argparse.Namespace, out: dict[str, list]) -> None:
    """Start the stack and run the trials into ``out`` (results, failures, interfered, spurious)."""
    rng = random.Random(args.seed)
    started = time.monotonic()
    with stack(name="enf-lat", gpus=args.gpus, agent_env=interval_env(args), keep_logs=True, tree=args.tree) as s:
        events = DieEvents(s.labels)
        try:
            for _ in range(args.neighbours):
                grant = rng.choice((1, 2, 4)) * GiB
                wait_usage(s, create(s, grant, grant // 2)["id"], grant // 2)
            masker = Masker(s) if args.mask else None
            last_event, attempt = [0], 0
            while len(out["results"]) < args.trials and attempt < args.warmup + args.trials + args.max_retries:
                if time.monotonic() - started > args.max_seconds:
                    out["failures"].append(f"stopped after {args.max_seconds}s with {len(out['results'])} trials")
                    break
                attempt += 1
                one(args, out, attempt, lambda: trial(s, events, args.phase, rng, last_event, masker))
        finally:
            events.close()


def one(args: argparse.Namespace, out: dict[str, list], attempt: int, run_trial: Any) -> None:
    """Run attempt ``attempt`` and file its result: a timed trial, a warm-up, a failure or a spoiled trial."""
    warm = attempt <= args.warmup
    try:
        res = run_trial()
    except Exception as exc:  # e.g. the container was removed by someone else before the write
        out["interfered"].append(f"attempt {attempt}: {exc}")
        print(f"  attempt {attempt}: FAILED {exc}", file=sys.stderr)
        return
    if res["die_s"] is None:
        out["failures"].append(f"attempt {attempt}: not killed within 20 s: {res}")
    elif res["state"] != "killed" or res["reason"] != "gpu_memory_exceeded":
        out["interfered"].append(f"attempt {attempt}: died {res['die_s']:.3f}s after t0 as "
                                 f"{res['state']}/{res['reason']}, not by the enforcer")
        print(f"  attempt {attempt}: container died without the enforcer ({res['state']}); retrying",
              file=sys.stderr)
        return
    if res["overrun_events"] and not warm:
        out["spurious"].append(res["id"])
    if warm:
        label = "warmup"
    else:
        out["results"].append(res)
        label = f"{len(out['results']):3}/{args.trials}"
    print(f"  {label}: decided {ms(res['decided_s'])} ms  die {ms(res['die_s'])} ms  "
          f"manager killed {ms(res['manager_killed_s'])} ms  events {','.join(res['events'])}",
          file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=50, help="timed kills (at least 50 for the report)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed kills first")
    parser.add_argument("--gpus", default="sim:8x24GiB", help="the agent's --gpus")
    harness.interval_options(parser)
    parser.add_argument("--neighbours", type=int, default=0, help="long-lived containers under grant beside the trials")
    parser.add_argument("--mask", action="store_true",
                        help="a neighbour on the trial's GPU frees exactly what the trial grows by, at the same time")
    parser.add_argument("--phase", type=float, default=1.0, help="random wait 0..PHASE s before each write")
    parser.add_argument("--max-seconds", type=float, default=1500, help="stop starting trials after this long")
    parser.add_argument("--target", type=float, default=1.0, help="target p99 latency in seconds")
    parser.add_argument("--max-retries", type=int, default=30,
                        help="attempts beyond trials+warmup allowed for trials spoiled by someone else")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--concurrent", type=int, metavar="N",
                        help="the tail: N containers on one GPU cross their grants at staggered times, each round")
    parser.add_argument("--rounds", type=int, default=5, help="with --concurrent: timed rounds (after --warmup ones)")
    parser.add_argument("--spread", type=float, default=1.0, help="with --concurrent: the crossings' spread, seconds")
    parser.add_argument("--tree", type=Path, help="run the manager and agent of this checkout (DIR/.venv/bin/python)")
    args = parser.parse_args(argv)
    if args.tree is not None and not (args.tree / ".venv" / "bin" / "python").exists():
        parser.error(f"--tree {args.tree}: no .venv/bin/python there")

    info = machine()
    if args.concurrent:
        out: dict[str, list] = {"rounds": [], "failures": []}
        try:
            run_concurrent(args, out)
        except KeyboardInterrupt:
            out["failures"].append("interrupted")
        return report_concurrent(args, out, info)
    out = {"results": [], "failures": [], "interfered": [], "spurious": []}
    try:
        run(args, out)
    except KeyboardInterrupt:
        out["failures"].append("interrupted")
    results, failures, interfered, spurious = out["results"], out["failures"], out["interfered"], out["spurious"]
    timed = [r for r in results if r["die_s"] is not None]
    if not timed:
        print("no trial completed", file=sys.stderr)
        for failure in failures:
            print("  " + failure, file=sys.stderr)
        return 1
    stats = {}
    for key, label in (("decided_s", "agent decided (overrun.at - t0)"), ("die_s", "container died (die - t0)"),
                       ("manager_killed_s", "manager marked killed (event - t0)")):
        values = [r[key] for r in timed if r[key] is not None]
        if values:
            stats[key] = {"label": label, **summary(values)}
    kill_step = [r["die_s"] - r["decided_s"] for r in timed if r["decided_s"] is not None]
    if kill_step:
        stats["kill_step_s"] = {"label": "docker kill -> die (die - at)", **summary(kill_step)}

    settings = ", ".join(f"{k}={v}" for k, v in interval_env(args).items()) or "default enforcement settings"
    cells = ("min", "p50", "p90", "p99", "max")
    table([("metric", "38"), ("n", "4"), *((c, "8.1f") for c in cells)],
          [[s["label"], s["n"], *(s[c] * 1000 for c in cells)] for s in stats.values()], note="  (ms)",
          lead=f"\nenforcement latency: {len(timed)} trials, agent {args.gpus}, {args.neighbours} neighbours, "
               f"{'growth masked by a neighbour, ' if args.mask else ''}{settings}; {tree_line(args)}; "
               f"{machine_line(info)}\n")
    p99 = stats["die_s"]["p99"]
    verdict = "PASS" if p99 <= args.target and not failures else "MISS"
    print(f"\ntarget p99(die) <= {args.target:.2f} s: {verdict} (p99 {p99:.3f} s, max {stats['die_s']['max']:.3f} s)")
    for failure in failures:
        print("  problem: " + failure)
    print(f"trials spoiled from outside (container removed by another process) and retried: {len(interfered)}")
    for line in interfered:
        print("  " + line)
    print(f"kills that also produced an 'overrun' event ('reported only'): {len(spurious)} of {len(timed)}")
    harness.save(args.json, "enforcement_latency", args, machine=info, stats=stats, trials=results, failures=failures,
                 interfered=interfered, spurious_overrun_events=spurious, verdict=verdict)
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
