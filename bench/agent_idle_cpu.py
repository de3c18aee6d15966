"""Agent CPU at idle: 8 simulated GPUs, 0 and then 32 running containers under their grants.

Starts a ``gpumgr manager`` and one ``gpumgr agent`` (``--gpus``, default ``sim:8x24GiB``, Docker
runtime, network mode ``none``, default enforcement and heartbeat settings) as child processes on
free loopback ports (``bench.harness.stack``), then measures two windows of ``--window`` seconds (default 60):

  A  the agent with no container
  B  the agent with ``--containers`` (default 32) running containers, each granted 2 GiB and using a
     fixed amount under it (``GPUMGR_SIM_USAGE_FILE=/tmp/use``), once the manager shows every usage

For each window: CPU seconds of the agent process (utime+stime of ``/proc/<pid>/stat``, which counts
all its threads) → % of one core, also per 10 s slice and per thread, with the exact scheduler run
time (``schedstat``) beside it; the manager's CPU over the same window; Docker's; and the whole
machine's busy share and fork rate from ``/proc/stat`` (the noise around it). Nothing talks to the
manager or the agent during a window. Other processes on a shared host may remove every
``gpumgr.grant`` container (the test suite's cleanup does): a 10 s slice in which one of ours died
is thrown away, the set is refilled, and slices are taken until the window is full.

With ``--profile auto`` (the default) a window B above ``--target`` is followed by ``py-spy record
--gil`` of the agent for ``--profile-seconds`` (the py-spy binary must be on PATH: ``pip install
py-spy``); ``--profile always`` profiles regardless.
Every container carries a per-run label and is force-removed at the end, even if the run fails.

    python bench/agent_idle_cpu.py [--window 60] [--containers 32] [--profile auto] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import harness
from bench.harness import TICK, GiB, Stack, cpu_seconds, interval_env, machine, machine_line, stack, table

SLICE = 10.0


def threads(pid: int) -> dict[int, float]:
    """Per thread: utime+stime in seconds (tick-sampled, as ``cpu_seconds``)."""
    found = {}
    for entry in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            found[int(entry)] = cpu_seconds(pid, int(entry))
    return found


def runtime_seconds(pid: int) -> float:
    """Time on CPU of all live threads from ``/proc/<pid>/task/*/schedstat`` (nanosecond scheduler accounting).

    ``utime+stime`` is sampled at the timer tick (``CONFIG_TICK_CPU_ACCOUNTING``), which is coarse for a
    process that wakes for well under a tick at a time; this is the exact figure, as a cross-check
    (threads that ended during the window are missing from it).
    """
    total = 0
    for entry in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            total += int(Path(f"/proc/{pid}/task/{entry}/schedstat").read_text().split()[0])
    return total / 1e9


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values[:8]) - idle, sum(values[:8])


def forks() -> int:
    """Processes created on this host since boot (``processes`` in /proc/stat)."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("processes "):
            return int(line.split()[1])
    return 0


def pids_named(name: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{entry}/comm").read_text().strip() == name:
                    found.append(int(entry))
    return found


class Counters:
    """Cumulative CPU counters of the agent, the manager, the engine and the machine at one instant."""

    def __init__(self, agent_pid: int, manager_pid: int, engines: dict[str, list[int]]) -> None:
        self.t = time.monotonic()
        self.agent = cpu_seconds(agent_pid)
        self.agent_sched = runtime_seconds(agent_pid)
        self.agent_threads = threads(agent_pid)
        self.manager = cpu_seconds(manager_pid)
        self.manager_sched = runtime_seconds(manager_pid)
        self.engines = {}
        for name, pids in engines.items():
            self.engines[name] = 0.0
            for pid in pids:
                with contextlib.suppress(OSError):
                    self.engines[name] += cpu_seconds(pid)
        self.busy, self.total = machine_busy()
        self.forks = forks()
        self.pids = sum(1 for e in os.listdir("/proc") if e.isdigit())


def measure(window: float, agent_pid: int, manager_pid: int, alive=lambda: True, between=lambda: None) -> dict:
    """CPU of the agent, the manager and the machine over ``window`` clean seconds, touching neither process.

    Time is taken in slices of ``SLICE`` seconds; a slice after which ``alive()`` is false (a container
    was removed by another process) is thrown away, ``between()`` repairs the set, and more slices
    are taken until ``window`` clean seconds are in.
    """
    engines = {name: pids_named(name) for name in ("dockerd", "containerd")}
    kept: list[tuple[Counters, Counters]] = []
    dropped = 0
    while sum(b.t - a.t for a, b in kept) < window - 0.5:
        left = window - sum(b.t - a.t for a, b in kept)
        before = Counters(agent_pid, manager_pid, engines)
        time.sleep(min(SLICE, left))
        after = Counters(agent_pid, manager_pid, engines)
        if alive():
            kept.append((before, after))
        else:
            dropped += 1
            between()
    elapsed = sum(b.t - a.t for a, b in kept)

    def total(get) -> float:
        return sum(get(b) - get(a) for a, b in kept)

    tids = set().union(*(b.agent_threads for _, b in kept))
    per_thread = sorted(((tid, 100 * total(lambda c, t=tid: c.agent_threads.get(t, 0.0)) / elapsed) for tid in tids),
                        key=lambda x: -x[1])
    return {
        "seconds": elapsed, "slices_kept": len(kept), "slices_dropped": dropped,
        "agent_cpu_s": total(lambda c: c.agent), "agent_pct": 100 * total(lambda c: c.agent) / elapsed,
        "agent_slices_pct": [100 * (b.agent - a.agent) / (b.t - a.t) for a, b in kept],
        "agent_sched_pct": 100 * total(lambda c: c.agent_sched) / elapsed,
        "agent_threads_pct": [{"tid": tid, "pct": p} for tid, p in per_thread if p > 0],
        "agent_thread_count": len(kept[-1][1].agent_threads),
        "manager_cpu_s": total(lambda c: c.manager), "manager_pct": 100 * total(lambda c: c.manager) / elapsed,
        "manager_sched_pct": 100 * total(lambda c: c.manager_sched) / elapsed,
        "engine_pct": {k: 100 * total(lambda c, k=k: c.engines[k]) / elapsed for k in engines},
        "machine_busy_pct_of_all_cpus": 100 * total(lambda c: c.busy) / max(1, total(lambda c: c.total)),
        "host_processes": kept[0][0].pids,
        "host_forks_per_s": total(lambda c: c.forks) / elapsed,
    }


def running_set(s: Stack, count: int, rng: random.Random, timeout: float = 120.0) -> tuple[dict[str, int], int]:
    """``count`` running containers of 2 GiB using 10..90% of it, whose usage the manager shows.

    Returns id → usage and how many had to be replaced (other processes on this host may remove every
    ``gpumgr.grant`` container, e.g. the test suite's cleanup).
    """
    expected: dict[str, int] = {}
    replaced = 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = {r["id"]: r for r in s.api.get("/v1/containers").json()["containers"]}
        dead = [cid for cid in expected if records.get(cid, {}).get("state") != "running"]
        for cid in dead:
            del expected[cid]
        replaced += len(dead)
        if len(expected) < count:
            for use in (rng.randrange(2 * GiB // 10, 2 * GiB * 9 // 10) for _ in range(count - len(expected))):
                expected[s.create_using("2GiB", use)["id"]] = use
            continue
        if all(records[cid]["gpu_memory_used"] == use for cid, use in expected.items()):
            return expected, replaced
        time.sleep(0.5)
    raise RuntimeError(f"could not get {count} containers running with their usage in {timeout:.0f} s")


#: Leaf frames of a thread that is blocked, not running: py-spy's own idle detection does not see
#: these as idle in this VM, so they are dropped by name.
IDLE_LEAVES = ("Condition.wait (threading.py", "Event.wait (threading.py", "SocketIO.readinto (socket.py",
               "Poller.poll (zmq/", "_worker (concurrent/futures/thread.py", "select (selectors.py",
               "Socket.recv", "Thread.join", "_wait_for_tstate_lock")


def profile(pid: int, seconds: int, out: Path, rate: int = 250) -> dict:
    """py-spy record (wall clock, every thread) of the agent; blocked samples dropped → where busy time goes.

    Unlike ``--gil`` this keeps time spent in system calls (reading /proc), which is most of it.
    """
    spy = shutil.which("py-spy")
    if spy is None:
        return {"error": "py-spy is not on PATH (pip install py-spy)"}
    raw = out / "agent-profile.txt"
    run = subprocess.run([spy, "record", "--pid", str(pid), "--duration", str(seconds), "--rate", str(rate), "--idle",
                          "--format", "raw", "--threads", "--output", str(raw)], capture_output=True, text=True)
    if run.returncode != 0 or not raw.exists():
        return {"error": f"py-spy failed: {run.stderr.strip()[-500:]}"}
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    by_thread: collections.Counter[str] = collections.Counter()
    samples = idle = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        if frames[-1].startswith(IDLE_LEAVES):
            idle += n
            continue
        samples += n
        by_thread[frames[0]] += n
        own[frames[-1]] += n
        for frame in set(frames[1:]):
            total[frame] += n
    return {"raw": str(raw), "seconds": seconds, "rate_hz": rate, "busy_samples": samples, "idle_samples": idle,
            "busy_pct_of_one_core": 100 * samples / (rate * seconds),
            "by_thread": by_thread.most_common(), "own": own.most_common(25), "total": total.most_common(40)}


CHEAP = "cheap poll (growth check: memory_poll)"
FULL = "full sample (Enforcer.check)"
BEAT = "heartbeat message (build + encode)"
WAKE = "empty Event.wait(poll interval) wake-up"


def breakdown(node: str, gpus: str, poll: float = 0.1, sample: float = 1.0, rounds: int = 40) -> dict:
    """CPU cost of each periodic piece of the agent's work, timed in this process on the same /proc and containers.

    Builds the agent's own objects (simulated source seeded like the agent, a Docker runtime that
    adopts the agent's containers by its node label, an enforcer) and times, with ``time.thread_time``
    and one poll interval of sleep between calls as in the agent: the cheap poll (``memory_poll``
    and the growth check, 10/s), the full sample (``Enforcer.check``, about 1/s), the heartbeat message
    (build + encode, 1/s) and an empty ``Event.wait(0.1)`` wake-up (10/s). Uses product internals, so
    it reports an error instead of failing if they changed.
    """
    try:
        import threading

        from gpumgr.agent import procmap
        from gpumgr.agent.enforcer import Enforcer
        from gpumgr.agent.gpus.select import open_source
        from gpumgr.agent.runtimes.docker_runtime import DockerRuntime
        from gpumgr.wire import protocol

        source = open_source(gpus, seed=node)
        runtime = DockerRuntime(lambda m: None, node=node)
        try:
            enforcer = Enforcer(source, source.devices(), runtime, lambda m, d: None)
            enforcer.check()
            time.sleep(2.5)  # past the simulator's settle time for processes it saw first just now

            def heartbeat() -> bytes:
                sample = enforcer.latest
                reports = [m.report(sample.usage.get(m.grant)) for m in runtime.managed()]
                return protocol.encode(protocol.Heartbeat(node=node, gpus=sample.gpus, containers=reports))

            wake = threading.Event()
            lock = source._lock

            def list_proc() -> None:
                with lock:
                    source._pids()

            def read_files() -> None:
                source.memory_poll()

            def rest_of_sample() -> None:  # what take_sample adds to the snapshots: owner and start time per process
                processes = source.process_snapshot()
                for procs in processes.values():
                    for proc in procs:
                        runtime.owner_of(proc.pid)
                        procmap.start_time_of(proc.pid)

            pieces = {CHEAP: enforcer._grew_past_room,
                      "  of which: usage files re-read (memory_poll)": read_files,
                      FULL: enforcer.check,
                      "  of which: /proc listing": list_proc,
                      "  of which: process_snapshot (list, identify new and simulated PIDs)": source.process_snapshot,
                      "  of which: process_snapshot + owner/start per PID": rest_of_sample,
                      BEAT: heartbeat,
                      WAKE: lambda: None}
            forks0 = forks()
            began_all = time.monotonic()
            costs = {}
            for name, call in pieces.items():
                spent = 0.0
                for _ in range(rounds):
                    began = time.thread_time()
                    call()
                    if name == WAKE:
                        wake.wait(poll)
                    spent += time.thread_time() - began
                    if name != WAKE:
                        time.sleep(poll)
                costs[name] = spent / rounds
            fork_rate = (forks() - forks0) / (time.monotonic() - began_all)
            managed = sum(1 for m in runtime.managed() if m.state == "running")
            usage = sum(len(v) for v in (enforcer.latest.usage or {}).values())
        finally:
            runtime.close()
            source.close()
    except Exception as exc:  # product internals moved: the breakdown is an extra
        return {"error": f"{type(exc).__name__}: {exc}"}
    per_second = {CHEAP: 1 / poll, FULL: 1 / (sample + poll), BEAT: 1, WAKE: 1 / poll}
    rate = 10
    pieces_out = []
    for name, cost in costs.items():
        rate = per_second.get(name, rate)  # the parts run as often as their whole
        pieces_out.append({"piece": name, "us_per_call": cost * 1e6, "per_s": rate, "pct_of_core": 100 * cost * rate,
                           "part": name.startswith("  ")})
    return {"managed": managed, "containers_with_usage": usage, "forks_per_s": fork_rate, "pieces": pieces_out,
            "estimate_pct": sum(p["pct_of_core"] for p in pieces_out if not p["part"])}


def run(args: argparse.Namespace, out: dict) -> None:
    """Start the stack, measure window A (no container) and window B (``--containers``), then profile and time."""
    with stack(name="enf-idle", gpus=args.gpus, agent_env=interval_env(args), keep_logs=True) as s:
        apid, mpid = s.agents[0].pid, s.manager.pid
        if not args.skip_empty:
            time.sleep(args.settle)
            print(f"window A: agent with 0 containers, {args.window:.0f} s ...", file=sys.stderr, flush=True)
            out["windows"]["empty"] = measure(args.window, apid, mpid)
        rng = random.Random(args.seed)
        box: dict = {}

        def refill() -> None:
            print(f"getting {args.containers} containers running ...", file=sys.stderr, flush=True)
            expected, replaced = running_set(s, args.containers, rng)
            if replaced:
                out["problems"].append(f"{replaced} container(s) removed by another process; replaced")
            box["pids"] = [s.pid(r["container_id"]) for r in s.api.get("/v1/containers").json()["containers"]
                           if r["id"] in expected]
            time.sleep(args.settle)

        def alive() -> bool:
            return all(os.path.exists(f"/proc/{pid}") for pid in box["pids"])

        refill()
        print(f"window B: agent with {args.containers} containers, {args.window:.0f} s ...", file=sys.stderr,
              flush=True)
        loaded = out["windows"]["loaded"] = measure(args.window, apid, mpid, alive, refill)
        if loaded["slices_dropped"]:
            out["problems"].append(f"{loaded['slices_dropped']} slice(s) of {SLICE:.0f} s dropped: a container "
                                   "was removed by another process during them")
        if args.profile == "always" or (args.profile == "auto" and loaded["agent_pct"] > args.target):
            print(f"profiling the agent with py-spy for {args.profile_seconds} s ...", file=sys.stderr, flush=True)
            out["prof"] = profile(apid, args.profile_seconds, s.tmp)
        if not args.no_breakdown:
            print("timing the agent's periodic work in this process ...", file=sys.stderr, flush=True)
            out["parts"] = breakdown(s.nodes[0], args.gpus, args.poll_interval or 0.1, args.sample_interval or 1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=float, default=60.0, help="seconds measured per configuration")
    parser.add_argument("--containers", type=int, default=32, help="running containers in window B")
    parser.add_argument("--gpus", default="sim:8x24GiB", help="the agent's --gpus")
    harness.interval_options(parser)
    parser.add_argument("--settle", type=float, default=10.0, help="seconds of rest before each window")
    parser.add_argument("--skip-empty", action="store_true", help="leave out window A (no container)")
    parser.add_argument("--profile", choices=("auto", "always", "never"), default="auto",
                        help="py-spy the agent after window B: when it misses the target (auto), always, never")
    parser.add_argument("--profile-seconds", type=int, default=30)
    parser.add_argument("--no-breakdown", action="store_true",
                        help="skip timing the agent's periodic work in this process after window B")
    parser.add_argument("--target", type=float, default=1.0, help="target agent CPU, %% of one core, in window B")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    info = machine(clk_tck=TICK)
    out: dict = {"windows": {}, "prof": None, "parts": None, "problems": []}
    try:
        run(args, out)
    except KeyboardInterrupt:
        out["problems"].append("interrupted")
    windows, prof, parts, problems = out["windows"], out["prof"], out["parts"], out["problems"]

    settings = ", ".join(f"{k}={v}" for k, v in interval_env(args).items()) or "default settings"
    table([("window", "16"), ("agent %core", "11.2f"), ("sched", "6.2f"), ("10 s slices", ">12"),
           ("manager %core", "13.2f"), ("sched", "6.2f"), ("docker+ctrd", "11.2f"), ("machine busy%", "13.1f"),
           ("pids", "5"), ("forks/s", "7.1f")],
          [["0 containers" if name == "empty" else f"{args.containers} containers", w["agent_pct"],
            w["agent_sched_pct"], f"{min(w['agent_slices_pct']):.1f}..{max(w['agent_slices_pct']):.1f}",
            w["manager_pct"], w["manager_sched_pct"], sum(w["engine_pct"].values()),
            w["machine_busy_pct_of_all_cpus"], w["host_processes"], w["host_forks_per_s"]]
           for name, w in windows.items()],
          lead=f"\nagent idle CPU: agent {args.gpus}, {settings}; {args.window:.0f} s windows; {machine_line(info)}\n"
               "agent %core: utime+stime from /proc/<pid>/stat (tick-sampled); sched: sum of the threads' schedstat "
               "run time (exact)\n")
    for name, w in windows.items():
        top = ", ".join(f"{t['tid']}: {t['pct']:.2f}" for t in w["agent_threads_pct"][:4])
        print(f"  agent threads ({name}, {w['agent_thread_count']} threads), % of one core: {top}")
    verdict = None
    if "loaded" in windows:
        loaded = windows["loaded"]["agent_pct"]
        verdict = "PASS" if loaded <= args.target else "MISS"
        print(f"\ntarget agent CPU with {args.containers} containers <= {args.target:.1f}% of one core: {verdict} "
              f"({loaded:.2f}%)")
    for problem in problems:
        print("  problem: " + problem)
    if parts:
        if "error" in parts:
            print(f"\nbreakdown: {parts['error']}")
        else:
            print(f"\nthe agent's periodic work timed in this process ({parts['managed']} managed containers, "
                  f"{parts['containers_with_usage']} with usage; thread CPU time, a poll interval apart as in "
                  f"the agent; host forks {parts['forks_per_s']:.0f}/s):")
            for piece in parts["pieces"]:
                print(f"  {piece['piece']:50} {piece['us_per_call']:8.0f} us x {piece['per_s']:4.1f}/s = "
                      f"{piece['pct_of_core']:5.2f}% of a core")
            print(f"  {'sum of the four':50} {'':8}           = {parts['estimate_pct']:5.2f}% of a core")
    if prof:
        if "error" in prof:
            print(f"\nprofile: {prof['error']}")
        else:
            print(f"\npy-spy profile of the agent, {prof['seconds']} s at {prof['rate_hz']} Hz, every thread, blocked "
                  f"samples dropped: {prof['busy_samples']} busy samples = {prof['busy_pct_of_one_core']:.2f}% of one "
                  f"core (py-spy stops the process to sample, which adds to it); raw: {prof['raw']}")
            print("  by thread: " + ", ".join(f"{t} {n}" for t, n in prof["by_thread"]))
            print("  hottest own (leaf) frames, samples:")
            for frame, n in prof["own"][:15]:
                print(f"    {n:6}  {100 * n / max(1, prof['busy_samples']):5.1f}%  {frame}")
            print("  hottest inclusive frames, samples:")
            for frame, n in prof["total"][:25]:
                print(f"    {n:6}  {100 * n / max(1, prof['busy_samples']):5.1f}%  {frame}")
    harness.save(args.json, "agent_idle_cpu", args, machine=info, windows=windows, profile=prof, breakdown=parts,
                 problems=problems, verdict=verdict)
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
