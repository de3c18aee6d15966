"""Swarm service start-up: ``docker gpu service create --replicas 10`` against plain ``docker service create``.

Target (from the issue): the median time until all replicas run, with gpumgr, is at most 1.2 x the
median of a plain ``docker service create --replicas 10`` of the same image: ratio of medians <= 1.2.

Set-up (all of it from the test suite, nothing on the host's own Docker engine is touched):

* ``tests.swarm.SwarmEngine``: a throw-away ``dockerd`` on its own socket, data and exec root, with
  ``gpumgr plugin install`` done against it (the OCI runtime hook ``gpumgr-runtime`` is its *default*
  runtime, the ``docker gpu`` CLI plugin is in its DOCKER_CONFIG), initialised as a one-node swarm on
  127.0.0.1; the test image ``gpumgr-test/busybox:latest`` is imported into it from /bin/busybox.
* ``bench.harness.stack``: ``gpumgr manager`` on free loopback ports and one ``gpumgr agent``,
  ``--gpus sim:2x48GiB`` (so ten 1 GiB replicas always fit), pointed at the engine (DOCKER_HOST) and
  at the hook's socket.

Both arms run on that same engine, so **the plain service's containers pass through the hook too**:
the hook is the engine's default runtime and a Swarm task cannot choose another. For them the shell
launcher sees ``create``, greps ``config.json``, finds no ``GPUMGR_REQUEST_MEMORY`` and execs runc;
every other runtime call (start, state, kill, delete) goes from ``sh`` straight to runc. A GPU task's
create goes from ``sh`` to the agent's hook pipe (no Python), which pins the bundle, then to runc.
``--bare-engine-reference`` adds a third arm C: plain ``docker service create`` on a second engine
started the same way but with an empty daemon.json (runc as default runtime, no hook at all).

Each trial (``--trials``, default 8, after ``--warmup`` untimed trials of each arm) runs the arms in
ABBA order (round k: A,B if k is even, else B,A; C, if asked for, last), each on a new service name:

  A  docker gpu --manager URL service create --detach --gpu-memory 1GiB --replicas 10
         --name bench-gpu-KK --stop-grace-period 1s gpumgr-test/busybox:latest sleep 3600
  B  docker service create --detach --replicas 10 --name bench-plain-KK --stop-grace-period 1s
         gpumgr-test/busybox:latest sleep 3600

  t0 = just before the CLI is started; then every ``--poll`` s (default 0.05), through the engine's
  API socket (docker-py, not the CLI, so the poller itself costs little CPU):
    tasks       the service's tasks with desired state running, all ``--replicas`` in state running
                (what ``docker service ps --filter desired-state=running`` shows): the **timed figure**
    containers  ``--replicas`` running containers labelled com.docker.swarm.service.name=NAME
    grants      GET /v1/containers?service=NAME on the manager: ``--replicas`` records in state
                running (asked in both arms so that both carry the same polling load; only A has any)
  Afterwards (untimed) every task container is inspected for its Created and StartedAt times, the
  service is removed with ``docker service rm``, and the next trial waits until its containers are
  gone, its grants are freed (A) and ``--settle`` s more.

After the trials, ``--hook-probes`` (default 20) direct calls of the installed hook launcher measure its
``create`` path outside Docker, with GPUMGR_RUNC=/bin/true so that no container is made:
  sh + exec       ``gpumgr-runtime --version`` (what every non-create call costs on top of runc)
  pass-through    ``gpumgr-runtime create --bundle B id`` with no GPU request (plain containers)
  (a create with GPUMGR_REQUEST_MEMORY is not probed: the agent grants only a container that its
  engine is creating, so the reserve round trip is timed inside the real engine with --trace-hook)
  and, for reference, ``/bin/true``, ``python -I -c pass``, ``python -I -S -c pass``, and the
  launcher's ``python -I -S`` importing what the create path imports.

Two diagnostic modes change what runs, so their figures are not the benchmark's headline:

  --trace-hook  swaps the engine's installed launcher for a wrapper that notes, for every runtime call,
                its start and end, and, for each create, the hook's phases (Python up, plugin.hook
                imported, Reserve built, socket and envelope imported, agent answered, exec of runc), by wrapping
                ask_agent, _reserve_message and os.execv around the unchanged hook code. The wrapper
                runs the Python hook for every GPU create: it times the Python path, not the pipe.

    python bench/swarm_create.py [--trials 8] [--warmup 1] [--replicas 10] [--bare-engine-reference]
                                 [--trace-hook] [--json out.json]

Needs root, dockerd, runc and /bin/busybox. Everything it starts is stopped and removed at the end,
also when a trial fails or the run is interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import docker

from bench import harness
from bench.harness import IMAGE, Stack, busybox_tar, first_line, interrupt, save, stack, summary
from gpumgr.plugin.launchers import HOOK_EAGER, HOOK_IMPORTS, launcher_code
from tests.swarm import SwarmEngine

SERVICE_LABEL = "com.docker.swarm.service.name"
LIVE = ("creating", "running")


# --- machine -------------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    """The harness's machine facts plus the Docker CLI, dockerd and runc versions."""
    return harness.machine(docker_cli=first_line(["docker", "version", "--format", "{{.Client.Version}}"]),
                           dockerd=first_line(["dockerd", "--version"]), runc=first_line(["runc", "--version"]))


def docker_time(text: str) -> float:
    """An RFC 3339 timestamp with up to nanoseconds, as Docker writes them (UTC, ``Z``), in epoch seconds."""
    match = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)", text)
    if match is None:
        raise ValueError(f"not a Docker timestamp: {text!r}")
    whole, frac, zone = match.groups()
    base = dt.datetime.fromisoformat(whole + ("+00:00" if zone == "Z" else zone)).timestamp()
    return base + (float(frac) if frac else 0.0)


# --- engines --------------------------------------------------------------------------------------
class BareSwarmEngine(SwarmEngine):
    """A SwarmEngine without gpumgr: empty daemon.json, so runc is the default runtime."""

    def _install(self) -> str:
        (self.dir / "daemon.json").write_text("{}\n")
        self.docker_config.mkdir(parents=True, exist_ok=True)
        return ""


@contextlib.contextmanager
def swarm_engine(cls: type[SwarmEngine], image_tar: bytes) -> Iterator[SwarmEngine]:
    """A started ``cls``, stopped and removed on exit, also when its constructor fails half-way (dockerd up)."""
    engine = cls.__new__(cls)
    try:
        engine.__init__(image_tar)  # type: ignore[misc]
        yield engine
    finally:
        with contextlib.suppress(Exception):
            if hasattr(engine, "proc"):
                engine.stop()
            elif hasattr(engine, "dir"):
                if hasattr(engine, "_log"):
                    engine._log.close()
                shutil.rmtree(engine.dir, ignore_errors=True)


# --- one trial ------------------------------------------------------------------------------------
class Arm:
    def __init__(self, key: str, slug: str, label: str, engine: SwarmEngine, manager: Stack, replicas: int,
                 gpu_memory: str | None) -> None:
        self.key, self.slug, self.label, self.engine, self.manager = key, slug, label, engine, manager
        self.replicas, self.gpu_memory = replicas, gpu_memory
        self.api = docker.APIClient(base_url=engine.env["DOCKER_HOST"], timeout=60)

    def command(self, name: str) -> list[str]:
        common = ["--detach", "--replicas", str(self.replicas), "--name", name, "--stop-grace-period", "1s"]
        tail = [IMAGE, "sleep", "3600"]
        if self.gpu_memory:
            return ["gpu", "--manager", self.manager.url, "service", "create", "--gpu-memory", self.gpu_memory,
                    *common, *tail]
        return ["service", "create", *common, *tail]

    def running_tasks(self, name: str) -> list[dict]:
        tasks = self.api.tasks(filters={"service": name, "desired-state": "running"})
        return [t for t in tasks if t["Status"]["State"] == "running"]

    def running_containers(self, name: str) -> list[dict]:
        return self.api.containers(filters={"label": f"{SERVICE_LABEL}={name}", "status": "running"})

    def grants(self, name: str) -> list[dict]:
        return self.manager.api.get("/v1/containers", params={"service": name}).json()["containers"]

    def trial(self, name: str, poll: float, timeout: float) -> dict[str, Any]:
        """Create the service and time it until all replicas run; the service is left running."""
        result: dict[str, Any] = {"arm": self.key, "name": name, "tasks_s": None, "containers_s": None,
                                  "grants_s": None}
        load = os.getloadavg()[0]
        t0_wall, t0 = time.time(), time.perf_counter()
        created = self.engine.docker(*self.command(name), check=False, timeout=timeout)
        result["cli_s"] = time.perf_counter() - t0
        if created.returncode != 0:
            raise RuntimeError(f"{self.label}: {' '.join(self.command(name))} failed: {created.stderr}")
        want_grants = self.gpu_memory is not None
        while True:
            now = time.perf_counter() - t0
            if result["tasks_s"] is None and len(self.running_tasks(name)) >= self.replicas:
                result["tasks_s"] = now
            if result["containers_s"] is None and len(self.running_containers(name)) >= self.replicas:
                result["containers_s"] = now
            if result["grants_s"] is None:  # asked in both arms: the same polling load on both
                running = [g for g in self.grants(name) if g["state"] == "running"]
                if want_grants and len(running) >= self.replicas:
                    result["grants_s"] = now
            if result["tasks_s"] is not None and result["containers_s"] is not None and (
                    result["grants_s"] is not None or not want_grants):
                break
            if now > timeout:
                raise RuntimeError(f"{self.label} {name}: not all {self.replicas} replicas ran within {timeout}s: "
                                   f"{result}\n{self.engine.docker('service', 'ps', '--no-trunc', name).stdout}")
            time.sleep(poll)
        result["loadavg_1m"] = load
        result.update(self._inspect(name, t0_wall))
        return result

    def _inspect(self, name: str, t0_wall: float) -> dict[str, Any]:
        """Untimed: when dockerd created and started each task container, relative to t0."""
        created, started, tasks_created, ids = [], [], [], {}
        for summary_ in self.api.containers(filters={"label": f"{SERVICE_LABEL}={name}"}):
            info = self.api.inspect_container(summary_["Id"])
            ids[info["Id"]] = [docker_time(info["Created"]), docker_time(info["State"]["StartedAt"])]
            created.append(docker_time(info["Created"]) - t0_wall)
            started.append(docker_time(info["State"]["StartedAt"]) - t0_wall)
        for task in self.api.tasks(filters={"service": name, "desired-state": "running"}):
            tasks_created.append(docker_time(task["CreatedAt"]) - t0_wall)
        runtime_path = [s - c for s, c in zip(started, created, strict=True)]
        return {"first_task_created_s": min(tasks_created), "first_container_created_s": min(created),
                "last_container_created_s": max(created), "last_container_started_s": max(started),
                "create_to_start_median_s": statistics.median(runtime_path),
                "create_to_start_max_s": max(runtime_path), "containers": ids}

    def remove(self, name: str, timeout: float) -> None:
        """Untimed: remove the service and wait until its containers and grants are gone."""
        self.engine.docker("service", "rm", name, check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            containers = self.api.containers(all=True, filters={"label": f"{SERVICE_LABEL}={name}"})
            live = [g for g in self.grants(name) if g["state"] in LIVE]
            if not containers and not live:
                return
            time.sleep(0.1)
        raise RuntimeError(f"{self.label} {name}: containers or grants still there {timeout}s after service rm")

    def close(self) -> None:
        self.api.close()


# --- the hook's create path, outside Docker ------------------------------------------------------
def time_command(argv: list[str], env: dict[str, str], n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        done = subprocess.run(argv, env=env, capture_output=True)
        times.append(time.perf_counter() - t0)
        if done.returncode != 0:
            logged = Path(argv[argv.index("--log") + 1]).read_text()[-2000:] if "--log" in argv else ""
            raise RuntimeError(f"{argv} exited {done.returncode}: {done.stderr.decode(errors='replace')[-2000:]}"
                               f"{logged}")
    return times


def hook_probes(engine: SwarmEngine, n: int) -> dict[str, dict[str, float]]:
    """The installed hook launcher's costs, each call timed from this process (fork+exec included)."""
    hook = str(engine.dir / "bin" / "gpumgr-runtime")
    python = sys.executable
    env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "GPUMGR_RUNC": "/bin/true",
           "GPUMGR_HOOK_SOCKET": engine.hook_socket, "GPUMGR_RUNTIME_CONFIG": str(engine.dir / "runtime.json")}
    bundle = Path(tempfile.mkdtemp(prefix="gpumgr-bench-bundle-", dir=engine.dir))
    base_env = ["PATH=/bin", "HOSTNAME=probe"]

    def write_bundle(process_env: list[str]) -> None:
        (bundle / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "process": {
            "args": ["sleep", "3600"], "env": process_env, "cwd": "/"}, "root": {"path": "rootfs"}}))

    results: dict[str, list[float]] = {
        "/bin/true": time_command(["/bin/true"], env, n),
        "runc --version": time_command(["runc", "--version"], env, n),
        "hook: sh + exec (gpumgr-runtime --version)": time_command([hook, "--version"], env, n),
        "python -I -c pass": time_command([python, "-I", "-c", "pass"], env, n),
        "python -I: import plugin.hook": time_command([python, "-I", "-c", "import gpumgr.plugin.hook"], env, n),
        "python -I -S -c pass": time_command([python, "-I", "-S", "-c", "pass"], env, n),
        "launcher's python -I -S: import msgpack, plugin.hook, socket, wire.envelope": time_command(
            [python, "-I", "-S", "-c", launcher_code("gpumgr.plugin.hook", HOOK_IMPORTS, HOOK_EAGER).replace(
                "sys.exit(gpumgr.plugin.hook.main())", "import socket; from gpumgr.wire import envelope")], env, n),
    }
    write_bundle(base_env)
    results["hook create, no GPU request (pass-through)"] = time_command(
        [hook, "--root", str(bundle / "root"), "create", "--bundle", str(bundle), "bench-probe-plain"], env, n)
    # a create with a GPU request is not probed here: the agent grants only a container its engine is
    # creating (bench-probe-* is none), so the reserve round trip is timed inside the trials (--trace-hook)
    shutil.rmtree(bundle, ignore_errors=True)
    return {key: summary(values) for key, values in results.items()}


# --- --trace-hook: where a create's time goes, measured inside the real engine -------------------
TRACE_PY = """import json, os, sys, time
t_start = time.time()
import gpumgr.plugin.hook as hook
marks = {{"py_start": t_start, "imported": time.time()}}
_message = hook._reserve_message
def message(container_id, env):
    marks["message"] = time.time()
    return _message(container_id, env)
hook._reserve_message = message
_ask = hook.ask_agent
def ask(request, socket_path, wait=hook.WAIT_SECONDS):
    marks["ask"] = time.time()
    import socket
    from gpumgr.wire import envelope
    marks["libs"] = time.time()
    try:
        return _ask(request, socket_path, wait)
    finally:
        marks["answered"] = time.time()
hook.ask_agent = ask
_execv = os.execv
def execv(path, args):
    marks["exec"] = time.time()
    marks["argv"] = sys.argv[1:]
    with open({log!r}, "a") as handle:
        handle.write(json.dumps(marks) + "\\n")
    _execv(path, args)
os.execv = execv
hook.main()
"""
TRACE_SH = """#!/bin/sh
# bench/swarm_create.py --trace-hook: times every runtime call; create goes through {trace_py}
s=$(date +%s.%N)
case " $* " in
  *" create "*) {python} -I {trace_py} "$@" ;;
  *) {orig} "$@" ;;
esac
rc=$?
printf '%s %s %s %s\\n' "$s" "$(date +%s.%N)" "$rc" "$*" >> {log}
exit $rc
"""


class HookTrace:
    """Replaces this engine's installed gpumgr-runtime by a timing wrapper around the same code.

    Only the throw-away engine's launcher file is swapped (dockerd execs it by path on every call); the
    hook's own code runs unchanged, with ask_agent and os.execv wrapped to note the time.
    """

    def __init__(self, engine: SwarmEngine) -> None:
        hook = engine.dir / "bin" / "gpumgr-runtime"
        orig = hook.with_name("gpumgr-runtime.orig")
        shutil.copy2(hook, orig)
        self.sh_log, self.py_log = engine.dir / "trace-sh.log", engine.dir / "trace-py.log"
        trace_py = engine.dir / "bin" / "trace_hook.py"
        trace_py.write_text(TRACE_PY.format(log=str(self.py_log)))
        tmp = hook.with_name(".gpumgr-runtime.trace")
        tmp.write_text(TRACE_SH.format(python=sys.executable, trace_py=trace_py, orig=orig, log=self.sh_log))
        tmp.chmod(0o755)
        os.replace(tmp, hook)

    def calls(self) -> tuple[dict[str, dict], list[tuple[str, float]]]:
        """Per container id: the create's marks; and (command, seconds) for every runtime call."""
        from gpumgr.plugin.hook import split_command

        creates: dict[str, dict] = {}
        every: list[tuple[str, float]] = []
        for line in self.sh_log.read_text().splitlines():
            start, end, rc, *argv = line.split(" ")
            command, _, _ = split_command(argv)
            every.append((command or "?", float(end) - float(start)))
            if command == "create" and rc == "0":
                creates[argv[-1]] = {"sh_start": float(start), "sh_end": float(end)}
        for line in self.py_log.read_text().splitlines():
            marks = json.loads(line)
            cid = marks.pop("argv")[-1]
            if cid in creates:
                creates[cid].update(marks)
        return creates, every


def trace_report(trace: HookTrace, arms: list[Arm], samples: dict[str, list[dict]]) -> dict[str, Any]:
    creates, every = trace.calls()
    phases = [("Created (dockerd) -> runtime create called", "created", "sh_start"),
              ("sh + python startup (to first line)", "sh_start", "py_start"),
              ("import gpumgr.plugin.hook", "py_start", "imported"),
              ("read config.json, parse env", "imported", "message"),
              ("build Reserve", "message", "ask"),
              ("import socket, wire.envelope", "ask", "libs"),
              ("agent -> manager -> agent round trip", "libs", "answered"),
              ("write config.json, exec", "answered", "exec"),
              ("no request: read config.json, exec", "imported", "exec"),
              ("runc create", "exec", "sh_end"),
              ("runtime create, whole call", "sh_start", "sh_end"),
              ("runtime create returned -> StartedAt", "sh_end", "started")]
    out: dict[str, Any] = {}
    print("\n## --trace-hook: each task container's runtime create, all timed trials (ms)\n")
    print("| arm | phase | n | median | p90 | max |")
    print("|---|---|---|---|---|---|")
    for arm in arms:
        rows = []
        for sample in samples[arm.key]:
            for cid, (created, started) in sample["containers"].items():
                if cid in creates:
                    rows.append({**creates[cid], "created": created, "started": started})
        out[arm.key] = {}
        for title, a, b in phases:
            values = [r[b] - r[a] for r in rows if a in r and b in r]
            if not values:
                continue
            stats = summary(values)
            out[arm.key][title] = stats
            print(f"| {arm.key} | {title} | {stats['n']} | {ms(stats['median'])} | {ms(stats['p90'])} | "
                  f"{ms(stats['max'])} |")
        if rows:
            spans = sorted((r["sh_start"], 1) for r in rows) + sorted((r["sh_end"], -1) for r in rows)
            # the most runtime creates of this arm in flight at once (across trials they never overlap)
            depth = peak = 0
            for _, step in sorted(spans):
                depth += step
                peak = max(peak, depth)
            out[arm.key]["peak_concurrent_creates"] = peak
            print(f"| {arm.key} | most creates in flight at once | {len(rows)} | {peak} | | |")
    by_command: dict[str, list[float]] = {}
    for command, seconds in every:
        by_command.setdefault(command, []).append(seconds)
    print("\n| runtime command (both arms, warm-up included) | calls | median ms | max ms |")
    print("|---|---|---|---|")
    for command, values in sorted(by_command.items()):
        print(f"| {command} | {len(values)} | {statistics.median(values) * 1000:.1f} | {max(values) * 1000:.1f} |")
    out["runtime_calls"] = {k: summary(v) for k, v in by_command.items()}
    return out


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f}"


def report(args: argparse.Namespace, arms: list[Arm], samples: dict[str, list[dict]],
           probes: dict[str, dict[str, float]] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"summary": {}}
    print(f"\n## {args.trials} trials per arm, {args.replicas} replicas, ABBA order "
          f"(ms from just before the CLI call)\n")
    print("| arm | figure | median | p90 | min | max |")
    print("|---|---|---|---|---|---|")
    figures = [("tasks_s", "all tasks running (timed)"), ("containers_s", "all containers running"),
               ("grants_s", "all grants running"), ("cli_s", "CLI returned"),
               ("first_task_created_s", "first task created (swarm)"),
               ("first_container_created_s", "first container created (dockerd)"),
               ("last_container_created_s", "last container created"),
               ("last_container_started_s", "last container started"),
               ("create_to_start_median_s", "per container Created->StartedAt, median of trial medians")]
    for arm in arms:
        out["summary"][arm.key] = {}
        for key, title in figures:
            values = [s[key] for s in samples[arm.key] if s.get(key) is not None]
            if not values:
                continue
            stats = summary(values)
            out["summary"][arm.key][key] = stats
            bold = "**" if key == "tasks_s" else ""
            print(f"| {arm.key} {arm.label} | {title} | {bold}{ms(stats['median'])}{bold} | {ms(stats['p90'])} | "
                  f"{ms(stats['min'])} | {ms(stats['max'])} |")
    a, b = samples["A"], samples["B"]
    med_a, med_b = statistics.median(s["tasks_s"] for s in a), statistics.median(s["tasks_s"] for s in b)
    pair_ratios = [x["tasks_s"] / y["tasks_s"] for x, y in zip(a, b, strict=True)]
    out["ratio_of_medians"] = med_a / med_b
    out["median_pair_ratio"] = statistics.median(pair_ratios)
    out["pair_ratios"] = pair_ratios
    print(f"\nratio of medians A/B (all tasks running): **{med_a / med_b:.3f}** (target <= 1.2: "
          f"{'met' if med_a / med_b <= 1.2 else 'MISSED'})")
    print(f"median of per-pair ratios A_k/B_k: {statistics.median(pair_ratios):.3f} "
          f"(pairs: {', '.join(f'{r:.2f}' for r in pair_ratios)})")
    if "C" in samples:
        med_c = statistics.median(s["tasks_s"] for s in samples["C"])
        out["ratio_B_over_C"] = med_b / med_c
        out["ratio_A_over_C"] = med_a / med_c
        print(f"bare-engine reference C: B/C = {med_b / med_c:.3f}, A/C = {med_a / med_c:.3f}")
    print("\n| trial | order | " + " | ".join(f"{arm.key} tasks | {arm.key} cli" for arm in arms) + " | A/B |")
    print("|---|---|" + "---|---|" * len(arms) + "---|")
    for k in range(args.trials):
        row = " | ".join(f"{ms(samples[arm.key][k]['tasks_s'])} | {ms(samples[arm.key][k]['cli_s'])}" for arm in arms)
        print(f"| {k} | {samples['order'][k]} | {row} | {pair_ratios[k]:.2f} |")
    if probes:
        out["hook_probes"] = probes
        print(f"\n## The hook's paths, {args.hook_probes} direct calls each (ms, fork+exec from Python included)\n")
        print("| call | median | p90 | min | max |")
        print("|---|---|---|---|---|")
        for key, stats in probes.items():
            print(f"| {key} | {stats['median'] * 1000:.1f} | {stats['p90'] * 1000:.1f} | {stats['min'] * 1000:.1f} | "
                  f"{stats['max'] * 1000:.1f} |")
    return out


# --- main -----------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=8, help="timed trials per arm")
    parser.add_argument("--warmup", type=int, default=1, help="untimed trials per arm first")
    parser.add_argument("--replicas", type=int, default=10)
    parser.add_argument("--gpus", default="sim:2x48GiB", help="the agent's --gpus")
    parser.add_argument("--gpu-memory", default="1GiB", help="each replica's grant in arm A")
    parser.add_argument("--poll", type=float, default=0.05, help="seconds between polls")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds a trial or a removal may take")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds of quiet after each removal")
    parser.add_argument("--hook-probes", type=int, default=20, help="direct calls per hook path (0: none)")
    parser.add_argument("--bare-engine-reference", action="store_true",
                        help="also arm C: plain service create on a second engine without the hook")
    parser.add_argument("--trace-hook", action="store_true",
                        help="diagnosis: time every runtime call and each phase of the hook's create (adds "
                             "overhead: its run's headline figures are not the benchmark's)")
    parser.add_argument("--json", type=Path, help="write every sample here")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("swarm_create.py needs root (it runs its own dockerd)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, interrupt)

    info = machine()
    print(f"machine: {info}")
    image_tar = busybox_tar()
    with contextlib.ExitStack() as running:
        engine = running.enter_context(swarm_engine(SwarmEngine, image_tar))
        manager = running.enter_context(stack(name="swarm", gpus=args.gpus, agent_env={
            "DOCKER_HOST": engine.env["DOCKER_HOST"], "GPUMGR_HOOK_SOCKET": engine.hook_socket}))
        default_runtime = engine.docker("info", "--format", "{{.DefaultRuntime}}").stdout.strip()
        print(f"engine {engine.dir}: default runtime {default_runtime!r}; manager {manager.url}")
        trace = HookTrace(engine) if args.trace_hook else None
        arms = [Arm("A", "gpu", "docker gpu service create", engine, manager, args.replicas, args.gpu_memory),
                Arm("B", "plain", "docker service create", engine, manager, args.replicas, None)]
        if args.bare_engine_reference:
            bare = running.enter_context(swarm_engine(BareSwarmEngine, image_tar))
            print(f"bare engine {bare.dir}: default runtime "
                  f"{bare.docker('info', '--format', '{{.DefaultRuntime}}').stdout.strip()!r}")
            arms.append(Arm("C", "bare", "docker service create, engine without hook", bare, manager, args.replicas,
                            None))
        for arm in arms:
            running.callback(arm.close)
        samples = run_trials(args, arms)
        probes = hook_probes(engine, args.hook_probes) if args.hook_probes else None
        out = report(args, arms, samples, probes)
        if trace is not None:
            out["trace"] = trace_report(trace, arms, samples)
        save(args.json, "swarm_create", args, machine=info, samples=samples, **out)
    return 0


def run_trials(args: argparse.Namespace, arms: list[Arm]) -> dict[str, list]:
    """Warm-up and timed trials in ABBA order (C, if there, last); each service removed after its trial."""
    samples: dict[str, list] = {arm.key: [] for arm in arms}
    samples["order"] = []
    for k in range(-args.warmup, args.trials):
        order = arms if k % 2 == 0 else [arms[1], arms[0], *arms[2:]]
        for arm in order:
            name = f"bench-{arm.slug}-{'warm' if k < 0 else ''}{abs(k):02d}"
            result = arm.trial(name, args.poll, args.timeout)
            arm.remove(name, args.timeout)
            time.sleep(args.settle)
            print(f"{'warm-up' if k < 0 else 'trial'} {k:2d} {arm.key}: tasks {ms(result['tasks_s'])} ms, "
                  f"containers {ms(result['containers_s'])} ms, grants {ms(result['grants_s'])} ms, "
                  f"cli {ms(result['cli_s'])} ms, Created->StartedAt median "
                  f"{ms(result['create_to_start_median_s'])} ms, load {result['loadavg_1m']:.2f}", flush=True)
            if k >= 0:
                samples[arm.key].append(result)
        if k >= 0:
            samples["order"].append("".join(arm.key for arm in order))
    return samples


if __name__ == "__main__":
    sys.exit(main())
