"""Three real managers on a three-member etcd: failover to the first placement, and what the etcd store costs.

Part 1, failover. A three-member etcd on loopback (``tests.etcd``), three ``gpumgr manager --store``
processes sharing one key pair and two ``gpumgr agent`` processes (process runtime, simulated GPUs)
given every manager's address (``tests.ha_procs``). Each trial waits until one manager leads with
both nodes ready on it, waits a random 0–1 s more (so the kill lands anywhere in the 1 s lease
renewal), ``kill -9``s the leader, and POSTs a placement to the two survivors in turn (a follower
holds a call while no one leads, then forwards it) until one answers 201: the figure is from the
signal to that 201. The killed manager is started again on its ports before the next trial.

Part 2, the store's cost on the placement path, the same run. One manager on its state directory
against the leader of the three on etcd, each with one agent (process runtime), in ``--rounds``
interleaved rounds: ``--sequential`` POSTs one after another (REST latency), then ``--burst`` POSTs
from 8 client threads (placements per second), all removed again between rounds (not timed). Also
POSTs through a follower (forwarded). etcd's revision is read before and after the etcd rounds:
every write transaction raises it by one, so its rise over the placements is the etcd writes per
placement (goal 0: a plain placement writes nothing; only queued requests, bindings, secret
rotation and one event-id block per 10,000 events do).

    python bench/ha_managers.py [--trials 20] [--rounds 3] [--sequential 40] [--burst 80] [--json out.json]
"""

from __future__ import annotations

import argparse
import logging
import random
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import interrupt, machine, machine_line, save, summary, table, wait_for
from gpumgr.manager.control.etcdv3 import b64
from tests.etcd import EtcdCluster
from tests.ha_procs import HaManager, HaManagers
from tests.procs import AgentProc, ManagerProc

BODY = {"command": ["sleep", "3600"], "gpu_memory": "64MiB"}
GPUS = "sim:4x80GiB"


def ready_on(manager: ManagerProc, count: int) -> bool:
    try:
        nodes = manager.get("/v1/nodes").json()["nodes"]
    except (requests.RequestException, ValueError, KeyError):
        return False
    return sum(1 for n in nodes if n["state"] == "ready") >= count


def first_201(survivors: list[HaManager], since: float) -> tuple[float, str]:
    """POST to the survivors in turn until one answers 201: (seconds since ``since``, the record id)."""
    turn = 0
    while True:
        manager = survivors[turn % len(survivors)]
        turn += 1
        try:
            answer = requests.post(manager.url + "/v1/containers", json=BODY, timeout=30)
        except requests.RequestException:
            continue
        if answer.status_code == 201:
            return time.monotonic() - since, answer.json()["id"]
        if time.monotonic() - since > 60:
            raise RuntimeError(f"no 201 within 60 s of the kill: {answer.status_code} {answer.text[:200]}")


def failover(ha: HaManagers, trials: int) -> list[float]:
    """Seconds from kill -9 of the leader to the first 201 through a surviving manager, per trial."""
    times: list[float] = []
    for trial in range(trials):
        leader = ha.leader()
        wait_for(lambda lead=leader: ready_on(lead, 2), 60, what="both nodes ready on the leader")
        time.sleep(random.uniform(0.0, 1.0))
        since = time.monotonic()
        leader.popen.send_signal(signal.SIGKILL)
        took, cid = first_201(ha.followers(leader), since)
        times.append(took)
        print(f"  trial {trial + 1:2d}: first 201 after {took:.3f} s", flush=True)
        leader.stop(signal.SIGKILL)
        ha.start(api_port=leader.api_port, agent_port=leader.agent_port)
        with_leader = ha.leader()
        with_leader.delete(f"/v1/containers/{cid}")
    return times


def revision(etcd: EtcdCluster) -> int:
    answer = etcd.client().call("/v3/kv/range", {"key": b64(b"/revision-probe")})
    return int(answer["header"]["revision"])


def placements(url: str, sequential: int, burst: int) -> tuple[list[float], float, list[str]]:
    """(latency of each sequential POST, placements per second of the burst, every id placed)."""
    session = requests.Session()
    latencies, ids = [], []
    for _ in range(sequential):
        start = time.perf_counter()
        answer = session.post(url + "/v1/containers", json=BODY, timeout=60)
        latencies.append(time.perf_counter() - start)
        if answer.status_code != 201:
            raise RuntimeError(f"{url}: {answer.status_code} {answer.text[:200]}")
        ids.append(answer.json()["id"])

    def one(_: int) -> str:
        answer = requests.post(url + "/v1/containers", json=BODY, timeout=60)
        if answer.status_code != 201:
            raise RuntimeError(f"{url}: {answer.status_code} {answer.text[:200]}")
        return str(answer.json()["id"])

    start = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        ids += list(pool.map(one, range(burst)))
    rate = burst / (time.perf_counter() - start)
    return latencies, rate, ids


def clear(url: str, ids: list[str]) -> None:
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda cid: requests.delete(f"{url}/v1/containers/{cid}", timeout=60), ids))


def costs(tmp: Path, etcd: EtcdCluster, ha: HaManagers, args: argparse.Namespace) -> dict[str, Any]:
    """Latency and placements/s per backend (and through a follower); etcd writes per placement."""
    solo = ManagerProc(tmp)
    agents = [AgentProc(tmp, solo, "bench-ha-solo", gpus=GPUS, runtime="process")]
    leader = ha.leader()
    agents.append(ha.agent("bench-ha-etcd", leader, gpus=GPUS, runtime="process"))
    follower = ha.followers(leader)[0]
    targets = {"state directory": solo.url, "etcd (3 members), leader": leader.url,
               "etcd (3 members), via a follower": follower.url}
    latency: dict[str, list[float]] = {name: [] for name in targets}
    rates: dict[str, list[float]] = {name: [] for name in targets}
    placed_on_etcd, writes = 0, 0
    try:
        for r in range(args.rounds):
            order = list(targets) if r % 2 == 0 else list(reversed(targets))
            for name in order:
                before = revision(etcd)
                lat, rate, ids = placements(targets[name], args.sequential, args.burst)
                if name != "state directory":
                    writes += revision(etcd) - before
                    placed_on_etcd += len(ids)
                latency[name] += lat
                rates[name].append(rate)
                clear(targets[name] if name == "state directory" else leader.url, ids)
                print(f"  round {r + 1} {name}: p50 {summary(lat, 1000)['p50']:.1f} ms, {rate:.1f} placements/s",
                      flush=True)
    finally:
        for agent in agents:
            agent.stop(signal.SIGKILL)
        solo.stop()
    return {"latency": latency, "rates": rates, "writes": writes, "placed": placed_on_etcd}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sequential", type=int, default=40)
    parser.add_argument("--burst", type=int, default=80)
    parser.add_argument("--json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    signal.signal(signal.SIGTERM, interrupt)  # a stopped run still stops its etcd, managers and agents
    info = machine()
    with tempfile.TemporaryDirectory(prefix="gpumgr-bench-ha-") as name:
        tmp = Path(name)
        etcd = EtcdCluster(tmp / "etcd", size=3)
        ha = HaManagers(tmp, etcd.endpoints, prefix="bench")
        agents: list[AgentProc] = []
        try:
            leader = ha.leader()
            agents = [ha.agent(f"bench-ha-{i}", leader, gpus=GPUS, runtime="process") for i in range(2)]
            print(f"failover, {args.trials} kills of the leader:", flush=True)
            times = failover(ha, args.trials)
            for agent in agents:
                agent.stop(signal.SIGKILL)
            agents = []
            print("placements, state directory against etcd:", flush=True)
            result = costs(tmp, etcd, ha, args)
        finally:
            for agent in agents:
                agent.stop(signal.SIGKILL)
            ha.stop()
            etcd.stop()
    kill = summary(times)
    table([("from kill -9 to the first 201", "30"), ("n", "3d"), ("p50 s", "7.3f"), ("p99 s", "7.3f"),
           ("min s", "7.3f"), ("max s", "7.3f")], [("kill -9 of the leader", kill["n"], kill["p50"], kill["p99"],
                                                     kill["min"], kill["max"])])
    base_lat = summary(result["latency"]["state directory"], 1000)["p50"]
    base_rate = sorted(result["rates"]["state directory"])[len(result["rates"]["state directory"]) // 2]
    rows = []
    for name, lat in result["latency"].items():
        s = summary(lat, 1000)
        rate = sorted(result["rates"][name])[len(result["rates"][name]) // 2]
        rows.append((name, s["p50"], s["p99"], s["p50"] / base_lat, rate, rate / base_rate))
    table([("backend", "34"), ("p50 ms", "8.1f"), ("p99 ms", "8.1f"), ("ratio", "6.2f"), ("placed/s", "9.1f"),
           ("ratio", "6.2f")], rows)
    per = result["writes"] / max(1, result["placed"])
    print(f"etcd writes: {result['writes']} over {result['placed']} placements = {per:.3f} per placement")
    print(machine_line(info))
    save(args.json, "ha_managers", args, machine=info, failover=times, kill=kill,
         latency={k: summary(v, 1000) for k, v in result["latency"].items()}, rates=result["rates"],
         writes=result["writes"], placed=result["placed"])


if __name__ == "__main__":
    main()
