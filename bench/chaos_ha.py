"""The HA chaos soak (``python bench/chaos.py --ha``): HA schedules one after another on one stack, under keyed load.

A three-member etcd, ``--managers`` ``gpumgr manager --store etcd://...`` processes and two real ``gpumgr
agent`` processes on the Docker engine (tests/chaos/ha.py). For ``--minutes``, episode after episode, a
schedule drawn by the seed among all of tests/chaos/ha.py's (a leader stopped, stopped twice, killed; one
etcd member or two down; an agent restarted; a mix of them overlapping) runs while ``--clients`` threads
POST (keyed, some queued), DELETE and PATCH through every manager; then the CI suite's checks
(tests/faults/test_chaos_ha.py) run after the heal. A stack whose episode failed is replaced (a new etcd
prefix, new node names) so the next episode starts clean; every failure is printed with its schedule.
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tests.chaos.ha import TEMPLATES, HaStack, Outcome, run_schedule, schedule
from tests.etcd import EtcdCluster
from tests.images import IMAGE, busybox_tar


def image(docker_client: Any) -> str:
    """The test image (busybox), imported as the test suite does if the engine lacks it."""
    import docker.errors

    try:
        docker_client.images.get(IMAGE)
    except docker.errors.ImageNotFound:
        repository, tag = IMAGE.rsplit(":", 1)
        docker_client.api.import_image_from_data(busybox_tar(), repository=repository, tag=tag)
    return IMAGE


def soak(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Run HA episodes for ``args.minutes`` and return the figures."""
    import docker

    client = docker.from_env()
    name = image(client)
    etcd = EtcdCluster(tmp / "etcd", size=3)
    rng, built, outcomes = random.Random(args.seed), 0, []
    stack: HaStack | None = None
    try:
        until = time.monotonic() + args.minutes * 60
        while time.monotonic() < until:
            if stack is None:
                built += 1
                stack = HaStack(tmp / f"soak{built}", etcd, f"hasoak{built}", [f"hasoak{built}-a", f"hasoak{built}-b"],
                                managers=args.managers, docker_client=client)
            plan = schedule(rng.choice(list(TEMPLATES)), rng.randrange(1 << 32), stack.nodes)
            outcome = run_schedule(stack, plan, name, client, clients=args.clients)
            outcomes.append(outcome)
            print(f"episode {len(outcomes)}: {plan} : {sum(outcome.told.answers.values())} calls, "
                  f"{len(outcome.problems)} problem(s)", flush=True)
            for problem in outcome.problems[:20]:
                print(f"  {problem}", flush=True)
            if outcome.problems:
                stack.stop()
                stack = None
            else:
                stack.clear(outcome.run)
    finally:
        if stack is not None:
            stack.stop()
        etcd.stop()
    return figures(outcomes)


def figures(outcomes: list[Outcome]) -> dict[str, Any]:
    """Episodes per schedule, the failed ones per schedule, and every answer the clients got."""
    answers: Counter[str] = Counter()
    for outcome in outcomes:
        answers.update(outcome.told.answers)
    return {
        "episodes": len(outcomes),
        "by_schedule": dict(Counter(o.schedule.name for o in outcomes)),
        "failed_by_schedule": dict(Counter(o.schedule.name for o in outcomes if o.problems)),
        "answers": dict(sorted(answers.items())),
        "failures": [{"schedule": str(o.schedule), "problems": o.problems[:20]} for o in outcomes if o.problems],
    }


def report(result: dict[str, Any]) -> list[str]:
    """Print the figures; return the episodes that failed."""
    runs = ", ".join(f"{n} {k}" for k, n in sorted(result["by_schedule"].items()))
    failed = ", ".join(f"{n} {k}" for k, n in sorted(result["failed_by_schedule"].items())) or "none"
    print(f"\n{result['episodes']} HA episodes ({runs}); failed: {failed}")
    print("answers: " + ", ".join(f"{k} ×{n:,}" for k, n in result["answers"].items()))
    return [f["schedule"] for f in result["failures"]]
