"""REST placement overhead: ``POST /v1/containers`` until its 201 against a bare docker-py ``containers.run``.

Starts a ``gpumgr manager`` and one ``gpumgr agent`` (``sim:2x24GiB``, Docker runtime, network
mode ``none``) as child processes on free loopback ports, then runs ``--pairs`` interleaved trials:

  A  gpumgr:  POST /v1/containers {image, command: sleep 300, gpu_memory: 1GiB}  -> 201 (running)
  B  bare:    docker.from_env().containers.run(image, ["sleep", "300"], detach=True, network_mode="none")
  C  agent-equivalent (reference, --no-equivalent drops it): the Docker calls the agent makes,
     containers.create(...) + start() + reload(), from this process

Only the call is timed; each container is removed right after its trial, outside the timed part
(DELETE for A, ``remove(force=True)`` for B and C). ``sleep`` as PID 1 ignores SIGTERM, so by default
the A container is SIGKILLed through Docker first to keep DELETE from waiting out its 5 s stop grace
(``--plain-delete`` skips that). Every container carries a per-run label and is removed at the end
even if the run fails.

    python bench/rest_overhead.py [--pairs 30] [--warmup 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import docker

from tests.procs import AgentProc, ManagerProc

IMAGE = "gpumgr-test/busybox:latest"
RUN_LABEL = "gpumgr-bench.run"


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class Trials:
    """The three ways of starting the same container, each returning (seconds, cleanup)."""

    def __init__(self, manager: ManagerProc, client: docker.DockerClient, run_id: str, plain_delete: bool) -> None:
        self.manager = manager
        self.client = client
        self.labels = {RUN_LABEL: run_id}
        self.plain_delete = plain_delete

    def gpumgr(self) -> float:
        body = {"image": IMAGE, "command": ["sleep", "300"], "gpu_memory": "1GiB", "labels": self.labels}
        t0 = time.perf_counter()
        reply = self.manager.http.post(f"{self.manager.url}/v1/containers", json=body, timeout=90)
        dt = time.perf_counter() - t0
        if reply.status_code != 201:
            raise RuntimeError(f"POST /v1/containers answered {reply.status_code}: {reply.text}")
        record = reply.json()
        if record["state"] != "running":
            raise RuntimeError(f"201 with state {record['state']!r}")
        if not self.plain_delete:
            with contextlib.suppress(docker.errors.APIError):
                self.client.api.kill(record["container_id"])
        gone = self.manager.http.delete(f"{self.manager.url}/v1/containers/{record['id']}", timeout=60)
        if gone.status_code != 200:
            raise RuntimeError(f"DELETE answered {gone.status_code}: {gone.text}")
        return dt

    def bare(self) -> float:
        t0 = time.perf_counter()
        container = self.client.containers.run(IMAGE, ["sleep", "300"], detach=True, network_mode="none",
                                               labels=self.labels)
        dt = time.perf_counter() - t0
        container.remove(force=True)
        return dt

    def equivalent(self) -> float:
        t0 = time.perf_counter()
        container = self.client.containers.create(IMAGE, ["sleep", "300"], detach=True, network_mode="none",
                                                  labels=self.labels)
        container.start()
        container.reload()
        dt = time.perf_counter() - t0
        container.remove(force=True)
        return dt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=30, help="timed rounds (each runs every arm once)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--settle", type=float, default=0.2, help="seconds of rest after each trial's cleanup")
    parser.add_argument("--no-equivalent", action="store_true", help="leave out arm C")
    parser.add_argument("--plain-delete", action="store_true", help="DELETE without killing first (5 s each)")
    parser.add_argument("--target", type=float, default=1.10, help="target median ratio gpumgr/bare")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    client = docker.from_env(timeout=60)
    client.images.get(IMAGE)  # fail early without the test image
    run_id = uuid.uuid4().hex[:12]
    arms = ["gpumgr", "bare"] + ([] if args.no_equivalent else ["agent_equivalent"])
    times: dict[str, list[float]] = {a: [] for a in arms}
    with tempfile.TemporaryDirectory(prefix="gpumgr-bench-") as tmp:
        manager = agent = None
        try:
            manager = ManagerProc(Path(tmp))
            agent = AgentProc(Path(tmp), manager, "bench-node", gpus="sim:2x24GiB", runtime="docker")
            trials = Trials(manager, client, run_id, args.plain_delete)
            run = {"gpumgr": trials.gpumgr, "bare": trials.bare, "agent_equivalent": trials.equivalent}
            for i in range(args.warmup + args.pairs):
                for arm in arms:  # A, B(, C), A, B(, C) ...
                    dt = run[arm]()
                    if i >= args.warmup:
                        times[arm].append(dt)
                    time.sleep(args.settle)
                if i >= args.warmup:
                    print(f"  {i - args.warmup + 1:3}/{args.pairs}: "
                          + "  ".join(f"{a}={times[a][-1] * 1000:6.1f}ms" for a in arms), file=sys.stderr)
        finally:
            for proc in (agent, manager):
                if proc is not None:
                    proc.stop()
            for container in client.containers.list(all=True, filters={"label": f"{RUN_LABEL}={run_id}"}):
                with contextlib.suppress(docker.errors.APIError):
                    container.remove(force=True)

    stats = {a: {"median_ms": statistics.median(v) * 1000, "p90_ms": pct(v, 0.9) * 1000,
                 "min_ms": min(v) * 1000, "max_ms": max(v) * 1000, "samples_ms": [x * 1000 for x in v]}
             for a, v in times.items()}
    ratio = stats["gpumgr"]["median_ms"] / stats["bare"]["median_ms"]
    paired = statistics.median(a / b for a, b in zip(times["gpumgr"], times["bare"], strict=True))
    print(f"\n{'arm':38} {'median ms':>10} {'p90 ms':>10} {'min ms':>10} {'max ms':>10}")
    names = {"gpumgr": "A gpumgr POST -> 201", "bare": "B docker-py containers.run",
             "agent_equivalent": "C create+start+reload (agent's calls)"}
    for arm, s in stats.items():
        print(f"{names[arm]:38} {s['median_ms']:10.1f} {s['p90_ms']:10.1f} {s['min_ms']:10.1f} {s['max_ms']:10.1f}")
    met = ratio <= args.target
    print(f"\nmedian ratio A/B = {ratio:.3f} (median of per-pair ratios {paired:.3f}); "
          f"target <= {args.target:.2f} -> {'MET' if met else 'MISSED'}")
    if "agent_equivalent" in stats:
        print(f"median ratio A/C = {stats['gpumgr']['median_ms'] / stats['agent_equivalent']['median_ms']:.3f}, "
              f"C/B = {stats['agent_equivalent']['median_ms'] / stats['bare']['median_ms']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "benchmark": "rest_overhead", "python": platform.python_version(), "args": vars(args),
            "docker": client.version().get("Version"), "results": stats, "median_ratio": ratio,
            "median_paired_ratio": paired, "target_ratio": args.target, "target_met": met,
        }, indent=2))
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
