"""False kills: containers whose usage moves randomly just under (and exactly at) their grants.

Starts a ``gpumgr manager`` and one ``gpumgr agent`` (``--gpus``, default ``sim:8x24GiB``, Docker
runtime, network mode ``none``, default enforcement settings) as child processes on free loopback
ports, places ``--containers`` (default 16) containers with random, odd-sized grants (any byte count
from 512 MiB to 8 GiB, ``on_overrun: kill``), and then for ``--duration`` seconds (default 600)
rewrites each one's usage file (``/proc/<pid>/root/tmp/use``, one write() after O_TRUNC) every
50..200 ms with a random value between 90% and 100% of its grant; ``--exact`` of the writes
(default 15%) are exactly the grant, which is allowed (only usage *above* the grant is an overrun).

Every ``--check`` seconds it reads the manager's records and events: a container the manager shows
above its grant, or any ``killed``/``overrun`` event, is a false positive. At the end it counts
``GET /v1/events?type=killed,overrun`` → target **0**. A positive control follows (``--no-control``
skips it): one container is pushed to exactly grant + 1 byte and must be killed, which shows that
enforcement was live throughout. Containers removed by another process on the host (a test
suite's cleanup removes every ``gpumgr.grant`` container) show up as ``exited``, not ``killed``;
they are counted and replaced. The agent's CPU over the soak is reported too.

Every container carries a per-run label and is force-removed at the end, even if the run fails or
gets SIGTERM. A single shell command may be limited in time; run it in the background:

    nohup python bench/soak.py --duration 600 --json soak.json > soak.log 2>&1 &
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import harness
from bench.harness import GiB, MiB, Stack, cpu_seconds, machine, machine_line, stack, wait_for, write_usage


class Soak:
    """The containers, their writers and the checks."""

    def __init__(self, args: argparse.Namespace, s: Stack) -> None:
        self.args = args
        self.s = s
        self.rng = random.Random(args.seed)
        self.live: dict[str, dict] = {}  # id → {grant, pid, container_id}
        self.writes = self.exact_writes = self.write_errors = 0
        self.replaced = 0
        self.over_seen: list[dict] = []
        self.bad_events: list[dict] = []
        self.external: list[dict] = []
        self.checks = 0
        self.max_ratio = 0.0
        self.last_event = 0

    # --- containers ----------------------------------------------------------------------------
    def add(self) -> None:
        grant = self.rng.randrange(512 * MiB, 8 * GiB + 1)
        start = grant * 95 // 100
        record = self.s.create_using(grant, start, on_overrun="kill")
        pid = self.s.pid(record["container_id"])
        self.live[record["id"]] = {"grant": grant, "pid": pid, "container_id": record["container_id"],
                                   "gpu": record["gpus"][0]["index"]}

    def wait_seen(self, timeout: float = 60) -> None:
        """Until the manager shows usage (> 0) for every live container."""
        def seen() -> bool:
            records = {r["id"]: r for r in self.s.api.get("/v1/containers").json()["containers"]}
            return all(records.get(cid, {}).get("gpu_memory_used", 0) > 0 for cid in self.live)

        wait_for(seen, timeout, interval=0.5, what="the manager to show the usage of every container")

    # --- the soak ------------------------------------------------------------------------------
    def value(self, grant: int) -> int:
        if self.rng.random() < self.args.exact:
            self.exact_writes += 1
            return grant
        return self.rng.randint(math.ceil(grant * self.args.low), grant)

    def run(self, duration: float, agent_pid: int) -> dict:
        queue = [(time.monotonic() + self.rng.uniform(0, self.args.max_interval), cid) for cid in self.live]
        heapq.heapify(queue)
        began = time.monotonic()
        end = began + duration
        next_check = began + self.args.check
        next_progress = began + self.args.progress
        cpu0, t_cpu0 = cpu_seconds(agent_pid), time.monotonic()
        while (now := time.monotonic()) < end:
            if now >= next_check:
                queue.extend((now, cid) for cid in self.check())
                heapq.heapify(queue)
                next_check = time.monotonic() + self.args.check
            if now >= next_progress:
                cpu = 100 * (cpu_seconds(agent_pid) - cpu0) / (time.monotonic() - t_cpu0)
                print(f"  {now - began:6.0f} s: {self.writes} writes ({self.exact_writes} exactly at the grant), "
                      f"killed/overrun events {len(self.bad_events)}, over-grant readings {len(self.over_seen)}, "
                      f"removed from outside {len(self.external)}, agent CPU {cpu:.1f}% of a core",
                      file=sys.stderr, flush=True)
                next_progress += self.args.progress
            if not queue:
                time.sleep(0.05)
                continue
            due, cid = queue[0]
            if due > now:
                time.sleep(min(due - now, max(0.0, next_check - now), end - now))
                continue
            heapq.heappop(queue)
            entry = self.live.get(cid)
            if entry is None:
                continue
            try:
                write_usage(entry["pid"], self.value(entry["grant"]))
                self.writes += 1
            except OSError:
                self.write_errors += 1  # the container is gone; the next check finds out why
                continue
            heapq.heappush(queue, (now + self.rng.uniform(self.args.min_interval, self.args.max_interval), cid))
        cpu = 100 * (cpu_seconds(agent_pid) - cpu0) / (time.monotonic() - t_cpu0)
        self.check()
        return {"seconds": time.monotonic() - began, "agent_cpu_pct": cpu}

    def check(self) -> list[str]:
        """Look at the manager; replace containers someone else removed; return the ids of new ones."""
        self.checks += 1
        events = self.s.events(self.last_event)
        if events:
            self.last_event = events[-1]["id"]
        for event in events:
            if event["type"] in ("killed", "overrun"):
                self.bad_events.append(event)
                print(f"  FALSE POSITIVE: {event['type']} event: {event}", file=sys.stderr, flush=True)
        records = {r["id"]: r for r in self.s.api.get("/v1/containers").json()["containers"]}
        for cid, entry in list(self.live.items()):
            record = records.get(cid, {})
            used = record.get("gpu_memory_used", 0)
            self.max_ratio = max(self.max_ratio, used / entry["grant"])
            if used > entry["grant"]:
                self.over_seen.append({"id": cid, "used": used, "grant": entry["grant"], "at": time.time()})
            if record.get("state") != "running":
                del self.live[cid]
                if record.get("state") == "killed":
                    continue  # a false kill: counted from its event
                self.external.append({"id": cid, "state": record.get("state"), "reason": record.get("reason"),
                                      "exit_code": record.get("exit_code"), "at": time.time()})
        fresh = []
        while len(self.live) < self.args.containers:
            before = set(self.live)
            self.add()
            self.replaced += 1
            fresh.extend(set(self.live) - before)
        return fresh

    def control(self) -> dict:
        """Push one container to grant + 1 byte: it must be killed, and only it."""
        cid, entry = next(iter(self.live.items()))
        t0 = time.time()
        write_usage(entry["pid"], entry["grant"] + 1)
        deadline = time.monotonic() + 15
        record: dict = {}
        while time.monotonic() < deadline:
            record = self.s.api.get(f"/v1/containers/{cid}").json()
            if record["state"] == "killed":
                break
            time.sleep(0.02)
        killed = self.s.events(self.last_event, type="killed")
        mine = [e for e in killed if e["container"] == cid]
        return {"id": cid, "grant": entry["grant"], "written": entry["grant"] + 1, "state": record.get("state"),
                "reason": record.get("reason"), "observed": record.get("detail", {}).get("observed"),
                "killed_after_s": mine[0]["time"] - t0 if mine else None,
                "others_killed": [e["container"] for e in killed if e["container"] != cid]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of soak")
    parser.add_argument("--containers", type=int, default=16)
    parser.add_argument("--gpus", default="sim:8x24GiB", help="the agent's --gpus")
    parser.add_argument("--min-interval", type=float, default=0.05, help="shortest time between writes to one file")
    parser.add_argument("--max-interval", type=float, default=0.2, help="longest time between writes to one file")
    parser.add_argument("--low", type=float, default=0.9, help="lowest usage written, as a share of the grant")
    parser.add_argument("--exact", type=float, default=0.15, help="share of writes exactly at the grant")
    parser.add_argument("--check", type=float, default=5.0, help="seconds between looks at the manager")
    parser.add_argument("--progress", type=float, default=60.0, help="seconds between progress lines")
    parser.add_argument("--no-control", action="store_true", help="skip the grant+1 positive control")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    info = machine()
    problems: list[str] = []
    result: dict = {}
    control: dict | None = None
    soak: Soak | None = None
    try:
        with stack(name="enf-soak", gpus=args.gpus, keep_logs=True) as s:
            soak = Soak(args, s)
            for _ in range(args.containers):
                soak.add()
            soak.wait_seen()
            print(f"soaking {args.containers} containers for {args.duration:.0f} s ...", file=sys.stderr, flush=True)
            result = soak.run(args.duration, s.agents[0].pid)
            if not args.no_control:
                control = soak.control()
    except KeyboardInterrupt:
        problems.append("interrupted")
    if soak is None:
        return 1

    killed = [e for e in soak.bad_events if e["type"] == "killed"]
    overrun = [e for e in soak.bad_events if e["type"] == "overrun"]
    seconds = result.get("seconds", 0.0)
    print(f"\nsoak: {args.containers} containers on {args.gpus}, default enforcement settings, "
          f"{seconds:.0f} s; {machine_line(info)}")
    rows = [
        ("duration (s)", f"{seconds:.0f}"),
        ("usage writes", f"{soak.writes} ({soak.writes / max(seconds, 1):.0f}/s)"),
        ("  of which exactly the grant", f"{soak.exact_writes}"),
        ("write errors (container gone)", f"{soak.write_errors}"),
        ("manager checks", f"{soak.checks}"),
        ("highest usage/grant the manager showed", f"{soak.max_ratio:.4f}"),
        ("manager showed usage > grant", f"{len(soak.over_seen)}"),
        ("containers removed from outside, replaced", f"{len(soak.external)} / {soak.replaced}"),
        ("agent CPU during the soak (% of a core)", f"{result.get('agent_cpu_pct', float('nan')):.1f}"),
        ("killed events (false kills)", f"{len(killed)}"),
        ("overrun events", f"{len(overrun)}"),
    ]
    for name, value in rows:
        print(f"  {name:42} {value}")
    false = len(killed) + len(overrun) + len(soak.over_seen)
    verdict = "PASS" if false == 0 and not problems else "MISS"
    print(f"\ntarget 0 false kills / overrun events: {verdict}")
    if control is not None:
        ok = control["state"] == "killed" and not control["others_killed"]
        after = control["killed_after_s"]
        print(f"positive control (usage = grant + 1 byte): {'killed' if ok else 'NOT KILLED'} "
              f"({control['reason']}, {'-' if after is None else f'{after:.3f} s'}); other containers killed: "
              f"{len(control['others_killed'])}")
        if not ok:
            problems.append(f"positive control failed: {control}")
            verdict = "MISS"
    for problem in problems:
        print("  problem: " + problem)
    harness.save(args.json, "soak", args, machine=info, result=result, writes=soak.writes,
                 exact_writes=soak.exact_writes, write_errors=soak.write_errors, checks=soak.checks,
                 max_ratio=soak.max_ratio, over_seen=soak.over_seen, bad_events=soak.bad_events,
                 external_removals=soak.external, replaced=soak.replaced, control=control, problems=problems,
                 verdict=verdict)
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
