"""REST placement overhead: ``POST /v1/containers`` until its 201 against a bare docker-py ``containers.run``.

Starts a ``gpumgr manager`` and one ``gpumgr agent`` (``sim:2x24GiB``, Docker runtime, network
mode ``none``) as child processes on free loopback ports (``bench.harness.stack``), then runs
``--pairs`` interleaved trials:

  A  gpumgr:  POST /v1/containers {image, command: sleep 300, gpu_memory: 1GiB}  -> 201 (running)
  K  keyed (--keyed): the same POST with a fresh ``Idempotency-Key`` each time (the key is claimed in the
     state directory before the create goes out, and its answer kept after: two fsynced writes)
  B  bare:    docker.from_env().containers.run(image, ["sleep", "300"], detach=True, network_mode="none")
  C  agent-equivalent (reference, --no-equivalent drops it): the Docker calls the agent makes,
     api.create_container(...) + api.start(), from this process
  D  agent-before (reference, dropped with C): the calls it made before, containers.create(...)
     (create + inspect) + start() + reload() (inspect)

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
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import docker.errors

from bench.harness import IMAGE, Stack, median, save, stack, summary, table

NAMES = {"gpumgr": "A gpumgr POST -> 201", "keyed": "K POST with Idempotency-Key", "bare": "B docker-py containers.run",
         "agent_equivalent": "C create+start (agent's calls)", "agent_before": "D create+inspect+start+inspect"}


class Trials:
    """The three ways of starting the same container, each returning the seconds its call took."""

    def __init__(self, s: Stack, plain_delete: bool) -> None:
        self.s, self.client, self.plain_delete = s, s.docker, plain_delete
        self.args = {"image": IMAGE, "command": ["sleep", "300"], "detach": True, "network_mode": "none",
                     "labels": s.labels}

    def keyed(self) -> float:
        return self.gpumgr({"Idempotency-Key": str(uuid.uuid4())})

    def gpumgr(self, headers: dict[str, str] | None = None) -> float:
        body = {"image": IMAGE, "command": ["sleep", "300"], "gpu_memory": "1GiB", "labels": self.s.labels}
        t0 = time.perf_counter()
        reply = self.s.api.post("/v1/containers", json=body, timeout=90, headers=headers)
        dt = time.perf_counter() - t0
        if reply.status_code != 201 or reply.json()["state"] != "running":
            raise RuntimeError(f"POST /v1/containers answered {reply.status_code}: {reply.text}")
        record = reply.json()
        if not self.plain_delete:
            with contextlib.suppress(docker.errors.APIError):
                self.client.api.kill(record["container_id"])
        gone = self.s.api.delete(f"/v1/containers/{record['id']}", timeout=60)
        if gone.status_code != 200:
            raise RuntimeError(f"DELETE answered {gone.status_code}: {gone.text}")
        return dt

    def bare(self) -> float:
        t0 = time.perf_counter()
        container = self.client.containers.run(**self.args)
        dt = time.perf_counter() - t0
        container.remove(force=True)
        return dt

    def equivalent(self) -> float:
        api = self.client.api
        t0 = time.perf_counter()
        created = api.create_container(self.args["image"], self.args["command"], detach=True, labels=self.s.labels,
                                       host_config=api.create_host_config(network_mode="none"))
        api.start(created["Id"])
        dt = time.perf_counter() - t0
        api.remove_container(created["Id"], force=True)
        return dt

    def before(self) -> float:
        t0 = time.perf_counter()
        container = self.client.containers.create(**self.args)
        container.start()
        container.reload()
        dt = time.perf_counter() - t0
        container.remove(force=True)
        return dt


def run(args: argparse.Namespace, arms: list[str]) -> dict[str, list[float]]:
    """The timed rounds, each arm once per round (A, B(, C), A, B(, C) ...), after the warm-up rounds."""
    times: dict[str, list[float]] = {a: [] for a in arms}
    with stack(name="bench-rest") as s:
        trials = Trials(s, args.plain_delete)
        calls = {"gpumgr": trials.gpumgr, "keyed": trials.keyed, "bare": trials.bare,
                 "agent_equivalent": trials.equivalent, "agent_before": trials.before}
        for i in range(args.warmup + args.pairs):
            for arm in arms:
                dt = calls[arm]()
                if i >= args.warmup:
                    times[arm].append(dt)
                time.sleep(args.settle)
            if i >= args.warmup:
                print(f"  {i - args.warmup + 1:3}/{args.pairs}: "
                      + "  ".join(f"{a}={times[a][-1] * 1000:6.1f}ms" for a in arms), file=sys.stderr)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=30, help="timed rounds (each runs every arm once)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--settle", type=float, default=0.2, help="seconds of rest after each trial's cleanup")
    parser.add_argument("--no-equivalent", action="store_true", help="leave out arms C and D")
    parser.add_argument("--plain-delete", action="store_true", help="DELETE without killing first (5 s each)")
    parser.add_argument("--target", type=float, default=1.10, help="target median ratio gpumgr/bare")
    parser.add_argument("--keyed", action="store_true", help="add arm K: the POST with an Idempotency-Key")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    times = run(args, ["gpumgr"] + (["keyed"] if args.keyed else []) + ["bare"]
                + ([] if args.no_equivalent else ["agent_equivalent", "agent_before"]))
    stats: dict[str, dict[str, Any]] = {
        a: {f"{k}_ms": s[k] for k in ("median", "p90", "min", "max")} | {"samples_ms": [x * 1000 for x in v]}
        for a, v in times.items() for s in [summary(v, 1000)]}
    ratio = stats["gpumgr"]["median_ms"] / stats["bare"]["median_ms"]
    paired = median(a / b for a, b in zip(times["gpumgr"], times["bare"], strict=True))
    table([("arm", "38"), ("median ms", "10.1f"), ("p90 ms", "10.1f"), ("min ms", "10.1f"), ("max ms", "10.1f")],
          [[NAMES[arm], s["median_ms"], s["p90_ms"], s["min_ms"], s["max_ms"]] for arm, s in stats.items()],
          lead="\n")
    met = ratio <= args.target
    print(f"\nmedian ratio A/B = {ratio:.3f} (median of per-pair ratios {paired:.3f}); "
          f"target <= {args.target:.2f} -> {'MET' if met else 'MISSED'}")
    if "keyed" in stats:
        print(f"median ratio K/A = {stats['keyed']['median_ms'] / stats['gpumgr']['median_ms']:.3f} (median of "
              f"per-pair ratios {median(k / a for k, a in zip(times['keyed'], times['gpumgr'], strict=True)):.3f})")
    if "agent_equivalent" in stats:
        print(f"median ratio A/C = {stats['gpumgr']['median_ms'] / stats['agent_equivalent']['median_ms']:.3f}, "
              f"C/B = {stats['agent_equivalent']['median_ms'] / stats['bare']['median_ms']:.3f}, "
              f"D/B = {stats['agent_before']['median_ms'] / stats['bare']['median_ms']:.3f}")
    save(args.json, "rest_overhead", args, results=stats, median_ratio=ratio, median_paired_ratio=paired,
         target_ratio=args.target, target_met=met)
    return 0


if __name__ == "__main__":
    sys.exit(main())
