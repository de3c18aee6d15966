"""Kill latency: from a container's usage jumping over its grant to the container being gone.

Starts a ``gpumgr manager`` and one ``gpumgr agent`` (``--gpus``, default ``sim:8x24GiB``, Docker
runtime, network mode ``none``, every enforcement setting at its default) as child processes on free
loopback ports, then runs ``--trials`` sequential trials, reusing that manager and agent:

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

    python bench/enforcement_latency.py [--trials 50] [--warmup 2] [--neighbours 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import docker
import docker.errors

from bench.common import IMAGE, RUN_LABEL, USAGE, agent_env, interrupt, machine, pct, remove_run, write_usage
from tests.procs import AgentProc, ManagerProc

GiB = 1 << 30
MiB = 1 << 20










class DieEvents:
    """One Docker events stream for this run's containers; remembers each container's ``die`` time."""

    def __init__(self, run_id: str) -> None:
        self._client = docker.from_env(timeout=60)
        self._stream = self._client.events(decode=True, filters={
            "type": "container", "event": ["die"], "label": [f"{RUN_LABEL}={run_id}"]})
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


def create(manager: ManagerProc, labels: dict, grant: int | str, use: int, placement: str | None = None) -> dict:
    body = {"image": IMAGE, "gpu_memory": grant, "env": {"GPUMGR_SIM_USAGE_FILE": USAGE}, "labels": labels,
            "on_overrun": "kill", "command": ["sh", "-c", f"echo {use} > {USAGE}; exec sleep 3600"]}
    if placement:
        body["placement"] = placement
    reply = manager.post("/v1/containers", json=body)
    if reply.status_code != 201 or reply.json()["state"] != "running":
        raise RuntimeError(f"POST /v1/containers answered {reply.status_code}: {reply.text}")
    return reply.json()


def wait_usage(manager: ManagerProc, cid: str, value: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if manager.get(f"/v1/containers/{cid}").json()["gpu_memory_used"] == value:
            return
        time.sleep(0.05)
    raise RuntimeError(f"the manager never showed {value} bytes used by {cid}")


class Masker:
    """A neighbour on the trial's GPU (8 GiB grant, 7 GiB used) that frees what the trial grows by, at once."""

    GRANT, USE = 8 * GiB, 7 * GiB

    def __init__(self, manager: ManagerProc, client: docker.DockerClient, labels: dict) -> None:
        record = create(manager, labels, self.GRANT, self.USE, placement="binpack")
        wait_usage(manager, record["id"], self.USE)
        self.gpu = record["gpus"][0]["uuid"]
        self.pid = client.api.inspect_container(record["container_id"])["State"]["Pid"]

    def drop(self, by: int) -> None:
        write_usage(self.pid, self.USE - by)

    def restore(self) -> None:
        write_usage(self.pid, self.USE)


def trial(manager: ManagerProc, client: docker.DockerClient, events: DieEvents, labels: dict,
          phase: float, rng: random.Random, last_event: list[int], masker: Masker | None = None) -> dict:
    """One timed kill; returns its timings (seconds after t0) or raises."""
    record = create(manager, labels, "1GiB", GiB // 2, placement="binpack" if masker else None)
    if masker is not None and record["gpus"][0]["uuid"] != masker.gpu:
        manager.delete(f"/v1/containers/{record['id']}")
        raise RuntimeError("the trial container did not land on the masker's GPU")
    wait_usage(manager, record["id"], GiB // 2)
    pid = client.api.inspect_container(record["container_id"])["State"]["Pid"]
    time.sleep(rng.uniform(0, phase))

    t0 = time.time()
    if masker is not None:
        masker.drop(2 * GiB - GiB // 2)  # first, so no poll can see the growth alone
    write_usage(pid, 2 * GiB)
    died = events.wait(record["container_id"], timeout=20)
    if masker is not None:
        masker.restore()

    result = {"id": record["id"], "gpu": record["gpus"][0]["index"], "die_s": None if died is None else died - t0}
    # The manager learns of the kill twice (the container's exit, the enforcer's overrun report), in either
    # order; wait for both so that detail.overrun is there.
    deadline = time.monotonic() + 10
    state: dict = {}
    while time.monotonic() < deadline:
        state = manager.get(f"/v1/containers/{record['id']}").json()
        if state["state"] not in ("running", "creating") and "overrun" in state.get("detail", {}):
            break
        if state["state"] == "exited" and died is not None and time.monotonic() > deadline - 8:
            break  # died without the enforcer: removed by someone else
        time.sleep(0.02)
    detail = state.get("detail", {})
    overrun = detail.get("overrun") or detail
    result["state"] = state.get("state")
    result["reason"] = state.get("reason")
    result["observed"] = overrun.get("observed")
    result["decided_s"] = overrun["at"] - t0 if "at" in overrun else None
    mine = [e for e in manager.get("/v1/events", params={"since": last_event[0]}).json()["events"]
            if e["container"] == record["id"]]
    killed = [e for e in mine if e["type"] == "killed"]
    result["manager_killed_s"] = killed[0]["time"] - t0 if killed else None
    result["events"] = [e["type"] for e in mine]
    result["overrun_events"] = sum(1 for e in mine if e["type"] == "overrun")
    every = manager.get("/v1/events", params={"since": last_event[0]}).json()["events"]
    if every:
        last_event[0] = every[-1]["id"]

    gone = manager.delete(f"/v1/containers/{record['id']}")
    if gone.status_code != 200:
        with contextlib.suppress(docker.errors.APIError):
            client.api.remove_container(record["container_id"], force=True)
    return result








def summary(values: list[float]) -> dict:
    return {"n": len(values), "min": min(values), "p50": pct(values, 0.5), "p90": pct(values, 0.9),
            "p99": pct(values, 0.99), "max": max(values), "mean": sum(values) / len(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=50, help="timed kills (at least 50 for the report)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed kills first")
    parser.add_argument("--gpus", default="sim:8x24GiB", help="the agent's --gpus")
    parser.add_argument("--poll-interval", type=float,
                        help="set the agent's GPUMGR_POLL_INTERVAL (default: leave the agent's default, 0.1 s)")
    parser.add_argument("--sample-interval", type=float,
                        help="set the agent's GPUMGR_SAMPLE_INTERVAL (default: leave the agent's default, 1.0 s)")
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
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, interrupt)

    client = docker.from_env(timeout=60)
    client.images.get(IMAGE)  # fail early without the test image
    run_id = uuid.uuid4().hex[:12]
    labels = {RUN_LABEL: run_id}
    rng = random.Random(args.seed)
    results: list[dict] = []
    failures: list[str] = []
    interfered: list[str] = []
    spurious: list[str] = []
    started = time.monotonic()
    info = machine()
    tmp = Path(tempfile.mkdtemp(prefix="gpumgr-enf-latency-"))
    manager = agent = events = None
    try:
        manager = ManagerProc(tmp)
        agent = AgentProc(tmp, manager, f"enf-lat-{run_id[:6]}", gpus=args.gpus, runtime="docker",
                          env=agent_env(args))
        events = DieEvents(run_id)
        for _ in range(args.neighbours):
            grant = rng.choice((1, 2, 4)) * GiB
            record = create(manager, labels, grant, grant // 2)
            wait_usage(manager, record["id"], grant // 2)
        masker = Masker(manager, client, labels) if args.mask else None
        last_event = [0]
        attempt = 0
        while len(results) < args.trials and attempt < args.warmup + args.trials + args.max_retries:
            if time.monotonic() - started > args.max_seconds:
                failures.append(f"stopped after {args.max_seconds}s with {len(results)} trials")
                break
            attempt += 1
            warm = attempt <= args.warmup
            try:
                res = trial(manager, client, events, labels, args.phase, rng, last_event, masker)
            except Exception as exc:  # e.g. the container was removed by someone else before the write
                interfered.append(f"attempt {attempt}: {exc}")
                print(f"  attempt {attempt}: FAILED {exc}", file=sys.stderr)
                continue
            if res["die_s"] is None:
                failures.append(f"attempt {attempt}: not killed within 20 s: {res}")
            elif res["state"] != "killed" or res["reason"] != "gpu_memory_exceeded":
                interfered.append(f"attempt {attempt}: died {res['die_s']:.3f}s after t0 as "
                                  f"{res['state']}/{res['reason']}, not by the enforcer")
                print(f"  attempt {attempt}: container died without the enforcer ({res['state']}); retrying",
                      file=sys.stderr)
                continue
            if res["overrun_events"] and not warm:
                spurious.append(res["id"])
            if warm:
                label = "warmup"
            else:
                results.append(res)
                label = f"{len(results):3}/{args.trials}"

            def ms(v):
                return "   -   " if v is None else f"{v * 1000:7.1f}"

            print(f"  {label}: decided {ms(res['decided_s'])} ms  die {ms(res['die_s'])} ms  "
                  f"manager killed {ms(res['manager_killed_s'])} ms  events {','.join(res['events'])}",
                  file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        failures.append("interrupted")
    finally:
        if events is not None:
            events.close()
        removed = remove_run(client, run_id)
        for proc in (agent, manager):
            if proc is not None:
                proc.stop()
        left = client.containers.list(all=True, filters={"label": f"{RUN_LABEL}={run_id}"})
        print(f"removed {removed} leftover container(s); {len(left)} remain; logs in {tmp}", file=sys.stderr)

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

    settings = ", ".join(f"{k}={v}" for k, v in agent_env(args).items()) or "default enforcement settings"
    print(f"\nenforcement latency: {len(timed)} trials, agent {args.gpus}, {args.neighbours} neighbours, "
          f"{'growth masked by a neighbour, ' if args.mask else ''}"
          f"{settings}; machine {info['nproc']} x {info['cpu_model']}; commit {info['commit']}")
    print(f"{'metric':38} {'n':>4} {'min':>8} {'p50':>8} {'p90':>8} {'p99':>8} {'max':>8}  (ms)")
    for s in stats.values():
        cells = " ".join(f"{s[k] * 1000:8.1f}" for k in ("min", "p50", "p90", "p99", "max"))
        print(f"{s['label']:38} {s['n']:4} {cells}")
    p99 = stats["die_s"]["p99"]
    verdict = "PASS" if p99 <= args.target and not failures else "MISS"
    print(f"\ntarget p99(die) <= {args.target:.2f} s: {verdict} (p99 {p99:.3f} s, max {stats['die_s']['max']:.3f} s)")
    for failure in failures:
        print("  problem: " + failure)
    print(f"trials spoiled from outside (container removed by another process) and retried: {len(interfered)}")
    for line in interfered:
        print("  " + line)
    print(f"kills that also produced an 'overrun' event ('reported only'): {len(spurious)} of {len(timed)}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "benchmark": "enforcement_latency", "machine": info, "args": vars(args), "stats": stats,
            "trials": results, "failures": failures,
            "interfered": interfered, "spurious_overrun_events": spurious, "verdict": verdict}, indent=2))
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
