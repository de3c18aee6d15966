"""Fair share end to end (issue 34): a preemptible burst of one account fills an idle cluster; a second account
arrives and gets back exactly its fair share by reclaim, soon after the borrowers' minimum runtime.

Real parts: a ``gpumgr manager`` process with ``accounts:`` in its YAML, two ``gpumgr agent`` processes driving
the Docker engine on simulated GPUs, real containers stopped by reclaim, and the invariant at the end.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import yaml

from tests.invariant import settles
from tests.procs import AgentProc, wait_for
from tests.test_tenants import ALICE, BOB, OPERATOR, Client, operator_manager

GiB = 1 << 30
MIN_RUNTIME = 2
ACCOUNTS = {
    "research": {"quota": {"gpu_memory": "8GiB"}, "over_quota_weight": 3, "reclaim_min_runtime": MIN_RUNTIME},
    "prod": {"quota": {"gpu_memory": "8GiB"}, "over_quota_weight": 1, "reclaim_min_runtime": MIN_RUNTIME},
}


@pytest.fixture
def cluster(tmp_path: Path, test_image, cleanup_containers):
    """A manager with accounts research (alice) and prod (bob), and two agents with two 8 GiB GPUs each."""
    config = tmp_path / "manager.yaml"
    config.write_text(yaml.safe_dump({"token": OPERATOR, "accounts": ACCOUNTS, "tenants": {
        "alice": {"token": ALICE, "account": "research"}, "bob": {"token": BOB, "account": "prod"}}}))
    manager = operator_manager(tmp_path, config, env={"GPUMGR_QUEUE_AGING": "3600"})
    agents = [AgentProc(tmp_path, manager, f"share-{n}", gpus="sim:2x8GiB") for n in range(2)]
    yield manager
    for agent in agents:
        agent.stop()
    manager.stop()


def ask(client: Client, image: str, count: int) -> list[str]:
    """``count`` preemptible 4 GiB requests that wait for room; their ids."""
    ids = []
    for _ in range(count):
        answer = client.call("POST", "/v1/containers", json={
            "image": image, "gpu_memory": "4GiB", "preemptible": True, "queue": True,
            "command": ["sh", "-c", "trap 'exit 0' TERM; while :; do sleep 1; done"]})
        assert answer.status_code in (201, 202), answer.text
        ids.append(answer.json()["id"])
    return ids


def held(operator: Client) -> dict[str, int]:
    """Each account's allocated bytes, as GET /v1/accounts says."""
    return {a["name"]: a["allocated"] for a in operator.call("GET", "/v1/accounts").json()["accounts"]}


def test_a_burst_fills_the_cluster_and_the_second_account_reclaims_exactly_its_fair_share(
        cluster, test_image, docker_client) -> None:
    manager = cluster
    operator, alice, bob = Client(manager, OPERATOR), Client(manager, ALICE), Client(manager, BOB)
    burst = ask(alice, test_image, 8)  # 32 GiB: the whole idle cluster, 24 GiB of it borrowed
    wait_for(lambda: held(operator)["research"] == 32 * GiB, 60, what="the burst running")
    records = [alice.call("GET", f"/v1/containers/{c}").json() for c in burst]
    assert sum(r["over_quota"] for r in records) == 6 and {r["account"] for r in records} == {"research"}
    started = time.monotonic()
    arrivals = ask(bob, test_image, 8)
    # fair shares: quotas 8 + 8 GiB, the 16 GiB surplus 3:1, so research 20 GiB and prod 12 GiB
    shares = {a["name"]: a["fair_share"] for a in operator.call("GET", "/v1/accounts").json()["accounts"]}
    assert shares["research"] == 20 * GiB and shares["prod"] == 12 * GiB
    wait_for(lambda: held(operator)["prod"] == 12 * GiB, MIN_RUNTIME + 30, what="prod's fair share")
    took = time.monotonic() - started
    assert held(operator)["research"] == 20 * GiB
    victims = [r for c in burst if (r := operator.call("GET", f"/v1/containers/{c}").json())["state"] == "preempted"]
    assert len(victims) == 3
    for victim in victims:
        assert victim["reason"] == "reclaimed" and victim["reclaimed_for_account"] == "prod"
        assert victim["over_quota"] and victim["preempted_for"] in arrivals
        assert victim["container_id"] not in {c.id for c in docker_client.containers.list()}
    # settled: nothing more is reclaimed while both keep asking
    time.sleep(3 * MIN_RUNTIME)
    assert held(operator) == {"research": 20 * GiB, "prod": 12 * GiB, "default": 0}
    reclaimed = [e for e in operator.call("GET", "/v1/events", params={"type": "preempted"}).json()["events"]
                 if e.get("final")]
    assert len(reclaimed) == 3
    print(f"prod reached its fair share {took:.1f}s after asking (reclaim_min_runtime {MIN_RUNTIME}s)")
    settles(manager, docker_client, {"share-0", "share-1"})


def test_sighup_reloads_the_accounts_and_a_tree_that_cannot_be_applied_keeps_them(cluster, tmp_path) -> None:
    manager = cluster
    operator = Client(manager, OPERATOR)
    config = tmp_path / "manager.yaml"
    settings = yaml.safe_load(config.read_text())
    settings["accounts"]["prod"]["over_quota_weight"] = 5
    config.write_text(yaml.safe_dump(settings))
    manager.popen.send_signal(signal.SIGHUP)

    def weight() -> float:
        return next(a for a in operator.call("GET", "/v1/accounts").json()["accounts"]
                    if a["name"] == "prod")["over_quota_weight"]

    wait_for(lambda: weight() == 5, 10, what="the new weight")
    digest = manager.get("/healthz").json().get("tenants_digest")
    settings["tenants"]["bob"]["account"] = "nowhere"
    config.write_text(yaml.safe_dump(settings))
    manager.popen.send_signal(signal.SIGHUP)
    wait_for(lambda: "nowhere" in manager.output(), 10, what="the refusal logged")
    assert weight() == 5 and manager.get("/healthz").json().get("tenants_digest") == digest
