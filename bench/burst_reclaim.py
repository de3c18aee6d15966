"""How long a request that needs a burster's bytes waits: from the reclaim to its placement, and its whole POST.

One manager and one agent with a single simulated 24 GiB GPU (``burst_min_runtime`` 0). Each round starts
a burster (4 GiB request, 12 GiB limit) using 10 GiB, waits until the map shows its burst, then POSTs a
16 GiB request, which fits only once the burster is reclaimed. Measured per round, from the manager's
events: the reclaim (the burster's ``preempted`` event) to the request's ``placed`` event; and the POST's
own latency (sent to answered 201, running). The request is then removed for the next round.

    python bench/burst_reclaim.py --rounds 20
"""

from __future__ import annotations

import argparse
import time

from harness import Stack, machine, machine_line, save, stack, summary, table, wait_for

GiB = 1 << 30


def one_round(s: Stack) -> tuple[float, float]:
    """(reclaim → placed, POST latency), in seconds."""
    burster = s.create_using(4 * GiB, 10 * GiB, gpu_memory_limit=12 * GiB)
    uuid = burster["gpus"][0]["uuid"]

    def burst_seen() -> bool:
        gpus = [g for n in s.api.get("/v1/nodes").json()["nodes"] for g in n["gpus"]]
        return any(g["uuid"] == uuid and g["memory_burst"] == 6 * GiB for g in gpus)

    wait_for(burst_seen, 10, what="the burst on the map")
    since = max((e["id"] for e in s.events()), default=0)
    sent = time.monotonic()
    placed = s.create_using(16 * GiB, 0)
    latency = time.monotonic() - sent
    events = s.events(since)
    reclaimed = next(e["time"] for e in events if e["type"] == "preempted" and e["container"] == burster["id"])
    landed = next(e["time"] for e in events if e["type"] == "placed" and e["container"] == placed["id"])
    s.api.delete(f"/v1/containers/{placed['id']}")
    return landed - reclaimed, latency


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    gaps, posts = [], []
    with stack(1, name="burst", gpus="sim:1x24GiB", manager_env={"GPUMGR_BURST_MIN_RUNTIME": "0"}) as s:
        for _ in range(args.rounds):
            gap, post = one_round(s)
            gaps.append(gap)
            posts.append(post)
    info = machine()
    rows = [(what, *(summary(values, 1000)[k] for k in ("median", "p90", "p99", "max")))
            for what, values in (("reclaim → placed", gaps), ("POST, sent → 201", posts))]
    print(f"{args.rounds} rounds on {machine_line(info)}")
    table([("", "18"), ("median ms", "10.1f"), ("p90 ms", "8.1f"), ("p99 ms", "8.1f"), ("max ms", "8.1f")], rows)
    save(args.json, "burst_reclaim", args, reclaim_to_placed=gaps, post=posts, machine=info)


if __name__ == "__main__":
    main()
